//! The shared state of one rank's engine ([`Inner`]): its persistence core
//! (`crate::persistence`) and what only an engine has: the staging pool, admission, the
//! sidecar client, GPU contexts, the claims of steps being saved and the owner lock. The
//! engine's entry points (`crate::engine`), the save pipeline (`crate::save`) and loads
//! (`crate::load`) all work on it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};

use hotstart_proto::wire::{Conn, FdStream};
use tracing::warn;

use crate::admission::Admission;
use crate::client::Client;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::handle::Shared;
use crate::owner::{self, OwnerLock};
use crate::persistence::Persistence;
use crate::staging::Pool;

/// The state every part of an engine shares.
pub(crate) struct Inner {
    /// This rank's tiers: with a sidecar, only read when it cannot be reached.
    pub(crate) core: Arc<Persistence>,
    /// Whether a save waits for admission (`WhenFull::Block`) rather than being skipped.
    pub(crate) block: bool,
    /// The bound on saves in flight, for saves of either kind.
    pub(crate) admission: Arc<Admission>,
    pub(crate) pool: Arc<Pool>,
    /// The sidecar that stages, persists and serves this rank's checkpoints, if any.
    pub(crate) sidecar: Option<Client>,
    pub(crate) skipped: AtomicU64,
    /// The handle of each step's save while it is unfinished (see [`Inner::claim`]).
    pub(crate) saving: Mutex<BTreeMap<u64, Arc<Shared>>>,
    /// Per-device contexts and copy streams, made on first use.
    pub(crate) gpu: Arc<Gpu>,
    /// Where this rank's owner lock is taken (`crate::owner`), and the lock once the first save
    /// took it.
    pub(crate) owner_dir: Option<PathBuf>,
    /// `Some(None)`: the lock could not be made, and saves go on without it.
    pub(crate) owner: Mutex<Option<Option<Arc<OwnerLock>>>>,
}

impl Inner {
    /// The sidecar and a new connection to it, to read the job's steps through: `None` without
    /// a sidecar, or where it cannot be reached and this engine has tiers of its own, which the
    /// caller reads instead (they are read only then). Without tiers of its own, a sidecar that
    /// is gone is waited for as a save waits (`EngineConfig::sidecar_wait`), then the error.
    pub(crate) fn reach_sidecar(&self) -> Result<Option<(&Client, Conn<FdStream>)>> {
        let Some(sidecar) = &self.sidecar else {
            return Ok(None);
        };
        let alone = self.core.tiers.is_empty();
        let conn = if alone {
            sidecar.connect_waiting()
        } else {
            sidecar.connect()
        };
        match conn {
            Ok(conn) => Ok(Some((sidecar, conn))),
            Err(e) if alone => Err(e),
            Err(e) => {
                warn!(error = %e, "sidecar unreachable; reading this engine's own tiers");
                Ok(None)
            }
        }
    }

    /// Makes sure this engine is the one writer of its job and rank on this node: takes the
    /// owner lock on the first save (see `crate::owner`). A lock that cannot be made at all (a
    /// directory this process cannot write) is warned about once, and saves go on without it.
    pub(crate) fn own_rank(&self) -> Result<()> {
        let Some(dir) = &self.owner_dir else {
            return Ok(());
        };
        let mut owner = self.owner.lock().unwrap_or_else(PoisonError::into_inner);
        if owner.is_none() {
            *owner = match owner::acquire(dir, &self.core.job, self.core.rank) {
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
}
