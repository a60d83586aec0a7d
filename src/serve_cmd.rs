//! `hotstart serve`: the per-node sidecar daemon.
//!
//! Thin: flags (each with its `HOTSTART_*` variable) and the TOML file become one
//! `hotstart_sidecar::Settings` each, merged (flags and variables over the file), checked,
//! and handed to the library's `Sidecar`, which serves until SIGTERM or SIGINT and drains.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use hotstart_sidecar::config::{Seconds, Size, TOKEN_ENV};
use hotstart_sidecar::{Settings, Sidecar, Token};

/// Settings of `hotstart serve`. Every flag can also be set by the variable shown, or by the
/// same key (with `_` for `-`) in the `--config` TOML file; flags and variables win over the
/// file. The cluster token comes only from HOTSTART_CLUSTER_TOKEN or --token-file.
#[derive(Debug, Args)]
#[command(after_help = "Example (three nodes):\n  \
    HOTSTART_CLUSTER_TOKEN=$(cat /etc/hotstart/token) hotstart serve --node-id node-a \\\n    \
    --peers node-b=10.0.0.2:7070,node-c=10.0.0.3:7070 --tls-dir /etc/hotstart/tls \\\n    \
    --memory-budget 64GiB --disk-dir /var/lib/hotstart --store s3://ckpt/run-42\n\n\
    Training processes find the sidecar through HOTSTART_SOCKET (the --socket path).\n\
    SIGTERM drains in-flight persistence for --grace, then exits 0; shards not persisted by\n\
    then are logged as such.")]
pub struct ServeArgs {
    /// TOML file with any of the settings below (keys as the flags, `_` for `-`).
    #[arg(long, env = "HOTSTART_CONFIG")]
    config: Option<PathBuf>,
    /// This node's id; a replacement node with the same id gets its shards back from peers
    /// [default: the host name].
    #[arg(long, env = "HOTSTART_NODE_ID")]
    node_id: Option<String>,
    /// Failure-domain label (rack, zone): replicas go to other domains where possible.
    #[arg(long, env = "HOTSTART_DOMAIN")]
    domain: Option<String>,
    /// Address peers connect to [default: 0.0.0.0:7070].
    #[arg(long, env = "HOTSTART_LISTEN")]
    listen: Option<String>,
    /// Unix socket for the training processes on this node [default:
    /// /run/hotstart/sidecar.sock].
    #[arg(long, env = "HOTSTART_SOCKET")]
    socket: Option<PathBuf>,
    /// Permission bits of the socket, octal [default: 660].
    #[arg(long, env = "HOTSTART_SOCKET_MODE")]
    socket_mode: Option<String>,
    /// Address of /livez, /readyz and /metrics [default: 0.0.0.0:7071].
    #[arg(long, env = "HOTSTART_HTTP")]
    http: Option<String>,
    /// Peers as id=host:port, comma-separated.
    #[arg(long, env = "HOTSTART_PEERS", value_delimiter = ',')]
    peers: Vec<String>,
    /// A name:port that resolves to every peer (a Kubernetes headless service).
    #[arg(long, env = "HOTSTART_PEERS_DNS")]
    peers_dns: Option<String>,
    /// Peers each shard is copied to [default: 1].
    #[arg(long, env = "HOTSTART_REPLICAS")]
    replicas: Option<usize>,
    /// Shared memory for staging, local shards and peers' replicas, e.g. 64GiB; hold two steps
    /// of every local rank (the newest and the next one, prepared ahead so that a save only
    /// copies) plus the replicas [default: half of the memory limit].
    #[arg(long, env = "HOTSTART_MEMORY_BUDGET")]
    memory_budget: Option<Size>,
    /// Object store URL of the store tier (s3://bucket/prefix, a directory, ...).
    #[arg(long, env = "HOTSTART_STORE")]
    store: Option<String>,
    /// Directory of the local disk tier.
    #[arg(long, env = "HOTSTART_DISK_DIR")]
    disk_dir: Option<PathBuf>,
    /// File holding the cluster token (instead of HOTSTART_CLUSTER_TOKEN).
    #[arg(long, env = "HOTSTART_CLUSTER_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// Run without a cluster token: only allowed when every address is loopback.
    #[arg(long, env = "HOTSTART_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    insecure: bool,
    /// Directory of this node's TLS files for encrypted, mutually authenticated peer links:
    /// ca.crt (the cluster's CA), tls.crt and tls.key (`hotstart tls init` makes them).
    /// Required unless every peer address is loopback; reloaded when the files change.
    #[arg(long, env = "HOTSTART_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// How long SIGTERM waits for in-flight persistence, e.g. 25s [default: 25s].
    #[arg(long, env = "HOTSTART_GRACE")]
    grace: Option<Seconds>,
    /// How long a starting node looks for its shards on peers before it is ready anyway
    /// [default: 30s].
    #[arg(long, env = "HOTSTART_RECOVERY_TIMEOUT")]
    recovery_timeout: Option<Seconds>,
    /// Complete steps kept per rank on disk and in the store; 0 keeps all [default: 2].
    #[arg(long, env = "HOTSTART_KEEP")]
    keep: Option<usize>,
    /// How long a peer connection may make no progress [default: 30s].
    #[arg(long, env = "HOTSTART_PEER_TIMEOUT")]
    peer_timeout: Option<Seconds>,
    /// How often peers are probed [default: 5s].
    #[arg(long, env = "HOTSTART_PROBE_INTERVAL")]
    probe_interval: Option<Seconds>,
    /// How long a save waits for memory to be freed before it is refused, and how long the
    /// next save's segment waits for an older step's persistence to let go of it [default: 60s].
    #[arg(long, env = "HOTSTART_STAGE_TIMEOUT")]
    stage_timeout: Option<Seconds>,
    /// Threads for checksums and copies; 0 picks the core count, at most 8 [default: 0].
    #[arg(long, env = "HOTSTART_THREADS")]
    threads: Option<usize>,
    /// Do not share chunks with peers (images, environments, checkpoints restored from the
    /// store): this node's processes that ask (HOTSTART_SHARE) read the store themselves, and
    /// peers that ask are refused.
    #[arg(long, env = "HOTSTART_NO_SHARE", value_parser = clap::builder::BoolishValueParser::new())]
    no_share: bool,
    /// Do not pin the steps held in memory for the GPU. By default, where this build has GPU
    /// support and a driver and devices exist, each step committed here is pinned once, in the
    /// background, and a restore into device tensors is copied by the sidecar itself, with
    /// nothing pinned by the restarted process (it costs the sidecar a CUDA context per device,
    /// and a pinned step's memory is not reused for a later save: each save gets new memory).
    #[arg(long, env = "HOTSTART_NO_GPU_PIN", value_parser = clap::builder::BoolishValueParser::new())]
    no_gpu_pin: bool,
    /// At most this much memory keeps shared pieces, to serve this node's processes and its
    /// peers; it is part of --memory-budget, taken only when free and given back before any
    /// checkpoint is evicted [default: 1GiB].
    #[arg(long, env = "HOTSTART_SHARE_CACHE")]
    share_cache: Option<Size>,
    /// A checkpoint chunk larger than this, restored from the store by several nodes at once,
    /// is shared in ranges of this size, each read from the store by one node and sent on by
    /// it, so the chunk spreads through the job while it is still arriving; a multiple of
    /// 64 KiB [default: 4MiB].
    #[arg(long, env = "HOTSTART_SHARE_PIECE")]
    share_piece: Option<Size>,
}

pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot watch for SIGTERM; serving until killed");
            std::future::pending::<()>().await;
        }
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => Settings::from_toml_file(path)?,
        None => Settings::default(),
    };
    let token = match std::env::var(TOKEN_ENV) {
        Ok(t) if !t.is_empty() => Some(Token::new(t).context(TOKEN_ENV)?),
        _ => None,
    };
    let flags = Settings {
        node_id: args.node_id,
        domain: args.domain,
        listen: args.listen,
        socket: args.socket,
        socket_mode: args.socket_mode,
        http: args.http,
        peers: (!args.peers.is_empty()).then_some(args.peers),
        peers_dns: args.peers_dns,
        replicas: args.replicas,
        memory_budget: args.memory_budget,
        store: args.store,
        disk_dir: args.disk_dir,
        token_file: args.token_file,
        insecure: args.insecure.then_some(true),
        tls_dir: args.tls_dir,
        grace: args.grace,
        recovery_timeout: args.recovery_timeout,
        keep: args.keep,
        peer_timeout: args.peer_timeout,
        probe_interval: args.probe_interval,
        stage_timeout: args.stage_timeout,
        threads: args.threads,
        share: args.no_share.then_some(false),
        gpu_pin: args.no_gpu_pin.then_some(false),
        share_cache: args.share_cache,
        share_piece: args.share_piece,
        token,
    };
    let cfg = file.merge(flags).resolve()?;
    let sidecar = Sidecar::bind(cfg).await?;
    let report = sidecar.run(shutdown_signal()).await?;
    if report.complete() {
        eprintln!(
            "hotstart serve: drained; {} shard(s) persisted",
            report.finished
        );
    } else {
        for (shard, tiers) in &report.not_persisted {
            let tiers: Vec<&str> = tiers.iter().map(|t| t.as_str()).collect();
            eprintln!(
                "hotstart serve: NOT PERSISTED {shard} (tiers: {}; the grace period ran out)",
                tiers.join(", ")
            );
        }
        for (shard, tiers) in &report.failed {
            let tiers: Vec<&str> = tiers.iter().map(|t| t.as_str()).collect();
            eprintln!(
                "hotstart serve: NOT PERSISTED {shard} (tiers: {}; they failed it, and no newer \
                 step of its rank reached every tier)",
                tiers.join(", ")
            );
        }
        if report.not_committed > 0 {
            eprintln!(
                "hotstart serve: NOT COMMITTED {} filled save(s): a training process still \
                 running hands its save to the next sidecar on this socket; one that is gone \
                 lost it",
                report.not_committed
            );
        }
    }
    Ok(())
}
