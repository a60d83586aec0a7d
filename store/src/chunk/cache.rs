//! The local chunk cache: plaintext chunk files in a directory, evicted least-recently-used
//! first when their total size passes the capacity.
//!
//! The directory is a [`DiskCache`]: files are named by chunk id (`<dir>/<2 hex>/<64 hex>`) and
//! written to a temporary name then renamed, so a crash leaves either a whole chunk or none; on
//! open the directory is scanned (oldest modification first) to rebuild the LRU order. On every
//! hit the content is re-hashed, so a cache file damaged on disk is dropped and refetched rather
//! than returned.
//!
//! Besides chunks, the cache holds whole files of several chunks, named by a key derived from
//! their chunk list ([`ChunkCache::file_key`]) and checked chunk by chunk before use
//! ([`ChunkCache::verify_file`]).
//!
//! [`ChunkCache::link_to`] hands a cache file out as a hard link (restoring a tree without writing
//! its files again). Such a file keeps its name in the cache and takes the linked entry's mode and
//! mtime, so after a reopen it may rank older in the LRU order; evicting it removes only the
//! cache's name.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use super::{ChunkId, ChunkRef};
use crate::disk_cache::{DiskCache, EntryNames};
use crate::error::{Error, Result};

/// A bounded on-disk cache of verified chunk plaintext. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ChunkCache {
    inner: Arc<DiskCache<ChunkFiles>>,
}

/// Chunk files are named by their id's 64 hex digits, under a subdirectory named by the first 2.
#[derive(Debug)]
struct ChunkFiles;

impl EntryNames for ChunkFiles {
    type Key = ChunkId;
    const FAN_OUT: bool = true;

    fn path_of(id: &ChunkId) -> PathBuf {
        let hex = id.to_hex();
        Path::new(&hex[..2]).join(&hex)
    }

    fn key_of(name: &str) -> Option<ChunkId> {
        ChunkId::from_hex(name).ok()
    }
}

impl ChunkCache {
    /// Opens (creating if needed) a cache in `dir` holding at most `capacity` bytes.
    pub fn open(dir: &Path, capacity: u64) -> Result<ChunkCache> {
        Ok(ChunkCache {
            inner: Arc::new(DiskCache::open(dir, capacity)?),
        })
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        self.inner.dir()
    }

    /// The file that holds `id` (whether or not it is cached).
    pub fn path_of(&self, id: &ChunkId) -> PathBuf {
        self.inner.path_of(id)
    }

    /// The cached file of `id`, if cached, marking it used: for hard-linking chunk files.
    pub fn file(&self, id: &ChunkId) -> Option<PathBuf> {
        self.inner.use_entry(id)
    }

    /// Hard-links the cached file of `id` to `dest` (which must not exist) as a file with
    /// permission bits `mode` and modification time `mtime_ns`, so a restored tree shares its
    /// bytes with the cache instead of writing them again. The caller has verified the cached
    /// bytes (a [`crate::ChunkStore::get`] just before does that).
    ///
    /// A linked inode has one mode and one mtime for every name it has, so the cache file takes
    /// `mode` and `mtime_ns` only while the cache is its sole name; once linked elsewhere it is
    /// linked again only where the mode and mtime match, so linking never changes the metadata of
    /// a file already handed out. An exclusive `flock` on the cache file makes that check and the
    /// link one step across processes.
    ///
    /// `Ok(false)`, and nothing done, when it cannot link: the chunk is not cached, `dest` is on
    /// another file system, the inode is shared with a different mode or mtime, `mode` would make
    /// the cache file unreadable, or the file has too many links. Other I/O errors are errors.
    pub fn link_to(&self, id: &ChunkId, dest: &Path, mode: u32, mtime_ns: i64) -> Result<bool> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

        if mode & 0o400 == 0 || self.file(id).is_none() {
            return Ok(false);
        }
        let src = self.path_of(id);
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&src)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("open cached chunk", &src, e)),
        };
        let fd = file.as_raw_fd();
        // SAFETY: `fd` is an open descriptor owned by `file`, which outlives the call; the lock
        // is released when `file` is closed.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(Error::io(
                "lock cached chunk",
                &src,
                std::io::Error::last_os_error(),
            ));
        }
        let meta = file
            .metadata()
            .map_err(|e| Error::io("stat cached chunk", &src, e))?;
        let mode = mode & 0o7777;
        let same = meta.mode() & 0o7777 == mode
            && meta.mtime() * 1_000_000_000 + meta.mtime_nsec() == mtime_ns;
        if !same {
            if meta.nlink() > 1 {
                return Ok(false);
            }
            crate::file_meta::set_fd_metadata(&file, &src, mode, mtime_ns)?;
        }
        match std::fs::hard_link(&src, dest) {
            Ok(()) => Ok(true),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EMLINK | libc::EPERM)
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(Error::io("hard-link cached chunk", dest, e)),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.inner.bytes()
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    /// Whether `id` is cached.
    pub fn contains(&self, id: &ChunkId) -> bool {
        self.inner.contains(id)
    }

    /// The verified plaintext of `id`, if cached. A cache file that no longer matches its id is
    /// removed and reported as a miss.
    pub async fn get(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        // A miss needs no blocking thread; a hit is marked used by `get_blocking`.
        if !self.contains(id) {
            return Ok(None);
        }
        let (this, id) = (self.clone(), *id);
        tokio::task::spawn_blocking(move || this.get_blocking(&id))
            .await
            .map_err(|e| Error::task("cache read", e))?
    }

    /// [`ChunkCache::get`] on the calling thread, for callers already off the runtime.
    pub fn get_blocking(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        if self.file(id).is_none() {
            return Ok(None);
        }
        let path = self.path_of(id);
        let read = std::fs::read(&path).map(|data| (ChunkId::of(&data) == *id).then_some(data));
        match read {
            Ok(Some(data)) => Ok(Some(Bytes::from(data))),
            Ok(None) => {
                tracing::warn!(chunk = %id, "cached chunk does not match its id; dropping it");
                self.remove(id);
                Ok(None)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.inner.forget(id);
                Ok(None)
            }
            Err(e) => Err(Error::io("read cached chunk", path, e)),
        }
    }

    /// Caches verified plaintext, evicting least recently used chunks beyond the capacity.
    pub async fn insert(&self, id: &ChunkId, data: &Bytes) -> Result<()> {
        let (this, id, data) = (self.clone(), *id, data.clone());
        tokio::task::spawn_blocking(move || this.insert_blocking(&id, &data))
            .await
            .map_err(|e| Error::task("cache write", e))?
    }

    /// [`ChunkCache::insert`] on the calling thread, for callers already off the runtime (a
    /// fetch writes the chunk it has just decoded without another hand-off between threads).
    pub fn insert_blocking(&self, id: &ChunkId, data: &[u8]) -> Result<()> {
        use std::io::Write;
        self.inner
            .write(id, data.len() as u64, |f| f.write_all(data))?;
        Ok(())
    }

    /// Takes `path`, a complete file holding exactly the (verified) bytes of chunk `id` (or of
    /// the chunks whose [`ChunkCache::file_key`] `id` is), into the cache as a hard link of it:
    /// a restore that has just written the file then needn't write the cache's copy too. The
    /// file shares its inode with the cache from then on, as one [`ChunkCache::link_to`] made
    /// does. `Ok(false)`, and nothing done, when `id` is cached already, `mode` would make the
    /// cache file unreadable, or `path` is on another file system.
    pub fn adopt(&self, id: &ChunkId, path: &Path, len: u64, mode: u32) -> Result<bool> {
        if len > self.inner.capacity() || mode & 0o400 == 0 || self.file(id).is_some() {
            return Ok(false);
        }
        let dest = self.path_of(id);
        let linked = match std::fs::hard_link(path, &dest) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.inner.create_parent(id)?;
                std::fs::hard_link(path, &dest)
            }
            other => other,
        };
        match linked {
            Ok(()) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::AlreadyExists
                    || e.kind() == std::io::ErrorKind::CrossesDevices
                    || e.raw_os_error() == Some(libc::EMLINK) =>
            {
                return Ok(false);
            }
            Err(e) => return Err(Error::io("link into the chunk cache", &dest, e)),
        }
        self.inner.admit(id, len);
        Ok(true)
    }

    /// The cache key of a whole file made of `chunks` in order. [`ChunkCache::adopt`] takes a
    /// restored file of several chunks under it, so a later restore links the file as it links
    /// a one-chunk file instead of writing it again. Derived under its own context, so it is
    /// never the id of a chunk.
    pub fn file_key(chunks: &[ChunkRef]) -> ChunkId {
        let mut h = blake3::Hasher::new_derive_key("hotstart 2026 cached file of chunks");
        for c in chunks {
            h.update(&c.id.0);
            h.update(&c.len.to_le_bytes());
        }
        ChunkId(*h.finalize().as_bytes())
    }

    /// Whether the cached file under `key` ([`ChunkCache::file_key`]) still holds exactly
    /// `chunks`, each re-hashed; one that does not is dropped and reported as `false`, like a
    /// damaged chunk.
    pub fn verify_file(&self, key: &ChunkId, chunks: &[ChunkRef]) -> Result<bool> {
        use std::io::Read;
        if self.file(key).is_none() {
            return Ok(false);
        }
        let path = self.path_of(key);
        let mut file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.inner.forget(key);
                return Ok(false);
            }
            Err(e) => return Err(Error::io("open cached file", path, e)),
        };
        let mut buf = Vec::new();
        let mut intact = true;
        for c in chunks {
            buf.resize(c.len as usize, 0);
            let read = file.read_exact(&mut buf);
            if read.is_err() || ChunkId::of(&buf) != c.id {
                intact = false;
                break;
            }
        }
        // Nothing may follow the last chunk.
        intact = intact && file.read(&mut [0u8; 1]).is_ok_and(|n| n == 0);
        if !intact {
            tracing::warn!(path = %path.display(),
                "cached file does not match its chunks; dropping it");
            self.remove(key);
        }
        Ok(intact)
    }

    /// Drops `id` from the cache.
    pub fn remove(&self, id: &ChunkId) {
        self.inner.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn evicts_least_recently_used_by_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(dir.path(), 250).unwrap();
        let chunks: Vec<Bytes> = (0..3u8).map(|i| Bytes::from(vec![i; 100])).collect();
        let ids: Vec<ChunkId> = chunks.iter().map(|c| ChunkId::of(c)).collect();
        cache.insert(&ids[0], &chunks[0]).await.unwrap();
        cache.insert(&ids[1], &chunks[1]).await.unwrap();
        // Use chunk 0 so chunk 1 is the least recently used.
        assert_eq!(cache.get(&ids[0]).await.unwrap().unwrap(), chunks[0]);
        cache.insert(&ids[2], &chunks[2]).await.unwrap();
        assert!(cache.bytes() <= 250);
        assert!(cache.contains(&ids[0]));
        assert!(!cache.contains(&ids[1]));
        assert!(!cache.path_of(&ids[1]).exists());
        assert!(cache.contains(&ids[2]));

        // Reopening rebuilds the index from the directory.
        drop(cache);
        let cache = ChunkCache::open(dir.path(), 250).unwrap();
        assert_eq!(cache.bytes(), 200);
        assert_eq!(cache.get(&ids[2]).await.unwrap().unwrap(), chunks[2]);
    }

    #[tokio::test]
    async fn a_damaged_cache_file_is_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(dir.path(), 1 << 20).unwrap();
        let data = Bytes::from_static(b"precious bytes");
        let id = ChunkId::of(&data);
        cache.insert(&id, &data).await.unwrap();
        std::fs::write(cache.path_of(&id), b"precious bytez").unwrap();
        assert!(cache.get(&id).await.unwrap().is_none());
        assert!(!cache.contains(&id));
    }

    #[tokio::test]
    async fn link_to_shares_an_inode_only_with_matching_metadata() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(&dir.path().join("cache"), 1 << 20).unwrap();
        let data = Bytes::from_static(b"print('hello')\n");
        let id = ChunkId::of(&data);
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        assert!(
            !cache.link_to(&id, &out.join("a"), 0o644, 1).unwrap(),
            "not cached yet"
        );
        cache.insert(&id, &data).await.unwrap();

        // The first link claims the cache file: it takes the entry's mode and mtime.
        let t1 = 1_600_000_000_123_456_789;
        assert!(cache.link_to(&id, &out.join("a"), 0o755, t1).unwrap());
        let a = std::fs::metadata(out.join("a")).unwrap();
        assert_eq!(
            a.ino(),
            std::fs::metadata(cache.path_of(&id)).unwrap().ino()
        );
        assert_eq!(a.mode() & 0o7777, 0o755);
        assert_eq!(a.mtime() * 1_000_000_000 + a.mtime_nsec(), t1);
        assert_eq!(std::fs::read(out.join("a")).unwrap(), data);

        // Same metadata: linked again. Other metadata: refused, and `a` is left as it was.
        assert!(cache.link_to(&id, &out.join("b"), 0o755, t1).unwrap());
        assert!(!cache.link_to(&id, &out.join("c"), 0o644, t1).unwrap());
        assert!(!cache.link_to(&id, &out.join("d"), 0o755, t1 + 1).unwrap());
        assert!(!out.join("c").exists() && !out.join("d").exists());
        let a = std::fs::metadata(out.join("a")).unwrap();
        assert_eq!(a.mode() & 0o7777, 0o755);
        assert_eq!(a.nlink(), 3);
        // A mode the cache could not read back is never given to the cache file.
        std::fs::remove_file(out.join("a")).unwrap();
        std::fs::remove_file(out.join("b")).unwrap();
        assert!(!cache.link_to(&id, &out.join("e"), 0o200, t1).unwrap());

        // Another file system: no link, no error.
        if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
            assert!(
                !cache
                    .link_to(&id, &shm.path().join("x"), 0o755, t1)
                    .unwrap()
            );
            assert!(!shm.path().join("x").exists());
        }
    }

    #[tokio::test]
    async fn adopt_takes_a_written_file_as_the_cached_copy() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(&dir.path().join("cache"), 1 << 20).unwrap();
        let data = Bytes::from_static(b"import os\n");
        let id = ChunkId::of(&data);
        let file = dir.path().join("restored.py");
        std::fs::write(&file, &data).unwrap();
        let len = data.len() as u64;

        // Unreadable for the cache: left alone.
        assert!(!cache.adopt(&id, &file, len, 0o200).unwrap());
        assert!(!cache.contains(&id));

        assert!(cache.adopt(&id, &file, len, 0o644).unwrap());
        assert!(cache.contains(&id));
        assert_eq!(
            std::fs::metadata(&file).unwrap().ino(),
            std::fs::metadata(cache.path_of(&id)).unwrap().ino()
        );
        assert_eq!(cache.bytes(), len);
        // A hit reads (and checks) the adopted bytes; a second adoption changes nothing.
        assert_eq!(cache.get(&id).await.unwrap().unwrap(), data);
        let other = dir.path().join("again.py");
        std::fs::write(&other, &data).unwrap();
        assert!(!cache.adopt(&id, &other, len, 0o644).unwrap());
        assert_eq!(std::fs::metadata(&other).unwrap().nlink(), 1);

        // Another file system: no link, no error.
        if let Ok(shm) = tempfile::tempdir_in("/dev/shm") {
            let data = Bytes::from_static(b"elsewhere");
            let id = ChunkId::of(&data);
            let there = shm.path().join("x");
            std::fs::write(&there, &data).unwrap();
            assert!(!cache.adopt(&id, &there, 9, 0o644).unwrap());
            assert!(!cache.contains(&id));
        }
    }

    #[test]
    fn a_whole_file_is_checked_chunk_by_chunk_before_use() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ChunkCache::open(&dir.path().join("cache"), 1 << 20).unwrap();
        let parts: [&[u8]; 2] = [b"first chunk ", b"second"];
        let refs: Vec<ChunkRef> = parts
            .iter()
            .map(|p| ChunkRef {
                id: ChunkId::of(p),
                len: p.len() as u32,
            })
            .collect();
        let key = ChunkCache::file_key(&refs);
        // Its own key: neither chunk's id, nor the key of the chunks in another order.
        assert!(refs.iter().all(|r| r.id != key));
        assert_ne!(key, ChunkCache::file_key(&[refs[1], refs[0]]));
        assert_ne!(key, ChunkId::of(&parts.concat()));

        let file = dir.path().join("lib.so");
        std::fs::write(&file, parts.concat()).unwrap();
        assert!(cache.adopt(&key, &file, 18, 0o644).unwrap());
        assert!(cache.verify_file(&key, &refs).unwrap());
        // One byte more at the end (through the shared inode): dropped, and a miss from then on.
        let mut longer = parts.concat();
        longer.push(b'!');
        std::fs::write(&file, &longer).unwrap();
        assert!(!cache.verify_file(&key, &refs).unwrap());
        assert!(!cache.contains(&key) && !cache.path_of(&key).exists());
        assert!(!cache.verify_file(&key, &refs).unwrap());
    }
}
