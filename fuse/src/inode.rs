//! The inode table: inode numbers ↔ paths, with the stat result last seen for each.
//!
//! Inode 1 is the root (path `""`). A path gets a number the first time it is looked up or
//! listed and keeps it while it exists, so the kernel's cached entries stay valid; a rename moves
//! the number to the new path. Each inode keeps the kind, size and mtime the store last reported
//! and when (`checked`): the filesystem trusts them for `stat_ttl`, then asks the store again.
//! A file being written through the mount carries a [`Writing`] marker instead: its size is the
//! number of bytes written so far and the store is not asked about it until the write commits.
//! Numbers are never reused.
//!
//! **Lifetime.** Each inode counts the references the kernel holds to it, as FUSE does: one for
//! every entry reply (lookup, create, mkdir), and `forget` gives them back. An inode the kernel
//! no longer references and that is not being written is dropped at once. Inodes the kernel was
//! never given (names seen only in a listing, which keeps their stat result for the `ls -l`
//! lookups that usually follow) are dropped once that result is older than `stat_ttl`, by a sweep
//! that runs whenever the table has doubled since the last one. So the table holds what the
//! kernel references, what is being written, and what was seen within `stat_ttl`, however many
//! objects the store has.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// The root directory's inode number.
pub const ROOT: u64 = 1;

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
}

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
    /// References the kernel holds (entry replies not yet forgotten).
    pub lookups: u64,
}

/// The table size below which no sweep runs.
pub const MIN_SWEEP: usize = 1024;

/// Inode number ↔ path, under one lock that is never held across an await.
#[derive(Debug)]
pub struct InodeTable {
    by_ino: HashMap<u64, Inode>,
    by_path: HashMap<String, u64>,
    next: u64,
    /// How long a stat result is trusted (and an unreferenced inode kept).
    ttl: Duration,
    /// The size at which the next sweep runs.
    sweep_at: usize,
}

impl InodeTable {
    pub fn new(ttl: Duration) -> InodeTable {
        let mut t = InodeTable {
            by_ino: HashMap::new(),
            by_path: HashMap::new(),
            next: ROOT + 1,
            ttl,
            sweep_at: MIN_SWEEP,
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
                lookups: 0,
            },
        );
        t.by_path.insert(String::new(), ROOT);
        t
    }

    /// Inodes in the table.
    pub fn len(&self) -> usize {
        self.by_ino.len()
    }

    /// The kernel was given `ino` in an entry reply: it holds one more reference.
    pub fn looked_up(&mut self, ino: u64) {
        if let Some(node) = self.by_ino.get_mut(&ino) {
            node.lookups += 1;
        }
    }

    /// The kernel dropped `n` references to `ino`. An inode left unreferenced is dropped unless
    /// it is being written (it then goes at a sweep once committed) or is the root.
    pub fn forget(&mut self, ino: u64, n: u64) {
        let Some(node) = self.by_ino.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if ino != ROOT && node.lookups == 0 && node.writing.is_none() {
            self.drop_ino(ino);
        }
    }

    fn drop_ino(&mut self, ino: u64) {
        if let Some(node) = self.by_ino.remove(&ino)
            && self.by_path.get(&node.path) == Some(&ino)
        {
            self.by_path.remove(&node.path);
        }
    }

    /// Drops inodes the kernel does not reference, not being written, whose stat result is
    /// older than the TTL (useless as a cache: the next stat asks the store anyway).
    fn sweep(&mut self) {
        let ttl = self.ttl;
        let stale: Vec<u64> = self
            .by_ino
            .iter()
            .filter(|&(&ino, n)| {
                ino != ROOT && n.lookups == 0 && n.writing.is_none() && n.checked.elapsed() >= ttl
            })
            .map(|(&ino, _)| ino)
            .collect();
        for ino in stale {
            self.drop_ino(ino);
        }
        self.sweep_at = (self.by_ino.len() * 2).max(MIN_SWEEP);
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
        if self.by_ino.len() >= self.sweep_at {
            self.sweep();
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
                lookups: 0,
            },
        );
        self.by_path.insert(path.to_string(), ino);
        ino
    }

    /// Forgets the path (it no longer exists) and its inode; the kernel's later requests for the
    /// number get ENOENT.
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

/// `dir/name`, or `name` at the root: the path of an entry in a tree of `/`-separated paths
/// (this mount's and the lazy images').
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
        let mut t = InodeTable::new(Duration::from_secs(1));
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

    #[test]
    fn forgotten_and_stale_unreferenced_inodes_go() {
        let mut t = InodeTable::new(Duration::ZERO);
        let t0 = SystemTime::UNIX_EPOCH;
        let a = t.upsert("a", FileKind::File, 1, t0);
        t.looked_up(a);
        t.looked_up(a);
        t.forget(a, 1);
        assert_eq!(t.ino_of("a"), Some(a), "one reference left");
        t.forget(a, 1);
        assert_eq!(t.ino_of("a"), None);
        assert!(t.get(a).is_none());
        let again = t.upsert("a", FileKind::File, 1, t0);
        assert_ne!(again, a, "numbers are never reused");
        t.forget(ROOT, 5);
        assert!(t.get(ROOT).is_some(), "the root stays");

        // Listed but never looked up: swept once stale, while referenced ones stay.
        let kept = t.upsert("kept", FileKind::File, 1, t0);
        t.looked_up(kept);
        for i in 0..10 * MIN_SWEEP {
            t.upsert(&format!("listed/{i}"), FileKind::File, 1, t0);
        }
        assert!(t.len() <= 2 * MIN_SWEEP, "{} inodes", t.len());
        assert_eq!(t.ino_of("kept"), Some(kept));
    }
}
