//! Packs: a snapshot's chunks in one object, so that a restore from a remote store fetches them
//! with a few large requests instead of one request each.
//!
//! An environment is mostly small files. The 502 MB venv of the benchmark is 10,703 chunks, 8,843
//! of them at most 64 KiB, and a restore that fetches each with its own GET is bound by requests
//! per second, not by bytes. So a capture also writes, beside the tree, one object holding the
//! zstd frames of every distinct chunk of the snapshot in tree order (up to [`PACK_MAX_BYTES`]
//! of plaintext in all), and names it in the record ([`PackRef`]). A restore from a remote store
//! reads the pack's index (started while the tree is fetched) and announces the chunks it will
//! read (those the node's chunk cache does not hold, alone or as part of a whole file) to the
//! chunk store ([`ChunkStore::expect`]); then it writes the tree while it fetches their frames,
//! in tree order, in ranged GETs of up to 4 MiB, and holds them in memory as they arrive
//! ([`ChunkStore::hold`]). A file whose chunks are announced waits for them rather than
//! fetching them on its own; every frame is checked against its chunk id when it is read, and
//! all are dropped when the restore ends.
//!
//! The pack copies chunks, it does not move them: every chunk is still stored on its own, where
//! lazy mounts, deduplication across snapshots and builds that know no packs find it. It costs
//! the store the compressed size of the snapshot's chunks once more (156 MB for that venv), and
//! a restore at most [`PACK_MAX_BYTES`] of memory. And it is only ever a shortcut: a pack that is
//! missing, truncated or malformed, a range that cannot be fetched, or a frame that does not
//! match its id, is logged and skipped, and the chunks concerned are fetched one by one.
//!
//! Layout, integers little-endian:
//!
//! ```text
//! "HSPACK01"                               8 bytes
//! count                                    u32
//! count × (chunk id: 32 bytes, frame length: u32)
//! the frames, in index order
//! ```

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::{BufMut, Bytes, BytesMut};
use futures::StreamExt;
use hotstart_store::{
    ChunkCache, ChunkId, ChunkStore, EntryKind, Store, StripeConfig, StripedReader, Tree,
};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use crate::chunking::CHUNK_SIZE;
use crate::error::{Error, Result};

/// At most this many bytes of plaintext go into one pack: a restore holds their frames in
/// memory. The chunks of a larger snapshot past this much are fetched one by one.
pub const PACK_MAX_BYTES: u64 = 1 << 30;

const MAGIC: &[u8; 8] = b"HSPACK01";
const HEADER: u64 = 12;
const INDEX_ENTRY: u64 = 36;
/// A frame longer than this cannot hold a chunk of a snapshot ([`CHUNK_SIZE`] bytes at most;
/// zstd's worst case adds a few hundred): an index that says otherwise is refused.
const FRAME_MAX: u32 = CHUNK_SIZE as u32 + 4096;
/// Largest index read (bounds what a hostile record can make us fetch before the index is seen).
const INDEX_MAX: u64 = 64 << 20;
/// Bytes per ranged GET, at most. Against a server on the same cores (SeaweedFS on loopback),
/// each GET costs it about 2 ms of CPU beside the bytes: a lazy mount's replay (a fifth of the
/// pack, scattered) cost the server 0.20-0.24 s of CPU in ranges of 4 MiB against 0.31-0.44 s
/// in ranges of 1 MiB, and the larger ranges started sooner in 21 of 26 alternating pairs.
const RANGE_MAX: u64 = 4 << 20;
/// Bytes of frames not wanted that a range reads across rather than starting another request.
const GAP_MAX: u64 = 256 << 10;

/// A snapshot's pack, as its record names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackRef {
    /// The object, relative to `envs/`.
    pub object: String,
    /// Chunks in the pack.
    pub chunks: u64,
    /// The object's size in bytes.
    pub size: u64,
}

impl PackRef {
    /// Bytes of the header and index; `None` when they cannot be as large as the record says.
    fn index_len(&self) -> Option<u64> {
        let len = self.chunks.checked_mul(INDEX_ENTRY)?.checked_add(HEADER)?;
        (len <= self.size && len <= INDEX_MAX).then_some(len)
    }
}

/// One chunk of a pack being built: where its bytes are in the captured directory.
struct Source {
    id: ChunkId,
    path: PathBuf,
    offset: u64,
    len: u32,
}

/// The pack of `tree`'s chunks, read back from `dir` (which the tree was just built from)
/// and encoded as `chunks` encodes chunks; `None` when no chunk qualifies. A chunk whose bytes
/// changed since the tree was built is left out (with a log line): the pack never holds a frame
/// that does not match its id. Returns the bytes and the number of chunks.
pub(crate) async fn build(
    tree: &Tree,
    dir: &Path,
    chunks: &ChunkStore,
) -> Result<Option<(Bytes, u64)>> {
    let sources = select(tree, dir);
    if sources.is_empty() {
        return Ok(None);
    }
    let chunks = chunks.clone();
    tokio::task::spawn_blocking(move || encode(&sources, &chunks))
        .await
        .map_err(|e| Error::task("build pack", e))
}

/// The distinct chunks, in tree order, up to [`PACK_MAX_BYTES`] in all.
fn select(tree: &Tree, dir: &Path) -> Vec<Source> {
    let (mut seen, mut total, mut out) = (HashSet::new(), 0u64, Vec::new());
    for e in &tree.entries {
        let EntryKind::File { chunks, .. } = &e.kind else {
            continue;
        };
        let mut offset = 0u64;
        for c in chunks {
            let len = u64::from(c.len);
            if total + len <= PACK_MAX_BYTES && seen.insert(c.id) {
                total += len;
                out.push(Source {
                    id: c.id,
                    path: dir.join(&e.path),
                    offset,
                    len: c.len,
                });
            }
            offset += len;
        }
    }
    out
}

/// Reads, checks and compresses `sources` on every core, then lays out the pack.
fn encode(sources: &[Source], chunks: &ChunkStore) -> Option<(Bytes, u64)> {
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut frames: Vec<(usize, Vec<u8>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(src) = sources.get(i) else {
                            return mine;
                        };
                        match frame_of(src, chunks) {
                            Ok(frame) => mine.push((i, frame)),
                            Err(reason) => tracing::warn!(
                                path = %src.path.display(), %reason,
                                "left out of the pack; restores fetch this chunk on its own"
                            ),
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    if frames.is_empty() {
        return None;
    }
    frames.sort_unstable_by_key(|(i, _)| *i);
    let body: usize = frames.iter().map(|(_, f)| f.len()).sum();
    let mut out =
        BytesMut::with_capacity(HEADER as usize + frames.len() * INDEX_ENTRY as usize + body);
    out.put_slice(MAGIC);
    out.put_u32_le(frames.len() as u32);
    for (i, frame) in &frames {
        out.put_slice(&sources[*i].id.0);
        out.put_u32_le(frame.len() as u32);
    }
    for (_, frame) in &frames {
        out.put_slice(frame);
    }
    Some((out.freeze(), frames.len() as u64))
}

/// The frame of one chunk, read from its file and checked against its id.
fn frame_of(src: &Source, chunks: &ChunkStore) -> std::result::Result<Vec<u8>, String> {
    let file = std::fs::File::open(&src.path).map_err(|e| e.to_string())?;
    let mut data = vec![0u8; src.len as usize];
    file.read_exact_at(&mut data, src.offset)
        .map_err(|e| e.to_string())?;
    if ChunkId::of(&data) != src.id {
        return Err("the file changed while it was captured".into());
    }
    chunks.encode(&src.id, &data).map_err(|e| e.to_string())
}

/// One frame as the index gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Frame {
    id: ChunkId,
    offset: u64,
    len: u32,
}

impl Frame {
    fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

/// The frames an index describes, checked against the record: the count it names, lengths a
/// chunk can have, and frames that end exactly where the object does.
fn parse_index(data: &[u8], pack: &PackRef) -> std::result::Result<Vec<Frame>, String> {
    if data.len() < HEADER as usize || &data[..8] != MAGIC {
        return Err("not a pack (bad magic)".into());
    }
    let count = u64::from(u32::from_le_bytes(data[8..12].try_into().expect("4 bytes")));
    if count != pack.chunks {
        return Err(format!(
            "the index lists {count} chunks, the record {}",
            pack.chunks
        ));
    }
    let mut offset = HEADER + count * INDEX_ENTRY;
    if data.len() as u64 != offset {
        return Err(format!(
            "the index is {} bytes; {count} chunks take {offset}",
            data.len()
        ));
    }
    let mut frames = Vec::with_capacity(count as usize);
    for entry in data[HEADER as usize..].chunks_exact(INDEX_ENTRY as usize) {
        let id = ChunkId(entry[..32].try_into().expect("32 bytes"));
        let len = u32::from_le_bytes(entry[32..].try_into().expect("4 bytes"));
        if len == 0 || len > FRAME_MAX {
            return Err(format!("chunk {id} has a frame of {len} bytes"));
        }
        frames.push(Frame { id, offset, len });
        offset += u64::from(len);
    }
    if offset != pack.size {
        return Err(format!(
            "the frames end at byte {offset}, the object is {} bytes",
            pack.size
        ));
    }
    Ok(frames)
}

/// Fuzz entry (`fuzz/`, not part of the API): a pack's index as a store returns it, for the
/// pack a record names (`chunks` and `size` from the input's first 16 bytes), read only when the
/// record's sizes allow it, as [`read_index`] does.
#[doc(hidden)]
pub fn fuzz_index(data: &[u8]) {
    let Some((head, index)) = data.split_first_chunk::<16>() else {
        return;
    };
    let pack = PackRef {
        object: "fuzz".into(),
        chunks: u64::from_le_bytes(head[..8].try_into().expect("8 bytes")),
        size: u64::from_le_bytes(head[8..].try_into().expect("8 bytes")),
    };
    if pack.index_len().is_none() {
        return;
    }
    if let Ok(frames) = parse_index(index, &pack) {
        assert_eq!(frames.len() as u64, pack.chunks);
        assert!(frames.windows(2).all(|w| w[0].end() == w[1].offset));
        assert_eq!(frames.last().map_or(HEADER, Frame::end), pack.size);
    }
}

/// Holds the frames of `group` that the node's sidecar provides ([`ChunkStore::shared`]), one
/// piece per run of adjacent frames; how many, or `None` (nothing held) when it did not provide
/// them all and the caller reads the pack.
async fn shared(chunks: &ChunkStore, object: &str, group: &[Frame]) -> Option<u64> {
    let mut got = Vec::new();
    for run in group.chunk_by(|a, b| a.end() == b.offset) {
        let ids: Vec<_> = run.iter().map(|f| (f.id, Some(f.len))).collect();
        let data = chunks.shared(object, run[0].offset, &ids).await?;
        let start = run[0].offset;
        got.extend(run.iter().map(|f| {
            let at = (f.offset - start) as usize;
            (f.id, data.slice(at..at + f.len as usize))
        }));
    }
    let n = got.len() as u64;
    chunks.hold(got);
    Some(n)
}

/// Neighbouring wanted frames (in pack order), merged into ranges of at most [`RANGE_MAX`]
/// bytes across gaps of at most [`GAP_MAX`].
fn ranges(frames: &[Frame]) -> Vec<Vec<Frame>> {
    let mut out: Vec<Vec<Frame>> = Vec::new();
    for &f in frames {
        match out.last_mut() {
            Some(group)
                if f.offset - group[group.len() - 1].end() <= GAP_MAX
                    && f.end() - group[0].offset <= RANGE_MAX =>
            {
                group.push(f)
            }
            _ => out.push(vec![f]),
        }
    }
    out
}

/// What fetching a pack for a restore, or for a lazy mount's replay, did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PackLoad {
    /// Chunks held in memory from the pack.
    pub chunks: u64,
    /// Bytes fetched from the pack object, and the GETs that fetched them.
    pub bytes: u64,
    pub requests: u64,
    /// Seconds from the first request to the last chunk held.
    pub seconds: f64,
}

/// A pack whose index is read and whose wanted chunks are announced to the chunk store; the
/// restore writes the tree while [`Loading::fetch`] delivers them. Whatever was announced and
/// not delivered when this is dropped is no longer announced, so no reader waits for a frame
/// that will not come.
pub(crate) struct Loading {
    chunks: ChunkStore,
    object: String,
    /// `None` when the pack cannot be used.
    reader: Option<StripedReader>,
    /// The frames announced, in pack order.
    frames: Vec<Frame>,
    /// The ranged GETs that fetch them, in the order they are wanted.
    ranges: Vec<Vec<Frame>>,
    done: PackLoad,
    started: std::time::Instant,
}

impl Drop for Loading {
    fn drop(&mut self) {
        self.chunks.not_coming(self.frames.iter().map(|f| f.id));
    }
}

/// A pack's index being read in the background: started as soon as the record names the pack,
/// so that it overlaps with fetching and decoding the tree. Dropping it stops the read.
pub(crate) struct IndexRead {
    pack: PackRef,
    task: JoinHandle<std::result::Result<Index, String>>,
    started: std::time::Instant,
}

/// A pack's index, checked against the record, and the reader of its frames.
struct Index {
    reader: StripedReader,
    frames: Vec<Frame>,
    /// Bytes the index took to read (in one GET).
    bytes: u64,
}

impl IndexRead {
    /// Starts reading the index of `pack`, an object of `chunks`' store.
    pub(crate) fn start(chunks: &ChunkStore, pack: &PackRef) -> IndexRead {
        let (store, p) = (chunks.store().clone(), pack.clone());
        IndexRead {
            pack: pack.clone(),
            task: tokio::spawn(async move { read_index(&store, &p).await }),
            started: std::time::Instant::now(),
        }
    }

    async fn finish(&mut self) -> std::result::Result<Index, String> {
        (&mut self.task)
            .await
            .unwrap_or_else(|e| Err(format!("index read failed: {e}")))
    }
}

impl Drop for IndexRead {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts using the pack whose index `index` reads (an object of `chunks`' store) for a
/// restore of `tree`: announces every chunk the restore will read from it
/// ([`ChunkStore::expect`]), to be fetched in pack order. Never fails: a pack that cannot be
/// used is logged, and the restore fetches its chunks one by one.
pub(crate) async fn start(chunks: &ChunkStore, index: IndexRead, tree: &Tree) -> Loading {
    let covered = cached_whole(tree, chunks);
    begin(chunks, index, |f| {
        (!covered.contains(&f.id)).then_some(f.offset)
    })
    .await
}

/// Starts using the pack whose index `index` reads for the chunks of `plan` (a lazy mount's
/// replay, in the order it will want them): announces those the pack holds, to be fetched in
/// ranges ordered by the first chunk of `plan` each holds. Never fails, as [`start`].
pub(crate) async fn start_planned(
    chunks: &ChunkStore,
    index: IndexRead,
    plan: &[ChunkId],
) -> Loading {
    let rank: HashMap<ChunkId, usize> = plan.iter().enumerate().map(|(i, id)| (*id, i)).collect();
    begin(chunks, index, |f| rank.get(&f.id).copied()).await
}

/// Announces the frames of the pack whose index `index` reads that `rank` orders (`None`: not
/// wanted) and that are neither held nor cached already, cut into ranges ([`ranges`]) and
/// ordered by the lowest rank of a frame each holds.
async fn begin<K: Ord>(
    chunks: &ChunkStore,
    mut index: IndexRead,
    rank: impl Fn(&Frame) -> Option<K>,
) -> Loading {
    let mut loading = Loading {
        chunks: chunks.clone(),
        object: index.pack.object.clone(),
        reader: None,
        frames: Vec::new(),
        ranges: Vec::new(),
        done: PackLoad::default(),
        started: index.started,
    };
    let local = |id: &ChunkId| chunks.is_held(id) || chunks.cache().is_some_and(|c| c.contains(id));
    match index.finish().await {
        Ok(Index {
            reader,
            frames,
            bytes,
        }) => {
            loading.done.bytes += bytes;
            loading.done.requests += 1;
            loading.frames = frames
                .into_iter()
                .filter(|f| !local(&f.id) && rank(f).is_some())
                .collect();
            chunks.expect(loading.frames.iter().map(|f| f.id));
            loading.ranges = ranges(&loading.frames);
            loading
                .ranges
                .sort_by_cached_key(|group| group.iter().filter_map(&rank).min());
            loading.reader = Some(reader);
        }
        Err(reason) => tracing::warn!(
            pack = %index.pack.object, %reason,
            "pack not used; its chunks are fetched one by one"
        ),
    }
    loading
}

/// The chunks of `tree`'s files that the local cache holds whole: a restore links those files
/// and reads none of their chunks.
fn cached_whole(tree: &Tree, chunks: &ChunkStore) -> HashSet<ChunkId> {
    let Some(cache) = chunks.cache() else {
        return HashSet::new();
    };
    tree.entries
        .iter()
        .filter_map(|e| match &e.kind {
            EntryKind::File { chunks: refs, .. } if refs.len() > 1 => Some(refs),
            _ => None,
        })
        .filter(|refs| cache.contains(&ChunkCache::file_key(refs)))
        .flat_map(|refs| refs.iter().map(|r| r.id))
        .collect()
}

/// A reader of the pack and the frames its index lists, checked against the record.
async fn read_index(store: &Store, pack: &PackRef) -> std::result::Result<Index, String> {
    let index_len = pack
        .index_len()
        .ok_or_else(|| format!("{} chunks cannot fit in {} bytes", pack.chunks, pack.size))?;
    let reader = StripedReader::with_size(store, &pack.object, pack.size, StripeConfig::default())
        .map_err(|e| e.to_string())?;
    let index = reader
        .read_at(0, index_len as usize)
        .await
        .map_err(|e| e.to_string())?;
    let frames = parse_index(&index, pack)?;
    Ok(Index {
        reader,
        frames,
        bytes: index.len() as u64,
    })
}

impl Loading {
    /// Fetches the announced frames range by range in the order they are wanted, up to
    /// `concurrency` ranged GETs at once, and
    /// holds each range's frames as it arrives. The chunks of a range that cannot be fetched are
    /// no longer announced: their readers fetch them one by one.
    pub(crate) async fn fetch(mut self, concurrency: usize) -> PackLoad {
        let Some(reader) = self.reader.clone() else {
            return self.done;
        };
        let mut fetches = futures::stream::iter(std::mem::take(&mut self.ranges))
            .map(|group| {
                let (reader, chunks) = (reader.clone(), self.chunks.clone());
                let object = self.object.clone();
                async move {
                    let start = group[0].offset;
                    let len = (group[group.len() - 1].end() - start) as usize;
                    if let Some(held) = shared(&chunks, &object, &group).await {
                        return Ok((held, 0));
                    }
                    match reader.read_at(start, len).await {
                        Ok(data) => {
                            let held = group.len() as u64;
                            chunks.hold(group.iter().map(|f| {
                                let at = (f.offset - start) as usize;
                                (f.id, data.slice(at..at + f.len as usize))
                            }));
                            Ok((held, len as u64))
                        }
                        Err(e) => {
                            chunks.not_coming(group.iter().map(|f| f.id));
                            Err(e.to_string())
                        }
                    }
                }
            })
            .buffer_unordered(concurrency.max(1));
        let mut first_error = None;
        while let Some(res) = fetches.next().await {
            match res {
                Ok((held, bytes)) => {
                    self.done.chunks += held;
                    self.done.bytes += bytes;
                    self.done.requests += 1;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(reason) = first_error {
            tracing::warn!(
                pack = %self.object, %reason, held = self.done.chunks,
                "pack not used in full; the chunks it did not provide are fetched one by one"
            );
        }
        self.done.seconds = self.started.elapsed().as_secs_f64();
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(id: u8, offset: u64, len: u32) -> Frame {
        Frame {
            id: ChunkId([id; 32]),
            offset,
            len,
        }
    }

    #[test]
    fn ranges_merge_neighbours_up_to_a_bound() {
        let frames = vec![
            frame(1, 100, 1000),
            frame(2, 1100, 1000),
            // 100 KiB skipped: still one range.
            frame(3, 2100 + (100 << 10), 1000),
            // 1 MiB skipped: a new range.
            frame(4, 4 << 20, 60_000),
        ];
        let mut many = Vec::new();
        let mut at = 8 << 20;
        for i in 0..100 {
            many.push(frame(i, at, 65_000));
            at += 65_000;
        }
        let all: Vec<Frame> = frames.into_iter().chain(many).collect();
        let got = ranges(&all);
        let sizes: Vec<usize> = got.iter().map(Vec::len).collect();
        assert_eq!(sizes[..2], [3, 1]);
        // 100 frames of 65,000 bytes: 64 fit in 4 MiB.
        assert_eq!(sizes[2..], [64, 36]);
        for g in &got {
            assert!(g[g.len() - 1].end() - g[0].offset <= RANGE_MAX);
        }
    }

    #[test]
    fn index_is_checked_against_the_record() {
        let mut data = MAGIC.to_vec();
        data.extend(2u32.to_le_bytes());
        for (id, len) in [(1u8, 10u32), (2, 20)] {
            data.extend([id; 32]);
            data.extend(len.to_le_bytes());
        }
        let pack = |chunks, size| PackRef {
            object: "snapshots/x/pack-0".into(),
            chunks,
            size,
        };
        let size = data.len() as u64 + 30;
        let frames = parse_index(&data, &pack(2, size)).unwrap();
        assert_eq!(
            frames,
            [frame(1, 84, 10), frame(2, 94, 20)],
            "frames follow the index"
        );
        assert!(parse_index(&data, &pack(3, size)).is_err(), "count");
        assert!(parse_index(&data, &pack(2, size + 1)).is_err(), "size");
        assert!(
            parse_index(&data[..50], &pack(2, size)).is_err(),
            "truncated"
        );
        let mut longer = data.clone();
        longer.push(0);
        assert!(
            parse_index(&longer, &pack(2, size)).is_err(),
            "trailing bytes"
        );
        let mut bad = data.clone();
        bad[0] = b'X';
        assert!(parse_index(&bad, &pack(2, size)).is_err(), "magic");
        let mut huge = data.clone();
        huge[44..48].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_index(&huge, &pack(2, size)).is_err(), "frame length");
        assert_eq!(pack(u64::MAX, 100).index_len(), None);
        assert_eq!(
            pack(2, 50).index_len(),
            None,
            "index longer than the object"
        );
    }
}
