//! File trees for tests: a sample directory with every kind of entry a tree manifest must carry,
//! and a walk that compares two trees entry by entry.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::pattern;

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL in test paths")
}

fn set_mtime(path: &Path, secs: i64) {
    let c = c_path(path);
    let ts = libc::timespec {
        tv_sec: secs,
        tv_nsec: 123_456_789,
    };
    // SAFETY: valid NUL-terminated path and two initialised timespecs.
    let rc = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            [ts, ts].as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(rc, 0, "utimensat {}", path.display());
}

/// Sets an extended attribute (not following symlinks); returns whether the filesystem took it.
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> bool {
    let (p, n) = (c_path(path), CString::new(name).expect("no NUL in names"));
    // SAFETY: NUL-terminated strings and a buffer valid for its length, all alive for the call.
    unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        ) == 0
    }
}

/// Every extended attribute of `path` (not following symlinks); none where unsupported.
pub fn xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let p = c_path(path);
    let mut names = vec![0u8; 64 << 10];
    // SAFETY: NUL-terminated path and a buffer valid for its length.
    let n = unsafe { libc::llistxattr(p.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    let mut out = BTreeMap::new();
    if n <= 0 {
        return out;
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name).expect("split on NUL");
        let mut value = vec![0u8; 64 << 10];
        // SAFETY: NUL-terminated strings and a buffer valid for its length.
        let got = unsafe {
            libc::lgetxattr(
                p.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if got >= 0 {
            value.truncate(got as usize);
            out.insert(String::from_utf8_lossy(name).into_owned(), value);
        }
    }
    out
}

/// A directory with every kind of entry a tree must carry: files of many sizes (empty, one
/// byte, chunk-size edges for 64 KiB chunks, over 2 MiB), duplicate content, several modes
/// including setuid and read-only, nested and empty directories, relative, absolute and
/// dangling symlinks, a hard link, a non-ASCII name, fixed mtimes with nanoseconds, and an xattr
/// where the filesystem takes one.
pub fn sample_dir(root: &Path) {
    let w = |rel: &str, data: &[u8], mode: u32| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("relative path")).expect("create dirs");
        std::fs::write(&p, data).expect("write sample file");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    w("empty.txt", b"", 0o644);
    w("one", b"x", 0o600);
    w("bin/tool", &pattern(64 << 10, 1), 0o755);
    w("bin/setuid", b"#!/bin/sh\n", 0o4755);
    w("data/exact-minus-1", &pattern((64 << 10) - 1, 2), 0o644);
    w("data/exact-plus-1", &pattern((64 << 10) + 1, 3), 0o644);
    w("data/big", &pattern(300 << 10, 4), 0o640);
    w("data/dup-a", &pattern(100 << 10, 5), 0o644);
    w("data/dup-b", &pattern(100 << 10, 5), 0o644); // same content: deduplicated chunks
    w("lib/libhuge.so", &pattern((2 << 20) + 12_345, 6), 0o755);
    w("deep/a/b/c/d.txt", b"deep", 0o444);
    w(
        "share/dir with space/\u{fc}n\u{ef}c\u{f6}de.txt",
        b"unicode\n",
        0o644,
    );
    std::fs::create_dir_all(root.join("empty-dir")).expect("mkdir");
    std::os::unix::fs::symlink("../data/big", root.join("bin/link-to-big")).expect("symlink");
    std::os::unix::fs::symlink("/nonexistent/absolute", root.join("dangling")).expect("symlink");
    std::fs::hard_link(root.join("data/big"), root.join("bin/hard-big")).expect("hard link");
    std::fs::set_permissions(root.join("deep/a"), std::fs::Permissions::from_mode(0o750))
        .expect("chmod");
    // user.* xattrs need a filesystem that takes them; where it does not, none is compared.
    set_xattr(&root.join("data/big"), "user.origin", b"sample");
    for (i, rel) in [
        "one",
        "data/big",
        "bin/link-to-big",
        "deep/a/b",
        "empty-dir",
        "lib/libhuge.so",
    ]
    .iter()
    .enumerate()
    {
        set_mtime(&root.join(rel), 1_600_000_000 + i as i64 * 1000);
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir {
        mode: u32,
    },
    File {
        mode: u32,
        mtime: Option<(i64, i64)>,
        /// Length and a 64-bit hash of the content (short enough to print on a mismatch).
        data: (usize, u64),
        link_group: Option<String>,
        xattrs: BTreeMap<String, Vec<u8>>,
    },
    Symlink {
        target: String,
        mtime: Option<(i64, i64)>,
    },
}

fn digest(data: &[u8]) -> (usize, u64) {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    data.hash(&mut h);
    (data.len(), h.finish())
}

fn snapshot(root: &Path, mtimes: bool) -> BTreeMap<String, Node> {
    fn go(
        root: &Path,
        dir: &Path,
        mtimes: bool,
        out: &mut BTreeMap<String, Node>,
        inodes: &mut HashMap<u64, String>,
    ) {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .expect("read_dir")
            .map(|e| e.expect("dir entry").file_name())
            .collect();
        names.sort();
        for name in names {
            let p = dir.join(&name);
            let rel = p
                .strip_prefix(root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            let m = std::fs::symlink_metadata(&p).expect("lstat");
            let mtime = mtimes.then(|| (m.mtime(), m.mtime_nsec()));
            let node = if m.file_type().is_symlink() {
                Node::Symlink {
                    target: std::fs::read_link(&p)
                        .expect("readlink")
                        .to_string_lossy()
                        .into_owned(),
                    mtime,
                }
            } else if m.is_dir() {
                go(root, &p, mtimes, out, inodes);
                Node::Dir {
                    mode: m.mode() & 0o7777,
                }
            } else {
                let link_group =
                    (m.nlink() > 1).then(|| inodes.entry(m.ino()).or_insert(rel.clone()).clone());
                Node::File {
                    mode: m.mode() & 0o7777,
                    mtime,
                    data: digest(&std::fs::read(&p).expect("read")),
                    link_group,
                    xattrs: xattrs(&p),
                }
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    go(root, root, mtimes, &mut out, &mut HashMap::new());
    out
}

/// Asserts that two trees hold the same entries: kinds, bytes, modes, symlink targets, file and
/// symlink mtimes, xattrs of files, and the same hard-link groups.
pub fn assert_trees_equal(a: &Path, b: &Path) {
    compare(a, b, true);
}

/// [`assert_trees_equal`] without mtimes, for sources that cannot carry them exactly.
pub fn assert_trees_equal_but_mtimes(a: &Path, b: &Path) {
    compare(a, b, false);
}

fn compare(a: &Path, b: &Path, mtimes: bool) {
    let (sa, sb) = (snapshot(a, mtimes), snapshot(b, mtimes));
    let keys_a: Vec<_> = sa.keys().collect();
    let keys_b: Vec<_> = sb.keys().collect();
    assert_eq!(keys_a, keys_b, "entry lists differ");
    for (k, va) in &sa {
        assert!(va == &sb[k], "{k} differs: {va:?} vs {:?}", sb[k]);
    }
}
