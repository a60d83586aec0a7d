//! Traces and profiles: which chunks a job reads while it starts, over many runs.
//!
//! A [`Trace`] is one mount's record: the first demand of each chunk, with its time since the
//! mount started. A [`Profile`] is many traces merged: for each chunk (by content hash, so a
//! profile survives an image rebuild that keeps that content), its length, how many runs read
//! it, the last run that did, and its first-access times in recent runs. Profile order is the
//! **median** first-access time, so one odd run does not reorder the hot set. A chunk that
//! `decay_runs` runs in a row did not read drops out, so the profile follows the job as it
//! changes.
//!
//! **Encoding** (both): the 6 bytes `HSPROF` (or `HSTRCE`), a little-endian `u16` format
//! version, then one zstd frame of JSON. Decoding bounds the decompressed size.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::time::Duration;

use bytes::Bytes;
use hotstart_store::ChunkId;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::loader::FirstAccess;

/// The format version of profiles and traces written by this build.
pub const PROFILE_FORMAT: u16 = 1;
const PROFILE_MAGIC: &[u8; 6] = b"HSPROF";
const TRACE_MAGIC: &[u8; 6] = b"HSTRCE";
/// Largest decoded profile or trace accepted.
const MAX_DECODED: u64 = 256 << 20;
/// First-access samples kept per chunk for its median.
const SAMPLES: usize = 9;
/// Runs a chunk may go unread before it leaves the profile, by default.
pub const DEFAULT_DECAY_RUNS: u32 = 5;

/// One chunk of a profile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfileEntry {
    #[serde(rename = "i")]
    pub id: ChunkId,
    #[serde(rename = "n")]
    pub len: u32,
    /// Runs that read this chunk.
    #[serde(rename = "r")]
    pub runs: u32,
    /// The number of the last run (1-based, see [`Profile::runs`]) that read it.
    #[serde(rename = "l")]
    pub last_run: u64,
    /// First-access times in microseconds since mount, most recent runs last.
    #[serde(rename = "t")]
    pub offsets_us: Vec<u64>,
}

impl ProfileEntry {
    /// The median first-access time.
    pub fn median(&self) -> Duration {
        let mut v = self.offsets_us.clone();
        v.sort_unstable();
        Duration::from_micros(v.get(v.len() / 2).copied().unwrap_or(0))
    }
}

/// The merged hot set of a tree, in replay order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Profile {
    /// Runs merged so far.
    pub runs: u64,
    pub entries: Vec<ProfileEntry>,
}

/// One mount's first accesses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    pub run: String,
    /// Last time the trace was written, milliseconds since the Unix epoch.
    pub updated_ms: u64,
    /// Whether the mount has ended (a trace left unfinished was a crash, or is still running).
    pub finished: bool,
    /// (chunk, length, microseconds since mount), in access order.
    pub accesses: Vec<(ChunkId, u32, u64)>,
}

impl Trace {
    pub fn new(run: &str, accesses: &[FirstAccess], updated_ms: u64, finished: bool) -> Trace {
        Trace {
            run: run.to_string(),
            updated_ms,
            finished,
            accesses: accesses
                .iter()
                .map(|a| (a.id, a.len, a.offset.as_micros() as u64))
                .collect(),
        }
    }

    pub fn encode(&self) -> Result<Bytes> {
        encode(TRACE_MAGIC, self, "trace")
    }

    pub fn decode(key: &str, data: &[u8]) -> Result<Trace> {
        decode(TRACE_MAGIC, key, data, "trace")
    }
}

impl Profile {
    /// Total plaintext bytes of the profile's chunks.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.len as u64).sum()
    }

    /// Merges one run's trace: a new run number, every read chunk's count, last run and time
    /// updated, chunks unread for `decay_runs` runs dropped, and the order recomputed. A trace
    /// that read nothing (a mount whose job never started, or died before its first read) says
    /// nothing about what a start reads and is not a run: a few of them in a row would
    /// otherwise empty the profile.
    pub fn merge(&mut self, trace: &Trace, decay_runs: u32) {
        if trace.accesses.is_empty() {
            return;
        }
        self.runs += 1;
        let run = self.runs;
        let mut at: HashMap<ChunkId, usize> = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.id, i))
            .collect();
        for &(id, len, offset_us) in &trace.accesses {
            match at.get(&id) {
                Some(&i) => {
                    let e = &mut self.entries[i];
                    if e.last_run == run {
                        continue; // listed twice in one trace
                    }
                    e.runs += 1;
                    e.last_run = run;
                    e.len = len;
                    e.offsets_us.push(offset_us);
                    if e.offsets_us.len() > SAMPLES {
                        e.offsets_us.remove(0);
                    }
                }
                None => {
                    at.insert(id, self.entries.len());
                    self.entries.push(ProfileEntry {
                        id,
                        len,
                        runs: 1,
                        last_run: run,
                        offsets_us: vec![offset_us],
                    });
                }
            }
        }
        let decay = decay_runs.max(1) as u64;
        self.entries.retain(|e| run - e.last_run < decay);
        self.entries
            .sort_by_key(|e| (e.median(), std::cmp::Reverse(e.runs), e.id));
    }

    /// The chunks to prefetch for a tree holding `present`: profile order, chunks the tree no
    /// longer has left out, cut before the total passes `budget` bytes.
    pub fn plan(&self, present: &HashSet<ChunkId>, budget: u64) -> Vec<(ChunkId, u32)> {
        let mut total = 0u64;
        let mut out = Vec::new();
        for e in &self.entries {
            if !present.contains(&e.id) {
                continue;
            }
            total += e.len as u64;
            if total > budget {
                break;
            }
            out.push((e.id, e.len));
        }
        out
    }

    pub fn encode(&self) -> Result<Bytes> {
        encode(PROFILE_MAGIC, self, "profile")
    }

    pub fn decode(key: &str, data: &[u8]) -> Result<Profile> {
        decode(PROFILE_MAGIC, key, data, "profile")
    }
}

fn encode<T: Serialize>(magic: &[u8; 6], value: &T, what: &'static str) -> Result<Bytes> {
    let json = serde_json::to_vec(value).map_err(|e| Error::Format {
        what,
        key: String::new(),
        reason: e.to_string(),
    })?;
    let body = zstd::bulk::compress(&json, 6).map_err(|e| Error::io("compress", what, e))?;
    let mut out = Vec::with_capacity(8 + body.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&PROFILE_FORMAT.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(Bytes::from(out))
}

fn decode<T: serde::de::DeserializeOwned>(
    magic: &[u8; 6],
    key: &str,
    data: &[u8],
    what: &'static str,
) -> Result<T> {
    let bad = |reason: String| Error::Format {
        what,
        key: key.to_string(),
        reason,
    };
    if data.len() < 8 || &data[..6] != magic {
        return Err(bad("bad magic".into()));
    }
    let version = u16::from_le_bytes([data[6], data[7]]);
    if version != PROFILE_FORMAT {
        return Err(bad(format!(
            "format version {version}; this build reads version {PROFILE_FORMAT}"
        )));
    }
    let mut json = Vec::new();
    zstd::stream::read::Decoder::new(&data[8..])
        .map_err(|e| bad(format!("zstd: {e}")))?
        .take(MAX_DECODED + 1)
        .read_to_end(&mut json)
        .map_err(|e| bad(format!("zstd: {e}")))?;
    if json.len() as u64 > MAX_DECODED {
        return Err(bad(format!("decodes to more than {MAX_DECODED} bytes")));
    }
    serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> ChunkId {
        ChunkId::of(&[n])
    }

    fn trace(accesses: &[(u8, u64)]) -> Trace {
        Trace {
            accesses: accesses.iter().map(|&(n, t)| (id(n), 100, t)).collect(),
            ..Trace::default()
        }
    }

    #[test]
    fn merging_orders_by_median_and_decays() {
        let mut p = Profile::default();
        p.merge(&trace(&[(1, 10), (2, 20), (3, 30)]), 2);
        p.merge(&trace(&[(2, 5), (1, 40), (3, 30)]), 2);
        // An odd run puts 3 first; the median keeps it last.
        p.merge(&trace(&[(3, 1), (2, 6), (1, 41)]), 2);
        let order: Vec<ChunkId> = p.entries.iter().map(|e| e.id).collect();
        assert_eq!(order, [id(2), id(3), id(1)]);
        assert_eq!(p.runs, 3);
        assert!(p.entries.iter().all(|e| e.runs == 3));
        // Chunk 3 unread for two runs decays out; a new chunk comes in.
        p.merge(&trace(&[(1, 1), (2, 2), (4, 3)]), 2);
        assert!(p.entries.iter().any(|e| e.id == id(3)));
        p.merge(&trace(&[(1, 1), (2, 2), (4, 3)]), 2);
        let ids: HashSet<ChunkId> = p.entries.iter().map(|e| e.id).collect();
        assert_eq!(ids, [id(1), id(2), id(4)].into_iter().collect());
    }

    #[test]
    fn mounts_that_read_nothing_are_not_runs() {
        let mut p = Profile::default();
        p.merge(&trace(&[(1, 10), (2, 20)]), 2);
        let before = p.clone();
        for _ in 0..5 {
            p.merge(&trace(&[]), 2);
        }
        assert_eq!(p, before);
        // A run that reads something still decays what it did not read.
        p.merge(&trace(&[(1, 1)]), 2);
        p.merge(&trace(&[(1, 1)]), 2);
        assert_eq!(p.runs, 3);
        assert_eq!(p.entries.iter().map(|e| e.id).collect::<Vec<_>>(), [id(1)]);
    }

    #[test]
    fn plans_skip_missing_chunks_and_respect_the_budget() {
        let mut p = Profile::default();
        p.merge(&trace(&[(1, 1), (2, 2), (3, 3), (4, 4)]), 5);
        let present: HashSet<ChunkId> = [id(1), id(3), id(4)].into_iter().collect();
        assert_eq!(
            p.plan(&present, 1000),
            vec![(id(1), 100), (id(3), 100), (id(4), 100)]
        );
        assert_eq!(p.plan(&present, 250), vec![(id(1), 100), (id(3), 100)]);
    }

    #[test]
    fn encodings_round_trip_and_refuse_garbage() {
        let mut p = Profile::default();
        p.merge(&trace(&[(1, 1), (2, 2)]), 5);
        let enc = p.encode().unwrap();
        assert_eq!(Profile::decode("k", &enc).unwrap(), p);
        assert!(Profile::decode("k", b"HSPROF\x01\x00junk").is_err());
        assert!(
            Trace::decode("k", &enc).is_err(),
            "a profile is not a trace"
        );
        let mut future = enc.to_vec();
        future[6] = 7;
        let err = Profile::decode("k", &future).unwrap_err().to_string();
        assert!(err.contains("version 7"), "{err}");
    }
}
