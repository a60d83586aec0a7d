//! [`AtomicFileWriter`]: one file written through io_uring under a temporary name, renamed into
//! place on commit. The algorithm is described in the [module documentation](super).

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{opcode, types};
use tracing::{debug, error, instrument};

mod inplace;

use super::buf::Pool;
use super::{ALIGN, Completion, DirectMode, Ring, UringConfig, open_maybe_direct};
use crate::error::{Error, Result};

/// Preallocation grows the file by its current size, at least this much...
const PREALLOC_MIN_STEP: u64 = 64 << 20;
/// ... and at most this much, at a time.
const PREALLOC_MAX_STEP: u64 = 1 << 30;

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
/// [`commit`](Self::commit). See the [module documentation](super) for the algorithm.
pub struct AtomicFileWriter {
    ring: Ring,
    file: File,
    path: PathBuf,
    tmp_path: PathBuf,
    mode: DirectMode,
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
    /// Grow the allocation ahead of the writes (in direct mode only).
    prealloc: bool,
    state: WriterState,
    /// Bytes written by [`write_aligned`](Self::write_aligned) straight from the caller's memory.
    in_place: u64,
    /// Test hook: report the next completed direct write as refused with `EINVAL`.
    #[cfg(test)]
    inject_einval: bool,
}

impl fmt::Debug for AtomicFileWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AtomicFileWriter")
            .field("path", &self.path)
            .field("tmp_path", &self.tmp_path)
            .field("direct", &self.mode.on)
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
        let ring = cfg.ring(path)?;
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
            mode: DirectMode::new(direct),
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
            in_place: 0,
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
        self.mode.on
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
        let to = if self.mode.on {
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
        let len = if self.mode.on {
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
            direct: self.mode.on,
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
        let done = self
            .ring
            .wait(want)
            .map_err(|e| Error::io("wait for writes to", &self.path, e))?;
        let mut result = Ok(());
        for &(idx, res) in &done {
            result = self.complete_write(idx as usize, res);
            if result.is_err() {
                break;
            }
        }
        self.ring.recycle(done);
        result
    }

    fn complete_write(&mut self, idx: usize, res: i32) -> Result<()> {
        let res = self.maybe_inject(self.slots[idx].direct, res);
        let finished = settle_write(
            &mut self.mode,
            &self.file,
            &self.path,
            &self.tmp_path,
            &mut self.slots[idx],
            res,
        )?;
        if finished {
            self.free.push(idx);
            Ok(())
        } else {
            self.push_write(idx)
        }
    }

    /// Test hook: turns the result of the next direct write into `EINVAL` when asked to.
    #[cfg(test)]
    fn maybe_inject(&mut self, direct: bool, res: i32) -> i32 {
        if self.inject_einval && direct {
            self.inject_einval = false;
            -libc::EINVAL
        } else {
            res
        }
    }

    #[cfg(not(test))]
    fn maybe_inject(&mut self, _direct: bool, res: i32) -> i32 {
        res
    }

    /// In direct mode, grows the file ahead of a write of `start..end`. Not for the first block:
    /// a file of one block gains nothing from it.
    fn preallocate_for(&mut self, start: u64, end: u64) {
        if !self.prealloc || !self.mode.on || start == 0 || end <= self.prealloc_to {
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
        if let Err(e) = self.ring.drain() {
            error!(path = %self.path.display(), error = %e, "cannot wait for io_uring writes; leaking their buffers");
            std::mem::forget(std::mem::replace(&mut self.pool, Pool::new(0, 0)));
        }
    }
}

/// Applies the completion `res` of a write to `slot` of a file in `mode`: `Ok(true)` once all
/// of the slot's bytes are written, `Ok(false)` when the rest must be submitted again (a short
/// or interrupted write, or a direct write refused and now buffered).
fn settle_write(
    mode: &mut DirectMode,
    file: &File,
    path: &Path,
    tmp_path: &Path,
    slot: &mut WriteSlot,
    res: i32,
) -> Result<bool> {
    let completion = mode
        .complete(file, path, "write", res, &mut slot.direct)
        .map_err(|e| Error::io("turn off O_DIRECT for", tmp_path, e))?;
    match completion {
        Completion::Transferred(n) => {
            slot.done += n;
            Ok(slot.done >= slot.len)
        }
        Completion::Resubmit => Ok(false),
        Completion::Failed(e) => Err(Error::io("write", path, e)),
        Completion::Nothing => Err(Error::io(
            "write",
            path,
            io::Error::new(
                io::ErrorKind::WriteZero,
                format!(
                    "wrote 0 of {} bytes at offset {}",
                    slot.len - slot.done,
                    slot.offset + slot.done as u64
                ),
            ),
        )),
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

#[cfg(test)]
mod tests {
    use super::super::testutil::{direct_supported, disk_dir, names, pattern, small_cfg};
    use super::super::{UringReader, read_all, read_all_aligned};
    use super::*;

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
}
