//! Chunk sharing: the nodes of a job fetch each piece of an image or environment from the
//! store about once per job, not once per node.
//!
//! A process of this node (an environment restore, a lazy image) asks for a **piece**: a byte
//! range of a store object and the ids of the zstd frames it holds
//! ([`hotstart_proto::share::Piece`]). Its identity is its content, so every node that wants
//! the same bytes names the same piece.
//!
//! **Who fetches it.** Every piece has an **owner**: of this node and the peers that answered
//! the last probe (less those avoided, below), the one whose BLAKE3 of (piece id, node id) is
//! highest (rendezvous hashing). Every node computes the same owner from the same membership,
//! with no tracker and no announcements; owners spread evenly over the nodes, and a node that
//! joins or leaves moves only the pieces it owns. A node asks the owner; the owner answers
//! from its cache or reads the store (once, however many nodes ask: requests for a piece in
//! flight wait for it), keeps the piece and answers. A node that owns a piece reads the store
//! itself. So the store sends each piece about once, and each node uploads about a 1/N share
//! of the artifact to each of the others.
//!
//! ```text
//!  process ──Piece──► sidecar: cache? ──► owner = max_n blake3(piece ‖ n) over up peers + me
//!                                            │ me: read the store      │ a peer: ask it (Piece)
//!                                            ▼                         ▼
//!                                      verify every frame, keep it in the cache, answer
//! ```
//!
//! **Failures.** A peer that cannot be reached, refuses, or does not answer within the peer
//! timeout is skipped for that piece: the next owner in rendezvous order is asked (a second
//! node most nodes agree on, so a dead owner's pieces are still read from the store about
//! once), then the store. A start is so never slower than reading the store alone by more
//! than two peer timeouts per piece, and only while a dead peer is still counted up (until the
//! next probe). A peer that is late, not dead (a slow link, a frozen process), is not waited
//! for that long: one late twice in a row, much slower than the others (its answer still
//! pending counts as at least as slow as it has taken so far), is avoided, and the piece
//! waited for goes to its next owner as its other pieces do.
//!
//! **Trust.** No peer is trusted for content: every frame of a piece that arrives from a peer
//! or the store is decompressed and checked against its id before it is cached or answered.
//! A peer that sends a frame that does not match is counted
//! (`hotstart_share_peer_failures_total{kind="corrupt"}`) and avoided for [`AVOID_FOR`]: it
//! owns nothing and is asked for nothing. The process checks every frame again as it reads it.
//!
//! **Ranges of a chunk.** A checkpoint chunk larger than `share_piece` is shared in ranges,
//! each a piece with an owner of its own, so that the chunk spreads while it still arrives.
//! A range comes with the chaining values of its 64 KiB parts (subtrees of the chunk's BLAKE3
//! tree, [`hotstart_ckpt::parts`]): each part is checked against its value as it arrives. A
//! range from a peer is kept, and so passed on, once its values are known to make the chunk's
//! id: the values of every range, gathered from the ranges' owners while the ranges are asked
//! for and checked against the id, or, when they could not be had, the values of all the
//! chunk's ranges once all are in.
//!
//! **Budget.** Pieces are kept in memory, least recently used first out, within
//! `share_cache` bytes and within the memory tier's budget: each is charged to it while kept,
//! only from memory free at the time, and the tier takes pieces back (least recently used
//! first) before it evicts any shard or refuses a save. A piece larger than a quarter of
//! `share_cache` is answered and not kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, Weak, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::{debug, warn};

use crate::Core;
use crate::members::Member;
use crate::memory::{Charge, Memory, ShardKey};
use crate::peer::PeerClient;
use blake3::hazmat::ChainingValue;
use hotstart_ckpt::format::{self, Manifest};
use hotstart_ckpt::parts;
use hotstart_ckpt::tier::TierKind;
use hotstart_proto::share::{Piece, PieceFrame, PieceSource};
use hotstart_store::{ChunkId, LruIndex, Store};

/// For fault tests: set to `1`, a sidecar flips one byte of every piece it sends to a peer;
/// set to `forge`, it also sends a range of a chunk with values made for the flipped bytes, so
/// that the range passes its own check and only its chunk's does not.
pub const CORRUPT_SENT_ENV: &str = "HOTSTART_FAULT_CORRUPT_SHARED";

/// How long a peer that sent a corrupt piece is avoided.
pub const AVOID_FOR: Duration = Duration::from_secs(600);

/// Owners asked for a piece before the store is read.
const OWNERS_ASKED: usize = 2;

/// Peers a node sends one piece to at once; more are redirected to those it sent it to (so a
/// piece spreads as a tree, each holder sending it on), or wait.
const UPLOADS_PER_PIECE: usize = 3;
/// Redirects followed for one piece.
const MAX_HOPS: usize = 6;

/// A peer that answers this many pieces in a row after their deadline, and whose answers are
/// this many times slower than the median peer's (for bytes, a moving average of every answer,
/// late ones too), is avoided: busy cores make every peer late now and then, and avoiding a
/// peer that is only as slow as the others moves its pieces to their next owner, which reads
/// them from the store a second time...
const SLOW_STRIKES: u32 = 2;
const SLOW_RATIO: f64 = 4.0;
/// ... for this long.
pub const SLOW_AVOID_FOR: Duration = Duration::from_secs(60);
/// A piece's deadline, past which the node waited on gets a strike: this many times the time
/// the peers' recent answers took for its size...
const LATE_FACTOR: f64 = 6.0;
/// ... and at least this long; before any answer, [`LATE_FIRST`] plus its size at
/// [`LATE_FIRST_RATE`] (a node whose cores are busy decompressing answers late, not never).
const LATE_MIN: Duration = Duration::from_millis(500);
const LATE_FIRST: Duration = Duration::from_millis(500);
const LATE_FIRST_RATE: f64 = 20e6;
/// The next owner is hedged to at this share of a piece's deadline, and again at each such
/// interval while it does not hold the piece: a hedge never reads the store, so it can come
/// well before a strike, which can move the piece to a second store reader.
const HEDGE_AT: f64 = 0.5;

/// What a hedge (a request for what a node holds, see `Core::ask_peer`) gets from a node that
/// does not hold the piece.
const NOT_HELD: &str = "not held";

/// Chunks of a checkpoint asked for at once by one restore...
const CHUNKS_IN_FLIGHT: usize = 4;
/// ... or ranges of its chunks, when they are asked for in ranges.
const RANGES_IN_FLIGHT: usize = 8;

/// Largest plaintext of one frame accepted when checking a piece.
const MAX_FRAME_PLAINTEXT: usize = 64 << 20;

/// A piece as answered.
#[derive(Debug, Clone)]
pub(crate) struct Got {
    pub bytes: Bytes,
    pub source: PieceSource,
    pub peer: Option<String>,
}

type Answer = std::result::Result<Got, String>;

/// A fetch in progress that later requests for the same piece wait for.
#[derive(Default)]
struct Flight {
    done: Mutex<Option<Answer>>,
    cv: Condvar,
    /// A peer asked this node for the piece in full: to it, this node is the piece's owner
    /// (the owners ahead of it failed it), so a fetch still asking them reads the store now.
    store_now: AtomicBool,
    /// Peers that asked this node for the piece as held (a hedge, or a redirect) while it was
    /// still fetching it.
    hedgers: Mutex<Vec<String>>,
}

/// Peers hedging to a node for a piece it is still fetching, past which, when it is the
/// piece's next owner, the owner ahead of it is late for them all ([`Core::ask_owners`]).
const HEDGE_QUORUM: usize = 3;

impl Flight {
    /// `asker` hedged to this node for the piece, which it is still fetching.
    fn hedged_by(&self, asker: &str) {
        let mut hedgers = lock(&self.hedgers);
        if !hedgers.iter().any(|a| a == asker) {
            hedgers.push(asker.to_string());
        }
    }

    /// [`HEDGE_QUORUM`] peers hedged to this node for the piece.
    fn hedge_quorum(&self) -> bool {
        lock(&self.hedgers).len() >= HEDGE_QUORUM
    }
}

/// How often a fetch asking peers looks at [`Flight::store_now`].
const STORE_NOW_POLL: Duration = Duration::from_millis(50);

/// The node a request for a piece waits on (its owner, or a node the owner redirected to),
/// and since when.
type Waiting = Arc<Mutex<(String, Instant)>>;

/// A piece of a chunk a restore asked for, landed in its place `dst`.
struct Landed<'b> {
    piece: Piece,
    got: Got,
    dst: &'b mut [u8],
}

/// A chunk a restore asks for in ranges, as its ranges from peers land: kept at once once the
/// values of its parts are verified against its id ([`Core::chunk_values`]), held back until
/// then.
#[derive(Default)]
struct Early {
    /// The chunk's parts' values, verified.
    values: Option<Arc<Vec<ChainingValue>>>,
    /// Ranges from peers (each with its answer) that landed before them.
    pending: Vec<(Piece, Bytes)>,
    /// Restores asking for the chunk.
    users: usize,
}

/// The sharing state of a sidecar.
pub(crate) struct Share {
    cache: Mutex<Cache>,
    flights: Mutex<HashMap<[u8; 32], Arc<Flight>>>,
    /// Stores opened by URL, for the pieces this node reads.
    stores: Mutex<HashMap<String, Store>>,
    /// Peers avoided, until when.
    avoided: Mutex<HashMap<String, Instant>>,
    /// Authenticated connections to peers, kept for the next piece.
    idle: Mutex<HashMap<String, Vec<PeerClient>>>,
    /// Each piece's sends to peers, and who it went to.
    uploads: Mutex<HashMap<[u8; 32], Uploads>>,
    uploads_changed: Condvar,
    /// Chunks asked for in ranges, by id.
    early: Mutex<HashMap<[u8; 32], Early>>,
    /// Ranges held back in `early` were kept, or will not be.
    early_changed: Condvar,
    /// Reads the store; only taken in `drop` (a runtime dropped on another runtime's thread
    /// would panic, so it is shut down in the background).
    rt: Option<tokio::runtime::Runtime>,
    /// What [`CORRUPT_SENT_ENV`] asks for: nothing (`None`), or whether to forge values.
    corrupt_sent: Option<bool>,
    /// Seconds per byte of the peers' recent answers (a moving average), for deadlines.
    pace: Mutex<Option<f64>>,
    /// Seconds per byte of each peer's answers (moving averages), late ones included.
    peer_pace: Mutex<HashMap<String, f64>>,
    /// Deadlines each peer missed in a row, since its last answer in time (0: its last
    /// answer was in time; absent: none yet).
    strikes: Mutex<HashMap<String, u32>>,
    /// The sidecar, for the threads that ask peers (set once it is made).
    core: OnceLock<Weak<Core>>,
}

impl Drop for Share {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Pieces kept in memory, least recently used first out: within `cap` bytes, and within the
/// memory tier's budget, charged to it and given back before any shard is evicted.
struct Cache {
    cap: u64,
    lru: LruIndex<[u8; 32]>,
    pieces: HashMap<[u8; 32], (Bytes, Charge)>,
}

impl Cache {
    fn new(cap: u64) -> Cache {
        Cache {
            cap,
            lru: LruIndex::default(),
            pieces: HashMap::new(),
        }
    }

    fn get(&mut self, id: &[u8; 32]) -> Option<Bytes> {
        let bytes = self.pieces.get(id)?.0.clone();
        self.lru.use_existing(id);
        Some(bytes)
    }

    fn holds(&self, id: &[u8; 32]) -> bool {
        self.pieces.contains_key(id)
    }

    /// Keeps `bytes`, unless larger than a quarter of the cache or than what the memory tier
    /// has free once every older piece is out; the pieces evicted for room.
    fn insert(&mut self, id: [u8; 32], bytes: Bytes, memory: &Arc<Memory>) -> Vec<[u8; 32]> {
        let n = bytes.len() as u64;
        if n > self.cap / 4 || self.holds(&id) || n > memory.free() + self.lru.bytes() {
            return Vec::new();
        }
        let mut evicted = self.evict_to(self.cap - n);
        let charge = loop {
            if let Some(c) = memory.reserve_free(n) {
                break Some(c);
            }
            let before = evicted.len();
            evicted.extend(self.evict_to(self.lru.bytes().saturating_sub(1)));
            if evicted.len() == before {
                break None;
            }
        };
        if let Some(charge) = charge {
            self.lru.touch(id, n);
            self.pieces.insert(id, (bytes, charge));
        }
        evicted
    }

    /// Evicts the least recently used pieces until at most `bytes` are kept.
    fn evict_to(&mut self, bytes: u64) -> Vec<[u8; 32]> {
        let evicted = self.lru.evict(bytes);
        for old in &evicted {
            self.pieces.remove(old);
        }
        evicted
    }
}

/// An answer smaller than this is costed as this many bytes: its time is the round trip and
/// the sender's turn, not its bytes. (Costed by its own size, one answer of a few hundred
/// bytes in 30 ms made every deadline of a 4 MiB range the peer timeout.)
const PACE_MIN_BYTES: usize = 1 << 20;

/// Seconds per byte of an answer of `len` bytes that took `took`, small ones costed as
/// [`PACE_MIN_BYTES`].
fn per_byte(took: Duration, len: usize) -> f64 {
    took.as_secs_f64() / len.max(PACE_MIN_BYTES) as f64
}

/// `old` moved a fifth of the way to `sample` (the first sample as it is).
fn moving_average(old: Option<f64>, sample: f64) -> f64 {
    old.map_or(sample, |o| 0.8 * o + 0.2 * sample)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Share {
    pub(crate) fn new(cache_bytes: u64) -> std::io::Result<Share> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hotstart-share")
            .enable_all()
            .build()?;
        Ok(Share {
            cache: Mutex::new(Cache::new(cache_bytes)),
            flights: Mutex::new(HashMap::new()),
            stores: Mutex::new(HashMap::new()),
            avoided: Mutex::new(HashMap::new()),
            idle: Mutex::new(HashMap::new()),
            uploads: Mutex::new(HashMap::new()),
            uploads_changed: Condvar::new(),
            early: Mutex::new(HashMap::new()),
            early_changed: Condvar::new(),
            rt: Some(rt),
            corrupt_sent: match std::env::var(CORRUPT_SENT_ENV).as_deref() {
                Ok("1") => Some(false),
                Ok("forge") => Some(true),
                _ => None,
            },
            pace: Mutex::new(None),
            peer_pace: Mutex::new(HashMap::new()),
            strikes: Mutex::new(HashMap::new()),
            core: OnceLock::new(),
        })
    }

    /// What this node sends a peer for `piece`: `answer`, unless a fault test asks for it to
    /// be corrupt ([`CORRUPT_SENT_ENV`]).
    pub(crate) fn sent(&self, piece: &Piece, answer: Bytes) -> Bytes {
        let Some(forge) = self.corrupt_sent else {
            return answer;
        };
        // A byte in the middle of the bytes (after a range's values).
        let data = split_range(piece, &answer).0.len();
        let mut v = answer.to_vec();
        let mid = data + (v.len() - data) / 2;
        v[mid] ^= 0x40;
        match piece.within {
            Some(at) if forge => with_values(at, &v[data..]),
            _ => v.into(),
        }
    }

    /// Lets the threads that ask peers reach the sidecar `core`,
    /// and its memory tier take cached pieces back.
    pub(crate) fn attach(&self, core: &Arc<Core>) {
        let _ = self.core.set(Arc::downgrade(core));
        let weak = Arc::downgrade(core);
        core.memory
            .on_reclaim(move |want| weak.upgrade().map_or(0, |c| c.share.give_back(want)));
    }

    /// Bytes of the pieces kept.
    pub(crate) fn cached_bytes(&self) -> u64 {
        lock(&self.cache).lru.bytes()
    }

    /// Drops the least recently used pieces until at least `want` bytes are given back to the
    /// memory tier (or none are left); the bytes it gave back.
    fn give_back(&self, want: u64) -> u64 {
        let mut cache = lock(&self.cache);
        let before = cache.lru.bytes();
        let evicted = cache.evict_to(before.saturating_sub(want));
        let freed = before - cache.lru.bytes();
        drop(cache);
        self.forget_uploads(evicted);
        freed
    }

    /// What this node no longer holds it no longer sends: its sends' records go too.
    fn forget_uploads(&self, evicted: Vec<[u8; 32]>) {
        if evicted.is_empty() {
            return;
        }
        let mut uploads = lock(&self.uploads);
        for old in evicted {
            if uploads.get(&old).is_some_and(|u| u.active == 0) {
                uploads.remove(&old);
            }
        }
    }

    fn avoid(&self, node: &str, wait: Duration) {
        lock(&self.avoided).insert(node.to_string(), Instant::now() + wait);
    }

    /// How long a peer may take to answer a piece of `len` bytes before it gets a strike.
    fn late_after(&self, len: u64, limit: Duration) -> Duration {
        match *lock(&self.pace) {
            Some(pace) => {
                Duration::from_secs_f64(LATE_FACTOR * pace * len.max(PACE_MIN_BYTES as u64) as f64)
                    .clamp(LATE_MIN, limit.max(LATE_MIN))
            }
            None => LATE_FIRST + Duration::from_secs_f64(len as f64 / LATE_FIRST_RATE),
        }
    }

    /// `node` answered `len` bytes in `took` (`timely`: within its deadline, which clears its
    /// strikes).
    fn answered(&self, node: &str, len: usize, took: Duration, timely: bool) {
        if timely {
            let mut strikes = lock(&self.strikes);
            strikes.insert(node.to_string(), 0);
        }
        let mut p = lock(&self.pace);
        *p = Some(moving_average(*p, per_byte(took, len)));
    }

    /// `node` sent `len` bytes, `took` after it was asked (in time or not).
    fn peer_answered(&self, node: &str, len: usize, took: Duration) {
        let mut paces = lock(&self.peer_pace);
        let p = paces.get(node).copied();
        paces.insert(node.to_string(), moving_average(p, per_byte(took, len)));
    }

    /// Whether `node`'s answers are [`SLOW_RATIO`] times slower than the median of the other
    /// peers' (false while either is unknown). `pending`: seconds per byte an answer of
    /// `node` not yet in has already taken, at least as slow as that answer will be.
    fn slower_than_others(&self, node: &str, pending: Option<f64>) -> bool {
        let paces = lock(&self.peer_pace);
        let known = paces.get(node).copied();
        let Some(mine) = [known, pending].into_iter().flatten().reduce(f64::max) else {
            return false;
        };
        let mut others: Vec<f64> = paces
            .iter()
            .filter(|(n, _)| *n != node)
            .map(|(_, &p)| p)
            .collect();
        if others.is_empty() {
            return false;
        }
        others.sort_by(f64::total_cmp);
        mine > SLOW_RATIO * others[others.len() / 2]
    }

    /// `node` missed a deadline, with an answer `pending` seconds per byte so far. It is
    /// avoided once it missed [`SLOW_STRIKES`] in a row while another peer's last answer was
    /// in time, and its answers are [`SLOW_RATIO`] times slower than the other peers': when no
    /// peer answers in time, the slow link is this node's own, and avoiding its peers would
    /// only send it to the store.
    fn strike(&self, core: &Core, node: &str, pending: f64) {
        core.metrics.share_peer_failed(node, "slow");
        let slower = self.slower_than_others(node, Some(pending));
        let mut strikes = lock(&self.strikes);
        let others_fine = strikes.iter().any(|(n, &k)| n != node && k == 0);
        let k = strikes.entry(node.to_string()).or_default();
        *k += 1;
        if *k >= SLOW_STRIKES && others_fine && slower {
            strikes.remove(node);
            drop(strikes);
            warn!(peer = %node, "a peer answers pieces too slowly; avoiding it for a while");
            self.avoid(node, SLOW_AVOID_FOR);
        }
    }

    fn is_avoided(&self, node: &str) -> bool {
        let mut avoided = lock(&self.avoided);
        match avoided.get(node) {
            Some(until) if Instant::now() < *until => true,
            Some(_) => {
                avoided.remove(node);
                false
            }
            None => false,
        }
    }
}

/// Checks every frame of `data` against `piece`'s ids: `Err` names the first that does not
/// match. A range of a frame (`within`) has each part checked against the value sent with it
/// here; those values are checked against the chunk's id once every range of it is in
/// (`Core::settle`).
pub(crate) fn verify(piece: &Piece, data: &[u8]) -> std::result::Result<(), String> {
    if let Some(len) = piece.answer_len()
        && len != data.len() as u64
    {
        return Err(format!("{} bytes where {len} were asked for", data.len()));
    }
    if let Some(at) = piece.within {
        let values = range_values(piece, data);
        let bytes = split_range(piece, data).1;
        let first = (at / parts::PART) as usize;
        for (k, (part, value)) in bytes.chunks(parts::PART as usize).zip(values).enumerate() {
            if parts::part_cv(first + k, part) != value {
                return Err(format!(
                    "part {} of chunk {} does not match the value sent with it",
                    first + k,
                    piece.frames[0].id
                ));
            }
        }
        return Ok(());
    }
    let mut at = 0usize;
    for f in &piece.frames {
        let id = ChunkId::from_hex(&f.id).map_err(|e| e.to_string())?;
        let end = match f.len {
            Some(n) => at + n as usize,
            None => data.len(),
        };
        let frame = data
            .get(at..end)
            .ok_or_else(|| format!("frame {id} runs past the end"))?;
        if piece.raw {
            let got = ChunkId::of(frame);
            if got != id {
                return Err(format!("chunk {id} hashes to {got}"));
            }
        } else {
            hotstart_store::chunk::decode_frame(&id, frame, MAX_FRAME_PLAINTEXT)
                .map_err(|e| e.to_string())?;
        }
        at = end;
    }
    Ok(())
}

/// A range's answer: the chaining value of each of its parts (the range starting `at` bytes
/// into its chunk), then its bytes.
fn with_values(at: u64, bytes: &[u8]) -> Bytes {
    let first = (at / parts::PART) as usize;
    let mut out =
        Vec::with_capacity(parts::count(bytes.len() as u64) * parts::CV_LEN + bytes.len());
    for (k, part) in bytes.chunks(parts::PART as usize).enumerate() {
        out.extend_from_slice(&parts::part_cv(first + k, part));
    }
    out.extend_from_slice(bytes);
    out.into()
}

/// A piece's answer split into a range's parts' values (none for other pieces) and its bytes.
fn split_range<'a>(piece: &Piece, answer: &'a [u8]) -> (&'a [u8], &'a [u8]) {
    let len = piece.len.map_or(answer.len(), |l| l as usize);
    answer.split_at(answer.len().saturating_sub(len))
}

/// The parts' values sent with a range's answer (none for other pieces, or if malformed).
fn range_values(piece: &Piece, answer: &[u8]) -> Vec<ChainingValue> {
    parts::from_bytes(split_range(piece, answer).0).unwrap_or_default()
}

/// The chunks of a file asked for in ranges (`units`: each piece with its chunk's index), each
/// with its ranges in order, in the order the first of them is asked for. A chunk found at
/// several places of the file (the same bytes) is listed once, with the ranges of one place.
fn ranges_by_chunk<'a>(
    units: impl Iterator<Item = (usize, &'a Piece)>,
    hashes: &[blake3::Hash],
) -> Vec<(blake3::Hash, Vec<Piece>)> {
    let mut split: Vec<(usize, blake3::Hash, Vec<Piece>)> = Vec::new();
    for (i, piece) in units.filter(|u| u.1.within.is_some()) {
        match split.iter_mut().find(|c| c.1 == hashes[i]) {
            Some(c) if c.0 == i => c.2.push(piece.clone()),
            Some(_) => {}
            None => split.push((i, hashes[i], vec![piece.clone()])),
        }
    }
    split
        .into_iter()
        .map(|(_, id, mut ranges)| {
            ranges.sort_by_key(|p| p.offset);
            (id, ranges)
        })
        .collect()
}

/// The indices of `nodes` in rendezvous order for the piece `id`: highest BLAKE3 of (id, node
/// id) first. Every node computes the same order from the same names; removing a node moves
/// only the pieces it was first for.
pub(crate) fn rendezvous(id: &[u8; 32], nodes: &[String]) -> Vec<usize> {
    let mut scored: Vec<([u8; 32], usize)> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let mut h = blake3::Hasher::new();
            h.update(id);
            h.update(node.as_bytes());
            (*h.finalize().as_bytes(), i)
        })
        .collect();
    scored.sort_by_key(|(score, _)| std::cmp::Reverse(*score));
    scored.into_iter().map(|(_, i)| i).collect()
}

impl Core {
    /// `piece` for a process of this node (`for_peer` false) or for a peer that chose this node
    /// as its owner (`for_peer` true: this node does not ask further, it reads the store).
    pub(crate) fn piece(&self, piece: &Piece, for_peer: bool) -> Answer {
        piece.check()?;
        let id = piece.content_id();
        if let Some(bytes) = lock(&self.share.cache).get(&id) {
            return Ok(Got {
                bytes,
                source: PieceSource::Cache,
                peer: None,
            });
        }
        let (flight, leader) = {
            let mut flights = lock(&self.share.flights);
            match flights.get(&id) {
                Some(f) => (f.clone(), false),
                None => {
                    let f = Arc::new(Flight::default());
                    flights.insert(id, f.clone());
                    (f, true)
                }
            }
        };
        if !leader {
            if for_peer {
                flight.store_now.store(true, Ordering::Relaxed);
            }
            let mut done = lock(&flight.done);
            while done.is_none() {
                done = flight.cv.wait(done).unwrap_or_else(PoisonError::into_inner);
            }
            // Whoever waited got it from this node, which had it in hand.
            return done
                .clone()
                .unwrap_or_else(|| Err("no answer".into()))
                .map(|g| Got {
                    source: PieceSource::Cache,
                    peer: None,
                    ..g
                });
        }
        let answer = self.fetch_piece(piece, &id, for_peer, &flight);
        match &answer {
            // A range from a peer is kept once its values are known to make its chunk's id.
            Ok(g) if piece.within.is_some() && g.source == PieceSource::Peer => {
                self.land_early(piece, &g.bytes)
            }
            Ok(g) => {
                self.keep(piece, g.bytes.clone());
            }
            Err(_) => {}
        }
        *lock(&flight.done) = Some(answer.clone());
        flight.cv.notify_all();
        lock(&self.share.flights).remove(&id);
        answer
    }

    /// Fills chunks of `key`'s file (laid out as `m` says) in `buf` from the pieces the job's
    /// nodes share, when the restore would read them from the store (`nearest`): data-parallel
    /// ranks hold the same bytes, so each piece is read from the store by its owner alone.
    /// For each chunk, where it came from, or `None` (left to the store reader).
    ///
    /// A chunk larger than `share_piece` is asked for in ranges of that size, each with an
    /// owner of its own: the owners read their ranges from the store at once and each sends
    /// its own to the others, so a chunk spreads through the job while it is still arriving,
    /// not one whole chunk after another. A node reads the pieces it owns before it asks for
    /// the others. Each range comes with its parts' values, checked as
    /// it arrives ([`verify`]). In the background, the values of every range of a chunk are
    /// gathered from their owners and checked against the chunk's id ([`Core::chunk_values`]):
    /// a range from a peer whose values are those is kept, and passed on, as it lands. Once
    /// every range of a chunk is in, the values are checked against the chunk's id
    /// ([`Core::settle`]), and the ranges not yet kept are kept.
    pub(crate) fn prefill_shared(
        &self,
        key: &ShardKey,
        m: &Manifest,
        nearest: TierKind,
        buf: &mut [u8],
    ) -> Vec<Option<TierKind>> {
        let Some(store) = self.cfg.store.as_deref() else {
            return Vec::new();
        };
        // Alone, or with a nearer copy, the store reader is the faster way.
        if !self.cfg.share || nearest != TierKind::Store || self.members.counts().0 == 0 {
            return Vec::new();
        }
        let hashes = m.chunk_hashes();
        let data_key = format::data_key(&key.job, key.step, key.rank);
        let range = (self.cfg.share_piece as usize).max(1);
        let mut units = Vec::new();
        for (i, chunk) in buf.chunks_mut(m.chunk_size.max(1) as usize).enumerate() {
            let (start, len) = (m.chunk_range(i).start, chunk.len());
            let split = len > range;
            for (j, dst) in chunk.chunks_mut(range).enumerate() {
                let at = (j * range) as u64;
                let piece = Piece {
                    artifact: "ckpt".into(),
                    store: store.to_string(),
                    key: data_key.clone(),
                    offset: start + at,
                    len: Some(dst.len() as u64),
                    frames: vec![PieceFrame {
                        id: hashes[i].to_hex().to_string(),
                        len: Some(len as u32),
                    }],
                    raw: true,
                    within: split.then_some(at),
                };
                units.push((i, piece, dst));
            }
        }
        // Every node starts at another place, so that the first pieces asked are not the same
        // few owners' on every node.
        let first = u64::from_le_bytes(
            blake3::hash(self.me.node.as_bytes()).as_bytes()[..8]
                .try_into()
                .unwrap_or_default(),
        ) as usize;
        let n = units.len().max(1);
        let in_flight = if units.len() > hashes.len() {
            RANGES_IN_FLIGHT
        } else {
            CHUNKS_IN_FLIGHT
        };
        units.rotate_left(first % n);
        // The values of the parts of the chunks shared in ranges, gathered in the background
        // in the order the ranges are asked for: a range that lands once they are verified is
        // kept, and passed on, at once rather than once its whole chunk is in.
        let split = ranges_by_chunk(units.iter().map(|u| (u.0, &u.1)), &hashes);
        let ids: Vec<[u8; 32]> = split.iter().map(|c| *c.0.as_bytes()).collect();
        for id in &ids {
            lock(&self.share.early).entry(*id).or_default().users += 1;
        }
        let done = Arc::new(AtomicBool::new(false));
        if let Some(core) = self.share.core.get().and_then(Weak::upgrade)
            && !split.is_empty()
        {
            let done = done.clone();
            std::thread::spawn(move || {
                for (id, ranges) in split {
                    if done.load(Ordering::Relaxed) {
                        break;
                    }
                    if let Some(values) = core.chunk_values(&id, &ranges) {
                        core.values_verified(id.as_bytes(), values);
                    }
                }
            });
        }
        // The pieces this node owns first: at the start every owner reads its own from the
        // store, so there is little to ask peers for yet, and an owner behind a slow link
        // gives its whole link to the reads its peers wait on rather than sharing it with its
        // own downloads.
        let (owned, others): (Vec<_>, Vec<_>) = units.into_iter().partition(|u| {
            self.owners(&u.1.content_id())
                .first()
                .is_some_and(Option::is_none)
        });
        let landed: Vec<Mutex<Vec<Landed>>> = hashes.iter().map(|_| Mutex::default()).collect();
        let filled = Mutex::new(vec![None; hashes.len()]);
        for phase in [owned, others] {
            let workers = in_flight.min(phase.len());
            let queue = Mutex::new(phase.into_iter());
            std::thread::scope(|scope| {
                for _ in 0..workers {
                    scope.spawn(|| {
                        loop {
                            let Some((i, piece, dst)) = lock(&queue).next() else {
                                break;
                            };
                            let got = match self.piece(&piece, false) {
                                Ok(got) if split_range(&piece, &got.bytes).1.len() == dst.len() => got,
                                Ok(_) => continue,
                                Err(reason) => {
                                    debug!(shard = %key, chunk = i, %reason, "chunk not shared; the store reader reads it");
                                    continue;
                                }
                            };
                            self.metrics
                                .shared("ckpt", got.source.as_str(), dst.len() as u64);
                            dst.copy_from_slice(split_range(&piece, &got.bytes).1);
                            // The worker that lands a chunk's last range settles the chunk.
                            let r = m.chunk_range(i);
                            let whole = {
                                let mut l = lock(&landed[i]);
                                l.push(Landed { piece, got, dst });
                                let sum: usize = l.iter().map(|x| x.dst.len()).sum();
                                (sum as u64 == r.end - r.start).then(|| std::mem::take(&mut *l))
                            };
                            if let Some(ranges) = whole {
                                lock(&filled)[i] = self.settle(&hashes[i], ranges);
                            }
                        }
                    });
                }
            });
        }
        done.store(true, Ordering::Relaxed);
        let mut early = lock(&self.share.early);
        for id in &ids {
            if let Some(e) = early.get_mut(id) {
                e.users -= 1;
                if e.users == 0 {
                    early.remove(id);
                }
            }
        }
        drop(early);
        self.share.early_changed.notify_all();
        // A chunk with a range missing is left to the store reader.
        filled.into_inner().unwrap_or_else(PoisonError::into_inner)
    }

    /// A range `piece` of a chunk landed from a peer (`answer`: its parts' values, each part
    /// checked against its value as it arrived, then its bytes): kept at once when its values
    /// are those verified for the chunk, held back while they are not yet known (for a chunk a
    /// restore asks for in ranges; else it is kept once its chunk is checked, [`Core::settle`]).
    fn land_early(&self, piece: &Piece, answer: &Bytes) {
        let Ok(chunk) = blake3::Hash::from_hex(&piece.frames[0].id) else {
            return;
        };
        let mut early = lock(&self.share.early);
        let Some(e) = early.get_mut(chunk.as_bytes()) else {
            return;
        };
        match e.values.clone() {
            Some(values) => {
                drop(early);
                self.keep_checked(&values, piece, answer.clone());
            }
            None => e.pending.push((piece.clone(), answer.clone())),
        }
    }

    /// The values of chunk `id`'s parts, verified against it: the ranges of it held back until
    /// now are kept (those that match), and those that land later at once.
    fn values_verified(&self, id: &[u8; 32], values: Vec<ChainingValue>) {
        let values = Arc::new(values);
        let mut early = lock(&self.share.early);
        let Some(e) = early.get_mut(id) else {
            return;
        };
        e.values = Some(values.clone());
        // Kept before the lock is let go: a peer waiting for one of them sees it kept.
        for (piece, answer) in std::mem::take(&mut e.pending) {
            self.keep_checked(&values, &piece, answer);
        }
        drop(early);
        self.share.early_changed.notify_all();
    }

    /// Keeps a range from a peer whose parts' values (each part checked against its own as it
    /// arrived, [`verify`]) are the chunk's verified `values`. One whose values differ is left
    /// to its chunk's check, which finds its sender ([`Core::settle`]).
    fn keep_checked(&self, values: &[ChainingValue], piece: &Piece, answer: Bytes) {
        let sent = range_values(piece, &answer);
        let first = (piece.within.unwrap_or(0) / parts::PART) as usize;
        // Kept already when its chunk was checked whole before the values came in.
        if !sent.is_empty()
            && values.get(first..first + sent.len()) == Some(&sent[..])
            && self.keep(piece, answer)
        {
            self.metrics.range_kept("on_arrival");
        }
    }

    /// A chunk whose every piece has landed: checked (a whole chunk as it came; ranges each
    /// part against its value as it came, and now their values merged against the chunk's
    /// id), its ranges from peers kept, and where it came from. A chunk whose ranges' values
    /// do not make its id (a peer that made up values for bytes it made up) is read from the
    /// store ([`Core::blame_ranges`]); `None` when it cannot be, for the store reader.
    fn settle(&self, id: &blake3::Hash, mut ranges: Vec<Landed>) -> Option<TierKind> {
        ranges.sort_by_key(|l| l.piece.offset);
        let checked = ranges.iter().all(|l| l.piece.within.is_none()) || {
            let values: Vec<ChainingValue> = ranges
                .iter()
                .flat_map(|l| range_values(&l.piece, &l.got.bytes))
                .collect();
            let len = ranges.iter().map(|l| l.dst.len() as u64).sum();
            parts::root(&values, len) == Some(*id)
        };
        if !checked {
            return self
                .blame_ranges(id, &mut ranges)
                .then_some(TierKind::Store);
        }
        for l in &ranges {
            if l.piece.within.is_some()
                && l.got.source == PieceSource::Peer
                && self.keep(&l.piece, l.got.bytes.clone())
            {
                self.metrics.range_kept("with_chunk");
            }
        }
        self.share.early_changed.notify_all();
        let has = |s| ranges.iter().any(|l| l.got.source == s);
        Some(if has(PieceSource::Store) {
            TierKind::Store
        } else if has(PieceSource::Peer) {
            TierKind::Peer
        } else {
            TierKind::Memory
        })
    }

    /// A chunk whose `ranges` do not make its `id`: its bytes from the store in their place,
    /// when they match, each range kept, and every peer whose range differs from them counted
    /// corrupt and avoided (a node passes on only ranges it read from the store or checked, so
    /// the sender is the culprit). Whether the chunk is now in place.
    fn blame_ranges(&self, id: &blake3::Hash, ranges: &mut [Landed]) -> bool {
        let Some(first) = ranges.first() else {
            return false;
        };
        let start = first.piece.offset - first.piece.within.unwrap_or(0);
        let len: usize = ranges.iter().map(|l| l.dst.len()).sum();
        let whole = Piece {
            offset: start,
            len: Some(len as u64),
            within: None,
            ..first.piece.clone()
        };
        let bytes = match self.read_store(&whole) {
            Ok(b) if b.len() == len && blake3::hash(&b) == *id => b,
            Ok(_) => {
                warn!(key = %whole.key, chunk = %id, "the store's copy of a chunk does not match its id either");
                return false;
            }
            Err(reason) => {
                debug!(key = %whole.key, %reason, "a chunk that did not match could not be read again");
                return false;
            }
        };
        self.metrics
            .shared("ckpt", PieceSource::Store.as_str(), len as u64);
        for l in ranges {
            let at = (l.piece.offset - start) as usize;
            let right = bytes.slice(at..at + l.dst.len());
            let answer = with_values(at as u64, &right);
            if let Some(node) = l.got.peer.as_deref()
                && l.got.bytes != answer
            {
                warn!(peer = %node, key = %l.piece.key, "a peer sent a range of a chunk that differs from the store's; avoiding it");
                self.metrics.share_peer_failed(node, "corrupt");
                self.share.avoid(node, AVOID_FOR);
            }
            l.dst.copy_from_slice(&right);
            self.keep(&l.piece, answer);
        }
        true
    }

    /// Keeps `piece`'s checked answer `bytes` to serve this node's processes and its peers:
    /// whether it was kept now (not before, and not refused for room).
    fn keep(&self, piece: &Piece, bytes: Bytes) -> bool {
        let id = piece.content_id();
        let mut cache = lock(&self.share.cache);
        let new = !cache.holds(&id);
        let evicted = cache.insert(id, bytes, &self.memory);
        let kept = new && cache.holds(&id);
        drop(cache);
        self.share.forget_uploads(evicted);
        kept
    }

    /// Whether this node's cache holds `piece`.
    pub(crate) fn share_holds(&self, piece: &Piece) -> bool {
        lock(&self.share.cache).holds(&piece.content_id())
    }

    /// The up peers (less those avoided) and this node (`None`), in rendezvous order for
    /// `id`: the owner first.
    fn owners(&self, id: &[u8; 32]) -> Vec<Option<Member>> {
        let mut nodes: Vec<Option<Member>> = self
            .members
            .up()
            .into_iter()
            .filter(|m| !self.share.is_avoided(&m.id.node))
            .map(Some)
            .collect();
        nodes.push(None);
        let name = |m: &Option<Member>| {
            m.as_ref()
                .map_or(self.me.node.clone(), |m| m.id.node.clone())
        };
        let names: Vec<String> = nodes.iter().map(name).collect();
        let order = rendezvous(id, &names);
        let mut nodes: Vec<Option<Option<Member>>> = nodes.into_iter().map(Some).collect();
        order.into_iter().filter_map(|i| nodes[i].take()).collect()
    }

    fn fetch_piece(&self, piece: &Piece, id: &[u8; 32], for_peer: bool, flight: &Flight) -> Answer {
        if !for_peer {
            // The owners ahead of this node, in order (this node itself reads the store).
            let peers: Vec<Member> = self
                .owners(id)
                .into_iter()
                .take(OWNERS_ASKED)
                .map_while(|o| o)
                .collect();
            if let Some(got) = self.ask_owners(piece, peers, flight) {
                return Ok(got);
            }
        }
        let mut bytes = self.read_store(piece)?;
        if let Some(at) = piece.within {
            bytes = with_values(at, &bytes);
        }
        verify(piece, &bytes).map_err(|reason| {
            format!(
                "{} in {} does not hold the frames asked for: {reason}",
                piece.key, piece.store
            )
        })?;
        Ok(Got {
            bytes,
            source: PieceSource::Store,
            peer: None,
        })
    }

    /// `piece` from `peers` (its owners, in order), verified; `None` when every one failed
    /// (the caller reads the store). Each is asked on a thread of its own, the first in full,
    /// with two deadlines from the pace of the peers' answers ([`Share::late_after`]):
    /// - **a hedge**, at [`HEDGE_AT`] of the piece's deadline and again at each such interval:
    ///   the next owner is asked for the piece if it (or a node it redirects to) holds it or
    ///   is fetching it, and asked again while its last hedge found nothing. A hedge never
    ///   makes a node read the store, so it is cheap; the first good answer wins.
    /// - **a strike**, at the deadline: the node waited on gets a strike and goes on being
    ///   waited for. A peer late [`SLOW_STRIKES`] times in a row while others answer in time,
    ///   and much slower than them, is avoided for [`SLOW_AVOID_FOR`], and loses the piece
    ///   waited for too, as it loses the pieces it owns: the next owner is asked in full,
    ///   whether or not its hedge has answered (every node that gives up on the same owner
    ///   asks the same next one, which reads the piece from the store once), or, when this
    ///   node is next in order, `None` (it reads the store).
    ///
    /// An owner hedged to is also asked in full once every other owner failed. Once a peer
    /// asks this node for the piece in full (`store_now`), having given up on the owners ahead
    /// of it, `None` too: every node that gives up on them asks this one, which reads the store
    /// once for all of them. So does a node next in order once [`HEDGE_QUORUM`] peers hedged to
    /// it for the piece while it has waited on the owner past its own hedge, and the owner is
    /// [`SLOW_RATIO`] times slower than the other peers (its pending answer counted): the owner
    /// is late for them all, and one store read by the node they all hedge to serves them
    /// without waiting for strikes.
    fn ask_owners(&self, piece: &Piece, peers: Vec<Member>, flight: &Flight) -> Option<Got> {
        let core = self.share.core.get()?.upgrade()?;
        let len = piece.len.unwrap_or(1 << 20);
        let (tx, rx) = mpsc::channel();
        // The node a request waits on (the owner, or a node it redirected to) and since when.
        let launch = |m: Member, hedge: bool| -> Waiting {
            let waiting = Arc::new(Mutex::new((m.id.node.clone(), Instant::now())));
            let (core, tx, piece, on) = (core.clone(), tx.clone(), piece.clone(), waiting.clone());
            std::thread::spawn(move || {
                let t = Instant::now();
                let (node, answer) = match core.ask_peer(&m, &piece, hedge, &on) {
                    Ok((sender, bytes)) => {
                        core.share.peer_answered(&sender, bytes.len(), t.elapsed());
                        (sender, Ok(bytes))
                    }
                    Err((node, kind, reason)) => (node, Err((kind, reason))),
                };
                let _ = tx.send((m, hedge, node, answer, t.elapsed()));
            });
            waiting
        };
        // This node is next in order after the owners asked: [`HEDGE_QUORUM`] applies.
        let next_in_order = peers.len() < OWNERS_ASKED;
        let mut next = peers.into_iter();
        // The owners hedged to and not failed, each with whether a hedge to it is out.
        let mut backups: Vec<(Member, bool)> = Vec::new();
        // The request to the owner asked in full last, the one waited for.
        let mut waited = launch(next.next()?, false);
        let mut in_flight = 1;
        // When the node waited on was asked or last struck, its deadline then (at the pace
        // then: one that shrank with each fast answer would strike peers that are only as
        // slow as everyone was when they were asked), and when the last hedge went out.
        let (mut struck_at, mut hedged_at) = (Instant::now(), Instant::now());
        let mut late = self.share.late_after(len, self.cfg.peer_timeout);
        loop {
            if flight.store_now.load(Ordering::Relaxed) {
                debug!(key = %piece.key, offset = piece.offset,
                    "a peer asked for a piece in full while its owners were asked; reading the store");
                return None;
            }
            let now = Instant::now();
            if in_flight == 0 {
                // Every peer asked failed: the next owner, else the store.
                let m = next.next().or_else(|| backups.pop().map(|(m, _)| m))?;
                waited = launch(m, false);
                in_flight += 1;
                (struck_at, hedged_at) = (now, now);
                late = self.share.late_after(len, self.cfg.peer_timeout);
            }
            let hedge = late.mul_f64(HEDGE_AT);
            // The node waited on: the owner, or a holder it redirected to.
            let (on, asked) = lock(&waited).clone();
            let pending = per_byte(asked.elapsed(), len as usize);
            // Late for this node too: past the point where it would hedge itself.
            if next_in_order
                && asked.elapsed() >= hedge
                && flight.hedge_quorum()
                && self.share.slower_than_others(&on, Some(pending))
            {
                debug!(key = %piece.key, offset = piece.offset, peer = %on,
                    waited_ms = asked.elapsed().as_millis() as u64,
                    "peers hedge for a piece whose owner is much slower than the others; reading the store");
                return None;
            }
            if now >= hedged_at + hedge {
                // The next owner, or again one whose last hedge found nothing.
                let again = backups.iter_mut().find(|(_, out)| !*out);
                let m = match (next.next(), again) {
                    (Some(m), _) => {
                        backups.push((m.clone(), true));
                        Some(m)
                    }
                    (None, Some((m, out))) => {
                        *out = true;
                        Some(m.clone())
                    }
                    (None, None) => None,
                };
                if let Some(m) = m {
                    launch(m, true);
                    in_flight += 1;
                }
                hedged_at = now;
            }
            if now >= struck_at + late {
                self.share.strike(self, &on, pending);
                struck_at = now;
                late = self.share.late_after(len, self.cfg.peer_timeout);
                // Avoided (for this piece or another), it loses this one too. (Looked at only
                // here: a node that avoids peers wrongly, its own cores busy, would otherwise
                // move every piece it waits on to a second store reader at once.)
                if self.share.is_avoided(&on) {
                    match backups.pop().map(|(m, _)| m).or_else(|| next.next()) {
                        Some(m) => {
                            waited = launch(m, false);
                            in_flight += 1;
                        }
                        // This node is next in order (no hedge is out), or every other owner
                        // failed: it reads the store.
                        None if in_flight <= 1 => return None,
                        None => {}
                    }
                }
            }
            let wait = (hedged_at + hedge)
                .min(struck_at + late)
                .saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait.min(STORE_NOW_POLL)) {
                Ok((_, hedged, node, Ok(bytes), took)) => {
                    debug!(peer = %node, key = %piece.key, offset = piece.offset, len = bytes.len(),
                        took_ms = took.as_millis() as u64, deadline_ms = late.as_millis() as u64,
                        hedged, "a peer answered a piece");
                    self.share.answered(&node, bytes.len(), took, took <= late);
                    return Some(Got {
                        bytes,
                        source: PieceSource::Peer,
                        peer: Some(node),
                    });
                }
                Ok((m, _, _, Err(("not_held", _)), _)) => {
                    in_flight -= 1;
                    if let Some((_, out)) = backups.iter_mut().find(|(b, _)| b.id.node == m.id.node)
                    {
                        *out = false;
                    }
                }
                Ok((m, _, node, Err((kind, reason)), _)) => {
                    in_flight -= 1;
                    backups.retain(|(b, _)| b.id.node != m.id.node);
                    if kind == "corrupt" {
                        self.corrupt_peer(&node, piece, &reason);
                    } else {
                        self.metrics.share_peer_failed(&node, kind);
                        debug!(peer = %node, key = %piece.key, %reason, "a peer did not provide a piece");
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    fn read_store(&self, piece: &Piece) -> std::result::Result<Bytes, String> {
        // The store tier's own store, whose requests `/metrics` counts.
        let tier_store = self
            .tiers
            .remote
            .as_ref()
            .filter(|_| self.cfg.store.as_deref() == Some(piece.store.as_str()));
        let store = if let Some(s) = tier_store {
            s.clone()
        } else {
            let mut stores = lock(&self.share.stores);
            match stores.get(&piece.store) {
                Some(s) => s.clone(),
                None => {
                    let s = Store::open(&piece.store).map_err(|e| e.to_string())?;
                    stores.insert(piece.store.clone(), s.clone());
                    s
                }
            }
        };
        let rt = self.share.rt.as_ref().ok_or("shutting down")?;
        let (offset, len, key) = (piece.offset, piece.len, piece.key.as_str());
        rt.block_on(async {
            match len {
                Some(len) => store.get_range(key, offset, len).await,
                None if offset == 0 => store.get(key).await,
                None => store
                    .get(key)
                    .await
                    .map(|b| b.slice((offset as usize).min(b.len())..)),
            }
        })
        .map_err(|e| e.to_string())
    }

    /// Asks `m` (an owner) for `piece`, following its redirects to the nodes that hold it
    /// ([`MAX_HOPS`] at most; a holder that no longer has it sends the asker back to the owner,
    /// which then serves it itself): the bytes, verified, and the node that sent them. A node
    /// redirected to that sends a corrupt piece is avoided, and the owner, not to blame, is
    /// asked again without redirects (rather than the next owner, which would read it from the
    /// store once more). Else the node blamed, the kind of failure (`not_held`, `corrupt`,
    /// `error`) and why.
    ///
    /// A `hedge` asks only for what `m` and the nodes it redirects to hold: [`NOT_HELD`] when
    /// they do not, and `m` reads nothing from the store for it. `waiting` names the node
    /// asked at each hop, for the caller's deadline: a late holder is the one struck, not the
    /// owner that redirected to it.
    fn ask_peer(
        &self,
        m: &Member,
        piece: &Piece,
        hedge: bool,
        waiting: &Waiting,
    ) -> std::result::Result<(String, Bytes), (String, &'static str, String)> {
        let failed = |kind: &'static str, reason: String| -> std::result::Result<_, _> {
            Err((m.id.node.clone(), kind, reason))
        };
        let (mut target, mut cached_only, mut redirect) = (m.clone(), hedge, true);
        for hop in 1..=MAX_HOPS {
            let t = Instant::now();
            *lock(waiting) = (target.id.node.clone(), t);
            // The last node redirected to sends the piece itself: every holder that has sent
            // it three times redirects, so a late asker could otherwise be passed down the
            // tree until it gives up.
            let last = hop == MAX_HOPS;
            let answer = match self.request_piece(&target, piece, cached_only, redirect && !last) {
                Ok(answer) => answer,
                Err(reason) => return failed("error", reason),
            };
            if answer.is_none() && target.id.node != m.id.node {
                debug!(holder = %target.id.node, owner = %m.id.node, offset = piece.offset,
                    took_ms = t.elapsed().as_millis() as u64, "a node redirected to did not hold a piece");
            }
            match answer {
                Some(FromPeer::Bytes(b)) => match verify(piece, &b) {
                    Ok(()) => return Ok((target.id.node, b)),
                    Err(reason) if target.id.node != m.id.node => {
                        self.corrupt_peer(&target.id.node, piece, &reason);
                        (target, cached_only, redirect) = (m.clone(), hedge, false);
                    }
                    Err(reason) => return Err((target.id.node, "corrupt", reason)),
                },
                Some(FromPeer::Redirect(node)) => {
                    let holder = self
                        .members
                        .up()
                        .into_iter()
                        .find(|x| x.id.node == node && !self.share.is_avoided(&node));
                    (target, cached_only, redirect) = match holder {
                        Some(h) => (h, true, true),
                        None if hedge => return failed("not_held", NOT_HELD.into()),
                        None => (m.clone(), false, false),
                    };
                }
                None if hedge => return failed("not_held", NOT_HELD.into()),
                None => (target, cached_only, redirect) = (m.clone(), false, false),
            }
        }
        failed(
            "error",
            format!("more than {MAX_HOPS} hops for a piece of {}", piece.key),
        )
    }

    /// `node` sent a piece that does not match its ids: counted, and avoided for [`AVOID_FOR`].
    fn corrupt_peer(&self, node: &str, piece: &Piece, reason: &str) {
        self.metrics.share_peer_failed(node, "corrupt");
        warn!(peer = %node, key = %piece.key, %reason,
            "a peer sent a piece that does not match its ids; avoiding it");
        self.share.avoid(node, AVOID_FOR);
    }

    /// One request for `piece` to `m`, on a kept connection or a new one.
    fn request_piece(
        &self,
        m: &Member,
        piece: &Piece,
        cached_only: bool,
        redirect: bool,
    ) -> std::result::Result<Option<FromPeer>, String> {
        self.with_client(m, |c| c.piece(piece, cached_only, redirect))
    }

    /// `ask` on a connection to `m`: a kept one, or a new one (also when the peer has closed
    /// the kept one since), kept afterwards for the next request.
    fn with_client<T>(
        &self,
        m: &Member,
        ask: impl Fn(&mut PeerClient) -> crate::error::Result<T>,
    ) -> std::result::Result<T, String> {
        let node = &m.id.node;
        let kept = lock(&self.share.idle).get_mut(node).and_then(Vec::pop);
        let (client, answer) = match kept.map(|mut c| (ask(&mut c), c)) {
            Some((Ok(answer), c)) => (c, answer),
            _ => {
                let mut c = self.connect(m).map_err(|e| e.to_string())?;
                let answer = ask(&mut c).map_err(|e| e.to_string())?;
                (c, answer)
            }
        };
        lock(&self.share.idle)
            .entry(node.clone())
            .or_default()
            .push(client);
        Ok(answer)
    }

    /// The values of the parts of `piece`, a range of a chunk, for a peer that asks
    /// (`super::peer`): from this node's cache, else as the range's owner, read from the store
    /// once (as for [`Core::piece_for_peer`]). Small, so sent at once, with no upload slot.
    pub(crate) fn values_for_peer(&self, piece: &Piece) -> std::result::Result<Bytes, String> {
        piece.check()?;
        if piece.within.is_none() {
            return Err("values are kept only for a range of a chunk".into());
        }
        let cached = lock(&self.share.cache).get(&piece.content_id());
        let bytes = match cached {
            Some(b) => b,
            None => self.piece(piece, true)?.bytes,
        };
        let bytes = self.share.sent(piece, bytes);
        let values = bytes.slice(..split_range(piece, &bytes).0.len());
        self.metrics.served(&piece.artifact, values.len() as u64);
        Ok(values)
    }

    /// The values of the parts of `piece`, a range of a chunk, not yet checked: from this
    /// node's cache, else from the range's owners, in order; this node, when it is one, fetches
    /// the range itself (joining the fetch in flight, if any).
    fn range_values_of(&self, piece: &Piece) -> std::result::Result<Vec<ChainingValue>, String> {
        let id = piece.content_id();
        if let Some(b) = lock(&self.share.cache).get(&id) {
            return Ok(range_values(piece, &b));
        }
        let mut failed = String::from("no owner to ask");
        for owner in self.owners(&id).into_iter().take(OWNERS_ASKED) {
            let Some(m) = owner else {
                return Ok(range_values(piece, &self.piece(piece, false)?.bytes));
            };
            match self.with_client(&m, |c| c.range_values(piece)) {
                Ok(raw) => match parts::from_bytes(&raw) {
                    Some(values) => return Ok(values),
                    None => failed = format!("{} sent malformed values", m.id.node),
                },
                Err(reason) => failed = reason,
            }
        }
        Err(failed)
    }

    /// The values of every part of a chunk `id` shared in `ranges` (in order), gathered from
    /// the ranges' owners at once and checked against `id`: `None` when one could not be had
    /// or they do not make `id` (the ranges are then checked once all are in, [`Core::settle`]).
    fn chunk_values(&self, id: &blake3::Hash, ranges: &[Piece]) -> Option<Vec<ChainingValue>> {
        let got: Vec<_> = std::thread::scope(|s| {
            let asks: Vec<_> = ranges
                .iter()
                .map(|p| s.spawn(move || self.range_values_of(p)))
                .collect();
            asks.into_iter()
                .map(|a| a.join().unwrap_or_else(|_| Err("panicked".into())))
                .collect()
        });
        let mut values = Vec::new();
        for (p, v) in ranges.iter().zip(got) {
            // A peer's values were sized on the wire (`PeerClient::range_values`); too few or
            // too many would not make the id below.
            match v {
                Ok(v) => values.extend(v),
                Err(reason) => {
                    debug!(key = %p.key, offset = p.offset, %reason, "the values of a range could not be had");
                    return None;
                }
            }
        }
        debug!(chunk = %id, "the values of a chunk's ranges are in");
        let len = ranges.iter().filter_map(|p| p.len).sum();
        if parts::root(&values, len) != Some(*id) {
            debug!(chunk = %id, "the values of a chunk's ranges do not make its id");
            return None;
        }
        Some(values)
    }

    /// `piece` (its id `id`) from this node's cache, or, while it is still landing here, once
    /// it has landed and been kept: a node is redirected to as soon as it is sent a piece, and
    /// a range of a chunk is held back until the chunk's values are known. `None` when not
    /// held by `deadline`.
    fn cached_or_landing(
        &self,
        piece: &Piece,
        id: &[u8; 32],
        asker: &str,
        deadline: Instant,
    ) -> Option<Bytes> {
        let flight = lock(&self.share.flights).get(id).cloned();
        if let Some(flight) = flight {
            flight.hedged_by(asker);
            let mut done = lock(&flight.done);
            while done.is_none() {
                let wait = deadline.checked_duration_since(Instant::now())?;
                done = flight
                    .cv
                    .wait_timeout(done, wait)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        let chunk = blake3::Hash::from_hex(&piece.frames.first()?.id).ok();
        let mut early = lock(&self.share.early);
        loop {
            if let Some(b) = lock(&self.share.cache).get(id) {
                return Some(b);
            }
            let held_back = chunk
                .and_then(|c| early.get(c.as_bytes()))
                .is_some_and(|e| e.pending.iter().any(|(p, _)| p.content_id() == *id));
            if !held_back {
                return None;
            }
            let wait = deadline.checked_duration_since(Instant::now())?;
            early = self
                .share
                .early_changed
                .wait_timeout(early, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// What this node sends a peer that asks it for `piece` (`super::peer`): the bytes (from
    /// the cache; else, unless `cached_only`, as the piece's owner, read from the store once)
    /// once one of its [`UPLOADS_PER_PIECE`] upload slots is free. While they are taken, or
    /// once it has been sent that many times, a peer that takes redirects is sent to a node
    /// this one sent the piece to; with none yet, it waits for a slot (at most a quarter of
    /// the peer timeout, then it is served anyway), or for such a node, whichever comes first.
    /// Asked `cached_only` while it is still landing here, it waits for it.
    pub(crate) fn piece_for_peer<'a>(
        &'a self,
        piece: &Piece,
        asker: &str,
        cached_only: bool,
        redirect: bool,
    ) -> ToPeer<'a> {
        if let Err(reason) = piece.check() {
            return ToPeer::Failed(reason);
        }
        let id = piece.content_id();
        // Well within the asker's own timeout, which would otherwise give up on this node.
        let deadline = Instant::now() + self.cfg.peer_timeout / 4;
        let bytes = if cached_only {
            match self.cached_or_landing(piece, &id, asker, deadline) {
                Some(b) => b,
                None => return ToPeer::NotHeld,
            }
        } else {
            match self.piece(piece, true) {
                Ok(g) => g.bytes,
                Err(reason) => return ToPeer::Failed(reason),
            }
        };
        let mut uploads = lock(&self.share.uploads);
        let mut waited = false;
        loop {
            let now = Instant::now();
            let u = uploads.entry(id).or_default();
            match u.route(asker, redirect, waited, now >= deadline) {
                Route::Redirect(node) => return ToPeer::Redirect(node),
                Route::Send => {
                    if waited {
                        debug!(%asker, offset = piece.offset, redirect,
                            "a peer waited for an upload slot");
                    }
                    return ToPeer::Bytes(
                        bytes,
                        UploadSlot {
                            share: &self.share,
                            id,
                            asker: asker.to_string(),
                            started: now,
                        },
                    );
                }
                Route::Wait => {}
            }
            uploads = self
                .share
                .uploads_changed
                .wait_timeout(uploads, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
            waited = true;
        }
    }
}

/// What a peer sent when asked for a piece.
pub(crate) enum FromPeer {
    Bytes(Bytes),
    /// Ask this node instead.
    Redirect(String),
}

/// What to send a peer that asked for a piece.
pub(crate) enum ToPeer<'a> {
    /// The bytes; the slot is given back once they are sent.
    Bytes(Bytes, UploadSlot<'a>),
    Redirect(String),
    /// Asked `cached_only`, and not in the cache.
    NotHeld,
    Failed(String),
}

/// The sends of one piece to peers in progress, and the peers it went to (with the seconds
/// the send took).
#[derive(Default)]
struct Uploads {
    active: usize,
    holders: Vec<(String, f64)>,
    next: usize,
}

/// What a node does with a peer that asks it for a piece.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// Send it the piece: a slot is taken.
    Send,
    /// Send it to this node, which the piece was sent to.
    Redirect(String),
    /// Wait for a slot or a node to send it to.
    Wait,
}

impl Uploads {
    /// How to answer `asker` (`redirect`: it takes redirects; `waited`: it has waited for a
    /// slot; `late`: it has waited long enough to be sent the piece whatever the slots).
    ///
    /// Once the piece was sent to as many nodes as it has slots, or while the slots are taken,
    /// or once the asker has waited, the asker is sent to a node the piece went to: one that
    /// took it about as fast as the fastest (one behind a slow link would pass it on slowly).
    /// A send leaves its slot once the bytes are in the socket's buffer, before they are
    /// through a slow link: slots alone would let a slow node send the piece to everyone.
    fn route(&mut self, asker: &str, redirect: bool, waited: bool, late: bool) -> Route {
        let fastest = self
            .holders
            .iter()
            .map(|h| h.1)
            .fold(f64::INFINITY, f64::min);
        let holders: Vec<&String> = self
            .holders
            .iter()
            .filter(|h| h.0 != asker && h.1 <= 2.0 * fastest)
            .map(|h| &h.0)
            .collect();
        let busy = self.active >= UPLOADS_PER_PIECE;
        let sent_enough = self.holders.len() >= UPLOADS_PER_PIECE;
        if redirect && !holders.is_empty() && (busy || waited || sent_enough) {
            self.next = self.next.wrapping_add(1);
            return Route::Redirect(holders[self.next % holders.len()].clone());
        }
        if !busy || late {
            self.active += 1;
            return Route::Send;
        }
        Route::Wait
    }
}

/// One of a piece's upload slots, taken.
pub(crate) struct UploadSlot<'a> {
    share: &'a Share,
    id: [u8; 32],
    asker: String,
    started: Instant,
}

impl UploadSlot<'_> {
    /// The send finished (`sent`: whole, so the asker now holds the piece).
    pub(crate) fn done(self, sent: bool) {
        let took = self.started.elapsed().as_secs_f64();
        let mut uploads = lock(&self.share.uploads);
        if let Some(u) = uploads.get_mut(&self.id) {
            u.active = u.active.saturating_sub(1);
            if sent && !u.holders.iter().any(|h| h.0 == self.asker) {
                u.holders.push((self.asker.clone(), took));
            }
        }
        drop(uploads);
        self.share.uploads_changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hotstart_proto::share::PieceFrame;

    fn frame(data: &[u8]) -> (String, Vec<u8>) {
        let id = ChunkId::of(data).to_hex();
        (id, zstd::bulk::compress(data, 3).unwrap())
    }

    fn piece(frames: &[(String, Vec<u8>)]) -> (Piece, Vec<u8>) {
        let p = Piece {
            artifact: "env".into(),
            store: "s3://b".into(),
            key: "k".into(),
            offset: 0,
            len: Some(frames.iter().map(|(_, f)| f.len() as u64).sum()),
            frames: frames
                .iter()
                .map(|(id, f)| PieceFrame {
                    id: id.clone(),
                    len: Some(f.len() as u32),
                })
                .collect(),
            raw: false,
            within: None,
        };
        (p, frames.iter().flat_map(|(_, f)| f.clone()).collect())
    }

    #[test]
    fn a_chunk_found_twice_in_a_file_gathers_the_values_of_one_place() {
        // Chunks 0 and 2 hold the same bytes; chunk 1 is whole (not split); asked from the
        // middle of the file on.
        let (a, b) = (blake3::hash(b"a"), blake3::hash(b"b"));
        let hashes = [a, b, a];
        let range = |chunk: u64, within: Option<u64>| Piece {
            artifact: "ckpt".into(),
            store: "s3://b".into(),
            key: "k".into(),
            offset: chunk * 100 + within.unwrap_or(0),
            len: Some(if within.is_some() { 50 } else { 100 }),
            frames: vec![],
            raw: true,
            within,
        };
        let units = [
            (2, range(2, Some(50))),
            (0, range(0, Some(50))),
            (0, range(0, Some(0))),
            (1, range(1, None)),
            (2, range(2, Some(0))),
        ];
        let split = ranges_by_chunk(units.iter().map(|(i, p)| (*i, p)), &hashes);
        let offsets: Vec<(blake3::Hash, Vec<u64>)> = split
            .iter()
            .map(|(id, r)| (*id, r.iter().map(|p| p.offset).collect()))
            .collect();
        assert_eq!(offsets, vec![(a, vec![200, 250])]);
    }

    #[test]
    fn a_range_is_checked_part_by_part_and_its_values_against_its_chunk() {
        const K: usize = parts::PART as usize;
        let chunk = hotstart_testkit::pattern(3 * K + 100, 9);
        let id = blake3::hash(&chunk);
        let range = |at: usize, len: usize| Piece {
            artifact: "ckpt".into(),
            store: "s3://b".into(),
            key: "k".into(),
            offset: at as u64,
            len: Some(len as u64),
            frames: vec![PieceFrame {
                id: id.to_hex().to_string(),
                len: Some(chunk.len() as u32),
            }],
            raw: true,
            within: Some(at as u64),
        };
        let (a, b) = (range(0, 2 * K), range(2 * K, K + 100));
        let (ya, yb) = (
            with_values(0, &chunk[..2 * K]),
            with_values(2 * K as u64, &chunk[2 * K..]),
        );
        verify(&a, &ya).unwrap();
        verify(&b, &yb).unwrap();
        assert_eq!(split_range(&b, &yb).1, &chunk[2 * K..]);
        let values: Vec<ChainingValue> = [(&a, &ya), (&b, &yb)]
            .iter()
            .flat_map(|(p, y)| range_values(p, y))
            .collect();
        assert_eq!(parts::root(&values, chunk.len() as u64), Some(id));
        // A flipped byte fails its part's value, naming the part.
        let mut bad = yb.to_vec();
        bad[2 * 32 + K + 7] ^= 1;
        assert!(verify(&b, &bad).unwrap_err().contains("part 3 of chunk"));
        // Values made up for flipped bytes pass the range and fail the chunk.
        let mut flipped = chunk[2 * K..].to_vec();
        flipped[K + 7] ^= 1;
        let forged = with_values(2 * K as u64, &flipped);
        verify(&b, &forged).unwrap();
        let values: Vec<ChainingValue> = [(&a, &ya), (&b, &forged)]
            .iter()
            .flat_map(|(p, y)| range_values(p, y))
            .collect();
        assert_ne!(parts::root(&values, chunk.len() as u64), Some(id));
        // Values of another place in the chunk fail: a part's value depends on where it is.
        assert!(verify(&b, &with_values(0, &chunk[2 * K..])).is_err());
        assert!(verify(&b, &yb[1..]).unwrap_err().contains("asked for"));
    }

    #[test]
    fn every_frame_is_checked_against_its_id() {
        let (p, data) = piece(&[frame(b"first frame"), frame(&[7u8; 5000])]);
        verify(&p, &data).unwrap();
        for at in [3, data.len() - 2] {
            let mut bad = data.clone();
            bad[at] ^= 1;
            assert!(verify(&p, &bad).is_err(), "flipped byte {at} passed");
        }
        assert!(
            verify(&p, &data[..data.len() - 1])
                .unwrap_err()
                .contains("were asked for")
        );
        // The right bytes under the wrong id.
        let (mut swapped, _) = piece(&[frame(b"first frame"), frame(&[7u8; 5000])]);
        swapped.frames[0].id = ChunkId::of(b"other").to_hex();
        assert!(verify(&swapped, &data).is_err());
    }

    #[test]
    fn the_cache_keeps_the_recently_used_within_its_bytes_and_the_memory_budget() {
        let memory = Memory::new(1 << 20, "me");
        let mut c = Cache::new(4 * 4096);
        let b = |n: usize| Bytes::from(vec![0u8; n]);
        for i in 1..=3 {
            c.insert([i; 32], b(4096), &memory);
        }
        assert!(c.get(&[1; 32]).is_some());
        c.insert([4; 32], b(4096), &memory);
        // Evicts 2, the least recently used.
        assert_eq!(c.insert([5; 32], b(4096), &memory), vec![[2; 32]]);
        assert!(c.get(&[2; 32]).is_none());
        assert!(c.get(&[1; 32]).is_some() && c.get(&[5; 32]).is_some());
        assert!(c.lru.bytes() <= c.cap);
        assert_eq!(memory.stats().used, 4 * 4096, "every piece kept is charged");
        c.insert([6; 32], b(4097), &memory); // over a quarter of the cache: answered, not kept
        assert!(c.get(&[6; 32]).is_none());

        // The memory tier has 2 pages: pieces fit in what is free, evicting older pieces.
        let memory = Memory::new(2 * 4096, "me");
        let mut c = Cache::new(64 * 4096);
        c.insert([1; 32], b(4096), &memory);
        let held = memory.reserve_free(4096).unwrap(); // a shard's page
        assert_eq!(c.insert([2; 32], b(4096), &memory), vec![[1; 32]]);
        assert!(c.holds(&[2; 32]) && memory.reserve_free(1).is_none());
        // A piece that does not fit even with every older one out: answered, not kept, and
        // the older ones stay.
        assert!(c.insert([3; 32], b(2 * 4096), &memory).is_empty());
        assert!(!c.holds(&[3; 32]) && c.holds(&[2; 32]));
        assert_eq!(memory.stats().used, 2 * 4096);
        drop(held);
        assert_eq!(memory.stats().used, 4096);
        drop(c);
        assert_eq!(memory.stats().used, 0);
    }

    #[test]
    fn only_a_peer_much_slower_than_the_others_counts_as_slow() {
        let share = Share::new(1 << 20).unwrap();
        let mib = 1 << 20;
        assert!(!share.slower_than_others("a", None), "unknown");
        share.peer_answered("a", mib, Duration::from_millis(300));
        assert!(
            !share.slower_than_others("a", None),
            "no other peer to compare with"
        );
        // Busy cores: every peer answers late now and then, none stands out.
        for (node, ms) in [("b", 100), ("c", 250), ("d", 150), ("b", 400)] {
            share.peer_answered(node, mib, Duration::from_millis(ms));
        }
        assert!(
            ["a", "b", "c", "d"]
                .iter()
                .all(|n| !share.slower_than_others(n, None))
        );
        // A link at a tenth of the others'.
        for _ in 0..3 {
            share.peer_answered("e", mib, Duration::from_millis(2500));
        }
        assert!(share.slower_than_others("e", None));
        // A peer with no answer in yet, whose first has taken ten times the others' so far.
        assert!(!share.slower_than_others("f", None));
        assert!(share.slower_than_others("f", Some(2.5 / mib as f64)));
        assert!(!share.slower_than_others("f", Some(0.3 / mib as f64)));
        assert!(!share.slower_than_others("a", None));
    }

    #[test]
    fn a_next_owner_counts_each_peer_that_hedges_to_it_once() {
        let flight = Flight::default();
        for asker in ["a", "a", "b", "b"] {
            flight.hedged_by(asker);
        }
        assert!(!flight.hedge_quorum(), "two peers");
        flight.hedged_by("c");
        assert!(flight.hedge_quorum(), "three peers");
        assert!(
            !flight.store_now.load(Ordering::Relaxed),
            "a hedge is not a request in full"
        );
    }

    #[test]
    fn a_small_answer_does_not_stretch_the_deadline_of_a_large_piece() {
        let share = Share::new(1 << 20).unwrap();
        let (range, limit) = (4 << 20, Duration::from_secs(30));
        share.answered("a", range, Duration::from_millis(400), true);
        // A rank's small second chunk: a round trip, not bytes.
        share.answered("b", 184, Duration::from_millis(30), true);
        let deadline = share.late_after(range as u64, limit);
        assert!(
            deadline < Duration::from_secs(3),
            "a 4 MiB range's deadline: {deadline:?}"
        );
        assert!(deadline >= LATE_MIN);
    }

    #[test]
    fn a_piece_sent_to_as_many_nodes_as_it_has_slots_is_passed_on_by_them() {
        let mut u = Uploads::default();
        let send = |u: &mut Uploads, asker: &str| u.route(asker, true, false, false);
        // The first three askers are sent it; the fourth, with every slot taken and no node
        // holding it yet, waits, unless it has waited long enough.
        for asker in ["a", "b", "c"] {
            assert_eq!(send(&mut u, asker), Route::Send);
        }
        assert_eq!(send(&mut u, "d"), Route::Wait);
        assert_eq!(u.route("d", true, true, true), Route::Send);
        u.active = 3;
        // One send is through (its bytes in the socket's buffer): a slot is free, but an asker
        // that has waited for one goes to the node it went to; a new asker takes the slot.
        u.active -= 1;
        u.holders.push(("a".into(), 0.1));
        assert_eq!(u.route("d", true, true, false), Route::Redirect("a".into()));
        assert_eq!(send(&mut u, "e"), Route::Send);
        // Sent three times: every asker that takes redirects is passed on, slots free or
        // not, to a holder about as fast as the fastest and never to itself.
        u.active = 0;
        u.holders.push(("b".into(), 0.15));
        u.holders.push(("slow".into(), 5.0));
        for _ in 0..6 {
            match send(&mut u, "b") {
                Route::Redirect(n) => assert_eq!(n, "a"),
                other => panic!("{other:?}"),
            }
            match send(&mut u, "f") {
                Route::Redirect(n) => assert!(n == "a" || n == "b", "{n}"),
                other => panic!("{other:?}"),
            }
        }
        // One that does not take redirects (its holder did not have it) is sent it.
        assert_eq!(u.route("f", false, false, false), Route::Send);
    }

    #[test]
    fn owners_spread_evenly_and_a_node_leaving_moves_only_its_pieces() {
        let nodes: Vec<String> = (0..8).map(|i| format!("node-{i}")).collect();
        let ids: Vec<[u8; 32]> = (0..8000u32)
            .map(|i| *blake3::hash(&i.to_le_bytes()).as_bytes())
            .collect();
        let mut owned = vec![0usize; nodes.len()];
        for id in &ids {
            owned[rendezvous(id, &nodes)[0]] += 1;
        }
        for n in &owned {
            assert!((800..1200).contains(n), "owners: {owned:?}");
        }
        let fewer: Vec<String> = nodes.iter().filter(|n| *n != "node-3").cloned().collect();
        for id in &ids {
            let before = &nodes[rendezvous(id, &nodes)[0]];
            let after = &fewer[rendezvous(id, &fewer)[0]];
            if before != "node-3" {
                assert_eq!(before, after);
            } else {
                // The next in order takes it over: the node most others agree on.
                assert_eq!(after, &nodes[rendezvous(id, &nodes)[1]]);
            }
        }
    }
}
