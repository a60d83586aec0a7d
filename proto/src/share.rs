//! Chunk sharing between the nodes of a job: the request a process (an environment restore, a
//! lazy image) sends its node's sidecar for a piece of a store object, and the same request
//! between sidecars.
//!
//! A **piece** is a byte range of one object of a store (a chunk's object, a range of an
//! environment's pack, a chunk of a checkpoint's file) together with what it must hold: the
//! ids of the frames it is made of, in order (zstd frames of a chunk store, or plaintext
//! chunks of a checkpoint). Its identity is its content ([`Piece::content_id`]), not where it is stored:
//! any node that holds those frames may serve it, and whoever receives it decodes every frame
//! and checks it against its id before using or passing on a byte.
//!
//! A piece may also be one range of a single plaintext frame (`within`: a piece of a large
//! checkpoint chunk, so that a chunk spreads through a job while it is still arriving). A
//! range starts at a multiple of [`RANGE_PART`], and is answered with the BLAKE3 chaining value
//! of each of its parts (a subtree of the chunk's hash tree) followed by its bytes: each part is
//! checked against its value as it arrives, and the values of every range of a chunk against
//! the chunk's id once all are in. No range is kept or passed on before that.

use serde::{Deserialize, Serialize};

/// One frame of a piece: the blake3 id of its plaintext (64 hex digits) and its stored length
/// (`None`: the rest of the piece, for a piece of one frame whose length is not known).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PieceFrame {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u32>,
}

/// A byte range of a store object and the frames it holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// What the piece is part of, for the metrics: `env`, `image`, `ckpt`, ... (at most 16
    /// lowercase letters).
    pub artifact: String,
    /// The store's URL, as the process opened it.
    pub store: String,
    /// The object's key in that store.
    pub key: String,
    /// Where the piece starts in the object.
    pub offset: u64,
    /// Its length (`None`: to the end of the object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// The frames it is made of, in order.
    pub frames: Vec<PieceFrame>,
    /// The frames are plaintext, each id the blake3 of its bytes (a checkpoint's chunks),
    /// rather than zstd frames of a chunk store.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw: bool,
    /// For a range of one raw frame: where the range starts in the frame. The one frame's
    /// `id` and `len` are then the whole frame's, `offset` and `len` the range's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<u64>,
}

/// Where a sidecar found a piece it answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PieceSource {
    /// Its own cache: a piece this node fetched before.
    Cache,
    /// A peer sidecar.
    Peer,
    /// The store, read by this sidecar.
    Store,
}

impl PieceSource {
    /// The name metrics and reports use.
    pub fn as_str(self) -> &'static str {
        match self {
            PieceSource::Cache => "cache",
            PieceSource::Peer => "peer",
            PieceSource::Store => "store",
        }
    }
}

/// A range of a frame starts at a multiple of this many bytes; each such part of it (the last
/// one possibly shorter) is answered with its 32-byte chaining value.
pub const RANGE_PART: u64 = 64 << 10;
/// Bytes of a chaining value.
pub const RANGE_VALUE_LEN: u64 = 32;

/// Largest number of frames one piece may name.
pub const MAX_PIECE_FRAMES: usize = 4096;
/// Largest piece, in stored bytes.
pub const MAX_PIECE_LEN: u64 = 64 << 20;

impl Piece {
    /// What is wrong with this request, if anything: an artifact name that is not one, no
    /// frames or too many, a length over [`MAX_PIECE_LEN`], frame lengths that do not add up
    /// to the piece's, an open-ended frame that is not the only one, a range that is not one
    /// of a single raw frame of known length.
    pub fn check(&self) -> Result<(), String> {
        let a = &self.artifact;
        if a.is_empty() || a.len() > 16 || !a.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(format!("artifact {a:?} is not 1 to 16 lowercase letters"));
        }
        if let Some(at) = self.within {
            let (Some(len), [frame], true) = (self.len, &self.frames[..], self.raw) else {
                return Err("a range must be of one raw frame, with its length".into());
            };
            if !is_hex_id(&frame.id) {
                return Err(format!("frame id {:?} is not 64 hex digits", frame.id));
            }
            let whole = frame.len.map_or(0, u64::from);
            return if len == 0 || len > MAX_PIECE_LEN || at.saturating_add(len) > whole {
                Err(format!(
                    "the range {at}+{len} is not within a frame of {whole} bytes"
                ))
            } else if !at.is_multiple_of(RANGE_PART) || whole <= RANGE_PART {
                Err(format!(
                    "a range starts at a multiple of {RANGE_PART} bytes of a larger frame, not {at} of {whole}"
                ))
            } else {
                Ok(())
            };
        }
        if self.frames.is_empty() || self.frames.len() > MAX_PIECE_FRAMES {
            return Err(format!(
                "{} frames (1 to {MAX_PIECE_FRAMES})",
                self.frames.len()
            ));
        }
        if let Some(f) = self.frames.iter().find(|f| !is_hex_id(&f.id)) {
            return Err(format!("frame id {:?} is not 64 hex digits", f.id));
        }
        let open = self.frames.iter().filter(|f| f.len.is_none()).count();
        match (self.len, open) {
            (None, 1) if self.frames.len() == 1 => Ok(()),
            (Some(len), 0) => {
                let sum: u64 = self
                    .frames
                    .iter()
                    .filter_map(|f| f.len)
                    .map(u64::from)
                    .sum();
                if len == 0 || len > MAX_PIECE_LEN {
                    Err(format!("length {len} (1 to {MAX_PIECE_LEN})"))
                } else if sum != len {
                    Err(format!("frames add up to {sum} bytes, not {len}"))
                } else {
                    Ok(())
                }
            }
            _ => Err("only a piece of one frame may leave its length open".into()),
        }
    }

    /// How many bytes answer this piece, when known: a range's parts' chaining values, then
    /// its bytes; any other piece's bytes.
    pub fn answer_len(&self) -> Option<u64> {
        let len = self.len?;
        Some(self.values_len().unwrap_or(0) + len)
    }

    /// For a range of a frame: the length of its parts' chaining values, which its answer
    /// starts with. `None` for other pieces.
    pub fn values_len(&self) -> Option<u64> {
        self.within?;
        Some(self.len?.div_ceil(RANGE_PART) * RANGE_VALUE_LEN)
    }

    /// The piece's identity: the blake3 of its frames' ids and lengths, in order. Two requests
    /// for the same bytes, wherever they are stored, have the same identity.
    pub fn content_id(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"hotstart piece v1");
        h.update(&[u8::from(self.raw)]);
        for f in &self.frames {
            h.update(f.id.as_bytes());
            h.update(&f.len.map_or(u64::MAX, u64::from).to_le_bytes());
        }
        if let Some(at) = self.within {
            h.update(b"within");
            h.update(&at.to_le_bytes());
            h.update(&self.len.unwrap_or(u64::MAX).to_le_bytes());
        }
        *h.finalize().as_bytes()
    }
}

fn is_hex_id(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(frames: &[(char, Option<u32>)], len: Option<u64>) -> Piece {
        Piece {
            artifact: "env".into(),
            store: "s3://b".into(),
            key: "k".into(),
            offset: 0,
            len,
            frames: frames
                .iter()
                .map(|&(c, len)| PieceFrame {
                    id: c.to_string().repeat(64),
                    len,
                })
                .collect(),
            raw: false,
            within: None,
        }
    }

    #[test]
    fn requests_are_checked_and_identified_by_content() {
        assert!(
            piece(&[('a', Some(3)), ('b', Some(4))], Some(7))
                .check()
                .is_ok()
        );
        assert!(piece(&[('a', None)], None).check().is_ok());
        let e = piece(&[('a', Some(3)), ('b', Some(4))], Some(8)).check();
        assert!(e.unwrap_err().contains("add up to 7"));
        assert!(piece(&[('a', None), ('b', None)], None).check().is_err());
        assert!(piece(&[('a', Some(3))], None).check().is_err());
        assert!(piece(&[], Some(1)).check().is_err());
        assert!(piece(&[('g', Some(1))], Some(1)).check().is_err());
        let mut p = piece(&[('a', None)], None);
        p.artifact = "Env!".into();
        assert!(p.check().is_err());
        // Identity is the content: another store or key, the same id.
        let a = piece(&[('a', Some(3)), ('b', Some(4))], Some(7));
        let mut b = a.clone();
        b.store = "s3://other".into();
        b.key = "elsewhere".into();
        b.offset = 99;
        assert_eq!(a.content_id(), b.content_id());
        let c = piece(&[('a', Some(4)), ('b', Some(3))], Some(7));
        assert_ne!(a.content_id(), c.content_id());
    }

    #[test]
    fn a_range_is_of_one_raw_frame_and_named_by_where_it_lies() {
        const K: u64 = RANGE_PART;
        let range = |at: u64, len: u64| {
            let mut p = piece(&[('a', Some(3 * K as u32))], Some(len));
            (p.raw, p.within, p.offset) = (true, Some(at), 1000 + at);
            p
        };
        assert!(range(0, 40).check().is_ok());
        assert!(range(2 * K, K).check().is_ok());
        assert!(
            range(2 * K, K + 1)
                .check()
                .unwrap_err()
                .contains("not within")
        );
        assert!(range(60, 40).check().unwrap_err().contains("multiple"));
        assert!(range(0, 0).check().is_err());
        let mut small = piece(&[('a', Some(K as u32))], Some(40));
        (small.raw, small.within) = (true, Some(0));
        assert!(small.check().unwrap_err().contains("larger frame"));
        // Answered with a value per part, then the bytes.
        assert_eq!(range(0, K + 1).answer_len(), Some(2 * 32 + K + 1));
        assert_eq!(piece(&[('a', Some(7))], Some(7)).answer_len(), Some(7));
        let mut not_raw = range(0, 40);
        not_raw.raw = false;
        assert!(not_raw.check().is_err());
        let mut open = range(0, 40);
        open.frames[0].len = None;
        assert!(open.check().is_err());
        let mut two = range(0, 40);
        two.frames.push(two.frames[0].clone());
        assert!(two.check().is_err());
        // Each range its own piece, none the whole frame's.
        let whole = piece(&[('a', Some(3 * K as u32))], Some(3 * K));
        let ids = [range(0, 40), range(K, 40), range(0, 20)].map(|p| p.content_id());
        assert!(ids[0] != ids[1] && ids[0] != ids[2] && ids[1] != ids[2]);
        assert!(!ids.contains(&whole.content_id()));
    }
}
