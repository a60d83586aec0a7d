//! The optional local stripe cache (`--cache-dir DIR --cache-mib N`).
//!
//! Whole stripes read from the store are kept as files in one directory and served from there on
//! later reads, least recently used evicted first once their total passes the capacity. A file is
//! named by the **version** of the object it came from (a BLAKE3 hash of key, ETag, size and
//! last-modified time, taken from a HEAD at open) and the stripe's offset and length, so a changed
//! object never matches stripes of an older version: they are simply never read again and age
//! out. Each file ends with the BLAKE3 hash of its bytes, checked on every hit; a file damaged on
//! disk is dropped and the stripe fetched again, never returned.
//!
//! Files are written to a temporary name and renamed, so a crash leaves whole entries or none;
//! opening the directory rebuilds the LRU order from modification times and removes leftovers.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use parking_lot::Mutex;

const HASH_LEN: usize = 32;

/// A bounded directory of stripe files. Cheap to clone.
#[derive(Debug, Clone)]
pub struct StripeCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    capacity: u64,
    lru: Mutex<Lru>,
    tmp: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

#[derive(Debug, Default)]
struct Lru {
    /// file name → (last-use tick, bytes on disk)
    entries: HashMap<String, (u64, u64)>,
    /// last-use tick → file name
    order: BTreeMap<u64, String>,
    bytes: u64,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, name: &str, size: u64) {
        self.tick += 1;
        if let Some((old, old_size)) = self.entries.insert(name.to_string(), (self.tick, size)) {
            self.order.remove(&old);
            self.bytes -= old_size;
        }
        self.order.insert(self.tick, name.to_string());
        self.bytes += size;
    }

    fn remove(&mut self, name: &str) {
        if let Some((tick, size)) = self.entries.remove(name) {
            self.order.remove(&tick);
            self.bytes -= size;
        }
    }

    fn evict(&mut self, capacity: u64) -> Vec<String> {
        let mut out = Vec::new();
        while self.bytes > capacity {
            let Some((_, name)) = self.order.pop_first() else {
                break;
            };
            if let Some((_, size)) = self.entries.remove(&name) {
                self.bytes -= size;
            }
            out.push(name);
        }
        out
    }
}

/// The cache identity of one version of one object.
pub fn version(key: &str, e_tag: Option<&str>, size: u64, mtime: SystemTime) -> String {
    let nanos = mtime
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut h = blake3::Hasher::new();
    for part in [
        key,
        e_tag.unwrap_or(""),
        &size.to_string(),
        &nanos.to_string(),
    ] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    h.finalize().to_hex().to_string()
}

fn is_entry_name(name: &str) -> bool {
    let mut parts = name.split('-');
    let ok = |p: Option<&str>, max: usize| {
        p.is_some_and(|p| {
            !p.is_empty() && p.len() <= max && p.bytes().all(|b| b.is_ascii_hexdigit())
        })
    };
    ok(parts.next(), 64) && ok(parts.next(), 16) && ok(parts.next(), 16) && parts.next().is_none()
}

impl StripeCache {
    /// Opens (creating it if needed) a cache in `dir` of at most `capacity` bytes.
    pub fn open(dir: &Path, capacity: u64) -> io::Result<StripeCache> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for f in std::fs::read_dir(dir)? {
            let f = f?;
            let name = f.file_name().to_string_lossy().to_string();
            let Ok(meta) = f.metadata() else { continue };
            if name.starts_with(".tmp-") {
                let _ = std::fs::remove_file(f.path());
            } else if meta.is_file() && is_entry_name(&name) {
                found.push((meta.modified().ok(), name, meta.len()));
            }
        }
        found.sort();
        let mut lru = Lru::default();
        for (_, name, size) in found {
            lru.touch(&name, size);
        }
        let cache = StripeCache {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                capacity,
                lru: Mutex::new(lru),
                tmp: AtomicU64::new(0),
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
            }),
        };
        let evicted = cache.inner.lru.lock().evict(capacity);
        cache.remove_files(&evicted);
        Ok(cache)
    }

    /// Bytes held on disk.
    pub fn bytes(&self) -> u64 {
        self.inner.lru.lock().bytes
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Stripes served from the cache so far.
    pub fn hits(&self) -> u64 {
        self.inner.hits.load(Ordering::Relaxed)
    }

    /// Stripes looked up and not found so far.
    pub fn misses(&self) -> u64 {
        self.inner.misses.load(Ordering::Relaxed)
    }

    fn name(version: &str, start: u64, len: u64) -> String {
        format!("{version}-{start:x}-{len:x}")
    }

    fn remove_files(&self, names: &[String]) {
        for name in names {
            let _ = std::fs::remove_file(self.inner.dir.join(name));
        }
    }

    /// The `len` bytes at `start` of object version `version`, if cached and intact.
    pub async fn get(&self, version: &str, start: u64, len: u64) -> Option<Bytes> {
        let name = Self::name(version, start, len);
        {
            let mut lru = self.inner.lru.lock();
            match lru.entries.get(&name) {
                Some(&(_, size)) => lru.touch(&name, size),
                None => {
                    self.inner.misses.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            }
        }
        let path = self.inner.dir.join(&name);
        let read = tokio::task::spawn_blocking(move || {
            let mut data = std::fs::read(path)?;
            let ok = data.len() == len as usize + HASH_LEN && {
                let (body, hash) = data.split_at(len as usize);
                blake3::hash(body).as_bytes() == hash
            };
            data.truncate(len as usize);
            Ok::<_, io::Error>(ok.then_some(data))
        })
        .await;
        match read {
            Ok(Ok(Some(data))) => {
                self.inner.hits.fetch_add(1, Ordering::Relaxed);
                Some(Bytes::from(data))
            }
            other => {
                if !matches!(other, Ok(Err(ref e)) if e.kind() == io::ErrorKind::NotFound) {
                    tracing::warn!(file = %name, "damaged or unreadable cache file; dropping it");
                }
                self.inner.lru.lock().remove(&name);
                self.remove_files(&[name]);
                self.inner.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Keeps a stripe, evicting the least recently used beyond the capacity. Failures are only
    /// logged: the cache is an optimisation.
    pub async fn insert(&self, version: &str, start: u64, data: Bytes) {
        let size = (data.len() + HASH_LEN) as u64;
        if size > self.inner.capacity {
            return;
        }
        let name = Self::name(version, start, data.len() as u64);
        let path = self.inner.dir.join(&name);
        let tmp = self.inner.dir.join(format!(
            ".tmp-{}-{}",
            std::process::id(),
            self.inner.tmp.fetch_add(1, Ordering::Relaxed)
        ));
        let written = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&data)?;
            f.write_all(blake3::hash(&data).as_bytes())?;
            drop(f);
            std::fs::rename(&tmp, &path).inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })
        })
        .await;
        match written {
            Ok(Ok(())) => {
                let evicted = {
                    let mut lru = self.inner.lru.lock();
                    lru.touch(&name, size);
                    lru.evict(self.inner.capacity)
                };
                self.remove_files(&evicted);
            }
            Ok(Err(e)) => tracing::warn!(file = %name, error = %e, "could not write cache file"),
            Err(e) => tracing::warn!(file = %name, error = %e, "cache write task failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hits_evicts_and_drops_damaged_files() {
        let dir = tempfile::tempdir().unwrap();
        let cache = StripeCache::open(dir.path(), 300).unwrap();
        let v = version("k", Some("e1"), 300, SystemTime::UNIX_EPOCH);
        assert_ne!(v, version("k", Some("e2"), 300, SystemTime::UNIX_EPOCH));
        cache.insert(&v, 0, Bytes::from(vec![1u8; 100])).await;
        cache.insert(&v, 100, Bytes::from(vec![2u8; 100])).await;
        assert_eq!(cache.get(&v, 0, 100).await.unwrap(), vec![1u8; 100]);
        // A third entry evicts the least recently used (offset 100).
        cache.insert(&v, 200, Bytes::from(vec![3u8; 50])).await;
        assert!(cache.bytes() <= 300);
        assert!(cache.get(&v, 100, 100).await.is_none());
        assert_eq!(cache.get(&v, 200, 50).await.unwrap(), vec![3u8; 50]);
        // A damaged file is a miss, and is gone afterwards.
        let f = dir.path().join(StripeCache::name(&v, 0, 100));
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[5] ^= 1;
        std::fs::write(&f, bytes).unwrap();
        assert!(cache.get(&v, 0, 100).await.is_none());
        assert!(!f.exists());
        // Reopening finds what is left.
        let again = StripeCache::open(dir.path(), 300).unwrap();
        assert_eq!(again.get(&v, 200, 50).await.unwrap(), vec![3u8; 50]);
        assert_eq!((cache.hits(), again.hits()), (2, 1));
    }
}
