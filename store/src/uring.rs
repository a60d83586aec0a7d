//! Local files written and read through io_uring, with `O_DIRECT` where the file system allows it.
//!
//! Checkpoint shards are multi-GiB files that must reach local disk at device speed and come back
//! just as fast. Both directions keep many large, aligned requests in flight on one io_uring per
//! file, behind a plain blocking API (async callers use `spawn_blocking`).
//!
//! # Writing: [`AtomicFileWriter`]
//!
//! * **Temp file, then rename.** Bytes go to `.<name>.tmp-<pid>-<n>` in the destination's
//!   directory. [`AtomicFileWriter::commit`] makes them durable (`fdatasync`), renames the temp file
//!   onto the final name and fsyncs the directory, so the final name shows the old file or the
//!   complete new one, never a torn one, even across a crash. Dropping the writer without commit
//!   (or [`AtomicFileWriter::abort`]) deletes the temp file.
//! * **Buffer pool.** `queue_depth` buffers of `block_size` bytes, 4096-aligned, carved out of one
//!   [`AlignedBuf`] (a memory map backed by huge pages where allowed, and only paid for where
//!   touched). `write` copies into the current buffer; a full buffer is queued as one
//!   `IORING_OP_WRITE` of block `i` at file offset `i * block_size`, and the next free buffer is
//!   taken. When no buffer is free the writer reaps completions, so up to `queue_depth` writes are
//!   in flight while the caller keeps copying.
//! * **Completions.** A short write is resubmitted for its remainder; a negative result becomes an
//!   error naming the path (and the writer refuses further use); a finished buffer returns to the
//!   pool. Buffers are never freed while the kernel may still touch them: commit, abort and drop
//!   all wait for every write in flight first.
//! * **Alignment and padding.** `O_DIRECT` needs aligned memory, offsets and lengths. Buffers and
//!   full blocks are aligned by construction; the last partial block is zero-padded to 4096 bytes
//!   and the file is cut back to its true length with `ftruncate` before `fdatasync`.
//! * **Preallocation.** In direct mode the file is grown with `fallocate` ahead of the writes (in
//!   steps of 64 MiB to 1 GiB, or exactly with [`AtomicFileWriter::reserve`]), so every write lands
//!   inside the file: ext4 runs direct writes that extend a file one at a time, which would collapse
//!   the queue to a depth of one.
//!
//! # Reading: [`UringReader`]
//!
//! [`UringReader::read_at`] cuts the asked range into requests of at most `block_size` bytes and
//! keeps up to `queue_depth` of them in flight, refilling the queue as each completes. In direct
//! mode the range is widened to 4096-byte boundaries. A request whose bytes all belong to the
//! caller and whose destination is aligned (the caller's buffer and the file offset agree modulo
//! 4096, which always holds for an [`AlignedBuf`] read from an aligned offset) is read straight
//! into the caller's buffer, with no copy. The others (a partial first or last page, or every
//! request when the buffer is misaligned) are read into aligned bounce buffers and the wanted part
//! is copied out (each request slot has its own bounce buffer, from a pool like the writer's).
//! `read_at` never returns, not even with an error, while a request that points into the caller's
//! buffer is in flight.
//!
//! # Falling back to buffered I/O
//!
//! `O_DIRECT` is asked for when [`UringConfig::direct`] is set, and dropped (logged at debug level,
//! reported by `is_direct()`) when the file system refuses it at open (`EINVAL`), when it would
//! only be emulated (tmpfs and ramfs keep the data in the page cache anyway), or when the first
//! direct request of a file fails with `EINVAL`: then `O_DIRECT` is cleared on the open file with
//! `fcntl(F_SETFL)` and the refused requests are resubmitted as buffered I/O.

use std::alloc::{self, Layout};
use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{IoUring, opcode, squeue, types};
use tracing::{debug, error, instrument};

use crate::error::{Error, Result};

/// Alignment of buffers, file offsets and lengths for `O_DIRECT`.
pub const ALIGN: usize = 4096;

const MAX_QUEUE_DEPTH: usize = 4096;
/// [`AlignedBuf`]s of this size and more are memory maps.
const MMAP_THRESHOLD: usize = 4 << 20;
const HUGE_PAGE: usize = 2 << 20;
const MAX_BLOCK_SIZE: usize = 1 << 30;
/// Most memory a writer's pool or a reader's bounce buffers may reserve.
const MAX_POOL: usize = 16 << 30;
/// Preallocation grows the file by its current size, at least this much...
const PREALLOC_MIN_STEP: u64 = 64 << 20;
/// ... and at most this much, at a time.
const PREALLOC_MAX_STEP: u64 = 1 << 30;
/// `statfs.f_type` of file systems whose `O_DIRECT` is only emulated.
const TMPFS_MAGIC: u64 = 0x0102_1994;
const RAMFS_MAGIC: u64 = 0x8584_58f6;

/// How local files are written and read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringConfig {
    /// Requests kept in flight; also the number of buffers in a writer's pool.
    pub queue_depth: usize,
    /// Bytes per request: a non-zero multiple of [`ALIGN`], at most 1 GiB.
    pub block_size: usize,
    /// Bypass the page cache with `O_DIRECT` where the file system supports it.
    pub direct: bool,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            queue_depth: 32,
            block_size: 1 << 20,
            direct: true,
        }
    }
}

impl UringConfig {
    fn check(&self, path: &Path) -> Result<()> {
        let invalid = |reason: String| {
            Error::io(
                "configure io_uring for",
                path,
                io::Error::new(io::ErrorKind::InvalidInput, reason),
            )
        };
        if !(1..=MAX_QUEUE_DEPTH).contains(&self.queue_depth) {
            return Err(invalid(format!(
                "queue_depth {} is not in 1..={MAX_QUEUE_DEPTH}",
                self.queue_depth
            )));
        }
        if self.block_size == 0
            || self.block_size & (ALIGN - 1) != 0
            || self.block_size > MAX_BLOCK_SIZE
        {
            return Err(invalid(format!(
                "block_size {} is not a non-zero multiple of {ALIGN} of at most {MAX_BLOCK_SIZE}",
                self.block_size
            )));
        }
        if self.queue_depth * self.block_size > MAX_POOL {
            return Err(invalid(format!(
                "queue_depth {} x block_size {} is more than {MAX_POOL} bytes of buffers",
                self.queue_depth, self.block_size
            )));
        }
        Ok(())
    }
}

/// A zero-initialised byte buffer whose start is aligned to [`ALIGN`], usable for `O_DIRECT`.
///
/// Reading into one with [`UringReader::read_at`] at an aligned offset needs no bounce copy.
///
/// Buffers of 4 MiB and more are anonymous memory maps, zero-filled by the kernel on first touch,
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
struct Pool {
    mem: AlignedBuf,
    size: usize,
}

impl Pool {
    fn new(count: usize, size: usize) -> Self {
        Self {
            mem: AlignedBuf::zeroed(count * size),
            size,
        }
    }

    /// Start of buffer `i`. Creates no reference to the memory.
    fn ptr(&self, i: usize) -> *mut u8 {
        self.mem.ptr.as_ptr().wrapping_add(i * self.size)
    }

    /// Buffer `i`, to fill.
    ///
    /// # Safety
    /// `i` must be below the pool's count, and no request in flight may use buffer `i`.
    unsafe fn buf_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: buffer `i` lies inside the allocation (the caller checks `i`), is initialised
        // (zeroed at allocation), is touched by no request (the caller's promise), and `&mut self`
        // keeps any other reference to it from being made through this pool.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(i), self.size) }
    }
}

/// One io_uring and the number of its requests the kernel has not completed yet.
struct Ring {
    ring: IoUring,
    in_flight: usize,
}

impl Ring {
    fn new(queue_depth: usize) -> io::Result<Self> {
        let entries = u32::try_from(queue_depth)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "queue depth too large"))?;
        Ok(Self {
            ring: IoUring::new(entries)?,
            in_flight: 0,
        })
    }

    /// Queues one request; [`Ring::submit`] or [`Ring::wait`] hands it to the kernel.
    ///
    /// # Safety
    /// The memory `sqe` points to must stay allocated, and must not be accessed in a way that
    /// conflicts with the request, until its completion has been reaped by [`Ring::wait`].
    unsafe fn push(&mut self, sqe: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: forwarded from this function's contract.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                break;
            }
            // The submission queue is full: hand it to the kernel to make room.
            self.submit()?;
        }
        self.in_flight += 1;
        Ok(())
    }

    fn submit(&mut self) -> io::Result<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if retryable(&e) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Submits what is queued, waits until at least `want` requests have completed, and replaces
    /// the contents of `done` with the `(user_data, result)` of every completion reaped.
    fn wait(&mut self, want: usize, done: &mut Vec<(u64, i32)>) -> io::Result<()> {
        done.clear();
        let want = want.min(self.in_flight);
        let result = loop {
            done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            if done.len() >= want {
                break Ok(());
            }
            match self.ring.submit_and_wait(want - done.len()) {
                Ok(_) => {}
                Err(e) if retryable(&e) => {}
                Err(e) => break Err(e),
            }
        };
        self.in_flight -= done.len();
        result
    }

    /// Waits for every request in flight, discarding their results.
    fn drain(&mut self, done: &mut Vec<(u64, i32)>) -> io::Result<()> {
        while self.in_flight > 0 {
            self.wait(self.in_flight, done)?;
        }
        Ok(())
    }
}

fn retryable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

/// Opens a file with `open(direct)`, asking for `O_DIRECT` when `direct` is set and falling back
/// to buffered I/O where it is refused (`EINVAL`) or only emulated (tmpfs, ramfs). Returns the
/// file and whether it is in direct mode.
fn open_maybe_direct(
    path: &Path,
    direct: bool,
    open: impl Fn(bool) -> io::Result<File>,
) -> io::Result<(File, bool)> {
    if !direct {
        return Ok((open(false)?, false));
    }
    match open(true) {
        Ok(file) if is_memory_fs(&file) => {
            clear_o_direct(&file)?;
            debug!(path = %path.display(), "O_DIRECT is only emulated on tmpfs; using buffered I/O");
            Ok((file, false))
        }
        Ok(file) => Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            debug!(path = %path.display(), "O_DIRECT refused at open; using buffered I/O");
            Ok((open(false)?, false))
        }
        Err(e) => Err(e),
    }
}

/// True when `file` lives on tmpfs or ramfs (or when that cannot be told: then false).
fn is_memory_fs(file: &File) -> bool {
    // SAFETY: `statfs` is a plain C struct for which all-zero bytes are a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable statfs and the descriptor is open for the whole call.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    #[allow(clippy::unnecessary_cast)] // `f_type` is i64, u32 or u64 depending on the target
    let f_type = st.f_type as u64 & 0xffff_ffff;
    f_type == TMPFS_MAGIC || f_type == RAMFS_MAGIC
}

/// Turns `O_DIRECT` off on an open file: later requests are buffered.
fn clear_o_direct(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: F_GETFL reads the status flags of an open descriptor; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: F_SETFL only changes the status flags of an open descriptor; no memory is passed.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Allocates `offset..offset + len` of `file` (mode 0: the file size grows to cover it).
fn fallocate(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let too_big = || io::Error::new(io::ErrorKind::InvalidInput, "preallocation past i64::MAX");
    let offset = libc::off_t::try_from(offset).map_err(|_| too_big())?;
    let len = libc::off_t::try_from(len).map_err(|_| too_big())?;
    loop {
        // SAFETY: fallocate takes an open descriptor and two integers; no memory is passed.
        if unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `.<name>.tmp-<pid>-<n>` next to `path`, unique within this process.
fn temp_path(path: &Path) -> Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let Some(name) = path.file_name() else {
        return Err(Error::io(
            "create",
            path,
            io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"),
        ));
    };
    let mut tmp = OsString::from(".");
    tmp.push(name);
    tmp.push(format!(
        ".tmp-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    Ok(path.with_file_name(tmp))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriterState {
    Open,
    /// A write failed; only drop (or abort) is left.
    Failed,
    Committed,
    Aborted,
}

/// One buffer's write: where it goes and how much of it the kernel has taken.
#[derive(Debug, Clone, Copy, Default)]
struct WriteSlot {
    offset: u64,
    len: usize,
    done: usize,
    /// Submitted while the file was in direct mode.
    direct: bool,
}

/// Writes one file through io_uring under a temporary name and renames it into place on
/// [`commit`](Self::commit). See the [module documentation](self) for the algorithm.
pub struct AtomicFileWriter {
    ring: Ring,
    file: File,
    path: PathBuf,
    tmp_path: PathBuf,
    direct: bool,
    /// A direct write has succeeded, so a later `EINVAL` is an error, not a refusal of `O_DIRECT`.
    direct_proven: bool,
    block_size: usize,
    /// `queue_depth` buffers; buffer `i`'s write is described by `slots[i]`.
    pool: Pool,
    slots: Vec<WriteSlot>,
    /// Buffers neither being filled nor in flight.
    free: Vec<usize>,
    /// The buffer being filled and how many bytes it holds.
    filling: Option<(usize, usize)>,
    /// File offset of the next block.
    next_offset: u64,
    /// Bytes accepted by `write`.
    len: u64,
    /// The file is allocated (and sized) up to here.
    prealloc_to: u64,
    /// Grow the allocation ahead of the writes.
    prealloc: bool,
    state: WriterState,
    done: Vec<(u64, i32)>,
    /// Test hook: report the next completed direct write as refused with `EINVAL`.
    #[cfg(test)]
    inject_einval: bool,
}

impl fmt::Debug for AtomicFileWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AtomicFileWriter")
            .field("path", &self.path)
            .field("tmp_path", &self.tmp_path)
            .field("direct", &self.direct)
            .field("len", &self.len)
            .field("in_flight", &self.ring.in_flight)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl AtomicFileWriter {
    /// Starts writing `path`: creates a temporary file next to it. Nothing appears under `path`
    /// until [`commit`](Self::commit).
    #[instrument(level = "debug", skip_all, fields(path = %path.display()))]
    pub fn create(path: &Path, cfg: &UringConfig) -> Result<Self> {
        cfg.check(path)?;
        let tmp_path = temp_path(path)?;
        let ring =
            Ring::new(cfg.queue_depth).map_err(|e| Error::io("set up io_uring for", path, e))?;
        let opened = open_maybe_direct(&tmp_path, cfg.direct, |direct| {
            let mut opts = OpenOptions::new();
            // Not create_new: a refused O_DIRECT open may already have created the file, and
            // the name is unique to this process.
            opts.write(true).create(true).truncate(true).mode(0o644);
            if direct {
                opts.custom_flags(libc::O_DIRECT);
            }
            opts.open(&tmp_path)
        });
        let (file, direct) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                let _ = fs::remove_file(&tmp_path);
                return Err(Error::io("create", &tmp_path, e));
            }
        };
        debug!(tmp = %tmp_path.display(), direct, "writing");
        Ok(Self {
            ring,
            file,
            path: path.to_path_buf(),
            tmp_path,
            direct,
            direct_proven: false,
            block_size: cfg.block_size,
            pool: Pool::new(cfg.queue_depth, cfg.block_size),
            slots: vec![WriteSlot::default(); cfg.queue_depth],
            free: (0..cfg.queue_depth).rev().collect(),
            filling: None,
            next_offset: 0,
            len: 0,
            prealloc_to: 0,
            prealloc: direct,
            state: WriterState::Open,
            done: Vec::with_capacity(cfg.queue_depth),
            #[cfg(test)]
            inject_einval: false,
        })
    }

    /// The final path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether writes bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Allocates disk space for a file of `total_len` bytes now, so that writes never extend the
    /// file and running out of space shows up before any data is written. A hint: writing more or
    /// fewer bytes is fine.
    pub fn reserve(&mut self, total_len: u64) -> Result<()> {
        self.ensure_open()?;
        let to = if self.direct {
            total_len.next_multiple_of(ALIGN as u64)
        } else {
            total_len
        };
        if to <= self.prealloc_to {
            return Ok(());
        }
        match fallocate(&self.file, self.prealloc_to, to - self.prealloc_to) {
            Ok(()) => {
                self.prealloc_to = to;
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) => Ok(()),
            Err(e) => Err(Error::io("preallocate", &self.tmp_path, e)),
        }
    }

    /// Appends `data`. Returns once it is copied into the pool; full blocks are already on their
    /// way to disk. After an error the writer is unusable: drop it (the temp file is removed).
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        self.ensure_open()?;
        let result = self.write_inner(data);
        if result.is_err() {
            self.state = WriterState::Failed;
        }
        result
    }

    /// Writes the last partial block, waits for every write, `fdatasync`s, renames the temp file
    /// onto the final path and fsyncs the directory. Returns the file's length.
    ///
    /// On error the temp file is removed, unless the rename already happened (then only the
    /// directory fsync failed, and the complete file is in place).
    #[instrument(level = "debug", skip_all, fields(path = %self.path.display(), len = self.len))]
    pub fn commit(mut self) -> Result<u64> {
        self.ensure_open()?;
        let result = self.commit_inner();
        if result.is_err() && self.state == WriterState::Open {
            self.state = WriterState::Failed;
        }
        result
    }

    /// Gives up: waits for the writes in flight and removes the temp file.
    pub fn abort(mut self) -> Result<()> {
        self.drain_in_flight();
        self.state = WriterState::Aborted;
        match fs::remove_file(&self.tmp_path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("remove", &self.tmp_path, e)),
        }
    }

    fn ensure_open(&self) -> Result<()> {
        let state = match self.state {
            WriterState::Open => return Ok(()),
            WriterState::Failed => "failed",
            WriterState::Committed => "committed",
            WriterState::Aborted => "aborted",
        };
        Err(Error::WriterClosed {
            key: self.path.display().to_string(),
            state,
        })
    }

    fn write_inner(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let (idx, filled) = match self.filling {
                Some(filling) => filling,
                None => (self.take_buffer()?, 0),
            };
            let n = (self.block_size - filled).min(data.len());
            // SAFETY: buffer `idx` is the one being filled: taken from `free` or already
            // `filling`, so no request uses it.
            let buf = unsafe { self.pool.buf_mut(idx) };
            buf[filled..filled + n].copy_from_slice(&data[..n]);
            data = &data[n..];
            self.len += n as u64;
            if filled + n == self.block_size {
                self.filling = None;
                self.submit_block(idx, self.block_size)?;
            } else {
                self.filling = Some((idx, filled + n));
            }
        }
        Ok(())
    }

    fn commit_inner(&mut self) -> Result<u64> {
        if let Some((idx, filled)) = self.filling.take() {
            self.submit_block(idx, filled)?;
        }
        while self.ring.in_flight > 0 {
            self.reap(self.ring.in_flight)?;
        }
        // Cuts off the padding of the last block and any preallocation past the end.
        self.file
            .set_len(self.len)
            .map_err(|e| Error::io("truncate", &self.tmp_path, e))?;
        self.file
            .sync_data()
            .map_err(|e| Error::io("fdatasync", &self.tmp_path, e))?;
        fs::rename(&self.tmp_path, &self.path)
            .map_err(|e| Error::io("rename temp file onto", &self.path, e))?;
        self.state = WriterState::Committed;
        File::open(parent_dir(&self.path))
            .and_then(|dir| dir.sync_all())
            .map_err(|e| Error::io("fsync the directory of", &self.path, e))?;
        Ok(self.len)
    }

    /// A buffer to fill: a free one, or else the next one whose write completes.
    fn take_buffer(&mut self) -> Result<usize> {
        loop {
            if let Some(idx) = self.free.pop() {
                return Ok(idx);
            }
            self.reap(1)?;
        }
    }

    /// Sends the first `len` bytes of buffer `idx` to the next block's offset.
    fn submit_block(&mut self, idx: usize, len: usize) -> Result<()> {
        let offset = self.next_offset;
        self.next_offset += self.block_size as u64;
        let len = if self.direct {
            let padded = len.next_multiple_of(ALIGN);
            // SAFETY: buffer `idx` was being filled, so no request uses it yet.
            let buf = unsafe { self.pool.buf_mut(idx) };
            buf[len..padded].fill(0);
            padded
        } else {
            len
        };
        self.preallocate_for(offset, offset + len as u64);
        self.slots[idx] = WriteSlot {
            offset,
            len,
            done: 0,
            direct: self.direct,
        };
        self.push_write(idx)
    }

    /// Queues and submits the rest of slot `idx`'s write.
    fn push_write(&mut self, idx: usize) -> Result<()> {
        let slot = self.slots[idx];
        let sqe = opcode::Write::new(
            types::Fd(self.file.as_raw_fd()),
            self.pool.ptr(idx).wrapping_add(slot.done),
            // block_size <= 1 GiB, checked by UringConfig::check.
            (slot.len - slot.done) as u32,
        )
        .offset(slot.offset + slot.done as u64)
        .build()
        .user_data(idx as u64);
        // SAFETY: the request reads bytes `done..len` of buffer `idx`, inside the pool (len <=
        // block_size). The pool's memory never moves; the buffer is not written while the request
        // is in flight (it is neither `filling` nor in `free` until `complete_write` sees its
        // completion); and the pool is not freed before that completion is reaped: commit, abort
        // and Drop wait for every request, and if waiting fails the pool is leaked instead. The
        // descriptor stays open as long as `self`, which Drop only finishes after that wait.
        unsafe { self.ring.push(&sqe) }.map_err(|e| Error::io("write", &self.path, e))?;
        self.ring
            .submit()
            .map_err(|e| Error::io("write", &self.path, e))
    }

    /// Reaps at least `want` completions and handles them.
    fn reap(&mut self, want: usize) -> Result<()> {
        let mut done = std::mem::take(&mut self.done);
        let mut result = self
            .ring
            .wait(want, &mut done)
            .map_err(|e| Error::io("wait for writes to", &self.path, e));
        for &(idx, res) in &done {
            if result.is_err() {
                break;
            }
            result = self.complete_write(idx as usize, res);
        }
        self.done = done;
        result
    }

    fn complete_write(&mut self, idx: usize, res: i32) -> Result<()> {
        #[cfg(test)]
        let res = if self.inject_einval && self.slots[idx].direct {
            self.inject_einval = false;
            -libc::EINVAL
        } else {
            res
        };
        let slot = &mut self.slots[idx];
        if res < 0 {
            let errno = -res;
            if errno == libc::EINVAL && slot.direct && !self.direct_proven {
                slot.direct = false;
                if self.direct {
                    clear_o_direct(&self.file)
                        .map_err(|e| Error::io("turn off O_DIRECT for", &self.tmp_path, e))?;
                    self.direct = false;
                    self.prealloc = false;
                    debug!(path = %self.path.display(), "O_DIRECT write refused; using buffered I/O");
                }
                return self.push_write(idx);
            }
            if errno == libc::EINTR || errno == libc::EAGAIN {
                return self.push_write(idx);
            }
            return Err(Error::io(
                "write",
                &self.path,
                io::Error::from_raw_os_error(errno),
            ));
        }
        if res == 0 {
            return Err(Error::io(
                "write",
                &self.path,
                io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!(
                        "wrote 0 of {} bytes at offset {}",
                        slot.len - slot.done,
                        slot.offset + slot.done as u64
                    ),
                ),
            ));
        }
        if slot.direct {
            self.direct_proven = true;
        }
        slot.done += res as usize;
        if slot.done < slot.len {
            return self.push_write(idx);
        }
        self.free.push(idx);
        Ok(())
    }

    /// In direct mode, grows the file ahead of a write of `start..end`. Not for the first block:
    /// a file of one block gains nothing from it.
    fn preallocate_for(&mut self, start: u64, end: u64) {
        if !self.prealloc || start == 0 || end <= self.prealloc_to {
            return;
        }
        let step = self.prealloc_to.clamp(PREALLOC_MIN_STEP, PREALLOC_MAX_STEP);
        let to = end.max(self.prealloc_to + step);
        match fallocate(&self.file, self.prealloc_to, to - self.prealloc_to) {
            Ok(()) => self.prealloc_to = to,
            Err(e) => {
                debug!(path = %self.path.display(), error = %e, "preallocation failed; writing without");
                self.prealloc = false;
            }
        }
    }

    /// Waits for every write in flight. If that fails the kernel may still read the pool, so the
    /// pool is leaked rather than freed.
    fn drain_in_flight(&mut self) {
        if self.ring.in_flight == 0 {
            return;
        }
        let mut done = std::mem::take(&mut self.done);
        if let Err(e) = self.ring.drain(&mut done) {
            error!(path = %self.path.display(), error = %e, "cannot wait for io_uring writes; leaking their buffers");
            std::mem::forget(std::mem::replace(&mut self.pool, Pool::new(0, 0)));
        }
    }
}

impl Drop for AtomicFileWriter {
    fn drop(&mut self) {
        self.drain_in_flight();
        if matches!(self.state, WriterState::Open | WriterState::Failed) {
            let _ = fs::remove_file(&self.tmp_path);
        }
    }
}

/// Writes `data` to `path` atomically (temp file, fsync, rename). Returns the bytes written.
pub fn write_file_atomic(path: &Path, data: &[u8], cfg: &UringConfig) -> Result<u64> {
    let mut writer = AtomicFileWriter::create(path, cfg)?;
    writer.reserve(data.len() as u64)?;
    writer.write(data)?;
    writer.commit()
}

/// Where a read request's bytes go.
#[derive(Debug, Clone, Copy)]
enum Target {
    /// Straight into the caller's buffer, at this index.
    Caller { at: usize },
    /// Into the bounce buffer of the request's slot; then `n` bytes from index `from` are copied
    /// to the caller's buffer at index `at`.
    Bounce { from: usize, at: usize, n: usize },
}

/// One read request.
#[derive(Debug, Clone, Copy)]
struct ReadSlot {
    offset: u64,
    /// Bytes asked for.
    len: usize,
    /// Bytes that must arrive; less than `len` only for a bounce read running past end of file.
    need: usize,
    /// Bytes that have arrived.
    done: usize,
    target: Target,
    /// Submitted while the file was in direct mode.
    direct: bool,
}

impl Default for ReadSlot {
    fn default() -> Self {
        Self {
            offset: 0,
            len: 0,
            need: 0,
            done: 0,
            target: Target::Caller { at: 0 },
            direct: false,
        }
    }
}

/// Cuts the range `offset..end` of a file into read requests (see the module documentation).
#[derive(Debug)]
struct Plan {
    pos: u64,
    stop: u64,
    offset: u64,
    end: u64,
    block: u64,
    direct: bool,
    /// The caller's buffer and the file offset agree modulo [`ALIGN`].
    congruent: bool,
}

impl Plan {
    fn new(offset: u64, end: u64, buf_addr: usize, direct: bool, block_size: usize) -> Self {
        let align = ALIGN as u64;
        let (pos, stop) = if direct {
            (offset / align * align, end.next_multiple_of(align))
        } else {
            (offset, end)
        };
        Self {
            pos,
            stop,
            offset,
            end,
            block: block_size as u64,
            direct,
            congruent: buf_addr as u64 % align == offset % align,
        }
    }

    fn next(&mut self) -> Option<ReadSlot> {
        let align = ALIGN as u64;
        let pos = self.pos;
        if pos >= self.stop {
            return None;
        }
        let caller = |end: u64| ReadSlot {
            offset: pos,
            len: (end - pos) as usize,
            need: (end - pos) as usize,
            done: 0,
            target: Target::Caller {
                at: (pos - self.offset) as usize,
            },
            direct: self.direct,
        };
        let (slot, next) = if !self.direct {
            let end = (pos + self.block).min(self.end);
            (caller(end), end)
        } else if self.congruent && pos >= self.offset && pos + align <= self.end {
            let end = (pos + self.block).min(self.end / align * align);
            (caller(end), end)
        } else {
            let end = if self.congruent {
                pos + align
            } else {
                (pos + self.block).min(self.stop)
            };
            let (lo, hi) = (pos.max(self.offset), end.min(self.end));
            let slot = ReadSlot {
                offset: pos,
                len: (end - pos) as usize,
                need: (hi - pos) as usize,
                done: 0,
                target: Target::Bounce {
                    from: (lo - pos) as usize,
                    at: (lo - self.offset) as usize,
                    n: (hi - lo) as usize,
                },
                direct: true,
            };
            (slot, end)
        };
        self.pos = next;
        Some(slot)
    }
}

/// Reads one file through io_uring with many requests in flight. See the
/// [module documentation](self) for the algorithm.
///
/// The length is taken when the file is opened.
pub struct UringReader {
    ring: Ring,
    file: File,
    path: PathBuf,
    len: u64,
    direct: bool,
    /// A direct read has succeeded, so a later `EINVAL` is an error, not a refusal of `O_DIRECT`.
    direct_proven: bool,
    block_size: usize,
    /// One bounce buffer per slot (memory is only touched, so only costs, where used).
    bounce: Pool,
    /// Requests, indexed by their `user_data`.
    slots: Vec<ReadSlot>,
    free_slots: Vec<usize>,
    done: Vec<(u64, i32)>,
}

impl fmt::Debug for UringReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringReader")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("direct", &self.direct)
            .finish_non_exhaustive()
    }
}

impl UringReader {
    /// Opens `path` for reading.
    #[instrument(level = "debug", skip_all, fields(path = %path.display()))]
    pub fn open(path: &Path, cfg: &UringConfig) -> Result<Self> {
        cfg.check(path)?;
        let ring =
            Ring::new(cfg.queue_depth).map_err(|e| Error::io("set up io_uring for", path, e))?;
        let (file, direct) = open_maybe_direct(path, cfg.direct, |direct| {
            let mut opts = OpenOptions::new();
            opts.read(true);
            if direct {
                opts.custom_flags(libc::O_DIRECT);
            }
            opts.open(path)
        })
        .map_err(|e| Error::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        Ok(Self {
            ring,
            file,
            path: path.to_path_buf(),
            len,
            direct,
            direct_proven: false,
            block_size: cfg.block_size,
            bounce: Pool::new(cfg.queue_depth, cfg.block_size),
            slots: vec![ReadSlot::default(); cfg.queue_depth],
            free_slots: (0..cfg.queue_depth).rev().collect(),
            done: Vec::with_capacity(cfg.queue_depth),
        })
    }

    /// The file's length when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The path being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fills `buf` with the file's bytes from `offset` on. A range running past the end of the
    /// file is an `UnexpectedEof` error. With an [`AlignedBuf`] and an aligned `offset`, bytes go
    /// from disk straight into `buf`.
    pub fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let n = buf.len() as u64;
        let end = match offset.checked_add(n) {
            Some(end) if end <= self.len => end,
            _ => return Err(self.eof(offset, n)),
        };
        if n == 0 {
            return Ok(());
        }
        // From here on `buf` is only reached through `base`, by the kernel and by bounce copies.
        let base = buf.as_mut_ptr();
        let mut plan = Plan::new(offset, end, base as usize, self.direct, self.block_size);
        let mut first_err: Option<Error> = None;
        let mut done = std::mem::take(&mut self.done);
        loop {
            while first_err.is_none() && !self.free_slots.is_empty() {
                let Some(slot) = plan.next() else { break };
                let Some(idx) = self.free_slots.pop() else {
                    break;
                };
                self.slots[idx] = slot;
                // SAFETY: `base` is the start of `buf`, borrowed exclusively for this call and
                // only touched through `base` from here on, and the plan only yields slots that
                // lie inside it; this function waits for every request before returning.
                if let Err(e) = unsafe { self.push_read(idx, base) } {
                    self.release(idx);
                    first_err = Some(e);
                }
            }
            if self.ring.in_flight == 0 {
                break;
            }
            // Submits what was queued (here and in `complete_read`) and waits, in one call.
            if let Err(e) = self.ring.wait(1, &mut done) {
                // Requests still point into `buf`, and returning would hand it back to the
                // caller while the kernel may write into it.
                error!(path = %self.path.display(), error = %e, "cannot wait for io_uring reads; aborting");
                std::process::abort();
            }
            for &(idx, res) in &done {
                // SAFETY: as for `push_read` above.
                if let Err(e) = unsafe { self.complete_read(idx as usize, res, base) } {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.done = done;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Returns slot `idx` (and so its bounce buffer) to the free list.
    fn release(&mut self, idx: usize) {
        self.free_slots.push(idx);
    }

    /// Queues the rest of slot `idx`'s read; the next [`Ring::wait`] submits it.
    ///
    /// # Safety
    /// `base` must point to the caller's buffer that the slot was planned for, valid for writes
    /// and not otherwise accessed until the request's completion has been reaped.
    unsafe fn push_read(&mut self, idx: usize, base: *mut u8) -> Result<()> {
        let slot = self.slots[idx];
        let dst = match slot.target {
            Target::Caller { at } => base.wrapping_add(at + slot.done),
            Target::Bounce { .. } => self.bounce.ptr(idx).wrapping_add(slot.done),
        };
        let sqe = opcode::Read::new(
            types::Fd(self.file.as_raw_fd()),
            dst,
            // block_size <= 1 GiB, checked by UringConfig::check.
            (slot.len - slot.done) as u32,
        )
        .offset(slot.offset + slot.done as u64)
        .build()
        .user_data(idx as u64);
        // SAFETY: the request writes `slot.len - slot.done` bytes at `dst`. For the caller's
        // buffer this is within it (the plan's slots lie inside `offset..end`) and the caller
        // guarantees it stays valid and untouched until the completion. The slot's bounce buffer
        // (len <= block_size) never moves, is used by this slot only, is not read before
        // `complete_read` sees the completion, and `read_at` reaps every request before it
        // returns, so it is not freed while in flight.
        unsafe { self.ring.push(&sqe) }.map_err(|e| Error::io("read", &self.path, e))
    }

    /// Handles one completion: resubmits a short or refused read, or copies a finished bounce
    /// read out and frees the slot.
    ///
    /// # Safety
    /// As for [`push_read`](Self::push_read).
    unsafe fn complete_read(&mut self, idx: usize, res: i32, base: *mut u8) -> Result<()> {
        let slot = &mut self.slots[idx];
        if res < 0 {
            let errno = -res;
            if errno == libc::EINVAL && slot.direct && !self.direct_proven {
                slot.direct = false;
                if self.direct {
                    clear_o_direct(&self.file)
                        .map_err(|e| Error::io("turn off O_DIRECT for", &self.path, e))?;
                    self.direct = false;
                    debug!(path = %self.path.display(), "O_DIRECT read refused; using buffered I/O");
                }
                // SAFETY: forwarded from this function's contract.
                return unsafe { self.push_read_or_release(idx, base) };
            }
            if errno == libc::EINTR || errno == libc::EAGAIN {
                // SAFETY: forwarded from this function's contract.
                return unsafe { self.push_read_or_release(idx, base) };
            }
            self.release(idx);
            return Err(Error::io(
                "read",
                &self.path,
                io::Error::from_raw_os_error(errno),
            ));
        }
        if res == 0 {
            let (offset, n) = (
                slot.offset + slot.done as u64,
                (slot.need - slot.done) as u64,
            );
            self.release(idx);
            return Err(Error::io(
                "read",
                &self.path,
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("file ended with {n} bytes still to read at offset {offset}"),
                ),
            ));
        }
        if slot.direct {
            self.direct_proven = true;
        }
        slot.done += res as usize;
        if slot.done < slot.need {
            // SAFETY: forwarded from this function's contract.
            return unsafe { self.push_read_or_release(idx, base) };
        }
        if let Target::Bounce { from, at, n } = slot.target {
            // SAFETY: the source, bytes `from..from + n` of this slot's bounce buffer, has been
            // filled by the completed request and no request uses it now. The destination, `base
            // + at .. base + at + n`, lies inside the caller's buffer (the plan's slots lie inside
            // `offset..end`), which the caller keeps valid and lets only this reader touch, and no
            // request in flight targets it, since every byte of the buffer belongs to exactly one
            // slot. The two are distinct allocations.
            unsafe {
                ptr::copy_nonoverlapping(self.bounce.ptr(idx).add(from), base.add(at), n);
            }
        }
        self.release(idx);
        Ok(())
    }

    /// # Safety
    /// As for [`push_read`](Self::push_read).
    unsafe fn push_read_or_release(&mut self, idx: usize, base: *mut u8) -> Result<()> {
        // SAFETY: forwarded from this function's contract.
        let result = unsafe { self.push_read(idx, base) };
        if result.is_err() {
            self.release(idx);
        }
        result
    }

    fn eof(&self, offset: u64, n: u64) -> Error {
        Error::io(
            "read",
            &self.path,
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{n} bytes at offset {offset} run past the end of the {}-byte file",
                    self.len
                ),
            ),
        )
    }
}

/// Reads the whole file at `path`.
pub fn read_all(path: &Path, cfg: &UringConfig) -> Result<Vec<u8>> {
    let mut reader = UringReader::open(path, cfg)?;
    let mut buf = vec![0; reader.usize_len()?];
    advise_huge_pages(&mut buf);
    reader.read_at(0, &mut buf)?;
    Ok(buf)
}

/// Asks for transparent huge pages behind a large, still untouched buffer: filling it then takes
/// one page fault per 2 MiB instead of one per 4 KiB, which matters when a multi-GiB file is read
/// into fresh memory. Only a hint; failures are ignored.
fn advise_huge_pages(buf: &mut [u8]) {
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

/// Reads the whole file at `path` into an aligned buffer: with `O_DIRECT`, the bytes go from disk
/// straight into it, with no bounce copy.
pub fn read_all_aligned(path: &Path, cfg: &UringConfig) -> Result<AlignedBuf> {
    let mut reader = UringReader::open(path, cfg)?;
    let mut buf = AlignedBuf::zeroed(reader.usize_len()?);
    reader.read_at(0, &mut buf)?;
    Ok(buf)
}

impl UringReader {
    fn usize_len(&self) -> Result<usize> {
        usize::try_from(self.len).map_err(|_| {
            Error::io(
                "read",
                &self.path,
                io::Error::new(io::ErrorKind::OutOfMemory, "file larger than memory"),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes from a xorshift64 generator.
    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// A temp dir on the real disk (not tmpfs), so that O_DIRECT is exercised.
    fn disk_dir() -> tempfile::TempDir {
        let target = concat!(env!("CARGO_MANIFEST_DIR"), "/../target");
        tempfile::Builder::new()
            .prefix("hotstart-uring-")
            .tempdir_in("/var/tmp")
            .or_else(|_| {
                fs::create_dir_all(target)?;
                tempfile::Builder::new()
                    .prefix("hotstart-uring-")
                    .tempdir_in(target)
            })
            .expect("a temp dir on disk")
    }

    /// Whether files in `dir` really bypass the page cache: O_DIRECT opens, and not on tmpfs.
    fn direct_supported(dir: &Path) -> bool {
        let probe = dir.join("direct-probe");
        let supported = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)
            .map(|f| !is_memory_fs(&f))
            .unwrap_or(false);
        let _ = fs::remove_file(&probe);
        supported
    }

    /// Every name in `dir`, hidden ones included, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn small_cfg() -> UringConfig {
        UringConfig {
            queue_depth: 4,
            block_size: 64 << 10,
            direct: true,
        }
    }

    /// Writes `data` to a fresh file in `dir` in pieces of `piece` bytes, then checks that the
    /// writer reported the right mode and length, that nothing but the final file is left, and
    /// that every way of reading it back gives `data`.
    fn round_trip(cfg: &UringConfig, data: &[u8], piece: usize) {
        let dir = disk_dir();
        let path = dir.path().join("shard.bin");
        let mut writer = AtomicFileWriter::create(&path, cfg).unwrap();
        assert_eq!(
            writer.is_direct(),
            cfg.direct && direct_supported(dir.path())
        );
        for chunk in data.chunks(piece) {
            writer.write(chunk).unwrap();
        }
        assert_eq!(writer.len(), data.len() as u64);
        assert!(!path.exists(), "the final name appears only on commit");
        assert_eq!(writer.commit().unwrap(), data.len() as u64);
        assert_eq!(names(dir.path()), ["shard.bin"], "no temp file left");

        let len = data.len();
        let on_disk = fs::read(&path).unwrap();
        assert!(on_disk == data, "{len} bytes: file content differs");
        let back = read_all(&path, cfg).unwrap();
        assert!(back == data, "{len} bytes: read_all differs");
        let back = read_all_aligned(&path, cfg).unwrap();
        assert!(&back[..] == data, "{len} bytes: read_all_aligned differs");
        let reader = UringReader::open(&path, cfg).unwrap();
        assert_eq!(reader.len(), len as u64);
        assert_eq!(
            reader.is_direct(),
            cfg.direct && direct_supported(dir.path())
        );
    }

    #[test]
    fn default_config() {
        let cfg = UringConfig::default();
        assert_eq!(cfg.queue_depth, 32);
        assert_eq!(cfg.block_size, 1 << 20);
        assert!(cfg.direct);
    }

    #[test]
    fn bad_config_is_refused() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        for cfg in [
            UringConfig {
                block_size: 1000,
                ..UringConfig::default()
            },
            UringConfig {
                block_size: 0,
                ..UringConfig::default()
            },
            UringConfig {
                queue_depth: 0,
                ..UringConfig::default()
            },
        ] {
            let err = AtomicFileWriter::create(&path, &cfg).unwrap_err();
            assert!(
                matches!(&err, Error::Io { source, .. } if source.kind() == io::ErrorKind::InvalidInput),
                "{err}"
            );
            assert!(UringReader::open(&path, &cfg).is_err());
        }
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn round_trips_edge_sizes() {
        let cfg = UringConfig::default();
        let bs = cfg.block_size;
        for (seed, len) in [0, 1, 4095, 4096, 4097, bs - 1, bs, bs + 1]
            .into_iter()
            .enumerate()
        {
            let data = pattern(len, seed as u64);
            round_trip(&cfg, &data, len.max(1));
        }
    }

    #[test]
    fn round_trips_in_odd_pieces() {
        let cfg = small_cfg();
        let bs = cfg.block_size;
        for (seed, (len, piece)) in [
            (4097, 7),
            (bs - 1, 4096),
            (bs + 1, 1000),
            (5 * bs + 12_345, 4095),
            (9 * bs, bs),
            (9 * bs + 1, 3 * bs + 5),
        ]
        .into_iter()
        .enumerate()
        {
            round_trip(&cfg, &pattern(len, 100 + seed as u64), piece);
        }
    }

    #[test]
    fn round_trips_20_mib() {
        let data = pattern(20 * (1 << 20) + 12_345, 7);
        round_trip(&UringConfig::default(), &data, 1_000_003);
        // A small pool must be reused many times over.
        round_trip(&small_cfg(), &data, 1 << 20);
    }

    #[test]
    fn round_trips_buffered() {
        let cfg = UringConfig {
            direct: false,
            ..small_cfg()
        };
        for (seed, len) in [0, 1, 4097, 3 * cfg.block_size + 5, 5 << 20]
            .into_iter()
            .enumerate()
        {
            round_trip(&cfg, &pattern(len, 200 + seed as u64), 10_000);
        }
    }

    #[test]
    fn write_file_atomic_round_trips() {
        let dir = disk_dir();
        let path = dir.path().join("whole");
        let data = pattern(3 * (1 << 20) + 17, 9);
        let cfg = UringConfig::default();
        assert_eq!(
            write_file_atomic(&path, &data, &cfg).unwrap(),
            data.len() as u64
        );
        assert!(read_all(&path, &cfg).unwrap() == data);
        assert_eq!(names(dir.path()), ["whole"]);
    }

    #[test]
    fn read_at_unaligned_offsets_and_lengths() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        let cfg = small_cfg();
        let bs = cfg.block_size;
        let len = 3 * bs + 777;
        let data = pattern(len, 11);
        write_file_atomic(&path, &data, &cfg).unwrap();
        let offsets = [
            0,
            1,
            511,
            4095,
            4096,
            4097,
            bs - 1,
            bs,
            bs + 100,
            2 * bs + 4096,
            len - 4097,
            len - 1,
        ];
        let lengths = [1, 2, 4095, 4096, 4097, bs - 1, bs, bs + 1, 2 * bs + 3, len];
        for direct in [true, false] {
            let cfg = UringConfig {
                direct,
                ..cfg.clone()
            };
            let mut reader = UringReader::open(&path, &cfg).unwrap();
            let mut aligned = AlignedBuf::zeroed(len + 2 * ALIGN);
            for offset in offsets {
                for n in lengths.into_iter().filter(|&n| offset + n <= len) {
                    let want = &data[offset..offset + n];
                    let mut buf = vec![0; n];
                    reader.read_at(offset as u64, &mut buf).unwrap();
                    assert!(buf == want, "direct={direct} offset={offset} n={n}: Vec");
                    // Congruent with the offset: the middle goes straight into the buffer.
                    // Off by one: everything goes through bounce buffers.
                    for shift in [0, 1] {
                        let at = (offset + shift) % ALIGN;
                        aligned.fill(0);
                        reader
                            .read_at(offset as u64, &mut aligned[at..at + n])
                            .unwrap();
                        assert!(
                            &aligned[at..at + n] == want,
                            "direct={direct} offset={offset} n={n} at={at}"
                        );
                        assert!(
                            aligned[..at].iter().all(|&b| b == 0)
                                && aligned[at + n..].iter().all(|&b| b == 0),
                            "direct={direct} offset={offset} n={n} at={at}: wrote outside"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn plan_tiles_the_range() {
        let block = 16 * ALIGN;
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % bound
        };
        for case in 0..2000 {
            let offset = next(1 << 20);
            let n = 1 + next(if case % 2 == 0 {
                3 * ALIGN as u64
            } else {
                1 << 20
            });
            let buf_addr = (next(1 << 30) as usize) & !7;
            let direct = case % 3 != 0;
            let mut plan = Plan::new(offset, offset + n, buf_addr, direct, block);
            // Which bytes of the caller's buffer each request fills.
            let mut covered = Vec::new();
            while let Some(slot) = plan.next() {
                assert!(slot.len <= block && slot.need <= slot.len && slot.need > 0);
                if direct {
                    assert_eq!(slot.offset % ALIGN as u64, 0, "case {case}");
                    assert_eq!(slot.len % ALIGN, 0, "case {case}");
                }
                match slot.target {
                    Target::Caller { at } => {
                        assert_eq!(slot.offset, offset + at as u64);
                        if direct {
                            assert_eq!((buf_addr + at) % ALIGN, 0, "case {case}");
                        }
                        covered.push((at, slot.len));
                    }
                    Target::Bounce { from, at, n, .. } => {
                        assert!(direct);
                        assert_eq!(slot.offset + from as u64, offset + at as u64);
                        assert_eq!(slot.need, from + n);
                        covered.push((at, n));
                    }
                }
            }
            let mut pos = 0;
            for (at, len) in covered {
                assert_eq!(at, pos, "case {case}: gap or overlap");
                pos += len;
            }
            assert_eq!(pos as u64, n, "case {case}: range not covered");
        }
    }

    #[test]
    fn reading_past_eof_is_an_error_naming_the_path() {
        let dir = disk_dir();
        let path = dir.path().join("short");
        write_file_atomic(&path, &pattern(10_000, 3), &UringConfig::default()).unwrap();
        let mut reader = UringReader::open(&path, &UringConfig::default()).unwrap();
        for (offset, n) in [(9_990, 20), (10_000, 1), (20_000, 5), (u64::MAX, 1)] {
            let mut buf = vec![0; n];
            let err = reader.read_at(offset, &mut buf).unwrap_err();
            match &err {
                Error::Io {
                    path: p, source, ..
                } => {
                    assert_eq!(p, &path);
                    assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                }
                other => panic!("unexpected error {other}"),
            }
            assert!(err.to_string().contains("short"), "{err}");
        }
        // Reading up to the very end, and nothing at the end, are fine.
        let mut buf = vec![0; 10];
        reader.read_at(9_990, &mut buf).unwrap();
        reader.read_at(10_000, &mut []).unwrap();
    }

    #[test]
    fn missing_file_errors_name_the_path() {
        let dir = disk_dir();
        let path = dir.path().join("no/such/dir/f");
        let err = AtomicFileWriter::create(&path, &UringConfig::default()).unwrap_err();
        assert!(err.to_string().contains("no/such/dir"), "{err}");
        let err = UringReader::open(&path, &UringConfig::default()).unwrap_err();
        assert!(
            matches!(&err, Error::Io { path: p, source, .. } if p == &path && source.kind() == io::ErrorKind::NotFound),
            "{err}"
        );
    }

    #[test]
    fn tmpfs_falls_back_to_buffered_io() {
        let shm = Path::new("/dev/shm");
        assert!(shm.is_dir(), "this test needs a tmpfs at /dev/shm");
        let dir = tempfile::tempdir_in(shm).unwrap();
        let path = dir.path().join("f");
        let cfg = UringConfig::default();
        let data = pattern(3 * cfg.block_size + 5, 5);
        let mut writer = AtomicFileWriter::create(&path, &cfg).unwrap();
        assert!(!writer.is_direct());
        writer.write(&data).unwrap();
        writer.commit().unwrap();
        let mut reader = UringReader::open(&path, &cfg).unwrap();
        assert!(!reader.is_direct());
        let mut back = vec![0; data.len() - 3];
        reader.read_at(3, &mut back).unwrap();
        assert!(back == data[3..]);
        assert!(read_all(&path, &cfg).unwrap() == data);
        assert_eq!(names(dir.path()), ["f"]);
    }

    #[test]
    fn refused_direct_open_falls_back_to_buffered_io() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        fs::write(&path, b"hello").unwrap();
        let (file, direct) = open_maybe_direct(&path, true, |direct| {
            if direct {
                Err(io::Error::from_raw_os_error(libc::EINVAL))
            } else {
                File::open(&path)
            }
        })
        .unwrap();
        assert!(!direct);
        assert_eq!(file.metadata().unwrap().len(), 5);
        // Other errors are not a refusal of O_DIRECT.
        let err = open_maybe_direct(&path, true, |_| {
            Err(io::Error::from_raw_os_error(libc::EACCES))
        })
        .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EACCES));
    }

    #[test]
    fn refused_first_direct_write_falls_back_to_buffered_io() {
        let dir = disk_dir();
        if !direct_supported(dir.path()) {
            panic!("{} does not support O_DIRECT", dir.path().display());
        }
        let path = dir.path().join("f");
        let cfg = small_cfg();
        let data = pattern(10 * cfg.block_size + 99, 13);
        let mut writer = AtomicFileWriter::create(&path, &cfg).unwrap();
        assert!(writer.is_direct());
        writer.inject_einval = true;
        writer.write(&data).unwrap();
        assert!(!writer.is_direct(), "fell back after the refused write");
        writer.commit().unwrap();
        assert!(fs::read(&path).unwrap() == data);
        assert_eq!(names(dir.path()), ["f"]);
    }

    #[test]
    fn abort_and_drop_leave_nothing_behind() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        let data = pattern(10 * (1 << 20) + 3, 17);
        for cfg in [UringConfig::default(), small_cfg()] {
            let mut writer = AtomicFileWriter::create(&path, &cfg).unwrap();
            writer.write(&data).unwrap();
            assert_eq!(
                names(dir.path()).len(),
                1,
                "the temp file exists while writing"
            );
            writer.abort().unwrap();
            assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));

            let mut writer = AtomicFileWriter::create(&path, &cfg).unwrap();
            writer.write(&data).unwrap();
            drop(writer);
            assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));

            drop(AtomicFileWriter::create(&path, &cfg).unwrap());
            assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));
        }
    }

    #[test]
    fn commit_replaces_an_existing_file_atomically() {
        let dir = disk_dir();
        let path = dir.path().join("ckpt");
        let cfg = UringConfig::default();
        let old = pattern(5 * (1 << 20) + 1, 19);
        fs::write(&path, &old).unwrap();
        for new in [
            pattern(2 * (1 << 20) + 7, 23),
            pattern(7 * (1 << 20) + 9, 29),
        ] {
            let before = fs::read(&path).unwrap();
            let mut writer = AtomicFileWriter::create(&path, &cfg).unwrap();
            writer.write(&new).unwrap();
            // Until commit, the old file is whole under the final name, and the new one is
            // a hidden temp file beside it.
            assert!(fs::read(&path).unwrap() == before);
            let listed = names(dir.path());
            assert_eq!(listed.len(), 2, "{listed:?}");
            assert!(listed[0].starts_with(".ckpt.tmp-"), "{listed:?}");
            writer.commit().unwrap();
            assert!(fs::read(&path).unwrap() == new);
            assert_eq!(names(dir.path()), ["ckpt"]);
        }
    }

    #[test]
    fn writer_is_send() {
        fn is_send<T: Send>() {}
        is_send::<AtomicFileWriter>();
        is_send::<UringReader>();
        is_send::<AlignedBuf>();
    }
}
