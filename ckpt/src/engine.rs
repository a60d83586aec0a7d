//! The [`Engine`]: asynchronous saves, retention, and the entry points for loads.
//!
//! **Save** (`Engine::save`) lays the tensors out as one safetensors file image, takes a staging
//! buffer from the bounded pool (blocking or skipping when `max_inflight` saves are in flight),
//! and starts one background thread for the save, then returns its [`SaveHandle`]. That thread:
//!
//! 1. starts one thread per tier, which begins writing the file as soon as its first bytes are
//!    staged (the disk tier in 64 MiB pieces behind the copies; the store tier once the whole
//!    file is staged, since its uploads are far slower than staging);
//! 2. *stages*: copies the header and every tensor into the buffer in file order, 8 MiB
//!    segments over `threads` threads, publishing the filled prefix as it grows, while the GPU
//!    copies device tensors on its own stream (`crate::cuda`); drops the caller's tensors and
//!    marks the handle staged (the caller may now mutate them);
//! 3. hashes every `chunk_size` chunk of the image with blake3 over the same threads (after
//!    staging, so it never slows the copies the caller waits for), while the tiers write, then
//!    hands each tier the manifest, which it writes after its data file (the commit); each
//!    tier's outcome is set on the handle as soon as it is known;
//! 4. hands the buffer back to the pool, then runs retention on each tier that succeeded.
//!
//! A panic anywhere in that thread is caught and reported as a failure on the handle; a failed
//! tier never has a manifest for the step, so the step never looks complete there.
//!
//! **Retention** (`Engine::gc`, and after each successful persist) works per tier and only on
//! this rank's own objects, so ranks never race on each other's files: it keeps the newest
//! `keep` complete steps, removes older complete ones, removes incomplete steps older than the
//! newest complete one (torn saves of crashed processes), and leaves newer incomplete steps
//! alone (they may still be persisting, here or on another rank). Steps this engine is still
//! persisting are never touched.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use hotstart_store::uring::UringConfig;
use hotstart_store::{Store, StripeConfig};
use tracing::{info, instrument, warn};

use crate::cuda::{self, Gpu, Pinned};
use crate::error::{Error, Result};
use crate::format::{self, Layout, Manifest};
use crate::handle::{Phase, SaveHandle, Shared};
use crate::retention;
use crate::staging::{self, Pool};
use crate::tensor::{Extras, Source, Tensor};
use crate::tier::disk::DiskTier;
use crate::tier::store::{Runtime, StoreTier};
use crate::tier::{Staging, Tier, TierKind};

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
    /// Extra attempts after a transient store error.
    pub store_retries: u32,
    /// First delay between store attempts; doubled each time.
    pub retry_backoff: Duration,
    /// The Unix socket of this node's sidecar (`hotstart serve`). When set, saves stage
    /// straight into the sidecar's shared memory and the sidecar persists them (its own disk
    /// and store tiers, and its peers); loads ask the sidecar, which serves the nearest copy.
    /// The disk and store tiers configured here are then only read, by loads, when the sidecar
    /// cannot be reached. See [`EngineConfig::sidecar_from_env`].
    pub sidecar: Option<PathBuf>,
}

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

pub(crate) struct Inner {
    pub(crate) job: String,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    keep: usize,
    pub(crate) chunk_size: usize,
    pub(crate) threads: usize,
    when_full: WhenFull,
    max_inflight: usize,
    /// Tiers in load order: disk first, then store. With a sidecar, only read when it cannot
    /// be reached.
    pub(crate) tiers: Vec<Arc<dyn Tier>>,
    /// Retention on the disk tier looks at this rank's files only (see `with_tiers`).
    disk_per_rank: bool,
    pool: Arc<Pool>,
    /// The sidecar that stages, persists and serves this rank's checkpoints, if any.
    pub(crate) sidecar: Option<crate::client::Client>,
    skipped: AtomicU64,
    persisting: Mutex<BTreeSet<u64>>,
    gc_lock: Mutex<()>,
    /// Per-device contexts and copy streams, made on first use.
    pub(crate) gpu: Gpu,
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
            .field("job", &self.inner.job)
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
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
            tiers.push(Arc::new(DiskTier::new(dir.clone(), cfg.uring.clone())));
        }
        if let Some(store) = &cfg.store {
            tiers.push(Arc::new(StoreTier::new(
                store.clone(),
                Arc::new(Runtime::new()?),
                cfg.stripe.clone(),
                cfg.store_retries,
                cfg.retry_backoff,
            )));
        }
        Engine::with_tiers(cfg, tiers, false)
    }

    /// An engine over tiers that already exist (shared by the sidecar's engines). With
    /// `disk_per_rank`, retention on the disk tier counts a step complete once this rank's
    /// manifest is there: a node's disk only ever holds its own ranks' files.
    pub fn with_tiers(
        cfg: EngineConfig,
        tiers: Vec<Arc<dyn Tier>>,
        disk_per_rank: bool,
    ) -> Result<Engine> {
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
        if tiers.is_empty() && cfg.sidecar.is_none() {
            return bad("no sidecar, disk tier or store tier is configured".into());
        }
        let sidecar = match &cfg.sidecar {
            Some(socket) => Some(crate::client::Client::attach(
                socket,
                &cfg.job,
                cfg.rank,
                cfg.world_size,
                cfg.max_inflight,
            )?),
            None => None,
        };
        let threads = if cfg.threads == 0 {
            staging::default_threads()
        } else {
            cfg.threads
        };
        Ok(Engine {
            inner: Arc::new(Inner {
                job: cfg.job,
                rank: cfg.rank,
                world_size: cfg.world_size,
                keep: cfg.keep,
                chunk_size: cfg.chunk_size,
                threads,
                when_full: cfg.when_full,
                max_inflight: cfg.max_inflight.max(1),
                tiers,
                disk_per_rank,
                pool: Pool::new(cfg.max_inflight),
                sidecar,
                skipped: AtomicU64::new(0),
                persisting: Mutex::new(BTreeSet::new()),
                gc_lock: Mutex::new(()),
                gpu: Gpu::new(),
            }),
            threads: Mutex::new(Vec::new()),
        })
    }

    /// The tiers a save goes to, nearest first: with a sidecar, its memory and the tiers it
    /// persists to; otherwise the configured disk and store tiers.
    pub fn tiers(&self) -> Vec<TierKind> {
        match &self.inner.sidecar {
            Some(s) => s.tiers(),
            None => self.inner.own_tiers(),
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

    pub(crate) fn when_full(&self) -> WhenFull {
        self.inner.when_full
    }

    /// Counts and logs a save skipped because `max_inflight` saves are in flight.
    pub(crate) fn count_skip(&self, step: u64) {
        self.inner.skipped.fetch_add(1, Ordering::Relaxed);
        warn!(
            step,
            inflight = self.inner.max_inflight,
            "staging pool full; checkpoint skipped"
        );
    }

    /// Starts saving `step`: returns once the staging copy is under way. See the module docs.
    ///
    /// Errors only on input that cannot be saved (duplicate or reserved names), on device
    /// tensors that cannot be read ([`Error::Cuda`]: no `cuda` feature, no driver, no such
    /// device), or when no thread can be started; everything later is reported on the handle.
    #[instrument(skip_all, fields(step, rank = self.inner.rank))]
    pub fn save(&self, step: u64, tensors: Vec<Tensor>, extras: Extras) -> Result<SaveHandle> {
        let inner = &self.inner;
        let layout = Layout::new(&inner.job, step, inner.rank, inner.world_size, &tensors)?;
        let devices: BTreeSet<usize> = tensors.iter().filter_map(Tensor::device).collect();
        if !devices.is_empty() {
            cuda::check_devices(&devices)?;
        }
        let len = usize::try_from(layout.file_len).map_err(|_| Error::Input {
            step,
            reason: "checkpoint larger than the address space".into(),
        })?;
        if let Some(sidecar) = &inner.sidecar {
            return sidecar.save(self, step, layout, tensors, extras);
        }
        let handle = |shared| SaveHandle {
            shared,
            step,
            rank: inner.rank,
            inflight: inner.max_inflight,
        };
        let block = inner.when_full == WhenFull::Block;
        let Some(slot) = inner.pool.acquire(len, block) else {
            self.count_skip(step);
            return Ok(handle(Shared::skipped(step)));
        };
        let shared = Shared::new(step, &inner.own_tiers());
        inner.start_persisting(step);
        let job = SaveJob {
            inner: inner.clone(),
            shared: shared.clone(),
            step,
            layout,
            tensors,
            extras,
        };
        self.spawn_tracked(format!("hotstart-ckpt-save-{step}"), &shared, move || {
            job.run(slot)
        })
        .inspect_err(|_| inner.done_persisting(step))?;
        Ok(handle(shared))
    }

    /// Runs the background work of a save on a thread of its own that `wait_idle` (and
    /// dropping) waits for. If no thread can be started, the handle's pending phases fail and
    /// so does the call.
    pub(crate) fn spawn_tracked(
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

    /// Persists a file that is already staged and hashed (a sidecar's committed segment) to
    /// this engine's tiers in the background, then applies retention. The handle reports each
    /// tier; the thread returned ends once retention is done too (the caller joins it: it is
    /// not one of the saves `wait_idle` waits for). `manifest` must describe the first `len`
    /// bytes of `region`.
    pub fn persist_staged(
        &self,
        step: u64,
        region: Arc<dyn crate::tier::Region>,
        len: usize,
        manifest: Vec<u8>,
    ) -> Result<(SaveHandle, JoinHandle<()>)> {
        let inner = &self.inner;
        let shared = Shared::new(step, &inner.own_tiers());
        shared.set_staged(Phase::Done);
        inner.start_persisting(step);
        let (job_inner, job_shared) = (inner.clone(), shared.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("hotstart-ckpt-persist-{step}"))
            .spawn(move || {
                guarded(&job_inner, &job_shared, step, || {
                    let image = Staging::filled(region, len);
                    let keys = Keys::new(&job_inner, step);
                    let persisted = std::thread::scope(|scope| {
                        let writers = start_writers(scope, &job_inner, &job_shared, &image, &keys);
                        join_writers(&job_inner, writers, Some(&manifest))
                    });
                    drop(image);
                    job_inner.retention(step, persisted);
                })
            });
        match spawned {
            Ok(t) => Ok((
                SaveHandle {
                    shared,
                    step,
                    rank: inner.rank,
                    inflight: inner.max_inflight,
                },
                t,
            )),
            Err(e) => {
                inner.done_persisting(step);
                Err(Error::io("spawn persist thread", "", e))
            }
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
        let Some(t) = self.inner.tier(tier) else {
            return Ok(Vec::new());
        };
        self.inner.complete_steps_in(t)
    }

    /// The newest step complete in any tier; with a sidecar, the newest step complete for
    /// every rank that the sidecar finds in its memory, its peers', their disks and the store.
    pub fn latest_complete_step(&self) -> Result<Option<u64>> {
        if let Some(sidecar) = &self.inner.sidecar {
            return sidecar.latest();
        }
        self.inner.latest_in_own_tiers()
    }

    /// Applies retention to every tier now; returns the steps whose files of this rank were
    /// removed, per tier.
    pub fn gc(&self) -> Result<Vec<(TierKind, Vec<u64>)>> {
        self.inner
            .tiers
            .iter()
            .map(|t| Ok((t.kind(), self.inner.gc_tier(t.as_ref())?)))
            .collect()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.wait_idle();
    }
}

impl Inner {
    /// The disk and store tiers of this engine itself, in load order.
    pub(crate) fn own_tiers(&self) -> Vec<TierKind> {
        self.tiers.iter().map(|t| t.kind()).collect()
    }

    /// The newest step complete in any of this engine's own tiers.
    pub(crate) fn latest_in_own_tiers(&self) -> Result<Option<u64>> {
        let mut best = None;
        for t in &self.tiers {
            match self.complete_steps_in(t.as_ref()) {
                Ok(steps) => best = best.max(steps.last().copied()),
                Err(e) => warn!(tier = %t.kind(), error = %e, "cannot list steps"),
            }
        }
        Ok(best)
    }

    fn start_persisting(&self, step: u64) {
        self.persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(step);
    }

    /// Retention on every tier in `persisted`, after `step` reached them.
    fn retention(&self, step: u64, persisted: Vec<&dyn Tier>) {
        for tier in persisted {
            if let Err(e) = self.gc_tier(tier) {
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

    fn done_persisting(&self, step: u64) {
        self.persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&step);
    }

    /// Whether `step` is complete in `tier`.
    pub(crate) fn is_complete(&self, tier: &dyn Tier, step: u64) -> Result<bool> {
        for r in 0..self.world_size {
            if r == self.rank {
                continue;
            }
            if !tier.exists(&format::manifest_key(&self.job, step, r))? {
                return Ok(false);
            }
        }
        Ok(self.read_manifest(tier, step).is_ok_and(|m| m.is_some()))
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
    fn gc_tier(&self, tier: &dyn Tier) -> Result<Vec<u64>> {
        let _g = self.gc_lock.lock().unwrap_or_else(PoisonError::into_inner);
        if self.keep == 0 {
            return Ok(Vec::new());
        }
        let per_rank = self.disk_per_rank && tier.kind() == TierKind::Disk;
        let mut steps = Vec::new();
        for s in tier.list_steps(&self.job)? {
            let done = if per_rank {
                self.read_manifest(tier, s).is_ok_and(|m| m.is_some())
            } else {
                self.is_complete(tier, s)?
            };
            steps.push((s, done));
        }
        let plan = retention::plan(&steps, self.keep);
        let busy = self
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut removed = Vec::new();
        for s in plan.removed {
            if !busy.contains(&s) {
                tier.remove_rank(&self.job, s, self.rank)?;
                removed.push(s);
            }
        }
        if !removed.is_empty() {
            info!(tier = %tier.kind(), ?removed, "retention removed steps");
        }
        Ok(removed)
    }
}

/// One save's background work.
struct SaveJob {
    inner: Arc<Inner>,
    shared: Arc<Shared>,
    step: u64,
    layout: Layout,
    tensors: Vec<Tensor>,
    extras: Extras,
}

/// Runs `work`, the background part of a save or persist of `step`; a panic in it is caught and
/// reported on the handle, and the step is no longer "persisting" afterwards.
fn guarded(inner: &Inner, shared: &Shared, step: u64, work: impl FnOnce()) {
    let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    if let Err(panic) = res {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        tracing::error!(step, %message, "checkpoint save thread panicked");
        shared.fail_pending(Arc::new(Error::Task {
            what: "save thread",
            message,
        }));
    }
    inner.done_persisting(step);
}

/// The keys of one rank's step.
struct Keys {
    step: u64,
    data: String,
    manifest: String,
}

impl Keys {
    fn new(inner: &Inner, step: u64) -> Keys {
        Keys {
            step,
            data: format::data_key(&inner.job, step, inner.rank),
            manifest: format::manifest_key(&inner.job, step, inner.rank),
        }
    }
}

/// A tier's writer: the channel its manifest goes to, and whether it persisted the step.
type Writer<'scope> = (
    mpsc::Sender<Vec<u8>>,
    std::thread::ScopedJoinHandle<'scope, bool>,
);

/// Starts one writer thread per tier: each writes the data file from `image` (as it is staged,
/// or at once when it is complete), then waits for the manifest on its channel and writes it,
/// the commit. Each tier's outcome is set on `shared` as soon as it is known.
fn start_writers<'scope, 'env>(
    scope: &'scope std::thread::Scope<'scope, 'env>,
    inner: &'env Inner,
    shared: &'env Shared,
    image: &'env Staging,
    keys: &'env Keys,
) -> Vec<Writer<'scope>> {
    let step = keys.step;
    inner
        .tiers
        .iter()
        .map(|tier| {
            let (tx, rx) = mpsc::channel::<Vec<u8>>();
            let persist = scope.spawn(move || {
                let kind = tier.kind();
                let res = tier.put_file(&keys.data, image).and_then(|()| {
                    // Sent once every chunk is hashed; never sent if the save failed.
                    let manifest = rx.recv().map_err(|_| Error::Task {
                        what: "checksums",
                        message: "no manifest for the staged file".into(),
                    })?;
                    tier.put_manifest(&keys.manifest, manifest)
                });
                match res {
                    Ok(()) => {
                        info!(step, tier = %kind, bytes = image.len(), "checkpoint persisted");
                        shared.set_tier(kind, Phase::Done);
                        true
                    }
                    // Staging's own error is on the handle already.
                    Err(_) if image.failed() => false,
                    Err(e) => {
                        tracing::error!(step, tier = %kind, error = %e, "checkpoint not persisted");
                        shared.set_tier(kind, Phase::Failed(Arc::new(e)));
                        false
                    }
                }
            });
            (tx, persist)
        })
        .collect()
}

/// Hands `manifest` to every writer (none: the save failed, so they give up) and waits for
/// them; the tiers that persisted the step.
fn join_writers<'a>(
    inner: &'a Inner,
    writers: Vec<Writer<'_>>,
    manifest: Option<&[u8]>,
) -> Vec<&'a dyn Tier> {
    let (senders, running): (Vec<_>, Vec<_>) = writers.into_iter().unzip();
    if let Some(m) = manifest {
        for tx in &senders {
            // A tier that failed already has hung up.
            let _ = tx.send(m.to_vec());
        }
    }
    drop(senders);
    inner
        .tiers
        .iter()
        .zip(running)
        .filter_map(|(tier, t)| t.join().unwrap_or(false).then_some(tier.as_ref()))
        .collect()
}

impl SaveJob {
    fn run(self, slot: staging::Slot) {
        let (inner, shared, step) = (self.inner.clone(), self.shared.clone(), self.step);
        guarded(&inner, &shared, step, || self.work(slot));
    }

    fn work(self, mut slot: staging::Slot) {
        let SaveJob {
            inner,
            shared,
            step,
            layout,
            tensors,
            extras,
        } = self;
        let Some(buf) = slot.shared() else { return };
        let image = Staging::new(buf, layout.file_len as usize);
        let keys = Keys::new(&inner, step);
        let persisted: Vec<&dyn Tier> = std::thread::scope(|scope| {
            // Fails the image if staging stops early, a panic included, so tiers stop waiting.
            let _abandon = staging::FailUnlessComplete(&image);
            // 1. Every tier starts at once, writing what is staged while the rest is copied.
            let writers = start_writers(scope, &inner, &shared, &image, &keys);
            // 2. Stage.
            let mut pin = slot.take_pin();
            let res = stage(&inner, slot.region(), &mut pin, &image, &layout, &tensors);
            if let Some(p) = pin {
                slot.set_pin(p);
            }
            drop(tensors);
            let staged = match res.and_then(|()| image.complete()) {
                Ok(staged) => staged,
                Err(e) => {
                    tracing::error!(step, error = %e, "checkpoint staging failed");
                    shared.fail_pending(Arc::new(e));
                    image.fail();
                    join_writers(&inner, writers, None);
                    return Vec::new();
                }
            };
            shared.set_staged(Phase::Done);
            // 3. Checksums, while the tiers write; then the manifest, each tier's commit.
            let manifest = manifest_for(&inner, step, &layout, staged.as_ref(), &extras);
            drop(staged);
            join_writers(&inner, writers, Some(&manifest))
        });
        // 4. The bytes are no longer needed: free the staging slot before retention.
        drop(image);
        drop(slot);
        inner.retention(step, persisted);
    }
}

/// The manifest (JSON) of a staged file: its layout, the blake3 of every chunk (hashed over the
/// engine's threads) and the extras.
pub(crate) fn manifest_for(
    inner: &Inner,
    step: u64,
    layout: &Layout,
    staged: &[u8],
    extras: &Extras,
) -> Vec<u8> {
    let hashes = staging::hash_chunks(staged, inner.chunk_size, inner.threads);
    Manifest::new(
        &inner.job,
        step,
        inner.rank,
        inner.world_size,
        layout,
        inner.chunk_size as u64,
        &hashes,
        extras,
    )
    .to_json()
}

/// Fills `image` from `tensors`: device tensors on the GPU's copy stream (into pinned memory
/// where `region`, the memory under the image, could be registered: `pin` keeps the
/// registration, made on first use), host tensors over the engine's threads at the same time.
/// Returns once every byte is in place.
pub(crate) fn stage(
    inner: &Inner,
    region: Option<(*const u8, usize)>,
    pin: &mut Option<Pinned>,
    image: &Staging,
    layout: &Layout,
    tensors: &[Tensor],
) -> Result<()> {
    let sources: Vec<Source<'_>> = tensors.iter().map(Tensor::source).collect();
    let first_device = sources.iter().find_map(|s| match s {
        Source::Device(d) => Some(d.ordinal),
        Source::Host(_) => None,
    });
    if let (Some(ordinal), Some((ptr, buf_len))) = (first_device, region)
        && pin.is_none()
    {
        match inner.gpu.pin(ordinal, ptr, buf_len) {
            Ok(p) => *pin = Some(p),
            Err(e) => {
                warn!(error = %e, "cannot pin the staging buffer; copying to pageable memory")
            }
        }
    }
    image.fill(&layout.header, &sources, inner.threads, &inner.gpu)
}
