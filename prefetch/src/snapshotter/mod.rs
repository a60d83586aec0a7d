//! `hotstart snapshotter`: a containerd snapshotter served as a proxy plugin (gRPC on a unix
//! socket).
//!
//! containerd keeps its own record of snapshots per namespace and calls this service for the
//! files: prepare, view, mounts, commit, remove, stat, update, usage, walk and cleanup. The
//! snapshots are overlayfs layers in local directories ([`state`]), and their metadata is
//! written durably on every change, so a restarted snapshotter serves every snapshot containerd
//! knows of. See docs/SEMANTICS.md, "Container images".

pub mod state;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use containerd_snapshots::tonic::{self, Status};
use containerd_snapshots::{Info, Kind as CtrKind, Snapshotter, Usage as CtrUsage, api};
use tracing::{debug, info};

pub use state::{Kind, Mount, Record, SnapshotError, Snapshots};

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

/// The gRPC face of [`Snapshots`]: every call runs on the blocking pool (it touches files).
#[derive(Debug, Clone)]
pub struct Service {
    snapshots: Arc<Snapshots>,
}

impl Service {
    pub fn new(snapshots: Snapshots) -> Service {
        Service {
            snapshots: Arc::new(snapshots),
        }
    }

    async fn run<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Snapshots) -> Result<T, SnapshotError> + Send + 'static,
    ) -> Result<T, Status> {
        let s = self.snapshots.clone();
        tokio::task::spawn_blocking(move || call(&s))
            .await
            .map_err(|e| Status::internal(format!("snapshotter task failed: {e}")))?
            .map_err(Status::from)
    }
}

fn info(key: String, r: Record) -> Info {
    Info {
        kind: match r.kind {
            Kind::View => CtrKind::View,
            Kind::Active => CtrKind::Active,
            Kind::Committed => CtrKind::Committed,
        },
        name: key,
        parent: r.parent,
        labels: r.labels.into_iter().collect(),
        created_at: r.created,
        updated_at: r.updated,
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
impl Snapshotter for Service {
    type Error = Status;

    async fn stat(&self, key: String) -> Result<Info, Status> {
        self.run(move |s| s.stat(&key).map(|r| info(key, r))).await
    }

    async fn update(&self, i: Info, paths: Option<Vec<String>>) -> Result<Info, Status> {
        self.run(move |s| {
            s.update(&i.name, labels(i.labels), &paths.unwrap_or_default())
                .map(|r| info(i.name, r))
        })
        .await
    }

    async fn usage(&self, key: String) -> Result<CtrUsage, Status> {
        let u = self.run(move |s| s.usage(&key)).await?;
        Ok(CtrUsage {
            inodes: u.inodes,
            size: u.size,
        })
    }

    async fn mounts(&self, key: String) -> Result<Vec<api::types::Mount>, Status> {
        self.run(move |s| s.mounts(&key)).await.map(to_api)
    }

    async fn prepare(
        &self,
        key: String,
        parent: String,
        l: HashMap<String, String>,
    ) -> Result<Vec<api::types::Mount>, Status> {
        debug!(%key, %parent, "prepare");
        self.run(move |s| s.prepare(&key, &parent, labels(l)))
            .await
            .map(to_api)
    }

    async fn view(
        &self,
        key: String,
        parent: String,
        l: HashMap<String, String>,
    ) -> Result<Vec<api::types::Mount>, Status> {
        debug!(%key, %parent, "view");
        self.run(move |s| s.view(&key, &parent, labels(l)))
            .await
            .map(to_api)
    }

    async fn commit(
        &self,
        name: String,
        key: String,
        l: HashMap<String, String>,
    ) -> Result<(), Status> {
        debug!(%name, %key, "commit");
        self.run(move |s| s.commit(&name, &key, labels(l))).await
    }

    async fn remove(&self, key: String) -> Result<(), Status> {
        debug!(%key, "remove");
        self.run(move |s| s.remove(&key)).await
    }

    async fn clear(&self) -> Result<(), Status> {
        let n = self.run(|s| s.cleanup()).await?;
        if n > 0 {
            info!(
                directories = n,
                "cleanup removed directories no snapshot names"
            );
        }
        Ok(())
    }

    type InfoStream = futures::stream::Iter<std::vec::IntoIter<Result<Info, Status>>>;

    async fn list(
        &self,
        _snapshotter: String,
        filters: Vec<String>,
    ) -> Result<Self::InfoStream, Status> {
        let all = self.run(move |s| s.list(&filters)).await?;
        Ok(futures::stream::iter(
            all.into_iter()
                .map(|i| Ok(info(i.key, i.record)))
                .collect::<Vec<_>>(),
        ))
    }
}

/// Serves `snapshots` on the unix socket `socket` until `shutdown` completes. A socket file
/// left by a process that is gone is replaced; one that answers is refused.
pub async fn serve(
    snapshots: Snapshots,
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
    let listener = tokio::net::UnixListener::bind(socket).map_err(io("listen on"))?;
    info!(socket = %socket.display(), root = %snapshots.root().display(), "snapshotter serving");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let res = tonic::transport::Server::builder()
        .add_service(containerd_snapshots::server(Arc::new(Service::new(
            snapshots,
        ))))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    let _ = std::fs::remove_file(socket);
    res.map_err(|e| io("serve")(std::io::Error::other(e.to_string())))
}
