//! Layers served lazily: a layer whose descriptor names an image in the store
//! ([`crate::LAYER_ANNOTATION`], written by `hotstart image convert`) is not downloaded and
//! unpacked by containerd; the snapshotter mounts that image read-only at the layer's directory
//! instead (the lazy loader: chunks fetched at first read and verified, first reads recorded
//! into the image's profile, the profile replayed and the page cache warmed at the next mount),
//! records the layer as committed, and tells containerd it exists. Overlayfs stacks it like any
//! other layer.
//!
//! containerd prepares an image's layers one after another. When CRI passes the layers above
//! the one being prepared (`containerd.io/snapshot/cri.image-layers`), their images are opened
//! ahead (record, tree, profile) while this layer mounts, so each later layer mounts without
//! those round trips. (Fetching their hot chunks ahead too was slower on two cores: decoding
//! and caching them competed with the mount in progress.)
//!
//! A layer that cannot be mounted (no store configured, the image not in the store, the store
//! unreachable) is left to containerd, which downloads and unpacks it as usual: a pull never
//! fails for it. A layer recorded as lazy is mounted again when the snapshotter starts, and
//! before any mount that stacks on it; if that fails, the mount is refused (`Unavailable`)
//! rather than served with the layer's files missing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hotstart_store::Tree;
use tokio::sync::Mutex;
use tonic::Status;
use tracing::{info, warn};

use super::state::{SnapshotError, Snapshots, Usage};
use crate::convert::layer_image;
use crate::image::{ImageRecord, Images};
use crate::layout::ImageRef;
use crate::mount::{LazyConfig, LazyMount, ProfileRead, load_profile};
use crate::profile::Profile;

/// The snapshot label containerd passes with the chain id of the layer it is about to unpack.
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";

/// The label CRI passes with the digests of the layer being prepared and those above it.
pub const IMAGE_LAYERS_LABEL: &str = "containerd.io/snapshot/cri.image-layers";

/// Layers opened ahead at most (the rest are opened when prepared).
const MAX_AHEAD: usize = 64;

/// How long a layer opened ahead waits for its prepare (containerd skips the prepare of a
/// layer it already has) before it is dropped.
const AHEAD_FOR: std::time::Duration = std::time::Duration::from_secs(120);

/// A layer image being opened ahead, since when.
type Ahead = (
    std::time::Instant,
    tokio::task::JoinHandle<crate::Result<Opened>>,
);

/// A layer's image, opened ahead of its prepare.
struct Opened {
    record: ImageRecord,
    tree: Tree,
    profile: Profile,
}

/// The lazily served layers of one snapshotter.
#[derive(Debug)]
pub struct Lazy {
    images: Images,
    cfg: LazyConfig,
    /// Live mounts by snapshot id.
    mounted: Mutex<HashMap<u64, LazyMount>>,
    /// Layer images being opened ahead, by image name.
    ahead: std::sync::Mutex<HashMap<String, Ahead>>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("image", &self.record.image)
            .finish()
    }
}

impl Lazy {
    pub fn new(images: Images, cfg: LazyConfig) -> Lazy {
        Lazy {
            images,
            cfg,
            mounted: Mutex::new(HashMap::new()),
            ahead: std::sync::Mutex::new(HashMap::new()),
        }
    }

    fn unavailable(&self, image: &str, e: impl std::fmt::Display) -> Status {
        Status::unavailable(format!(
            "layer image {image} cannot be mounted from {}: {e}",
            self.images.store().url()
        ))
    }

    /// Mounts every layer of `layers` (id, image) that is not mounted.
    pub async fn ensure(
        &self,
        snapshots: &Snapshots,
        layers: Vec<(u64, String)>,
    ) -> Result<(), Status> {
        if layers.is_empty() {
            return Ok(());
        }
        let mut mounted = self.mounted.lock().await;
        for (id, image) in layers {
            if mounted.contains_key(&id) {
                continue;
            }
            let unavailable = |e: &dyn std::fmt::Display| {
                self.unavailable(
                    &image,
                    format!("{e}; containers on this layer start once it can be mounted again"),
                )
            };
            let r = ImageRef::parse(&image).map_err(|e| unavailable(&e))?;
            let m = self
                .images
                .mount(&r, &snapshots.fs_dir(id), self.cfg.clone())
                .await
                .map_err(|e| unavailable(&e))?;
            info!(%image, id, "lazy layer mounted");
            mounted.insert(id, m);
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
        let ahead = self.take_ahead(image);
        let (record, tree, profile) = match ahead {
            Some(handle) => match handle.await {
                Ok(Ok(o)) => (o.record, o.tree, Some(ProfileRead::ready(o.profile))),
                _ => self.open(&r).await?,
            },
            None => self.open(&r).await?,
        };
        let id = blocking(snapshots, {
            let (name, parent) = (name.to_string(), parent.to_string());
            move |s| s.reserve_lazy(&name, &parent)
        })
        .await?;
        let mounted = match LazyMount::mount_with(
            self.images.chunks().clone(),
            &tree,
            image,
            Some(r.artifacts()),
            &snapshots.fs_dir(id),
            self.cfg.clone(),
            profile,
        )
        .await
        {
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
            let _ = mounted.unmount().await;
            discard(snapshots, id).await?;
            return Err(e);
        }
        info!(%image, snapshot = name, id, "layer served lazily");
        self.mounted.lock().await.insert(id, mounted);
        Ok(())
    }

    /// The record and tree of `image`, with its profile being read meanwhile.
    async fn open(
        &self,
        image: &ImageRef,
    ) -> Result<(ImageRecord, Tree, Option<ProfileRead>), Status> {
        let profile = crate::read_profile(self.images.store(), Some(&image.artifacts()), &self.cfg);
        let (record, tree) = self
            .images
            .open(image)
            .await
            .map_err(|e| self.unavailable(&image.to_string(), e))?;
        Ok((record, tree, profile))
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
            let (images, prefetch) = (self.images.clone(), self.cfg.prefetch);
            let handle = tokio::spawn(open_ahead(images, image, prefetch));
            ahead.insert(key, (std::time::Instant::now(), handle));
        }
    }

    /// Unmounts the layer of snapshot `id` (its run report and trace are written to the store).
    pub async fn release(&self, id: u64) {
        let m = self.mounted.lock().await.remove(&id);
        if let Some(m) = m
            && let Err(e) = m.unmount().await
        {
            warn!(id, error = %e, "lazy layer unmount");
        }
    }

    /// Unmounts every layer (at shutdown).
    pub async fn release_all(&self) {
        let all: Vec<LazyMount> = self.mounted.lock().await.drain().map(|(_, m)| m).collect();
        for m in all {
            if let Err(e) = m.unmount().await {
                warn!(error = %e, "lazy layer unmount");
            }
        }
    }
}

/// Opens `image`: its record and tree, and with `prefetch` its profile.
async fn open_ahead(images: Images, image: ImageRef, prefetch: bool) -> crate::Result<Opened> {
    let artifacts = image.artifacts();
    let (opened, profile) = tokio::join!(images.open(&image), async {
        if prefetch {
            load_profile(images.store(), &artifacts)
                .await
                .unwrap_or_default()
        } else {
            Profile::default()
        }
    });
    let (record, tree) = opened?;
    Ok(Opened {
        record,
        tree,
        profile,
    })
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
