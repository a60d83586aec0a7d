//! The [`Engine`]: asynchronous saves, retention, and the entry points for loads.
//!
//! **Save** (`Engine::save`) lays the tensors out as one safetensors file image, is admitted
//! (blocking or skipping when `max_inflight` saves are in flight), takes its staging memory (a
//! buffer of the engine's pool, or a segment of the sidecar's memory) and starts one
//! background thread that runs the save pipeline (`crate::save`: stage, hash, then the tiers or
//! the sidecar), then returns its [`SaveHandle`]. The sidecar's persistence of a step it holds
//! runs the same pipeline, through the rank's persistence core
//! ([`Persistence::persist_staged`](crate::Persistence::persist_staged)).
//!
//! **Retention** (`Engine::gc`, and after each successful persist) works per tier and only on
//! this rank's own objects, so ranks never race on each other's files: it keeps the newest
//! `keep` complete steps, removes older complete ones, removes incomplete steps older than the
//! newest complete one (torn saves of crashed processes), and leaves newer incomplete steps
//! alone (they may still be persisting, here or on another rank). Steps this engine is still
//! persisting are never touched.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use hotstart_store::uring::UringConfig;
use hotstart_store::{Store, StripeConfig};
use tracing::{instrument, warn};

use crate::admission::Admission;
use crate::cuda::{self, Gpu};
use crate::error::{Error, Result};
use crate::format::{Layout, Manifest};
use crate::handle::{SaveHandle, Shared};
use crate::inner::Inner;
use crate::load::{Destination, Loaded, StepSel};
use crate::persistence::Persistence;
use crate::save::{Input, Save, Target};
use crate::staging::Pool;
use crate::tensor::{Extras, Tensor};
use crate::tier::disk::DiskTier;
use crate::tier::store::{Runtime, StoreTier};
use crate::tier::{Tier, TierKind};

/// What `save` does when `max_inflight` checkpoints are already staged or persisting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WhenFull {
    /// Wait for one to finish (back-pressure on the training loop).
    #[default]
    Block,
    /// Drop this save: warn, count it, and return a handle whose phases are `Skipped`.
    Skip,
}

/// Everything an [`Engine`] needs.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Job name: the first path component(s) of every key.
    pub job: String,
    pub rank: u32,
    pub world_size: u32,
    /// Local disk tier root; `None` for no disk tier.
    pub disk_dir: Option<PathBuf>,
    /// Object store tier; `None` for no store tier.
    pub store: Option<Store>,
    /// Complete steps kept per tier by retention; 0 keeps everything.
    pub keep: usize,
    /// Saves staged or persisting at once (staging buffers in the pool).
    pub max_inflight: usize,
    pub when_full: WhenFull,
    /// Bytes per checksummed chunk (the unit of verification and of tier fallback on load).
    pub chunk_size: usize,
    /// Threads for staging copies, checksums and parallel chunk reads; 0 picks the core count
    /// (at most 8).
    pub threads: usize,
    /// How the disk tier writes and reads.
    pub uring: UringConfig,
    /// How the store tier stripes uploads and reads.
    pub stripe: StripeConfig,
    /// Extra attempts after a transient store error: a short read, a local directory's
    /// interrupted I/O. A remote store's client retries its own requests, within
    /// [`hotstart_store::REMOTE_RETRY_FOR`]; what fails after that is not retried again.
    pub store_retries: u32,
    /// First delay between store attempts; doubled each time.
    pub retry_backoff: Duration,
    /// The Unix socket of this node's sidecar (`hotstart serve`). When set, saves stage
    /// straight into the sidecar's shared memory and the sidecar persists them (its own disk
    /// and store tiers, and its peers); loads ask the sidecar, which serves the nearest copy.
    /// The disk and store tiers configured here are then only read, by loads and by the
    /// questions about steps, when the sidecar cannot be reached. See [`EngineConfig::sidecar_from_env`].
    pub sidecar: Option<PathBuf>,
    /// How long the engine waits for a sidecar that is gone (its socket missing or refusing:
    /// restarting, or started with the job and not listening yet) before it fails: when it is
    /// made, at a save, and at a read that has no tiers of its own to go to instead.
    pub sidecar_wait: Duration,
}

/// Default [`EngineConfig::sidecar_wait`]: a sidecar restarting takes a few seconds.
pub const DEFAULT_SIDECAR_WAIT: Duration = Duration::from_secs(60);

/// Default chunk size: 64 MiB.
pub const DEFAULT_CHUNK_SIZE: usize = 64 << 20;

/// The environment variable naming the sidecar's Unix socket, for the engine
/// ([`EngineConfig::sidecar_from_env`]) and for `hotstart serve` alike.
pub const SOCKET_ENV: &str = "HOTSTART_SOCKET";

impl EngineConfig {
    /// Defaults for `rank` of `world_size` in `job`, with no tier configured yet.
    pub fn new(job: impl Into<String>, rank: u32, world_size: u32) -> EngineConfig {
        EngineConfig {
            job: job.into(),
            rank,
            world_size,
            disk_dir: None,
            store: None,
            keep: 2,
            max_inflight: 2,
            when_full: WhenFull::Block,
            chunk_size: DEFAULT_CHUNK_SIZE,
            threads: 0,
            uring: UringConfig::default(),
            stripe: StripeConfig::default(),
            store_retries: 4,
            retry_backoff: Duration::from_millis(100),
            sidecar: None,
            sidecar_wait: DEFAULT_SIDECAR_WAIT,
        }
    }

    /// With the sidecar listening on `socket`.
    pub fn sidecar(mut self, socket: impl Into<PathBuf>) -> Self {
        self.sidecar = Some(socket.into());
        self
    }

    /// With the sidecar named by [`SOCKET_ENV`] (`HOTSTART_SOCKET`), when that variable is set
    /// and not empty; unchanged otherwise.
    pub fn sidecar_from_env(mut self) -> Self {
        if let Some(socket) = std::env::var_os(SOCKET_ENV).filter(|s| !s.is_empty()) {
            self.sidecar = Some(PathBuf::from(socket));
        }
        self
    }

    /// With a local disk tier rooted at `dir`.
    pub fn disk(mut self, dir: impl Into<PathBuf>) -> Self {
        self.disk_dir = Some(dir.into());
        self
    }

    /// With an object store tier.
    pub fn store(mut self, store: Store) -> Self {
        self.store = Some(store);
        self
    }
}

/// The checkpoint engine of one rank. Blocking API: call it from plain threads, not from inside
/// an async runtime.
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("job", &self.inner.core.job)
            .field("rank", &self.inner.core.rank)
            .field("world_size", &self.inner.core.world_size)
            .field("tiers", &self.tiers())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Checks the configuration and opens the tiers; with a sidecar, connects to it once to
    /// check that it serves (an error if it does not).
    pub fn new(cfg: EngineConfig) -> Result<Engine> {
        let mut tiers: Vec<Arc<dyn Tier>> = Vec::new();
        if let Some(dir) = &cfg.disk_dir {
            usable_dir("local_dir (the disk tier)", dir)?;
            tiers.push(Arc::new(DiskTier::new(dir.clone(), cfg.uring.clone())));
        }
        match cfg.store.as_ref().map(|s| (s, s.local_dir())) {
            // The embedded default: a local directory, written at the disk's speed.
            Some((_, Some(dir))) => {
                usable_dir("the store (a local directory)", dir)?;
                tiers.push(Arc::new(DiskTier::for_local_store(dir, cfg.uring.clone())))
            }
            Some((store, None)) => tiers.push(Arc::new(StoreTier::new(
                store.clone(),
                Arc::new(Runtime::new()?),
                cfg.stripe.clone(),
                cfg.store_retries,
                cfg.retry_backoff,
            ))),
            None => {}
        }
        if tiers.is_empty() && cfg.sidecar.is_none() {
            return Err(Error::Config {
                reason: "no sidecar, disk tier or store tier is configured".into(),
            });
        }
        // Where the owner lock lives: the first local place this rank's saves go through.
        let owner_dir = cfg
            .disk_dir
            .clone()
            .or_else(|| cfg.store.as_ref()?.local_dir().map(Into::into))
            .or_else(|| {
                let socket = cfg.sidecar.as_ref()?;
                Some(socket.parent()?.to_path_buf())
            });
        let mut core = Persistence::new(&cfg, tiers, false)?;
        if let Some(dir) = &owner_dir {
            // Engines of this process that share the owner lock are one writer.
            core.writes = crate::owner::writes(dir, &cfg.job, cfg.rank);
        }
        let core = Arc::new(core);
        let gpu = Arc::new(Gpu::new());
        let sidecar = match &cfg.sidecar {
            Some(socket) => Some(crate::client::Client::attach(
                socket,
                &cfg.job,
                cfg.rank,
                cfg.world_size,
                cfg.sidecar_wait,
                gpu.clone(),
            )?),
            None => None,
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                core,
                block: cfg.when_full == WhenFull::Block,
                admission: Admission::new(cfg.max_inflight),
                pool: Pool::new(),
                sidecar,
                skipped: AtomicU64::new(0),
                saving: Mutex::new(BTreeMap::new()),
                gpu,
                owner_dir,
                owner: Mutex::new(None),
            }),
            threads: Mutex::new(Vec::new()),
        })
    }

    /// The tiers a save goes to, nearest first: with a sidecar, its memory and the tiers it
    /// persists to; otherwise the configured disk and store tiers.
    pub fn tiers(&self) -> Vec<TierKind> {
        match &self.inner.sidecar {
            Some(s) => s.tiers(),
            None => self.inner.core.own_tiers(),
        }
    }

    /// The sidecar's socket, when this engine saves through one.
    pub fn sidecar(&self) -> Option<&std::path::Path> {
        self.inner.sidecar.as_ref().map(|s| s.socket())
    }

    /// Saves skipped so far because the pool was full (policy `skip`).
    pub fn skipped(&self) -> u64 {
        self.inner.skipped.load(Ordering::Relaxed)
    }

    /// Starts saving `step`: returns once the staging copy is under way. See the module docs.
    ///
    /// Errors only on input that cannot be saved (duplicate or reserved names), on a step whose
    /// earlier save is not finished ([`Error::InFlight`]), on another process of this node
    /// saving the same job and rank ([`Error::SecondWriter`]), on device tensors that cannot be
    /// read ([`Error::Cuda`]: no `cuda` feature, no driver, no such device), or when no thread
    /// can be started; everything later is reported on the handle.
    #[instrument(skip_all, fields(step, rank = self.inner.core.rank))]
    pub fn save(&self, step: u64, tensors: Vec<Tensor>, extras: Extras) -> Result<SaveHandle> {
        let inner = &self.inner;
        let layout = Layout::new(&inner.core.job, step, inner.core.world_size, &tensors)?;
        let devices: BTreeSet<usize> = tensors.iter().filter_map(Tensor::device).collect();
        let len = usize::try_from(layout.file_len).map_err(|_| Error::Input {
            step,
            reason: "checkpoint larger than the address space".into(),
        })?;
        let handle = |shared| SaveHandle {
            shared,
            step,
            rank: inner.core.rank,
            inflight: inner.admission.max(),
        };
        let tiers = match &inner.sidecar {
            Some(sidecar) => sidecar.tiers(),
            None => inner.core.own_tiers(),
        };
        let shared = Shared::new(step, &tiers);
        inner.claim(step, &shared)?;
        let owned = inner.own_rank().and_then(|()| {
            if devices.is_empty() {
                Ok(())
            } else {
                cuda::check_devices(&devices)
            }
        });
        if let Err(e) = owned {
            inner.unclaim(step);
            return Err(e);
        }
        let block = inner.block;
        let Some(ticket) = inner.admission.take(block) else {
            inner.unclaim(step);
            inner.skipped.fetch_add(1, Ordering::Relaxed);
            warn!(
                step,
                inflight = inner.admission.max(),
                "max_inflight saves in flight; checkpoint skipped"
            );
            return Ok(handle(Shared::skipped(step)));
        };
        let target = match &inner.sidecar {
            Some(sidecar) => {
                let ordinal = tensors.iter().find_map(Tensor::device);
                let lease = sidecar
                    .lease(step, len, block, ordinal)
                    .inspect_err(|_| inner.unclaim(step))?;
                Target::Sidecar(Box::new(lease))
            }
            None => Target::Pool(inner.pool.take(len)),
        };
        inner.core.start_persisting(step);
        let save = Save {
            core: inner.core.clone(),
            shared: shared.clone(),
            step,
            ticket: Some(ticket),
            input: Input::Tensors {
                layout,
                tensors,
                extras,
                gpu: inner.gpu.clone(),
            },
        };
        self.spawn_tracked(format!("hotstart-ckpt-save-{step}"), &shared, move || {
            save.run(target)
        })
        .inspect_err(|_| inner.core.done_persisting(step))?;
        Ok(handle(shared))
    }

    /// Runs the background work of a save on a thread of its own that `wait_idle` (and
    /// dropping) waits for. If no thread can be started, the handle's pending phases fail and
    /// so does the call.
    fn spawn_tracked(
        &self,
        name: String,
        shared: &Shared,
        work: impl FnOnce() + Send + 'static,
    ) -> Result<()> {
        match std::thread::Builder::new().name(name).spawn(work) {
            Ok(t) => {
                let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
                threads.retain(|t| !t.is_finished());
                threads.push(t);
                Ok(())
            }
            Err(e) => {
                let e = Arc::new(Error::io("spawn save thread", "", e));
                shared.fail_pending(e.clone());
                Err(Error::Task {
                    what: "save",
                    message: e.to_string(),
                })
            }
        }
    }

    /// Loads a step of this rank, verifying every chunk; see the module docs. With a sidecar,
    /// the sidecar serves the step from the nearest tier that holds it (see
    /// the `hotstart-sidecar` crate), and this engine's own tiers are read only if it cannot be reached.
    #[instrument(skip_all, fields(rank = self.inner.core.rank, ?which))]
    pub fn load(&self, which: StepSel, dest: Destination<'_>) -> Result<Loaded> {
        self.inner.load(which, dest)
    }

    /// `rank`'s manifest of `step`, from the first tier (in load order) that holds a valid one
    /// for this job, step and rank, whatever world size it was written with. This is how a job
    /// reads checkpoints saved by a job of another size: the manifest names the saved world size
    /// and the tensor index, and an engine configured as that rank of that world size loads the
    /// data. Bytes are not verified here; [`Engine::load`] verifies every chunk.
    ///
    /// With a sidecar, the sidecar finds it (its memory, its peers' memory, its disk, the
    /// store), and this engine's own tiers are read when the sidecar holds none or cannot be
    /// reached.
    pub fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        let Some((sidecar, mut conn)) = self.inner.reach_sidecar()? else {
            return self.inner.core.manifest(step, rank);
        };
        match sidecar.manifest(&mut conn, step, rank) {
            Err(e) if e.is_not_found() && !self.inner.core.tiers.is_empty() => {
                self.inner.core.manifest(step, rank)
            }
            found => found,
        }
    }

    /// Waits for every save started so far to finish persisting.
    pub fn wait_idle(&self) {
        let threads: Vec<_> =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        for t in threads {
            let _ = t.join();
        }
    }

    /// Steps complete in `tier` for this job: every rank's manifest present, and this rank's
    /// valid. Ascending.
    pub fn complete_steps(&self, tier: TierKind) -> Result<Vec<u64>> {
        self.inner.core.complete_steps(tier)
    }

    /// Every step complete for this rank's world size in some tier, ascending: with a sidecar,
    /// as the sidecar finds them (its memory, its peers', their disks, the store), else (or
    /// when it cannot be reached) in this engine's own tiers. A tier that cannot be read is an
    /// error ([`Error::Unavailable`]): a list without it would be wrong.
    pub fn steps(&self) -> Result<Vec<u64>> {
        if let Some((sidecar, mut conn)) = self.inner.reach_sidecar()? {
            return sidecar.steps(&mut conn);
        }
        let mut all = BTreeSet::new();
        for t in &self.inner.core.tiers {
            let steps = self.inner.core.complete_steps_in(t.as_ref()).map_err(|e| {
                if e.is_unreadable() {
                    Error::unavailable(t.kind(), &self.inner.core.job, e)
                } else {
                    e
                }
            })?;
            all.extend(steps);
        }
        Ok(all.into_iter().collect())
    }

    /// The newest step complete in any tier; with a sidecar (that can be reached), the newest
    /// step complete for every rank that the sidecar finds in its memory, its peers', their
    /// disks and the store.
    pub fn latest_complete_step(&self) -> Result<Option<u64>> {
        if let Some((sidecar, mut conn)) = self.inner.reach_sidecar()? {
            return sidecar.latest(&mut conn);
        }
        self.inner.core.latest_in_own_tiers_below(None)
    }

    /// The newest step complete as [`Engine::latest_complete_step`] finds them, older than
    /// `step`: where a job goes back to when one of its ranks cannot restore the step it chose
    /// (corrupt or gone in every tier), so that every rank restores the same step.
    pub fn latest_complete_step_below(&self, step: u64) -> Result<Option<u64>> {
        if let Some((sidecar, mut conn)) = self.inner.reach_sidecar()? {
            return sidecar.latest_below(&mut conn, step);
        }
        self.inner.core.latest_in_own_tiers_below(Some(step))
    }

    /// The newest checkpoint of this job whatever world size saved it, and that world size: the
    /// newest step that every rank of the world size that wrote it committed in one of this
    /// engine's own tiers; with a sidecar, also the newest the sidecar finds complete for any
    /// world size (in its memory, its peers' memory, their disks, the store), whichever is
    /// newer. A step of another world size is for a loader that
    /// reshards (torch.distributed.checkpoint); [`Engine::load`] refuses it with a
    /// [`Error::Config`] that says so.
    pub fn latest_checkpoint(&self) -> Result<Option<(u64, u32)>> {
        self.latest_checkpoint_in(None)
    }

    /// The newest checkpoint as [`Engine::latest_checkpoint`] finds them, older than `step`:
    /// where a job that reshards goes back to when one of its ranks cannot read the step it
    /// chose.
    pub fn latest_checkpoint_below(&self, step: u64) -> Result<Option<(u64, u32)>> {
        self.latest_checkpoint_in(Some(step))
    }

    fn latest_checkpoint_in(&self, below: Option<u64>) -> Result<Option<(u64, u32)>> {
        let own = self.inner.core.latest_checkpoint_in_own_tiers(below)?;
        let Some((sidecar, mut conn)) = self.inner.reach_sidecar()? else {
            return Ok(own);
        };
        Ok(own.max(sidecar.latest_checkpoint(&mut conn, below)?))
    }

    /// Applies retention to every tier now; returns the steps whose files of this rank were
    /// removed, per tier.
    pub fn gc(&self) -> Result<Vec<(TierKind, Vec<u64>)>> {
        self.inner.core.gc()
    }
}

/// Checks at construction that `dir` is (or can be made) a directory this process can write:
/// a tier that is misconfigured fails here, not at every save.
fn usable_dir(what: &str, dir: &std::path::Path) -> Result<()> {
    let bad = |reason: String| Error::Config {
        reason: format!("{what} {}: {reason}", dir.display()),
    };
    std::fs::create_dir_all(dir).map_err(|e| {
        bad(format!(
            "cannot be made a directory ({e}); pass a directory path"
        ))
    })?;
    let probe = dir.join(format!(".hotstart-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&probe)
        .map_err(|e| {
            bad(format!(
                "cannot be written ({e}); check its permissions and space"
            ))
        })?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.wait_idle();
    }
}
