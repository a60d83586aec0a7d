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

/// The sysfs file holding the kernel read-ahead window, in KiB, of the filesystem mounted at
/// `mountpoint`. The device number comes from `/proc/self/mountinfo` rather than from a `stat`
/// of the mount point, which would go through the new filesystem and leave its root's
/// attributes in the kernel's cache.
fn read_ahead_file(mountpoint: &Path) -> io::Result<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")?;
    let dev = mount_device(&mountinfo, mountpoint).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} is not in /proc/self/mountinfo", mountpoint.display()),
        )
    })?;
    Ok(PathBuf::from(format!("/sys/class/bdi/{dev}/read_ahead_kb")))
}

/// The `major:minor` of the topmost mount at `mountpoint` in a mountinfo table (fields: id,
/// parent id, major:minor, root, mount point, ...; spaces and other odd bytes in paths are
/// written as octal escapes such as `\040`).
fn mount_device<'a>(mountinfo: &'a str, mountpoint: &Path) -> Option<&'a str> {
    let want = mountpoint.to_str()?;
    mountinfo.lines().rev().find_map(|line| {
        let mut fields = line.split(' ');
        let dev = fields.nth(2)?;
        let point = fields.nth(1)?;
        (unescape(point) == want).then_some(dev)
    })
}

/// Undoes mountinfo's octal escapes (`\NNN`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).and_then(|d| {
            let d = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(d, 8).ok()
        });
        match (b[i], octal) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_topmost_mount_and_undoes_escapes() {
        let table = "\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 22 0:39 / /tmp/a\\040b rw,nosuid - fuse.hotstart old rw
41 22 0:52 / /tmp/a\\040b rw,nosuid - fuse.hotstart new rw
42 22 0:53 / /tmp/ab rw - tmpfs tmpfs rw
";
        assert_eq!(mount_device(table, Path::new("/tmp/a b")), Some("0:52"));
        assert_eq!(mount_device(table, Path::new("/")), Some("254:0"));
        assert_eq!(mount_device(table, Path::new("/tmp/c")), None);
        assert_eq!(unescape("x\\134y\\04"), "x\\y\\04");
    }
}
