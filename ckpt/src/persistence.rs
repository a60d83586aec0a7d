//! The persistence core of one rank ([`Persistence`]): its tiers (disk, store), and what is
//! decided over them: which steps are complete (`crate::index`'s rule), retention after each
//! save and on demand (`crate::retention`'s plan), the sinks that write a staged file to every
//! tier (`crate::save`), and the verified reader that brings a step back (`crate::load`).
//!
//! An [`Engine`](crate::Engine) saves and loads through one; the sidecar (`hotstart serve`)
//! keeps one per job and rank it holds, and calls it directly: to persist a step it holds
//! ([`Persistence::persist_staged`]), to read one back into its memory
//! ([`Persistence::read_into`]) and to hand a step's file on this node's disk to a restarted
//! process ([`Persistence::open_local_file`]). Nothing here stages, admits, talks to a sidecar
//! or touches a GPU but through what the caller passes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use tracing::{info, warn};

use crate::engine::EngineConfig;
use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::index::{self, StepIndex};
use crate::retention;
use crate::staging;
use crate::tier::{Tier, TierKind};
use hotstart_store::uring::UringConfig;

/// One rank's checkpoints in its tiers: see the module docs.
pub struct Persistence {
    pub(crate) job: String,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) keep: usize,
    pub(crate) chunk_size: usize,
    pub(crate) threads: usize,
    /// Tiers in load order: disk first, then store.
    pub(crate) tiers: Vec<Arc<dyn Tier>>,
    /// Retention on the disk tier looks at this rank's files only (see [`Persistence::new`]).
    pub(crate) disk_per_rank: bool,
    /// This rank's writer's saves: shared by every engine of the process that holds the
    /// rank's owner lock (`crate::owner::writes`), which are one writer.
    pub(crate) writes: Arc<Writes>,
    /// How local files are read (a step's file handed over, see `open_local_file`).
    pub(crate) uring: UringConfig,
}

/// What retention needs to know of one writer's saves, whichever of its engines made them: a
/// step one engine is writing is neither old nor abandoned to another's retention.
#[derive(Debug, Default)]
pub(crate) struct Writes {
    /// Steps with saves running, and how many (a step saved again while its first save's
    /// thread still runs retention counts twice).
    persisting: Mutex<BTreeMap<u64, usize>>,
    /// When each step was last asked to be saved, in order (a counter and the step's number
    /// from it): a save of step S asked after one of T > S means the job went back to an older
    /// step (it restored one) and trains again.
    asked: Mutex<(u64, BTreeMap<u64, u64>)>,
    /// One retention at a time.
    gc: Mutex<()>,
}

impl std::fmt::Debug for Persistence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persistence")
            .field("job", &self.job)
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("tiers", &self.own_tiers())
            .finish_non_exhaustive()
    }
}

impl Persistence {
    /// The persistence of `cfg`'s job and rank over `tiers` (nearest first), which already
    /// exist: the engine opens its own, the sidecar shares one set among every rank it holds.
    /// With `disk_per_rank`, retention on the disk tier counts a step complete once this
    /// rank's manifest is there: a node's disk only ever holds its own ranks' files. The disk
    /// and store settings of `cfg` are not looked at.
    pub fn new(
        cfg: &EngineConfig,
        tiers: Vec<Arc<dyn Tier>>,
        disk_per_rank: bool,
    ) -> Result<Persistence> {
        format::check_job(&cfg.job)?;
        let bad = |reason: String| Err(Error::Config { reason });
        if cfg.world_size == 0 || cfg.rank >= cfg.world_size {
            return bad(format!(
                "rank {} of world size {}",
                cfg.rank, cfg.world_size
            ));
        }
        if cfg.chunk_size == 0 || cfg.chunk_size > (1 << 31) {
            return bad(format!("chunk size {} is not in 1..=2 GiB", cfg.chunk_size));
        }
        Ok(Persistence {
            job: cfg.job.clone(),
            rank: cfg.rank,
            world_size: cfg.world_size,
            keep: cfg.keep,
            chunk_size: cfg.chunk_size,
            threads: if cfg.threads == 0 {
                staging::default_threads()
            } else {
                cfg.threads
            },
            tiers,
            disk_per_rank,
            writes: Arc::default(),
            uring: cfg.uring.clone(),
        })
    }

    /// Steps complete in `tier` for this job: every rank's manifest present, and this rank's
    /// valid. Ascending; empty when `tier` is not one of this rank's.
    pub fn complete_steps(&self, tier: TierKind) -> Result<Vec<u64>> {
        let Some(t) = self.tier(tier) else {
            return Ok(Vec::new());
        };
        self.complete_steps_in(t)
    }

    /// The newest step complete in `tier` whatever world size saved it (older than `below`,
    /// if given), and that world size; `None` when `tier` is not one of this rank's.
    pub fn latest_checkpoint_in(
        &self,
        tier: TierKind,
        below: Option<u64>,
    ) -> Result<Option<(u64, u32)>> {
        let Some(t) = self.tier(tier) else {
            return Ok(None);
        };
        for step in t.list_steps(&self.job)?.into_iter().rev() {
            if below.is_some_and(|b| step >= b) {
                continue;
            }
            if let Some(ws) = self.saved_world_size(t, step)? {
                return Ok(Some((step, ws)));
            }
        }
        Ok(None)
    }

    /// The disk and store tiers of this rank, in load order.
    pub(crate) fn own_tiers(&self) -> Vec<TierKind> {
        self.tiers.iter().map(|t| t.kind()).collect()
    }

    /// The newest step complete in any of this rank's tiers (older than `below`, if
    /// given); see [`Persistence::newest_in_own_tiers`] for a tier that cannot be read.
    pub(crate) fn latest_in_own_tiers_below(&self, below: Option<u64>) -> Result<Option<u64>> {
        let complete = |t: &dyn Tier, step| {
            if below.is_some_and(|b| step >= b) {
                return Ok(None);
            }
            Ok(self.is_complete(t, step)?.then_some(()))
        };
        Ok(self.newest_in_own_tiers(complete)?.map(|(step, ())| step))
    }

    /// Whether `step` is complete in one of this rank's tiers (`crate::index`'s rule, for this
    /// rank's world size): a load of a step asked for by number takes no other, as one of the
    /// newest does not. A tier that cannot be read is an error unless another has the step
    /// complete.
    pub(crate) fn complete_in_own_tiers(&self, step: u64) -> Result<bool> {
        let mut unreadable = None;
        for t in &self.tiers {
            match self.is_complete(t.as_ref(), step) {
                Ok(true) => return Ok(true),
                Ok(false) => {}
                Err(e) => {
                    unreadable.get_or_insert((t.kind(), e));
                }
            }
        }
        match unreadable {
            Some((tier, e)) => Err(Error::unavailable(tier, &self.job, e)),
            None => Ok(false),
        }
    }

    /// The newest step of this job in any of this rank's tiers for which `found` says
    /// something, and what it said. Each tier's steps are tried newest first, stopping at the
    /// first found (or at one no newer than what another tier found already).
    ///
    /// A tier that cannot be read (a store that is down, a directory that cannot be listed) is
    /// an error ([`Error::Unavailable`]) unless a *nearer* tier found a step: every save
    /// commits to the nearer tiers first (`crate::save`), so a farther tier cannot hold a newer
    /// step than they do unless they were emptied (and then they hold none) or failed to
    /// persist it (a full disk: its error was on that save's handle). Never "no checkpoint"
    /// while a tier that might hold one cannot be read.
    fn newest_in_own_tiers<T>(
        &self,
        found: impl Fn(&dyn Tier, u64) -> Result<Option<T>>,
    ) -> Result<Option<(u64, T)>> {
        let mut best: Option<(u64, T)> = None;
        for t in &self.tiers {
            let newest = t.list_steps(&self.job).and_then(|steps| {
                for &step in steps.iter().rev() {
                    if best.as_ref().is_some_and(|(b, _)| *b >= step) {
                        break;
                    }
                    if let Some(v) = found(t.as_ref(), step)? {
                        return Ok(Some((step, v)));
                    }
                }
                Ok(None)
            });
            match newest {
                Ok(Some(n)) => best = Some(n),
                Ok(None) => {}
                Err(e) if best.is_some() => {
                    warn!(tier = %t.kind(), error = %e, "cannot list steps; a nearer tier holds a newer one")
                }
                Err(e) => return Err(Error::unavailable(t.kind(), &self.job, e)),
            }
        }
        Ok(best)
    }

    /// Records that `step` was asked to be saved now.
    pub(crate) fn start_persisting(&self, step: u64) {
        *self
            .writes
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(step)
            .or_default() += 1;
        let mut asked = self
            .writes
            .asked
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        asked.0 += 1;
        let n = asked.0;
        asked.1.insert(step, n);
    }

    /// Retention after the save of `step`: on every tier it reached (`persisted`), and on the
    /// disk tier whether it reached it or not. A disk that filled up (say, with steps kept while
    /// their upload to the store waited out an outage) frees space only through retention, and
    /// if only a successful write led to it, a full disk would stay full. A failed store is
    /// left alone: it is usually unreachable, and listing it would only retry.
    pub(crate) fn retention(&self, step: u64, persisted: Vec<&dyn Tier>) {
        let reached = |t: &dyn Tier| persisted.iter().any(|p| std::ptr::addr_eq(*p, t));
        for tier in self.tiers.iter().map(|t| t.as_ref()) {
            if !reached(tier) && tier.kind() != TierKind::Disk {
                continue;
            }
            if let Err(e) = self.gc_tier(tier, Some(step)) {
                warn!(step, tier = %tier.kind(), error = %e, "retention failed");
            }
        }
    }

    pub(crate) fn tier(&self, kind: TierKind) -> Option<&dyn Tier> {
        self.tiers
            .iter()
            .find(|t| t.kind() == kind)
            .map(|t| t.as_ref())
    }

    pub(crate) fn done_persisting(&self, step: u64) {
        let mut persisting = self
            .writes
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = persisting.get_mut(&step) {
            *n -= 1;
            if *n == 0 {
                persisting.remove(&step);
            }
        }
    }

    /// Whether `step` is complete in `tier` for this rank's world size (`crate::index`'s
    /// rule, with this rank's manifest the one read).
    pub(crate) fn is_complete(&self, tier: &dyn Tier, step: u64) -> Result<bool> {
        let index = StepIndex::list(tier, &self.job, Some(step))?;
        let Some(entry) = index.get(step).filter(|e| e.committed(self.world_size)) else {
            return Ok(false);
        };
        Ok(match self.read_manifest(tier, step) {
            Ok(Some(m)) => index::manifest_fits(&m, self.world_size, entry.ranks.get(&self.rank)),
            Ok(None) | Err(_) => false,
        })
    }

    /// This rank's manifest of `step` in `tier`: `None` when absent, an error when invalid or
    /// not this job's, step's or rank's.
    pub(crate) fn read_manifest(&self, tier: &dyn Tier, step: u64) -> Result<Option<Manifest>> {
        let key = format::manifest_key(&self.job, step, self.rank);
        let Some(bytes) = tier.get_manifest(&key)? else {
            return Ok(None);
        };
        let location = format!("{key} ({} tier)", tier.kind());
        let m = Manifest::parse_for(
            &bytes,
            &location,
            &self.job,
            step,
            self.rank,
            self.world_size,
        )?;
        Ok(Some(m))
    }

    /// `rank`'s manifest of `step` in `tier`, whatever world size wrote it: `None` when there
    /// is none of this job, step and rank, or it cannot be parsed (logged).
    fn manifest_of_any_world(
        &self,
        tier: &dyn Tier,
        step: u64,
        rank: u32,
    ) -> Result<Option<Manifest>> {
        let key = format::manifest_key(&self.job, step, rank);
        let Some(bytes) = tier.get_manifest(&key)? else {
            return Ok(None);
        };
        let location = format!("{key} ({} tier)", tier.kind());
        match Manifest::parse(&bytes, &location) {
            Ok(m) if m.job == self.job && m.step == step && m.rank == rank => Ok(Some(m)),
            Ok(_) => Ok(None),
            Err(e) => {
                warn!(step, tier = %tier.kind(), error = %e, "unusable manifest");
                Ok(None)
            }
        }
    }

    /// The world size that saved `step` in `tier` when the step is complete there for it
    /// (`crate::index`'s rule, with rank 0's manifest the one read: it names the world size).
    /// `None` when the step is not complete in `tier`.
    pub(crate) fn saved_world_size(&self, tier: &dyn Tier, step: u64) -> Result<Option<u32>> {
        let Some(m) = self.manifest_of_any_world(tier, step, 0)? else {
            return Ok(None);
        };
        let ws = m.world_size;
        let index = StepIndex::list(tier, &self.job, Some(step))?;
        let complete = index
            .get(step)
            .is_some_and(|e| e.committed(ws) && index::manifest_fits(&m, ws, e.ranks.get(&0)));
        Ok(complete.then_some(ws))
    }

    /// The newest step complete in one of this rank's tiers, whatever world size saved
    /// it, and that world size; with `below`, only steps older than it.
    pub(crate) fn latest_checkpoint_in_own_tiers(
        &self,
        below: Option<u64>,
    ) -> Result<Option<(u64, u32)>> {
        self.newest_in_own_tiers(|t, step| {
            if below.is_some_and(|b| step >= b) {
                return Ok(None);
            }
            self.saved_world_size(t, step)
        })
    }

    /// The error for a step this rank's world size cannot load because another world size
    /// saved it; `None` when that is not why.
    pub(crate) fn saved_by_another_world(&self, step: u64) -> Option<Error> {
        let saved = self.tiers.iter().find_map(|t| {
            self.saved_world_size(t.as_ref(), step)
                .ok()
                .flatten()
                .filter(|&ws| ws != self.world_size)
        })?;
        Some(self.another_world(step, saved))
    }

    /// The error for `step`, saved by `saved` ranks, asked for by this rank of its world size.
    pub(crate) fn another_world(&self, step: u64, saved: u32) -> Error {
        let (job, rank, world_size) = (&self.job, self.rank, self.world_size);
        Error::Config {
            reason: format!(
                "step {step} of job {job:?} was saved by {saved} ranks, and this is rank {rank} \
                 of {world_size}: a rank's file loads only into the same world size. Load it \
                 with torch.distributed.checkpoint (hotstart.torch.StorageReader reshards it to \
                 any world size), or open the engine with world size {saved}"
            ),
        }
    }

    pub(crate) fn complete_steps_in(&self, tier: &dyn Tier) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        for step in tier.list_steps(&self.job)? {
            if self.is_complete(tier, step)? {
                out.push(step);
            }
        }
        Ok(out)
    }

    /// Applies retention to every tier now (`Engine::gc`); the steps whose files of this rank
    /// were removed, per tier.
    pub fn gc(&self) -> Result<Vec<(TierKind, Vec<u64>)>> {
        self.tiers
            .iter()
            .map(|t| Ok((t.kind(), self.gc_tier(t.as_ref(), None)?)))
            .collect()
    }

    /// Retention on `tier`, after a save of `saved` reached it (`None`: `Engine::gc`).
    ///
    /// After a save of S, this rank's copies of steps newer than S that were asked for before
    /// S (or by an earlier process) are stale: the job went back to an older step and trains
    /// again, so they belong to a run it abandoned. They are removed (this rank's files only,
    /// never a step still persisting or asked for again since), and the rule of
    /// [`retention::plan`] applies to the rest: without this, the newest `keep` steps by number
    /// would be the abandoned ones, and retention would remove the step just saved.
    pub(crate) fn gc_tier(&self, tier: &dyn Tier, saved: Option<u64>) -> Result<Vec<u64>> {
        let _g = self
            .writes
            .gc
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.keep == 0 {
            return Ok(Vec::new());
        }
        let per_rank = self.disk_per_rank && tier.kind() == TierKind::Disk;
        let busy: BTreeSet<u64> = self
            .writes
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .copied()
            .collect();
        let stale = |s: u64| {
            let Some(saved) = saved.filter(|&saved| s > saved) else {
                return false;
            };
            let asked = self
                .writes
                .asked
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let order = |step: u64| asked.1.get(&step).copied();
            !busy.contains(&s) && order(s) < order(saved)
        };
        let mut steps = Vec::new();
        let mut removed = Vec::new();
        // Steps newer than the one saved, left by a run that went back to an older step: this
        // rank's files there, if it has any, are removed.
        let mut abandoned = Vec::new();
        // Complete steps that a larger world saved (a job that came back with fewer ranks):
        // their ranks this world does not have are removed with them by its last rank.
        let mut larger: BTreeMap<u64, u32> = BTreeMap::new();
        for s in tier.list_steps(&self.job)? {
            if stale(s) {
                tier.remove_rank(&self.job, s, self.rank)?;
                abandoned.push(s);
                continue;
            }
            let done = if per_rank {
                // A step that another world size saved is a kept step, not a torn one of this
                // world: this rank's manifest says so whatever world size wrote it, and a step
                // of a world too small to have this rank, complete on this disk, is one too.
                match self
                    .manifest_of_any_world(tier, s, self.rank)?
                    .map(|m| m.world_size)
                {
                    Some(ws) => {
                        if ws > self.world_size {
                            larger.insert(s, ws);
                        }
                        true
                    }
                    None => self
                        .saved_world_size(tier, s)?
                        .is_some_and(|ws| ws <= self.rank),
                }
            } else if self.is_complete(tier, s)? {
                true
            } else {
                // Complete for the world size that saved it counts as complete: not a torn
                // save of this world to clear away.
                let saved = self.saved_world_size(tier, s)?;
                if let Some(ws) = saved.filter(|&ws| ws > self.world_size) {
                    larger.insert(s, ws);
                }
                saved.is_some()
            };
            steps.push((s, done));
        }
        let plan = retention::plan(&steps, self.keep);
        for s in plan.removed {
            if !busy.contains(&s) {
                tier.remove_rank(&self.job, s, self.rank)?;
                // A node's disk holds the files of whichever of its ranks saved them: every
                // rank there removes those of the ranks this world does not have.
                if (per_rank || self.rank + 1 == self.world_size)
                    && let Some(&ws) = larger.get(&s)
                {
                    for r in self.world_size..ws {
                        tier.remove_rank(&self.job, s, r)?;
                    }
                }
                removed.push(s);
            }
        }
        if !removed.is_empty() || !abandoned.is_empty() {
            info!(tier = %tier.kind(), ?removed, ?abandoned, "retention removed old steps, and this rank's files of abandoned ones");
        }
        removed.extend(abandoned);
        Ok(removed)
    }
}
