//! The memory tier: committed shards in sealed shared memory, within a byte budget.
//!
//! **Budget.** Every segment the sidecar creates (being staged by a training process, being
//! received from a peer or read back from a tier, or committed) is charged to one budget for
//! as long as the sidecar holds it: a [`Charge`] is taken before the segment exists and given
//! back when it is dropped. Charges are whole pages. The budget is never exceeded: a request
//! that does not fit first evicts, then waits (up to a deadline) for memory that is about to be
//! freed, then is refused with [`Error::Budget`]. A shard it evicted that someone still reads
//! frees its memory when they let go: the request waits for that (a moment, even with no
//! deadline of its own) before it evicts more or gives up.
//!
//! **Recycling.** A training process stages each save into a segment that was prepared ahead
//! (see `super::local`); in the steady state that is the segment of an older step of the same
//! rank, oldest first, taken back from this tier ([`Memory::recycle`]) rather than memory new
//! to both processes, so a save costs only its copy and nothing is allocated. A shard's segment
//! is recycled only when
//! - its step is older than the newest committed step of its rank (never the newest), and older
//!   than the newest step complete for every rank as the sidecar sees it (its memory and disk
//!   and its peers'): a restore would pick that one or a newer one, never this, and a step
//!   that is not complete yet (a rank ahead of the others) may still become the one;
//! - nobody else holds it: no persistence, replication, peer transfer or restore reads it
//!   (the index holds the only reference, checked under the index's lock, so nobody can take
//!   another meanwhile);
//! - it was never handed to another process (a restore seals it for good).
//!
//! A recycled shard leaves the index (the step is no longer served from this node's memory);
//! its charge goes with the segment, so the budget covers it the whole time.
//!
//! **Eviction.** Shards are evicted oldest step first (ties: the one committed first), but the
//! newest committed step of each (job, rank) is never evicted, so every rank this node holds
//! can always be restored from memory at its latest step; except a rank the job no longer has:
//! once the job's newest step held here was saved by fewer ranks (it went on with fewer after
//! a node was lost), the newest step of a rank past them is evicted as any older step. That
//! goes by the newest step held here, complete or not: should the smaller job die before it
//! completes one, a restart that goes back to the bigger job's step reads that rank's shard
//! from a disk or the store instead. Nothing is evicted when evicting
//! everything that may go would still not make room. An evicted shard leaves the index at
//! once; its memory is freed when the last user (a persist, a replication, a restore in
//! progress) lets go of it.
//!
//! **Memory lent out.** What the sidecar keeps only while nothing else needs the memory (the
//! sharing cache's pieces, see `super::share`) is charged to the same budget, and is given back
//! ([`Memory::on_reclaim`]) before any shard is evicted or a request waits.

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use tracing::info;

use crate::error::{Error, Result};
use crate::wire::{Held, ShardInfo};
use blake3::hazmat::ChainingValue;
use hotstart_ckpt::format::Manifest;
use hotstart_ckpt::parts;
use hotstart_proto::shm::{self, Committed, Segment};

/// Charges are rounded up to whole pages of this size.
const PAGE: u64 = 4096;

/// How long a request waits for the memory of shards it evicted while someone still read them
/// (an inventory, a transfer, a restore) before it evicts more or is refused.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// A rank's file of one step.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardKey {
    pub job: String,
    pub rank: u32,
    pub step: u64,
}

impl std::fmt::Display for ShardKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} step {} rank {}", self.job, self.step, self.rank)
    }
}

/// A committed shard: sealed, verified against its manifest, never written again.
#[derive(Debug)]
pub struct Shard {
    pub key: ShardKey,
    pub world_size: u32,
    /// The node whose training process staged it.
    pub origin: String,
    pub manifest: Manifest,
    /// The manifest as written by the engine (what the tiers persist).
    pub manifest_json: String,
    pub seg: Arc<Committed>,
    pub committed: Instant,
    /// Its chunks' part values, for peers that ask for parts of it.
    pub parts: PartValues,
}

/// Every chunk's part chaining values ([`hotstart_ckpt::parts`]) of a shard: empty for a
/// chunk of one part. Made in the pass that hashes its chunks as it comes in (a commit, a
/// replica), or else once, on all cores, when a peer first asks for parts of it (a reader that
/// reshards); kept with it: 32 bytes per 64 KiB.
#[derive(Default)]
pub struct PartValues(OnceLock<Vec<Vec<ChainingValue>>>);

impl PartValues {
    /// Values made on the way in (from the pass that hashed the shard's chunks), every chunk's.
    pub fn made(values: Vec<Vec<ChainingValue>>) -> PartValues {
        PartValues(OnceLock::from(values))
    }
}

impl std::fmt::Debug for PartValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "PartValues(made)"
        } else {
            "PartValues(not yet)"
        })
    }
}

impl Shard {
    /// Chunk `i`'s part values (empty for a chunk of one part), made for every chunk on
    /// first use over `threads` threads unless they came with the shard.
    pub fn part_values(&self, i: usize, threads: usize) -> &[ChainingValue] {
        let all = self.parts.0.get_or_init(|| {
            let started = Instant::now();
            let m = &self.manifest;
            let data = &self.seg.bytes()[..m.file_len as usize];
            let values = hotstart_ckpt::map_chunks(data, m.chunk_size as usize, threads, |c| {
                parts::id_and_values(c).1
            });
            let seconds = started.elapsed().as_secs_f64();
            info!(shard = %self.key, seconds, "part values made");
            values
        });
        all.get(i).map_or(&[], Vec::as_slice)
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        self.manifest.file_len
    }

    /// Never true: a safetensors file has a header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// How an inventory lists it.
    pub fn info(&self) -> ShardInfo {
        ShardInfo {
            job: self.key.job.clone(),
            rank: self.key.rank,
            step: self.key.step,
            world_size: self.world_size,
            len: self.len(),
            origin: self.origin.clone(),
            held: Held::Memory,
        }
    }
}

/// Bytes charged to the budget, given back on drop.
///
/// The memory tier holds the segments that hold the charges, so a charge refers to it weakly:
/// a strong reference would be a cycle, and a stopped sidecar would never free its segments.
#[derive(Debug)]
pub struct Charge {
    mem: Weak<Memory>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let Some(mem) = self.mem.upgrade() else {
            return;
        };
        let mut s = mem.lock();
        s.used -= self.bytes;
        drop(s);
        mem.freed.notify_all();
    }
}

/// What the memory tier holds now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub budget: u64,
    /// Charged now: every segment the sidecar holds.
    pub used: u64,
    /// The most ever charged at once.
    pub peak: u64,
    /// Committed shards staged on this node, and their bytes.
    pub local_shards: u64,
    pub local_bytes: u64,
    /// Replicas held for peers, and their bytes.
    pub replica_shards: u64,
    pub replica_bytes: u64,
    pub evictions: u64,
    pub evicted_bytes: u64,
    /// Requests refused for want of memory.
    pub refusals: u64,
    /// Segments created for training processes to stage into.
    pub created: u64,
    /// Segments of older steps staged into again.
    pub recycled: u64,
}

#[derive(Debug, Default)]
struct State {
    used: u64,
    peak: u64,
    shards: BTreeMap<ShardKey, Arc<Shard>>,
    evictions: u64,
    evicted_bytes: u64,
    refusals: u64,
    created: u64,
    recycled: u64,
}

/// What [`Memory::recycle`] found.
#[derive(Debug)]
pub enum Recycled {
    /// The segment of an older step, to be staged into again.
    Taken(Segment),
    /// A segment that may be recycled later: once what reads it lets go (a persistence, a
    /// replication), or once a newer step is complete.
    Busy,
    /// None that may ever be.
    None,
}

/// Gives back at least the bytes asked for, if it holds them; returns what it gave back.
struct Reclaimer(Box<dyn Fn(u64) -> u64 + Send + Sync>);

impl std::fmt::Debug for Reclaimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reclaimer")
    }
}

/// The memory tier of one sidecar.
#[derive(Debug)]
pub struct Memory {
    budget: u64,
    node: String,
    state: Mutex<State>,
    freed: Condvar,
    reclaimer: OnceLock<Reclaimer>,
}

fn pages(len: u64) -> u64 {
    len.max(1).div_ceil(PAGE).saturating_mul(PAGE)
}

impl Memory {
    /// An empty tier of `budget` bytes on node `node` (shards from elsewhere are replicas).
    pub fn new(budget: u64, node: impl Into<String>) -> Arc<Memory> {
        Arc::new(Memory {
            budget,
            node: node.into(),
            state: Mutex::new(State::default()),
            freed: Condvar::new(),
            reclaimer: OnceLock::new(),
        })
    }

    /// Sets what gives memory back before any shard is evicted: `f(bytes)` frees at least
    /// `bytes` of charges if it holds them (dropping them, without holding this tier's lock)
    /// and returns how many it freed. Set once.
    pub fn on_reclaim(&self, f: impl Fn(u64) -> u64 + Send + Sync + 'static) {
        let _ = self.reclaimer.set(Reclaimer(Box::new(f)));
    }

    /// Bytes of the budget not charged now.
    pub fn free(&self) -> u64 {
        self.budget.saturating_sub(self.lock().used)
    }

    /// Asks the reclaimer for `bytes`; what it freed.
    fn reclaim(&self, bytes: u64) -> u64 {
        self.reclaimer.get().map_or(0, |r| (r.0)(bytes))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Charges `len` bytes (rounded up to pages): evicts what it may, then waits up to `wait`
    /// for memory to be freed; [`Error::Budget`] if it still does not fit.
    pub fn reserve(self: &Arc<Self>, len: u64, wait: Duration, what: &str) -> Result<Charge> {
        let need = pages(len);
        let deadline = Instant::now() + wait;
        // Until when shards just evicted may still be let go of by whoever reads them.
        let mut releasing = None;
        let mut s = self.lock();
        loop {
            if s.used.saturating_add(need) <= self.budget {
                s.used += need;
                s.peak = s.peak.max(s.used);
                return Ok(Charge {
                    mem: Arc::downgrade(self),
                    bytes: need,
                });
            }
            if let Some(left) = releasing
                .map(|r: Instant| r.saturating_duration_since(Instant::now()))
                .filter(|l| !l.is_zero())
            {
                // Evicting more now would take steps the memory about to come back makes room
                // for; refusing would fail a request that fits in a moment.
                s = self
                    .freed
                    .wait_timeout(s, left)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            let short = need.saturating_add(s.used) - self.budget;
            drop(s);
            let reclaimed = self.reclaim(short);
            s = self.lock();
            if reclaimed > 0 {
                continue;
            }
            let short = need.saturating_add(s.used).saturating_sub(self.budget);
            let victims = evict(&mut s, short);
            if !victims.is_empty() {
                // Dropped without the lock: the last reference frees the memory, which takes it.
                drop(s);
                for v in &victims {
                    info!(shard = %v.key, bytes = v.len(), "evicted from memory");
                }
                let read_elsewhere = victims
                    .iter()
                    .any(|v| Arc::strong_count(v) > 1 || Arc::strong_count(&v.seg) > 1);
                drop(victims);
                if read_elsewhere {
                    releasing = Some(Instant::now() + RELEASE_WAIT);
                }
                s = self.lock();
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || need > self.budget {
                s.refusals += 1;
                let reason = if need > self.budget {
                    format!("{what} is larger than the whole budget")
                } else {
                    format!(
                        "{what}: everything left is the newest step of a rank or in use; \
                         raise the memory budget"
                    )
                };
                return Err(Error::Budget {
                    need,
                    used: s.used,
                    budget: self.budget,
                    reason,
                });
            }
            s = self
                .freed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Charges `len` bytes only if they are free now: nothing is evicted or waited for.
    pub fn reserve_free(self: &Arc<Self>, len: u64) -> Option<Charge> {
        let need = pages(len);
        let mut s = self.lock();
        if s.used.saturating_add(need) > self.budget {
            return None;
        }
        s.used += need;
        s.peak = s.peak.max(s.used);
        Some(Charge {
            mem: Arc::downgrade(self),
            bytes: need,
        })
    }

    /// Charges `len` bytes for the next segment of `job`'s `rank` if they are free, or can be
    /// made free at once by evicting other ranks' (and replicas') older steps, oldest first:
    /// that rank's own steps are left alone (they are what it recycles, and hold the step a
    /// restore would pick). Never waits.
    pub fn reserve_sparing(self: &Arc<Self>, len: u64, job: &str, rank: u32) -> Option<Charge> {
        if let Some(c) = self.reserve_free(len) {
            return Some(c);
        }
        let short = pages(len)
            .saturating_add(self.lock().used)
            .saturating_sub(self.budget);
        if self.reclaim(short) > 0
            && let Some(c) = self.reserve_free(len)
        {
            return Some(c);
        }
        let victims = {
            let mut s = self.lock();
            let short = pages(len)
                .saturating_add(s.used)
                .saturating_sub(self.budget);
            evict_but(&mut s, short, Some((job, rank)))
        };
        for v in &victims {
            info!(shard = %v.key, bytes = v.len(), "evicted from memory");
        }
        // Dropped without the lock: the last reference frees the memory, which takes it.
        drop(victims);
        self.reserve_free(len)
    }

    /// Counts a segment created for a training process to stage into.
    pub fn count_created(&self) {
        self.lock().created += 1;
    }

    /// Waits up to `wait` for a charge to be given back (or anything else that frees memory).
    pub fn wait_freed(&self, wait: Duration) {
        let s = self.lock();
        let _ = self.freed.wait_timeout(s, wait);
    }

    /// The segment of an older step of `job`'s `rank`, of about `len` bytes, taken out of the
    /// tier to be staged into again: one older than `complete` (the newest step complete for
    /// every rank, as the sidecar sees it). See the module docs for when one may be.
    pub fn recycle(&self, job: &str, rank: u32, len: usize, complete: Option<u64>) -> Recycled {
        let mut s = self.lock();
        let mine = |k: &ShardKey| k.job == job && k.rank == rank;
        let Some(newest) = s.shards.keys().filter(|k| mine(k)).map(|k| k.step).max() else {
            return Recycled::None;
        };
        // Older steps that may be recycled once nothing holds them and a newer step is complete.
        let later: Vec<&Arc<Shard>> = s
            .shards
            .values()
            .filter(|sh| mine(&sh.key) && sh.key.step < newest)
            .filter(|sh| shm::fits(sh.seg.len(), len) && !sh.seg.is_sealed())
            .collect();
        let free = later
            .iter()
            .filter(|sh| complete.is_some_and(|c| sh.key.step < c))
            .find(|sh| Arc::strong_count(sh) == 1 && Arc::strong_count(&sh.seg) == 1)
            .map(|sh| sh.key.clone());
        let Some(key) = free else {
            return if later.is_empty() {
                Recycled::None
            } else {
                Recycled::Busy
            };
        };
        let Some(shard) = s.shards.remove(&key) else {
            return Recycled::None;
        };
        // Only the index held them, and its lock is held: nobody can have taken another.
        let seg = Arc::into_inner(shard)
            .and_then(|sh| Arc::into_inner(sh.seg))
            .and_then(Committed::recycle);
        match seg {
            Some(seg) => {
                s.recycled += 1;
                info!(shard = %key, "segment recycled for the next save");
                Recycled::Taken(seg)
            }
            None => Recycled::None,
        }
    }

    /// Adds a committed shard (replacing one with the same key); the one replaced.
    pub fn insert(&self, shard: Arc<Shard>) -> Option<Arc<Shard>> {
        self.lock().shards.insert(shard.key.clone(), shard)
    }

    /// Takes the shard under `key` out of the tier.
    pub fn remove(&self, key: &ShardKey) -> Option<Arc<Shard>> {
        self.lock().shards.remove(key)
    }

    /// The shard under `key`, if held.
    pub fn get(&self, key: &ShardKey) -> Option<Arc<Shard>> {
        self.lock().shards.get(key).cloned()
    }

    /// Every shard held (of `job`, when given).
    pub fn shards(&self, job: Option<&str>) -> Vec<Arc<Shard>> {
        self.lock()
            .shards
            .values()
            .filter(|s| job.is_none_or(|j| s.key.job == j))
            .cloned()
            .collect()
    }

    /// What the tier holds now.
    pub fn stats(&self) -> MemoryStats {
        let s = self.lock();
        let mut out = MemoryStats {
            budget: self.budget,
            used: s.used,
            peak: s.peak,
            evictions: s.evictions,
            evicted_bytes: s.evicted_bytes,
            refusals: s.refusals,
            created: s.created,
            recycled: s.recycled,
            ..MemoryStats::default()
        };
        for sh in s.shards.values() {
            if sh.origin == self.node {
                out.local_shards += 1;
                out.local_bytes += sh.len();
            } else {
                out.replica_shards += 1;
                out.replica_bytes += sh.len();
            }
        }
        out
    }
}

/// Takes shards out of the index, oldest step first, until their charges add up to `want`
/// bytes; never the newest step of a (job, rank) that the job's newest step still has. Takes
/// none when all that may go would not add up to `want`.
fn evict(s: &mut State, want: u64) -> Vec<Arc<Shard>> {
    evict_but(s, want, None)
}

/// [`evict`], sparing every shard of `spare`'s (job, rank).
fn evict_but(s: &mut State, want: u64, spare: Option<(&str, u32)>) -> Vec<Arc<Shard>> {
    let mut newest: BTreeMap<(&str, u32), u64> = BTreeMap::new();
    // Per job: its newest step held, and the largest world size that step was saved with.
    let mut world: BTreeMap<&str, (u64, u32)> = BTreeMap::new();
    for sh in s.shards.values() {
        let k = &sh.key;
        let n = newest.entry((k.job.as_str(), k.rank)).or_insert(k.step);
        *n = (*n).max(k.step);
        let w = world
            .entry(k.job.as_str())
            .or_insert((k.step, sh.world_size));
        *w = (*w).max((k.step, sh.world_size));
    }
    // The newest step of a rank is kept, unless the job's newest step has fewer ranks: the job
    // went on without that rank (an elastic restart), and once the smaller job completes a
    // step no restore takes the rank's step any more (see the module docs).
    let kept = |sh: &Shard| {
        let job = sh.key.job.as_str();
        newest.get(&(job, sh.key.rank)) == Some(&sh.key.step)
            && world.get(job).is_none_or(|&(_, w)| sh.key.rank < w)
    };
    let mut candidates: Vec<(u64, Instant, ShardKey)> = s
        .shards
        .values()
        .filter(|sh| !kept(sh))
        .filter(|sh| spare != Some((sh.key.job.as_str(), sh.key.rank)))
        .map(|sh| (sh.key.step, sh.committed, sh.key.clone()))
        .collect();
    candidates.sort();
    let evictable: u64 = candidates
        .iter()
        .filter_map(|(_, _, k)| s.shards.get(k))
        .map(|sh| pages(sh.seg.len() as u64))
        .sum();
    if evictable < want {
        // Evicting would not make room: keep everything, wait for memory in use instead.
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut freed = 0u64;
    for (_, _, key) in candidates {
        if freed >= want {
            break;
        }
        if let Some(sh) = s.shards.remove(&key) {
            let bytes = pages(sh.seg.len() as u64);
            // Memory still in use elsewhere is freed later; count it either way.
            freed += bytes;
            s.evictions += 1;
            s.evicted_bytes += bytes;
            out.push(sh);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use hotstart_ckpt::format::Layout;
    use hotstart_ckpt::{Dtype, Tensor};

    /// A committed shard of `len` bytes (recyclable: not sealed), charged to `mem`.
    pub(crate) fn shard(
        mem: &Arc<Memory>,
        job: &str,
        rank: u32,
        step: u64,
        len: usize,
    ) -> Result<Arc<Shard>> {
        shard_of(mem, job, rank, 2, step, len)
    }

    /// A shard of rank `rank` of a job of `world` ranks.
    fn shard_of(
        mem: &Arc<Memory>,
        job: &str,
        rank: u32,
        world: u32,
        step: u64,
        len: usize,
    ) -> Result<Arc<Shard>> {
        let charge = mem.reserve(len as u64, Duration::ZERO, "test shard")?;
        let t = Tensor::new("w", Dtype::U8, vec![len as u64 - 64], vec![0u8; len - 64]).unwrap();
        let layout = Layout::new(job, step, world, &[t]).unwrap();
        let seg = Segment::create("t", len, Some(Box::new(charge)))
            .unwrap()
            .commit()
            .unwrap();
        let hashes = vec![blake3::hash(b""); layout.file_len.div_ceil(1 << 20) as usize];
        let manifest = Manifest::new(
            job,
            step,
            rank,
            world,
            &layout,
            1 << 20,
            &hashes,
            &Default::default(),
        );
        Ok(Arc::new(Shard {
            key: ShardKey {
                job: job.into(),
                rank,
                step,
            },
            world_size: world,
            origin: if rank == 0 {
                "me".into()
            } else {
                "peer".into()
            },
            manifest_json: String::from_utf8(manifest.to_json()).unwrap(),
            manifest,
            seg: Arc::new(seg),
            committed: Instant::now(),
            parts: Default::default(),
        }))
    }

    fn steps(mem: &Memory, rank: u32) -> Vec<u64> {
        mem.shards(Some("j"))
            .iter()
            .filter(|s| s.key.rank == rank)
            .map(|s| s.key.step)
            .collect()
    }

    #[test]
    fn memory_lent_out_is_given_back_before_any_shard_is_evicted() {
        let mem = Memory::new(4 * 8192, "me");
        mem.insert(shard(&mem, "j", 0, 1, 8192).unwrap());
        mem.insert(shard(&mem, "j", 0, 2, 8192).unwrap());
        // Two pages lent out (as cached pieces are), given back on request, oldest first.
        let lent: Arc<Mutex<Vec<Charge>>> = Arc::new(Mutex::new(
            (0..2).map(|_| mem.reserve_free(8192).unwrap()).collect(),
        ));
        let back = lent.clone();
        mem.on_reclaim(move |want| {
            let mut lent = back.lock().unwrap();
            let mut freed = 0;
            while freed < want && !lent.is_empty() {
                freed += lent.remove(0).bytes;
            }
            freed
        });
        assert_eq!(mem.stats().used, 4 * 8192);
        // One page: one charge lent out goes, step 1 stays.
        let c = mem.reserve(8192, Duration::ZERO, "t").unwrap();
        assert_eq!(
            (lent.lock().unwrap().len(), steps(&mem, 0)),
            (1, vec![1, 2])
        );
        // Two more: the last lent page, then step 1 (the oldest, not the newest) is evicted.
        mem.insert(shard(&mem, "j", 0, 3, 2 * 8192).unwrap());
        assert!(lent.lock().unwrap().is_empty());
        assert_eq!(steps(&mem, 0), vec![2, 3]);
        assert_eq!(mem.stats().used, 4 * 8192);
        // Sparing a rank's own steps, memory lent out is still taken back first.
        drop(c);
        lent.lock().unwrap().push(mem.reserve_free(8192).unwrap());
        let _c = mem.reserve_sparing(8192, "j", 0).unwrap();
        assert!(lent.lock().unwrap().is_empty());
        assert_eq!(steps(&mem, 0), vec![2, 3]);
    }

    #[test]
    fn evicts_oldest_first_never_the_newest_of_a_rank_and_never_exceeds() {
        let mem = Memory::new(5 * 8192, "me");
        for step in 1..=3 {
            mem.insert(shard(&mem, "j", 0, step, 8192).unwrap());
        }
        mem.insert(shard(&mem, "j", 1, 1, 8192).unwrap());
        assert_eq!(mem.stats().used, 4 * 8192);
        // Two more pages: step 1 of rank 0 goes (oldest, not rank 0's newest); rank 1's only
        // step stays although it is as old.
        mem.insert(shard(&mem, "j", 0, 4, 2 * 8192).unwrap());
        assert_eq!(steps(&mem, 0), vec![2, 3, 4]);
        assert_eq!(steps(&mem, 1), vec![1]);
        let st = mem.stats();
        assert_eq!((st.evictions, st.used, st.peak), (1, 5 * 8192, 5 * 8192));
        assert_eq!((st.local_shards, st.replica_shards), (3, 1));
        // Bigger than everything that may go: refused, nothing exceeded.
        let err = shard(&mem, "j", 0, 5, 5 * 8192).unwrap_err().to_string();
        assert!(err.contains("memory budget"), "{err}");
        assert!(mem.stats().peak <= mem.budget());
        assert_eq!(steps(&mem, 0), vec![2, 3, 4], "nothing evicted in vain");
        assert_eq!(steps(&mem, 1), vec![1]);
        assert_eq!(mem.stats().evictions, 1);
        let err = mem
            .reserve(6 * 8192, Duration::ZERO, "huge")
            .unwrap_err()
            .to_string();
        assert!(err.contains("larger than the whole budget"), "{err}");
        assert_eq!(mem.stats().refusals, 2);
    }

    /// A job of 3 ranks goes on with 2: the newest step of its rank 2, which no restore takes
    /// any more, makes room; the newest steps of ranks 0 and 1 (saved by the 2) stay.
    #[test]
    fn a_rank_the_job_went_on_without_is_evicted_though_newest() {
        let mem = Memory::new(5 * 8192, "me");
        for rank in 0..3 {
            mem.insert(shard_of(&mem, "j", rank, 3, 1, 8192).unwrap());
        }
        for rank in 0..2 {
            mem.insert(shard_of(&mem, "j", rank, 2, 2, 8192).unwrap());
        }
        // Step 1 of ranks 0 and 1 go first (older than their newest), then rank 2's.
        mem.insert(shard_of(&mem, "j", 0, 2, 3, 3 * 8192).unwrap());
        assert_eq!(steps(&mem, 0), vec![2, 3]);
        assert_eq!(steps(&mem, 1), vec![2]);
        assert_eq!(steps(&mem, 2), Vec::<u64>::new());
        // While the newest step is the 3 ranks', rank 2's newest stays.
        let mem = Memory::new(4 * 8192, "me");
        for rank in 0..3 {
            mem.insert(shard_of(&mem, "j", rank, 3, 1, 8192).unwrap());
        }
        mem.insert(shard_of(&mem, "j", 0, 3, 2, 8192).unwrap());
        let err = shard_of(&mem, "j", 1, 3, 2, 2 * 8192)
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory budget"), "{err}");
        assert_eq!(steps(&mem, 2), vec![1]);
    }

    #[test]
    fn memory_of_an_evicted_shard_still_being_read_is_waited_for_not_evicted_around() {
        let mem = Memory::new(4 * 8192, "me");
        for step in 1..=4 {
            mem.insert(shard(&mem, "j", 0, step, 8192).unwrap());
        }
        // Someone reads every shard (an inventory, a transfer) while a request with no wait
        // of its own needs one more page: it evicts step 1 only, and gets the page when the
        // reader lets go.
        let read = mem.shards(Some("j"));
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(read);
        });
        let charge = mem.reserve(8192, Duration::ZERO, "replica").unwrap();
        reader.join().unwrap();
        assert_eq!(steps(&mem, 0), vec![2, 3, 4]);
        assert_eq!(mem.stats().evictions, 1);
        drop(charge);
        assert_eq!(mem.stats().used, 3 * 8192);
    }

    fn taken(r: Recycled) -> Segment {
        match r {
            Recycled::Taken(seg) => seg,
            other => panic!("nothing recycled: {other:?}"),
        }
    }

    #[test]
    fn recycles_only_a_step_older_than_the_newest_complete_that_nobody_holds_and_never_sealed() {
        let mem = Memory::new(16 * 8192, "me");
        let s1 = shard(&mem, "j", 0, 1, 8192).unwrap();
        mem.insert(s1.clone());
        // The newest step of its rank: never.
        assert!(matches!(mem.recycle("j", 0, 8000, Some(2)), Recycled::None));
        mem.insert(shard(&mem, "j", 0, 2, 8192).unwrap());
        mem.insert(shard(&mem, "j", 0, 3, 8192).unwrap());
        // Nothing complete, or step 1 complete (the step a restore would pick): not yet.
        assert!(matches!(mem.recycle("j", 0, 8000, None), Recycled::Busy));
        assert!(matches!(mem.recycle("j", 0, 8000, Some(1)), Recycled::Busy));
        // Step 2 complete: step 1 may go, but a reader (a persistence) holds it: later.
        assert!(matches!(mem.recycle("j", 0, 8000, Some(2)), Recycled::Busy));
        drop(s1);
        // Another size: not this one.
        assert!(matches!(
            mem.recycle("j", 0, 3 * 8192, Some(2)),
            Recycled::None
        ));
        let seg = taken(mem.recycle("j", 0, 8000, Some(2)));
        assert_eq!(seg.len(), 8192);
        assert_eq!(
            steps(&mem, 0),
            vec![2, 3],
            "a recycled step leaves the tier"
        );
        let st = mem.stats();
        assert_eq!(
            (st.recycled, st.used),
            (1, 3 * 8192),
            "its charge went with it"
        );
        drop(seg);
        assert_eq!(mem.stats().used, 2 * 8192);

        // Sealed for good (handed to another process): never again.
        let s2 = mem
            .shards(Some("j"))
            .into_iter()
            .find(|s| s.key.step == 2)
            .unwrap();
        s2.seg.seal().unwrap();
        s2.seg.seal().unwrap();
        drop(s2);
        assert!(matches!(mem.recycle("j", 0, 8000, Some(3)), Recycled::None));
        assert_eq!(steps(&mem, 0), vec![2, 3]);
    }

    #[test]
    fn dropping_the_memory_tier_frees_what_it_holds() {
        let mem = Memory::new(4 * 4096, "me");
        mem.insert(shard(&mem, "j", 0, 1, 4096).unwrap());
        let weak = Arc::downgrade(&mem);
        drop(mem);
        assert!(
            weak.upgrade().is_none(),
            "shards keep the memory tier alive"
        );
    }

    #[test]
    fn an_evicted_shard_in_use_is_freed_when_let_go_and_waiters_get_it() {
        let mem = Memory::new(2 * 4096, "me");
        mem.insert(shard(&mem, "j", 0, 1, 4096).unwrap());
        mem.insert(shard(&mem, "j", 0, 2, 4096).unwrap());
        let held = mem.get(&ShardKey {
            job: "j".into(),
            rank: 0,
            step: 1,
        });
        let waiter = {
            let mem = mem.clone();
            std::thread::spawn(move || {
                mem.reserve(4096, Duration::from_secs(30), "waiter")
                    .map(|_| ())
            })
        };
        // The waiter evicts step 1 (not freed: still held here), then waits for memory.
        let deadline = Instant::now() + Duration::from_secs(30);
        while mem.stats().evictions == 0 {
            assert!(Instant::now() < deadline, "the waiter never evicted");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(steps(&mem, 0), vec![2], "step 1 evicted, still in use");
        assert!(!waiter.is_finished(), "no memory was free yet");
        drop(held);
        waiter.join().unwrap().unwrap();
        assert!(mem.stats().peak <= 2 * 4096);
    }
}
