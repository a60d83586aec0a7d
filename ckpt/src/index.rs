//! The step index: which steps and ranks a tier holds, from one listing, and the one rule for
//! when a step is complete. The engine (the latest step, retention after a save), `hotstart
//! ckpt ls/gc/verify` ([`crate::Checkpoints`]) and the sidecar (what its memory, its disk and
//! its peers hold) all decide completeness here.
//!
//! **The rule.** A step is complete for a world of `W` ranks when every rank `0..W` has its
//! data file and its manifest under their final names ([`StepEntry::committed`]: a save writes a
//! rank's manifest last, once its data file is in place), and every manifest the reader reads
//! is valid for its job, step and rank, names `W`, and records the length of the data file
//! listed beside it ([`manifest_fits`]). The engine reads one manifest (its own rank's, or rank
//! 0's to learn `W`); `hotstart ckpt` reads every rank's.

use std::collections::BTreeMap;

use crate::error::Result;
use crate::format::{self, Manifest, StepFile};
use crate::tier::Tier;

/// What a listing shows of one rank of one step (a rank whose only file is the temporary one
/// of an unfinished write has neither).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RankFiles {
    /// The manifest is under its final name.
    pub manifest: bool,
    /// The length of the data file under its final name, if there is one.
    pub data_len: Option<u64>,
}

/// What a listing shows of one step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepEntry {
    /// Every rank with a file of any kind.
    pub ranks: BTreeMap<u32, RankFiles>,
    /// Bytes of every file in the step's directory.
    pub bytes: u64,
}

impl StepEntry {
    /// The first half of the rule: every rank `0..world_size` committed its data file and its
    /// manifest.
    pub fn committed(&self, world_size: u32) -> bool {
        world_size > 0
            && (0..world_size).all(|r| {
                self.ranks
                    .get(&r)
                    .is_some_and(|f| f.manifest && f.data_len.is_some())
            })
    }
}

/// The steps of one job in one tier, ascending.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepIndex {
    steps: BTreeMap<u64, StepEntry>,
}

impl StepIndex {
    /// One listing of `job` in `tier`: every step, or only `step`.
    pub fn list(tier: &dyn Tier, job: &str, step: Option<u64>) -> Result<StepIndex> {
        let prefix = match step {
            Some(s) => format!("{}/", format::step_prefix(job, s)),
            None => format!("{job}/"),
        };
        let objects = tier.list_objects(&prefix)?;
        Ok(StepIndex::from_keys(
            job,
            objects.iter().map(|(k, len)| (k.as_str(), *len)),
        ))
    }

    /// The index of `job`'s keys among `objects` (key and length); other keys are ignored.
    pub fn from_keys<'a>(job: &str, objects: impl IntoIterator<Item = (&'a str, u64)>) -> Self {
        let mut index = StepIndex::default();
        for (key, len) in objects {
            let Some(k) = format::parse_key(key).filter(|k| k.job == job) else {
                continue;
            };
            let entry = index.steps.entry(k.step).or_default();
            entry.bytes += len;
            let rank = match k.file {
                StepFile::Data(r) | StepFile::Manifest(r) | StepFile::Partial(r) => r,
                StepFile::Other => continue,
            };
            let files = entry.ranks.entry(rank).or_default();
            match k.file {
                StepFile::Data(_) => files.data_len = Some(len),
                StepFile::Manifest(_) => files.manifest = true,
                _ => {}
            }
        }
        index
    }

    /// Records a rank that committed `step` (as a sidecar's memory holds it).
    pub fn insert_committed(&mut self, step: u64, rank: u32, data_len: u64) {
        let files = self
            .steps
            .entry(step)
            .or_default()
            .ranks
            .entry(rank)
            .or_default();
        files.manifest = true;
        files.data_len = Some(data_len);
    }

    /// Every step, ascending.
    pub fn steps(&self) -> impl DoubleEndedIterator<Item = (u64, &StepEntry)> {
        self.steps.iter().map(|(s, e)| (*s, e))
    }

    /// One step.
    pub fn get(&self, step: u64) -> Option<&StepEntry> {
        self.steps.get(&step)
    }

    /// The newest step that every rank of `world_size` committed, older than `below` if given.
    pub fn newest_committed(&self, world_size: u32, below: Option<u64>) -> Option<u64> {
        self.steps()
            .rev()
            .filter(|(s, _)| below.is_none_or(|b| *s < b))
            .find(|(_, e)| e.committed(world_size))
            .map(|(s, _)| s)
    }
}

/// The second half of the rule: a manifest read for `(job, step, rank)` counts when it is
/// valid for them (the caller parsed it with [`Manifest::parse_for`] or compared the three),
/// names `world_size`, and records the length of the data file listed beside it.
pub fn manifest_fits(m: &Manifest, world_size: u32, files: Option<&RankFiles>) -> bool {
    m.world_size == world_size && files.is_some_and(|f| f.data_len == Some(m.file_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_committed_when_every_rank_has_both_files() {
        let keys = [
            ("j/step-1/rank-0.safetensors", 10),
            ("j/step-1/rank-0.manifest.json", 2),
            ("j/step-1/rank-1.safetensors", 10),
            ("j/step-1/rank-1.manifest.json", 2),
            // Rank 1's manifest is missing; rank 0's data file too.
            ("j/step-2/rank-0.manifest.json", 2),
            ("j/step-2/rank-1.safetensors", 10),
            ("j/step-2/.rank-1.manifest.json.tmp-1-0", 1),
            ("j/step-3/rank-0.safetensors", 10),
            ("j/step-3/rank-0.manifest.json", 2),
            ("other/step-9/rank-0.manifest.json", 2),
            ("j/step-4/notes", 5),
        ];
        let index = StepIndex::from_keys("j", keys);
        assert_eq!(
            index.steps().map(|(s, _)| s).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        let one = index.get(1).unwrap();
        assert!(one.committed(2) && one.committed(1) && !one.committed(3));
        assert_eq!(one.bytes, 24);
        let two = index.get(2).unwrap();
        assert!(!two.committed(2) && !two.committed(1));
        assert_eq!(
            two.ranks[&1],
            RankFiles {
                manifest: false,
                data_len: Some(10)
            }
        );
        assert!(!index.get(4).unwrap().committed(1));
        assert_eq!(index.newest_committed(2, None), Some(1));
        assert_eq!(index.newest_committed(1, None), Some(3));
        assert_eq!(index.newest_committed(1, Some(3)), Some(1));
        assert_eq!(index.newest_committed(0, None), None);
    }
}
