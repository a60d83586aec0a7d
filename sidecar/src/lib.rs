//! hotstart-sidecar: the node daemon (`hotstart serve`). One per node, it owns the memory tier,
//! backs it up into peers' memory, persists it to disk and store, and serves restores.
//!
//! The frames, local messages and shared-memory segments it shares with training processes are
//! `hotstart-proto`; the messages between sidecars are its own ([`wire`]). It persists and
//! reads back steps through `hotstart-ckpt`'s persistence core ([`hotstart_ckpt::Persistence`]),
//! never through an engine. A training process (and the Python wheel)
//! links `hotstart-ckpt` and `hotstart-proto`, never this crate.
//!
//! ```text
//!   training process ──Unix socket──► sidecar ──TCP (authenticated)──► peer sidecars
//!   (Engine, sidecar mode)            │   memory tier: sealed memfd segments, one budget
//!     stage into a memfd  ◄─SCM_RIGHTS┤   persistence: hotstart_ckpt::Persistence per rank
//!     map a sealed memfd  ◄───────────┘   /livez /readyz /metrics over HTTP
//! ```
//!
//! **Save.** The training process asks for a segment (`local`), stages its checkpoint into it
//! directly (the device-to-host copy lands in memory that survives a crash of the training
//! process), unmaps it and commits. The sidecar seals the segment against writes, checks it
//! against the manifest's chunk hashes and holds it in the memory tier (`memory`); then, in the
//! background (`persist`), copies it to `replicas` peers chosen by a deterministic ring
//! (`placement`, `peer`) and writes it to the local disk and the store through the checkpoint
//! library's persistence core of that job and rank (`tiers`), the same sinks an engine's own
//! saves go through. Each tier reports back to the training process's save handle.
//!
//! **Restore** (`restore`). The newest step complete for every rank, found in this node's and
//! the peers' inventories (memory and disk), else in the store; served from this node's memory,
//! else a peer's memory, else local disk, else the store, and handed over as a sealed segment
//! the training process maps: owned tensors are views of it, caller buffers get one copy.
//! Where a GPU is, the steps held in memory are pinned for it once, and device tensors are
//! filled by the sidecar from that memory (`pin`).
//!
//! **Lifecycle** (`lifecycle`): starting → recovering (a replacement node pulls its shards back
//! from peers, `recovery`) → ready → draining (SIGTERM: in-flight persistence gets the grace
//! period, what did not finish is reported).
//!
//! **Trust.** Peers authenticate with a shared cluster token (`auth`); every frame is bounded
//! and versioned (`hotstart_proto::wire`), and a bad one costs only its connection; every shard that arrives
//! from a peer is verified against its blake3 chunk hashes before it is held. The local socket
//! is protected by its file mode.

pub mod auth;
pub mod config;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
mod http;
mod lifecycle;
mod local;
mod members;
pub mod memory;
pub mod metrics;
mod peer;
mod persist;
mod pin;
mod placement;
mod recovery;
mod restore;
mod share;
mod tiers;
pub mod tls;
pub mod wire;

use hotstart_ckpt::Error as CkptError;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, error, info, warn};

pub use auth::{ClusterKey, Identity};
pub use config::{Settings, SidecarConfig, Token};
pub use error::{Error, Result};
pub use lifecycle::State;
pub use peer::{Fetched, PeerClient};
pub use persist::DrainReport;
pub use recovery::RecoveryReport;
pub use wire::{Held, PeerMsg, ShardInfo};

/// Everything the daemon's parts share.
pub(crate) struct Core {
    pub(crate) cfg: SidecarConfig,
    pub(crate) me: Identity,
    pub(crate) key: ClusterKey,
    /// The certificates of peer links, when they are encrypted.
    pub(crate) tls: Option<tls::Tls>,
    pub(crate) life: lifecycle::Lifecycle,
    pub(crate) memory: Arc<memory::Memory>,
    pub(crate) metrics: metrics::Metrics,
    pub(crate) members: members::Members,
    /// Disk and store, and each rank's persistence over them.
    pub(crate) tiers: tiers::Tiers,
    pub(crate) inflight: persist::Inflight,
    pub(crate) adopting: local::Adopting,
    pub(crate) threads: usize,
    /// Pieces of images and environments shared with peers.
    pub(crate) share: share::Share,
    /// Steps held in memory, pinned for the GPU where it can be.
    pub(crate) pins: pin::Pins,
    stopped: AtomicBool,
}

impl Core {
    fn gauges(&self) -> metrics::Gauges {
        let (peers_up, peers_down) = self.members.counts();
        let (replication_lag, replication_pending) = self.inflight.replication();
        metrics::Gauges {
            state: Some(self.life.get()),
            memory: self.memory.stats(),
            peers_up,
            peers_down,
            replication_lag,
            replication_pending,
            persist_running: self.inflight.running(),
            share_cache: self.share.cached_bytes(),
            pins: self.pins.counts(),
        }
    }
}

impl http::Routes for Core {
    fn get(&self, path: &str) -> Option<http::Response> {
        let state = self.life.get();
        match path {
            "/livez" => Some(http::Response::text(200, format!("ok ({state})\n"))),
            "/readyz" if state == State::Ready => Some(http::Response::text(200, "ready\n")),
            "/readyz" => Some(http::Response::text(503, format!("not ready: {state}\n"))),
            "/metrics" => Some(http::Response {
                status: 200,
                content_type: "text/plain; version=0.0.4; charset=utf-8",
                body: self
                    .metrics
                    .render(&self.gauges(), self.tiers.store_counter.as_deref()),
            }),
            _ => None,
        }
    }
}

/// A sidecar with its listeners bound, not yet serving.
pub struct Sidecar {
    core: Arc<Core>,
    peer_listener: TcpListener,
    local_listener: UnixListener,
    http_listener: tokio::net::TcpListener,
    peer_addr: SocketAddr,
    http_addr: SocketAddr,
}

impl std::fmt::Debug for Sidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sidecar")
            .field("node", &self.core.me.node)
            .field("peer_addr", &self.peer_addr)
            .field("http_addr", &self.http_addr)
            .finish_non_exhaustive()
    }
}

/// Binds the Unix socket at `path`: a leftover file from a dead sidecar is replaced, a live
/// sidecar on it is an error.
fn bind_socket(path: &Path, mode: u32) -> Result<UnixListener> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(CkptError::Config {
                reason: format!("another sidecar is serving {}", path.display()),
            }
            .into());
        }
        std::fs::remove_file(path).map_err(|e| Error::io("remove stale socket", path, e))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create socket directory", dir, e))?;
    }
    let l = UnixListener::bind(path).map_err(|e| Error::io("bind", path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io("chmod", path, e))?;
    Ok(l)
}

impl Sidecar {
    /// Opens the tiers and binds every listener; nothing is served yet (`/livez` and the peer
    /// port answer from [`Sidecar::run`] on).
    pub async fn bind(cfg: SidecarConfig) -> Result<Sidecar> {
        let threads = if cfg.threads == 0 {
            hotstart_ckpt::default_threads()
        } else {
            cfg.threads
        };
        // Unusable certificates are refused before anything is opened or bound.
        let tls = cfg.tls_dir.as_deref().map(tls::Tls::open).transpose()?;
        let tiers = tiers::Tiers::open(&cfg)?;
        let peer_listener = TcpListener::bind(cfg.listen).map_err(|e| CkptError::Config {
            reason: format!("listen {}: {e}", cfg.listen),
        })?;
        let peer_addr = peer_listener
            .local_addr()
            .map_err(|e| Error::io("local address", "peer listener", e))?;
        let (http_listener, http_addr) =
            http::bind(cfg.http).await.map_err(|e| CkptError::Config {
                reason: format!("http {}: {e}", cfg.http),
            })?;
        let local_listener = bind_socket(&cfg.socket, cfg.socket_mode)?;
        let me = Identity {
            node: cfg.node_id.clone(),
            domain: cfg.domain.clone(),
        };
        let key = ClusterKey::new(cfg.token.as_ref().map_or(&[][..], |t| t.bytes()));
        let core = Arc::new(Core {
            me,
            key,
            tls,
            life: lifecycle::Lifecycle::new(),
            memory: memory::Memory::new(cfg.memory_budget, cfg.node_id.clone()),
            metrics: metrics::Metrics::default(),
            members: members::Members::new(&cfg),
            tiers,
            inflight: persist::Inflight::default(),
            adopting: local::Adopting::default(),
            threads,
            share: share::Share::new(cfg.share_cache)
                .map_err(|e| Error::io("start the sharing runtime", "tokio", e))?,
            pins: pin::Pins::start(cfg.gpu_pin),
            stopped: AtomicBool::new(false),
            cfg,
        });
        core.share.attach(&core);
        info!(
            node = %core.me.node,
            listen = %peer_addr,
            http = %http_addr,
            socket = %core.cfg.socket.display(),
            budget = core.cfg.memory_budget,
            secure = core.cfg.token.is_some(),
            tls = core.tls.is_some(),
            "sidecar bound"
        );
        match hotstart_proto::shm::huge_pages() {
            hotstart_proto::shm::HugePages::Never => info!(
                "shared memory in 4 KiB pages (shmem_enabled); restores from memory run at \
                 0.5-0.85x of memcpy: see the huge pages section of docs/CONFIGURATION.md"
            ),
            pages => debug!(?pages, "shared memory in 2 MiB pages"),
        }
        Ok(Sidecar {
            core,
            peer_listener,
            local_listener,
            http_listener,
            peer_addr,
            http_addr,
        })
    }

    /// Where peers connect.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Where `/livez`, `/readyz` and `/metrics` are served.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Serves: recovers, becomes ready, serves until `shutdown` completes, then drains.
    /// Returns what the drain found, once its listeners are closed (a sidecar bound next in
    /// this process can take the same addresses).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<DrainReport> {
        let Sidecar {
            core,
            peer_listener,
            local_listener,
            http_listener,
            peer_addr,
            ..
        } = self;
        let http = tokio::spawn(http::serve(http_listener, core.clone()));
        let mut accepting = vec![spawn_accept(
            "hotstart-peer",
            core.clone(),
            move || peer_listener.accept(),
            |c, (sock, addr)| peer::serve(c, sock, addr),
        )?];
        tokio::pin!(shutdown);
        core.life.advance(State::Recovering);
        let recovery = {
            let core = core.clone();
            tokio::task::spawn_blocking(move || core.recover())
        };
        let mut prober_thread = None;
        let shut_early = tokio::select! {
            r = recovery => {
                if let Err(e) = r {
                    error!(error = %e, "recovery panicked");
                }
                false
            }
            () = &mut shutdown => true,
        };
        if !shut_early {
            core.life.advance(State::Ready);
            let socket = core.cfg.socket.clone();
            accepting.push(spawn_accept(
                "hotstart-local",
                core.clone(),
                move || local_listener.accept(),
                |c, (sock, _)| local::serve(c, sock),
            )?);
            let prober = core.clone();
            // Parked between probes and unparked at shutdown, so that it lets go of the core
            // (and the memory it holds) as soon as the sidecar stops.
            prober_thread = Some(
                std::thread::Builder::new()
                    .name("hotstart-probe".into())
                    .spawn(move || {
                        loop {
                            std::thread::park_timeout(prober.cfg.probe_interval);
                            if prober.stopped.load(Ordering::Acquire) {
                                break;
                            }
                            if prober.life.get() == State::Ready {
                                prober.probe();
                            }
                        }
                    })
                    .map_err(|e| Error::io("spawn prober", "", e))?,
            );
            info!(socket = %socket.display(), "sidecar ready");
            shutdown.await;
        }
        core.life.advance(State::Draining);
        let report = {
            let core = core.clone();
            tokio::task::spawn_blocking(move || core.drain())
                .await
                .map_err(|e| CkptError::Task {
                    what: "drain",
                    message: e.to_string(),
                })?
        };
        // Stop accepting: no new training process or peer is served from here on. The accept
        // threads are woken by a connection of their own, which they drop. They and the HTTP
        // task are waited for, so that every listener is closed when this returns: a sidecar
        // started again in this process can bind the same addresses.
        core.stopped.store(true, Ordering::Release);
        let _ = std::net::TcpStream::connect(peer_addr);
        let _ = std::os::unix::net::UnixStream::connect(&core.cfg.socket);
        let _ = std::fs::remove_file(&core.cfg.socket);
        http.abort();
        let _ = http.await;
        let deadline = Instant::now() + Duration::from_secs(5);
        while !accepting.iter().all(|t| t.is_finished()) {
            if Instant::now() > deadline {
                warn!("an accept thread did not stop; its listener closes when it does");
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if let Some(t) = prober_thread {
            t.thread().unpark();
        }
        Ok(report)
    }
}

/// Accepts connections with `accept` on a thread of its own (`{name}-accept`) until the
/// sidecar stops, and serves each with `serve` on a thread of its own (`name`).
fn spawn_accept<C: Send + 'static>(
    name: &'static str,
    core: Arc<Core>,
    accept: impl Fn() -> std::io::Result<C> + Send + 'static,
    serve: impl Fn(Arc<Core>, C) + Clone + Send + 'static,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("{name}-accept"))
        .spawn(move || {
            while !core.stopped.load(Ordering::Acquire) {
                let served = accept().and_then(|conn| {
                    if core.stopped.load(Ordering::Acquire) {
                        return Ok(());
                    }
                    let (c, serve) = (core.clone(), serve.clone());
                    std::thread::Builder::new()
                        .name(name.into())
                        .spawn(move || serve(c, conn))
                        .map(|_| ())
                });
                if let Err(e) = served {
                    warn!(error = %e, "accept failed");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })
        .map_err(|e| Error::io("spawn accept thread", "", e))
}
