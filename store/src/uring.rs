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
//! * **No copy from aligned memory.** [`AtomicFileWriter::write_aligned`] skips the pool for a
//!   caller buffer that starts on a 4096-byte boundary: `block_size` writes go to the kernel
//!   straight from the caller's memory, `queue_depth` in flight, and the call returns only once
//!   they are all complete (see `writer/inplace.rs`).
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
//! [`UringReader::read_windows`] reads a range the same way, a window at a time, into a few
//! buffers taken in turn, and hands each window to a callback in file order while the windows
//! after it are read: a caller that hashes or copies what it reads keeps the disk busy meanwhile,
//! with no thread of its own. `read_at` is one window into one buffer.
//!
//! # Falling back to buffered I/O
//!
//! `O_DIRECT` is asked for when [`UringConfig::direct`] is set, and dropped (logged at debug level,
//! reported by `is_direct()`) when the file system refuses it at open (`EINVAL`), when it would
//! only be emulated (tmpfs and ramfs keep the data in the page cache anyway), or when the first
//! direct request of a file fails with `EINVAL`: then `O_DIRECT` is cleared on the open file with
//! `fcntl(F_SETFL)` and the refused requests are resubmitted as buffered I/O.

//!
//! # Layout
//!
//! This file holds what both directions share: [`UringConfig`], the ring wrapper that submits and
//! reaps requests, opening with `O_DIRECT` and the fallback from it. `buf` has [`AlignedBuf`] and
//! the buffer pools, `writer` the [`AtomicFileWriter`], `reader` the [`UringReader`].

mod buf;
mod reader;
mod writer;

pub use buf::AlignedBuf;
pub use reader::{UringReader, open_for_reading, read_all, read_all_aligned};
pub use writer::{AtomicFileWriter, write_file_atomic};

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use io_uring::{IoUring, squeue};
use tracing::debug;

use crate::error::{Error, Result};

/// Alignment of buffers, file offsets and lengths for `O_DIRECT`.
pub const ALIGN: usize = 4096;

const MAX_QUEUE_DEPTH: usize = 4096;
const MAX_BLOCK_SIZE: usize = 1 << 30;
/// Most memory a writer's pool or a reader's bounce buffers may reserve.
const MAX_POOL: usize = 16 << 30;
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

    /// Sets up the ring for one file at `path` (named in the error).
    fn ring(&self, path: &Path) -> Result<Ring> {
        Ring::new(self.queue_depth).map_err(|e| Error::io("set up io_uring for", path, e))
    }
}

/// One io_uring and the number of its requests the kernel has not completed yet.
struct Ring {
    ring: IoUring,
    in_flight: usize,
    /// Reused for the completions of each [`Ring::wait`].
    reaped: Vec<(u64, i32)>,
}

impl Ring {
    fn new(queue_depth: usize) -> io::Result<Self> {
        let entries = u32::try_from(queue_depth)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "queue depth too large"))?;
        Ok(Self {
            ring: IoUring::new(entries)?,
            in_flight: 0,
            reaped: Vec::with_capacity(queue_depth),
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

    /// Submits what is queued, waits until at least `want` requests have completed, and returns
    /// the `(user_data, result)` of every completion reaped. Hand the list back with
    /// [`Ring::recycle`] once handled, so that the next wait reuses it. On error the completions
    /// reaped so far are dropped (they are counted as no longer in flight).
    fn wait(&mut self, want: usize) -> io::Result<Vec<(u64, i32)>> {
        let mut done = std::mem::take(&mut self.reaped);
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
        result.map(|()| done)
    }

    /// Gives back the list a [`Ring::wait`] returned.
    fn recycle(&mut self, done: Vec<(u64, i32)>) {
        self.reaped = done;
    }

    /// Waits for every request in flight, discarding their results.
    fn drain(&mut self) -> io::Result<()> {
        while self.in_flight > 0 {
            let done = self.wait(self.in_flight)?;
            self.recycle(done);
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

/// What a completed request asks for next (see [`DirectMode::complete`]).
#[derive(Debug)]
enum Completion {
    /// This many bytes (at least one) were transferred.
    Transferred(usize),
    /// Nothing was transferred: the file ended (a read) or the device took nothing (a write).
    Nothing,
    /// Submit the rest of the request again: it was interrupted, or it was refused as a direct
    /// request and `O_DIRECT` is now off.
    Resubmit,
    /// The request failed.
    Failed(io::Error),
}

/// The `O_DIRECT` state of an open file, kept by the writer and the reader alike.
#[derive(Debug, Clone, Copy)]
struct DirectMode {
    /// Requests are submitted with `O_DIRECT`.
    on: bool,
    /// A direct request has succeeded, so a later `EINVAL` is an error, not a refusal of `O_DIRECT`.
    proven: bool,
}

impl DirectMode {
    fn new(on: bool) -> Self {
        Self { on, proven: false }
    }

    /// Interprets the result `res` of a request on `file` that was submitted in direct mode if
    /// `*sent_direct`. The first direct request refused with `EINVAL` means the file system will
    /// not do `O_DIRECT` for this file: it is turned off on `file` (logged as an `op` on `path`),
    /// `*sent_direct` is cleared and the request is to be resubmitted as buffered I/O. Returns an
    /// error only when turning `O_DIRECT` off fails.
    fn complete(
        &mut self,
        file: &File,
        path: &Path,
        op: &str,
        res: i32,
        sent_direct: &mut bool,
    ) -> io::Result<Completion> {
        if res < 0 {
            let errno = -res;
            if errno == libc::EINVAL && *sent_direct && !self.proven {
                *sent_direct = false;
                if self.on {
                    clear_o_direct(file)?;
                    self.on = false;
                    debug!(path = %path.display(), "O_DIRECT {op} refused; using buffered I/O");
                }
                return Ok(Completion::Resubmit);
            }
            if errno == libc::EINTR || errno == libc::EAGAIN {
                return Ok(Completion::Resubmit);
            }
            return Ok(Completion::Failed(io::Error::from_raw_os_error(errno)));
        }
        if res == 0 {
            return Ok(Completion::Nothing);
        }
        if *sent_direct {
            self.proven = true;
        }
        Ok(Completion::Transferred(res as usize))
    }
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

/// Helpers shared by the tests of every part.
#[cfg(test)]
mod testutil {
    use std::fs::{self, OpenOptions};
    use std::os::unix::fs::OpenOptionsExt;
    use std::path::Path;

    use super::{UringConfig, is_memory_fs};

    pub(super) use hotstart_testkit::pattern;

    /// A temp dir on the real disk (not tmpfs), so that O_DIRECT is exercised.
    pub(super) fn disk_dir() -> tempfile::TempDir {
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
    pub(super) fn direct_supported(dir: &Path) -> bool {
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
    pub(super) fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    pub(super) fn small_cfg() -> UringConfig {
        UringConfig {
            queue_depth: 4,
            block_size: 64 << 10,
            direct: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::testutil::{disk_dir, names, pattern};
    use super::*;

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
    fn writer_is_send() {
        fn is_send<T: Send>() {}
        is_send::<AtomicFileWriter>();
        is_send::<UringReader>();
        is_send::<AlignedBuf>();
    }
}
