//! `hotstart mount STORE MOUNTPOINT`: serve a store as a directory until SIGINT or SIGTERM.
//!
//! Arguments become a [`hotstart_fuse::MountConfig`]; the library mounts (clearing a stale mount a
//! crashed process left at the same directory), and this command waits for a signal or for the
//! mount to be removed from outside (`fusermount3 -u`), then unmounts cleanly.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use hotstart_fuse::{FsConfig, MountConfig};
use hotstart_store::Store;
use tokio::signal::unix::{SignalKind, signal};

/// Options of `hotstart mount`.
#[derive(Debug, Args)]
pub struct MountArgs {
    /// The store to serve: a directory, file://, memory:// or s3://bucket/prefix URL.
    store: String,
    /// An existing directory to mount on.
    mountpoint: PathBuf,
    /// Refuse every change (EROFS).
    #[arg(long)]
    read_only: bool,
    /// Bytes per ranged GET or multipart part, in MiB (AWS S3 needs at least 5).
    #[arg(long, default_value_t = 8)]
    stripe_mib: usize,
    /// Stripes in flight per read window or upload.
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
    /// Largest read-ahead window of a sequential reader, in MiB (it starts at 1 MiB).
    #[arg(long, default_value_t = 64)]
    max_read_ahead_mib: usize,
    /// Memory all open files together may hold in read-ahead and upload buffers, in MiB.
    #[arg(long, default_value_t = 1024)]
    memory_budget_mib: usize,
    /// Seconds a stat result is trusted before the store is asked again.
    #[arg(long, default_value_t = 1.0)]
    stat_ttl: f64,
    /// Owner of every file (default: the mounting user).
    #[arg(long)]
    uid: Option<u32>,
    /// Group of every file (default: the mounting user's group).
    #[arg(long)]
    gid: Option<u32>,
    /// Permission bits of files, in octal.
    #[arg(long, default_value = "644", value_parser = parse_mode)]
    file_mode: u16,
    /// Permission bits of directories, in octal.
    #[arg(long, default_value = "755", value_parser = parse_mode)]
    dir_mode: u16,
    /// Let other users access the mount (needs user_allow_other in /etc/fuse.conf unless root).
    #[arg(long)]
    allow_other: bool,
    /// Directory for spill files: local copies of files being written, so that writers that seek
    /// back work (default: the system temp dir; put it on disk, not tmpfs).
    #[arg(long)]
    spill_dir: Option<PathBuf>,
    /// Local disk all spill files together may use, in MiB; past it a seek back is ENOSPC.
    #[arg(long, default_value_t = 16384)]
    max_spill_mib: u64,
    /// Keep whole stripes read from the store in this directory and serve later reads from it.
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Disk the stripe cache may use, in MiB (least recently used stripes are evicted).
    #[arg(long, default_value_t = 10240)]
    cache_mib: u64,
    /// Requests the kernel may keep in flight in the background.
    #[arg(long, default_value_t = 64)]
    max_background: u16,
    /// The kernel's own read-ahead for the mount, in MiB: how far ahead of a sequential reader
    /// the kernel asks for pages (the kernel's default is 128 KiB). Setting it needs root; 0
    /// keeps the kernel's default. Much larger windows send more concurrent requests than
    /// help.
    #[arg(long, default_value_t = 4)]
    kernel_read_ahead_mib: u64,
}

fn parse_mode(s: &str) -> Result<u16, String> {
    u16::from_str_radix(s, 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?} is not an octal mode such as 644"))
}

impl MountArgs {
    fn config(&self) -> anyhow::Result<MountConfig> {
        let defaults = FsConfig::default();
        let ttl = Duration::try_from_secs_f64(self.stat_ttl)
            .with_context(|| format!("--stat-ttl {}", self.stat_ttl))?;
        Ok(MountConfig {
            fs: FsConfig {
                read_only: self.read_only,
                stripe_size: self.stripe_mib.max(1) << 20,
                max_in_flight: self.in_flight.max(1),
                max_read_ahead: self.max_read_ahead_mib.max(1) << 20,
                memory_budget: self.memory_budget_mib.max(1) << 20,
                stat_ttl: ttl,
                uid: self.uid.unwrap_or(defaults.uid),
                gid: self.gid.unwrap_or(defaults.gid),
                file_mode: self.file_mode,
                dir_mode: self.dir_mode,
                spill_dir: self.spill_dir.clone(),
                max_spill: self.max_spill_mib << 20,
                cache_dir: self.cache_dir.clone(),
                cache_bytes: self.cache_mib << 20,
                ..defaults
            },
            allow_other: self.allow_other,
            max_background: self.max_background,
            fs_name: self.store.clone(),
            kernel_read_ahead: (self.kernel_read_ahead_mib > 0)
                .then_some(self.kernel_read_ahead_mib << 20),
            ..MountConfig::default()
        })
    }
}

/// Mounts, waits for SIGINT/SIGTERM (or an external unmount), unmounts.
pub async fn run(args: MountArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let store = Store::open(&args.store).with_context(|| format!("open store {}", args.store))?;
    let mut sigint = signal(SignalKind::interrupt()).context("install SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("install SIGTERM handler")?;
    let mp = args.mountpoint.clone();
    let rt = tokio::runtime::Handle::current();
    let handle = tokio::task::spawn_blocking(move || hotstart_fuse::mount(store, &mp, cfg, rt))
        .await
        .context("mount task")??;
    eprintln!(
        "hotstart: serving {} at {} (Ctrl-C or SIGTERM unmounts)",
        args.store,
        args.mountpoint.display()
    );
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = sigint.recv() => break,
            _ = sigterm.recv() => break,
            _ = tick.tick() => if handle.is_finished() {
                eprintln!("hotstart: {} was unmounted from outside", args.mountpoint.display());
                break;
            },
        }
    }
    tokio::task::spawn_blocking(move || handle.unmount())
        .await
        .context("unmount task")?
        .with_context(|| format!("unmount {}", args.mountpoint.display()))?;
    Ok(())
}
