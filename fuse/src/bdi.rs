//! The kernel's read-ahead for a FUSE mount.
//!
//! The kernel reads ahead of a sequential reader in the page cache, sending FUSE read requests
//! before they are asked for, but for a FUSE filesystem it starts with the default window of
//! the mount's backing device, 128 KiB, whatever `max_readahead` the filesystem asks for at
//! init. With 1 MiB requests that leaves at most about one request in flight beyond the one a
//! reader waits for, so each `read(2)` pays a whole round trip through the daemon. The window
//! is a property of the mount's backing device info (`/sys/class/bdi/<major>:<minor>/`, named
//! after the mount's device number), which root can raise after mounting; then the kernel keeps
//! several requests in flight and the daemon answers them from its own read-ahead.

use std::io;
use std::path::{Path, PathBuf};

use crate::mountinfo::topmost;

/// The sysfs file holding the kernel read-ahead window, in KiB, of the filesystem mounted at
/// `mountpoint`. The device number comes from `/proc/self/mountinfo` rather than from a `stat`
/// of the mount point, which would go through the new filesystem and leave its root's
/// attributes in the kernel's cache.
fn read_ahead_file(mountpoint: &Path) -> io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let dev = topmost(&mountinfo, mountpoint)
        .map(|m| m.dev)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not in /proc/self/mountinfo", mountpoint.display()),
            )
        })?;
    Ok(PathBuf::from(format!("/sys/class/bdi/{dev}/read_ahead_kb")))
}

/// The kernel read-ahead window of the mount at `mountpoint` (absolute, without symlinks, as
/// mountinfo names it), in bytes.
pub fn read_ahead(mountpoint: &Path) -> io::Result<u64> {
    let file = read_ahead_file(mountpoint)?;
    let text = std::fs::read_to_string(&file)?;
    let kib: u64 = text.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: not a number: {text:?}", file.display()),
        )
    })?;
    Ok(kib << 10)
}

/// Sets the kernel read-ahead window of the mount at `mountpoint` (as for [`read_ahead`]) to
/// `bytes`, rounded down to KiB. Needs root; the caller decides whether a failure matters.
pub fn set_read_ahead(mountpoint: &Path, bytes: u64) -> io::Result<()> {
    let file = read_ahead_file(mountpoint)?;
    std::fs::write(&file, format!("{}\n", bytes >> 10))
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", file.display())))
}
