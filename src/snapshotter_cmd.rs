//! `hotstart snapshotter`: the containerd proxy snapshotter.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use hotstart_prefetch::snapshotter::{self, Snapshots};

/// Serve container snapshots to containerd as a proxy plugin (gRPC on a unix socket).
///
/// Snapshots are overlayfs layers in local directories under --root; their record is written
/// durably on every change, so a restarted snapshotter serves every snapshot containerd knows
/// of. containerd's config.toml names this socket:
///
///   [proxy_plugins.hotstart]
///     type = "snapshot"
///     address = "/run/hotstart/snapshotter.sock"
///
/// and images are unpacked and run with it by `--snapshotter hotstart` (ctr), or
/// `snapshotter = "hotstart"` in CRI's containerd section. See deploy/containerd/.
#[derive(Debug, Args)]
pub struct SnapshotterArgs {
    /// Where snapshots and their record live (a local file system with overlayfs support).
    #[arg(
        long,
        env = "HOTSTART_SNAPSHOTTER_ROOT",
        default_value = "/var/lib/hotstart/snapshotter"
    )]
    root: PathBuf,
    /// The unix socket containerd connects to (its proxy_plugins address).
    #[arg(
        long,
        env = "HOTSTART_SNAPSHOTTER_SOCKET",
        default_value = "/run/hotstart/snapshotter.sock"
    )]
    socket: PathBuf,
}

pub async fn run(args: SnapshotterArgs) -> anyhow::Result<()> {
    let root = args.root.clone();
    let snapshots = tokio::task::spawn_blocking(move || Snapshots::open(root))
        .await?
        .with_context(|| format!("open the snapshotter state in {}", args.root.display()))?;
    snapshotter::serve(snapshots, &args.socket, crate::serve_cmd::shutdown_signal()).await?;
    Ok(())
}
