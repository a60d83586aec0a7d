//! `hotstart snapshotter`: the containerd proxy snapshotter.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use hotstart_fuse::MountOptions;
use hotstart_image::LazyConfig;
use hotstart_image::snapshotter::{self, Lazy, Snapshots};

use crate::image_cmd::{CacheArgs, images_at};

/// Serve container snapshots to containerd as a proxy plugin (gRPC on a unix socket).
///
/// Snapshots are overlayfs layers in local directories under --root; their record is written
/// durably on every change, so a restarted snapshotter serves every snapshot containerd knows
/// of. With --store, a layer converted by `hotstart image convert` is not downloaded and
/// unpacked: its image is mounted lazily from the store instead (chunks fetched at first read,
/// verified, the image's profile recorded and replayed). A layer that cannot be served so is
/// unpacked by containerd as usual.
///
/// containerd's config.toml names this socket:
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
    /// The store converted layers are served from (a directory, file:// or s3:// URL); without
    /// it every layer is unpacked by containerd.
    #[arg(long, env = "HOTSTART_STORE")]
    store: Option<String>,
    #[command(flatten)]
    cache: CacheArgs,
    /// Memory for verified chunks of each lazy layer, in MiB.
    #[arg(long, default_value_t = 256)]
    memory_mib: u64,
    /// How long a container start on lazy layers is recorded at most, in seconds: its report
    /// (`hotstart image stats --container REF`) covers the start until its container is
    /// removed or this long, and the first start on newly mounted layers adds what it read
    /// in that time to the image's profile.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    record_for_secs: u64,
}

pub async fn run(args: SnapshotterArgs) -> anyhow::Result<()> {
    let root = args.root.clone();
    let snapshots = tokio::task::spawn_blocking(move || Snapshots::open(root))
        .await?
        .with_context(|| format!("open the snapshotter state in {}", args.root.display()))?;
    let lazy = match &args.store {
        Some(url) => {
            let images = images_at(
                url,
                32,
                Some(args.cache.cache_dir.clone()),
                args.cache.cache_mib,
            )?;
            let defaults = LazyConfig::default();
            let lazy = Lazy::new(
                images,
                LazyConfig {
                    memory_cache: args.memory_mib << 20,
                    // A container's first start fetches its layers at the link's bandwidth.
                    fetch_all_without_profile: true,
                    mount: MountOptions {
                        // Containers run as any user; the kernel checks their permissions.
                        allow_other: true,
                        fs_name: "hotstart-layer".into(),
                        ..defaults.mount.clone()
                    },
                    ..defaults
                },
            );
            Some(lazy.with_record_for(std::time::Duration::from_secs(args.record_for_secs)))
        }
        None => None,
    };
    snapshotter::serve(
        snapshots,
        lazy,
        &args.socket,
        crate::serve_cmd::shutdown_signal(),
    )
    .await?;
    Ok(())
}
