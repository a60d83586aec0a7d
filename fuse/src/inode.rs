//! The inode table: inode numbers ↔ paths, with the stat result last seen for each.
//!
//! Inode 1 is the root (path `""`). A path gets a number the first time it is looked up or
//! listed and keeps it while it exists, so the kernel's cached entries stay valid; a rename moves
//! the number to the new path. Each inode keeps the kind, size and mtime the store last reported
//! and when (`checked`): the filesystem trusts them for `stat_ttl`, then asks the store again.
//! A file being written through the mount carries a [`Writing`] marker instead: its size is the
//! number of bytes written so far and the store is not asked about it until the write commits.
//! Numbers are never reused; `forget` is ignored (entries are small).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use crate::fs::FileKind;

/// The root directory's inode number.
pub const ROOT: u64 = 1;

/// Shared state of a file open for writing, seen by stat while the upload is in progress.
#[derive(Debug, Clone)]
pub struct Writing {
    /// The write handle.
    pub fh: u64,
    /// Bytes written so far (the file's size as seen through the mount).
    pub len: Arc<AtomicU64>,
    /// Set by unlink: the handle aborts at close instead of making the object visible.
    pub cancelled: Arc<AtomicBool>,
}

impl Writing {
    pub fn new(fh: u64) -> Writing {
        Writing {
            fh,
            len: Arc::new(AtomicU64::new(0)),
            cancelled: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }
}

/// One inode.
#[derive(Debug, Clone)]
pub struct Inode {
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    pub mtime: SystemTime,
    /// When the store last confirmed this entry.
    pub checked: Instant,
    /// Present while the file is open for writing through the mount.
    pub writing: Option<Writing>,
}

/// Inode number ↔ path, under one lock that is never held across an await.
#[derive(Debug)]
pub struct InodeTable {
    by_ino: HashMap<u64, Inode>,
    by_path: HashMap<String, u64>,
    next: u64,
}

impl InodeTable {
    pub fn new() -> InodeTable {
        let mut t = InodeTable {
            by_ino: HashMap::new(),
            by_path: HashMap::new(),
            next: ROOT + 1,
        };
        t.by_ino.insert(
            ROOT,
            Inode {
                path: String::new(),
                kind: FileKind::Dir,
                size: 0,
                mtime: SystemTime::UNIX_EPOCH,
                checked: Instant::now(),
                writing: None,
            },
        );
        t.by_path.insert(String::new(), ROOT);
        t
    }

    pub fn get(&self, ino: u64) -> Option<&Inode> {
        self.by_ino.get(&ino)
    }

    pub fn get_mut(&mut self, ino: u64) -> Option<&mut Inode> {
        self.by_ino.get_mut(&ino)
    }

    pub fn ino_of(&self, path: &str) -> Option<u64> {
        self.by_path.get(path).copied()
    }

    /// Records what the store said about `path` and returns its inode number (new or kept).
    /// An inode being written keeps its local state.
    pub fn upsert(&mut self, path: &str, kind: FileKind, size: u64, mtime: SystemTime) -> u64 {
        let now = Instant::now();
        if let Some(&ino) = self.by_path.get(path)
            && let Some(node) = self.by_ino.get_mut(&ino)
        {
            if node.writing.is_none() {
                node.kind = kind;
                node.size = size;
                node.mtime = mtime;
                node.checked = now;
            }
            return ino;
        }
        let ino = self.next;
        self.next += 1;
        self.by_ino.insert(
            ino,
            Inode {
                path: path.to_string(),
                kind,
                size,
                mtime,
                checked: now,
                writing: None,
            },
        );
        self.by_path.insert(path.to_string(), ino);
        ino
    }

    /// Forgets the path (it no longer exists); the inode number stays valid for stat errors.
    pub fn remove_path(&mut self, path: &str) {
        if let Some(ino) = self.by_path.remove(path) {
            self.by_ino.remove(&ino);
        }
    }

    /// Moves `from` (and, for a directory, everything known under it) to `to`, dropping whatever
    /// was known at `to`.
    pub fn rename(&mut self, from: &str, to: &str) {
        self.remove_path(to);
        let prefix = format!("{from}/");
        let moved: Vec<(String, u64)> = self
            .by_path
            .iter()
            .filter(|(p, _)| p.as_str() == from || p.starts_with(&prefix))
            .map(|(p, &i)| (p.clone(), i))
            .collect();
        for (old, ino) in moved {
            self.by_path.remove(&old);
            let new = format!("{to}{}", &old[from.len()..]);
            if let Some(node) = self.by_ino.get_mut(&ino) {
                node.path = new.clone();
            }
            self.by_path.insert(new, ino);
        }
    }

    /// Files being written directly inside directory `dir` (path `""` for the root).
    pub fn writing_in(&self, dir: &str) -> Vec<(u64, Inode)> {
        self.by_ino
            .iter()
            .filter(|(_, n)| n.writing.is_some() && parent_of(&n.path) == dir)
            .map(|(&i, n)| (i, n.clone()))
            .collect()
    }

    /// Whether any file under directory `dir` is being written.
    pub fn writing_under(&self, dir: &str) -> bool {
        let prefix = format!("{dir}/");
        self.by_ino
            .values()
            .any(|n| n.writing.is_some() && (dir.is_empty() || n.path.starts_with(&prefix)))
    }
}

/// The parent directory of a path (`""` for top-level names).
pub fn parent_of(path: &str) -> &str {
    path.rsplit_once('/').map(|(p, _)| p).unwrap_or("")
}

/// `dir/name`, or `name` at the root.
pub fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rename_moves_numbers_and_children() {
        let mut t = InodeTable::new();
        let t0 = SystemTime::UNIX_EPOCH;
        let d = t.upsert("a", FileKind::Dir, 0, t0);
        let f = t.upsert("a/x", FileKind::File, 3, t0);
        let other = t.upsert("b", FileKind::File, 1, t0);
        t.rename("a", "b");
        assert_eq!(t.ino_of("b"), Some(d));
        assert_eq!(t.ino_of("b/x"), Some(f));
        assert_eq!(t.get(f).map(|n| n.path.as_str()), Some("b/x"));
        assert!(t.get(other).is_none());
        assert_eq!(t.ino_of("a"), None);
        assert_eq!(parent_of("b/x"), "b");
        assert_eq!(join("", "x"), "x");
    }
}
