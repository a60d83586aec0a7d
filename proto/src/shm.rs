//! Shared memory of the memory tier: memfd segments, their mappings, and passing their file
//! descriptors between processes over a Unix socket (`SCM_RIGHTS`).
//!
//! **Life of a segment.** The sidecar creates a [`Segment`] (`memfd_create`, sized, and sealed
//! against shrinking and growing so nobody can pull pages out from under a mapping). One that
//! goes to a training process has its pages allocated up front ([`Segment::allocate`], i.e.
//! `fallocate`), so that a full memory cgroup is an error now rather than a `SIGBUS` in the
//! middle of the training process's copy later. The sidecar sends the descriptor to a training
//! process, which maps it read-write (populated ahead of its save, see the engine's `client` module), stages
//! a checkpoint into it, then unmaps it, closes its descriptor and commits. The sidecar maps
//! it read-only and holds it as [`Committed`]: from then on the sidecar is the only process
//! with a way to reach it, and it never maps it writable.
//!
//! **Recycling instead of a permanent seal.** A committed segment is not sealed against writes
//! (the kernel's `F_SEAL_WRITE` can never be lifted, so a sealed segment could never be staged
//! into again, and every save would pay for memory new to both processes). It is handed out for
//! writing again only through [`Committed::recycle`], which takes it by value: the memory tier
//! calls it once nobody else holds the shard (no persistence, replication or restore reads it)
//! and its step is no longer needed in memory (see the sidecar's memory tier), so no borrow of its bytes
//! can outlive it. When a committed segment's descriptor leaves the sidecar (a restore), it is
//! first sealed for good ([`Committed::seal`]: refused while any process still maps it
//! writable); the receiver checks the seals ([`Sealed::open`]) before it trusts the bytes, and
//! a sealed segment is never recycled. A segment the sidecar fills itself (from a peer's
//! stream, or read back from disk or store) is mapped writable in the sidecar alone with every
//! page allocated and mapped up front ([`Segment::create_to_fill`]: `madvise` on every core
//! rather than a page fault per page), filled in place, and sealed ([`Filling`]).
//!
//! The memory lives as long as any descriptor or mapping of it does, in any process; the
//! sidecar's budget charge ([`Charge`]) lives as long as the sidecar's own
//! segment does, recycled or not.
//!
//! **Huge pages.** Shared memory is backed by 2 MiB pages where the node lets it
//! ([`huge_pages`], the kernel's `shmem_enabled`): with 4 KiB pages every copy into or out of a
//! segment pays a page-table entry (or a page-cache lookup) per 4 KiB, which halves the
//! bandwidth of a restore from memory on a small machine. Every mapping asks for huge pages
//! (`MADV_HUGEPAGE`), which is what `advise` needs; under `advise` a segment's pages are also
//! allocated through such a mapping rather than by `fallocate` (which would allocate small
//! ones).

use std::ffi::CString;
use std::io;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What lives exactly as long as a segment does, whoever holds it: the sidecar's budget charge
/// for the segment's memory, released when the segment is dropped.
pub type Charge = Box<dyn std::any::Any + Send + Sync>;

/// Seals every segment gets at creation.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
/// Seals of a committed segment: its bytes and size are fixed forever.
const SEALED: libc::c_int = SIZE_SEALS | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;

/// How the kernel backs shared memory with transparent huge pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HugePages {
    /// 4 KiB pages only (`never`, `deny`, or no transparent huge pages at all).
    Never,
    /// Huge pages for mappings that ask for them (`advise`).
    Advise,
    /// Huge pages however the memory is allocated (`always`, `within_size`, `force`).
    Always,
}

/// The node's control for transparent huge pages in shared memory.
pub const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The word chosen in a transparent-huge-page control file: `advise` of
/// `always within_size [advise] never`.
pub fn thp_choice(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.split('[').nth(1)?.split(']').next()?.to_owned())
}

/// The node's setting for 2 MiB shared-memory pages: the per-size control where the kernel has
/// one and it does not say `inherit`, else [`SHMEM_ENABLED`].
pub fn huge_pages() -> HugePages {
    let word = thp_choice("/sys/kernel/mm/transparent_hugepage/hugepages-2048kB/shmem_enabled")
        .filter(|w| w != "inherit")
        .or_else(|| thp_choice(SHMEM_ENABLED));
    match word.as_deref() {
        Some("always" | "within_size" | "force") => HugePages::Always,
        Some("advise") => HugePages::Advise,
        _ => HugePages::Never,
    }
}

/// [`SHMEM_ENABLED`] set to another word for the life of the value, then put back: for
/// benchmarks and tests that compare settings (needs root).
#[derive(Debug)]
pub struct ShmemEnabled {
    old: Option<String>,
}

impl ShmemEnabled {
    /// Sets the control to `word` (nothing to do if it is already chosen).
    pub fn set(word: &str) -> io::Result<ShmemEnabled> {
        let old = thp_choice(SHMEM_ENABLED);
        if old.as_deref() == Some(word) {
            return Ok(ShmemEnabled { old: None });
        }
        std::fs::write(SHMEM_ENABLED, word)?;
        Ok(ShmemEnabled { old })
    }
}

impl Drop for ShmemEnabled {
    fn drop(&mut self) {
        if let Some(old) = &self.old {
            let _ = std::fs::write(SHMEM_ENABLED, old);
        }
    }
}

/// Room a segment that training processes stage into has beyond its file, so that a file that
/// grows a little from one save to the next (a longer header at step 10, 100, ...) still fits
/// the segment of an older step.
const SLOT_SLACK: usize = 64 << 10;

/// The size of a segment to stage a file of `len` bytes into: whole pages, with some slack.
pub fn slot_len(len: usize) -> usize {
    (len.max(1) + SLOT_SLACK).next_multiple_of(4096)
}

/// Whether a segment of `have` bytes serves a file of `len` bytes: it holds it, and is not much
/// larger than the segment such a file would get (a sixteenth more at most).
pub fn fits(have: usize, len: usize) -> bool {
    have >= len && have <= slot_len(len) + len / 16
}

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A memfd of fixed size.
#[derive(Debug)]
pub struct Segment {
    fd: OwnedFd,
    len: usize,
    /// The sidecar's budget charge for the memory, released when the segment is dropped.
    _charge: Option<Charge>,
}

impl Segment {
    /// A new segment of `len` bytes (at least 1), sealed against size changes; its pages are
    /// allocated as they are first written. `name` shows in `/proc/<pid>/fd` and
    /// `/proc/<pid>/maps`.
    pub fn create(name: &str, len: usize, charge: Option<Charge>) -> io::Result<Segment> {
        let cname = CString::new(name).map_err(|_| io::Error::other("NUL in segment name"))?;
        // SAFETY: a valid NUL-terminated name; creates a new descriptor this function owns.
        let raw = cvt(unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        } as libc::c_int)?;
        // SAFETY: `raw` is a new descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len.max(1))
            .map_err(|_| io::Error::other("segment larger than off_t"))?;
        // SAFETY: plain system calls on the descriptor just created.
        unsafe {
            cvt(libc::ftruncate(fd.as_raw_fd(), size))?;
            cvt(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS))?;
        }
        Ok(Segment {
            fd,
            len: len.max(1),
            _charge: charge,
        })
    }

    /// A new segment mapped writable in this process, to be filled here (from a peer's stream
    /// or a tier) and then sealed: every page is allocated and mapped now, in huge pages where
    /// the node allows, so the copy that fills it takes no page faults and running out of
    /// memory is an error here.
    pub fn create_to_fill(name: &str, len: usize, charge: Option<Charge>) -> io::Result<Filling> {
        Segment::create_to_fill_ranges(name, len, std::slice::from_ref(&(0..len)), charge)
    }

    /// [`Segment::create_to_fill`] for a segment of which only `ranges` will be filled (the
    /// parts of a shard a reader asked a peer for): only their pages are allocated now, and
    /// the rest stays a hole that costs no memory.
    pub fn create_to_fill_ranges(
        name: &str,
        len: usize,
        ranges: &[Range<usize>],
        charge: Option<Charge>,
    ) -> io::Result<Filling> {
        let seg = Segment::create(name, len, charge)?;
        let map = seg.map_writable()?;
        let ranges = page_ranges(ranges, seg.len);
        if !populate_over(&map, &ranges, populate_threads())? {
            for r in &ranges {
                seg.fallocate(r.clone())?;
            }
        }
        Ok(Filling { seg, map })
    }

    /// Allocates (and zeroes) every page now: an error here, not a `SIGBUS` in whoever writes
    /// the segment later, when memory runs out.
    pub fn allocate(self) -> io::Result<Segment> {
        // Huge pages are allocated only through a mapping that asks for them.
        if huge_pages() == HugePages::Advise && populate(&self.map_writable()?)? {
            return Ok(self);
        }
        self.fallocate(0..self.len)?;
        Ok(self)
    }

    /// Allocates the pages of `range` with `fallocate` (in small pages under `advise`).
    fn fallocate(&self, range: Range<usize>) -> io::Result<()> {
        let off = |n: usize| {
            libc::off_t::try_from(n).map_err(|_| io::Error::other("segment larger than off_t"))
        };
        // SAFETY: fallocate on a descriptor this segment owns.
        cvt(unsafe {
            libc::fallocate(
                self.fd.as_raw_fd(),
                0,
                off(range.start)?,
                off(range.end - range.start)?,
            )
        })?;
        Ok(())
    }

    /// A segment received from the sidecar: its size is read from the descriptor, and it must
    /// be sealed against shrinking (so a mapping of it can never lose its pages).
    pub fn from_fd(fd: OwnedFd) -> io::Result<Segment> {
        let seals = seals(fd.as_fd())?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::other(
                "shared memory segment is not sealed against shrinking",
            ));
        }
        let len = fd_len(fd.as_fd())?;
        Ok(Segment {
            fd,
            len,
            _charge: None,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: segments have at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Maps the whole segment, read-write, shared: what a training process stages into.
    pub fn map_writable(&self) -> io::Result<Mapping> {
        Mapping::new(self.fd.as_fd(), self.len, true)
    }

    /// The same segment through a descriptor of its own that cannot write it, nor map it
    /// writable: what a training process may keep of a segment it hands over.
    pub fn read_only(&self) -> io::Result<Segment> {
        let path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        Ok(Segment {
            fd: std::fs::File::open(&path)?.into(),
            len: self.len,
            _charge: None,
        })
    }

    /// Maps the whole segment read-only, through a descriptor of its own.
    pub fn map_read_only(&self) -> io::Result<ReadOnly> {
        ReadOnly::new(self.read_only()?)
    }

    /// Seals the segment against writes, for good, and maps it read-only. Fails (`EBUSY`) while
    /// any process still has it mapped writable.
    pub fn seal(self) -> io::Result<Sealed> {
        seal_for_good(self.fd.as_fd())?;
        Ok(Sealed(ReadOnly::new(self)?))
    }

    /// A segment a training process has staged into, unmapped and committed: mapped read-only
    /// here and held by the sidecar alone (see the module docs).
    pub fn commit(self) -> io::Result<Committed> {
        Ok(Committed::from_read_only(ReadOnly::new(self)?))
    }
}

/// Adds every seal of a committed segment; fine if they are there already. Fails (`EBUSY`)
/// while any process still has the segment mapped writable.
fn seal_for_good(fd: BorrowedFd<'_>) -> io::Result<()> {
    if seals(fd)? & SEALED == SEALED {
        return Ok(());
    }
    // SAFETY: fcntl on a descriptor the caller owns.
    match cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALED) }) {
        Ok(_) => Ok(()),
        // Sealed by another thread in between (F_SEAL_SEAL refuses more seals).
        Err(_) if seals(fd)? & SEALED == SEALED => Ok(()),
        Err(e) => Err(e),
    }
}

impl AsFd for Segment {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Bytes of a mapping populated at once: threads take such blocks in turn until none is left,
/// so they finish together however fast each one goes.
const POPULATE_BLOCK: usize = 32 << 20;

/// Allocates and maps every page of `map` now, in huge pages where the mapping may have them,
/// over as many threads as the machine has (zeroing fresh memory is the whole cost, and it
/// scales with cores); false where the kernel cannot (before Linux 5.14).
fn populate(map: &Mapping) -> io::Result<bool> {
    populate_over(
        map,
        std::slice::from_ref(&(0..map.len())),
        populate_threads(),
    )
}

fn populate_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// `ranges` (ascending, of a segment of `len` bytes) widened to whole pages and merged where
/// they then meet, as the kernel allocates them.
fn page_ranges(ranges: &[Range<usize>], len: usize) -> Vec<Range<usize>> {
    const PAGE: usize = 4096;
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in ranges.iter().filter(|r| r.start < r.end.min(len)) {
        let (start, end) = (
            r.start / PAGE * PAGE,
            r.end.min(len).next_multiple_of(PAGE).min(len),
        );
        match out.last_mut() {
            Some(last) if start <= last.end => last.end = last.end.max(end),
            _ => out.push(start..end),
        }
    }
    out
}

/// [`populate`] of `ranges` of `map` (page-aligned starts) over `threads` threads.
fn populate_over(map: &Mapping, ranges: &[Range<usize>], threads: usize) -> io::Result<bool> {
    let blocks: Vec<(usize, usize)> = ranges
        .iter()
        .flat_map(|r| {
            let end = r.end.min(map.len());
            (r.start..end)
                .step_by(POPULATE_BLOCK)
                .map(move |at| (at, POPULATE_BLOCK.min(end - at)))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let start = map.as_ptr() as usize;
    let work = || -> io::Result<bool> {
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(at, len)) = blocks.get(i) else {
                return Ok(true);
            };
            let done = populate_range(start + at, len);
            if !matches!(done, Ok(true)) {
                // Nobody goes on after a failure.
                next.store(blocks.len(), Ordering::Relaxed);
                return done;
            }
        }
    };
    std::thread::scope(|s| {
        let others: Vec<_> = (1..threads.min(blocks.len()))
            .map(|_| s.spawn(work))
            .collect();
        others.into_iter().fold(work(), |all, h| {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("populating thread panicked")));
            all.and_then(|a| r.map(|b| a && b))
        })
    })
}

/// [`populate`] for the `len` bytes at `addr`, part of a mapping the caller owns.
fn populate_range(addr: usize, len: usize) -> io::Result<bool> {
    // SAFETY: populating (allocating and zeroing) pages of a mapping the caller owns; no byte
    // changes.
    match cvt(unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) }) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: fcntl F_GET_SEALS reads the descriptor's seals.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) })
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: an all-zero stat is a valid value to be overwritten by fstat.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes into the stat it is given.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

fn fd_len(fd: BorrowedFd<'_>) -> io::Result<usize> {
    usize::try_from(fstat(fd)?.st_size)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| io::Error::other("empty shared memory segment"))
}

/// A shared mapping of a whole segment, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a mapping is plain memory owned by this value; who may write it when is decided by its
// users (`Staging` for a writable one, the seal for a read-only one), as for `AlignedBuf`.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Mapping> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a new shared mapping of `len` bytes of the descriptor at an address of the
        // kernel's choosing; no existing memory is affected. The segment is sealed against
        // shrinking, so every page of the mapping stays backed. Pages are mapped as they are
        // first touched, by whichever threads copy: in parallel, unlike `MAP_POPULATE`.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(raw.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        // SAFETY: advice on the mapping just made. It fails only where the kernel has no
        // transparent huge pages, and then changes nothing.
        unsafe { libc::madvise(raw, len, libc::MADV_HUGEPAGE) };
        Ok(Mapping { ptr, len })
    }
}

impl Mapping {
    /// Makes a writable mapping ready for a copy that must not wait for the kernel: every page
    /// mapped now, from this thread alone (the pages are already allocated, so this only fills
    /// the page tables), and the mapping kept out of child processes (`MADV_DONTFORK`), so
    /// that a process forked during a save never holds the segment writable after its commit.
    /// Returns whether the pages could be mapped ahead (not before Linux 5.14; the copy then
    /// maps them as it goes).
    pub fn prepare_for_writes(&self) -> io::Result<bool> {
        // SAFETY: advice on this mapping, which this value owns; no byte changes.
        cvt(unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.len, libc::MADV_DONTFORK) })?;
        populate_over(self, std::slice::from_ref(&(0..self.len)), 1)
    }

    /// The start of the mapping. Writing through it is up to the caller: only into a writable
    /// mapping, and only where nothing else reads or writes at the same time.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, owned by this value and unmapped only here.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A whole segment mapped read-only: what [`Sealed`] and [`Committed`] have in common.
#[derive(Debug)]
pub struct ReadOnly {
    // Field order: unmap before closing.
    map: Mapping,
    seg: Segment,
    /// Whether [`ReadOnly::read_at`] copies through the mapping (huge pages) or with `pread`.
    copy_mapped: bool,
}

impl ReadOnly {
    /// Maps `seg` through a read-only descriptor of its own: a shared mapping made through a
    /// writable one could be made writable later (`mprotect`), so the kernel would count it as
    /// a writer and refuse to seal the segment while it exists.
    fn new(seg: Segment) -> io::Result<ReadOnly> {
        let path = format!("/proc/self/fd/{}", seg.fd.as_raw_fd());
        let ro = std::fs::File::open(&path)?;
        let map = Mapping::new(ro.as_fd(), seg.len, false)?;
        Ok(ReadOnly {
            map,
            seg,
            copy_mapped: huge_pages() != HugePages::Never,
        })
    }

    /// The whole segment.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping covers `len` bytes, all backed (sealed against shrinking). Nothing
        // writes them while this borrow lives: a `ReadOnly` is either sealed against writes in
        // every process (`Sealed`), or committed, which no other process can reach and which
        // becomes writable again only by being consumed (`Committed::recycle`), which cannot
        // happen while it is borrowed.
        unsafe { std::slice::from_raw_parts(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.seg.len
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Copies the bytes at `offset` into `buf`. Where shared memory has huge pages, from the
    /// mapping (one fault per 2 MiB); otherwise with `pread`, straight from the segment's pages
    /// without a page fault per 4 KiB (a page-cache lookup per 4 KiB instead, which is cheaper).
    /// From the mapping, large pieces are written with streaming stores (`buf` is a restore's
    /// destination, not read again soon: see `memcopy`).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if self.copy_mapped {
            let src = usize::try_from(offset)
                .ok()
                .and_then(|at| self.bytes().get(at..at.checked_add(buf.len())?))
                .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
            crate::memcopy::copy_cold(buf, src);
            return Ok(());
        }
        let mut done = 0;
        while done < buf.len() {
            let at = libc::off_t::try_from(offset + done as u64)
                .map_err(|_| io::Error::other("offset larger than off_t"))?;
            let rest = &mut buf[done..];
            // SAFETY: pread writes at most `rest.len()` bytes into `rest`.
            let n = unsafe {
                libc::pread(
                    self.seg.fd.as_raw_fd(),
                    rest.as_mut_ptr().cast(),
                    rest.len(),
                    at,
                )
            };
            match n {
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                n if n > 0 => done += n as usize,
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

impl AsFd for ReadOnly {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.seg.as_fd()
    }
}

/// A segment sealed against writes and mapped read-only: its bytes never change again.
#[derive(Debug)]
pub struct Sealed(ReadOnly);

impl Sealed {
    /// A sealed segment received from another process: the descriptor must carry every seal of
    /// a committed segment, and be at least `len` bytes.
    pub fn open(fd: OwnedFd, len: usize) -> io::Result<Sealed> {
        let s = seals(fd.as_fd())?;
        if s & SEALED != SEALED {
            return Err(io::Error::other(format!(
                "shared memory segment is not sealed (seals {s:#x})"
            )));
        }
        let seg = Segment::from_fd(fd)?;
        if seg.len < len {
            return Err(io::Error::other(format!(
                "shared memory segment of {} bytes for a {len}-byte file",
                seg.len
            )));
        }
        Ok(Sealed(ReadOnly::new(seg)?))
    }
}

impl std::ops::Deref for Sealed {
    type Target = ReadOnly;

    fn deref(&self) -> &ReadOnly {
        &self.0
    }
}

/// A committed segment in the sidecar's memory tier: mapped read-only, reachable by no other
/// process, and either sealed for good (it was handed out, or filled here) or recyclable.
///
/// It can carry one attachment that lives exactly as long as its mapping ([`Committed::attach`]):
/// a registration of the mapping with a device driver, say, which must go before the mapping
/// does.
pub struct Committed {
    // Field order: the attachment goes before the mapping (and `recycle` drops it first).
    attached: std::sync::OnceLock<Box<dyn std::any::Any + Send + Sync>>,
    ro: ReadOnly,
}

impl std::fmt::Debug for Committed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committed")
            .field("ro", &self.ro)
            .field("attached", &self.attached.get().is_some())
            .finish()
    }
}

impl Committed {
    /// Seals the segment against writes for good, before its descriptor leaves the sidecar:
    /// fails (`EBUSY`) while any process still maps it writable (a training process that
    /// committed without unmapping). Sealing twice is fine.
    pub fn seal(&self) -> io::Result<()> {
        seal_for_good(self.ro.seg.as_fd())
    }

    /// [`Committed::seal`], waiting up to `wait` for writable mappings to go: a training
    /// process that was killed right after it committed still maps the segment until the
    /// kernel has torn its memory down, which can end after its parent reaped it (another
    /// holder of its address space, such as a reader of its `/proc` files, lets go later).
    /// A process that keeps the mapping is still refused (`EBUSY`) once `wait` has passed.
    pub fn seal_within(&self, wait: std::time::Duration) -> io::Result<()> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match self.seal() {
                Err(e)
                    if e.raw_os_error() == Some(libc::EBUSY)
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                done => return done,
            }
        }
    }

    /// Whether the segment is sealed for good (and so never recycled).
    pub fn is_sealed(&self) -> bool {
        seals(self.ro.seg.as_fd()).is_ok_and(|s| s & SEALED == SEALED)
    }

    /// The segment, to be staged into again: `None` once sealed for good.
    pub fn recycle(self) -> Option<Segment> {
        if self.is_sealed() {
            return None;
        }
        let Committed { attached, ro } = self;
        drop(attached);
        let ReadOnly { map, seg, .. } = ro;
        drop(map);
        Some(seg)
    }

    fn from_read_only(ro: ReadOnly) -> Committed {
        Committed {
            attached: std::sync::OnceLock::new(),
            ro,
        }
    }

    /// Attaches `thing` to the mapping: it is dropped just before the mapping is unmapped (or
    /// the segment recycled). False, and `thing` dropped, when something is attached already.
    pub fn attach(&self, thing: Box<dyn std::any::Any + Send + Sync>) -> bool {
        self.attached.set(thing).is_ok()
    }

    /// What is attached, if anything.
    pub fn attached(&self) -> Option<&(dyn std::any::Any + Send + Sync)> {
        self.attached.get().map(|b| &**b)
    }
}

impl From<Sealed> for Committed {
    fn from(s: Sealed) -> Committed {
        Committed::from_read_only(s.0)
    }
}

impl std::ops::Deref for Committed {
    type Target = ReadOnly;

    fn deref(&self) -> &ReadOnly {
        &self.ro
    }
}

/// A new segment mapped writable in this process alone while it is filled (from a peer's stream
/// or a tier), then sealed.
#[derive(Debug)]
pub struct Filling {
    map: Mapping,
    seg: Segment,
}

impl AsMut<[u8]> for Filling {
    fn as_mut(&mut self) -> &mut [u8] {
        self.bytes_mut()
    }
}

impl Filling {
    /// The whole segment, for writing.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping covers `len` bytes; the segment was created by this process and
        // its descriptor never left it, so this is the only mapping, and the exclusive borrow
        // of `self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.map.ptr.as_ptr(), self.map.len) }
    }

    /// Unmaps the writable mapping and seals the segment.
    pub fn seal(self) -> io::Result<Sealed> {
        let Filling { map, seg } = self;
        drop(map);
        seg.seal()
    }
}

/// Sends `data` on `sock`, with `fd` attached to its first byte when given.
pub fn send(sock: &UnixStream, data: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let mut sent = 0;
    let mut fd = fd.map(|f| f.as_raw_fd());
    while sent < data.len() || fd.is_some() {
        let n = send_once(sock.as_raw_fd(), &data[sent..], fd.take())?;
        sent += n;
    }
    Ok(())
}

fn send_once(sock: RawFd, data: &[u8], fd: Option<RawFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // Room for one descriptor, aligned as a cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: the control buffer is `space` bytes (<= 64), aligned for cmsghdr, and
        // msg_controllen says so; CMSG_FIRSTHDR/CMSG_DATA point inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    loop {
        // SAFETY: `msg` points at live buffers described by their lengths.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives into `buf` from `sock`; descriptors that arrive with the bytes are appended to
/// `fds` (close-on-exec). 0 at end of stream.
pub fn recv(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 16];
    loop {
        // SAFETY: an all-zero msghdr is valid; the buffers below outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of_val(&control);
        // SAFETY: `msg` describes live buffers of the lengths given.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: walking the control messages the kernel wrote, within msg_controllen; each
        // SCM_RIGHTS payload is an array of descriptors now owned by this process.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c);
                    let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                    for i in 0..bytes / size_of::<RawFd>() {
                        let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
                c = libc::CMSG_NXTHDR(&msg, c);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(io::Error::other("too many file descriptors in one message"));
        }
        return Ok(n as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_bytes_are_shared_then_sealed_forever() {
        let seg = Segment::create("test", 3 * 4096 + 5, None).unwrap();
        assert_eq!(seg.len(), 3 * 4096 + 5);
        let dup = seg.as_fd().try_clone_to_owned().unwrap();
        let w = seg.map_writable().unwrap();
        // SAFETY: the mapping is ours and nobody else writes it.
        unsafe { std::ptr::write_bytes(w.as_ptr(), 0xAB, w.len()) };
        drop(w);
        let sealed = seg.seal().unwrap();
        assert!(sealed.bytes().iter().all(|&b| b == 0xAB));
        // Nobody can map it writable any more, through any descriptor.
        let other = Segment::from_fd(dup).unwrap();
        assert!(other.map_writable().is_err());
        let reopened = Sealed::open(other.as_fd().try_clone_to_owned().unwrap(), 3 * 4096).unwrap();
        assert_eq!(reopened.bytes(), sealed.bytes());
    }

    #[test]
    fn a_committed_segment_is_sealed_once_its_last_writer_lets_go() {
        let seg = Segment::create("test", 8192, None).unwrap();
        let w = seg.map_writable().unwrap();
        // SAFETY: ours alone.
        unsafe { std::ptr::write_bytes(w.as_ptr(), 3, 8192) };
        let committed = seg.commit().unwrap();
        // A writer that stays: refused once the wait is over.
        let err = committed
            .seal_within(std::time::Duration::from_millis(50))
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
        assert!(!committed.is_sealed());
        // A writer that lets go within the wait (a killed process torn down): sealed.
        let gone = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(w);
        });
        committed
            .seal_within(std::time::Duration::from_secs(10))
            .unwrap();
        gone.join().unwrap();
        assert!(committed.is_sealed());
    }

    /// Reads the first byte of the mapping it was made for when dropped: a read after the
    /// mapping is gone would fault.
    struct LastLook(*const u8, std::sync::Arc<std::sync::atomic::AtomicU8>);

    // SAFETY: only read, in `drop`, while the mapping it points into still exists (the test).
    unsafe impl Send for LastLook {}
    // SAFETY: as for `Send`.
    unsafe impl Sync for LastLook {}

    impl Drop for LastLook {
        fn drop(&mut self) {
            // SAFETY: the attachment is dropped before its mapping is unmapped (the contract
            // under test).
            let b = unsafe { self.0.read_volatile() };
            self.1.store(b, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn an_attachment_goes_before_its_mapping_when_recycled_or_dropped() {
        use std::sync::atomic::{AtomicU8, Ordering};
        for recycle in [true, false] {
            let seg = Segment::create("test", 8192, None).unwrap();
            let w = seg.map_writable().unwrap();
            // SAFETY: ours alone.
            unsafe { std::ptr::write_bytes(w.as_ptr(), 9, 8192) };
            drop(w);
            let committed = seg.commit().unwrap();
            let seen = std::sync::Arc::new(AtomicU8::new(0));
            let look = LastLook(committed.bytes().as_ptr(), seen.clone());
            assert!(committed.attach(Box::new(look)));
            assert!(!committed.attach(Box::new(1u32)), "a second attachment");
            assert!(committed.attached().is_some_and(|a| a.is::<LastLook>()));
            assert_eq!(seen.load(Ordering::SeqCst), 0);
            if recycle {
                let again = committed.recycle().expect("not sealed: recyclable");
                assert_eq!(again.len(), 8192);
            } else {
                drop(committed);
            }
            assert_eq!(seen.load(Ordering::SeqCst), 9, "recycled: {recycle}");
        }
    }

    #[test]
    fn seal_waits_for_writers_and_receivers_check_seals() {
        let seg = Segment::create("test", 8192, None).unwrap();
        let dup = seg.as_fd().try_clone_to_owned().unwrap();
        let w = seg.map_writable().unwrap();
        // SAFETY: ours alone.
        unsafe { std::ptr::write_bytes(w.as_ptr(), 7, 8192) };
        // An unsealed descriptor is refused as a committed segment.
        assert!(Sealed::open(dup.try_clone().unwrap(), 8192).is_err());
        let err = seg.seal().map(|_| ()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBUSY), "{err}");
        let _ = w;
    }

    fn allocated_bytes(fd: BorrowedFd<'_>) -> u64 {
        fstat(fd).unwrap().st_blocks as u64 * 512
    }

    #[test]
    fn ranges_widen_to_pages_and_merge() {
        let r = page_ranges(
            &[5..10, 4000..4097, 9000..9001, 20000..30000, 40000..50000],
            41000,
        );
        assert_eq!(r, vec![0..12288, 16384..32768, 36864..41000]);
        assert!(page_ranges(&[100..100, 50000..60000], 41000).is_empty());
    }

    /// A peer's answer to a resharding reader fills a few ranges of a large shard: only those
    /// are allocated; the rest reads as zeros and costs nothing.
    #[test]
    fn a_segment_filled_in_ranges_allocates_only_them() {
        let len = 64 << 20;
        let ranges = [3 * 4096 + 5..5 * 4096, (32 << 20)..(33 << 20) + 17];
        let mut f = Segment::create_to_fill_ranges("test", len, &ranges, None).unwrap();
        let allocated = allocated_bytes(f.seg.as_fd());
        // Whole pages of each range; at most a huge page around each where the node uses them.
        assert!(allocated >= (1 << 20) + 2 * 4096, "{allocated}");
        assert!(allocated <= 6 << 20, "{allocated} of {len} bytes allocated");
        let bytes = f.bytes_mut();
        for r in &ranges {
            for (i, b) in bytes[r.clone()].iter_mut().enumerate() {
                *b = (i % 251) as u8 + 1;
            }
        }
        let sealed = f.seal().unwrap();
        let got = sealed.bytes();
        for r in &ranges {
            assert!(
                got[r.clone()]
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 251) as u8 + 1)
            );
        }
        assert!(got[..ranges[0].start].iter().all(|&b| b == 0));
        assert!(got[ranges[0].end..ranges[1].start].iter().all(|&b| b == 0));
    }

    #[test]
    fn every_huge_page_setting_allocates_up_front_and_restores_the_same_bytes() {
        // Three blocks to populate, the last a short one.
        let len = 2 * POPULATE_BLOCK + 4096 + 3;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        for word in ["never", "advise", "within_size"] {
            let _setting = match ShmemEnabled::set(word) {
                Ok(s) => s,
                // Only root on a writable /sys may change it (and only where the kernel has
                // transparent huge pages); the node's setting is covered by every other test.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::PermissionDenied
                            | io::ErrorKind::ReadOnlyFilesystem
                            | io::ErrorKind::NotFound
                    ) =>
                {
                    eprintln!("skipped: cannot set {SHMEM_ENABLED} ({e}); needs root");
                    return;
                }
                Err(e) => panic!("set shmem_enabled to {word}: {e}"),
            };
            let want = match word {
                "never" => HugePages::Never,
                "advise" => HugePages::Advise,
                _ => HugePages::Always,
            };
            assert_eq!(huge_pages(), want);
            // Staged into through a mapping, as a training process does.
            let seg = Segment::create("test", len, None)
                .unwrap()
                .allocate()
                .unwrap();
            assert!(allocated_bytes(seg.as_fd()) >= len as u64, "{word}");
            let w = seg.map_writable().unwrap();
            // SAFETY: ours alone, `len` bytes.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), w.as_ptr(), len) };
            drop(w);
            let staged = seg.seal().unwrap();
            // Filled here, as from a peer.
            let mut seg = Segment::create_to_fill("test", len, None).unwrap();
            assert!(allocated_bytes(seg.seg.as_fd()) >= len as u64, "{word}");
            seg.bytes_mut().copy_from_slice(&data);
            let received = seg.seal().unwrap();
            for sealed in [staged, received] {
                assert_eq!(sealed.0.copy_mapped, want != HugePages::Never);
                let mut back = vec![0u8; len - 4099];
                sealed.read_at(4099, &mut back).unwrap();
                assert!(back == data[4099..], "{word}: bytes differ");
                let err = sealed.read_at(len as u64 - 1, &mut [0; 2]).unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{word}");
            }
        }
    }

    #[test]
    fn descriptors_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut fill = Segment::create_to_fill("test", 4096, None).unwrap();
        fill.bytes_mut()[..5].copy_from_slice(b"hello");
        let sealed = fill.seal().unwrap();
        send(&a, b"frame", Some(sealed.as_fd())).unwrap();
        send(&a, b"plain", None).unwrap();
        let mut buf = [0u8; 10];
        let mut fds = Vec::new();
        let mut got = 0;
        while got < 10 {
            got += recv(&b, &mut buf[got..], &mut fds).unwrap();
        }
        assert_eq!(&buf, b"frameplain");
        assert_eq!(fds.len(), 1);
        let other = Sealed::open(fds.pop().unwrap(), 4096).unwrap();
        assert_eq!(&other.bytes()[..5], b"hello");
        assert!(Sealed::open(other.as_fd().try_clone_to_owned().unwrap(), 8192).is_err());
    }
}
