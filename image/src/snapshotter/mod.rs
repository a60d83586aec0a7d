//! `hotstart snapshotter`: a containerd snapshotter served as a proxy plugin (gRPC on a unix
//! socket).
//!
//! containerd keeps its own record of snapshots per namespace and calls this service for the
//! files: prepare, view, mounts, commit, remove, stat, update, usage, walk and cleanup. The
//! snapshots are overlayfs layers in local directories ([`state`]), and their metadata is
//! written durably on every change, so a restarted snapshotter serves every snapshot containerd
//! knows of. See docs/SEMANTICS.md, "Container images".

pub mod lazy;
pub mod state;

/// containerd's Snapshots service (generated; see the files' headers).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod api {
    pub mod types {
        include!("api/containerd.types.rs");
    }
    pub mod services {
        pub mod snapshots {
            pub mod v1 {
                include!("api/containerd.services.snapshots.v1.rs");
            }
        }
    }
}

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use api::services::snapshots::v1 as pb;
use pb::snapshots_server::{Snapshots as SnapshotsApi, SnapshotsServer};
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

pub use lazy::Lazy;
pub use state::{Kind, LazyLayer, Mount, Record, SnapshotError, Snapshots};

impl From<SnapshotError> for Status {
    fn from(e: SnapshotError) -> Status {
        let msg = e.to_string();
        match e {
            SnapshotError::NotFound { .. } => Status::not_found(msg),
            SnapshotError::AlreadyExists { .. } => Status::already_exists(msg),
            SnapshotError::Precondition { .. } => Status::failed_precondition(msg),
            SnapshotError::Invalid(_) => Status::invalid_argument(msg),
            SnapshotError::Io { .. } => Status::internal(msg),
        }
    }
}

/// The gRPC face of [`Snapshots`]: every call runs on the blocking pool (it touches files);
/// with [`Lazy`], layers converted by `hotstart image convert` are served lazily.
#[derive(Debug, Clone)]
pub struct Service {
    snapshots: Arc<Snapshots>,
    lazy: Option<Arc<Lazy>>,
}

impl Service {
    pub fn new(snapshots: Snapshots, lazy: Option<Lazy>) -> Service {
        Service {
            snapshots: Arc::new(snapshots),
            lazy: lazy.map(Arc::new),
        }
    }

    async fn run<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Snapshots) -> Result<T, SnapshotError> + Send + 'static,
    ) -> Result<Response<T>, Status> {
        lazy::blocking(&self.snapshots, call)
            .await
            .map(Response::new)
    }

    /// Mounts the lazily served layers `key` stacks on, if any is not mounted; they are
    /// returned, top first.
    async fn ensure_lazy(&self, key: &str) -> Result<Vec<LazyLayer>, Status> {
        let Some(lazy) = &self.lazy else {
            return Ok(Vec::new());
        };
        if key.is_empty() {
            return Ok(Vec::new());
        }
        let key = key.to_string();
        let layers = lazy::blocking(&self.snapshots, move |s| s.lazy_layers(&key)).await?;
        lazy.ensure(&self.snapshots, &layers).await?;
        Ok(layers)
    }

    /// Serves the layer containerd is about to unpack lazily, when its labels name an image
    /// and a target: `Some(status)` to answer with (`AlreadyExists`: containerd skips the
    /// layer's download), `None` to prepare as usual (containerd downloads and unpacks it).
    async fn try_lazy(&self, parent: &str, l: &BTreeMap<String, String>) -> Option<Status> {
        let lazy = self.lazy.as_ref()?;
        let (target, image) = (l.get(lazy::TARGET_LABEL)?, l.get(crate::LAYER_ANNOTATION)?);
        if let Some(layers) = l.get(lazy::IMAGE_LAYERS_LABEL) {
            lazy.open_ahead(layers);
        }
        match lazy
            .serve(&self.snapshots, target, parent, l.clone(), image)
            .await
        {
            Ok(()) => Some(Status::already_exists(format!(
                "snapshot {target:?} already exists (served lazily from {image})"
            ))),
            Err(s) if s.code() == tonic::Code::AlreadyExists => Some(s),
            Err(s) => {
                warn!(%image, error = %s.message(), "layer not served lazily; containerd unpacks it");
                None
            }
        }
    }

    /// Mounts every lazily served layer (in the background at start: containers that ran on
    /// them before the restart keep the old, dead mount anyway, and a mount that stacks on one
    /// mounts it first); a layer that fails is mounted again when a container needs it.
    pub async fn mount_lazy_layers(&self) {
        if let Some(lazy) = &self.lazy {
            for layer in self.snapshots.all_lazy() {
                let image = &layer.image;
                if let Err(e) = lazy
                    .ensure(&self.snapshots, std::slice::from_ref(&layer))
                    .await
                {
                    warn!(%image, error = %e.message(), "lazy layer not mounted at start");
                }
            }
        }
    }
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn info(key: String, r: Record) -> pb::Info {
    pb::Info {
        name: key,
        parent: r.parent,
        kind: match r.kind {
            Kind::View => pb::Kind::View,
            Kind::Active => pb::Kind::Active,
            Kind::Committed => pb::Kind::Committed,
        } as i32,
        created_at: Some(timestamp(r.created)),
        updated_at: Some(timestamp(r.updated)),
        labels: r.labels.into_iter().collect(),
    }
}

fn to_api(mounts: Vec<Mount>) -> Vec<api::types::Mount> {
    mounts
        .into_iter()
        .map(|m| api::types::Mount {
            r#type: m.kind,
            source: m.source,
            target: String::new(),
            options: m.options,
        })
        .collect()
}

fn labels(l: HashMap<String, String>) -> BTreeMap<String, String> {
    l.into_iter().collect()
}

#[tonic::async_trait]
impl SnapshotsApi for Service {
    async fn prepare(
        &self,
        r: Request<pb::PrepareSnapshotRequest>,
    ) -> Result<Response<pb::PrepareSnapshotResponse>, Status> {
        let r = r.into_inner();
        let l = labels(r.labels);
        debug!(key = %r.key, parent = %r.parent, labels = ?l, "prepare");
        if let Some(answer) = self.try_lazy(&r.parent, &l).await {
            return Err(answer);
        }
        let layers = self.ensure_lazy(&r.parent).await?;
        // A snapshot that is not a layer being unpacked is a container's: its start begins.
        let container = (!l.contains_key(lazy::TARGET_LABEL)).then(|| r.key.clone());
        let prepared = self
            .run(move |s| {
                let mounts = to_api(s.prepare(&r.key, &r.parent, l)?);
                Ok(pb::PrepareSnapshotResponse { mounts })
            })
            .await?;
        if let (Some(lazy), Some(key)) = (&self.lazy, container) {
            lazy.start(&key, &layers).await;
        }
        Ok(prepared)
    }

    async fn view(
        &self,
        r: Request<pb::ViewSnapshotRequest>,
    ) -> Result<Response<pb::ViewSnapshotResponse>, Status> {
        let r = r.into_inner();
        debug!(key = %r.key, parent = %r.parent, "view");
        self.ensure_lazy(&r.parent).await?;
        self.run(move |s| {
            let mounts = to_api(s.view(&r.key, &r.parent, labels(r.labels))?);
            Ok(pb::ViewSnapshotResponse { mounts })
        })
        .await
    }

    async fn mounts(
        &self,
        r: Request<pb::MountsRequest>,
    ) -> Result<Response<pb::MountsResponse>, Status> {
        let key = r.into_inner().key;
        self.ensure_lazy(&key).await?;
        self.run(move |s| {
            let mounts = to_api(s.mounts(&key)?);
            Ok(pb::MountsResponse { mounts })
        })
        .await
    }

    async fn commit(&self, r: Request<pb::CommitSnapshotRequest>) -> Result<Response<()>, Status> {
        let r = r.into_inner();
        debug!(name = %r.name, key = %r.key, "commit");
        self.run(move |s| s.commit(&r.name, &r.key, labels(r.labels)))
            .await
    }

    async fn remove(&self, r: Request<pb::RemoveSnapshotRequest>) -> Result<Response<()>, Status> {
        let key = r.into_inner().key;
        debug!(%key, "remove");
        if let Some(lazy) = &self.lazy {
            lazy.finish(&key).await;
            // Unmounted only once nothing stacks on it (and so only if it can be removed).
            let k = key.clone();
            let rec = lazy::blocking(&self.snapshots, move |s| s.removable(&k)).await?;
            if rec.lazy.is_some() {
                lazy.release(rec.id).await;
            }
        }
        self.run(move |s| s.remove(&key)).await
    }

    async fn stat(
        &self,
        r: Request<pb::StatSnapshotRequest>,
    ) -> Result<Response<pb::StatSnapshotResponse>, Status> {
        let key = r.into_inner().key;
        self.run(move |s| {
            let rec = s.stat(&key)?;
            Ok(pb::StatSnapshotResponse {
                info: Some(info(key, rec)),
            })
        })
        .await
    }

    async fn update(
        &self,
        r: Request<pb::UpdateSnapshotRequest>,
    ) -> Result<Response<pb::UpdateSnapshotResponse>, Status> {
        let r = r.into_inner();
        let i = r
            .info
            .ok_or_else(|| Status::invalid_argument("an update names the snapshot in its info"))?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        self.run(move |s| {
            let rec = s.update(&i.name, labels(i.labels), &paths)?;
            Ok(pb::UpdateSnapshotResponse {
                info: Some(info(i.name, rec)),
            })
        })
        .await
    }

    type ListStream =
        futures::stream::Iter<std::vec::IntoIter<Result<pb::ListSnapshotsResponse, Status>>>;

    async fn list(
        &self,
        r: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let filters = r.into_inner().filters;
        debug!(?filters, "walk");
        let all = self.run(move |s| s.list(&filters)).await?.into_inner();
        // In messages of at most 100 snapshots, as containerd's own snapshotters send them.
        let mut pages = Vec::new();
        let mut infos = all.into_iter().map(|i| info(i.key, i.record)).peekable();
        while infos.peek().is_some() {
            pages.push(Ok(pb::ListSnapshotsResponse {
                info: infos.by_ref().take(100).collect(),
            }));
        }
        Ok(Response::new(futures::stream::iter(pages)))
    }

    async fn usage(
        &self,
        r: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        let key = r.into_inner().key;
        self.run(move |s| {
            let u = s.usage(&key)?;
            Ok(pb::UsageResponse {
                size: u.size,
                inodes: u.inodes,
            })
        })
        .await
    }

    async fn cleanup(&self, _: Request<pb::CleanupRequest>) -> Result<Response<()>, Status> {
        let n = self.run(|s| s.cleanup()).await?.into_inner();
        if n > 0 {
            info!(
                directories = n,
                "cleanup removed directories no snapshot names"
            );
        }
        Ok(Response::new(()))
    }
}

/// Serves `snapshots` (with `lazy`, converted layers lazily) on the unix socket `socket` until
/// `shutdown` completes, then unmounts the lazy layers. A socket file left by a process that is
/// gone is replaced; one that answers is refused.
pub async fn serve(
    snapshots: Snapshots,
    lazy: Option<Lazy>,
    socket: &Path,
    shutdown: impl Future<Output = ()>,
) -> Result<(), SnapshotError> {
    let io = |op: &'static str| {
        let path = socket.to_path_buf();
        move |source| SnapshotError::Io { op, path, source }
    };
    if socket.exists() {
        if std::os::unix::net::UnixStream::connect(socket).is_ok() {
            return Err(SnapshotError::Invalid(format!(
                "{}: another snapshotter is serving this socket; stop it or pick another --socket",
                socket.display()
            )));
        }
        std::fs::remove_file(socket).map_err(io("remove stale socket"))?;
    }
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(io("create the directory of"))?;
    }
    let root = snapshots.root().display().to_string();
    let service = Service::new(snapshots, lazy);
    let listener = tokio::net::UnixListener::bind(socket).map_err(io("listen on"))?;
    let remount = service.clone();
    tokio::spawn(async move { remount.mount_lazy_layers().await });
    info!(socket = %socket.display(), %root, "snapshotter serving");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let res = tonic::transport::Server::builder()
        .add_service(SnapshotsServer::new(service.clone()))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    let _ = std::fs::remove_file(socket);
    if let Some(lazy) = &service.lazy {
        lazy.release_all().await;
    }
    res.map_err(|e| io("serve")(std::io::Error::other(e.to_string())))
}
