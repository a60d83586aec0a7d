//! Layers served lazily: a layer whose descriptor names an image in the store
//! ([`crate::LAYER_ANNOTATION`], written by `hotstart image convert`) is not downloaded and
//! unpacked by containerd; the snapshotter mounts that image read-only at the layer's directory
//! instead (the lazy loader: chunks fetched at first read and verified, first reads recorded
//! into the image's profile, the profile replayed and the page cache warmed at the next mount),
//! records the layer as committed, and tells containerd it exists. Overlayfs stacks it like any
//! other layer.
//!
//! A layer that cannot be mounted (no store configured, the image not in the store, the store
//! unreachable) is left to containerd, which downloads and unpacks it as usual: a pull never
//! fails for it. A layer recorded as lazy is mounted again when the snapshotter starts, and
//! before any mount that stacks on it; if that fails, the mount is refused (`Unavailable`)
//! rather than served with the layer's files missing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use tokio::sync::Mutex;
use tonic::Status;
use tracing::{info, warn};

use super::state::{SnapshotError, Snapshots, Usage};
use crate::image::Images;
use crate::layout::ImageRef;
use crate::mount::{LazyConfig, LazyMount};

/// The snapshot label containerd passes with the chain id of the layer it is about to unpack.
pub const TARGET_LABEL: &str = "containerd.io/snapshot.ref";

/// The lazily served layers of one snapshotter.
#[derive(Debug)]
pub struct Lazy {
    images: Images,
    cfg: LazyConfig,
    /// Live mounts by snapshot id.
    mounted: Mutex<HashMap<u64, LazyMount>>,
}

impl Lazy {
    pub fn new(images: Images, cfg: LazyConfig) -> Lazy {
        Lazy {
            images,
            cfg,
            mounted: Mutex::new(HashMap::new()),
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
        let record = self
            .images
            .record(&r)
            .await
            .map_err(|e| self.unavailable(image, e))?;
        let id = blocking(snapshots, {
            let (name, parent) = (name.to_string(), parent.to_string());
            move |s| s.reserve_lazy(&name, &parent)
        })
        .await?;
        let mounted = match self
            .images
            .mount(&r, &snapshots.fs_dir(id), self.cfg.clone())
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
