//! [`DiskCache`]: a directory of entry files bounded by bytes, least recently used evicted first.
//!
//! The building block of every on-disk cache here (the chunk cache, the FUSE stripe cache). It
//! owns the directory, the [`LruIndex`] over it and the routine that keeps the two in step; the
//! cache built on it says how entries are named ([`EntryNames`]) and what their bytes mean
//! (checksums, framing), and checks them on use.
//!
//! - **Layout.** Each entry is one file, `<dir>/<name>` or, for a fan-out layout,
//!   `<dir>/<sub>/<name>` (one level of subdirectories, made on the first write into each).
//! - **Writing.** An entry is written to `.tmp-<pid>-<n>` beside its final name, then renamed, so
//!   a crash leaves a whole entry or none. Only then is it indexed, and the least recently used
//!   entries beyond the capacity are evicted: dropped from the index, then their files removed.
//!   An entry larger than the whole capacity is not kept.
//! - **Opening** a directory rebuilds the index: leftover temporary files are removed, files that
//!   name an entry are indexed by size, oldest modification first (ties by name), and the cache
//!   is evicted down to its capacity. Any other file is left alone and not counted.
//!
//! Every call here does blocking file I/O; async users run them on the blocking pool.

use std::fs::File;
use std::hash::Hash;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::lru::LruIndex;

/// The prefix of the temporary files entries are written to before their rename.
const TMP_PREFIX: &str = ".tmp-";

/// How the entries of one kind of cache are named on disk.
pub trait EntryNames {
    /// What an entry is looked up by.
    type Key: Hash + Eq + Clone + std::fmt::Debug;

    /// Whether entry files sit in one level of subdirectories (`<dir>/<sub>/<name>`) rather
    /// than directly in the cache directory.
    const FAN_OUT: bool;

    /// The file of `key`, relative to the cache directory: `<name>`, or `<sub>/<name>` when
    /// [`EntryNames::FAN_OUT`].
    fn path_of(key: &Self::Key) -> PathBuf;

    /// The key of the entry file named `name`, or `None` for a file that is no entry.
    fn key_of(name: &str) -> Option<Self::Key>;
}

/// A directory of entry files indexed least-recently-used by bytes.
#[derive(Debug)]
pub struct DiskCache<N: EntryNames> {
    dir: PathBuf,
    capacity: u64,
    lru: Mutex<LruIndex<N::Key>>,
    tmp_counter: AtomicU64,
}

impl<N: EntryNames> DiskCache<N> {
    /// Opens (creating it if needed) a cache in `dir` of at most `capacity` bytes: removes
    /// leftover temporary files, indexes the entry files found, oldest modification first, and
    /// evicts the oldest beyond the capacity.
    pub fn open(dir: &Path, capacity: u64) -> Result<DiskCache<N>> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create cache directory", dir, e))?;
        let mut found = Vec::new();
        if N::FAN_OUT {
            for sub in
                std::fs::read_dir(dir).map_err(|e| Error::io("read cache directory", dir, e))?
            {
                let sub = sub.map_err(|e| Error::io("read cache directory", dir, e))?;
                if !sub.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                // A subdirectory that cannot be read holds nothing the cache can use.
                let _ = scan::<N>(&sub.path(), &mut found);
            }
        } else {
            scan::<N>(dir, &mut found).map_err(|e| Error::io("read cache directory", dir, e))?;
        }
        found.sort_by(|a, b| (a.mtime, &a.name).cmp(&(b.mtime, &b.name)));
        let mut lru = LruIndex::default();
        for f in found {
            lru.touch(f.key, f.size);
        }
        let cache = DiskCache {
            dir: dir.to_path_buf(),
            capacity,
            lru: Mutex::new(lru),
            tmp_counter: AtomicU64::new(0),
        };
        let evicted = cache.lru.lock().evict(capacity);
        cache.remove_files(&evicted);
        Ok(cache)
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held (the sizes the entries were indexed with).
    pub fn bytes(&self) -> u64 {
        self.lru.lock().bytes()
    }

    /// Number of entries held.
    pub fn len(&self) -> usize {
        self.lru.lock().len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.lru.lock().is_empty()
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: &N::Key) -> bool {
        self.lru.lock().contains(key)
    }

    /// The file that holds `key` (whether or not it is held).
    pub fn path_of(&self, key: &N::Key) -> PathBuf {
        self.dir.join(N::path_of(key))
    }

    /// The file of `key` if held, marking it the most recently used.
    pub fn use_entry(&self, key: &N::Key) -> Option<PathBuf> {
        self.lru.lock().use_existing(key)?;
        Some(self.path_of(key))
    }

    /// Writes the entry `key` of `size` bytes: `fill` writes its bytes into a temporary file,
    /// which is then renamed into place, indexed, and the cache evicted down to its capacity.
    /// `Ok(false)`, and nothing written, when `size` exceeds the whole capacity. On an error the
    /// temporary file is removed and the index is left as it was.
    pub fn write(
        &self,
        key: &N::Key,
        size: u64,
        fill: impl FnOnce(&mut File) -> io::Result<()>,
    ) -> Result<bool> {
        if size > self.capacity {
            return Ok(false);
        }
        let path = self.path_of(key);
        let tmp = path.with_file_name(format!(
            "{TMP_PREFIX}{}-{}",
            std::process::id(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        ));
        // A fan-out subdirectory is made on the first write into it, not checked on every one.
        let created = match File::create(&tmp) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.create_parent(key)?;
                File::create(&tmp)
            }
            other => other,
        };
        let mut file = created.map_err(|e| Error::io("create cache file", &tmp, e))?;
        let filled = fill(&mut file);
        drop(file);
        let renamed = filled
            .map_err(|e| Error::io("write cache file", &tmp, e))
            .and_then(|()| {
                std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename cache file", &path, e))
            });
        if let Err(e) = renamed {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        self.admit(key, size);
        Ok(true)
    }

    /// Makes the directory the file of `key` goes in, for a caller that places the file itself
    /// (a hard link) and found the directory missing.
    pub fn create_parent(&self, key: &N::Key) -> Result<()> {
        let path = self.path_of(key);
        match path.parent() {
            Some(parent) => std::fs::create_dir_all(parent)
                .map_err(|e| Error::io("create cache directory", parent, e)),
            None => Ok(()),
        }
    }

    /// Indexes `key` as `size` bytes, the most recently used, and evicts the least recently used
    /// entries beyond the capacity (removing their files); returns the keys evicted, oldest
    /// first. For an entry file the caller has put at [`DiskCache::path_of`] itself; a key held
    /// already takes the new size.
    pub fn admit(&self, key: &N::Key, size: u64) -> Vec<N::Key> {
        let evicted = {
            let mut lru = self.lru.lock();
            lru.touch(key.clone(), size);
            lru.evict(self.capacity)
        };
        self.remove_files(&evicted);
        evicted
    }

    /// Drops `key` from the index only, for an entry whose file is already gone.
    pub fn forget(&self, key: &N::Key) {
        self.lru.lock().remove(key);
    }

    /// Drops `key`: from the index, then its file.
    pub fn remove(&self, key: &N::Key) {
        self.forget(key);
        self.remove_files(std::slice::from_ref(key));
    }

    fn remove_files(&self, keys: &[N::Key]) {
        for key in keys {
            let path = self.path_of(key);
            if let Err(e) = std::fs::remove_file(&path)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "could not remove cache file");
            }
        }
    }
}

/// An entry file found when opening.
struct Found<K> {
    mtime: Option<SystemTime>,
    name: String,
    key: K,
    size: u64,
}

/// Collects the entry files directly in `dir` into `found`, removing leftover temporary files.
fn scan<N: EntryNames>(dir: &Path, found: &mut Vec<Found<N::Key>>) -> io::Result<()> {
    for f in std::fs::read_dir(dir)? {
        let f = f?;
        let name = f.file_name().to_string_lossy().into_owned();
        let Ok(meta) = f.metadata() else { continue };
        if name.starts_with(TMP_PREFIX) {
            let _ = std::fs::remove_file(f.path());
        } else if meta.is_file()
            && let Some(key) = N::key_of(&name)
        {
            found.push(Found {
                mtime: meta.modified().ok(),
                name,
                key,
                size: meta.len(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Entries named `e-<key>` directly in the directory.
    #[derive(Debug)]
    struct Flat;

    impl EntryNames for Flat {
        type Key = String;
        const FAN_OUT: bool = false;
        fn path_of(key: &String) -> PathBuf {
            PathBuf::from(format!("e-{key}"))
        }
        fn key_of(name: &str) -> Option<String> {
            name.strip_prefix("e-").map(str::to_string)
        }
    }

    /// Entries named `<key>` under a subdirectory named by the key's first letter.
    #[derive(Debug)]
    struct Fanned;

    impl EntryNames for Fanned {
        type Key = String;
        const FAN_OUT: bool = true;
        fn path_of(key: &String) -> PathBuf {
            Path::new(&key[..1]).join(key)
        }
        fn key_of(name: &str) -> Option<String> {
            name.chars()
                .all(|c| c.is_ascii_lowercase())
                .then(|| name.to_string())
        }
    }

    fn k(s: &str) -> String {
        s.to_string()
    }

    fn put<N: EntryNames<Key = String>>(c: &DiskCache<N>, key: &str, byte: u8, len: usize) {
        assert!(
            c.write(&k(key), len as u64, |f| {
                io::Write::write_all(f, &vec![byte; len])
            })
            .unwrap()
        );
    }

    /// A file of `len` bytes at `path` last modified `secs` after the epoch.
    fn file_at(path: &Path, len: usize, secs: u64) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, vec![7u8; len]).unwrap();
        let f = File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
            .unwrap();
    }

    fn names_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn evicts_least_recently_used_files_by_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::<Flat>::open(dir.path(), 300).unwrap();
        put(&c, "a", 1, 100);
        put(&c, "b", 2, 100);
        put(&c, "c", 3, 100);
        assert_eq!((c.len(), c.bytes()), (3, 300));
        assert_eq!(c.use_entry(&k("a")), Some(dir.path().join("e-a")));
        assert_eq!(c.use_entry(&k("zz")), None);

        // Each new entry pushes out exactly the least recently used one: b, then c, then a.
        put(&c, "d", 4, 100);
        assert_eq!(names_in(dir.path()), ["e-a", "e-c", "e-d"]);
        put(&c, "e", 5, 100);
        assert_eq!(names_in(dir.path()), ["e-a", "e-d", "e-e"]);
        put(&c, "f", 6, 100);
        assert_eq!(names_in(dir.path()), ["e-d", "e-e", "e-f"]);
        assert!(!c.contains(&k("a")) && c.contains(&k("f")));
        assert_eq!(
            std::fs::read(dir.path().join("e-f")).unwrap(),
            vec![6u8; 100]
        );
        assert_eq!(c.bytes(), 300);

        // One entry larger than the space left evicts as many as it needs, oldest first.
        assert_eq!(c.admit(&k("d"), 100), Vec::<String>::new());
        std::fs::write(dir.path().join("e-g"), vec![0u8; 150]).unwrap();
        assert_eq!(c.admit(&k("g"), 150), vec![k("e"), k("f")]);
        assert_eq!(names_in(dir.path()), ["e-d", "e-g"]);
        assert_eq!(c.bytes(), 250);

        // Larger than the whole capacity: not written, nothing evicted.
        assert!(!c.write(&k("h"), 301, |_| unreachable!()).unwrap());
        assert_eq!(names_in(dir.path()), ["e-d", "e-g"]);

        // Rewriting an entry replaces its bytes and its size.
        put(&c, "d", 9, 40);
        assert_eq!(
            std::fs::read(dir.path().join("e-d")).unwrap(),
            vec![9u8; 40]
        );
        assert_eq!(c.bytes(), 190);

        c.remove(&k("g"));
        assert_eq!(names_in(dir.path()), ["e-d"]);
        assert_eq!((c.len(), c.bytes()), (1, 40));
    }

    #[test]
    fn a_failed_write_leaves_no_file_and_no_entry() {
        let dir = tempfile::tempdir().unwrap();
        let c = DiskCache::<Flat>::open(dir.path(), 300).unwrap();
        put(&c, "a", 1, 100);
        let err = c
            .write(&k("b"), 100, |f| {
                io::Write::write_all(f, b"half")?;
                Err(io::Error::other("disk on fire"))
            })
            .unwrap_err();
        assert!(err.to_string().contains("disk on fire"), "{err}");
        assert_eq!(names_in(dir.path()), ["e-a"]);
        assert_eq!((c.len(), c.bytes()), (1, 100));
    }

    #[test]
    fn open_removes_leftovers_and_rebuilds_the_order_from_mtimes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // Entries last modified in the order c, a, d, b; a crash's temporary file; a stranger.
        file_at(&d.join("e-a"), 100, 2_000);
        file_at(&d.join("e-b"), 100, 4_000);
        file_at(&d.join("e-c"), 100, 1_000);
        file_at(&d.join("e-d"), 50, 3_000);
        file_at(&d.join(".tmp-123-0"), 500, 5_000);
        file_at(&d.join("notes.txt"), 1_000, 500);
        std::fs::create_dir(d.join("e-dir")).unwrap();

        // 350 bytes found, capacity 240: the oldest (c) goes, then the next oldest (a).
        let c = DiskCache::<Flat>::open(d, 240).unwrap();
        assert_eq!(names_in(d), ["e-b", "e-d", "e-dir", "notes.txt"]);
        assert_eq!((c.len(), c.bytes()), (2, 150));
        assert!(c.contains(&k("d")) && c.contains(&k("b")) && !c.contains(&k("dir")));

        // The rebuilt order continues: d (older) goes before b.
        put(&c, "x", 0, 100);
        assert_eq!(names_in(d), ["e-b", "e-dir", "e-x", "notes.txt"]);
        assert_eq!(c.bytes(), 200);
        drop(c);

        // A reopen counts what is on disk, by size; within capacity, nothing goes.
        let c = DiskCache::<Flat>::open(d, 1_000).unwrap();
        assert_eq!((c.len(), c.bytes()), (2, 200));
        assert_eq!(names_in(d), ["e-b", "e-dir", "e-x", "notes.txt"]);
    }

    #[test]
    fn a_fan_out_layout_is_written_and_reopened_through_its_subdirectories() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let c = DiskCache::<Fanned>::open(d, 1_000).unwrap();
        // The subdirectory is made by the first write into it.
        put(&c, "apple", 1, 300);
        put(&c, "avocado", 2, 300);
        put(&c, "banana", 3, 300);
        assert_eq!(names_in(d), ["a", "b"]);
        assert_eq!(names_in(&d.join("a")), ["apple", "avocado"]);
        assert_eq!(std::fs::read(d.join("b/banana")).unwrap(), vec![3u8; 300]);
        drop(c);

        // Leftovers inside subdirectories go; files at the top level are no entries.
        file_at(&d.join("a/.tmp-9-9"), 10, 1);
        file_at(&d.join("b/NOT-AN-ENTRY"), 10, 1);
        file_at(&d.join("cherry"), 10, 1);
        for (name, secs) in [
            ("a/apple", 3_000),
            ("a/avocado", 1_000),
            ("b/banana", 2_000),
        ] {
            let f = File::options().write(true).open(d.join(name)).unwrap();
            f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
                .unwrap();
        }
        let c = DiskCache::<Fanned>::open(d, 650).unwrap();
        assert_eq!(names_in(&d.join("a")), ["apple"]);
        assert_eq!(names_in(&d.join("b")), ["NOT-AN-ENTRY", "banana"]);
        assert!(d.join("cherry").exists());
        assert_eq!((c.len(), c.bytes()), (2, 600));
        // banana (2 000 s) is older than apple (3 000 s).
        put(&c, "cherry", 4, 300);
        assert!(!d.join("b/banana").exists());
        assert_eq!(std::fs::read(d.join("c/cherry")).unwrap(), vec![4u8; 300]);
        assert_eq!(c.bytes(), 600);
    }
}
