//! [`LruIndex`]: which keys a byte-bounded cache holds, in least-recently-used order.
//!
//! The index only does the bookkeeping (sizes, use order, what to evict); the cache that owns it
//! keeps the bytes wherever it likes (files in a directory, `Bytes` in memory) and drops what
//! [`LruIndex::evict`] returns. Every operation is O(log n).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Sizes and use order of the entries of a cache bounded by bytes.
#[derive(Debug)]
pub struct LruIndex<K> {
    /// key → (last-use tick, size)
    entries: HashMap<K, (u64, u64)>,
    /// last-use tick → key
    order: BTreeMap<u64, K>,
    bytes: u64,
    tick: u64,
}

impl<K> Default for LruIndex<K> {
    fn default() -> Self {
        LruIndex {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            bytes: 0,
            tick: 0,
        }
    }
}

impl<K: Hash + Eq + Clone> LruIndex<K> {
    /// Marks `key` (of `size` bytes) as the most recently used, adding it if new.
    pub fn touch(&mut self, key: K, size: u64) {
        self.tick += 1;
        if let Some((old, old_size)) = self.entries.insert(key.clone(), (self.tick, size)) {
            self.order.remove(&old);
            self.bytes -= old_size;
        }
        self.order.insert(self.tick, key);
        self.bytes += size;
    }

    /// Marks `key` as the most recently used if present; returns its size.
    pub fn use_existing(&mut self, key: &K) -> Option<u64> {
        let size = self.entries.get(key)?.1;
        self.touch(key.clone(), size);
        Some(size)
    }

    /// Forgets `key`; returns its size if it was present.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let (tick, size) = self.entries.remove(key)?;
        self.order.remove(&tick);
        self.bytes -= size;
        Some(size)
    }

    /// Pops least recently used entries until at most `capacity` bytes remain; returns them.
    pub fn evict(&mut self, capacity: u64) -> Vec<K> {
        let mut out = Vec::new();
        while self.bytes > capacity {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some((_, size)) = self.entries.remove(&key) {
                self.bytes -= size;
            }
            out.push(key);
        }
        out
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Total bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_first() {
        let mut lru = LruIndex::default();
        lru.touch("a", 100);
        lru.touch("b", 100);
        lru.touch("c", 100);
        assert_eq!(lru.use_existing(&"a"), Some(100));
        assert_eq!(lru.evict(200), vec!["b"]);
        assert_eq!(lru.bytes(), 200);
        // Re-touching with a new size replaces the old one.
        lru.touch("c", 10);
        assert_eq!(lru.bytes(), 110);
        assert_eq!(lru.remove(&"a"), Some(100));
        assert_eq!(lru.remove(&"a"), None);
        assert_eq!((lru.len(), lru.bytes()), (1, 10));
        assert_eq!(lru.evict(0), vec!["c"]);
        assert!(lru.is_empty());
    }
}
