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
//! **Pinning.** With the `cuda` feature, a buffer that receives device tensors is registered as
//! pinned host memory (`cuMemHostRegister`) the first time, and stays registered while it is
//! reused: the registration travels with the buffer in the slot and in the free list. It is
//! undone before the memory is freed: a [`FreeBuf`] drops its registration before its buffer,
//! and a slot whose buffer is still shared when it is dropped unregisters at once.
//!
//! **Copies.** The file image (header, then every tensor back to back) is split into one
//! destination slice per tensor ([`split_image`]). Device tensors' slices go to the GPU's copy
//! engine (`crate::cuda`); host tensors' slices are cut into `threads` equal shares of bytes and
//! each scoped thread copies its share, so one huge tensor is spread over every thread just like
//! many small ones.
//!
//! **Checksums.** The staged file is cut into `chunk_size` chunks; threads take chunk indices
//! from a shared counter and hash them with blake3.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use hotstart_store::uring::AlignedBuf;

use crate::cuda::Pinned;
use crate::tensor::{DevicePtr, Source};

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
    free: Vec<FreeBuf>,
    taken: usize,
}

/// A staging buffer and its pinned-memory registration, if any.
#[derive(Debug)]
struct FreeBuf {
    // Field order matters: fields drop in declaration order, so the registration is undone
    // before the buffer's memory is freed.
    pin: Option<Pinned>,
    buf: AlignedBuf,
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
        s.free.sort_by_key(|b| b.buf.len());
        let pick = s
            .free
            .iter()
            .position(|b| b.buf.len() >= len)
            .or_else(|| s.free.len().checked_sub(1));
        let reuse = pick.map(|i| s.free.swap_remove(i));
        drop(s);
        let FreeBuf { pin, buf } = match reuse {
            Some(b) if b.buf.len() >= len => b,
            // Dropping a too-small buffer unregisters it first (see `FreeBuf`).
            _ => FreeBuf {
                pin: None,
                buf: AlignedBuf::zeroed(len.max(1).next_multiple_of(SIZE_STEP)),
            },
        };
        Some(Slot {
            pool: self.clone(),
            pin,
            buf: Some(Arc::new(buf)),
        })
    }

    fn release(&self, buf: Option<FreeBuf>) {
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
    /// The buffer's pinned-memory registration; dropped (undone) before the buffer is freed.
    pin: Option<Pinned>,
    buf: Option<Arc<AlignedBuf>>,
}

impl Slot {
    /// Whether the buffer is registered as pinned host memory.
    pub(crate) fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// The buffer's address and length, for registering it as pinned memory.
    pub(crate) fn region(&self) -> Option<(*const u8, usize)> {
        self.buf.as_ref().map(|b| (b.as_ptr(), b.len()))
    }

    /// Keeps `pin`, the registration of [`Slot::region`], with the buffer from now on.
    pub(crate) fn set_pin(&mut self, pin: Pinned) {
        self.pin = Some(pin);
    }

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
        let pin = self.pin.take();
        let buf = match self.buf.take().map(Arc::try_unwrap) {
            Some(Ok(buf)) => Some(FreeBuf { pin, buf }),
            // Still shared: not reused, so unregister now, while this reference keeps the memory
            // alive; nothing is copying into it any more.
            Some(Err(shared)) => {
                drop(pin);
                drop(shared);
                None
            }
            None => None,
        };
        self.pool.release(buf);
    }
}

/// Host bytes to copy: a destination slice of the staging buffer and its source.
pub(crate) type HostCopy<'d, 's> = (&'d mut [u8], &'s [u8]);
/// Device bytes to copy: a destination slice of the staging buffer and the device memory.
pub(crate) type DeviceCopy<'d> = (&'d mut [u8], DevicePtr);

/// Writes `header` at the start of `dst` and splits the rest into one slice per source, back to
/// back: host sources become [`HostCopy`]s, device sources [`DeviceCopy`]s.
///
/// `dst` must be at least `header.len()` plus the sources' lengths (the layout's file length).
pub(crate) fn split_image<'d, 's>(
    dst: &'d mut [u8],
    header: &[u8],
    sources: &[Source<'s>],
) -> (Vec<HostCopy<'d, 's>>, Vec<DeviceCopy<'d>>) {
    let (head, mut rest) = dst.split_at_mut(header.len());
    head.copy_from_slice(header);
    let (mut host, mut device) = (Vec::new(), Vec::new());
    for src in sources {
        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(src.len());
        rest = tail;
        match *src {
            Source::Host(bytes) => host.push((piece, bytes)),
            Source::Device(mem) => device.push((piece, mem)),
        }
    }
    (host, device)
}

/// Performs every host copy, spread over `threads` threads in equal shares of bytes.
pub(crate) fn copy_parallel(copies: Vec<HostCopy<'_, '_>>, threads: usize) {
    let total: usize = copies.iter().map(|(d, _)| d.len()).sum();
    let threads = if total < PARALLEL_MIN {
        1
    } else {
        threads.max(1)
    };
    if threads == 1 {
        for (dst, src) in copies {
            dst.copy_from_slice(src);
        }
        return;
    }
    // Cut the copies at every multiple of `share` bytes; group `g` gets bytes
    // `g * share .. (g + 1) * share` of the whole.
    let share = total.div_ceil(threads);
    let mut groups: Vec<Vec<HostCopy<'_, '_>>> = (0..threads).map(|_| Vec::new()).collect();
    let (mut g, mut room) = (0usize, share);
    for (mut dst, mut src) in copies {
        while !dst.is_empty() {
            if room == 0 {
                g = (g + 1).min(threads - 1);
                room = share;
            }
            let n = room.min(dst.len());
            let (d0, d1) = std::mem::take(&mut dst).split_at_mut(n);
            let (s0, s1) = src.split_at(n);
            groups[g].push((d0, s0));
            (dst, src, room) = (d1, s1, room - n);
        }
    }
    std::thread::scope(|scope| {
        for group in groups.into_iter().filter(|g| !g.is_empty()) {
            scope.spawn(move || {
                for (dst, src) in group {
                    dst.copy_from_slice(src);
                }
            });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split of the image, copied over any number of threads, lands each source at its
    /// place and leaves device slices to the caller.
    #[test]
    fn split_and_copy_place_every_byte() {
        let a: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..10u8).collect();
        let c: Vec<u8> = (0..1_500_001u32).map(|i| (i * 7) as u8).collect();
        let dev = DevicePtr {
            ordinal: 0,
            ptr: 0x1000,
            len: 5,
        };
        let sources = [
            Source::Host(&a),
            Source::Device(dev),
            Source::Host(&[]),
            Source::Host(&b),
            Source::Host(&c),
        ];
        let header = b"HEADER!!";
        for threads in [1, 2, 3, 7, 64] {
            let total = header.len() + a.len() + 5 + b.len() + c.len();
            let mut dst = vec![0xEEu8; total + 3];
            let (host, device) = split_image(&mut dst[..total], header, &sources);
            assert_eq!(device.len(), 1);
            assert_eq!(device[0].0.len(), 5);
            assert_eq!(device[0].1, dev);
            copy_parallel(host, threads);
            let mut want = header.to_vec();
            want.extend_from_slice(&a);
            want.extend_from_slice(&[0xEE; 5]);
            want.extend_from_slice(&b);
            want.extend_from_slice(&c);
            want.extend_from_slice(&[0xEE; 3]);
            assert!(dst == want, "{threads} threads");
        }
    }
}
