//! [`Loader`]: where a lazy mount gets chunks, and the counters its report is made of.
//!
//! **Tiers.** A chunk is looked for in a bounded **memory** cache (verified plaintext, LRU by
//! bytes), then in the chunk store's bounded **local disk** cache, and only then fetched from the
//! **store**. Every fetch is **single-flight**: the loader keeps one shared future per chunk in
//! flight, whether a read or the prefetcher started it, and a fetched chunk enters the memory
//! cache before it leaves the in-flight map, so no window exists in which a second reader would
//! fetch it again.
//!
//! **The disk cache is written in the background.** A chunk fetched from a remote store goes
//! into the memory cache at once and into the disk cache later, from a thread of its own at the
//! lowest CPU priority, so the copy never competes with the job the mount serves (on a small
//! node, writing 100 MB into the cache took as much CPU as fetching it). At most
//! `CACHE_QUEUE` chunks wait for it; one that finds the queue full is not cached. A chunk
//! of a local-directory store is not cached at all: it is on this node's disk already.
//!
//! **Demand and prefetch.** A read ([`Loader::demand`]) never waits behind the prefetcher: if its
//! chunk is already in flight it waits for that fetch; otherwise it starts its own fetch at once,
//! whatever the prefetcher's queue holds (the queued chunk "jumps the queue", and the prefetcher
//! skips it when it gets there). The prefetcher ([`Loader::prefetch`]) only starts fetches while
//! the number of fetches in flight, demand ones included, is below its window (see
//! `prefetch.rs`), so demand reads always come first. Prefetched chunks are decoded
//! (decompressed and verified) at the lowest CPU priority ([`crate::decode`]), so a replay
//! never takes CPU from the job it runs ahead of; a read that waits for one has it decoded at
//! once.
//!
//! **What is counted** (per mount, see `report.rs`): the first demand of each chunk is recorded
//! with its time since the mount started (this is the trace a profile is made of); it is a
//! **hit** if the chunk was already local (memory or disk), a miss if the read had to wait for
//! the store. **Stall** is the total time reads waited for chunks to arrive from the store.
//! **Prefetched** chunks are those the prefetcher brought in; those never demanded by the end are
//! **wasted**.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, sync_channel};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use hotstart_store::{ChunkCache, ChunkId, ChunkStore, LruIndex};
use parking_lot::Mutex;

use crate::decode::{Decoder, lowest_cpu_priority};

type Flight = Shared<BoxFuture<'static, Result<Bytes, Arc<hotstart_store::Error>>>>;

/// Chunks waiting for the cache writer, at most.
const CACHE_QUEUE: usize = 64;

/// Who started a fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Demand,
    Prefetch,
}

/// Verified chunks in memory, least recently used evicted first.
#[derive(Debug)]
struct MemCache {
    index: LruIndex<ChunkId>,
    data: HashMap<ChunkId, Bytes>,
    capacity: u64,
}

impl MemCache {
    fn get(&mut self, id: &ChunkId) -> Option<Bytes> {
        self.index.use_existing(id)?;
        self.data.get(id).cloned()
    }

    fn insert(&mut self, id: ChunkId, data: Bytes) {
        if data.len() as u64 > self.capacity {
            return;
        }
        self.index.touch(id, data.len() as u64);
        self.data.insert(id, data);
        for gone in self.index.evict(self.capacity) {
            self.data.remove(&gone);
        }
    }

    fn contains(&self, id: &ChunkId) -> bool {
        self.index.contains(id)
    }
}

/// The first demand of one chunk in this mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstAccess {
    pub id: ChunkId,
    pub len: u32,
    /// Time since the mount started.
    pub offset: Duration,
}

#[derive(Debug, Default)]
struct Counters {
    reads: AtomicU64,
    bytes_read: AtomicU64,
    hits: AtomicU64,
    stall_ns: AtomicU64,
    demand_fetches: AtomicU64,
    demand_fetch_bytes: AtomicU64,
    prefetched: AtomicU64,
    prefetched_bytes: AtomicU64,
    prefetch_errors: AtomicU64,
    warmed_files: AtomicU64,
    warmed_bytes: AtomicU64,
}

/// A snapshot of a loader's counters (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderStats {
    /// Read calls served.
    pub reads: u64,
    /// Bytes those reads returned.
    pub bytes_read: u64,
    /// Distinct chunks demanded.
    pub chunks_read: u64,
    /// Plaintext bytes of those chunks.
    pub chunk_bytes_read: u64,
    /// Distinct chunks that were local when first demanded.
    pub hits: u64,
    /// Total time reads waited for chunks from the store.
    pub stall: Duration,
    /// Chunks a read had to fetch itself (not found local or in flight).
    pub demand_fetches: u64,
    pub demand_fetch_bytes: u64,
    /// Chunks the prefetcher brought in.
    pub prefetched: u64,
    pub prefetched_bytes: u64,
    /// Of those, never demanded so far.
    pub wasted: u64,
    pub wasted_bytes: u64,
    pub prefetch_errors: u64,
    /// Files whose prefetched pages went into the kernel's page cache ahead of the job, and
    /// those pages' bytes (see `warm.rs`).
    pub warmed_files: u64,
    pub warmed_bytes: u64,
}

impl LoaderStats {
    /// What was counted since `earlier` (a snapshot of the same loader's counters).
    pub fn since(&self, earlier: &LoaderStats) -> LoaderStats {
        LoaderStats {
            reads: self.reads.saturating_sub(earlier.reads),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            chunks_read: self.chunks_read.saturating_sub(earlier.chunks_read),
            chunk_bytes_read: self
                .chunk_bytes_read
                .saturating_sub(earlier.chunk_bytes_read),
            hits: self.hits.saturating_sub(earlier.hits),
            stall: self.stall.saturating_sub(earlier.stall),
            demand_fetches: self.demand_fetches.saturating_sub(earlier.demand_fetches),
            demand_fetch_bytes: self
                .demand_fetch_bytes
                .saturating_sub(earlier.demand_fetch_bytes),
            prefetched: self.prefetched.saturating_sub(earlier.prefetched),
            prefetched_bytes: self
                .prefetched_bytes
                .saturating_sub(earlier.prefetched_bytes),
            wasted: self.wasted.saturating_sub(earlier.wasted),
            wasted_bytes: self.wasted_bytes.saturating_sub(earlier.wasted_bytes),
            prefetch_errors: self.prefetch_errors.saturating_sub(earlier.prefetch_errors),
            warmed_files: self.warmed_files.saturating_sub(earlier.warmed_files),
            warmed_bytes: self.warmed_bytes.saturating_sub(earlier.warmed_bytes),
        }
    }
}

impl std::ops::AddAssign for LoaderStats {
    /// Adds another loader's counters (the layers of one container start).
    fn add_assign(&mut self, o: LoaderStats) {
        self.reads += o.reads;
        self.bytes_read += o.bytes_read;
        self.chunks_read += o.chunks_read;
        self.chunk_bytes_read += o.chunk_bytes_read;
        self.hits += o.hits;
        self.stall += o.stall;
        self.demand_fetches += o.demand_fetches;
        self.demand_fetch_bytes += o.demand_fetch_bytes;
        self.prefetched += o.prefetched;
        self.prefetched_bytes += o.prefetched_bytes;
        self.wasted += o.wasted;
        self.wasted_bytes += o.wasted_bytes;
        self.prefetch_errors += o.prefetch_errors;
        self.warmed_files += o.warmed_files;
        self.warmed_bytes += o.warmed_bytes;
    }
}

/// Chunks for one lazy mount. Cheap to share (`Arc`).
pub struct Loader {
    chunks: ChunkStore,
    mem: Mutex<MemCache>,
    inflight: Mutex<HashMap<ChunkId, (Origin, Flight)>>,
    /// First demand of each chunk: offset since `start`, and length.
    seen: Mutex<HashMap<ChunkId, (Duration, u32)>>,
    /// Chunks the prefetcher brought in, with their lengths.
    prefetched: Mutex<HashMap<ChunkId, u32>>,
    /// Bytes of `prefetched` not demanded yet. Changed only under the `seen` lock (taken
    /// before `prefetched`), so it always equals what `seen` and `prefetched` say.
    ahead: AtomicU64,
    demand_inflight: AtomicUsize,
    prefetch_inflight: AtomicUsize,
    /// Signalled whenever a fetch ends or a demand read starts or ends.
    changed: tokio::sync::Notify,
    counters: Counters,
    start: Instant,
    /// Fetched chunks on their way into the disk cache (`None`: not cached).
    to_cache: Option<SyncSender<(ChunkId, Bytes)>>,
    /// Decodes prefetched frames at the lowest CPU priority (`None`: on the blocking pool);
    /// started by the first prefetch, so a mount with nothing to replay has no such threads.
    decoder: std::sync::OnceLock<Option<Decoder>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("chunks", &self.chunks)
            .field("stats", &self.stats())
            .finish()
    }
}

/// Decrements a counter when dropped (a cancelled read still leaves the count right).
struct InFlightGuard<'a>(&'a AtomicUsize, &'a tokio::sync::Notify);

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.notify_waiters();
    }
}

impl Loader {
    /// A loader over `chunks` with a memory cache of `memory_bytes`; its clock starts now.
    pub fn new(chunks: ChunkStore, memory_bytes: u64) -> Loader {
        let to_cache = match chunks.cache() {
            Some(cache) if !chunks.store().is_local() => cache_writer(cache.clone()),
            _ => None,
        };
        Loader {
            to_cache,
            decoder: std::sync::OnceLock::new(),
            chunks,
            mem: Mutex::new(MemCache {
                index: LruIndex::default(),
                data: HashMap::new(),
                capacity: memory_bytes,
            }),
            inflight: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashMap::new()),
            prefetched: Mutex::new(HashMap::new()),
            ahead: AtomicU64::new(0),
            demand_inflight: AtomicUsize::new(0),
            prefetch_inflight: AtomicUsize::new(0),
            changed: tokio::sync::Notify::new(),
            counters: Counters::default(),
            start: Instant::now(),
        }
    }

    pub fn chunks(&self) -> &ChunkStore {
        &self.chunks
    }

    /// When the mount (and its clock) started.
    pub fn started(&self) -> Instant {
        self.start
    }

    /// Counts one read call that returned `bytes` (the file system calls this).
    pub fn count_read(&self, bytes: u64) {
        self.counters.reads.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The verified bytes of chunk `id` (`len` bytes long) for a read: from memory, the disk
    /// cache, a fetch already in flight, or a fetch started now.
    pub async fn demand(self: &Arc<Self>, id: ChunkId, len: u32) -> hotstart_store::Result<Bytes> {
        let first = self.first_demand(id, len);
        if let Some(b) = self.mem.lock().get(&id) {
            if first {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(b);
        }
        self.demand_inflight.fetch_add(1, Ordering::AcqRel);
        let _guard = InFlightGuard(&self.demand_inflight, &self.changed);
        let (flight, prefetching) = {
            let mut inflight = self.inflight.lock();
            match inflight.get(&id) {
                Some((origin, f)) => (Some(f.clone()), *origin == Origin::Prefetch),
                None if self.on_disk(&id) => (None, false),
                None => {
                    let f = self.spawn_fetch(id, Origin::Demand, None);
                    inflight.insert(id, (Origin::Demand, f.clone()));
                    self.counters.demand_fetches.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .demand_fetch_bytes
                        .fetch_add(len as u64, Ordering::Relaxed);
                    (Some(f), false)
                }
            }
        };
        if let (true, Some(Some(d))) = (prefetching, self.decoder.get()) {
            // Not left to the low-priority decoding threads now that a read waits for it.
            d.expedite(&id);
        }
        match flight {
            Some(f) => {
                let waited = Instant::now();
                let res = f.await.map_err(hotstart_store::Error::Shared);
                self.counters
                    .stall_ns
                    .fetch_add(waited.elapsed().as_nanos() as u64, Ordering::Relaxed);
                res
            }
            None => {
                // Local disk: no store request to wait for.
                if first {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                }
                let data = self.chunks.get(&id).await?;
                self.mem.lock().insert(id, data.clone());
                Ok(data)
            }
        }
    }

    /// Records the first demand of `id` (now); whether this was it.
    fn first_demand(&self, id: ChunkId, len: u32) -> bool {
        let mut seen = self.seen.lock();
        match seen.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((self.start.elapsed(), len));
                if let Some(&l) = self.prefetched.lock().get(&id) {
                    self.ahead.fetch_sub(l as u64, Ordering::AcqRel);
                }
                true
            }
        }
    }

    /// Counts chunk `id`, already in the kernel's page cache, as read now (a hit), as
    /// [`Loader::demand`] would have had the read come through the filesystem.
    pub fn served_from_page_cache(&self, id: ChunkId, len: u32) {
        if self.first_demand(id, len) {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The bytes of `id` if they are in memory or on their way there (a fetch in flight), for
    /// the page-cache warmer; no read is counted. A frame already queued for the low-priority
    /// decoders is decoded on the calling thread. `None`: neither, or the fetch failed.
    pub async fn fetched(&self, id: &ChunkId) -> Option<Bytes> {
        if let Some(b) = self.mem.lock().get(id) {
            return Some(b);
        }
        let f = self.inflight.lock().get(id).map(|(_, f)| f.clone())?;
        if let Some(Some(d)) = self.decoder.get() {
            // The caller waits for it: not left to the low-priority threads.
            d.decode_here(id);
        }
        f.await.ok()
    }

    /// Counts pages stored in the kernel's page cache (`new_file`: the first of their file).
    pub fn count_warmed(&self, new_file: bool, bytes: u64) {
        self.counters
            .warmed_files
            .fetch_add(new_file as u64, Ordering::Relaxed);
        self.counters
            .warmed_bytes
            .fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether `id` is already local, in flight or was demanded: nothing for the prefetcher
    /// to do.
    pub fn settled(&self, id: &ChunkId) -> bool {
        self.mem.lock().contains(id)
            || self.inflight.lock().contains_key(id)
            || self.seen.lock().contains_key(id)
            || self.on_disk(id)
    }

    /// Starts a prefetch of `id` unless it is settled; the returned future ends with the fetch
    /// (with its latency), or at once when nothing was started.
    pub fn prefetch(
        self: &Arc<Self>,
        id: ChunkId,
        len: u32,
    ) -> Option<BoxFuture<'static, PrefetchDone>> {
        let flight = {
            let mut inflight = self.inflight.lock();
            if inflight.contains_key(&id) || self.mem.lock().contains(&id) || self.on_disk(&id) {
                return None;
            }
            let seen = self.seen.lock();
            if seen.contains_key(&id) {
                return None;
            }
            // Counted before the fetch can end (and fail, which uncounts it).
            self.prefetched.lock().insert(id, len);
            self.ahead.fetch_add(len as u64, Ordering::AcqRel);
            self.prefetch_inflight.fetch_add(1, Ordering::AcqRel);
            let (tx, link) = tokio::sync::oneshot::channel();
            let f = self.spawn_fetch(id, Origin::Prefetch, Some(tx));
            inflight.insert(id, (Origin::Prefetch, f.clone()));
            (f, link)
        };
        let (flight, link) = flight;
        Some(
            async move {
                let ok = flight.await.is_ok();
                PrefetchDone {
                    ok,
                    // Sent before the flight ends, or never (the frame was in memory).
                    latency: link.await.ok(),
                }
            }
            .boxed(),
        )
    }

    /// Fetches in flight: (demand, prefetch).
    pub fn in_flight(&self) -> (usize, usize) {
        (
            self.demand_inflight.load(Ordering::Acquire),
            self.prefetch_inflight.load(Ordering::Acquire),
        )
    }

    /// Waits until a fetch ends or a demand read starts or ends (or `timeout` passes).
    pub async fn wait_change(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.changed.notified()).await;
    }

    /// Prefetched bytes not demanded yet (fetched or still arriving).
    pub fn ahead_bytes(&self) -> u64 {
        self.ahead.load(Ordering::Acquire)
    }

    /// Every first demand so far, in the order they happened.
    pub fn trace(&self) -> Vec<FirstAccess> {
        let mut out: Vec<FirstAccess> = self
            .seen
            .lock()
            .iter()
            .map(|(id, (offset, len))| FirstAccess {
                id: *id,
                len: *len,
                offset: *offset,
            })
            .collect();
        out.sort_by_key(|a| (a.offset, a.id));
        out
    }

    /// The counters now.
    pub fn stats(&self) -> LoaderStats {
        let c = &self.counters;
        let seen = self.seen.lock();
        let (mut wasted, mut wasted_bytes) = (0, 0);
        for (id, len) in self.prefetched.lock().iter() {
            if !seen.contains_key(id) {
                wasted += 1;
                wasted_bytes += *len as u64;
            }
        }
        LoaderStats {
            reads: c.reads.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            chunks_read: seen.len() as u64,
            chunk_bytes_read: seen.values().map(|(_, l)| *l as u64).sum(),
            hits: c.hits.load(Ordering::Relaxed),
            stall: Duration::from_nanos(c.stall_ns.load(Ordering::Relaxed)),
            demand_fetches: c.demand_fetches.load(Ordering::Relaxed),
            demand_fetch_bytes: c.demand_fetch_bytes.load(Ordering::Relaxed),
            prefetched: c.prefetched.load(Ordering::Relaxed),
            prefetched_bytes: c.prefetched_bytes.load(Ordering::Relaxed),
            wasted,
            wasted_bytes,
            prefetch_errors: c.prefetch_errors.load(Ordering::Relaxed),
            warmed_files: c.warmed_files.load(Ordering::Relaxed),
            warmed_bytes: c.warmed_bytes.load(Ordering::Relaxed),
        }
    }

    fn on_disk(&self, id: &ChunkId) -> bool {
        self.chunks.cache().is_some_and(|c| c.contains(id))
    }

    /// The one fetch of `id`: from the store, then into memory (and on to the cache writer),
    /// then out of the in-flight map. `link`, if given, is sent how long the store's request
    /// took, and nothing when the frame came from memory (a snapshot's pack, held or announced).
    fn spawn_fetch(
        self: &Arc<Self>,
        id: ChunkId,
        origin: Origin,
        link: Option<tokio::sync::oneshot::Sender<Duration>>,
    ) -> Flight {
        let this = self.clone();
        let task = tokio::spawn(async move {
            let decoder = (origin == Origin::Prefetch)
                .then(|| {
                    this.decoder
                        .get_or_init(|| Decoder::start(this.chunks.clone()))
                })
                .and_then(Option::as_ref);
            let res = match decoder {
                Some(d) => match this.timed_frame(&id, link).await {
                    Ok(frame) => {
                        d.decode(id, frame, || this.seen.lock().contains_key(&id))
                            .await
                    }
                    Err(e) => Err(e),
                },
                None => this.chunks.get_uncached(&id).await,
            };
            if let (Ok(data), Some(tx)) = (&res, &this.to_cache) {
                // A full queue skips this chunk: the cache is a hint, the memory tier has it.
                let _ = tx.try_send((id, data.clone()));
            }
            this.finish_fetch(id, origin, &res);
            res
        });
        async move {
            match task.await {
                Ok(res) => res.map_err(Arc::new),
                Err(e) => Err(Arc::new(hotstart_store::Error::Task {
                    what: "chunk fetch",
                    message: e.to_string(),
                })),
            }
        }
        .boxed()
        .shared()
    }

    /// The stored frame of `id` (held, announced, or fetched from the store); how long the
    /// store's request took goes to `link` when there was one.
    async fn timed_frame(
        &self,
        id: &ChunkId,
        link: Option<tokio::sync::oneshot::Sender<Duration>>,
    ) -> hotstart_store::Result<Bytes> {
        let in_memory = self.chunks.is_held(id);
        let asked = Instant::now();
        let frame = self.chunks.fetch_frame(id).await?;
        if let Some(tx) = link.filter(|_| !in_memory) {
            let _ = tx.send(asked.elapsed());
        }
        Ok(frame)
    }

    fn finish_fetch(&self, id: ChunkId, origin: Origin, res: &hotstart_store::Result<Bytes>) {
        match res {
            Ok(data) => {
                self.mem.lock().insert(id, data.clone());
                if origin == Origin::Prefetch {
                    self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
                    self.counters
                        .prefetched_bytes
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Err(e) => {
                if origin == Origin::Prefetch {
                    self.counters
                        .prefetch_errors
                        .fetch_add(1, Ordering::Relaxed);
                    let seen = self.seen.lock();
                    if let Some(l) = self.prefetched.lock().remove(&id)
                        && !seen.contains_key(&id)
                    {
                        self.ahead.fetch_sub(l as u64, Ordering::AcqRel);
                    }
                    tracing::warn!(chunk = %id, error = %e, "prefetch failed; a read will retry");
                }
            }
        }
        self.inflight.lock().remove(&id);
        if origin == Origin::Prefetch {
            self.prefetch_inflight.fetch_sub(1, Ordering::AcqRel);
        }
        self.changed.notify_waiters();
    }
}

/// What one prefetch did.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchDone {
    pub ok: bool,
    /// How long its request to the store took, decoding excluded; `None` when the frame came
    /// from memory (a snapshot's pack), which says nothing about the link.
    pub latency: Option<Duration>,
}

/// Starts the thread that writes fetched chunks into `cache` at the lowest CPU priority; it
/// ends when the loader (the sender) is gone and the queue is drained.
fn cache_writer(cache: ChunkCache) -> Option<SyncSender<(ChunkId, Bytes)>> {
    let (tx, rx) = sync_channel::<(ChunkId, Bytes)>(CACHE_QUEUE);
    let started = std::thread::Builder::new()
        .name("chunk-cache-writer".into())
        .spawn(move || {
            lowest_cpu_priority();
            for (id, data) in rx {
                if let Err(e) = cache.insert_blocking(&id, &data) {
                    tracing::warn!(chunk = %id, error = %e, "could not cache chunk");
                }
            }
        });
    match started {
        Ok(_) => Some(tx),
        Err(e) => {
            tracing::warn!(error = %e, "no chunk cache writer; fetched chunks stay in memory only");
            None
        }
    }
}
