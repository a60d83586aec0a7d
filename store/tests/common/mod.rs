//! Helpers shared by the store's integration tests.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use bytes::Bytes;
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

/// Deterministic incompressible bytes (see `hotstart_testkit::pattern`).
pub fn pattern(len: usize, seed: u64) -> Bytes {
    Bytes::from(hotstart_testkit::pattern(len, seed))
}

/// A store on a fresh bucket of the shared SeaweedFS server, or `None` (with a printed reason)
/// when the server is not available outside CI. In CI a missing server fails the test.
pub fn s3_store(test: &str) -> Option<Store> {
    let weed = SeaweedFs::shared()?;
    let bucket = weed.fresh_bucket(&test.replace('_', "-"));
    Some(
        Store::open_with(&format!("{bucket}/conformance"), &weed.client_options())
            .expect("open SeaweedFS store"),
    )
}

fn set_mtime(path: &Path, secs: i64) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
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

/// A small directory with every kind of entry a tree must carry.
pub fn sample_dir(root: &Path) {
    let w = |rel: &str, data: &[u8], mode: u32| {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, data).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    w("empty.txt", b"", 0o644);
    w("one", b"x", 0o600);
    w("bin/tool", &pattern(64 << 10, 1), 0o755);
    w("data/exact-minus-1", &pattern((64 << 10) - 1, 2), 0o644);
    w("data/exact-plus-1", &pattern((64 << 10) + 1, 3), 0o644);
    w("data/big", &pattern(300 << 10, 4), 0o640);
    w("data/dup-a", &pattern(100 << 10, 5), 0o644);
    w("data/dup-b", &pattern(100 << 10, 5), 0o644); // same content: deduplicated chunks
    w("deep/a/b/c/d.txt", b"deep", 0o444);
    std::fs::create_dir_all(root.join("empty-dir")).unwrap();
    std::os::unix::fs::symlink("../data/big", root.join("bin/link-to-big")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/absolute", root.join("dangling")).unwrap();
    std::fs::hard_link(root.join("data/big"), root.join("bin/hard-big")).unwrap();
    std::fs::set_permissions(root.join("deep/a"), std::fs::Permissions::from_mode(0o750)).unwrap();
    for (i, rel) in [
        "one",
        "data/big",
        "bin/link-to-big",
        "deep/a/b",
        "empty-dir",
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
        mtime: (i64, i64),
        data: Vec<u8>,
        link_group: Option<String>,
    },
    Symlink {
        target: String,
        mtime: (i64, i64),
    },
}

fn snapshot(root: &Path) -> BTreeMap<String, Node> {
    fn go(
        root: &Path,
        dir: &Path,
        out: &mut BTreeMap<String, Node>,
        inodes: &mut HashMap<u64, String>,
    ) {
        let mut names: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for name in names {
            let p = dir.join(&name);
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let node = if m.file_type().is_symlink() {
                Node::Symlink {
                    target: std::fs::read_link(&p)
                        .unwrap()
                        .to_string_lossy()
                        .into_owned(),
                    mtime: (m.mtime(), m.mtime_nsec()),
                }
            } else if m.is_dir() {
                go(root, &p, out, inodes);
                Node::Dir {
                    mode: m.mode() & 0o7777,
                }
            } else {
                let link_group =
                    (m.nlink() > 1).then(|| inodes.entry(m.ino()).or_insert(rel.clone()).clone());
                Node::File {
                    mode: m.mode() & 0o7777,
                    mtime: (m.mtime(), m.mtime_nsec()),
                    data: std::fs::read(&p).unwrap(),
                    link_group,
                }
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    go(root, root, &mut out, &mut HashMap::new());
    out
}

/// Asserts that two trees hold the same entries: kinds, bytes, modes, symlink targets, file and
/// symlink mtimes, and the same hard-link groups.
pub fn assert_trees_equal(a: &Path, b: &Path) {
    let (sa, sb) = (snapshot(a), snapshot(b));
    let keys_a: Vec<_> = sa.keys().collect();
    let keys_b: Vec<_> = sb.keys().collect();
    assert_eq!(keys_a, keys_b, "entry lists differ");
    for (k, va) in &sa {
        assert!(va == &sb[k], "{k} differs: {va:?} vs {:?}", sb[k]);
    }
}
