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
    pub disk: Phase,
    pub store: Phase,
}

impl SaveStatus {
    /// The phase of one tier.
    pub fn tier(&self, tier: TierKind) -> &Phase {
        match tier {
            TierKind::Disk => &self.disk,
            TierKind::Store => &self.store,
        }
    }

    fn tier_mut(&mut self, tier: TierKind) -> &mut Phase {
        match tier {
            TierKind::Disk => &mut self.disk,
            TierKind::Store => &mut self.store,
        }
    }

    fn all_finished(&self) -> bool {
        self.staged.is_finished() && self.disk.is_finished() && self.store.is_finished()
    }
}

#[derive(Debug)]
pub(crate) struct Shared {
    status: Mutex<SaveStatus>,
    changed: Condvar,
}

impl Shared {
    pub(crate) fn new(step: u64, disk: bool, store: bool) -> Arc<Shared> {
        let tier = |on: bool| if on { Phase::Pending } else { Phase::Off };
        Arc::new(Shared {
            status: Mutex::new(SaveStatus {
                step,
                staged: Phase::Pending,
                disk: tier(disk),
                store: tier(store),
            }),
            changed: Condvar::new(),
        })
    }

    pub(crate) fn skipped(step: u64) -> Arc<Shared> {
        Arc::new(Shared {
            status: Mutex::new(SaveStatus {
                step,
                staged: Phase::Skipped,
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
            for p in [&mut s.staged, &mut s.disk, &mut s.store] {
                if !p.is_finished() {
                    *p = Phase::Failed(e.clone());
                }
            }
        });
    }

    fn wait_until(&self, done: impl Fn(&SaveStatus) -> bool) -> SaveStatus {
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
            Phase::Failed(e) => Err(Error::Task {
                what: "staging",
                message: e.to_string(),
            }),
            Phase::Pending | Phase::Off => Err(Error::Task {
                what: "staging",
                message: "unexpected state".into(),
            }),
        }
    }

    /// Waits until `tier` has the step durably (data, then manifest) or failed to.
    pub fn wait_persisted(&self, tier: TierKind) -> Result<()> {
        let s = self.shared.wait_until(|s| s.tier(tier).is_finished());
        self.tier_result(tier, s.tier(tier))
    }

    /// Waits for every configured tier; the first failure, if any.
    pub fn wait(&self) -> Result<()> {
        let s = self.shared.wait_until(SaveStatus::all_finished);
        for tier in [TierKind::Disk, TierKind::Store] {
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
