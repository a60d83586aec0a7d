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

use crate::cuda::{self, Gpu};
use crate::error::{Error, Result};
use crate::format::{self, Layout, Manifest};
use crate::handle::{Phase, SaveHandle, Shared};
use crate::staging::{self, Pool, Slot};
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
}

/// Default chunk size: 64 MiB.
pub const DEFAULT_CHUNK_SIZE: usize = 64 << 20;

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
        }
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
    /// Tiers in load order: disk first, then store.
    pub(crate) tiers: Vec<Box<dyn Tier>>,
    pool: Arc<Pool>,
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
    /// Checks the configuration and opens the tiers.
    pub fn new(cfg: EngineConfig) -> Result<Engine> {
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
        if cfg.disk_dir.is_none() && cfg.store.is_none() {
            return bad("neither a disk tier nor a store tier is configured".into());
        }
        let mut tiers: Vec<Box<dyn Tier>> = Vec::new();
        if let Some(dir) = &cfg.disk_dir {
            tiers.push(Box::new(DiskTier::new(dir.clone(), cfg.uring.clone())));
        }
        if let Some(store) = &cfg.store {
            let rt = Arc::new(Runtime::new()?);
            tiers.push(Box::new(StoreTier::new(
                store.clone(),
                rt,
                cfg.stripe.clone(),
                cfg.store_retries,
                cfg.retry_backoff,
            )));
        }
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
                pool: Pool::new(cfg.max_inflight),
                skipped: AtomicU64::new(0),
                persisting: Mutex::new(BTreeSet::new()),
                gc_lock: Mutex::new(()),
                gpu: Gpu::new(),
            }),
            threads: Mutex::new(Vec::new()),
        })
    }

    /// The configured tiers, in load order.
    pub fn tiers(&self) -> Vec<TierKind> {
        self.inner.tiers.iter().map(|t| t.kind()).collect()
    }

    /// Saves skipped so far because the pool was full (policy `skip`).
    pub fn skipped(&self) -> u64 {
        self.inner.skipped.load(Ordering::Relaxed)
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
        let handle = |shared| SaveHandle {
            shared,
            step,
            rank: inner.rank,
            inflight: inner.max_inflight,
        };
        let block = inner.when_full == WhenFull::Block;
        let Some(slot) = inner.pool.acquire(len, block) else {
            inner.skipped.fetch_add(1, Ordering::Relaxed);
            warn!(
                step,
                inflight = inner.pool.taken(),
                "staging pool full; checkpoint skipped"
            );
            return Ok(handle(Shared::skipped(step)));
        };
        let has = |k| self.tiers().contains(&k);
        let shared = Shared::new(step, has(TierKind::Disk), has(TierKind::Store));
        inner
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(step);
        let job = SaveJob {
            inner: inner.clone(),
            shared: shared.clone(),
            step,
            layout,
            tensors,
            extras,
        };
        let spawned = std::thread::Builder::new()
            .name(format!("hotstart-ckpt-save-{step}"))
            .spawn(move || job.run(slot));
        match spawned {
            Ok(t) => {
                let mut threads = self.threads.lock().unwrap_or_else(PoisonError::into_inner);
                threads.retain(|t| !t.is_finished());
                threads.push(t);
            }
            Err(e) => {
                inner.done_persisting(step);
                let e = Arc::new(Error::io("spawn save thread", "", e));
                shared.fail_pending(e.clone());
                return Err(Error::Task {
                    what: "save",
                    message: e.to_string(),
                });
            }
        }
        Ok(handle(shared))
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
        self.inner.complete_steps(t)
    }

    /// The newest step complete in any tier.
    pub fn latest_complete_step(&self) -> Result<Option<u64>> {
        let mut best = None;
        for t in &self.inner.tiers {
            match self.inner.complete_steps(t.as_ref()) {
                Ok(steps) => best = best.max(steps.last().copied()),
                Err(e) => warn!(tier = %t.kind(), error = %e, "cannot list steps"),
            }
        }
        Ok(best)
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
        let m = Manifest::parse(&bytes, &location)?;
        if m.job != self.job
            || m.step != step
            || m.rank != self.rank
            || m.world_size != self.world_size
        {
            return Err(Error::format(
                "manifest",
                location,
                format!(
                    "written for job {:?} step {} rank {} of {}",
                    m.job, m.step, m.rank, m.world_size
                ),
            ));
        }
        Ok(Some(m))
    }

    fn complete_steps(&self, tier: &dyn Tier) -> Result<Vec<u64>> {
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
        let steps = tier.list_steps(&self.job)?;
        let mut complete = Vec::new();
        for &s in &steps {
            if self.is_complete(tier, s)? {
                complete.push(s);
            }
        }
        let Some(&newest) = complete.last() else {
            return Ok(Vec::new());
        };
        let kept: BTreeSet<u64> = complete.iter().rev().take(self.keep).copied().collect();
        let busy = self
            .persisting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut removed = Vec::new();
        for s in steps {
            let old_complete = complete.binary_search(&s).is_ok() && !kept.contains(&s);
            let torn = complete.binary_search(&s).is_err() && s < newest;
            if (old_complete || torn) && !busy.contains(&s) {
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

impl SaveJob {
    fn run(self, slot: staging::Slot) {
        let (inner, shared, step) = (self.inner.clone(), self.shared.clone(), self.step);
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work(slot)));
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
        let data_key = format::data_key(&inner.job, step, inner.rank);
        let manifest_key = format::manifest_key(&inner.job, step, inner.rank);
        let persisted: Vec<&dyn Tier> = std::thread::scope(|scope| {
            // Fails the image if staging stops early, a panic included, so tiers stop waiting.
            let _abandon = staging::FailUnlessComplete(&image);
            // 1. Every tier starts at once, writing what is staged while the rest is copied.
            let (manifests, running): (Vec<_>, Vec<_>) = inner
                .tiers
                .iter()
                .map(|tier| {
                    let (tx, rx) = mpsc::channel::<Vec<u8>>();
                    let (image, shared) = (&image, &shared);
                    let (data_key, manifest_key) = (&data_key, &manifest_key);
                    let persist = scope.spawn(move || {
                        let kind = tier.kind();
                        let res = tier.put_file(data_key, image).and_then(|()| {
                            // Sent once every chunk is hashed; never sent if the save failed.
                            let manifest = rx.recv().map_err(|_| Error::Task {
                                what: "checksums",
                                message: "no manifest for the staged file".into(),
                            })?;
                            tier.put_manifest(manifest_key, manifest)
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
                .unzip();
            // 2. Stage.
            let res = stage(&inner, &mut slot, &image, &layout, &tensors);
            drop(tensors);
            let staged = match res.and_then(|()| image.complete()) {
                Ok(staged) => staged,
                Err(e) => {
                    tracing::error!(step, error = %e, "checkpoint staging failed");
                    shared.fail_pending(Arc::new(e));
                    image.fail();
                    drop(manifests);
                    running.into_iter().for_each(|t| _ = t.join());
                    return Vec::new();
                }
            };
            shared.set_staged(Phase::Done);
            // 3. Checksums, while the tiers write; then the manifest, each tier's commit.
            let hashes = staging::hash_chunks(staged.as_ref(), inner.chunk_size, inner.threads);
            drop(staged);
            let manifest = Manifest::new(
                &inner.job,
                step,
                inner.rank,
                inner.world_size,
                &layout,
                inner.chunk_size as u64,
                &hashes,
                &extras,
            )
            .to_json();
            for tx in manifests {
                // A tier that failed already has hung up.
                let _ = tx.send(manifest.clone());
            }
            inner
                .tiers
                .iter()
                .zip(running)
                .filter_map(|(tier, t)| t.join().unwrap_or(false).then_some(tier.as_ref()))
                .collect()
        });
        // 4. The bytes are no longer needed: free the staging slot before retention.
        drop(image);
        drop(slot);
        for tier in persisted {
            if let Err(e) = inner.gc_tier(tier) {
                warn!(step, tier = %tier.kind(), error = %e, "retention failed");
            }
        }
    }
}

/// Fills `image` from `tensors`: device tensors on the GPU's copy stream (into pinned memory
/// where the buffer could be registered), host tensors over the engine's threads at the same
/// time. Returns once every byte is in place.
fn stage(
    inner: &Inner,
    slot: &mut Slot,
    image: &Staging,
    layout: &Layout,
    tensors: &[Tensor],
) -> Result<()> {
    let sources: Vec<Source<'_>> = tensors.iter().map(Tensor::source).collect();
    let first_device = sources.iter().find_map(|s| match s {
        Source::Device(d) => Some(d.ordinal),
        Source::Host(_) => None,
    });
    if let (Some(ordinal), Some((ptr, buf_len))) = (first_device, slot.region())
        && !slot.is_pinned()
    {
        match inner.gpu.pin(ordinal, ptr, buf_len) {
            Ok(pin) => slot.set_pin(pin),
            Err(e) => {
                warn!(error = %e, "cannot pin the staging buffer; copying to pageable memory")
            }
        }
    }
    image.fill(&layout.header, &sources, inner.threads, &inner.gpu)
}
