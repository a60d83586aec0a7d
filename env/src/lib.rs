//! hotstart-env: dependency snapshots.
//!
//! Turns "install the environment" on every node into "restore the environment that one node
//! installed". A snapshot is an image: a [`hotstart_store::Tree`] (paths, modes, mtimes,
//! symlinks, hard links, chunk lists) plus content-addressed chunks in a
//! [`hotstart_store::ChunkStore`], so identical files are stored once across every snapshot.
//!
//! - [`key`]: what identifies an environment (lock files' bytes, interpreter, platform, install
//!   command, target).
//! - [`capture`]: an installed directory becomes a tree and chunks, published under its key by
//!   a conditional create of its record ([`record`]): the first complete snapshot wins, and a
//!   half-uploaded one is never seen.
//! - [`restore`]: parallel chunk fetches, hard links from the local chunk cache, a temporary
//!   directory renamed into place.
//! - [`pack`]: a snapshot's chunks again in one object, so a restore from a remote store
//!   fetches them with a few large requests.
//! - [`relocate`]: a snapshot restored at another path than it was captured at.
//! - [`node`]: node-local file locks, so concurrent `ensure` calls for one key do the work once.
//! - [`ensure`](ensure()): all of the above in one call, as `hotstart env ensure` runs it.
//! - [`gc`]: listing snapshots and deleting old ones and unreferenced chunks, excluded from
//!   running captures by [`store_lock`].
//!
//! - [`lazy`]: `ensure` that, on a hit, mounts the snapshot read-only and lazily through
//!   `hotstart-image` instead of restoring it, with a hot-chunk profile kept beside the
//!   snapshot ([`EnvStore::artifacts`]) and replayed by every later mount on any node.

pub mod capture;
mod chunking;
pub mod ensure;
pub mod error;
pub mod gc;
pub mod key;
pub mod lazy;
pub mod node;
pub mod pack;
pub mod record;
pub mod relocate;
pub mod restore;
pub mod store_lock;
mod util;

pub use capture::{CaptureReport, capture};
pub use ensure::{Action, EnsureConfig, Outcome, default_cache_dir, ensure};
pub use error::{Error, Result};
pub use key::{Key, KeyInputs, KeySpec, Platform, PythonInfo};
pub use lazy::{LAZY_READ_AHEAD, LazyOutcome, MountedEnv, Unmounted, ensure_lazy, lazy_config};
pub use record::{EnvStore, PathRef, PathRefKind, SnapshotRecord};
pub use relocate::RelocateReport;
pub use restore::{RestoreOptions, RestoreReport, restore};
