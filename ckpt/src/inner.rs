//! The shared state of one rank's engine ([`Inner`]): its configuration, tiers, staging pool,
//! admission, sidecar client and GPU contexts, which the engine's entry points (`crate::engine`),
//! the save pipeline (`crate::save`) and loads (`crate::load`) all work on; and what it decides
//! itself: which steps are complete, and retention after each save.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::{info, warn};

use crate::admission::Admission;
use crate::client::Client;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::handle::Shared;
use crate::index::{self, StepIndex};
use crate::owner::{self, OwnerLock};
use crate::retention;
use crate::staging::Pool;
use crate::tier::{Tier, TierKind};
use hotstart_store::uring::UringConfig;

/// The state every part of an engine shares.
pub(crate) struct Inner {
    pub(crate) job: String,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) keep: usize,
    pub(crate) chunk_size: usize,
    pub(crate) threads: usize,
    /// Whether a save waits for admission (`WhenFull::Block`) rather than being skipped.
    pub(crate) block: bool,
    /// The bound on saves in flight, for saves of either kind.
    pub(crate) admission: Arc<Admission>,
    /// Tiers in load order: disk first, then store. With a sidecar, only read when it cannot
    /// be reached.
    pub(crate) tiers: Vec<Arc<dyn Tier>>,
    /// Retention on the disk tier looks at this rank's files only (see `with_tiers`).
    pub(crate) disk_per_rank: bool,
    pub(crate) pool: Arc<Pool>,
    /// The sidecar that stages, persists and serves this rank's checkpoints, if any.
    pub(crate) sidecar: Option<Client>,
    pub(crate) skipped: AtomicU64,
    /// Steps with saves running, and how many (a step saved again while its first save's
    /// thread still runs retention counts twice).
    pub(crate) persisting: Mutex<BTreeMap<u64, usize>>,
    /// The handle of each step's save while it is unfinished (see [`Inner::claim`]).
    pub(crate) saving: Mutex<BTreeMap<u64, Arc<Shared>>>,
    /// When each step was last asked to be saved through this engine, in order (a counter and
    /// the step's number from it): a save of step S asked after one of T > S means the job
    /// went back to an older step (it restored one) and trains again.
    pub(crate) asked: Mutex<(u64, BTreeMap<u64, u64>)>,
    pub(crate) gc_lock: Mutex<()>,
    /// Per-device contexts and copy streams, made on first use.
    pub(crate) gpu: Arc<Gpu>,
    /// How files a sidecar hands over are read.
    pub(crate) uring: UringConfig,
    /// Where this rank's owner lock is taken (`crate::owner`), and the lock once the first save
    /// took it.
    pub(crate) owner_dir: Option<PathBuf>,
    /// `Some(None)`: the lock could not be made, and saves go on without it.
    pub(crate) owner: Mutex<Option<Option<Arc<OwnerLock>>>>,
}

impl Inner {
    /// Makes sure this engine is the one writer of its job and rank on this node: takes the
    /// owner lock on the first save (see `crate::owner`). A lock that cannot be made at all (a
    /// directory this process cannot write) is warned about once, and saves go on without it.
    pub(crate) fn own_rank(&self) -> Result<()> {
        let Some(dir) = &self.owner_dir else {
            return Ok(());
        };
        let mut owner = self.owner.lock().unwrap_or_else(PoisonError::into_inner);
        if owner.is_none() {
            *owner = match owner::acquire(dir, &self.job, self.rank) {
                Ok(lock) => Some(Some(lock)),
                Err(e @ Error::SecondWriter { .. }) => return Err(e),
                Err(e) => {
                    warn!(error = %e, "no owner lock: a second writer of this rank will not be detected");
                    Some(None)
                }
            };
        }
        Ok(())
    }

    /// The disk and store tiers of this engine itself, in load order.
    pub(crate) fn own_tiers(&self) -> Vec<TierKind> {
        self.tiers.iter().map(|t| t.kind()).collect()
    }

    /// The newest step complete in any of this engine's own tiers (older than `below`, if
    /// given); see [`Inner::newest_in_own_tiers`] for a tier that cannot be read.
    pub(crate) fn latest_in_own_tiers_below(&self, below: Option<u64>) -> Result<Option<u64>> {
        let complete = |t: &dyn Tier, step| {
            if below.is_some_and(|b| step >= b) {
                return Ok(None);
            }
            Ok(self.is_complete(t, step)?.then_some(()))
        };
        Ok(self.newest_in_own_tiers(complete)?.map(|(step, ())| step))
    }

    /// The newest step of this job in any of this engine's own tiers for which `found` says
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

    /// Claims `step` for the save whose handle is `shared`: refused while the handle of an
    /// earlier save of the same step is not finished (a step is written by one save at a time;
    /// once that save is over, a new one replaces it, see `crate::save`). The claim lasts as
    /// long as its handle is unfinished, so whoever waited for that handle may save again.
    pub(crate) fn claim(&self, step: u64, shared: &Arc<Shared>) -> Result<()> {
        let mut saving = self.saving.lock().unwrap_or_else(PoisonError::into_inner);
        saving.retain(|_, s| !s.status().all_finished());
        if saving.contains_key(&step) {
            return Err(Error::InFlight { step });
        }
        saving.insert(step, shared.clone());
        Ok(())
    }

    /// Gives up the claim of a save that did not start.
    pub(crate) fn unclaim(&self, step: u64) {
        self.saving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&step);
    }

    /// Records that `step` was asked to be saved now.
    pub(crate) fn start_persisting(&self, step: u64) {
        *self
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(step)
            .or_default() += 1;
        let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
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
            if let Err(e) = self.gc_tier_after(tier, Some(step)) {
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

    /// Whether `step` is complete in `tier` for this engine's world size (`crate::index`'s
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

    /// The world size that saved `step` in `tier` when the step is complete there for it
    /// (`crate::index`'s rule, with rank 0's manifest the one read: it names the world size).
    /// `None` when the step is not complete in `tier`.
    pub(crate) fn saved_world_size(&self, tier: &dyn Tier, step: u64) -> Result<Option<u32>> {
        let key = format::manifest_key(&self.job, step, 0);
        let Some(bytes) = tier.get_manifest(&key)? else {
            return Ok(None);
        };
        let location = format!("{key} ({} tier)", tier.kind());
        let m = match Manifest::parse(&bytes, &location) {
            Ok(m) if m.job == self.job && m.step == step && m.rank == 0 => m,
            Ok(_) => return Ok(None),
            Err(e) => {
                warn!(step, tier = %tier.kind(), error = %e, "unusable manifest");
                return Ok(None);
            }
        };
        let ws = m.world_size;
        let index = StepIndex::list(tier, &self.job, Some(step))?;
        let complete = index
            .get(step)
            .is_some_and(|e| e.committed(ws) && index::manifest_fits(&m, ws, e.ranks.get(&0)));
        Ok(complete.then_some(ws))
    }

    /// The newest step complete in one of this engine's own tiers, whatever world size saved
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

    /// The error for a step this engine's world size cannot load because another world size
    /// saved it; `None` when that is not why.
    pub(crate) fn saved_by_another_world(&self, step: u64) -> Option<Error> {
        let saved = self.tiers.iter().find_map(|t| {
            self.saved_world_size(t.as_ref(), step)
                .ok()
                .flatten()
                .filter(|&ws| ws != self.world_size)
        })?;
        Some(another_world(
            &self.job,
            step,
            saved,
            self.rank,
            self.world_size,
        ))
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

    /// Retention on one tier; the steps removed.
    pub(crate) fn gc_tier(&self, tier: &dyn Tier) -> Result<Vec<u64>> {
        self.gc_tier_after(tier, None)
    }

    /// Retention on `tier`, after a save of `saved` reached it (`None`: `hotstart ckpt gc`).
    ///
    /// After a save of S, this rank's copies of steps newer than S that were asked for before
    /// S (or by an earlier process) are stale: the job went back to an older step and trains
    /// again, so they belong to a run it abandoned. They are removed (this rank's files only,
    /// never a step still persisting or asked for again since), and the rule of
    /// [`retention::plan`] applies to the rest: without this, the newest `keep` steps by number
    /// would be the abandoned ones, and retention would remove the step just saved.
    pub(crate) fn gc_tier_after(&self, tier: &dyn Tier, saved: Option<u64>) -> Result<Vec<u64>> {
        let _g = self.gc_lock.lock().unwrap_or_else(PoisonError::into_inner);
        if self.keep == 0 {
            return Ok(Vec::new());
        }
        let per_rank = self.disk_per_rank && tier.kind() == TierKind::Disk;
        let busy: BTreeSet<u64> = self
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
            let asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
            let order = |step: u64| asked.1.get(&step).copied();
            !busy.contains(&s) && order(s) < order(saved)
        };
        let mut steps = Vec::new();
        let mut removed = Vec::new();
        // Steps newer than the one saved, left by a run that went back to an older step: this
        // rank's files there, if it has any, are removed.
        let mut abandoned = Vec::new();
        for s in tier.list_steps(&self.job)? {
            if stale(s) {
                tier.remove_rank(&self.job, s, self.rank)?;
                abandoned.push(s);
                continue;
            }
            let done = if per_rank {
                self.read_manifest(tier, s).is_ok_and(|m| m.is_some())
            } else {
                self.is_complete(tier, s)?
            };
            steps.push((s, done));
        }
        let plan = retention::plan(&steps, self.keep);
        for s in plan.removed {
            if !busy.contains(&s) {
                tier.remove_rank(&self.job, s, self.rank)?;
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

/// A step saved by `saved` ranks, asked for by rank `rank` of `world_size`.
pub(crate) fn another_world(job: &str, step: u64, saved: u32, rank: u32, world_size: u32) -> Error {
    Error::Config {
        reason: format!(
            "step {step} of job {job:?} was saved by {saved} ranks, and this is rank {rank} of \
             {world_size}: a rank's file loads only into the same world size. Load it with \
             torch.distributed.checkpoint (hotstart.torch.StorageReader reshards it to any world \
             size), or open the engine with world size {saved}"
        ),
    }
}
