//! The staging pool and the parallel copies and checksums done on staged bytes.
//!
//! **Pool.** At most `max_inflight` staging buffers exist at once, each one page-aligned
//! [`AlignedBuf`] (a huge-page-backed memory map for large sizes, so it can be written with
//! `O_DIRECT` and uploaded without another copy). A save takes a [`Slot`] before it copies
//! anything and holds it until every tier has finished with the bytes; dropping the slot hands
//! the buffer back. When every slot is taken, `acquire` blocks (policy `block`) or gives up
//! (policy `skip`). Buffers are reused across saves, so after the first save of a given size
//! staging writes into memory that is already faulted in; a save larger than the biggest free
//! buffer replaces it with a larger one. A buffer still referenced when its slot is dropped
//! (a store client that kept a clone of the bytes) is simply not reused.
//!
//! **Copies.** The file image (header, then every tensor back to back) is cut into `threads`
//! equal byte ranges of the destination; each scoped thread copies the pieces of the source
//! tensors that fall in its range, so one huge tensor is spread over every thread just like many
//! small ones.
//!
//! **Checksums.** The staged file is cut into `chunk_size` chunks; threads take chunk indices
//! from a shared counter and hash them with blake3.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use hotstart_store::uring::AlignedBuf;

/// Staging buffers are sized in multiples of this, so slightly growing saves reuse them.
const SIZE_STEP: usize = 2 << 20;
/// Below this many bytes a copy or hash runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 20;

/// The bounded set of staging buffers shared by every save of an engine.
#[derive(Debug)]
pub(crate) struct Pool {
    state: Mutex<PoolState>,
    freed: Condvar,
    max: usize,
}

#[derive(Debug)]
struct PoolState {
    free: Vec<AlignedBuf>,
    taken: usize,
}

impl Pool {
    pub(crate) fn new(max: usize) -> Arc<Pool> {
        Arc::new(Pool {
            state: Mutex::new(PoolState {
                free: Vec::new(),
                taken: 0,
            }),
            freed: Condvar::new(),
            max: max.max(1),
        })
    }

    /// Slots in use now.
    pub(crate) fn taken(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .taken
    }

    /// A buffer of at least `len` bytes; `None` when all slots are taken and `block` is false.
    pub(crate) fn acquire(self: &Arc<Self>, len: usize, block: bool) -> Option<Slot> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while s.taken >= self.max {
            if !block {
                return None;
            }
            s = self.freed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.taken += 1;
        // The smallest free buffer that is big enough, else the biggest one to replace.
        s.free.sort_by_key(|b| b.len());
        let pick = s
            .free
            .iter()
            .position(|b| b.len() >= len)
            .or_else(|| s.free.len().checked_sub(1));
        let reuse = pick.map(|i| s.free.swap_remove(i));
        drop(s);
        let buf = match reuse {
            Some(b) if b.len() >= len => b,
            _ => AlignedBuf::zeroed(len.max(1).next_multiple_of(SIZE_STEP)),
        };
        Some(Slot {
            pool: self.clone(),
            buf: Some(Arc::new(buf)),
        })
    }

    fn release(&self, buf: Option<AlignedBuf>) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.taken -= 1;
        if let Some(b) = buf {
            s.free.push(b);
        }
        drop(s);
        self.freed.notify_one();
    }
}

/// One staging buffer, lent to one save until dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    pool: Arc<Pool>,
    buf: Option<Arc<AlignedBuf>>,
}

impl Slot {
    /// The buffer for writing: only possible while no tier holds a reference.
    pub(crate) fn buf_mut(&mut self) -> Option<&mut AlignedBuf> {
        self.buf.as_mut().and_then(Arc::get_mut)
    }

    /// A shared reference for the tiers.
    pub(crate) fn shared(&self) -> Option<Arc<AlignedBuf>> {
        self.buf.clone()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let buf = self.buf.take().and_then(|b| Arc::try_unwrap(b).ok());
        self.pool.release(buf);
    }
}

/// Copies `header` and then every source back to back into `dst`, spread over `threads`.
pub(crate) fn copy_parallel(dst: &mut [u8], header: &[u8], sources: &[&[u8]], threads: usize) {
    dst[..header.len()].copy_from_slice(header);
    let data = &mut dst[header.len()..];
    let total: usize = sources.iter().map(|s| s.len()).sum();
    let data = &mut data[..total];
    let threads = if total < PARALLEL_MIN {
        1
    } else {
        threads.max(1)
    };
    let share = total.div_ceil(threads).max(1);
    // Each thread's range of the destination, as a disjoint mutable slice.
    let parts: Vec<(usize, &mut [u8])> = data
        .chunks_mut(share)
        .enumerate()
        .map(|(i, p)| (i * share, p))
        .collect();
    let copy_range = |start: usize, out: &mut [u8]| {
        let end = start + out.len();
        let mut at = 0usize;
        for src in sources {
            let (s0, s1) = (at, at + src.len());
            at = s1;
            if s1 <= start || s0 >= end {
                continue;
            }
            let (a, b) = (s0.max(start), s1.min(end));
            out[a - start..b - start].copy_from_slice(&src[a - s0..b - s0]);
        }
    };
    if parts.len() <= 1 {
        for (start, out) in parts {
            copy_range(start, out);
        }
        return;
    }
    std::thread::scope(|scope| {
        for (start, out) in parts {
            let copy_range = &copy_range;
            scope.spawn(move || copy_range(start, out));
        }
    });
}

/// blake3 of every `chunk_size` chunk of `data`, spread over `threads`.
pub(crate) fn hash_chunks(data: &[u8], chunk_size: usize, threads: usize) -> Vec<blake3::Hash> {
    let chunks: Vec<&[u8]> = data.chunks(chunk_size.max(1)).collect();
    let threads = if data.len() < PARALLEL_MIN {
        1
    } else {
        threads.clamp(1, chunks.len().max(1))
    };
    if threads == 1 {
        return chunks.iter().map(|c| blake3::hash(c)).collect();
    }
    let next = AtomicUsize::new(0);
    let mut out = vec![blake3::Hash::from_bytes([0; 32]); chunks.len()];
    let results = Mutex::new(&mut out);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = chunks.get(i) else { break };
                    let h = blake3::hash(c);
                    results.lock().unwrap_or_else(PoisonError::into_inner)[i] = h;
                }
            });
        }
    });
    out
}

/// Threads to use for copies and hashes when the configuration says 0 (automatic).
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}
