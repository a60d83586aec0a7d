//! Mounting, unmounting, and recovering a mount point left behind by a crash.
//!
//! [`mount_fs`] mounts any [`Filesystem`] through fuser (pure Rust, through `fusermount3`: no
//! libfuse needed) on a background session thread, and returns a [`MountHandle`] that unmounts
//! when told to or when dropped, so a test or a CLI that panics still leaves no mount behind.
//! [`mount`] does that for a store wrapped in [`StripedFs`]. With
//! [`MountOptions::kernel_read_ahead`], the kernel's read-ahead window for the new mount is
//! raised right after mounting (see `bdi.rs`).
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
use crate::filesystem::Filesystem;
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

impl MountConfig {
    /// The session options of this configuration.
    pub fn options(&self) -> MountOptions {
        MountOptions {
            read_only: self.fs.read_only,
            allow_other: self.allow_other,
            threads: self.threads,
            max_background: self.max_background,
            fs_name: self.fs_name.clone(),
            kernel_read_ahead: self.kernel_read_ahead,
        }
    }
}

/// How any [`Filesystem`] is mounted (the session, not the filesystem's own behaviour).
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Mount read-only (the kernel refuses changes with EROFS before asking the filesystem).
    pub read_only: bool,
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

impl Default for MountOptions {
    fn default() -> Self {
        MountConfig::default().options()
    }
}

/// Stores file contents into the kernel's page cache of a mount without a request for them
/// (FUSE's store notification): later reads and page faults of those pages are served by the
/// kernel, with no round trip through the daemon. Usable from any thread.
pub struct PageCache(fuser::Notifier);

impl std::fmt::Debug for PageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PageCache")
    }
}

impl PageCache {
    /// Stores `data` as the bytes of inode `ino` from `offset` on. Only whole pages are kept,
    /// and a last partial page only where `data` ends at the end of the file; the inode must
    /// be known to the kernel (looked up or listed, and not forgotten), or nothing is stored
    /// (which the kernel does not report).
    pub fn store(&self, ino: u64, offset: u64, data: &[u8]) -> io::Result<()> {
        self.0.store(fuser::INodeNo(ino), offset, data)
    }
}

/// A live mount; unmounted by [`MountHandle::unmount`] or on drop.
pub struct MountHandle<F = StripedFs> {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    fs: Arc<F>,
}

impl<F> std::fmt::Debug for MountHandle<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountHandle")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl<F> MountHandle<F> {
    /// The filesystem being served.
    pub fn fs(&self) -> &Arc<F> {
        &self.fs
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// A handle that puts bytes into the kernel's page cache of this mount's files (`None` once
    /// unmounted).
    pub fn page_cache(&self) -> Option<PageCache> {
        self.session.as_ref().map(|s| PageCache(s.notifier()))
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
            Err(e) if is_mount_point(&self.mountpoint) => {
                tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                    "unmount failed; detaching lazily");
                lazy_unmount(&self.mountpoint)
            }
            // Unmounted, but the session ended with an error: nothing is left to detach.
            Err(e) => {
                tracing::debug!(mountpoint = %self.mountpoint.display(), error = %e,
                    "session ended with an error after unmounting");
                Ok(())
            }
        }
    }
}

impl<F> Drop for MountHandle<F> {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::error!(mountpoint = %self.mountpoint.display(), error = %e, "could not unmount");
        }
    }
}

/// Whether something is mounted at `path`: a dead FUSE mount (ENOTCONN) counts, and so does a
/// directory on another device than its parent.
fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let parent = match path.parent() {
        // A bare name ("mnt") has the working directory as its parent.
        Some(p) if p.as_os_str().is_empty() => Path::new("."),
        Some(p) => p,
        None => Path::new("/"),
    };
    match (std::fs::symlink_metadata(path), std::fs::metadata(parent)) {
        (Err(e), _) => e.raw_os_error() == Some(libc::ENOTCONN),
        (Ok(m), Ok(p)) => m.dev() != p.dev(),
        (Ok(_), Err(_)) => false,
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
    // The tools fail on a mount that went away meanwhile; that is what was asked for.
    if !is_mount_point(mountpoint) {
        return Ok(());
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

/// Mounts `store` at `mountpoint` as a [`StripedFs`]; requests run on `rt`.
pub fn mount(
    store: Store,
    mountpoint: &Path,
    cfg: MountConfig,
    rt: tokio::runtime::Handle,
) -> io::Result<MountHandle> {
    if let Some(dir) = &cfg.fs.cache_dir {
        std::fs::create_dir_all(dir).map_err(|e| {
            io::Error::new(e.kind(), format!("cache directory {}: {e}", dir.display()))
        })?;
    }
    let fs = Arc::new(StripedFs::new(store, cfg.fs.clone()));
    let handle = mount_fs(fs, mountpoint, &cfg.options(), rt)?;
    tracing::info!(mountpoint = %mountpoint.display(), store = handle.fs().store().url(), "mounted");
    Ok(handle)
}

/// Readies `mountpoint` for a mount: detaches a stale mount left there by a crashed process,
/// checks that it is a directory with no live FUSE file system on it, and returns it as the
/// kernel's mount table names it (absolute, without symlinks). [`mount_fs`] calls it; a caller
/// that starts work for the mount beforehand (a prefetch) calls it first, so that a mount point
/// that cannot be used fails before that work starts.
pub fn prepare_mountpoint(mountpoint: &Path) -> io::Result<PathBuf> {
    clear_stale_mount(mountpoint)?;
    let context = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!("mount point {}: {e}", mountpoint.display()),
        )
    };
    let meta = std::fs::metadata(mountpoint).map_err(context)?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::NotADirectory,
            format!("mount point {} is not a directory", mountpoint.display()),
        ));
    }
    // Resolved while it is still a plain directory. A handle keeps it, so that unmounting does
    // not depend on the working directory.
    let canonical = mountpoint.canonicalize().map_err(context)?;
    // A second FUSE mount on top of a live one would hide it until unmounted, then leave it
    // behind: almost always a mistake (a mount left running, or mounted twice).
    if let Some(source) = crate::mountinfo::fuse_at(&canonical) {
        return Err(io::Error::new(
            io::ErrorKind::ResourceBusy,
            format!(
                "mount point {} already has a FUSE file system mounted ({source}): unmount it \
                 first (fusermount3 -u {}), or choose another directory",
                mountpoint.display(),
                canonical.display()
            ),
        ));
    }
    Ok(canonical)
}

/// Mounts any [`Filesystem`] at `mountpoint` (clearing a stale mount left there by a crashed
/// process first); requests run on `rt`.
pub fn mount_fs<F: Filesystem>(
    fs: Arc<F>,
    mountpoint: &Path,
    opts: &MountOptions,
    rt: tokio::runtime::Handle,
) -> io::Result<MountHandle<F>> {
    let canonical = prepare_mountpoint(mountpoint)?;
    let adapter = FuseAdapter::new(fs.clone(), rt, opts.max_background.max(1));
    let mut options = vec![
        MountOption::FSName(opts.fs_name.clone()),
        MountOption::Subtype("hotstart".to_string()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
    ];
    options.push(if opts.read_only {
        MountOption::RO
    } else {
        MountOption::RW
    });
    let mut config = Config::default();
    config.mount_options = options;
    config.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(opts.threads.max(1));
    let session = fuser::spawn_mount(adapter, mountpoint, &config)
        .map_err(|e| io::Error::new(e.kind(), format!("mount {}: {e}", mountpoint.display())))?;
    if let Some(bytes) = opts.kernel_read_ahead
        && let Err(e) = crate::bdi::set_read_ahead(&canonical, bytes)
    {
        tracing::warn!(mountpoint = %mountpoint.display(), error = %e,
            "cannot set the kernel read-ahead (needs root); sequential reads will be slower");
    }
    Ok(MountHandle {
        session: Some(session),
        mountpoint: canonical,
        fs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_mount_points_from_plain_directories() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!is_mount_point(dir.path()));
        assert!(!is_mount_point(&dir.path().join("missing")));
        assert!(is_mount_point(Path::new("/proc")));
        // Nothing mounted there: detaching it is already done.
        lazy_unmount(dir.path()).unwrap();
    }
}
