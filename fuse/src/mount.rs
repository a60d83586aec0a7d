//! Mounting, unmounting, and recovering a mount point left behind by a crash.
//!
//! [`mount`] wraps a store in [`StripedFs`], mounts it through fuser (pure Rust, through
//! `fusermount3`: no libfuse needed) on a background session thread, and returns a
//! [`MountHandle`] that unmounts when told to or when dropped, so a test or a CLI that panics
//! still leaves no mount behind.
//!
//! **Crash recovery.** A process killed while mounted leaves the kernel mount in place with
//! nobody serving it: every access to the mount point fails with ENOTCONN ("Transport endpoint is
//! not connected"). Before mounting, [`clear_stale_mount`] stats the mount point, and on ENOTCONN
//! detaches the dead mount with `fusermount3 -uz` (lazy: processes still holding files there
//! get errors, the directory is usable at once), falling back to `umount -l`. The next mount on
//! the same directory then proceeds normally.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use fuser::{BackgroundSession, Config, MountOption, SessionACL};
use hotstart_store::Store;

use crate::FsConfig;
use crate::fs::StripedFs;
use crate::fuse::FuseAdapter;

/// Everything `hotstart mount` can set.
#[derive(Debug, Clone)]
pub struct MountConfig {
    /// The filesystem's behaviour (read-only, stripes, read-ahead, budget, ownership).
    pub fs: FsConfig,
    /// Let users other than the one who mounted access the mount (FUSE `allow_other`).
    pub allow_other: bool,
    /// fuser session threads reading requests from the kernel (requests run on tokio).
    pub threads: usize,
    /// Requests the kernel keeps in flight in the background (read-ahead, async reads).
    pub max_background: u16,
    /// The source name shown in /proc/mounts.
    pub fs_name: String,
    /// The kernel's read-ahead window for the mount, in bytes (`None` keeps the kernel's
    /// default of 128 KiB). Setting it needs root; without root the default stays, with a log
    /// line. See `bdi.rs`.
    pub kernel_read_ahead: Option<u64>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            fs: FsConfig::default(),
            allow_other: false,
            threads: 1,
            max_background: 64,
            fs_name: "hotstart".to_string(),
            kernel_read_ahead: Some(4 << 20),
        }
    }
}

/// A live mount; unmounted by [`MountHandle::unmount`] or on drop.
pub struct MountHandle {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    fs: Arc<StripedFs>,
}

impl std::fmt::Debug for MountHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountHandle")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl MountHandle {
    /// The filesystem being served (for its budget and store).
    pub fn fs(&self) -> &Arc<StripedFs> {
        &self.fs
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Whether the session ended on its own (unmounted from outside).
    pub fn is_finished(&self) -> bool {
        self.session.as_ref().is_none_or(|s| s.guard.is_finished())
    }

    /// Unmounts and waits for the session to end. If the mount is busy, it is detached lazily.
    pub fn unmount(mut self) -> io::Result<()> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> io::Result<()> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                    "unmount failed; detaching lazily");
                lazy_unmount(&self.mountpoint)
            }
        }
    }
}

impl Drop for MountHandle {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::error!(mountpoint = %self.mountpoint.display(), error = %e, "could not unmount");
        }
    }
}

fn lazy_unmount(mountpoint: &Path) -> io::Result<()> {
    for (bin, args) in [
        ("fusermount3", &["-uz"][..]),
        ("fusermount", &["-uz"]),
        ("umount", &["-l"]),
    ] {
        match Command::new(bin).args(args).arg(mountpoint).output() {
            Ok(out) if out.status.success() => return Ok(()),
            Ok(out) => tracing::debug!(bin, stderr = %String::from_utf8_lossy(&out.stderr)),
            Err(e) => tracing::debug!(bin, error = %e),
        }
    }
    Err(io::Error::other(format!(
        "could not detach {}: fusermount3 -uz and umount -l both failed",
        mountpoint.display()
    )))
}

/// Detaches a dead FUSE mount at `mountpoint` (one whose process crashed: ENOTCONN). Returns
/// whether there was one.
pub fn clear_stale_mount(mountpoint: &Path) -> io::Result<bool> {
    match std::fs::metadata(mountpoint) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            tracing::warn!(mountpoint = %mountpoint.display(),
                "found a stale mount from a crashed process; detaching it");
            lazy_unmount(mountpoint)?;
            Ok(true)
        }
        _ => Ok(false),
    }
}

/// Mounts `store` at `mountpoint`; requests run on `rt`.
pub fn mount(
    store: Store,
    mountpoint: &Path,
    cfg: MountConfig,
    rt: tokio::runtime::Handle,
) -> io::Result<MountHandle> {
    clear_stale_mount(mountpoint)?;
    let meta = std::fs::metadata(mountpoint).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("mount point {}: {e}", mountpoint.display()),
        )
    })?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotADirectory,
            format!("mount point {} is not a directory", mountpoint.display()),
        ));
    }
    // As /proc/self/mountinfo will name it; resolved now, while it is still a plain directory.
    let canonical = mountpoint.canonicalize()?;
    if let Some(dir) = &cfg.fs.cache_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            io::Error::new(e.kind(), format!("cache directory {}: {e}", dir.display()))
        })?;
    }
    let fs = Arc::new(StripedFs::new(store, cfg.fs.clone()));
    let adapter = FuseAdapter::new(fs.clone(), rt, cfg.max_background.max(1));
    let mut options = vec![
        MountOption::FSName(cfg.fs_name.clone()),
        MountOption::Subtype("hotstart".to_string()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
    ];
    options.push(if cfg.fs.read_only {
        MountOption::RO
    } else {
        MountOption::RW
    });
    let mut config = Config::default();
    config.mount_options = options;
    config.acl = if cfg.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(cfg.threads.max(1));
    let session = fuser::spawn_mount(adapter, mountpoint, &config)
        .map_err(|e| io::Error::new(e.kind(), format!("mount {}: {e}", mountpoint.display())))?;
    if let Some(bytes) = cfg.kernel_read_ahead
        && let Err(e) = crate::bdi::set_read_ahead(&canonical, bytes)
    {
        tracing::warn!(mountpoint = %mountpoint.display(), error = %e,
            "cannot set the kernel read-ahead (needs root); sequential reads will be slower");
    }
    tracing::info!(mountpoint = %mountpoint.display(), store = fs.store().url(), "mounted");
    Ok(MountHandle {
        session: Some(session),
        mountpoint: mountpoint.to_path_buf(),
        fs,
    })
}
