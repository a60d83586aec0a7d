//! Content-addressed chunks.
//!
//! A chunk's id is the blake3 hash of its plaintext. It is stored as one zstd frame under
//! `chunks/<first 2 hex>/<64 hex>`, so identical bytes are stored once however many images,
//! snapshots or checkpoints contain them, and a chunk can be checked against its own name.
//!
//! Reading a chunk:
//! 0. frames a caller fetched in bulk and holds in memory ([`ChunkStore::hold`]), or waits for
//!    when it announced them ([`ChunkStore::expect`]); checked as they are read;
//! 1. the local disk cache, if configured (plaintext files, LRU by bytes); the bytes are hashed
//!    and a mismatching cache file is dropped and refetched;
//! 2. otherwise a fetch from the store, **single-flight**: concurrent readers of one chunk share
//!    one request (whichever way they read it: cached, uncached, or as the raw frame). The
//!    frame is decompressed with its declared size bounded by `max_chunk_size` (a hostile frame
//!    cannot make us allocate more), hashed, and only then handed out and cached. A mismatch
//!    is [`Error::Corrupt`] naming the chunk: never wrong bytes.
//!
//! Writing a chunk hashes it, skips it when the store already has it (a HEAD, or this process saw
//! it already), and otherwise compresses and PUTs it. Batches run with bounded concurrency;
//! compression and hashing run on the blocking pool.

mod cache;
pub mod share;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::{StreamExt, TryStreamExt};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

pub use cache::ChunkCache;
pub use share::Share;

use crate::error::{Error, Result};
use crate::url::Store;

/// The blake3 hash of a chunk's plaintext.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id of `data`.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 hex digits.
    pub fn from_hex(s: &str) -> Result<ChunkId> {
        blake3::Hash::from_hex(s)
            .map(|h| ChunkId(*h.as_bytes()))
            .map_err(|e| Error::Format {
                what: "chunk id",
                reason: format!("{s:?}: {e}"),
            })
    }

    /// The object key of this chunk, relative to the chunk store's root.
    pub fn key(&self) -> String {
        let hex = self.to_hex();
        format!("chunks/{}/{}", &hex[..2], hex)
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

impl Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        ChunkId::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

/// One chunk of a file: its id and plaintext length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    #[serde(rename = "i")]
    pub id: ChunkId,
    #[serde(rename = "n")]
    pub len: u32,
}

/// How a [`ChunkStore`] fetches, caches and compresses.
#[derive(Debug, Clone)]
pub struct ChunkStoreConfig {
    /// Chunks fetched or uploaded at once by a batch call.
    pub concurrency: usize,
    /// Local cache directory; `None` for no cache.
    pub cache_dir: Option<PathBuf>,
    /// Bytes the cache may hold before it evicts the least recently used chunks.
    pub cache_capacity: u64,
    /// zstd level for new chunks.
    pub zstd_level: i32,
    /// Largest plaintext chunk accepted when decoding (bounds what a hostile frame can allocate).
    pub max_chunk_size: usize,
    /// The node's sidecar socket to share chunks of a remote store through ([`share`]);
    /// by default `HOTSTART_SHARE`, or none.
    pub share: Option<PathBuf>,
    /// What these chunks are, in the sidecar's metrics: `env`, `image`, ...
    pub artifact: &'static str,
}

impl Default for ChunkStoreConfig {
    fn default() -> Self {
        ChunkStoreConfig {
            concurrency: 16,
            cache_dir: None,
            cache_capacity: 4 << 30,
            zstd_level: 3,
            max_chunk_size: 64 << 20,
            share: Share::socket_from_env(),
            artifact: "chunks",
        }
    }
}

type SharedFetch = Shared<BoxFuture<'static, Result<Bytes, Arc<Error>>>>;
type SharedPut = Shared<BoxFuture<'static, Result<(), Arc<Error>>>>;

/// Content-addressed chunks in a store. Cheap to clone.
#[derive(Clone)]
pub struct ChunkStore {
    inner: Arc<Inner>,
}

struct Inner {
    store: Store,
    cfg: ChunkStoreConfig,
    cache: Option<ChunkCache>,
    /// The node's sidecar, asked before a remote store.
    share: Option<Share>,
    /// Reads in progress (fetch, decode, cache), so that concurrent readers of a chunk share one.
    fetching: Mutex<HashMap<ChunkId, SharedFetch>>,
    /// GETs of frames in progress, shared by every reader of the chunk, whatever it does with
    /// the frame.
    frames: Mutex<HashMap<ChunkId, SharedFetch>>,
    /// Uploads in progress, so that two writers of the same new chunk upload it once.
    putting: Mutex<HashMap<ChunkId, SharedPut>>,
    /// Chunks this process has seen in the store (uploaded or checked).
    present: Mutex<HashSet<ChunkId>>,
    /// Frames fetched ahead in bulk ([`ChunkStore::hold`]) and those announced.
    held: Mutex<Held>,
    /// Woken whenever `held` changes, for readers waiting on an announced chunk: on a blocking
    /// thread, and on the runtime.
    held_changed: Condvar,
    held_notify: tokio::sync::Notify,
    stats: Mutex<ChunkStats>,
}

/// Frames a caller fetched in bulk for the reads of one job (a snapshot's pack for a restore).
#[derive(Default)]
struct Held {
    /// Stored frames, decoded and checked against their ids when read.
    frames: HashMap<ChunkId, Bytes>,
    /// Chunks announced ([`ChunkStore::expect`]) and not held yet: their reads wait.
    coming: HashSet<ChunkId>,
}

/// What a chunk store did, for tests and reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkStats {
    /// Chunks read from the store (after single-flight merging).
    pub fetched: u64,
    /// Compressed bytes read from the store.
    pub fetched_bytes: u64,
    /// Reads served from the local cache.
    pub cache_hits: u64,
    /// Reads served from chunks held in memory ([`ChunkStore::hold`]).
    pub held_hits: u64,
    /// Frames and pack ranges the node's sidecar provided (from its cache, a peer or the
    /// store), instead of this process's own store reads.
    pub shared: u64,
    /// Their stored bytes.
    pub shared_bytes: u64,
    /// Chunks uploaded.
    pub uploaded: u64,
    /// Compressed bytes uploaded.
    pub uploaded_bytes: u64,
    /// Puts skipped because the store already had the chunk.
    pub deduplicated: u64,
}

impl fmt::Debug for ChunkStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChunkStore")
            .field("store", &self.inner.store)
            .field("cfg", &self.inner.cfg)
            .finish()
    }
}

impl ChunkStore {
    /// Chunks under `store` (keys `chunks/..`), with an optional local cache.
    pub fn new(store: Store, cfg: ChunkStoreConfig) -> Result<ChunkStore> {
        let cache = match &cfg.cache_dir {
            Some(dir) => Some(ChunkCache::open(dir, cfg.cache_capacity)?),
            None => None,
        };
        // A local directory is read faster than any peer could send it.
        let share = cfg
            .share
            .as_ref()
            .filter(|_| !store.is_local())
            .map(Share::new);
        Ok(ChunkStore {
            inner: Arc::new(Inner {
                store,
                cfg,
                cache,
                share,
                fetching: Mutex::new(HashMap::new()),
                frames: Mutex::new(HashMap::new()),
                putting: Mutex::new(HashMap::new()),
                present: Mutex::new(HashSet::new()),
                held: Mutex::new(Held::default()),
                held_changed: Condvar::new(),
                held_notify: tokio::sync::Notify::new(),
                stats: Mutex::new(ChunkStats::default()),
            }),
        })
    }

    /// The store the chunks live in.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// How this chunk store fetches, caches and compresses.
    pub fn config(&self) -> &ChunkStoreConfig {
        &self.inner.cfg
    }

    /// The local cache, if any.
    pub fn cache(&self) -> Option<&ChunkCache> {
        self.inner.cache.as_ref()
    }

    /// Counters since this chunk store was created.
    pub fn stats(&self) -> ChunkStats {
        *self.inner.stats.lock()
    }

    /// Whether the store holds `id`.
    pub async fn contains(&self, id: &ChunkId) -> Result<bool> {
        if self.inner.present.lock().contains(id) {
            return Ok(true);
        }
        let found = self.inner.store.exists(&id.key()).await?;
        if found {
            self.inner.present.lock().insert(*id);
        }
        Ok(found)
    }

    /// Deletes the store's copy of `id` when that copy is damaged: read again straight from the
    /// store, it still does not decode to bytes with that id. Writers trust a chunk the store
    /// already holds ([`ChunkStore::put`]), so a damaged copy left in place would be reused by
    /// every later upload of the same bytes; once it is gone, the next one uploads it again.
    /// Returns whether it was deleted (`false`: the copy is sound, or not there).
    pub async fn delete_if_damaged(&self, id: &ChunkId) -> Result<bool> {
        let key = id.key();
        let frame = match self.inner.store.get(&key).await {
            Ok(frame) => frame,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        let (checked, max) = (*id, self.inner.cfg.max_chunk_size);
        let sound =
            tokio::task::spawn_blocking(move || decode_frame(&checked, &frame, max).is_ok())
                .await
                .map_err(|e| Error::task("chunk decode", e))?;
        if sound {
            return Ok(false);
        }
        self.inner.present.lock().remove(id);
        self.inner.store.delete(&key).await?;
        tracing::warn!(chunk = %id.to_hex(), store = self.inner.store.url(),
            "deleted a damaged chunk from the store; the next upload of its bytes stores it again");
        Ok(true)
    }

    /// The ids among `ids` that the store does not hold, in their order.
    pub async fn missing(&self, ids: &[ChunkId]) -> Result<Vec<ChunkId>> {
        let found: Vec<bool> = futures::stream::iter(ids)
            .map(|id| self.contains(id))
            .buffered(self.inner.cfg.concurrency.max(1))
            .try_collect()
            .await?;
        Ok(ids
            .iter()
            .zip(found)
            .filter(|(_, f)| !f)
            .map(|(id, _)| *id)
            .collect())
    }

    /// Stores `data` unless the store already has it; returns its id. Concurrent puts of the
    /// same new chunk upload it once.
    pub async fn put(&self, data: Bytes) -> Result<ChunkId> {
        let (id, data) = tokio::task::spawn_blocking(move || (ChunkId::of(&data), data))
            .await
            .map_err(|e| Error::task("chunk hash", e))?;
        if self.inner.present.lock().contains(&id) {
            self.inner.stats.lock().deduplicated += 1;
            return Ok(id);
        }
        let (upload, first) = {
            let mut putting = self.inner.putting.lock();
            match putting.get(&id) {
                Some(u) => (u.clone(), false),
                None => {
                    let u = self.spawn_put(id, data);
                    putting.insert(id, u.clone());
                    (u, true)
                }
            }
        };
        upload.await.map_err(Error::Shared)?;
        if !first {
            self.inner.stats.lock().deduplicated += 1;
        }
        Ok(id)
    }

    /// Starts the one upload of `id` (unless the store has it) that every concurrent writer
    /// waits on; it runs as its own task and leaves the map when done.
    fn spawn_put(&self, id: ChunkId, data: Bytes) -> SharedPut {
        let this = self.clone();
        let task = tokio::spawn(async move {
            let res = this.upload(id, data).await;
            this.inner.putting.lock().remove(&id);
            res
        });
        async move {
            match task.await {
                Ok(res) => res.map_err(Arc::new),
                Err(e) => Err(Arc::new(Error::task("chunk upload", e))),
            }
        }
        .boxed()
        .shared()
    }

    async fn upload(&self, id: ChunkId, data: Bytes) -> Result<()> {
        if self.contains(&id).await? {
            self.inner.stats.lock().deduplicated += 1;
            return Ok(());
        }
        let this = self.clone();
        let frame = tokio::task::spawn_blocking(move || this.encode(&id, &data))
            .await
            .map_err(|e| Error::task("chunk compress", e))??;
        let n = frame.len() as u64;
        self.inner.store.put(&id.key(), Bytes::from(frame)).await?;
        self.inner.present.lock().insert(id);
        let mut stats = self.inner.stats.lock();
        stats.uploaded += 1;
        stats.uploaded_bytes += n;
        Ok(())
    }

    /// Stores many chunks with bounded concurrency; ids in input order.
    pub async fn put_many(&self, chunks: Vec<Bytes>) -> Result<Vec<ChunkId>> {
        futures::stream::iter(chunks)
            .map(|c| self.put(c))
            .buffered(self.inner.cfg.concurrency.max(1))
            .try_collect()
            .await
    }

    /// The verified plaintext of `id`.
    pub async fn get(&self, id: &ChunkId) -> Result<Bytes> {
        if let Some(bytes) = self.cached(id).await? {
            return Ok(bytes);
        }
        let id = *id;
        self.single_flight(
            |i| &i.fetching,
            id,
            move |this| async move { this.fetch(id, true).await },
        )
        .await
    }

    /// Announces that the caller is fetching the frames of `ids` in bulk and will
    /// [`hold`](ChunkStore::hold) them: until it does, or gives up on them
    /// ([`ChunkStore::not_coming`]), their reads wait for them instead of fetching each on its
    /// own. The caller must end every announcement one way or the other.
    pub fn expect(&self, ids: impl IntoIterator<Item = ChunkId>) {
        let mut held = self.inner.held.lock();
        for id in ids {
            if !held.frames.contains_key(&id) {
                held.coming.insert(id);
            }
        }
    }

    /// Keeps stored frames in memory until [`ChunkStore::release_held`]; reads of their chunks
    /// find them there before the cache and the store. For a caller that fetched many chunks'
    /// frames in a few requests (a snapshot's pack), so that reading them costs no request each.
    /// A frame is decoded and checked against its id when it is read; one that does not match
    /// is logged and dropped, and its chunk is read from the cache or the store as if it had
    /// never been held.
    pub fn hold(&self, frames: impl IntoIterator<Item = (ChunkId, Bytes)>) {
        {
            let mut held = self.inner.held.lock();
            for (id, frame) in frames {
                held.coming.remove(&id);
                held.frames.insert(id, frame);
            }
        }
        self.held_changed();
    }

    /// Ends the announcement of `ids` that were not held: their reads stop waiting and go to the
    /// cache and the store.
    pub fn not_coming(&self, ids: impl IntoIterator<Item = ChunkId>) {
        {
            let mut held = self.inner.held.lock();
            for id in ids {
                held.coming.remove(&id);
            }
        }
        self.held_changed();
    }

    /// Whether `id` is held in memory or announced ([`ChunkStore::hold`],
    /// [`ChunkStore::expect`]).
    pub fn is_held(&self, id: &ChunkId) -> bool {
        let held = self.inner.held.lock();
        held.frames.contains_key(id) || held.coming.contains(id)
    }

    /// Drops every frame held in memory and every announcement; returns how many frames there
    /// were. Reads go to the cache and the store again.
    pub fn release_held(&self) -> usize {
        let frames = std::mem::take(&mut *self.inner.held.lock()).frames.len();
        self.held_changed();
        frames
    }

    fn held_changed(&self) {
        self.inner.held_changed.notify_all();
        self.inner.held_notify.notify_waiters();
    }

    /// `Some(Some(frame))` when `id` is held, `Some(None)` when it is neither held nor announced,
    /// `None` while it is announced and not held yet.
    fn held_frame(held: &Held, id: &ChunkId) -> Option<Option<Bytes>> {
        match held.frames.get(id) {
            Some(frame) => Some(Some(frame.clone())),
            None if held.coming.contains(id) => None,
            None => Some(None),
        }
    }

    /// The bytes of `id` held in memory, waiting for them if they were announced (on a blocking
    /// thread), counted as a hit.
    fn held_blocking(&self, id: &ChunkId) -> Option<Bytes> {
        let mut held = self.inner.held.lock();
        let frame = loop {
            match Self::held_frame(&held, id) {
                Some(frame) => break frame?,
                None => self.inner.held_changed.wait(&mut held),
            }
        };
        drop(held);
        self.decode_held(id, &frame)
    }

    /// [`ChunkStore::held_blocking`] on the runtime.
    async fn held(&self, id: &ChunkId) -> Option<Bytes> {
        let frame = self.held_async(id, false).await?;
        self.decode_held(id, &frame)
    }

    /// The frame of `id` held in memory, waiting for it while it is announced; `take` removes
    /// it from memory.
    async fn held_async(&self, id: &ChunkId, take: bool) -> Option<Bytes> {
        loop {
            // Made before the check: a `notify_waiters` after it wakes it, polled or not.
            let changed = self.inner.held_notify.notified();
            let found = {
                let mut held = self.inner.held.lock();
                let found = Self::held_frame(&held, id);
                if take && matches!(found, Some(Some(_))) {
                    held.frames.remove(id);
                }
                found
            };
            match found {
                Some(frame) => return frame,
                None => changed.await,
            }
        }
    }

    fn decode_held(&self, id: &ChunkId, frame: &[u8]) -> Option<Bytes> {
        match self.decode(id, frame) {
            Ok(plain) => {
                self.inner.stats.lock().held_hits += 1;
                Some(plain)
            }
            Err(e) => {
                tracing::warn!(chunk = %id, error = %e, "a frame held in memory does not match its chunk; reading it again");
                self.inner.held.lock().frames.remove(id);
                None
            }
        }
    }

    /// The verified bytes of `id` held in memory or in the local cache, counted as a hit; `None`
    /// when neither has it.
    async fn cached(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        if let Some(bytes) = self.held(id).await {
            return Ok(Some(bytes));
        }
        let Some(cache) = &self.inner.cache else {
            return Ok(None);
        };
        let hit = cache.get(id).await?;
        self.count_hit(&hit);
        Ok(hit)
    }

    fn count_hit(&self, hit: &Option<Bytes>) {
        if hit.is_some() {
            self.inner.stats.lock().cache_hits += 1;
        }
    }

    /// [`ChunkStore::get`] for a caller that writes the bytes to a file of its own and then
    /// hands that file to the cache ([`ChunkCache::adopt`]): a chunk that is not cached yet is
    /// fetched and verified but not written to the cache, so its bytes are written once.
    pub async fn get_uncached(&self, id: &ChunkId) -> Result<Bytes> {
        if let Some(bytes) = self.cached(id).await? {
            return Ok(bytes);
        }
        self.fetch(*id, false).await
    }

    /// [`ChunkStore::get_uncached`] on the calling thread, for callers already off the runtime,
    /// when no network is involved: held in memory (waiting for it while it is announced), from
    /// the local cache, or from the store when it is a local directory ([`Store::is_local`]).
    /// `Ok(None)` when the chunk would have to come from a remote store.
    pub fn get_uncached_blocking(&self, id: &ChunkId) -> Result<Option<Bytes>> {
        if let Some(bytes) = self.held_blocking(id) {
            return Ok(Some(bytes));
        }
        if let Some(cache) = &self.inner.cache {
            let hit = cache.get_blocking(id)?;
            self.count_hit(&hit);
            if hit.is_some() {
                return Ok(hit);
            }
        }
        let Some(frame) = self.inner.store.get_blocking(&id.key()) else {
            return Ok(None);
        };
        let frame = frame?;
        self.count_fetch(frame.len());
        self.decode(id, &frame).map(Some)
    }

    /// The stored frame of `id` as fetched, neither decoded nor verified nor cached: for a
    /// caller that decodes it ([`ChunkStore::decode`]) on a blocking thread together with what
    /// it does with the bytes, in one hand-off. A frame held in memory ([`ChunkStore::hold`],
    /// waited for while it is announced) is taken from there instead: such a caller keeps the
    /// chunk it decodes, and reads it no more through this store.
    pub async fn fetch_frame(&self, id: &ChunkId) -> Result<Bytes> {
        if let Some(frame) = self.held_async(id, true).await {
            self.inner.stats.lock().held_hits += 1;
            return Ok(frame);
        }
        let id = *id;
        self.single_flight(
            |i| &i.frames,
            id,
            move |this| async move {
                let key = id.key();
                if let Some(frame) = this.shared(&key, 0, &[(id, None)]).await {
                    return Ok(frame);
                }
                let frame = this.inner.store.get(&key).await?;
                this.count_fetch(frame.len());
                Ok(frame)
            },
        )
        .await
    }

    /// The stored bytes of `key` (of this store) from byte `offset` on, made of the frames
    /// `frames` (ids and stored lengths, in order), from the node's sidecar ([`share`]): `None`
    /// when this store does not share or the sidecar did not provide them, and the caller
    /// reads the store. The sidecar checked every frame against its id; the caller decodes
    /// (and so checks) them again as it reads them.
    pub async fn shared(
        &self,
        key: &str,
        offset: u64,
        frames: &[(ChunkId, Option<u32>)],
    ) -> Option<Bytes> {
        self.inner.share.as_ref()?;
        let len = frames
            .iter()
            .map(|(_, l)| l.map(u64::from))
            .sum::<Option<u64>>();
        let piece = hotstart_proto::share::Piece {
            artifact: self.inner.cfg.artifact.to_string(),
            store: self.inner.store.url().to_string(),
            key: self.inner.store.opened_key(key),
            offset,
            len,
            frames: frames
                .iter()
                .map(|(id, len)| hotstart_proto::share::PieceFrame {
                    id: id.to_hex(),
                    len: *len,
                })
                .collect(),
            raw: false,
            within: None,
        };
        let this = self.clone();
        let got = tokio::task::spawn_blocking(move || {
            let share = this.inner.share.as_ref()?;
            match share.piece(&piece) {
                Ok(got) => got,
                Err(reason) => {
                    tracing::warn!(
                        sidecar = %share.socket().display(), key = %piece.key, %reason,
                        "the node's sidecar did not share this piece; reading the store"
                    );
                    None
                }
            }
        })
        .await
        .ok()??;
        let mut stats = self.inner.stats.lock();
        stats.shared += 1;
        stats.shared_bytes += got.bytes.len() as u64;
        Some(got.bytes)
    }

    /// The stored frame of the chunk `data` whose id is `id`: zstd at the configured level.
    pub fn encode(&self, id: &ChunkId, data: &[u8]) -> Result<Vec<u8>> {
        zstd::bulk::compress(data, self.inner.cfg.zstd_level)
            .map_err(|e| Error::io("compress chunk", id.key(), e))
    }

    /// The verified plaintext of a frame of `id` from [`ChunkStore::fetch_frame`].
    pub fn decode(&self, id: &ChunkId, frame: &[u8]) -> Result<Bytes> {
        let plain = decode_frame(id, frame, self.inner.cfg.max_chunk_size)?;
        self.inner.present.lock().insert(*id);
        Ok(plain)
    }

    fn count_fetch(&self, frame_len: usize) {
        let mut stats = self.inner.stats.lock();
        stats.fetched += 1;
        stats.fetched_bytes += frame_len as u64;
    }

    /// Many chunks with bounded concurrency, in input order.
    pub async fn get_many(&self, ids: &[ChunkId]) -> Result<Vec<Bytes>> {
        futures::stream::iter(ids)
            .map(|id| self.get(id))
            .buffered(self.inner.cfg.concurrency.max(1))
            .try_collect()
            .await
    }

    /// Waits for the operation on `id` in progress in the map `flights` picks, or starts
    /// `start` as that operation. It runs as its own task, so it completes (and leaves the map)
    /// even if its first reader goes away.
    async fn single_flight<F, Fut>(
        &self,
        flights: fn(&Inner) -> &Mutex<HashMap<ChunkId, SharedFetch>>,
        id: ChunkId,
        start: F,
    ) -> Result<Bytes>
    where
        F: FnOnce(ChunkStore) -> Fut,
        Fut: Future<Output = Result<Bytes>> + Send + 'static,
    {
        let flight = flights(&self.inner)
            .lock()
            .entry(id)
            .or_insert_with(|| {
                let this = self.clone();
                let op = start(self.clone());
                let task = tokio::spawn(async move {
                    let res = op.await;
                    flights(&this.inner).lock().remove(&id);
                    res
                });
                async move {
                    match task.await {
                        Ok(res) => res.map_err(Arc::new),
                        Err(e) => Err(Arc::new(Error::task("chunk fetch", e))),
                    }
                }
                .boxed()
                .shared()
            })
            .clone();
        flight.await.map_err(Error::Shared)
    }

    /// Fetches and verifies `id`, writing it to the cache when `cache` is set.
    async fn fetch(&self, id: ChunkId, cache: bool) -> Result<Bytes> {
        let frame = self.fetch_frame(&id).await?;
        let this = self.clone();
        // Decoded and cached on one blocking thread: one hand-off per chunk, not two.
        tokio::task::spawn_blocking(move || {
            let plain = this.decode(&id, &frame)?;
            if let Some(cache) = this.inner.cache.as_ref().filter(|_| cache)
                && let Err(e) = cache.insert_blocking(&id, &plain)
            {
                // A cache that cannot be written is a slower read next time, not a failed read.
                tracing::warn!(chunk = %id, error = %e, "could not cache chunk");
            }
            Ok(plain)
        })
        .await
        .map_err(|e| Error::task("chunk decode", e))?
    }
}

/// Decompresses one stored frame and checks it against its id.
pub fn decode_frame(id: &ChunkId, frame: &[u8], max_chunk_size: usize) -> Result<Bytes> {
    let corrupt = |reason: String| Error::Corrupt {
        id: id.to_hex(),
        reason,
    };
    let declared = match zstd::zstd_safe::get_frame_content_size(frame) {
        Ok(Some(n)) => n,
        Ok(None) => return Err(corrupt("zstd frame does not declare its size".into())),
        Err(_) => return Err(corrupt("not a zstd frame".into())),
    };
    if declared > max_chunk_size as u64 {
        return Err(corrupt(format!(
            "frame declares {declared} bytes, more than the {max_chunk_size}-byte limit"
        )));
    }
    thread_local! {
        // One decompression context per thread, reused: creating one per chunk is measurable
        // when a restore decodes thousands of small chunks.
        static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    let plain = DECOMPRESSOR
        .with(|d| {
            let mut d = d.borrow_mut();
            let d = match d.as_mut() {
                Some(d) => d,
                None => d.insert(zstd::bulk::Decompressor::new()?),
            };
            d.decompress(frame, declared as usize)
        })
        .map_err(|e| corrupt(format!("zstd: {e}")))?;
    if plain.len() as u64 != declared {
        return Err(corrupt(format!(
            "frame declares {declared} bytes but holds {}",
            plain.len()
        )));
    }
    let got = ChunkId::of(&plain);
    if got != *id {
        return Err(corrupt(format!("content hashes to {got}")));
    }
    Ok(Bytes::from(plain))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wrap::{Counter, Interceptor, Op};

    #[test]
    fn hex_round_trip_and_key_layout() {
        let id = ChunkId::of(b"hello");
        assert_eq!(ChunkId::from_hex(&id.to_hex()).unwrap(), id);
        let key = id.key();
        assert!(key.starts_with(&format!("chunks/{}/", &id.to_hex()[..2])));
        assert!(ChunkId::from_hex("zz").is_err());
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<ChunkId>(&json).unwrap(), id);
    }

    /// Chunks in a memory store whose requests are counted.
    fn counted_chunks() -> (Arc<Counter>, ChunkStore) {
        let counter = Arc::new(Counter::default());
        let store = Store::open("memory://")
            .unwrap()
            .wrap(|inner| counter.clone().wrap(inner));
        (
            counter.clone(),
            ChunkStore::new(store, ChunkStoreConfig::default()).unwrap(),
        )
    }

    #[tokio::test]
    async fn concurrent_puts_of_one_chunk_upload_once() {
        let (counter, chunks) = counted_chunks();
        let data = Bytes::from(vec![9u8; 100_000]);
        let ids = chunks.put_many(vec![data.clone(); 8]).await.unwrap();
        assert!(ids.iter().all(|id| *id == ChunkId::of(&data)));
        assert_eq!(counter.get(Op::Put).requests, 1);
        let stats = chunks.stats();
        assert_eq!((stats.uploaded, stats.deduplicated), (1, 7));
    }

    #[tokio::test]
    async fn concurrent_reads_of_one_chunk_share_one_get_whichever_way_they_read() {
        let (counter, chunks) = counted_chunks();
        let data = Bytes::from(vec![3u8; 90_000]);
        let id = chunks.put(data.clone()).await.unwrap();
        let frame = chunks.encode(&id, &data).unwrap();
        let reads = (0..12).map(|i| {
            let chunks = chunks.clone();
            async move {
                match i % 3 {
                    0 => chunks.get(&id).await.unwrap(),
                    1 => chunks.get_uncached(&id).await.unwrap(),
                    _ => chunks
                        .decode(&id, &chunks.fetch_frame(&id).await.unwrap())
                        .unwrap(),
                }
            }
        });
        for read in futures::future::join_all(reads).await {
            assert_eq!(read, data);
        }
        assert_eq!(counter.get(Op::Get).requests, 1);
        assert_eq!(chunks.stats().fetched, 1);
        // Once it is done, a later read is a new request.
        assert_eq!(chunks.fetch_frame(&id).await.unwrap(), frame);
        assert_eq!(counter.get(Op::Get).requests, 2);
    }

    #[tokio::test]
    async fn held_chunks_are_read_without_a_request_until_released() {
        let (counter, chunks) = counted_chunks();
        let data = Bytes::from(vec![5u8; 70_000]);
        let id = chunks.put(data.clone()).await.unwrap();
        let frame = Bytes::from(chunks.encode(&id, &data).unwrap());
        chunks.hold([(id, frame.clone())]);
        assert!(chunks.is_held(&id));
        assert_eq!(chunks.get(&id).await.unwrap(), data);
        assert_eq!(chunks.get_uncached(&id).await.unwrap(), data);
        assert_eq!(chunks.get_uncached_blocking(&id).unwrap().unwrap(), data);
        assert_eq!(counter.get(Op::Get).requests, 0);
        assert_eq!(chunks.stats().held_hits, 3);
        assert_eq!(chunks.release_held(), 1);
        assert!(!chunks.is_held(&id));
        assert_eq!(chunks.get(&id).await.unwrap(), data);
        assert_eq!(counter.get(Op::Get).requests, 1);
        // A caller of `fetch_frame` takes a held frame: it is read once from memory.
        chunks.hold([(id, frame.clone())]);
        assert_eq!(chunks.fetch_frame(&id).await.unwrap(), frame);
        assert!(!chunks.is_held(&id), "taken");
        assert_eq!(counter.get(Op::Get).requests, 1);
        assert_eq!(chunks.fetch_frame(&id).await.unwrap(), frame);
        assert_eq!(counter.get(Op::Get).requests, 2);
    }

    #[tokio::test]
    async fn a_held_frame_of_other_bytes_is_dropped_and_the_chunk_fetched() {
        let (counter, chunks) = counted_chunks();
        let data = Bytes::from(vec![5u8; 70_000]);
        let id = chunks.put(data.clone()).await.unwrap();
        let other = zstd::bulk::compress(&[6u8; 70_000], 1).unwrap();
        chunks.hold([(id, Bytes::from(other))]);
        assert_eq!(chunks.get(&id).await.unwrap(), data);
        assert_eq!(counter.get(Op::Get).requests, 1);
        assert_eq!(chunks.stats().held_hits, 0);
        assert!(!chunks.is_held(&id), "the bad frame is gone");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_of_announced_chunks_wait_for_them() {
        let (counter, chunks) = counted_chunks();
        let a = Bytes::from(vec![1u8; 50_000]);
        let b = Bytes::from(vec![2u8; 50_000]);
        let c = Bytes::from(vec![3u8; 50_000]);
        let (ia, ib, ic) = (
            chunks.put(a.clone()).await.unwrap(),
            chunks.put(b.clone()).await.unwrap(),
            chunks.put(c.clone()).await.unwrap(),
        );
        chunks.expect([ia, ib, ic]);
        assert!(chunks.is_held(&ia) && chunks.is_held(&ib));
        let blocking = {
            let chunks = chunks.clone();
            tokio::task::spawn_blocking(move || chunks.get_uncached_blocking(&ia).unwrap())
        };
        let waiting = {
            let chunks = chunks.clone();
            tokio::spawn(async move { chunks.get(&ia).await.unwrap() })
        };
        let taking = {
            let chunks = chunks.clone();
            tokio::spawn(async move { chunks.fetch_frame(&ic).await.unwrap() })
        };
        let given_up = {
            let chunks = chunks.clone();
            tokio::spawn(async move { chunks.get(&ib).await.unwrap() })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        for task in [&waiting, &taking, &given_up] {
            assert!(!task.is_finished(), "waits while announced");
        }
        assert!(!blocking.is_finished());
        let frame_c = Bytes::from(chunks.encode(&ic, &c).unwrap());
        chunks.hold([
            (ia, Bytes::from(chunks.encode(&ia, &a).unwrap())),
            (ic, frame_c.clone()),
        ]);
        assert_eq!(blocking.await.unwrap().unwrap(), a);
        assert_eq!(waiting.await.unwrap(), a);
        assert_eq!(taking.await.unwrap(), frame_c);
        assert_eq!(counter.get(Op::Get).requests, 0, "served from memory");
        assert!(!given_up.is_finished());
        // Never delivered: the reader fetches it.
        chunks.not_coming([ib]);
        assert_eq!(given_up.await.unwrap(), b);
        assert_eq!(counter.get(Op::Get).requests, 1);
    }

    #[test]
    fn decode_rejects_lies() {
        let data = vec![7u8; 10_000];
        let id = ChunkId::of(&data);
        let frame = zstd::bulk::compress(&data, 3).unwrap();
        assert_eq!(decode_frame(&id, &frame, 1 << 20).unwrap(), data);
        // Over the size limit.
        assert!(decode_frame(&id, &frame, 100).unwrap_err().is_corrupt());
        // Wrong id.
        let other = ChunkId::of(b"other");
        assert!(
            decode_frame(&other, &frame, 1 << 20)
                .unwrap_err()
                .is_corrupt()
        );
        // Garbage and truncation.
        assert!(
            decode_frame(&id, b"garbage", 1 << 20)
                .unwrap_err()
                .is_corrupt()
        );
        assert!(
            decode_frame(&id, &frame[..frame.len() / 2], 1 << 20)
                .unwrap_err()
                .is_corrupt()
        );
        // A frame whose header claims a huge size is refused before allocating.
        let mut huge = zstd::bulk::compress(&[0u8; 16], 3).unwrap();
        huge.truncate(4);
        assert!(decode_frame(&id, &huge, 1 << 20).is_err());
    }
}
