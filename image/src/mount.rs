//! [`LazyMount`]: any [`Tree`] in a store mounted read-only and lazily, with its profile
//! recorded and replayed.
//!
//! **Mounting** (`LazyMount::mount`): the tree's namespace is built in memory ([`ImageFs`]) and
//! mounted through `hotstart-fuse`'s adapter, read-only. Meanwhile, with an [`ArtifactDir`], a
//! background task merges traces that crashed mounts left behind into the profile, reads the
//! profile and, unless prefetch is off, replays its chunks that the tree still contains (see
//! `prefetch.rs`). A profile that cannot be read costs the mount its prefetch, not the mount.
//!
//! **While mounted** every first read of a chunk is recorded (see `loader.rs`); unless recording
//! is off, the trace so far is written to `traces/<run>` every `flush_every`, so a mount that is
//! killed still leaves its trace for the next mount to merge.
//!
//! **Unmounting** (`LazyMount::unmount`): the prefetcher stops, the filesystem is unmounted,
//! the trace is merged into the profile (read, merge, write: two mounts ending at the same
//! instant can lose one run's contribution, never corrupt the profile) and the trace object is
//! removed; the run's [`MountReport`] is logged and stored as `runs/<run>.json`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::future::BoxFuture;
use hotstart_fuse::{MountHandle, MountOptions};
use hotstart_store::{ChunkId, ChunkStore, Store, Tree};
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::fs::ImageFs;
use crate::layout::ArtifactDir;
use crate::loader::Loader;
use crate::prefetch::{PrefetchConfig, ReplayStats, replay};
use crate::profile::{DEFAULT_DECAY_RUNS, Profile, Trace};
use crate::report::MountReport;
use crate::warm;

/// The kernel read-ahead of an image mount by default, in bytes: one chunk of the default size
/// (see [`MountOptions::kernel_read_ahead`]).
pub const KERNEL_READ_AHEAD: u64 = 1 << 20;

/// How a lazy mount behaves.
#[derive(Debug, Clone)]
pub struct LazyConfig {
    /// Bytes of verified chunks kept in memory (prefetched chunks wait here to be read).
    pub memory_cache: u64,
    /// Replay the profile at mount.
    pub prefetch: bool,
    /// Record first reads and merge them into the profile.
    pub record: bool,
    pub replay: PrefetchConfig,
    /// Runs a chunk may go unread before it leaves the profile.
    pub decay_runs: u32,
    /// How often the trace so far is written to the store.
    pub flush_every: Duration,
    /// A trace not updated for this long belongs to a mount that died; the next mount merges it.
    pub stale_trace_after: Duration,
    /// How long the kernel may cache entries, attributes and negative lookups.
    pub ttl: Duration,
    /// Store the replayed chunks' file pages in the kernel's page cache ahead of the job (see
    /// `warm.rs`); the mount then waits for the profile before it goes live.
    pub warm_page_cache: bool,
    /// The FUSE session (always mounted read-only).
    pub mount: MountOptions,
    /// Told the replay's plan before the replay starts (see [`PlanHook`]).
    pub on_plan: Option<PlanHook>,
    /// Without a profile (no mount recorded one yet), prefetch every chunk of the tree in file
    /// order instead of nothing, behind demand reads and without warming the page cache: a
    /// first start then waits for the link's bandwidth rather than one round trip per chunk.
    pub fetch_all_without_profile: bool,
}

/// Told the chunks a replay will prefetch, in replay order, before it prefetches any: a caller
/// that can fetch them in bulk (a snapshot's pack, in a few ranged GETs instead of a request
/// each) announces them to the chunk store ([`ChunkStore::expect`]) before the returned future
/// ends and holds their frames as they arrive ([`ChunkStore::hold`]); the replay then takes
/// each planned chunk from memory ([`ChunkStore::fetch_frame`]). When the replay ends, every
/// frame still held is dropped ([`ChunkStore::release_held`]): what it planned is in the
/// loader's memory cache by then. A hook may also only hold the replay back (the snapshotter's
/// waits for the layer records its pull needs first).
#[derive(Clone)]
pub struct PlanHook(pub Arc<dyn Fn(Vec<ChunkId>) -> BoxFuture<'static, ()> + Send + Sync>);

impl std::fmt::Debug for PlanHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlanHook")
    }
}

impl Default for LazyConfig {
    fn default() -> Self {
        LazyConfig {
            memory_cache: 1 << 30,
            prefetch: true,
            record: true,
            replay: PrefetchConfig::default(),
            decay_runs: DEFAULT_DECAY_RUNS,
            flush_every: Duration::from_secs(30),
            stale_trace_after: Duration::from_secs(600),
            ttl: Duration::from_secs(3600),
            warm_page_cache: true,
            mount: MountOptions {
                fs_name: "hotstart-image".to_string(),
                kernel_read_ahead: Some(KERNEL_READ_AHEAD),
                ..MountOptions::default()
            },
            on_plan: None,
            fetch_all_without_profile: false,
        }
    }
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A run id: sortable by start time, unique across processes and hosts.
pub(crate) fn new_run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = blake3::Hasher::new();
    h.update(&nanos.to_le_bytes());
    h.update(&std::process::id().to_le_bytes());
    if let Ok(host) = std::fs::read("/proc/sys/kernel/hostname") {
        h.update(&host);
    }
    format!("{:013}-{}", nanos / 1_000_000, &h.finalize().to_hex()[..12])
}

/// Reads the profile under `dir` (empty if there is none).
pub async fn load_profile(store: &Store, dir: &ArtifactDir) -> Result<Profile> {
    let key = dir.profile_key();
    match store.get(&key).await {
        Ok(bytes) => Profile::decode(&key, &bytes),
        Err(e) if e.is_not_found() => Ok(Profile::default()),
        Err(e) => Err(e.into()),
    }
}

/// Merges `traces` into the profile under `dir` and writes it back. A profile that cannot be
/// decoded (damaged, or of another format version) is replaced: it is only a hint, and keeping
/// it would stop every later run from being recorded. Traces that read nothing are not runs
/// ([`Profile::merge`]): with only those, the profile is neither read nor written.
pub(crate) async fn merge_traces(
    store: &Store,
    dir: &ArtifactDir,
    traces: &[Trace],
    decay_runs: u32,
) -> Result<()> {
    if traces.iter().all(|t| t.accesses.is_empty()) {
        return Ok(());
    }
    let mut profile = match load_profile(store, dir).await {
        Ok(p) => p,
        Err(e @ Error::Format { .. }) => {
            tracing::warn!(error = %e, "replacing an unreadable profile");
            Profile::default()
        }
        Err(e) => return Err(e),
    };
    for t in traces {
        profile.merge(t, decay_runs);
    }
    store.put(&dir.profile_key(), profile.encode()?).await?;
    Ok(())
}

/// Traces under `dir` whose mounts ended or died, merged into the profile and removed.
async fn merge_leftover_traces(
    store: &Store,
    dir: &ArtifactDir,
    stale_after: Duration,
    decay_runs: u32,
) -> Result<()> {
    let listed = store.list(&dir.traces_prefix()).await?;
    let cutoff = now_ms().saturating_sub(stale_after.as_millis() as u64);
    let mut done = Vec::new();
    for obj in listed {
        let trace = match store.get(&obj.key).await {
            Ok(b) => match Trace::decode(&obj.key, &b) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(key = %obj.key, error = %e, "dropping an unreadable trace");
                    store.delete(&obj.key).await?;
                    continue;
                }
            },
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e.into()),
        };
        if trace.finished || trace.updated_ms < cutoff {
            done.push((obj.key, trace));
        }
    }
    if done.is_empty() {
        return Ok(());
    }
    tracing::info!(
        traces = done.len(),
        "merging traces of earlier mounts into the profile"
    );
    let traces: Vec<Trace> = done.iter().map(|(_, t)| t.clone()).collect();
    merge_traces(store, dir, &traces, decay_runs).await?;
    for (key, _) in done {
        store.delete(&key).await?;
    }
    Ok(())
}

/// A mounted tree; see the module documentation. Unmounted by [`LazyMount::unmount`] (which
/// saves the profile and report) or, without saving anything, when dropped.
pub struct LazyMount {
    handle: Option<MountHandle<ImageFs>>,
    loader: Arc<Loader>,
    label: String,
    run: String,
    started_ms: u64,
    artifacts: Option<ArtifactDir>,
    cfg: LazyConfig,
    stop: tokio::sync::watch::Sender<bool>,
    replay: Option<JoinHandle<ReplayStats>>,
    /// What the prefetcher did, once it has finished.
    replayed: Option<ReplayStats>,
    flusher: Option<JoinHandle<()>>,
    warmer: Option<std::thread::JoinHandle<()>>,
    mountpoint: PathBuf,
}

impl std::fmt::Debug for LazyMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyMount")
            .field("tree", &self.label)
            .field("run", &self.run)
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

/// [`hotstart_fuse::prepare_mountpoint`], off the runtime's threads: the error a mount at
/// `mountpoint` would fail with, before anything is started for it.
pub(crate) async fn prepare_mountpoint(mountpoint: &Path) -> Result<()> {
    let mp = mountpoint.to_path_buf();
    tokio::task::spawn_blocking(move || hotstart_fuse::prepare_mountpoint(&mp))
        .await
        .map_err(|e| Error::task("mount", e))?
        .map_err(|e| Error::io("mount", mountpoint, e))?;
    Ok(())
}

impl LazyMount {
    /// Mounts `tree` (its chunks in `chunks`) at `mountpoint`. `label` names it in reports;
    /// `artifacts`, if given, is where its profile, traces and run reports live.
    #[tracing::instrument(skip_all, fields(tree = label, mountpoint = %mountpoint.display()))]
    pub async fn mount(
        chunks: ChunkStore,
        tree: &Tree,
        label: &str,
        artifacts: Option<ArtifactDir>,
        mountpoint: &Path,
        cfg: LazyConfig,
    ) -> Result<LazyMount> {
        prepare_mountpoint(mountpoint).await?;
        let profile = read_profile(chunks.store(), artifacts.as_ref(), &cfg);
        Self::mount_with(chunks, tree, label, artifacts, mountpoint, cfg, profile).await
    }

    /// [`LazyMount::mount`] with the profile already being read (by [`read_profile`]), so that
    /// reading it overlaps with reading the tree. Check the mount point with
    /// [`prepare_mountpoint`] before starting that read: one that cannot be used then fails
    /// before any prefetch starts.
    pub async fn mount_with(
        chunks: ChunkStore,
        tree: &Tree,
        label: &str,
        artifacts: Option<ArtifactDir>,
        mountpoint: &Path,
        cfg: LazyConfig,
        profile: Option<ProfileRead>,
    ) -> Result<LazyMount> {
        let store = chunks.store().clone();
        // Prefetched chunks wait in memory, and in the disk cache when there is one.
        let budget = chunks
            .cache()
            .map_or(0, |c| c.capacity())
            .max(cfg.memory_cache);
        let loader = Arc::new(Loader::new(chunks, cfg.memory_cache));
        let started_ms = now_ms();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (replaying, replaying_rx) = tokio::sync::watch::channel(true);
        let (plan_tx, plan_rx) = tokio::sync::oneshot::channel();
        let plan_tx = cfg.warm_page_cache.then_some(plan_tx);
        // The profile is read, and replayed, while the filesystem mounts.
        let replay = artifacts.as_ref().map(|dir| {
            tokio::spawn(prepare_and_replay(
                store.clone(),
                dir.clone(),
                profile,
                tree.chunk_refs()
                    .into_iter()
                    .map(|c| (c.id, c.len))
                    .collect(),
                budget,
                cfg.clone(),
                loader.clone(),
                stop_rx.clone(),
                Planned {
                    plan: plan_tx,
                    replaying,
                },
            ))
        });
        let fs = Arc::new(ImageFs::new(tree, loader.clone(), cfg.ttl));
        let fs_for_warmer = fs.clone();
        // Files to warm are known before the mount is live: none of their entries may reach
        // the kernel with the usual TTL before they are marked (see `warm.rs`).
        // The plan never comes without warming, or without a profile to replay.
        let warm_files = match plan_rx.await {
            Ok(plan) => fs.plan_warming(&plan),
            Err(_) => Vec::new(),
        };
        let opts = MountOptions {
            read_only: true,
            ..cfg.mount.clone()
        };
        let rt = tokio::runtime::Handle::current();
        let mp = mountpoint.to_path_buf();
        let mounted =
            tokio::task::spawn_blocking(move || hotstart_fuse::mount_fs(fs, &mp, &opts, rt))
                .await
                .map_err(|e| Error::task("mount", e))
                .and_then(|r| r.map_err(|e| Error::io("mount", mountpoint, e)));
        let handle = match mounted {
            Ok(h) => h,
            Err(e) => {
                let _ = stop.send(true);
                if let Some(t) = replay {
                    t.abort();
                }
                return Err(e);
            }
        };
        let warmer = match handle.page_cache() {
            Some(cache) if !warm_files.is_empty() => warm::spawn(
                fs_for_warmer,
                warm_files,
                mountpoint.to_path_buf(),
                cache,
                stop_rx.clone(),
                replaying_rx,
            ),
            _ => None,
        };
        let run = new_run_id();
        let flusher = match (&artifacts, cfg.record) {
            (Some(dir), true) => Some(tokio::spawn(flush_periodically(
                store.clone(),
                dir.trace_key(&run),
                run.clone(),
                loader.clone(),
                cfg.flush_every,
                cfg.stale_trace_after / 3,
                stop_rx,
            ))),
            _ => None,
        };
        tracing::info!(run = %run, "mounted");
        Ok(LazyMount {
            handle: Some(handle),
            loader,
            label: label.to_string(),
            run,
            started_ms,
            artifacts,
            cfg,
            stop,
            replay,
            replayed: None,
            flusher,
            warmer,
            mountpoint: mountpoint.to_path_buf(),
        })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// This mount's run id.
    pub fn run(&self) -> &str {
        &self.run
    }

    /// The loader reads go through (its counters are live).
    pub fn loader(&self) -> &Arc<Loader> {
        &self.loader
    }

    /// Whether the mount was removed from outside (`fusermount3 -u`).
    pub fn is_finished(&self) -> bool {
        self.handle.as_ref().is_none_or(|h| h.is_finished())
    }

    /// The report so far (the prefetcher's part once [`LazyMount::prefetch_done`] returned).
    pub fn report(&self) -> MountReport {
        MountReport::new(
            &self.run,
            &self.label,
            self.started_ms,
            self.loader.started().elapsed().as_secs_f64(),
            &self.loader.stats(),
            self.replayed.as_ref(),
        )
    }

    /// Waits until the prefetcher has gone through its plan and the warmer has stored what it
    /// could in the page cache (at once if there was nothing to do).
    pub async fn prefetch_done(&mut self) -> Option<ReplayStats> {
        if let Some(task) = self.replay.take() {
            self.replayed = task.await.ok();
        }
        if let Some(w) = self.warmer.take() {
            let _ = tokio::task::spawn_blocking(move || w.join()).await;
        }
        self.replayed
    }

    /// Stops prefetching, unmounts, merges the trace into the profile and stores the report.
    pub async fn unmount(mut self) -> Result<MountReport> {
        let report = self.stop_and_unmount().await?;
        tracing::info!(tree = %self.label, run = %self.run, "unmounted: {}", report.summary());
        if let Some(dir) = &self.artifacts {
            let store = self.loader.chunks().store();
            if self.cfg.record {
                let trace = Trace::new(&self.run, &self.loader.trace(), now_ms(), true);
                let key = dir.trace_key(&self.run);
                match merge_traces(
                    store,
                    dir,
                    std::slice::from_ref(&trace),
                    self.cfg.decay_runs,
                )
                .await
                {
                    Ok(_) => store.delete(&key).await?,
                    Err(e) => {
                        // Leave the finished trace for the next mount to merge.
                        tracing::warn!(error = %e, "could not merge the trace into the profile");
                        store.put(&key, trace.encode()?).await?;
                        return Err(e);
                    }
                }
            }
            put_report(store, dir, &report).await?;
        }
        Ok(report)
    }

    /// Stops prefetching and unmounts, saving nothing: for a caller that records the reads
    /// and reports itself (the snapshotter does, per container start).
    pub async fn close(mut self) -> Result<()> {
        self.stop_and_unmount().await.map(drop)
    }

    /// The report of the whole mount, once it is unmounted.
    async fn stop_and_unmount(&mut self) -> Result<MountReport> {
        let _ = self.stop.send(true);
        if let Some(w) = self.warmer.take() {
            // It stops at the next file or chunk; it may be listing a directory of the mount.
            let _ = tokio::task::spawn_blocking(move || w.join()).await;
        }
        if let Some(h) = self.handle.take() {
            let mp = self.mountpoint.clone();
            tokio::task::spawn_blocking(move || h.unmount())
                .await
                .map_err(|e| Error::task("unmount", e))?
                .map_err(|e| Error::io("unmount", mp, e))?;
        }
        let replay = match self.replay.take() {
            Some(t) => t.await.ok(),
            None => self.replayed,
        };
        if let Some(f) = self.flusher.take() {
            f.abort();
            let _ = f.await;
        }
        Ok(MountReport::new(
            &self.run,
            &self.label,
            self.started_ms,
            self.loader.started().elapsed().as_secs_f64(),
            &self.loader.stats(),
            replay.as_ref(),
        ))
    }
}

/// Stores `report` as `runs/<run>.json` under `dir`.
pub(crate) async fn put_report(
    store: &Store,
    dir: &ArtifactDir,
    report: &MountReport,
) -> Result<()> {
    let key = dir.run_key(&report.run);
    let json = serde_json::to_vec_pretty(report).map_err(|e| Error::Format {
        what: "run report",
        key: key.clone(),
        reason: e.to_string(),
    })?;
    store.put(&key, Bytes::from(json)).await?;
    Ok(())
}

impl Drop for LazyMount {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.replay.take() {
            t.abort();
        }
        if let Some(t) = self.flusher.take() {
            t.abort();
        }
        // The handle unmounts when dropped.
    }
}

/// The profile of a mount, being read in the background ([`read_profile`]); dropping it stops
/// the read.
pub struct ProfileRead(JoinHandle<Result<Profile>>);

impl Drop for ProfileRead {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl ProfileRead {
    /// A profile being read by `read`, which starts now.
    pub fn spawn(
        read: impl std::future::Future<Output = Result<Profile>> + Send + 'static,
    ) -> ProfileRead {
        ProfileRead(tokio::spawn(read))
    }
}

/// Starts reading the profile under `artifacts` if `cfg` prefetches, for
/// [`LazyMount::mount_with`]: started before the tree is at hand, the two reads overlap.
pub fn read_profile(
    store: &Store,
    artifacts: Option<&ArtifactDir>,
    cfg: &LazyConfig,
) -> Option<ProfileRead> {
    let dir = artifacts?.clone();
    let store = store.clone();
    cfg.prefetch
        .then(|| ProfileRead::spawn(async move { load_profile(&store, &dir).await }))
}

/// Replays the profile's plan (when prefetching) while merging traces that dead mounts left
/// (when recording; they count from the next mount on). Runs in the background: a store that
/// fails here, or a profile that cannot be read, costs this mount its prefetch (with a
/// warning), never the mount itself.
#[allow(clippy::too_many_arguments)]
async fn prepare_and_replay(
    store: Store,
    dir: ArtifactDir,
    profile: Option<ProfileRead>,
    chunks_in_order: Vec<(ChunkId, u32)>,
    budget: u64,
    cfg: LazyConfig,
    loader: Arc<Loader>,
    stop: tokio::sync::watch::Receiver<bool>,
    planned: Planned,
) -> ReplayStats {
    let Planned {
        plan: plan_tx,
        replaying: replaying_tx,
    } = planned;
    let replaying = async {
        let Some(mut profile) = profile else {
            return ReplayStats::default();
        };
        let plan = match (&mut profile.0).await {
            Ok(Ok(profile)) if profile.runs == 0 && cfg.fetch_all_without_profile => {
                let mut total = 0u64;
                let plan: Vec<(ChunkId, u32)> = chunks_in_order
                    .into_iter()
                    .take_while(|(_, len)| {
                        total += u64::from(*len);
                        total <= budget
                    })
                    .collect();
                tracing::info!(
                    planned = plan.len(),
                    "no profile yet; prefetching the whole tree"
                );
                if let Some(tx) = plan_tx {
                    let _ = tx.send(Vec::new());
                }
                plan
            }
            Ok(Ok(profile)) => {
                let present: HashSet<ChunkId> = chunks_in_order.iter().map(|(id, _)| *id).collect();
                let plan = profile.plan(&present, budget);
                tracing::info!(runs = profile.runs, planned = plan.len(), "profile loaded");
                if let Some(tx) = plan_tx {
                    let _ = tx.send(plan.clone());
                }
                plan
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not read the profile; not prefetching");
                return ReplayStats::default();
            }
            Err(e) => {
                tracing::warn!(error = %e, "profile task failed; not prefetching");
                return ReplayStats::default();
            }
        };
        let Some(hook) = cfg.on_plan.as_ref().filter(|_| !plan.is_empty()) else {
            return replay(loader, plan, cfg.replay, stop).await;
        };
        (hook.0)(plan.iter().map(|(id, _)| *id).collect()).await;
        let chunks = loader.chunks().clone();
        let stats = replay(loader, plan, cfg.replay, stop).await;
        let dropped = chunks.release_held();
        if dropped > 0 {
            tracing::debug!(dropped, "frames held for the replay and not taken");
        }
        stats
    };
    let merging = async {
        if cfg.record
            && let Err(e) =
                merge_leftover_traces(&store, &dir, cfg.stale_trace_after, cfg.decay_runs).await
        {
            tracing::warn!(error = %e, "could not merge the traces of earlier mounts");
        }
    };
    let stats = tokio::join!(replaying, merging).0;
    let _ = replaying_tx.send(false);
    stats
}

/// What [`prepare_and_replay`] tells the mount: the plan once it is known (dropped unsent
/// when there is none), and that the replay is over.
struct Planned {
    plan: Option<tokio::sync::oneshot::Sender<Vec<(ChunkId, u32)>>>,
    replaying: tokio::sync::watch::Sender<bool>,
}

/// Writes the trace so far every `every` while it grows, and at least every `heartbeat` (so
/// that other mounts never take a live trace for a dead one).
async fn flush_periodically(
    store: Store,
    key: String,
    run: String,
    loader: Arc<Loader>,
    every: Duration,
    heartbeat: Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every.min(heartbeat).max(Duration::from_millis(100)));
    tick.tick().await;
    let (mut written, mut last) = (0usize, Instant::now());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let accesses = loader.trace();
        if accesses.len() == written && last.elapsed() < heartbeat {
            continue;
        }
        let trace = Trace::new(&run, &accesses, now_ms(), false);
        match trace.encode() {
            Ok(bytes) => match store.put(&key, bytes).await {
                Ok(()) => (written, last) = (accesses.len(), Instant::now()),
                Err(e) => tracing::warn!(error = %e, "could not write the trace"),
            },
            Err(e) => tracing::warn!(error = %e, "could not encode the trace"),
        }
    }
}
