//! Offline inspection of a checkpoint location: list steps, show a rank's index, verify every
//! chunk, and apply retention, without an [`Engine`](crate::Engine) (the `hotstart ckpt`
//! commands are thin wrappers around [`Checkpoints`]).
//!
//! **Opening.** A location is a store URL (`s3://`, `file://`, `memory://`, ...: the store tier)
//! or a plain directory (the disk tier, read through io_uring). Both hold the same layout.
//!
//! **Listing.** One listing of the job ([`StepIndex`]) gives every step and the files of each
//! rank (the committed data file and manifest, and on disk the hidden temporary files of
//! unfinished writes); every rank's manifest is read. A step is *complete* by
//! [`crate::index`]'s rule, which the engine and the sidecar apply too.
//!
//! **Verifying.** For each rank with a manifest the data file is read chunk by chunk with the
//! loader's own chunk reader and pool (`crate::load`: chunks spread over threads, one reader
//! per thread, each window hashed while the next is read) and every chunk's blake3 compared
//! with the manifest's; the safetensors header is parsed and must list the manifest's tensors.
//! Every problem is collected, naming step, rank and chunk, rather than stopping at the first.
//!
//! **Retention** ([`Checkpoints::gc`]) is the engine's rule applied to every rank at once: keep
//! the newest `keep` complete steps, remove older complete steps and incomplete steps older than
//! the newest complete one, leave newer incomplete steps alone (they may still be persisting).
//! Run it when no engine of the job is writing older steps.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hotstart_store::uring::{AlignedBuf, UringConfig};
use hotstart_store::{StoreUrl, StripeConfig};

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::index::{self, StepIndex};
use crate::load;
use crate::retention;
use crate::tier::disk::DiskTier;
use crate::tier::store::{Runtime, StoreTier};
use crate::tier::{Tier, TierReader};

/// Most absent ranks listed for one step.
const MAX_LISTED_RANKS: u32 = 1 << 16;

/// A checkpoint location opened for inspection.
pub struct Checkpoints {
    tier: Box<dyn Tier>,
    location: String,
    threads: usize,
}

impl fmt::Debug for Checkpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoints")
            .field("location", &self.location)
            .field("tier", &self.tier.kind())
            .finish_non_exhaustive()
    }
}

/// The state of one rank's manifest.
#[derive(Debug, Clone)]
pub enum ManifestState {
    Missing,
    /// Present but unusable: why.
    Invalid(String),
    Valid(Box<Manifest>),
}

/// One rank of one step as found in the listing.
#[derive(Debug, Clone)]
pub struct RankInfo {
    pub rank: u32,
    /// Size of the data file, `None` when absent.
    pub data_len: Option<u64>,
    pub manifest: ManifestState,
}

/// One step of a job.
#[derive(Debug, Clone)]
pub struct StepInfo {
    pub job: String,
    pub step: u64,
    /// From the first valid manifest.
    pub world_size: Option<u32>,
    /// Ranks seen in the listing or expected by the world size, ascending.
    pub ranks: Vec<RankInfo>,
    /// Bytes of every object of the step (temporary files included).
    pub bytes: u64,
    pub complete: bool,
}

impl StepInfo {
    /// Ranks whose manifest is valid and whose data file has the recorded length.
    pub fn committed_ranks(&self) -> usize {
        self.ranks.iter().filter(|r| rank_committed(r)).count()
    }

    /// Whether some rank's files were damaged or lost after that rank committed: a manifest
    /// that cannot be used, or a valid one whose data file is missing or of another length.
    /// A torn save (ranks without a manifest, the rest whole) is not damaged.
    pub fn damaged(&self) -> bool {
        self.ranks
            .iter()
            .any(|r| !matches!(r.manifest, ManifestState::Missing) && !rank_committed(r))
    }

    /// Why the step is incomplete, or `None` when it is complete.
    pub fn incomplete_reason(&self) -> Option<String> {
        if self.complete {
            return None;
        }
        let Some(ws) = self.world_size else {
            return Some("no valid manifest".into());
        };
        let bad: Vec<String> = self
            .ranks
            .iter()
            .filter(|r| r.rank < ws && !rank_committed(r))
            .map(|r| match (&r.manifest, r.data_len) {
                (ManifestState::Missing, _) => format!("rank {} has no manifest", r.rank),
                (ManifestState::Invalid(why), _) => format!("rank {}: {why}", r.rank),
                (ManifestState::Valid(_), None) => format!("rank {} has no data file", r.rank),
                (ManifestState::Valid(_), Some(_)) => {
                    format!("rank {}: data file length differs", r.rank)
                }
            })
            .collect();
        Some(bad.join("; "))
    }
}

fn rank_committed(r: &RankInfo) -> bool {
    match &r.manifest {
        ManifestState::Valid(m) => r.data_len == Some(m.file_len),
        _ => false,
    }
}

/// Something wrong found by [`Checkpoints::verify`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub step: u64,
    pub rank: u32,
    /// The chunk, when the problem is one chunk's.
    pub chunk: Option<usize>,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} rank {}", self.step, self.rank)?;
        if let Some(c) = self.chunk {
            write!(f, " chunk {c}")?;
        }
        write!(f, ": {}", self.reason)
    }
}

/// What [`Checkpoints::verify`] checked and found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// `(step, rank, chunks, bytes)` of every rank verified, bad or not.
    pub checked: Vec<(u64, u32, usize, u64)>,
    /// Steps skipped because they are incomplete (only when no step was asked for).
    pub skipped_incomplete: Vec<u64>,
    pub problems: Vec<Problem>,
}

impl VerifyReport {
    /// True when nothing is wrong.
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// What [`Checkpoints::gc`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Steps removed, ascending.
    pub removed: Vec<u64>,
    /// Complete steps kept, ascending.
    pub kept: Vec<u64>,
    /// Incomplete steps newer than the newest kept one, left alone (a save may still be
    /// writing them), ascending.
    pub pending: Vec<u64>,
}

impl Checkpoints {
    /// Opens `location`: a store URL (with `://`) or a local directory (the disk tier).
    pub fn open(location: &str) -> Result<Checkpoints> {
        let tier: Box<dyn Tier> = if location.contains("://") {
            let store = StoreUrl::parse(location)
                .and_then(|u| u.open())
                .map_err(|e| Error::store("open", location, e))?;
            let rt = Arc::new(Runtime::new()?);
            Box::new(StoreTier::new(
                store,
                rt,
                StripeConfig::default(),
                4,
                Duration::from_millis(100),
            ))
        } else {
            let root = PathBuf::from(location);
            if !root.is_dir() {
                return Err(Error::Config {
                    reason: format!(
                        "{} is not a directory: pass a checkpoint directory (a disk tier or a \
                         local store) or a store URL (s3://bucket/prefix, file:///path)",
                        root.display()
                    ),
                });
            }
            Box::new(DiskTier::new(root, UringConfig::default()))
        };
        Ok(Checkpoints {
            tier,
            location: location.to_string(),
            threads: std::thread::available_parallelism().map_or(4, |n| n.get().min(8)),
        })
    }

    /// The location as given.
    pub fn location(&self) -> &str {
        &self.location
    }

    /// Every job with at least one step directory, sorted.
    pub fn jobs(&self) -> Result<Vec<String>> {
        let objects = self.tier.list_objects("")?;
        let jobs: BTreeSet<String> = objects
            .iter()
            .filter_map(|(k, _)| format::parse_key(k).map(|k| k.job.to_string()))
            .collect();
        Ok(jobs.into_iter().collect())
    }

    /// Every step of `job`, ascending, with its ranks and completeness.
    pub fn steps(&self, job: &str) -> Result<Vec<StepInfo>> {
        format::check_job(job)?;
        let index = StepIndex::list(self.tier.as_ref(), job, None)?;
        let mut out = Vec::new();
        for (step, entry) in index.steps() {
            let mut infos: BTreeMap<u32, RankInfo> = BTreeMap::new();
            for (&rank, files) in &entry.ranks {
                let manifest = if files.manifest {
                    self.manifest_state(job, step, rank)
                } else {
                    ManifestState::Missing
                };
                infos.insert(
                    rank,
                    RankInfo {
                        rank,
                        data_len: files.data_len,
                        manifest,
                    },
                );
            }
            let world_size = infos.values().find_map(|i| match &i.manifest {
                ManifestState::Valid(m) => Some(m.world_size),
                _ => None,
            });
            // Ranks the world size expects that left no file at all (a hostile world size
            // cannot make this list huge).
            for rank in 0..world_size.unwrap_or(0).min(MAX_LISTED_RANKS) {
                infos.entry(rank).or_insert_with(|| RankInfo {
                    rank,
                    data_len: None,
                    manifest: ManifestState::Missing,
                });
            }
            // `crate::index`'s rule, with every rank's manifest read.
            let complete = world_size.is_some_and(|ws| {
                entry.committed(ws)
                    && (0..ws).all(|r| {
                        infos.get(&r).is_some_and(|i| {
                            matches!(&i.manifest, ManifestState::Valid(m)
                                if index::manifest_fits(m, ws, entry.ranks.get(&r)))
                        })
                    })
            });
            out.push(StepInfo {
                job: job.to_string(),
                step,
                world_size,
                ranks: infos.into_values().collect(),
                bytes: entry.bytes,
                complete,
            });
        }
        Ok(out)
    }

    /// The newest complete step of `job`.
    pub fn latest_complete(&self, job: &str) -> Result<Option<u64>> {
        Ok(self
            .steps(job)?
            .iter()
            .rev()
            .find(|s| s.complete)
            .map(|s| s.step))
    }

    /// The valid manifest of one rank of one step.
    pub fn manifest(&self, job: &str, step: u64, rank: u32) -> Result<Manifest> {
        format::check_job(job)?;
        match self.manifest_state(job, step, rank) {
            ManifestState::Valid(m) => Ok(*m),
            ManifestState::Missing => Err(Error::NotFound {
                job: job.to_string(),
                step: Some(step),
                rank,
            }),
            ManifestState::Invalid(reason) => Err(Error::format(
                "manifest",
                format::manifest_key(job, step, rank),
                reason,
            )),
        }
    }

    fn manifest_state(&self, job: &str, step: u64, rank: u32) -> ManifestState {
        let key = format::manifest_key(job, step, rank);
        let bytes = match self.tier.get_manifest(&key) {
            Ok(Some(b)) => b,
            Ok(None) => return ManifestState::Missing,
            Err(e) => return ManifestState::Invalid(e.to_string()),
        };
        match Manifest::parse(&bytes, &key) {
            Ok(m) if m.job != job || m.step != step || m.rank != rank => {
                ManifestState::Invalid(format!(
                    "written for job {:?} step {} rank {}",
                    m.job, m.step, m.rank
                ))
            }
            Ok(m) => ManifestState::Valid(Box::new(m)),
            Err(e) => ManifestState::Invalid(e.to_string()),
        }
    }

    /// Re-hashes every chunk of every rank of `step` (or of every complete step when `None`);
    /// see the module docs. Errors only when the location cannot be listed or `step` does not
    /// exist; what is wrong with the checkpoints is in the report.
    pub fn verify(&self, job: &str, step: Option<u64>) -> Result<VerifyReport> {
        let steps = self.steps(job)?;
        let mut report = VerifyReport::default();
        let selected: Vec<&StepInfo> = match step {
            Some(s) => {
                let Some(info) = steps.iter().find(|i| i.step == s) else {
                    return Err(Error::NotFound {
                        job: job.to_string(),
                        step: Some(s),
                        rank: 0,
                    });
                };
                vec![info]
            }
            // Every step but the torn saves: a step some rank committed (its manifest is
            // written last) whose files were damaged or lost since is damage, not a save that
            // never finished, and is checked.
            None => {
                report.skipped_incomplete = steps
                    .iter()
                    .filter(|s| !s.complete && !s.damaged())
                    .map(|s| s.step)
                    .collect();
                steps.iter().filter(|s| s.complete || s.damaged()).collect()
            }
        };
        for info in selected {
            let problem = |rank: u32, reason: String| Problem {
                step: info.step,
                rank,
                chunk: None,
                reason,
            };
            for r in &info.ranks {
                match (&r.manifest, r.data_len) {
                    (ManifestState::Valid(m), Some(len)) if len == m.file_len => {
                        report
                            .checked
                            .push((info.step, r.rank, m.chunks.len(), m.file_len));
                        report.problems.extend(self.verify_rank(job, m));
                    }
                    (ManifestState::Valid(_), None) => report.problems.push(problem(
                        r.rank,
                        "no data file, though its manifest is there: lost or deleted".into(),
                    )),
                    (ManifestState::Valid(m), Some(len)) => report.problems.push(problem(
                        r.rank,
                        format!(
                            "the data file has {len} bytes where its manifest says {}: cut \
                             short or replaced",
                            m.file_len
                        ),
                    )),
                    (ManifestState::Invalid(why), _) => {
                        report.problems.push(problem(r.rank, why.clone()))
                    }
                    (ManifestState::Missing, _) if info.world_size.is_none_or(|ws| r.rank < ws) => {
                        report.problems.push(problem(
                            r.rank,
                            "no manifest: this rank's save never committed".into(),
                        ))
                    }
                    // Files of a rank the world that saved the step does not have.
                    (ManifestState::Missing, _) => {}
                }
            }
        }
        Ok(report)
    }

    /// Every problem with one rank's data file.
    fn verify_rank<'s>(&'s self, job: &str, m: &Manifest) -> Vec<Problem> {
        let problem = |chunk: Option<usize>, reason: String| Problem {
            step: m.step,
            rank: m.rank,
            chunk,
            reason,
        };
        let key = format::data_key(job, m.step, m.rank);
        let hashes = m.chunk_hashes();
        let chunk_size = m.chunk_size as usize;
        let problems = Mutex::new(Vec::new());
        let push = |p: Problem| {
            problems
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(p)
        };
        // The header, then the chunks.
        match self.check_header(&key, m) {
            Ok(()) => {}
            Err(e) => push(problem(None, e.to_string())),
        }
        // The loader's chunk reader (each window hashed as the next is read) over its pool;
        // every chunk is checked, and every problem kept.
        let workers = self.threads.clamp(1, 8).min(hashes.len().max(1));
        let init = || (None, AlignedBuf::zeroed(chunk_size));
        let work = |(reader, buf): &mut (Option<Box<dyn TierReader + 's>>, AlignedBuf),
                    i: usize| {
            let reader = match reader {
                Some(r) => r,
                // Every worker would fail alike: one error stops them, reported once below.
                slot @ None => slot.insert(self.tier.reader(&key, m.file_len)?),
            };
            let range = m.chunk_range(i);
            let slice = &mut buf[..(range.end - range.start) as usize];
            match load::read_chunk(reader.as_mut(), range.start, slice) {
                Ok(got) if got != hashes[i] => push(problem(
                    Some(i),
                    format!(
                        "checksum mismatch in bytes {}..{} (manifest {}, file {})",
                        range.start,
                        range.end,
                        hashes[i].to_hex(),
                        got.to_hex()
                    ),
                )),
                Ok(_) => {}
                Err(e) => push(problem(Some(i), e.to_string())),
            }
            Ok(())
        };
        if let Err(e) = load::each_parallel(0..hashes.len(), workers, init, work, |_| Ok(())) {
            push(problem(None, e.to_string()));
        }
        let mut problems = problems
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        problems.sort_by_key(|p| p.chunk);
        problems
    }

    /// Parses the file's safetensors header and compares its index with the manifest's.
    fn check_header(&self, key: &str, m: &Manifest) -> Result<()> {
        let mut reader = self.tier.reader(key, m.file_len)?;
        let mut first8 = [0u8; 8];
        let n = first8.len().min(m.file_len as usize);
        reader.read_at(0, &mut first8[..n])?;
        let prefix_len = format::header_prefix_len(&first8[..n], m.file_len, key)?;
        let mut prefix = vec![0u8; prefix_len as usize];
        reader.read_at(0, &mut prefix)?;
        let header = format::parse_header(&prefix, m.file_len, key)?;
        let mut listed: Vec<_> = header.tensors.iter().collect();
        let mut expected: Vec<_> = m.tensors.iter().collect();
        listed.sort_by(|a, b| a.name.cmp(&b.name));
        expected.sort_by(|a, b| a.name.cmp(&b.name));
        if header.data_offset != m.data_offset || listed != expected {
            return Err(Error::format(
                "safetensors header",
                key,
                "tensor index differs from the manifest's",
            ));
        }
        Ok(())
    }

    /// The error for a job with no steps here: most likely a misspelt name.
    pub fn no_steps(&self, job: &str) -> Error {
        Error::Config {
            reason: format!(
                "job {job:?} has no steps at {}; `hotstart ckpt ls {}` lists the jobs there",
                self.location, self.location
            ),
        }
    }

    /// Applies retention to `job` on every rank; see the module docs. `keep` must be at least 1.
    pub fn gc(&self, job: &str, keep: usize) -> Result<GcReport> {
        let steps = self.steps(job)?;
        if steps.is_empty() {
            // A misspelt job name would otherwise read as a job with nothing to collect.
            return Err(self.no_steps(job));
        }
        let present: Vec<(u64, bool)> = steps.iter().map(|s| (s.step, s.complete)).collect();
        let plan = retention::plan(&present, keep);
        for info in steps.iter().filter(|s| plan.removed.contains(&s.step)) {
            for r in &info.ranks {
                self.tier.remove_rank(job, info.step, r.rank)?;
            }
        }
        let newest = plan.kept.last().copied().unwrap_or(0);
        let pending = present
            .iter()
            .filter(|&&(step, complete)| !complete && step > newest)
            .map(|&(step, _)| step)
            .collect();
        Ok(GcReport {
            removed: plan.removed,
            kept: plan.kept,
            pending,
        })
    }
}
