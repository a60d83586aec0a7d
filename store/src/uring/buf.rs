//! Aligned memory for `O_DIRECT`: [`AlignedBuf`], the buffer pools carved out of one, and the huge
//! page hint for plain `Vec`s.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::{self, NonNull};

use super::ALIGN;

/// [`AlignedBuf`]s of this size and more are memory maps: from one huge page on, so a 2 MiB
/// buffer (a device load's pinned bounce buffer) is one huge page to fault in and pin: in 4 KiB
/// pages, a disk-tier load into device tensors through them ran 1.27x slower on an H200.
const MMAP_THRESHOLD: usize = HUGE_PAGE;
const HUGE_PAGE: usize = 2 << 20;

/// A zero-initialised byte buffer whose start is aligned to [`ALIGN`], usable for `O_DIRECT`.
///
/// Reading into one with [`UringReader::read_at`](super::UringReader::read_at) at an aligned
/// offset needs no bounce copy.
///
/// Buffers of 2 MiB and more are anonymous memory maps, zero-filled by the kernel on first touch,
/// so a multi-GiB buffer costs nothing until it is filled, and backed by transparent huge pages
/// where the system allows: a 1 MiB request into huge pages is a handful of physically contiguous
/// segments instead of 256 scattered 4 KiB pages, which is much cheaper to pin and to send to the
/// device. Smaller buffers come from the global allocator.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// From `mmap` rather than the global allocator.
    mapped: bool,
}

// SAFETY: an AlignedBuf uniquely owns its allocation, like a Vec<u8>; it hands out `&[u8]` only
// through `&self` and `&mut [u8]` only through `&mut self`, so moving or sharing it across threads
// is as safe as for Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: see `Send` above; `&AlignedBuf` only allows reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` zero bytes.
    ///
    /// # Panics
    /// If `len` rounded up to [`ALIGN`] overflows `isize` (as `Vec` does); aborts if memory runs
    /// out.
    pub fn zeroed(len: usize) -> Self {
        if len >= MMAP_THRESHOLD {
            // SAFETY: a new private anonymous mapping at an address of the kernel's choosing; no
            // existing memory is affected.
            let raw = unsafe {
                libc::mmap(
                    ptr::null_mut(),
                    Self::map_len(len),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if raw != libc::MAP_FAILED {
                // SAFETY: advice about the mapping just made, which this buffer owns; it changes no
                // contents, and a failure (no THP support) is harmless.
                unsafe { libc::madvise(raw, Self::map_len(len), libc::MADV_HUGEPAGE) };
                if let Some(ptr) = NonNull::new(raw.cast::<u8>()) {
                    return Self {
                        ptr,
                        len,
                        mapped: true,
                    };
                }
            }
            // Fall back to the allocator, which reports running out of memory.
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least one byte is always allocated).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        Self {
            ptr,
            len,
            mapped: false,
        }
    }

    /// Length in bytes (without creating a slice over the contents).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the buffer as a raw pointer that may be written through, for filling disjoint
    /// parts of one shared buffer from several threads while others read the parts already
    /// filled. Writing through it is only sound where no `&[u8]` or `&mut [u8]` obtained from
    /// this buffer covers the bytes written, for as long as the write lasts; the caller's
    /// synchronisation must order each write before any later read of those bytes.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Mapped length: whole huge pages, which also lets the kernel align the mapping to them.
    fn map_len(len: usize) -> usize {
        len.next_multiple_of(HUGE_PAGE)
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), ALIGN).expect("AlignedBuf length overflows isize")
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to an allocation of at least `len` bytes, all initialised (zeroed at
        // allocation), owned by `self` and alive for the borrow of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; the exclusive borrow of `self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: `ptr..ptr + map_len` is the mapping made in `zeroed`, owned by this buffer and
            // unmapped only here. Nothing useful can be done if unmapping fails.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), Self::map_len(self.len)) };
        } else {
            // SAFETY: `ptr` came from `alloc_zeroed` with this same layout and is freed only here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// `count` buffers of `size` bytes carved out of one [`AlignedBuf`] (so that they share its huge
/// pages). Buffers are reached through raw pointers: the kernel may be reading or writing some of
/// them while another is filled, so no reference ever covers the whole pool.
pub(super) struct Pool {
    mem: AlignedBuf,
    size: usize,
}

impl Pool {
    pub(super) fn new(count: usize, size: usize) -> Self {
        Self {
            mem: AlignedBuf::zeroed(count * size),
            size,
        }
    }

    /// Start of buffer `i`. Creates no reference to the memory.
    pub(super) fn ptr(&self, i: usize) -> *mut u8 {
        self.mem.ptr.as_ptr().wrapping_add(i * self.size)
    }

    /// Buffer `i`, to fill.
    ///
    /// # Safety
    /// `i` must be below the pool's count, and no request in flight may use buffer `i`.
    pub(super) unsafe fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: buffer `i` lies inside the allocation (the caller checks `i`), is initialised
        // (zeroed at allocation), is touched by no request (the caller's promise), and `&mut self`
        // keeps any other reference to it from being made through this pool.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(i), self.size) }
    }
}

/// Asks for transparent huge pages behind a large, still untouched buffer: filling it then takes
/// one page fault per 2 MiB instead of one per 4 KiB, which matters when a multi-GiB file is read
/// into fresh memory. Only a hint; failures are ignored.
pub(super) fn advise_huge_pages(buf: &mut [u8]) {
    if buf.len() < MMAP_THRESHOLD {
        return;
    }
    let addr = buf.as_mut_ptr() as usize;
    let start = addr.next_multiple_of(ALIGN);
    let end = (addr + buf.len()) / ALIGN * ALIGN;
    if end > start {
        let page = buf.as_mut_ptr().wrapping_add(start - addr);
        // SAFETY: MADV_HUGEPAGE changes only the paging policy of whole pages inside `buf`, which
        // is borrowed exclusively; it changes no contents.
        unsafe { libc::madvise(page.cast(), end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_bufs_are_aligned_zeroed_and_writable() {
        // Below and above the mmap threshold, and lengths that are not page multiples.
        for len in [
            0,
            1,
            4095,
            4097,
            MMAP_THRESHOLD - 1,
            MMAP_THRESHOLD,
            MMAP_THRESHOLD + 3,
        ] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.as_ptr() as usize % ALIGN, 0, "len {len}");
            assert!(buf.iter().all(|&b| b == 0), "len {len}: not zeroed");
            buf.fill(0xa5);
            assert!(buf.iter().all(|&b| b == 0xa5), "len {len}");
        }
    }

    #[test]
    fn pool_buffers_are_disjoint_and_aligned() {
        let size = 64 << 10;
        let mut pool = Pool::new(4, size);
        for i in 0..4 {
            assert_eq!(pool.ptr(i) as usize % ALIGN, 0);
            // SAFETY: `i` < 4 and no request uses the pool.
            unsafe { pool.buf_mut(i) }.fill(i as u8 + 1);
        }
        for i in 0..4 {
            // SAFETY: as above.
            let buf = unsafe { pool.buf_mut(i) };
            assert!(buf.iter().all(|&b| b == i as u8 + 1), "buffer {i}");
        }
    }
}
