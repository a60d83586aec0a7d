//! Layers served lazily: a layer whose descriptor names an image in the store
//! ([`crate::LAYER_ANNOTATION`], written by `hotstart image convert`) is not downloaded and
//! unpacked by containerd; the snapshotter mounts that image read-only at the layer's directory
//! instead (the lazy loader: chunks fetched at first read and verified, the profile replayed
//! and the page cache warmed at mount), records the layer as committed, and tells containerd it
//! exists. Overlayfs stacks it like any other layer.
//!
//! **One profile per container image.** CRI names the image being pulled in each layer's labels
//! ([`IMAGE_REF_LABEL`]); every layer of that image replays the chunks of the image's one
//! profile that it holds ([`crate::container_image`] says where it lives), so the hot set of a
//! start is one list across all its layers. Without that label (a pull outside CRI), a layer
//! keeps a profile of its own.
//!
//! **A run per container start.** A start begins when containerd prepares a container's
//! writable snapshot on lazy layers ([`Lazy::start`]) and ends when that snapshot is removed or
//! after `record_for`, whichever is first ([`Lazy::finish`]). Its report (the layers' counters
//! over the start: reads, hit rate, stall, fetches, and for the first start on new mounts the
//! mounts' prefetch, warming and waste) is logged and stored under the image's `runs/`. The
//! first start on newly mounted layers also merges what it read first, in the order it read
//! it across layers, into the image's profile as one run; a later start on the same mounts
//! reads from memory and the page cache, so it reports without changing the profile.
//!
//! containerd prepares an image's layers one after another. When CRI passes the layers above
//! the one being prepared (`containerd.io/snapshot/cri.image-layers`), their images are opened
//! ahead (record and tree) while this layer mounts, so each later layer mounts without those
//! round trips; the image's profile is read once for all of them. Replays wait (at most
//! [`OPENS_FIRST_FOR`]) until those opens are done: a tree that shares the link with a replay's
//! window of chunk fetches arrives at a fraction of the bandwidth, and the pull, which every
//! replayed chunk is for, waits on the tree. (Fetching their hot chunks ahead too was slower on
//! two cores: decoding and caching them competed with the mount in progress.)
//!
//! A layer that cannot be mounted (no store configured, the image not in the store, the store
//! unreachable) is left to containerd, which downloads and unpacks it as usual: a pull never
//! fails for it. A layer recorded as lazy is mounted again when the snapshotter starts, and
//! before any mount that stacks on it; if that fails, the mount is refused (`Unavailable`)
//! rather than served with the layer's files missing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use hotstart_store::Tree;
use tokio::sync::Mutex;
use tonic::Status;
use tracing::{info, warn};

pub use super::state::{IMAGE_LAYERS_LABEL, IMAGE_REF_LABEL};
use super::state::{LazyLayer, SnapshotError, Snapshots, Usage};
use crate::convert::{container_image, layer_image};
use crate::image::{ImageRecord, Images};
use crate::layout::{ArtifactDir, ImageRef};
use crate::loader::{FirstAccess, Loader, LoaderStats};
use crate::mount::{
    LazyConfig, LazyMount, PlanHook, ProfileRead, load_profile, merge_traces, new_run_id, now_ms,
    put_report,
};
use crate::profile::{Profile, Trace};
use crate::report::MountReport;

/// The snapshot label containerd passes with the chain id of the layer it is about to unpack.
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";

/// How long a container start is recorded at most, by default (see [`Lazy::with_record_for`]).
pub const RECORD_FOR: Duration = Duration::from_secs(60);

/// Layers opened ahead at most (the rest are opened when prepared).
const MAX_AHEAD: usize = 64;

/// How long a layer opened ahead waits for its prepare (containerd skips the prepare of a
/// layer it already has) before it is dropped.
const AHEAD_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// How long a replay waits at most for layers being opened ahead (see the module
/// documentation).
const OPENS_FIRST_FOR: Duration = Duration::from_millis(500);

/// A layer image being opened ahead, since when.
type Ahead = (
    std::time::Instant,
    tokio::task::JoinHandle<crate::Result<Opened>>,
);

/// Counts one open ahead in progress, until dropped (also when its task is aborted).
struct Opening(Arc<tokio::sync::watch::Sender<usize>>);

impl Opening {
    fn new(count: &Arc<tokio::sync::watch::Sender<usize>>) -> Opening {
        count.send_modify(|n| *n += 1);
        Opening(count.clone())
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// A layer's image, opened ahead of its prepare.
struct Opened {
    record: ImageRecord,
    tree: Tree,
}

/// A profile being read for the layers of a pull, shared by them.
type SharedProfile = Shared<BoxFuture<'static, Result<Profile, String>>>;

/// How long a profile read for one layer serves the next layers of its image.
const PROFILE_FOR: Duration = Duration::from_secs(10);

/// The lazily served layers of one snapshotter.
#[derive(Debug)]
pub struct Lazy {
    images: Images,
    /// How layers are mounted: never recording themselves (starts are recorded instead).
    cfg: LazyConfig,
    /// Whether starts record their first reads into the profile.
    record: bool,
    record_for: Duration,
    /// Live mounts by snapshot id.
    mounted: Mutex<HashMap<u64, Layer>>,
    /// Layer images being opened ahead, by image name.
    ahead: std::sync::Mutex<HashMap<String, Ahead>>,
    /// How many opens ahead are in progress (replays wait for none).
    opening: Arc<tokio::sync::watch::Sender<usize>>,
    /// Container starts being recorded, by the key of the container's snapshot.
    starts: std::sync::Mutex<HashMap<String, Start>>,
    /// Profiles read lately, by key, since when.
    profiles: std::sync::Mutex<HashMap<String, (Instant, SharedProfile)>>,
}

/// A mounted layer.
#[derive(Debug)]
struct Layer {
    mount: LazyMount,
    /// Where the profile it replayed lives: its container image's, or its own.
    dir: ArtifactDir,
    /// What reports of starts on it are called: the container image, or the layer's image.
    label: String,
    /// Whether a start has taken its first reads for the profile.
    recorded: bool,
}

/// A container start being recorded (see the module documentation).
#[derive(Debug)]
struct Start {
    run: String,
    dir: ArtifactDir,
    label: String,
    started: Instant,
    started_ms: u64,
    /// Each layer's loader and its counters when the start began.
    layers: Vec<(Arc<Loader>, LoaderStats)>,
    /// Whether its first reads go into the profile.
    record: bool,
    /// Ends the start after `record_for`.
    timer: tokio::task::AbortHandle,
}

/// Where the profile and starts of a layer pulled for `pulled_for` live, and their name.
fn artifacts(image: &ImageRef, pulled_for: Option<&str>) -> (ArtifactDir, String) {
    match pulled_for {
        Some(r) => (container_image(r).artifacts(), r.to_string()),
        None => (image.artifacts(), image.to_string()),
    }
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("image", &self.record.image)
            .finish()
    }
}

impl Lazy {
    /// Layers of `images` mounted as `cfg` says; with `cfg.record`, container starts are
    /// recorded into their image's profile.
    pub fn new(images: Images, cfg: LazyConfig) -> Lazy {
        Lazy::waiting_for_opens(images, cfg, OPENS_FIRST_FOR)
    }

    /// [`Lazy::new`], with replays waiting at most `opens_first_for` for the opens ahead.
    fn waiting_for_opens(images: Images, cfg: LazyConfig, opens_first_for: Duration) -> Lazy {
        let opening = Arc::new(tokio::sync::watch::Sender::new(0usize));
        let (waits, then) = (opening.clone(), cfg.on_plan.clone());
        let after_opens = PlanHook(Arc::new(move |plan| {
            let (mut opens, then) = (waits.subscribe(), then.clone());
            async move {
                let _ = tokio::time::timeout(opens_first_for, opens.wait_for(|n| *n == 0)).await;
                if let Some(hook) = then {
                    (hook.0)(plan).await;
                }
            }
            .boxed()
        }));
        Lazy {
            images,
            record: cfg.record,
            cfg: LazyConfig {
                record: false,
                on_plan: Some(after_opens),
                ..cfg
            },
            record_for: RECORD_FOR,
            mounted: Mutex::new(HashMap::new()),
            ahead: std::sync::Mutex::new(HashMap::new()),
            opening,
            starts: std::sync::Mutex::new(HashMap::new()),
            profiles: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The profile under `dir` (when prefetching), read once for every layer of a pull: each
    /// layer of an image replays the part of the image's profile it holds.
    fn profile(&self, dir: &ArtifactDir) -> Option<ProfileRead> {
        if !self.cfg.prefetch {
            return None;
        }
        let mut profiles = self
            .profiles
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        profiles.retain(|_, (since, _)| since.elapsed() < PROFILE_FOR);
        let read = profiles
            .entry(dir.profile_key())
            .or_insert_with(|| {
                let (store, dir) = (self.images.store().clone(), dir.clone());
                let read =
                    async move { load_profile(&store, &dir).await.map_err(|e| e.to_string()) };
                (Instant::now(), read.boxed().shared())
            })
            .1
            .clone();
        Some(ProfileRead::spawn(async move {
            read.await.map_err(|message| crate::Error::Task {
                what: "read the profile",
                message,
            })
        }))
    }

    /// Records a container start for at most `d` (its report then covers that long; the
    /// start ends earlier when its container's snapshot is removed).
    pub fn with_record_for(self, d: Duration) -> Lazy {
        Lazy {
            record_for: d,
            ..self
        }
    }

    fn unavailable(&self, image: &str, e: impl std::fmt::Display) -> Status {
        Status::unavailable(format!(
            "layer image {image} cannot be mounted from {}: {e}",
            self.images.store().url()
        ))
    }

    /// Mounts every layer of `layers` that is not mounted.
    pub async fn ensure(&self, snapshots: &Snapshots, layers: &[LazyLayer]) -> Result<(), Status> {
        if layers.is_empty() {
            return Ok(());
        }
        let mut mounted = self.mounted.lock().await;
        for layer in layers {
            if mounted.contains_key(&layer.id) {
                continue;
            }
            let (id, image) = (layer.id, &layer.image);
            let unavailable = |e: &dyn std::fmt::Display| {
                self.unavailable(
                    image,
                    format!("{e}; containers on this layer start once it can be mounted again"),
                )
            };
            let r = ImageRef::parse(image).map_err(|e| unavailable(&e))?;
            let (dir, label) = artifacts(&r, layer.pulled_for.as_deref());
            let profile = self.profile(&dir);
            let (_, tree) = self.images.open(&r).await.map_err(|e| unavailable(&e))?;
            let m = self
                .mount(snapshots, id, &tree, image, &dir, profile)
                .await
                .map_err(|e| unavailable(&e))?;
            info!(%image, id, "lazy layer mounted");
            mounted.insert(
                id,
                Layer {
                    mount: m,
                    dir,
                    label,
                    recorded: false,
                },
            );
        }
        Ok(())
    }

    /// Serves the layer `image` as the committed snapshot `name` over `parent`. Returns
    /// [`SnapshotError::AlreadyExists`] when `name` exists (what containerd is told either way),
    /// and any other error when the layer cannot be served lazily.
    pub async fn serve(
        &self,
        snapshots: &Arc<Snapshots>,
        name: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
        image: &str,
    ) -> Result<(), Status> {
        let r = ImageRef::parse(image).map_err(|e| self.unavailable(image, e))?;
        let (dir, label) = artifacts(&r, labels.get(IMAGE_REF_LABEL).map(String::as_str));
        let ahead = self.take_ahead(image);
        let profile = self.profile(&dir);
        let (record, tree) = match ahead {
            Some(handle) => match handle.await {
                Ok(Ok(o)) => (o.record, o.tree),
                _ => self.open(&r).await?,
            },
            None => self.open(&r).await?,
        };
        let id = blocking(snapshots, {
            let (name, parent) = (name.to_string(), parent.to_string());
            move |s| s.reserve_lazy(&name, &parent)
        })
        .await?;
        let mounted = match self.mount(snapshots, id, &tree, image, &dir, profile).await {
            Ok(m) => m,
            Err(e) => {
                discard(snapshots, id).await?;
                return Err(self.unavailable(image, e));
            }
        };
        let c = record.counts;
        let usage = Usage {
            size: c.bytes as i64,
            inodes: (c.files + c.dirs + c.symlinks) as i64,
        };
        let recorded = blocking(snapshots, {
            let (name, parent, image) = (name.to_string(), parent.to_string(), image.to_string());
            move |s| s.record_lazy(&name, id, &parent, labels, &image, usage)
        })
        .await;
        if let Err(e) = recorded {
            close(mounted).await;
            discard(snapshots, id).await?;
            return Err(e);
        }
        info!(%image, snapshot = name, id, "layer served lazily");
        self.mounted.lock().await.insert(
            id,
            Layer {
                mount: mounted,
                dir,
                label,
                recorded: false,
            },
        );
        Ok(())
    }

    /// Mounts `tree` (of the layer image `image`) at the directory of snapshot `id`, replaying
    /// `profile` (the one under `dir`, being read).
    async fn mount(
        &self,
        snapshots: &Snapshots,
        id: u64,
        tree: &Tree,
        image: &str,
        dir: &ArtifactDir,
        profile: Option<ProfileRead>,
    ) -> crate::Result<LazyMount> {
        LazyMount::mount_with(
            self.images.chunks().clone(),
            tree,
            image,
            Some(dir.clone()),
            &snapshots.fs_dir(id),
            self.cfg.clone(),
            profile,
        )
        .await
    }

    /// The record and tree of `image`.
    async fn open(&self, image: &ImageRef) -> Result<(ImageRecord, Tree), Status> {
        self.images
            .open(image)
            .await
            .map_err(|e| self.unavailable(&image.to_string(), e))
    }

    fn take_ahead(&self, image: &str) -> Option<tokio::task::JoinHandle<crate::Result<Opened>>> {
        self.ahead
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(image)
            .map(|(_, handle)| handle)
    }

    /// Starts opening the images of the layers above the one being prepared (`layers`: the
    /// value of [`IMAGE_LAYERS_LABEL`], this layer first). Layers that are not converted fail
    /// to open and are prepared as usual.
    pub fn open_ahead(&self, layers: &str) {
        let mut ahead = self
            .ahead
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ahead.retain(|_, (since, handle)| {
            let keep = since.elapsed() < AHEAD_FOR;
            if !keep {
                handle.abort();
            }
            keep
        });
        for digest in layers.split(',').skip(1) {
            let Ok(image) = layer_image(digest.trim()) else {
                continue;
            };
            let key = image.to_string();
            if ahead.len() >= MAX_AHEAD || ahead.contains_key(&key) {
                continue;
            }
            let images = self.images.clone();
            let open = Opening::new(&self.opening);
            let handle = tokio::spawn(async move {
                let (record, tree) = images.open(&image).await?;
                drop(open);
                Ok(Opened { record, tree })
            });
            ahead.insert(key, (std::time::Instant::now(), handle));
        }
    }

    /// Begins recording a container start: containerd prepared the container's snapshot `key`
    /// over the lazy layers `layers` (top first, all mounted). Ends at [`Lazy::finish`] or
    /// after `record_for`.
    pub async fn start(self: &Arc<Self>, key: &str, layers: &[LazyLayer]) {
        let Some(top) = layers.first() else {
            return;
        };
        let mut mounted = self.mounted.lock().await;
        let Some((dir, label)) = mounted
            .get(&top.id)
            .map(|l| (l.dir.clone(), l.label.clone()))
        else {
            return;
        };
        // The first start on new mounts: nothing read through them yet.
        let record = self.record
            && layers.iter().all(|l| {
                mounted
                    .get(&l.id)
                    .is_some_and(|m| !m.recorded && m.mount.loader().stats().chunks_read == 0)
            });
        let mut loaders = Vec::new();
        for l in layers {
            if let Some(m) = mounted.get_mut(&l.id) {
                m.recorded |= record;
                let loader = m.mount.loader().clone();
                // The first start takes its mounts' prefetch and warming as its own.
                let base = if record {
                    LoaderStats::default()
                } else {
                    loader.stats()
                };
                loaders.push((loader, base));
            }
        }
        drop(mounted);
        let this = self.clone();
        let k = key.to_string();
        let after = self.record_for;
        let timer = tokio::spawn(async move {
            tokio::time::sleep(after).await;
            let start = this.take_start(&k);
            if let Some(s) = start {
                this.end(s).await;
            }
        });
        let run = new_run_id();
        info!(container = key, image = %label, %run, record, "container start on lazy layers");
        let earlier = self
            .starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                key.to_string(),
                Start {
                    run,
                    dir,
                    label,
                    started: Instant::now(),
                    started_ms: now_ms(),
                    layers: loaders,
                    record,
                    timer: timer.abort_handle(),
                },
            );
        if let Some(s) = earlier {
            s.timer.abort();
        }
    }

    /// Ends the start recorded for the container snapshot `key`, if one is: its report is
    /// stored, and its trace merged into the profile.
    pub async fn finish(&self, key: &str) {
        if let Some(s) = self.take_start(key) {
            s.timer.abort();
            self.end(s).await;
        }
    }

    fn take_start(&self, key: &str) -> Option<Start> {
        self.starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(key)
    }

    /// Reports `s`, and with its `record`, merges what it read first into its profile as one
    /// run (accesses timed from the start, across layers). A store that fails costs the
    /// report or the profile's update, with a warning; never the container.
    async fn end(&self, s: Start) {
        let mut stats = LoaderStats::default();
        let mut accesses: Vec<FirstAccess> = Vec::new();
        for (loader, base) in &s.layers {
            stats += loader.stats().since(base);
            if s.record {
                let origin = loader.started();
                accesses.extend(loader.trace().into_iter().map(|a| FirstAccess {
                    offset: (origin + a.offset).saturating_duration_since(s.started),
                    ..a
                }));
            }
        }
        let report = MountReport::new(
            &s.run,
            &s.label,
            s.started_ms,
            s.started.elapsed().as_secs_f64(),
            &stats,
            None,
        );
        info!(image = %s.label, run = %s.run, "container start: {}", report.summary());
        let store = self.images.store();
        if !accesses.is_empty() {
            accesses.sort_by_key(|a| (a.offset, a.id));
            let trace = Trace::new(&s.run, &accesses, now_ms(), true);
            let merged = merge_traces(
                store,
                &s.dir,
                std::slice::from_ref(&trace),
                self.cfg.decay_runs,
            )
            .await;
            if let Err(e) = merged {
                warn!(image = %s.label, error = %e, "could not merge the start into the profile");
            }
            // The next pull reads the profile with this start in it.
            self.profiles
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&s.dir.profile_key());
        }
        if let Err(e) = put_report(store, &s.dir, &report).await {
            warn!(image = %s.label, error = %e, "could not store the start's report");
        }
    }

    /// Unmounts the layer of snapshot `id`.
    pub async fn release(&self, id: u64) {
        let m = self.mounted.lock().await.remove(&id);
        if let Some(l) = m {
            close(l.mount).await;
        }
    }

    /// Ends every start being recorded, then unmounts every layer (at shutdown).
    pub async fn release_all(&self) {
        let starts: Vec<Start> = self
            .starts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .map(|(_, s)| s)
            .collect();
        for s in starts {
            s.timer.abort();
            self.end(s).await;
        }
        let all: Vec<Layer> = self.mounted.lock().await.drain().map(|(_, l)| l).collect();
        for l in all {
            close(l.mount).await;
        }
    }
}

/// Unmounts a layer (what was read is recorded per start, not per mount).
async fn close(m: LazyMount) {
    if let Err(e) = m.close().await {
        warn!(error = %e, "lazy layer unmount");
    }
}

/// Deletes the directory of a lazy layer that was not recorded.
async fn discard(snapshots: &Arc<Snapshots>, id: u64) -> Result<(), Status> {
    blocking(snapshots, move |s| {
        s.discard(id);
        Ok(())
    })
    .await
}

/// Runs `call` on the blocking pool.
pub(super) async fn blocking<T: Send + 'static>(
    snapshots: &Arc<Snapshots>,
    call: impl FnOnce(&Snapshots) -> Result<T, SnapshotError> + Send + 'static,
) -> Result<T, Status> {
    let s = snapshots.clone();
    tokio::task::spawn_blocking(move || call(&s))
        .await
        .map_err(|e| Status::internal(format!("snapshotter task failed: {e}")))?
        .map_err(Status::from)
}

#[cfg(test)]
mod tests {
    use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};
    use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

    use super::*;
    use crate::BuildConfig;

    #[tokio::test]
    async fn replays_wait_for_the_layers_being_opened_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("f"), b"bytes").unwrap();
        let store = Store::open(dir.path().join("store").to_str().unwrap()).unwrap();
        let chunks = |s: Store| ChunkStore::new(s, ChunkStoreConfig::default()).unwrap();
        let (this, above) = (
            format!("sha256:{}", "a".repeat(64)),
            format!("sha256:{}", "b".repeat(64)),
        );
        let image = layer_image(&above).unwrap();
        Images::new(chunks(store.clone()))
            .build(&src, &image, &BuildConfig::default())
            .await
            .unwrap();
        // The layer above is store round trips of 100 ms away; the replay may wait far longer
        // than the open takes, so only a replay that does not wait finds it still in progress.
        let link = Arc::new(Throttle::new(ThrottleConfig {
            latency: Duration::from_millis(100),
            ..ThrottleConfig::default()
        }));
        let slow = store.wrap(|inner| link.clone().wrap(inner));
        let lazy = Lazy::waiting_for_opens(
            Images::new(chunks(slow)),
            LazyConfig::default(),
            Duration::from_secs(60),
        );
        lazy.open_ahead(&format!("{this},{above}"));
        assert_eq!(
            *lazy.opening.borrow(),
            1,
            "only the layer above is opened ahead"
        );
        let hook = lazy.cfg.on_plan.clone().expect("the replay's hook");
        (hook.0)(Vec::new()).await;
        assert_eq!(
            *lazy.opening.borrow(),
            0,
            "the replay went ahead of an open"
        );
        let opened = lazy
            .take_ahead(&image.to_string())
            .unwrap()
            .await
            .unwrap()
            .unwrap();
        assert_eq!(opened.record.counts.files, 1);
    }
}
