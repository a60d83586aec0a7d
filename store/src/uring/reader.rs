//! [`UringReader`]: one file read through io_uring with many requests in flight, straight into
//! the caller's buffer where alignment allows. The algorithm is described in the
//! [module documentation](super).

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::DerefMut;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr;

use io_uring::{opcode, types};
use tracing::{error, instrument};

use super::buf::{AlignedBuf, Pool, advise_huge_pages};
use super::{ALIGN, Completion, DirectMode, Ring, UringConfig, open_maybe_direct};
use crate::error::{Error, Result};

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
/// [module documentation](super) for the algorithm.
///
/// The length is taken when the file is opened.
pub struct UringReader {
    ring: Ring,
    file: File,
    path: PathBuf,
    len: u64,
    mode: DirectMode,
    block_size: usize,
    /// One bounce buffer per slot (memory is only touched, so only costs, where used).
    bounce: Pool,
    /// Requests, indexed by their `user_data`.
    slots: Vec<ReadSlot>,
    free_slots: Vec<usize>,
}

impl fmt::Debug for UringReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringReader")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("direct", &self.mode.on)
            .finish_non_exhaustive()
    }
}

impl UringReader {
    /// Opens `path` for reading.
    #[instrument(level = "debug", skip_all, fields(path = %path.display()))]
    pub fn open(path: &Path, cfg: &UringConfig) -> Result<Self> {
        cfg.check(path)?;
        let ring = cfg.ring(path)?;
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
            mode: DirectMode::new(direct),
            block_size: cfg.block_size,
            bounce: Pool::new(cfg.queue_depth, cfg.block_size),
            slots: vec![ReadSlot::default(); cfg.queue_depth],
            free_slots: (0..cfg.queue_depth).rev().collect(),
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
        self.mode.on
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
        let mut plan = Plan::new(offset, end, base as usize, self.mode.on, self.block_size);
        let mut first_err: Option<Error> = None;
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
            let done = match self.ring.wait(1) {
                Ok(done) => done,
                Err(e) => {
                    // Requests still point into `buf`, and returning would hand it back to the
                    // caller while the kernel may write into it.
                    error!(path = %self.path.display(), error = %e, "cannot wait for io_uring reads; aborting");
                    std::process::abort();
                }
            };
            for &(idx, res) in &done {
                // SAFETY: as for `push_read` above.
                if let Err(e) = unsafe { self.complete_read(idx as usize, res, base) } {
                    first_err.get_or_insert(e);
                }
            }
            self.ring.recycle(done);
        }
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
        let completion = self
            .mode
            .complete(&self.file, &self.path, "read", res, &mut slot.direct)
            .map_err(|e| Error::io("turn off O_DIRECT for", &self.path, e))?;
        let n = match completion {
            Completion::Transferred(n) => n,
            Completion::Resubmit => {
                // SAFETY: forwarded from this function's contract.
                return unsafe { self.push_read_or_release(idx, base) };
            }
            Completion::Failed(e) => {
                self.release(idx);
                return Err(Error::io("read", &self.path, e));
            }
            Completion::Nothing => {
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
        };
        slot.done += n;
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
    read_whole(path, cfg, |len| {
        let mut buf = vec![0; len];
        advise_huge_pages(&mut buf);
        buf
    })
}

/// Reads the whole file at `path` into an aligned buffer: with `O_DIRECT`, the bytes go from disk
/// straight into it, with no bounce copy.
pub fn read_all_aligned(path: &Path, cfg: &UringConfig) -> Result<AlignedBuf> {
    read_whole(path, cfg, AlignedBuf::zeroed)
}

/// Reads the whole file at `path` into a buffer of its length made by `new_buf`.
fn read_whole<B: DerefMut<Target = [u8]>>(
    path: &Path,
    cfg: &UringConfig,
    new_buf: impl FnOnce(usize) -> B,
) -> Result<B> {
    let mut reader = UringReader::open(path, cfg)?;
    let len = usize::try_from(reader.len).map_err(|_| {
        Error::io(
            "read",
            path,
            io::Error::new(io::ErrorKind::OutOfMemory, "file larger than memory"),
        )
    })?;
    let mut buf = new_buf(len);
    reader.read_at(0, &mut buf)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{disk_dir, pattern, small_cfg};
    use super::super::write_file_atomic;
    use super::*;

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
}
