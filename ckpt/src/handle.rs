//! [`SaveHandle`]: what a caller holds while a save stages and persists in the background.
//!
//! The background thread of a save moves each phase of a shared [`SaveStatus`] from `Pending`
//! to `Done`, `Failed` or `Skipped` exactly once, under a mutex, and wakes every waiter through
//! a condition variable. Waiting never times out by itself: every phase ends, because the
//! background thread catches panics and marks what is left `Failed`.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::error::{Error, Result};
use crate::tier::TierKind;

/// Where one phase of a save stands.
#[derive(Debug, Clone)]
pub enum Phase {
    /// Not finished yet.
    Pending,
    /// Finished successfully.
    Done,
    /// Failed; the error is shared by every waiter.
    Failed(Arc<Error>),
    /// Not done because the save was skipped (staging pool full, policy `skip`).
    Skipped,
    /// The tier is not configured.
    Off,
}

impl Phase {
    /// True unless still pending.
    pub fn is_finished(&self) -> bool {
        !matches!(self, Phase::Pending)
    }
}

/// A snapshot of a save's progress.
#[derive(Debug, Clone)]
pub struct SaveStatus {
    pub step: u64,
    /// The staging copy: once finished, the caller's tensors are no longer read.
    pub staged: Phase,
    /// Committed to the sidecar's memory (survives a crash of this process); `Off` without a
    /// sidecar.
    pub memory: Phase,
    /// Replicated to the sidecar's peers (survives the loss of this node); `Off` without a
    /// sidecar, or when it has no peers or a replication factor of 0.
    pub peers: Phase,
    pub disk: Phase,
    pub store: Phase,
}

impl SaveStatus {
    /// The phase of one tier.
    pub fn tier(&self, tier: TierKind) -> &Phase {
        match tier {
            TierKind::Memory => &self.memory,
            TierKind::Peer => &self.peers,
            TierKind::Disk => &self.disk,
            TierKind::Store => &self.store,
        }
    }

    fn tier_mut(&mut self, tier: TierKind) -> &mut Phase {
        match tier {
            TierKind::Memory => &mut self.memory,
            TierKind::Peer => &mut self.peers,
            TierKind::Disk => &mut self.disk,
            TierKind::Store => &mut self.store,
        }
    }

    fn phases_mut(&mut self) -> [&mut Phase; 5] {
        [
            &mut self.staged,
            &mut self.memory,
            &mut self.peers,
            &mut self.disk,
            &mut self.store,
        ]
    }

    pub(crate) fn all_finished(&self) -> bool {
        self.staged.is_finished() && TierKind::ALL.iter().all(|&t| self.tier(t).is_finished())
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    status: Mutex<SaveStatus>,
    changed: Condvar,
}

impl Shared {
    /// A save whose staging and `tiers` are pending; the other tiers are `Off`.
    pub(crate) fn new(step: u64, tiers: &[TierKind]) -> Arc<Shared> {
        let tier = |t| {
            if tiers.contains(&t) {
                Phase::Pending
            } else {
                Phase::Off
            }
        };
        Arc::new(Shared {
            status: Mutex::new(SaveStatus {
                step,
                staged: Phase::Pending,
                memory: tier(TierKind::Memory),
                peers: tier(TierKind::Peer),
                disk: tier(TierKind::Disk),
                store: tier(TierKind::Store),
            }),
            changed: Condvar::new(),
        })
    }

    pub(crate) fn skipped(step: u64) -> Arc<Shared> {
        Arc::new(Shared {
            status: Mutex::new(SaveStatus {
                step,
                staged: Phase::Skipped,
                memory: Phase::Skipped,
                peers: Phase::Skipped,
                disk: Phase::Skipped,
                store: Phase::Skipped,
            }),
            changed: Condvar::new(),
        })
    }

    fn update(&self, f: impl FnOnce(&mut SaveStatus)) {
        let mut s = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        f(&mut s);
        drop(s);
        self.changed.notify_all();
    }

    pub(crate) fn set_staged(&self, phase: Phase) {
        self.update(|s| s.staged = phase);
    }

    pub(crate) fn set_tier(&self, tier: TierKind, phase: Phase) {
        self.update(|s| *s.tier_mut(tier) = phase);
    }

    /// Marks every phase still pending as failed with `e`.
    pub(crate) fn fail_pending(&self, e: Arc<Error>) {
        self.update(|s| {
            for p in s.phases_mut() {
                if !p.is_finished() {
                    *p = Phase::Failed(e.clone());
                }
            }
        });
    }

    pub(crate) fn wait_until(&self, done: impl Fn(&SaveStatus) -> bool) -> SaveStatus {
        let mut s = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        while !done(&s) {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.clone()
    }

    pub(crate) fn status(&self) -> SaveStatus {
        self.status
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// The handle of one save. Dropping it waits for the staging copy (so borrowed tensors are
/// never read after their owner could have freed them) but not for persistence.
#[derive(Debug)]
pub struct SaveHandle {
    pub(crate) shared: Arc<Shared>,
    pub(crate) step: u64,
    pub(crate) rank: u32,
    pub(crate) inflight: usize,
}

impl SaveHandle {
    /// The step being saved.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Waits until the tensors are copied into staging memory; afterwards the caller may change
    /// or free them. The only wait a training loop needs.
    pub fn wait_staged(&self) -> Result<()> {
        let s = self.shared.wait_until(|s| s.staged.is_finished());
        match s.staged {
            Phase::Done => Ok(()),
            Phase::Skipped => Err(Error::Skipped {
                step: self.step,
                inflight: self.inflight,
            }),
            Phase::Failed(e) => Err(Error::Staging {
                step: self.step,
                source: e.clone(),
            }),
            Phase::Pending | Phase::Off => Err(Error::Task {
                what: "staging",
                message: "unexpected state".into(),
            }),
        }
    }

    /// Waits until `tier` has the step durably (data, then manifest) or failed to. For
    /// [`TierKind::Memory`]: until the sidecar holds it, verified and sealed; for
    /// [`TierKind::Peer`]: until the sidecar's peers hold it.
    pub fn wait_persisted(&self, tier: TierKind) -> Result<()> {
        let s = self.shared.wait_until(|s| s.tier(tier).is_finished());
        self.tier_result(tier, s.tier(tier))
    }

    /// Waits for every configured tier; the first failure, if any.
    pub fn wait(&self) -> Result<()> {
        let s = self.shared.wait_until(SaveStatus::all_finished);
        for tier in TierKind::ALL {
            match s.tier(tier) {
                Phase::Off => {}
                p => self.tier_result(tier, p)?,
            }
        }
        Ok(())
    }

    fn tier_result(&self, tier: TierKind, p: &Phase) -> Result<()> {
        match p {
            Phase::Done => Ok(()),
            Phase::Skipped => Err(Error::Skipped {
                step: self.step,
                inflight: self.inflight,
            }),
            Phase::Off => Err(Error::Config {
                reason: format!("the {tier} tier is not configured"),
            }),
            Phase::Failed(e) => Err(Error::Persist {
                tier,
                step: self.step,
                rank: self.rank,
                source: e.clone(),
            }),
            Phase::Pending => Err(Error::Task {
                what: "persist",
                message: "unexpected state".into(),
            }),
        }
    }

    /// Where the save stands now, without waiting.
    pub fn status(&self) -> SaveStatus {
        self.shared.status()
    }
}

impl Drop for SaveHandle {
    fn drop(&mut self) {
        self.shared.wait_until(|s| s.staged.is_finished());
    }
}
