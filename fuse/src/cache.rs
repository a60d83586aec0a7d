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
//! The directory is a [`DiskCache`] of the store crate, the block the chunk cache is built on too:
//! files are written to a temporary name and renamed, so a crash leaves whole entries or none;
//! opening the directory rebuilds the LRU order from modification times and removes leftovers.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use bytes::Bytes;
use hotstart_store::{DiskCache, EntryNames};

const HASH_LEN: usize = 32;

/// A bounded directory of stripe files. Cheap to clone.
#[derive(Debug, Clone)]
pub struct StripeCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    files: DiskCache<StripeFiles>,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// Stripe files are named `<version>-<start hex>-<len hex>`, directly in the cache directory.
#[derive(Debug)]
struct StripeFiles;

impl EntryNames for StripeFiles {
    type Key = String;
    const FAN_OUT: bool = false;

    fn path_of(name: &String) -> PathBuf {
        PathBuf::from(name)
    }

    fn key_of(name: &str) -> Option<String> {
        is_entry_name(name).then(|| name.to_string())
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
        let files = DiskCache::open(dir, capacity).map_err(|e| {
            let kind = match &e {
                hotstart_store::Error::Io { source, .. } => source.kind(),
                _ => io::ErrorKind::Other,
            };
            io::Error::new(kind, e)
        })?;
        Ok(StripeCache {
            inner: Arc::new(Inner {
                files,
                hits: AtomicU64::new(0),
                misses: AtomicU64::new(0),
            }),
        })
    }

    /// Bytes held on disk.
    pub fn bytes(&self) -> u64 {
        self.inner.files.bytes()
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.files.capacity()
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

    /// The `len` bytes at `start` of object version `version`, if cached and intact.
    pub async fn get(&self, version: &str, start: u64, len: u64) -> Option<Bytes> {
        let name = Self::name(version, start, len);
        let Some(path) = self.inner.files.use_entry(&name) else {
            self.inner.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
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
                self.inner.files.remove(&name);
                self.inner.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Keeps a stripe, evicting the least recently used beyond the capacity. Failures are only
    /// logged: the cache is an optimisation.
    pub async fn insert(&self, version: &str, start: u64, data: Bytes) {
        let size = (data.len() + HASH_LEN) as u64;
        if size > self.capacity() {
            return;
        }
        let name = Self::name(version, start, data.len() as u64);
        let this = self.clone();
        let written = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            this.inner.files.write(&name, size, |f| {
                f.write_all(&data)?;
                f.write_all(blake3::hash(&data).as_bytes())
            })
        })
        .await;
        match written {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "could not write cache file"),
            Err(e) => tracing::warn!(error = %e, "cache write task failed"),
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
