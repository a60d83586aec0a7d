//! The on-storage format: names, the safetensors header, and the manifest.
//!
//! Per step and rank two objects (files on disk, objects in a store), under the job's prefix:
//!
//! ```text
//! <job>/step-<N>/rank-<R>.safetensors     8-byte LE header length n, n bytes of JSON header
//!                                         (padded with spaces so 8 + n is a multiple of 8), data
//! <job>/step-<N>/rank-<R>.manifest.json   written last: its presence is the rank's commit
//! ```
//!
//! **Writing.** [`Layout::new`] assigns each tensor a contiguous byte range in the order given
//! and renders the header by hand (names and metadata escaped by `serde_json`) so the file order
//! is the caller's. The manifest repeats the tensor index and adds what a reader needs to trust
//! the file without parsing it first: its length, the chunk size, and the blake3 of every chunk
//! (chunk `i` is bytes `i * chunk_size ..` of the whole file, header included).
//!
//! **Reading hostile bytes.** Every parser here takes bytes that may be anything. Lengths are
//! checked against the file length and a hard maximum *before* anything is allocated; every
//! offset and size is checked with overflow-free arithmetic; JSON is parsed by `serde_json`
//! (whose recursion limit stops deep nesting); nothing panics. The full layout is described in
//! `docs/FORMAT.md`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tensor::{Dtype, Extras, Tensor, byte_len};
pub use hotstart_proto::wire::Region;

/// What a reader of some regions needs of one chunk ([`Manifest::parts_for`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub chunk: usize,
    /// The chunk's [`crate::parts`] it needs, ascending, when not all of them.
    pub parts: Option<Vec<usize>>,
}

/// `format` field of every manifest.
pub const FORMAT_NAME: &str = "hotstart-ckpt";
/// Version of the manifest layout this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The engine that wrote a manifest.
pub const ENGINE_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Largest safetensors JSON header accepted (as the `safetensors` crate does).
pub const MAX_HEADER_LEN: u64 = 100 << 20;
/// Largest manifest accepted.
pub const MAX_MANIFEST_LEN: u64 = 100 << 20;

/// `<job>/step-<N>`.
pub fn step_prefix(job: &str, step: u64) -> String {
    format!("{job}/step-{step}")
}

/// `<job>/step-<N>/rank-<R>.safetensors`.
pub fn data_key(job: &str, step: u64, rank: u32) -> String {
    format!("{job}/step-{step}/rank-{rank}.safetensors")
}

/// `<job>/step-<N>/rank-<R>.manifest.json`.
pub fn manifest_key(job: &str, step: u64, rank: u32) -> String {
    format!("{job}/step-{step}/rank-{rank}.manifest.json")
}

/// The step of a directory name `step-<N>` (decimal digits only), or `None`.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// What a file in a step directory is, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepFile {
    /// `rank-<R>.safetensors`: a rank's committed data file.
    Data(u32),
    /// `rank-<R>.manifest.json`: a rank's manifest, the last file a save writes.
    Manifest(u32),
    /// `.rank-<R>.safetensors.tmp-*` or `.rank-<R>.manifest.json.tmp-*`: a write that has not
    /// been renamed into place (in progress, or left by a process killed mid-write).
    Partial(u32),
    /// Anything else.
    Other,
}

/// A key `<job>/step-<N>/<file>`, parsed: the inverse of [`data_key`] and [`manifest_key`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepKey<'a> {
    pub job: &'a str,
    pub step: u64,
    pub file: StepFile,
}

/// Parses a key of a step directory; `None` for a key that is not in one.
pub fn parse_key(key: &str) -> Option<StepKey<'_>> {
    let (dir, name) = key.rsplit_once('/')?;
    let (job, step_dir) = dir.rsplit_once('/')?;
    Some(StepKey {
        job,
        step: parse_step_dir(step_dir)?,
        file: parse_step_file(name),
    })
}

/// What the file `name` of a step directory is.
pub fn parse_step_file(name: &str) -> StepFile {
    let (partial, name) = match name.strip_prefix('.') {
        Some(rest) => match rest.split_once(".tmp-") {
            Some((inner, _)) => (true, inner),
            None => return StepFile::Other,
        },
        None => (false, name),
    };
    let Some(rest) = name.strip_prefix("rank-") else {
        return StepFile::Other;
    };
    let (digits, manifest) = if let Some(d) = rest.strip_suffix(".safetensors") {
        (d, false)
    } else if let Some(d) = rest.strip_suffix(".manifest.json") {
        (d, true)
    } else {
        return StepFile::Other;
    };
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return StepFile::Other;
    }
    match digits.parse() {
        Ok(rank) if partial => StepFile::Partial(rank),
        Ok(rank) if manifest => StepFile::Manifest(rank),
        Ok(rank) => StepFile::Data(rank),
        Err(_) => StepFile::Other,
    }
}

/// Checks a job name: `/`-separated components of `[A-Za-z0-9._-]`, none empty, `.` or `..`.
pub fn check_job(job: &str) -> Result<()> {
    let bad = |reason: &str| Error::Config {
        reason: format!("job name {job:?}: {reason}"),
    };
    if job.is_empty() || job.len() > 512 {
        return Err(bad("must be 1 to 512 bytes"));
    }
    for c in job.split('/') {
        if c.is_empty() || c == "." || c == ".." {
            return Err(bad("empty, '.' or '..' path component"));
        }
        if !c
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        {
            return Err(bad("only A-Z a-z 0-9 . _ - and / are allowed"));
        }
    }
    Ok(())
}

/// One tensor of the index: offsets are relative to the start of the data section, as in
/// safetensors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data_offsets: [u64; 2],
}

impl TensorEntry {
    /// Bytes of data.
    pub fn len(&self) -> u64 {
        self.data_offsets[1] - self.data_offsets[0]
    }

    /// True for a tensor with no bytes (a zero-size dimension).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where everything goes in one rank's safetensors file.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The first `data_offset` bytes of the file: length prefix, JSON, padding.
    pub header: Vec<u8>,
    pub tensors: Vec<TensorEntry>,
    pub file_len: u64,
}

impl Layout {
    /// Lays out `tensors` in the order given, with job, step and world size in `__metadata__`.
    /// Not the rank: the replicas of a data-parallel job then write byte-identical files, whose
    /// chunks hash the same, so nodes share them (the rank is in the file's name and manifest).
    pub fn new(job: &str, step: u64, world_size: u32, tensors: &[Tensor]) -> Result<Layout> {
        let input = |reason: String| Error::Input { step, reason };
        let mut seen = HashSet::with_capacity(tensors.len());
        let mut entries = Vec::with_capacity(tensors.len());
        let mut off = 0u64;
        for t in tensors {
            if t.name.is_empty() || t.name == "__metadata__" {
                return Err(input(format!("tensor name {:?} is reserved", t.name)));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(input(format!("tensor name {:?} given twice", t.name)));
            }
            let end = off + t.byte_len() as u64;
            entries.push(TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: [off, end],
            });
            off = end;
        }
        let json_str = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
        let mut json = String::from("{\"__metadata__\":{");
        let meta = [
            ("format", "pt".to_string()),
            ("hotstart.format_version", FORMAT_VERSION.to_string()),
            ("job", job.to_string()),
            ("step", step.to_string()),
            ("world_size", world_size.to_string()),
        ];
        for (i, (k, v)) in meta.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            json.push_str(&format!("{}:{}", json_str(k), json_str(v)));
        }
        json.push('}');
        for e in &entries {
            let shape: Vec<String> = e.shape.iter().map(u64::to_string).collect();
            json.push_str(&format!(
                ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                json_str(&e.name),
                e.dtype,
                shape.join(","),
                e.data_offsets[0],
                e.data_offsets[1]
            ));
        }
        json.push('}');
        while json.len() % 8 != 0 {
            json.push(' ');
        }
        if json.len() as u64 > MAX_HEADER_LEN {
            return Err(input(format!(
                "safetensors header of {} bytes exceeds {MAX_HEADER_LEN}",
                json.len()
            )));
        }
        let mut header = Vec::with_capacity(8 + json.len());
        header.extend_from_slice(&(json.len() as u64).to_le_bytes());
        header.extend_from_slice(json.as_bytes());
        let file_len = header.len() as u64 + off;
        Ok(Layout {
            header,
            tensors: entries,
            file_len,
        })
    }

    /// Where the data section starts in the file.
    pub fn data_offset(&self) -> u64 {
        self.header.len() as u64
    }
}

/// A parsed safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// `8 + n`: where the data section starts.
    pub data_offset: u64,
    pub metadata: BTreeMap<String, String>,
    /// Sorted by offset; contiguous from 0 to the end of the file.
    pub tensors: Vec<TensorEntry>,
}

/// Length of the header prefix (`8 + n`) announced by the first 8 bytes of a file of
/// `file_len` bytes, checked against the file length and [`MAX_HEADER_LEN`].
pub fn header_prefix_len(first8: &[u8], file_len: u64, location: &str) -> Result<u64> {
    let bad = |reason: String| Error::format("safetensors header", location, reason);
    let Some(n) = first8.get(..8) else {
        return Err(bad(format!(
            "file of {} bytes has no 8-byte length",
            first8.len()
        )));
    };
    let mut b = [0u8; 8];
    b.copy_from_slice(n);
    let n = u64::from_le_bytes(b);
    if n > MAX_HEADER_LEN {
        return Err(bad(format!("header length {n} exceeds {MAX_HEADER_LEN}")));
    }
    if n.saturating_add(8) > file_len {
        return Err(bad(format!(
            "header length {n} runs past the end of a {file_len}-byte file"
        )));
    }
    Ok(n + 8)
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Parses the header of a safetensors file of `file_len` bytes whose first bytes are `prefix`
/// (at least `8 + n` of them). Checks that every tensor's bytes fit its dtype and shape and that
/// the tensors tile the data section exactly.
pub fn parse_header(prefix: &[u8], file_len: u64, location: &str) -> Result<Header> {
    let bad = |reason: String| Error::format("safetensors header", location, reason);
    let data_offset = header_prefix_len(prefix, file_len, location)?;
    let Some(json) = prefix.get(8..data_offset as usize) else {
        return Err(bad(format!(
            "only {} header bytes given, {data_offset} needed",
            prefix.len()
        )));
    };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| bad(format!("header JSON: {e}")))?;
    let data_len = file_len - data_offset;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(map.len());
    for (name, v) in map {
        if name == "__metadata__" {
            metadata = serde_json::from_value(v).map_err(|e| bad(format!("__metadata__: {e}")))?;
            continue;
        }
        let raw: RawEntry =
            serde_json::from_value(v).map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
        let dtype: Dtype = raw
            .dtype
            .parse()
            .map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
        let [b, e] = raw.data_offsets;
        let want = byte_len(dtype, &raw.shape);
        if b > e || e > data_len || want != Some(e - b) {
            return Err(bad(format!(
                "tensor {name:?}: offsets {b}..{e} do not fit {dtype} {:?} in {data_len} data bytes",
                raw.shape
            )));
        }
        tensors.push(TensorEntry {
            name,
            dtype,
            shape: raw.shape,
            data_offsets: [b, e],
        });
    }
    tensors.sort_by_key(|t| (t.data_offsets[0], t.data_offsets[1]));
    let mut at = 0u64;
    for t in &tensors {
        if t.data_offsets[0] != at {
            return Err(bad(format!(
                "tensor {:?} starts at {}, expected {at}",
                t.name, t.data_offsets[0]
            )));
        }
        at = t.data_offsets[1];
    }
    if at != data_len {
        return Err(bad(format!("tensors cover {at} of {data_len} data bytes")));
    }
    Ok(Header {
        data_offset,
        metadata,
        tensors,
    })
}

/// A rank's commit record for one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub engine_version: String,
    pub job: String,
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    /// File name of the safetensors file, relative to the step directory.
    pub file: String,
    pub file_len: u64,
    /// `8 + n`: where the data section starts.
    pub data_offset: u64,
    pub chunk_size: u64,
    /// blake3 (hex) of each `chunk_size` piece of the whole file.
    pub chunks: Vec<String>,
    pub tensors: Vec<TensorEntry>,
    /// How `extras` values are encoded: always `"base64"` (standard alphabet, padded).
    pub extras_encoding: String,
    pub extras: BTreeMap<String, String>,
}

impl Manifest {
    /// A manifest for a file laid out by `layout` whose chunks hash to `chunks`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        job: &str,
        step: u64,
        rank: u32,
        world_size: u32,
        layout: &Layout,
        chunk_size: u64,
        chunks: &[blake3::Hash],
        extras: &Extras,
    ) -> Manifest {
        let b64 = base64::engine::general_purpose::STANDARD;
        Manifest {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            engine_version: ENGINE_VERSION.into(),
            job: job.into(),
            step,
            rank,
            world_size,
            file: format!("rank-{rank}.safetensors"),
            file_len: layout.file_len,
            data_offset: layout.data_offset(),
            chunk_size,
            chunks: chunks.iter().map(|h| h.to_hex().to_string()).collect(),
            tensors: layout.tensors.clone(),
            extras_encoding: "base64".into(),
            extras: extras
                .iter()
                .map(|(k, v)| (k.clone(), b64.encode(v)))
                .collect(),
        }
    }

    /// The manifest as pretty JSON.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising plain strings, integers and arrays cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Parses and validates a manifest.
    pub fn parse(bytes: &[u8], location: &str) -> Result<Manifest> {
        let bad = |reason: String| Error::format("manifest", location, reason);
        if bytes.len() as u64 > MAX_MANIFEST_LEN {
            return Err(bad(format!(
                "{} bytes exceeds {MAX_MANIFEST_LEN}",
                bytes.len()
            )));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        m.validate().map_err(bad)?;
        Ok(m)
    }

    /// Parses and validates a manifest that must have been written for `rank` of `world_size`
    /// in `job` at `step`.
    pub fn parse_for(
        bytes: &[u8],
        location: &str,
        job: &str,
        step: u64,
        rank: u32,
        world_size: u32,
    ) -> Result<Manifest> {
        let m = Manifest::parse(bytes, location)?;
        if m.job != job || m.step != step || m.rank != rank || m.world_size != world_size {
            return Err(Error::format(
                "manifest",
                location,
                format!(
                    "written for job {:?} step {} rank {} of {}",
                    m.job, m.step, m.rank, m.world_size
                ),
            ));
        }
        Ok(m)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT_NAME || self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format {:?} version {} is not {FORMAT_NAME:?} version {FORMAT_VERSION}",
                self.format, self.format_version
            ));
        }
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(format!(
                "rank {} of world size {}",
                self.rank, self.world_size
            ));
        }
        if self.file != format!("rank-{}.safetensors", self.rank) {
            return Err(format!(
                "file {:?} does not match rank {}",
                self.file, self.rank
            ));
        }
        if self.chunk_size == 0 {
            return Err("chunk size 0".into());
        }
        if self.data_offset < 8
            || self.data_offset > self.file_len
            || self.data_offset - 8 > MAX_HEADER_LEN
        {
            return Err(format!(
                "data offset {} does not fit a {}-byte file",
                self.data_offset, self.file_len
            ));
        }
        if self.chunks.len() as u64 != self.file_len.div_ceil(self.chunk_size) {
            return Err(format!(
                "{} chunk hashes for {} bytes in chunks of {}",
                self.chunks.len(),
                self.file_len,
                self.chunk_size
            ));
        }
        if let Some(bad) = self
            .chunks
            .iter()
            .position(|h| blake3::Hash::from_hex(h).is_err())
        {
            return Err(format!("chunk {bad}: not a blake3 hex digest"));
        }
        let data_len = self.file_len - self.data_offset;
        let mut at = 0u64;
        let mut names = HashSet::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let [b, e] = t.data_offsets;
            if !names.insert(t.name.as_str())
                || b != at
                || e < b
                || e > data_len
                || byte_len(t.dtype, &t.shape) != Some(e - b)
            {
                return Err(format!("tensor {:?}: bad name, offsets or shape", t.name));
            }
            at = e;
        }
        if at != data_len {
            return Err(format!("tensors cover {at} of {data_len} data bytes"));
        }
        if self.extras_encoding != "base64" {
            return Err(format!("extras encoding {:?}", self.extras_encoding));
        }
        self.decode_extras()?;
        Ok(())
    }

    /// The chunk hashes, decoded (valid after [`Manifest::parse`]).
    pub fn chunk_hashes(&self) -> Vec<blake3::Hash> {
        self.chunks
            .iter()
            .map(|h| blake3::Hash::from_hex(h).unwrap_or(blake3::Hash::from_bytes([0; 32])))
            .collect()
    }

    /// File byte range of tensor `t`'s data.
    pub fn tensor_range(&self, t: &TensorEntry) -> std::ops::Range<u64> {
        self.data_offset + t.data_offsets[0]..self.data_offset + t.data_offsets[1]
    }

    /// File byte range of chunk `i`.
    pub fn chunk_range(&self, i: usize) -> std::ops::Range<u64> {
        let start = (i as u64)
            .saturating_mul(self.chunk_size)
            .min(self.file_len);
        start..start.saturating_add(self.chunk_size).min(self.file_len)
    }

    /// The chunks a reader of `regions` needs, ascending: those that hold the file's header
    /// (it is parsed on every load) and those that the regions' bytes lie in. A region of a
    /// tensor the manifest does not list, or past its tensor's end, is an error (the reason).
    pub fn chunks_for(&self, regions: &[Region]) -> std::result::Result<Vec<usize>, String> {
        Ok(self
            .parts_for(regions)?
            .into_iter()
            .map(|n| n.chunk)
            .collect())
    }

    /// What a reader of `regions` needs of each chunk [`Manifest::chunks_for`] names: the whole
    /// chunk, or only some of its [`crate::parts`] (a chunk of more than one part of which not
    /// every part holds needed bytes).
    pub fn parts_for(&self, regions: &[Region]) -> std::result::Result<Vec<Need>, String> {
        let size = self.chunk_size.max(1);
        let mut need: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        let mut cover = |range: std::ops::Range<u64>| {
            let range = range.start.min(self.file_len)..range.end.min(self.file_len);
            let mut at = range.start;
            while at < range.end {
                let chunk = (at / size) as usize;
                let start = chunk as u64 * size;
                let end = (start + size).min(range.end);
                let first = ((at - start) / crate::parts::PART) as usize;
                let last = ((end - 1 - start) / crate::parts::PART) as usize;
                need.entry(chunk).or_default().extend(first..=last);
                at = end;
            }
        };
        cover(0..self.data_offset);
        let by_name: HashMap<&str, &TensorEntry> =
            self.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        for r in regions {
            let t = by_name
                .get(r.tensor.as_str())
                .ok_or_else(|| format!("no tensor {:?} in the checkpoint", r.tensor))?;
            let whole = self.tensor_range(t);
            let start = whole.start.checked_add(r.offset);
            match start.and_then(|s| s.checked_add(r.len).map(|e| s..e)) {
                Some(range) if range.end <= whole.end => cover(range),
                _ => {
                    return Err(format!(
                        "{} bytes at offset {} of tensor {:?} of {} bytes",
                        r.len,
                        r.offset,
                        r.tensor,
                        whole.end - whole.start
                    ));
                }
            }
        }
        Ok(need
            .into_iter()
            .filter(|(chunk, _)| *chunk < self.chunks.len())
            .map(|(chunk, parts)| {
                let len = self.chunk_range(chunk).end - self.chunk_range(chunk).start;
                let all = parts.len() == crate::parts::count(len);
                Need {
                    chunk,
                    parts: (!all).then(|| parts.into_iter().collect()),
                }
            })
            .collect())
    }

    /// The extras, decoded.
    pub fn decode_extras(&self) -> std::result::Result<Extras, String> {
        let b64 = base64::engine::general_purpose::STANDARD;
        self.extras
            .iter()
            .map(|(k, v)| {
                b64.decode(v)
                    .map(|v| (k.clone(), v))
                    .map_err(|e| format!("extra {k:?}: {e}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_keys_parse_strictly_and_invert_the_builders() {
        fn parsed(k: &str) -> Option<(&str, u64, StepFile)> {
            parse_key(k).map(|k| (k.job, k.step, k.file))
        }
        assert_eq!(
            parsed(&data_key("a/b", 12, 3)),
            Some(("a/b", 12, StepFile::Data(3)))
        );
        assert_eq!(
            parsed(&manifest_key("j", 1, 0)),
            Some(("j", 1, StepFile::Manifest(0)))
        );
        assert_eq!(
            parsed("j/step-1/.rank-7.safetensors.tmp-12-0"),
            Some(("j", 1, StepFile::Partial(7)))
        );
        assert_eq!(
            parsed("j/step-1/.rank-7.manifest.json.tmp-1-2"),
            Some(("j", 1, StepFile::Partial(7)))
        );
        for other in [
            "j/step-1/rank-.safetensors",
            "j/step-1/rank--1.manifest.json",
            "j/step-1/rank-3.json",
            "j/step-1/rank-99999999999.safetensors",
            "j/step-1/.rank-0.manifest.json",
            "j/step-1/notes.txt",
        ] {
            assert_eq!(parsed(other).map(|k| k.2), Some(StepFile::Other), "{other}");
        }
        for outside in [
            "step-1/rank-0.safetensors",
            "j/step-x/rank-0.safetensors",
            "j",
        ] {
            assert_eq!(parsed(outside), None, "{outside}");
        }
        // A file in a folder under a step directory is not one of the step's.
        assert_eq!(parsed("j/step-1/sub/rank-0.manifest.json"), None);
    }
}
