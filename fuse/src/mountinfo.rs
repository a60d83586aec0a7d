//! What the kernel's mount table (`/proc/self/mountinfo`) says is mounted where.

use std::path::Path;

/// One mount as the table lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mount<'a> {
    /// The device number, `major:minor`.
    pub dev: &'a str,
    /// The filesystem type (`fuse.hotstart` for this crate's mounts).
    pub fstype: &'a str,
    /// What was mounted (the FUSE file system's name).
    pub source: &'a str,
}

/// The topmost mount at `mountpoint` (absolute, without symlinks, as the table names it) in a
/// mountinfo table. Fields: id, parent id, major:minor, root, mount point, options, optional
/// fields, `-`, type, source, super options; spaces and other odd bytes in paths are written as
/// octal escapes such as `\040`.
pub(crate) fn topmost<'a>(mountinfo: &'a str, mountpoint: &Path) -> Option<Mount<'a>> {
    let want = mountpoint.to_str()?;
    mountinfo.lines().rev().find_map(|line| {
        let mut fields = line.split(' ');
        let dev = fields.nth(2)?;
        let point = fields.nth(1)?;
        if unescape(point) != want {
            return None;
        }
        let mut rest = fields.skip_while(|f| *f != "-").skip(1);
        Some(Mount {
            dev,
            fstype: rest.next()?,
            source: rest.next()?,
        })
    })
}

/// The topmost mount at `mountpoint` in this process's mount table when it is a FUSE file
/// system: what it serves, named by its source. `None` when there is none or the table cannot
/// be read.
pub(crate) fn fuse_at(mountpoint: &Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = topmost(&table, mountpoint)?;
    (mount.fstype == "fuse" || mount.fstype.starts_with("fuse.")).then(|| unescape(mount.source))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_topmost_mount_and_undoes_escapes() {
        let table = "\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 22 0:39 / /tmp/a\\040b rw,nosuid - fuse.hotstart old rw
41 22 0:52 / /tmp/a\\040b rw,nosuid shared:7 - fuse.hotstart new rw
42 22 0:53 / /tmp/ab rw - tmpfs tmpfs rw
";
        let top = topmost(table, Path::new("/tmp/a b")).unwrap();
        assert_eq!(
            top,
            Mount {
                dev: "0:52",
                fstype: "fuse.hotstart",
                source: "new"
            }
        );
        assert_eq!(topmost(table, Path::new("/")).unwrap().fstype, "ext4");
        assert_eq!(topmost(table, Path::new("/tmp/ab")).unwrap().dev, "0:53");
        assert_eq!(topmost(table, Path::new("/tmp/c")), None);
        assert_eq!(unescape("x\\134y\\04"), "x\\y\\04");
    }
}
