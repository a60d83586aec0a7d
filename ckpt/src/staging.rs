//! The staging pool and the parallel copies and checksums done on staged bytes.
//!
//! **Pool.** Staging buffers are page-aligned [`AlignedBuf`]s (a huge-page-backed memory map
//! for large sizes, so they can be written with `O_DIRECT` and uploaded without another copy).
//! A save takes a [`Slot`] before it copies anything and holds it until every tier has finished
//! with the bytes; dropping the slot hands the buffer back. The saves in flight bound how many
//! exist (at most `max_inflight`, see `crate::admission`). Buffers are reused across saves, so
//! after the first save of a given size staging writes into memory that is already faulted in;
//! a save larger than the biggest free buffer replaces it with a larger one. A buffer still
//! referenced when its slot is dropped (a store client that kept a clone of the bytes) is
//! simply not reused.
//!
//! **Pinning.** With the `cuda` feature, a buffer that receives device tensors is registered as
//! pinned host memory (`cuMemHostRegister`) the first time, and stays registered while it is
//! reused: the registration travels with the buffer in the slot and in the free list. It is
//! undone before the memory is freed: a [`FreeBuf`] drops its registration before its buffer,
//! and a slot whose buffer is still shared when it is dropped unregisters at once.
//!
//! **Copies.** A save's image ([`Staging`]) is the header, then every tensor back to back. Host
//! bytes are copied in 8 MiB segments of the image, taken in file order by `threads` scoped
//! threads, so one huge tensor is spread over every thread just like many small ones; device
//! tensors' ranges go to the GPU's copy engine (`crate::cuda`) at the same time. The image
//! publishes its longest filled prefix as segments complete (a segment with device bytes once
//! the GPU copies are done), and tiers read that prefix while the rest is copied.
//!
//! **Checksums.** The staged file is cut into `chunk_size` chunks; threads take chunk indices
//! from a shared counter and hash them with blake3.

use hotstart_proto::shm::{Committed, Mapping, ReadOnly};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use hotstart_store::uring::AlignedBuf;

use crate::cuda::{DeviceCopy, Gpu, Pinned};
use crate::error::{Error, Result};
use crate::tensor::Source;

/// Staging buffers are sized in multiples of this, so slightly growing saves reuse them.
const SIZE_STEP: usize = 2 << 20;
/// Below this many bytes a copy or hash runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 20;

/// The staging buffers of an engine, reused from save to save. How many exist at once is
/// bounded by the saves in flight (`crate::save::Admission`): each one holds at most one.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    free: Mutex<Vec<FreeBuf>>,
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
    pub(crate) fn new() -> Arc<Pool> {
        Arc::default()
    }

    /// A buffer of at least `len` bytes: the smallest free one that is big enough, else a new
    /// one that replaces the biggest free one.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> Slot {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.sort_by_key(|b| b.buf.len());
        let pick = free
            .iter()
            .position(|b| b.buf.len() >= len)
            .or_else(|| free.len().checked_sub(1));
        let reuse = pick.map(|i| free.swap_remove(i));
        drop(free);
        let FreeBuf { pin, buf } = match reuse {
            Some(b) if b.buf.len() >= len => b,
            // Dropping a too-small buffer unregisters it first (see `FreeBuf`).
            _ => FreeBuf {
                pin: None,
                buf: AlignedBuf::zeroed(len.max(1).next_multiple_of(SIZE_STEP)),
            },
        };
        Slot {
            pool: self.clone(),
            pin,
            buf: Some(Arc::new(buf)),
        }
    }

    fn release(&self, buf: Option<FreeBuf>) {
        if let Some(b) = buf {
            self.free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(b);
        }
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
    /// Takes the buffer's pinned-memory registration, if any, to be given back with
    /// [`Slot::set_pin`].
    pub(crate) fn take_pin(&mut self) -> Option<Pinned> {
        self.pin.take()
    }

    /// The buffer's address and length, for registering it as pinned memory.
    pub(crate) fn region(&self) -> Option<(*const u8, usize)> {
        self.buf
            .as_ref()
            .map(|b| (b.as_mut_ptr().cast_const(), b.len()))
    }

    /// Keeps `pin`, the registration of [`Slot::region`], with the buffer from now on.
    pub(crate) fn set_pin(&mut self, pin: Pinned) {
        self.pin = Some(pin);
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

/// A staged file: the first `len` bytes of a shared, page-aligned region, complete and never
/// written again.
#[derive(Clone)]
pub struct Staged {
    pub(crate) buf: Arc<dyn Region>,
    pub(crate) len: usize,
}

impl AsRef<[u8]> for Staged {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: a `Staged` is only made from a complete image (`Staging::complete`) or a
        // sealed shared-memory segment: `len` bytes inside the region (checked when the image
        // was made), initialised, and never written again while the region lives, which the
        // `Arc` keeps it doing for this borrow.
        unsafe { std::slice::from_raw_parts(self.buf.ptr(), self.len) }
    }
}

/// Memory a staging image lives in: a pool buffer of this process, or a shared-memory segment
/// of the sidecar mapped into it. Page-aligned (the disk tier writes it with `O_DIRECT`).
///
/// Implementations own `len()` bytes at `ptr()` for as long as they live and never move them;
/// who writes them when is the [`Staging`] image's business. Only this crate implements it
/// (the pool's buffers and the shared-memory segments of [`hotstart_proto::shm`]).
pub trait Region: sealed::Region + Send + Sync + 'static {
    /// The start of the region, valid for reads and writes of `len()` bytes.
    fn ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

pub(crate) mod sealed {
    /// Keeps [`super::Region`] to this crate's own memory.
    pub trait Region {}
}

impl sealed::Region for AlignedBuf {}

impl Region for AlignedBuf {
    fn ptr(&self) -> *mut u8 {
        self.as_mut_ptr()
    }

    fn len(&self) -> usize {
        AlignedBuf::len(self)
    }
}

impl sealed::Region for Mapping {}

impl Region for Mapping {
    fn ptr(&self) -> *mut u8 {
        self.as_ptr()
    }

    fn len(&self) -> usize {
        Mapping::len(self)
    }
}

impl sealed::Region for ReadOnly {}

impl Region for ReadOnly {
    fn ptr(&self) -> *mut u8 {
        self.bytes().as_ptr().cast_mut()
    }

    fn len(&self) -> usize {
        ReadOnly::len(self)
    }
}

impl sealed::Region for Committed {}

impl Region for Committed {
    fn ptr(&self) -> *mut u8 {
        self.bytes().as_ptr().cast_mut()
    }

    fn len(&self) -> usize {
        ReadOnly::len(self)
    }
}

/// Staging fills and publishes the image in segments of this many bytes, in order; each copy
/// thread takes whole segments.
const SEGMENT: usize = 8 << 20;

/// One save's file image while it is staged: the staging threads fill it segment by segment, in
/// file order, and the tiers read the prefix filled so far, so the disk tier writes the first
/// bytes while the last ones are still being copied.
///
/// Nothing ever holds a reference to bytes that are not yet published: each copy writes its
/// exact range through a raw pointer, publication happens under the mutex after the copy, and a
/// reader only ever borrows a published prefix, which is never written again (an image is filled
/// once).
pub struct Staging {
    buf: Arc<dyn Region>,
    len: usize,
    started: AtomicBool,
    fill: Mutex<Fill>,
    changed: Condvar,
}

#[derive(Debug)]
struct Fill {
    /// Per segment: its host bytes (header included) are copied.
    copied: Vec<bool>,
    /// Per segment: it holds device bytes, which land only when the GPU copies finish.
    device: Vec<bool>,
    device_done: bool,
    /// Segments published: a prefix of the image.
    published: usize,
    failed: bool,
}

impl fmt::Debug for Staging {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Staging")
            .field("len", &self.len)
            .field("published_bytes", &self.published_bytes())
            .finish_non_exhaustive()
    }
}

/// Marks an image failed when dropped before it is complete: filling stopped early, by an
/// error or a panic.
pub(crate) struct FailUnlessComplete<'a>(pub(crate) &'a Staging);

impl Drop for FailUnlessComplete<'_> {
    fn drop(&mut self) {
        self.0.fail();
    }
}

impl Staging {
    /// An empty image of `len` bytes over the start of `buf`.
    pub(crate) fn new(buf: Arc<dyn Region>, len: usize) -> Staging {
        assert!(len <= buf.len(), "image of {len} bytes in a smaller buffer");
        let segments = len.div_ceil(SEGMENT);
        Staging {
            buf,
            len,
            started: AtomicBool::new(false),
            fill: Mutex::new(Fill {
                copied: vec![false; segments],
                device: vec![false; segments],
                device_done: true,
                published: 0,
                failed: segments == 0,
            }),
            changed: Condvar::new(),
        }
    }

    /// An image of the first `len` bytes of `buf`, which already hold the whole file and are
    /// never written again (a sealed segment of the sidecar): complete from the start.
    pub(crate) fn filled(buf: Arc<dyn Region>, len: usize) -> Staging {
        let image = Staging::new(buf, len);
        image.started.store(true, Ordering::Release);
        let mut f = image.lock();
        f.copied.fill(true);
        f.published = f.copied.len();
        f.failed = false;
        drop(f);
        image
    }

    /// The file's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the file is empty (never, for a safetensors image).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Everything staged so far, once that is at least the first `end` bytes (or the whole
    /// file); an error if staging failed first. Short of the whole file, the prefix is a
    /// multiple of 8 MiB.
    pub fn prefix(&self, end: usize) -> Result<&[u8]> {
        let want = end.min(self.len);
        let mut f = self.lock();
        let end = loop {
            let published = f.published.saturating_mul(SEGMENT).min(self.len);
            if published >= want {
                break published;
            }
            if f.failed {
                return Err(Self::failure());
            }
            f = self.changed.wait(f).unwrap_or_else(PoisonError::into_inner);
        };
        drop(f);
        // SAFETY: bytes `..end` lie in the buffer (`len <= buf.len()`) and are published: every
        // write to them happened before their publication, which this thread observed under the
        // mutex, and no write to them happens after it (the image is filled once).
        Ok(unsafe { std::slice::from_raw_parts(self.buf.ptr(), end) })
    }

    /// The whole file once staged.
    pub fn complete(&self) -> Result<Staged> {
        self.prefix(self.len)?;
        Ok(Staged {
            buf: self.buf.clone(),
            len: self.len,
        })
    }

    /// Whether staging failed (or was abandoned) before the whole image was published.
    pub fn failed(&self) -> bool {
        self.lock().failed
    }

    fn failure() -> Error {
        Error::Task {
            what: "staging",
            message: "the checkpoint could not be staged".into(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Fill> {
        self.fill.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn published_bytes(&self) -> usize {
        self.lock().published.saturating_mul(SEGMENT).min(self.len)
    }

    /// Marks the image failed unless it is already complete, waking every reader.
    pub(crate) fn fail(&self) {
        let mut f = self.lock();
        if f.published < f.copied.len() {
            f.failed = true;
        }
        drop(f);
        self.changed.notify_all();
    }

    /// Publishes whatever prefix of segments is now complete.
    fn advance(&self, update: impl FnOnce(&mut Fill)) {
        let mut f = self.lock();
        update(&mut f);
        let before = f.published;
        while f.published < f.copied.len()
            && f.copied[f.published]
            && (f.device_done || !f.device[f.published])
        {
            f.published += 1;
        }
        let moved = f.published != before;
        drop(f);
        if moved {
            self.changed.notify_all();
        }
    }

    /// The image's bytes `start..start + len` for writing.
    ///
    /// # Safety
    /// The range must be inside the image, not yet published, and not overlap any other live
    /// slice made by this function.
    #[allow(clippy::mut_from_ref)]
    unsafe fn region_mut(&self, start: usize, len: usize) -> &mut [u8] {
        debug_assert!(start + len <= self.len);
        // SAFETY: in bounds by the caller's contract; exclusive because ranges handed out are
        // disjoint and no reader borrows an unpublished byte.
        unsafe { std::slice::from_raw_parts_mut(self.buf.ptr().add(start), len) }
    }

    /// Fills the image: `header`, then every source back to back (their lengths must add up to
    /// the image's). Host bytes are copied over `threads` threads in segment order; device
    /// sources go to the GPU's copy stream at the same time. Returns once every byte is in
    /// place; on an error or a panic the image is marked failed, so readers never wait forever.
    pub(crate) fn fill(
        &self,
        header: &[u8],
        sources: &[Source<'_>],
        threads: usize,
        gpu: &Gpu,
    ) -> Result<()> {
        if self.started.swap(true, Ordering::AcqRel) {
            return Err(Error::Task {
                what: "staging",
                message: "a staging image is filled only once".into(),
            });
        }
        let guard = FailUnlessComplete(self);
        // Every part of the image at its offset, in file order.
        let mut pieces: Vec<(usize, Source<'_>)> = Vec::with_capacity(sources.len() + 1);
        pieces.push((0, Source::Host(header)));
        let mut end = header.len();
        for &s in sources {
            pieces.push((end, s));
            end += s.len();
        }
        if end != self.len {
            return Err(Error::Task {
                what: "staging",
                message: format!(
                    "{end} bytes of header and tensors for an image of {}",
                    self.len
                ),
            });
        }
        let device: Vec<DeviceCopy<'_>> = pieces
            .iter()
            .filter_map(|&(start, p)| match p {
                Source::Device(d) if d.len > 0 => {
                    // SAFETY: in the image (the lengths add up, checked above); pieces are
                    // disjoint, and host copies below only touch host pieces' bytes.
                    Some((unsafe { self.region_mut(start, d.len) }, d))
                }
                _ => None,
            })
            .collect();
        if !device.is_empty() {
            let mut f = self.lock();
            f.device_done = false;
            for (dst, _) in &device {
                let start = dst.as_ptr() as usize - self.buf.ptr() as usize;
                for k in start / SEGMENT..=(start + dst.len() - 1) / SEGMENT {
                    f.device[k] = true;
                }
            }
        }
        let pending = if device.is_empty() {
            None
        } else {
            Some(gpu.start_d2h(device)?)
        };
        let segments = self.len.div_ceil(SEGMENT);
        let next = AtomicUsize::new(0);
        let copy = || {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= segments {
                    return;
                }
                let (lo, hi) = (k * SEGMENT, ((k + 1) * SEGMENT).min(self.len));
                let first = pieces.partition_point(|(start, p)| start + p.len() <= lo);
                for &(start, piece) in pieces[first..].iter().take_while(|(s, _)| *s < hi) {
                    let Source::Host(src) = piece else { continue };
                    let (a, b) = (lo.max(start), hi.min(start + src.len()));
                    if a < b {
                        // SAFETY: inside the image; segment `k` is taken by this thread alone
                        // and is unpublished until `advance` below; host and device pieces are
                        // disjoint.
                        let dst = unsafe { self.region_mut(a, b - a) };
                        dst.copy_from_slice(&src[a - start..b - start]);
                    }
                }
                self.advance(|f| f.copied[k] = true);
            }
        };
        let threads = if self.len < PARALLEL_MIN {
            1
        } else {
            threads.clamp(1, segments)
        };
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(copy);
            }
            copy();
        });
        if let Some(p) = pending {
            p.wait()?;
            self.advance(|f| f.device_done = true);
        }
        drop(guard);
        Ok(())
    }
}

/// blake3 of every `chunk_size` chunk of `data`, spread over `threads`.
pub fn hash_chunks(data: &[u8], chunk_size: usize, threads: usize) -> Vec<blake3::Hash> {
    map_chunks(data, chunk_size, threads, blake3::hash)
}

/// `f` of every `chunk_size` chunk of `data`, in order, spread over `threads` (one thread
/// for data too small to be worth more).
pub fn map_chunks<T: Send>(
    data: &[u8],
    chunk_size: usize,
    threads: usize,
    f: impl Fn(&[u8]) -> T + Sync,
) -> Vec<T> {
    let chunks: Vec<&[u8]> = data.chunks(chunk_size.max(1)).collect();
    let threads = if data.len() < PARALLEL_MIN {
        1
    } else {
        threads.clamp(1, chunks.len().max(1))
    };
    if threads == 1 {
        return chunks.iter().map(|c| f(c)).collect();
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<T>> = std::iter::repeat_with(|| None).take(chunks.len()).collect();
    let results = Mutex::new(&mut out);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(c) = chunks.get(i) else { break };
                    let v = f(c);
                    results.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(v);
                }
            });
        }
    });
    out.into_iter()
        .map(|v| v.expect("every chunk mapped"))
        .collect()
}

/// Threads to use for copies and hashes when the configuration says 0 (automatic).
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DevicePtr;

    fn image(len: usize) -> Staging {
        Staging::new(Arc::new(AlignedBuf::zeroed(len + 3)), len)
    }

    /// Every source lands at its place over any number of threads, whatever segment
    /// boundaries it crosses, and a reader following the published prefix sees final bytes.
    #[test]
    fn fill_places_every_byte_and_publishes_in_order() {
        let a: Vec<u8> = (0..(SEGMENT + 3_000_000) as u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..10u8).collect();
        let c: Vec<u8> = (0..(2 * SEGMENT + 1) as u32)
            .map(|i| (i * 7) as u8)
            .collect();
        let sources = [
            Source::Host(&a),
            Source::Host(&[]),
            Source::Host(&b),
            Source::Host(&c),
        ];
        let header = b"HEADER!!";
        let mut want = header.to_vec();
        for part in [&a[..], &b, &c] {
            want.extend_from_slice(part);
        }
        for threads in [1, 2, 3, 7] {
            let img = image(want.len());
            std::thread::scope(|scope| {
                let reader = scope.spawn(|| {
                    let mut seen = 0;
                    while seen < want.len() {
                        let got = img.prefix(seen + SEGMENT / 2).unwrap();
                        assert!(got.len() > seen, "the prefix grows");
                        assert!(
                            got.len() == want.len() || got.len().is_multiple_of(SEGMENT),
                            "whole segments until the end"
                        );
                        assert!(got[seen..] == want[seen..got.len()], "bytes {seen}..");
                        seen = got.len();
                    }
                });
                img.fill(header, &sources, threads, &Gpu::new()).unwrap();
                reader.join().unwrap();
            });
            assert!(
                img.complete().unwrap().as_ref() == &want[..],
                "{threads} threads"
            );
            assert!(!img.failed());
            assert!(
                img.fill(header, &sources, threads, &Gpu::new()).is_err(),
                "filled twice"
            );
        }
    }

    /// Lengths that do not add up, or device memory without a GPU, fail the image: readers of
    /// the rest get an error instead of waiting forever.
    #[test]
    fn a_failed_fill_releases_readers() {
        let a = vec![5u8; 3 * SEGMENT];
        let img = image(4 + a.len() + 1);
        let err = img.fill(b"HEAD", &[Source::Host(&a)], 2, &Gpu::new());
        assert!(err.is_err());
        assert!(img.failed());
        assert!(img.prefix(img.len()).is_err());
        assert!(img.complete().is_err());

        let dev = DevicePtr {
            ordinal: 0,
            ptr: 0x1000,
            len: 5,
        };
        let img = image(4 + a.len() + 5);
        std::thread::scope(|scope| {
            let reader = scope.spawn(|| img.prefix(img.len()).map(|_| ()));
            let filled = img.fill(
                b"HEAD",
                &[Source::Host(&a), Source::Device(dev)],
                2,
                &Gpu::new(),
            );
            assert!(filled.is_err(), "no GPU here, or no such device pointer");
            assert!(reader.join().unwrap().is_err());
        });
    }
}
