//! Listings that carry attributes (READDIRPLUS, [`CachePolicy::listing_attrs`]), on a real
//! mount of a small in-memory filesystem that counts the lookups the kernel sends: after a
//! directory is listed, stat and open of its entries reach the filesystem with no lookup, and
//! every name, size, mode and byte is as the filesystem has it.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use hotstart_fuse::{
    CachePolicy, Filesystem, FsError, FsResult, MountHandle, MountOptions, NodeAttr, NodeEntry,
    NodeKind,
};

const ROOT: u64 = 1;
const DIR: u64 = 2;
/// Inode of file `i` of the directory.
const FIRST_FILE: u64 = 10;

/// `/d` holding `files` files named long enough that the listing spans many replies; file `i`
/// holds `i % 300` bytes of `i as u8` and has mode [`Tree::mode`]`(i)`.
struct Tree {
    files: u64,
    listing_attrs: bool,
    /// Lookups in `/d`.
    lookups: AtomicU64,
}

impl Tree {
    fn name(i: u64) -> String {
        format!("file-{i:05}-with-a-name-long-enough-to-fill-the-kernel-buffers")
    }

    fn mode(i: u64) -> u16 {
        if i.is_multiple_of(2) { 0o600 } else { 0o644 }
    }

    fn file(&self, ino: u64) -> FsResult<u64> {
        (FIRST_FILE..FIRST_FILE + self.files)
            .contains(&ino)
            .then_some(ino - FIRST_FILE)
            .ok_or(FsError::NotFound {
                path: format!("<inode {ino}>"),
            })
    }

    fn attr(&self, ino: u64) -> FsResult<NodeAttr> {
        let (kind, size, perm) = match ino {
            ROOT | DIR => (NodeKind::Dir, 0, 0o755),
            _ => {
                let i = self.file(ino)?;
                (NodeKind::File, i % 300, Tree::mode(i))
            }
        };
        Ok(NodeAttr {
            ino,
            kind,
            size,
            mtime: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
        })
    }
}

impl Filesystem for Tree {
    fn cache_policy(&self) -> CachePolicy {
        CachePolicy {
            ttl: Duration::from_secs(60),
            negative_ttl: None,
            keep_page_cache: true,
            stateless_open: true,
            listing_attrs: self.listing_attrs,
        }
    }

    async fn lookup(&self, parent: u64, name: &str) -> FsResult<NodeAttr> {
        let not_found = || FsError::NotFound {
            path: name.to_string(),
        };
        match parent {
            ROOT if name == "d" => self.attr(DIR),
            DIR => {
                self.lookups.fetch_add(1, Ordering::Relaxed);
                let i: u64 = name
                    .strip_prefix("file-")
                    .and_then(|n| n.get(..5))
                    .and_then(|n| n.parse().ok())
                    .filter(|&i| Tree::name(i) == name && i < self.files)
                    .ok_or_else(not_found)?;
                self.attr(FIRST_FILE + i)
            }
            _ => Err(not_found()),
        }
    }

    async fn getattr(&self, ino: u64) -> FsResult<NodeAttr> {
        self.attr(ino)
    }

    async fn readdir(&self, ino: u64) -> FsResult<Vec<NodeEntry>> {
        Ok(match ino {
            ROOT => vec![NodeEntry {
                ino: DIR,
                name: "d".into(),
                kind: NodeKind::Dir,
            }],
            DIR => (0..self.files)
                .map(|i| NodeEntry {
                    ino: FIRST_FILE + i,
                    name: Tree::name(i),
                    kind: NodeKind::File,
                })
                .collect(),
            _ => Vec::new(),
        })
    }

    async fn open(&self, ino: u64, _flags: i32) -> FsResult<u64> {
        self.file(ino)
    }

    async fn read(&self, ino: u64, _fh: u64, offset: u64, size: usize) -> FsResult<Bytes> {
        let i = self.file(ino)?;
        let len = (i % 300).saturating_sub(offset).min(size as u64);
        Ok(Bytes::from(vec![i as u8; len as usize]))
    }
}

/// Mounts a tree of `files` files, lists `/d`, stats and reads every entry, and returns the
/// lookups that reached the filesystem.
fn list_stat_and_read(files: u64, listing_attrs: bool) -> u64 {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tree = Arc::new(Tree {
        files,
        listing_attrs,
        lookups: AtomicU64::new(0),
    });
    let opts = MountOptions {
        read_only: true,
        ..MountOptions::default()
    };
    let handle: MountHandle<Tree> =
        hotstart_fuse::mount_fs(tree.clone(), dir.path(), &opts, rt.handle().clone())
            .expect("mount (needs /dev/fuse, fusermount3 and root)");
    let d = dir.path().join("d");
    let checked = std::panic::catch_unwind(|| {
        let mut names: Vec<String> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        let want: Vec<String> = (0..files).map(Tree::name).collect();
        assert_eq!(names, want, "every name listed once");
        for i in 0..files {
            let p = d.join(Tree::name(i));
            let meta = std::fs::symlink_metadata(&p).unwrap();
            assert_eq!(meta.len(), i % 300, "size of file {i}");
            assert_eq!(
                meta.permissions().mode() & 0o7777,
                u32::from(Tree::mode(i)),
                "mode of file {i}"
            );
            assert_eq!(
                std::fs::read(&p).unwrap(),
                vec![i as u8; (i % 300) as usize]
            );
        }
    });
    handle.unmount().unwrap();
    rt.shutdown_background();
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
    tree.lookups.load(Ordering::Relaxed)
}

#[test]
fn listed_entries_need_no_lookup() {
    // 2000 entries of about 250 bytes each with their attributes: many reply buffers.
    assert_eq!(list_stat_and_read(2000, true), 0);
}

#[test]
fn without_listing_attributes_each_entry_is_looked_up() {
    assert_eq!(list_stat_and_read(200, false), 200);
}
