//! Parts of a chunk, each checked on its own against the chunk's id.
//!
//! A chunk's id is the BLAKE3 hash of its bytes: the root of a binary tree over its 1 KiB
//! blocks. A [`PART`] of a chunk (64 KiB at a multiple of 64 KiB from the chunk's start, the
//! last one possibly shorter) is a whole subtree of that tree, so its *chaining value* is one
//! of the tree's inner nodes. A reader given every part's chaining value merges them up to the
//! root exactly as BLAKE3 does ([`root`]); when the root equals the chunk's id, those values
//! are the chunk's own, and any part that arrives is checked by hashing it alone and comparing
//! with its value ([`part_cv`]). A sender can then send only the parts a reader needs (a load
//! that reshards reads a third of each tensor) with 32 bytes per part of the chunk added, and
//! every byte that arrives is still verified against the manifest's id.

use blake3::hazmat::{self, ChainingValue, HasherExt, Mode};

/// Bytes of a part: the parts shared chunks' ranges are checked in on the wire.
pub const PART: u64 = hotstart_proto::share::RANGE_PART;

/// Bytes of a chaining value.
pub const CV_LEN: usize = hotstart_proto::share::RANGE_VALUE_LEN as usize;

/// How many parts a chunk of `len` bytes has.
pub fn count(len: u64) -> usize {
    len.div_ceil(PART) as usize
}

/// Whether a chunk of `len` bytes has more than one part (a chunk of one part is checked
/// against its id alone).
pub fn splits(len: u64) -> bool {
    len > PART
}

/// The chaining value of part `i` of a chunk of more than one part, `bytes` being that part.
pub fn part_cv(i: usize, bytes: &[u8]) -> ChainingValue {
    part_hasher(i).update(bytes).finalize_non_root()
}

/// A hasher for part `i`, to be fed its bytes in order and finished with
/// [`HasherExt::finalize_non_root`].
pub fn part_hasher(i: usize) -> blake3::Hasher {
    let mut h = blake3::Hasher::new();
    h.set_input_offset(i as u64 * PART);
    h
}

/// Every part's chaining value of `chunk` (which has more than one part), in order.
pub fn cvs(chunk: &[u8]) -> Vec<ChainingValue> {
    chunk
        .chunks(PART as usize)
        .enumerate()
        .map(|(i, p)| part_cv(i, p))
        .collect()
}

/// A chunk's id and its parts' chaining values (none for a chunk of one part), from one pass
/// over its bytes: what hashing the chunk costs anyway.
pub fn id_and_values(chunk: &[u8]) -> (blake3::Hash, Vec<ChainingValue>) {
    let mut h = ChunkHasher::new(chunk.len() as u64);
    h.update(chunk);
    h.finish()
}

/// Hashes a chunk of known length fed in pieces of any size, keeping its parts' chaining
/// values on the way ([`id_and_values`]).
pub struct ChunkHasher {
    len: u64,
    done: u64,
    part: blake3::Hasher,
    values: Vec<ChainingValue>,
}

impl ChunkHasher {
    pub fn new(len: u64) -> ChunkHasher {
        ChunkHasher {
            len,
            done: 0,
            part: blake3::Hasher::new(),
            values: Vec::new(),
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        if !splits(self.len) {
            self.part.update(data);
            self.done += data.len() as u64;
            return;
        }
        while !data.is_empty() {
            let room = PART - self.done % PART;
            let n = (room as usize).min(data.len());
            self.part.update(&data[..n]);
            self.done += n as u64;
            data = &data[n..];
            if self.done.is_multiple_of(PART) && self.done < self.len {
                self.values.push(self.part.finalize_non_root());
                self.part = part_hasher(self.values.len());
            }
        }
    }

    /// The id and the values; an id that matches nothing when fewer or more bytes than the
    /// chunk's length came.
    pub fn finish(mut self) -> (blake3::Hash, Vec<ChainingValue>) {
        if !splits(self.len) {
            return (self.part.finalize(), Vec::new());
        }
        // The part in hand, unless no byte of it came.
        if self.done > self.values.len() as u64 * PART {
            self.values.push(self.part.finalize_non_root());
        }
        match root(&self.values, self.len).filter(|_| self.done == self.len) {
            Some(id) => (id, self.values),
            None => (blake3::Hash::from_bytes([0; 32]), Vec::new()),
        }
    }
}

/// The id of a chunk of `len` bytes whose parts have chaining values `cvs`; `None` when
/// there are not [`count`]`(len)` of them or the chunk has a single part.
pub fn root(cvs: &[ChainingValue], len: u64) -> Option<blake3::Hash> {
    if !splits(len) || cvs.len() != count(len) {
        return None;
    }
    let (left, right, left_len) = split(cvs, len);
    Some(hazmat::merge_subtrees_root(
        &subtree(left, left_len),
        &subtree(right, len - left_len),
        Mode::Hash,
    ))
}

/// The chaining value of the subtree of `len` bytes whose parts have `cvs`.
fn subtree(cvs: &[ChainingValue], len: u64) -> ChainingValue {
    if let [one] = cvs {
        return *one;
    }
    let (left, right, left_len) = split(cvs, len);
    hazmat::merge_subtrees_non_root(
        &subtree(left, left_len),
        &subtree(right, len - left_len),
        Mode::Hash,
    )
}

/// BLAKE3's split of a subtree of `len` bytes (more than one part): its left subtree is a
/// power of two of at least [`PART`] bytes, so it ends on a part's boundary.
fn split(cvs: &[ChainingValue], len: u64) -> (&[ChainingValue], &[ChainingValue], u64) {
    let left_len = hazmat::left_subtree_len(len);
    let (left, right) = cvs.split_at((left_len / PART) as usize);
    (left, right, left_len)
}

/// `cvs` as the bytes sent on the wire.
pub fn to_bytes(cvs: &[ChainingValue]) -> Vec<u8> {
    cvs.concat()
}

/// Chaining values from their bytes on the wire; `None` when the length is not a multiple of
/// [`CV_LEN`].
pub fn from_bytes(bytes: &[u8]) -> Option<Vec<ChainingValue>> {
    if !bytes.len().is_multiple_of(CV_LEN) {
        return None;
    }
    Some(
        bytes
            .chunks_exact(CV_LEN)
            .map(|c| c.try_into().expect("CV_LEN bytes"))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 10) as u8)
            .collect()
    }

    #[test]
    fn parts_merge_to_the_chunks_id_at_every_shape() {
        let p = PART as usize;
        // One part and a byte, powers of two, odd tails, and a full 64 MiB chunk's shape.
        for len in [
            p + 1,
            2 * p,
            2 * p + 1,
            3 * p,
            5 * p - 7,
            8 * p,
            13 * p + 1024,
            64 * p,
        ] {
            let chunk = bytes(len, len as u8);
            let cvs = cvs(&chunk);
            assert_eq!(cvs.len(), count(len as u64));
            assert_eq!(
                root(&cvs, len as u64),
                Some(blake3::hash(&chunk)),
                "{len} bytes"
            );
            // The same value, fed piece by piece across the part's boundaries.
            let last = cvs.len() - 1;
            let mut h = part_hasher(last);
            for piece in chunk[last * p..].chunks(1000) {
                h.update(piece);
            }
            assert_eq!(h.finalize_non_root(), cvs[last]);
            // One pass, fed in pieces that cross the parts' boundaries.
            let mut h = ChunkHasher::new(len as u64);
            for piece in chunk.chunks(40_000) {
                h.update(piece);
            }
            assert_eq!(h.finish(), (blake3::hash(&chunk), cvs.clone()));
        }
        // A chunk of one part: its id alone; too few bytes: an id that matches nothing.
        let small = bytes(1000, 3);
        assert_eq!(id_and_values(&small), (blake3::hash(&small), Vec::new()));
        let mut h = ChunkHasher::new(3 * PART);
        h.update(&bytes(2 * p, 1));
        assert_ne!(h.finish().0, blake3::hash(&bytes(2 * p, 1)));
    }

    #[test]
    fn a_changed_byte_or_value_no_longer_matches() {
        let len = 5 * PART as usize + 100;
        let chunk = bytes(len, 7);
        let id = blake3::hash(&chunk);
        let mut cvs = cvs(&chunk);
        // A part with one byte flipped has another value: the reader rejects it.
        let mut part = chunk[PART as usize..2 * PART as usize].to_vec();
        part[10] ^= 1;
        assert_ne!(part_cv(1, &part), cvs[1]);
        // The same bytes at another part's place have another value too.
        assert_ne!(part_cv(2, &chunk[PART as usize..2 * PART as usize]), cvs[1]);
        // A value that is not the chunk's no longer merges to its id.
        cvs[3][0] ^= 1;
        assert_ne!(root(&cvs, len as u64), Some(id));
        // Too few values, or a chunk of one part: no root.
        assert_eq!(root(&cvs[1..], len as u64), None);
        assert_eq!(root(&cvs[..1], PART), None);
        assert_eq!(from_bytes(&to_bytes(&cvs)), Some(cvs.clone()));
        assert_eq!(from_bytes(&[0; 33]), None);
    }
}
