//! [`UringReader`]: one file read through io_uring with many requests in flight, straight into
//! the caller's buffer where alignment allows. The algorithm is described in the
//! [module documentation](super).

use std::collections::VecDeque;
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
    /// The window of [`UringReader::read_windows`] this request fills.
    window: usize,
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
            window: 0,
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

    /// Every request of the range has been handed out.
    fn is_done(&self) -> bool {
        self.pos >= self.stop
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
            window: 0,
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
                window: 0,
            };
            (slot, end)
        };
        self.pos = next;
        Some(slot)
    }
}

/// One window of [`UringReader::read_windows`] being read.
struct Window {
    plan: Plan,
    /// Start of the window's buffer.
    base: *mut u8,
    len: usize,
    /// Requests submitted and not yet complete.
    in_flight: usize,
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
        Self::from_file(open_for_reading(path, cfg)?, path, cfg)
    }

    /// Reads `file`, opened elsewhere (by [`open_for_reading`] in another process that handed
    /// the descriptor over, say), with direct I/O when it was opened with `O_DIRECT`. `path`
    /// names it in errors.
    pub fn from_file(file: File, path: &Path, cfg: &UringConfig) -> Result<Self> {
        cfg.check(path)?;
        let ring = cfg.ring(path)?;
        // SAFETY: F_GETFL on a descriptor `file` owns.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(Error::io("fcntl", path, io::Error::last_os_error()));
        }
        let direct = flags & libc::O_DIRECT != 0;
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
        self.read_windows(offset, n, &mut [buf], |_| Ok::<(), Error>(()))
    }

    /// Reads `len` bytes from `offset` on, in order, a window at a time: window `i` (as long as
    /// the first buffer, the last one shorter) goes into `bufs[i % bufs.len()]`, and `f` gets
    /// each window's bytes as soon as it and every window before it are in. The windows after it
    /// are read while `f` runs, as many as there are other buffers; a buffer is read into again
    /// once `f` has returned from the window before. So `f` can hash or copy one window while
    /// the disk fills the next, with no thread of its own.
    ///
    /// Stops at the first error, from the file (as an `E`) or from `f`, and returns it once no
    /// request is in flight; `f` is not called again after it fails. A range running past the
    /// end of the file is an `UnexpectedEof` error, and a buffer shorter than its window an
    /// `InvalidInput` one, both before anything is read.
    pub fn read_windows<E: From<Error>>(
        &mut self,
        offset: u64,
        len: u64,
        bufs: &mut [&mut [u8]],
        mut f: impl FnMut(&[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.len => end,
            _ => return Err(self.eof(offset, len).into()),
        };
        if len == 0 {
            return Ok(());
        }
        let width = bufs.first().map_or(0, |b| b.len() as u64);
        let count = if width == 0 { 0 } else { len.div_ceil(width) };
        let short = (0..count.min(bufs.len() as u64)).find(|&i| {
            let want = width.min(len - i * width);
            (bufs[i as usize].len() as u64) < want
        });
        if count == 0 || short.is_some() {
            return Err(E::from(Error::io(
                "read",
                &self.path,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} buffers, the first {width} bytes long, cannot hold {len} bytes read in windows of the first one's length",
                        bufs.len()
                    ),
                ),
            )));
        }
        // From here on the buffers are only reached through these pointers, by the kernel, by
        // bounce copies and by `f`.
        let bases: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        // Windows started and not yet handed to `f`, oldest first: `windows[0]` is window
        // number `delivered`.
        let mut windows: VecDeque<Window> = VecDeque::with_capacity(bases.len());
        let (mut started, mut delivered) = (0u64, 0u64);
        let mut first_err: Option<E> = None;
        loop {
            while first_err.is_none() && started < count && windows.len() < bases.len() {
                let start = offset + started * width;
                let stop = (start + width).min(end);
                let base = bases[(started % bases.len() as u64) as usize];
                windows.push_back(Window {
                    plan: Plan::new(start, stop, base as usize, self.mode.on, self.block_size),
                    base,
                    len: (stop - start) as usize,
                    in_flight: 0,
                });
                started += 1;
            }
            for (k, window) in windows.iter_mut().enumerate() {
                while first_err.is_none() && !self.free_slots.is_empty() {
                    let Some(mut slot) = window.plan.next() else {
                        break;
                    };
                    let Some(idx) = self.free_slots.pop() else {
                        break;
                    };
                    slot.window = k + (delivered as usize);
                    self.slots[idx] = slot;
                    // SAFETY: `window.base` is the start of the window's buffer, borrowed
                    // exclusively for this call and only touched through `bases` from here on;
                    // the plan only yields slots inside the window, whose buffer `f` is not
                    // given until every one of them has completed; this function waits for
                    // every request before returning.
                    match unsafe { self.push_read(idx, window.base) } {
                        Ok(()) => window.in_flight += 1,
                        Err(e) => {
                            self.release(idx);
                            first_err = Some(e.into());
                        }
                    }
                }
            }
            if let Some(front) = windows.front()
                && first_err.is_none()
                && front.plan.is_done()
                && front.in_flight == 0
            {
                // SAFETY: every request into this window has completed and none is queued, so
                // nothing else touches these `len` bytes (inside its buffer, see above) until the
                // buffer's next window is started, after `f` returns.
                let bytes = unsafe { std::slice::from_raw_parts(front.base, front.len) };
                if let Err(e) = f(bytes) {
                    first_err = Some(e);
                }
                windows.pop_front();
                delivered += 1;
                if delivered == count {
                    break;
                }
                continue;
            }
            if self.ring.in_flight == 0 {
                if first_err.is_none() && self.free_slots.is_empty() {
                    // Nothing in flight and no slot to submit with: a slot was lost. Fail
                    // rather than spin.
                    first_err = Some(E::from(Error::io(
                        "read",
                        &self.path,
                        io::Error::other("no request slot left to read with"),
                    )));
                }
                if first_err.is_some() {
                    break;
                }
                continue;
            }
            // Submits what was queued (here and in `complete_read`) and waits, in one call.
            let done = match self.ring.wait(1) {
                Ok(done) => done,
                Err(e) => {
                    // Requests still point into the buffers, and returning would hand them back
                    // to the caller while the kernel may write into them.
                    error!(path = %self.path.display(), error = %e, "cannot wait for io_uring reads; aborting");
                    std::process::abort();
                }
            };
            for &(idx, res) in &done {
                let window = &mut windows[self.slots[idx as usize].window - delivered as usize];
                // SAFETY: as for `push_read` above; the slot's window is still started, since a
                // window is handed to `f` only when none of its requests is in flight.
                match unsafe { self.complete_read(idx as usize, res, window.base) } {
                    Ok(false) => {}
                    Ok(true) => window.in_flight -= 1,
                    Err(e) => {
                        window.in_flight -= 1;
                        first_err.get_or_insert(e.into());
                    }
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

    /// Handles one completion: resubmits a short or refused read (`Ok(false)`: still in
    /// flight), or copies a finished bounce read out and frees the slot (`Ok(true)`). On an error
    /// the slot is free too.
    ///
    /// # Safety
    /// As for [`push_read`](Self::push_read).
    unsafe fn complete_read(&mut self, idx: usize, res: i32, base: *mut u8) -> Result<bool> {
        let slot = &mut self.slots[idx];
        let completion =
            match self
                .mode
                .complete(&self.file, &self.path, "read", res, &mut slot.direct)
            {
                Ok(c) => c,
                Err(e) => {
                    self.release(idx);
                    return Err(Error::io("turn off O_DIRECT for", &self.path, e));
                }
            };
        let n = match completion {
            Completion::Transferred(n) => n,
            Completion::Resubmit => {
                // SAFETY: forwarded from this function's contract.
                return unsafe { self.push_read_or_release(idx, base) }.map(|()| false);
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
            return unsafe { self.push_read_or_release(idx, base) }.map(|()| false);
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
        Ok(true)
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

/// Opens `path` for reading as [`UringReader::open`] does: with `O_DIRECT` where `cfg` asks
/// for it and the file system takes it.
pub fn open_for_reading(path: &Path, cfg: &UringConfig) -> Result<File> {
    open_maybe_direct(path, cfg.direct, |direct| {
        let mut opts = OpenOptions::new();
        opts.read(true);
        if direct {
            opts.custom_flags(libc::O_DIRECT);
        }
        opts.open(path)
    })
    .map(|(file, _)| file)
    .map_err(|e| Error::io("open", path, e))
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
    fn read_windows_hands_out_every_window_in_order_through_reused_buffers() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        let cfg = small_cfg();
        let bs = cfg.block_size;
        let len = 9 * bs + 4321;
        let data = pattern(len, 5);
        write_file_atomic(&path, &data, &cfg).unwrap();
        for direct in [true, false] {
            let cfg = UringConfig {
                direct,
                ..cfg.clone()
            };
            let mut reader = UringReader::open(&path, &cfg).unwrap();
            // Windows wider and narrower than a request, buffers aligned and not, one buffer
            // (read, hand out, read again) and more than the queue holds requests for.
            for (offset, n, width, count, shift) in [
                (0, len, 2 * bs, 2, 0),
                (4096, len - 4096, bs + 4096, 3, 0),
                (1, len - 1, 3 * bs, 2, 1),
                (777, 5 * bs, bs / 2, 1, 0),
                (0, len, bs, 12, 0),
                (len - 10, 10, 4096, 2, 3),
            ] {
                let mut store: Vec<AlignedBuf> = (0..count)
                    .map(|_| AlignedBuf::zeroed(width + ALIGN))
                    .collect();
                let mut bufs: Vec<&mut [u8]> = store
                    .iter_mut()
                    .map(|b| &mut b[shift..shift + width])
                    .collect();
                let mut got = Vec::new();
                let mut sizes = Vec::new();
                reader
                    .read_windows(offset as u64, n as u64, &mut bufs, |w| {
                        got.extend_from_slice(w);
                        sizes.push(w.len());
                        Ok::<(), Error>(())
                    })
                    .unwrap();
                let case = format!("direct={direct} offset={offset} n={n} width={width}");
                assert!(got == data[offset..offset + n], "{case}");
                let last = sizes.pop().unwrap();
                assert!(sizes.iter().all(|&s| s == width), "{case}: {sizes:?}");
                assert!(last > 0 && last <= width, "{case}: last window {last}");
            }
        }
    }

    #[test]
    fn read_windows_stops_at_the_callers_error_and_refuses_short_buffers() {
        let dir = disk_dir();
        let path = dir.path().join("f");
        let cfg = small_cfg();
        let data = pattern(8 * cfg.block_size, 9);
        write_file_atomic(&path, &data, &cfg).unwrap();
        let mut reader = UringReader::open(&path, &cfg).unwrap();
        let width = cfg.block_size;
        let mut a = AlignedBuf::zeroed(width);
        let mut b = AlignedBuf::zeroed(width);
        let mut calls = 0;
        let err = reader
            .read_windows(0, data.len() as u64, &mut [&mut a, &mut b], |w| {
                calls += 1;
                assert!(w == &data[(calls - 1) * width..calls * width]);
                if calls == 3 {
                    Err(Stop::Caller("enough"))
                } else {
                    Ok(())
                }
            })
            .map_err(|e| match e {
                Stop::Caller(why) => why,
                Stop::Read(e) => panic!("read error {e}"),
            })
            .unwrap_err();
        assert_eq!((err, calls), ("enough", 3));
        // The reader is whole again: every slot came back.
        let mut all = vec![0; data.len()];
        reader.read_at(0, &mut all).unwrap();
        assert!(all == data);

        // A second buffer shorter than its window: refused before anything is read.
        let mut short = vec![0; width - 1];
        let err = reader
            .read_windows(
                0,
                2 * width as u64,
                &mut [&mut a, &mut short],
                |_| -> Result<(), Stop> { panic!("nothing may be handed out") },
            )
            .unwrap_err();
        match err {
            Stop::Read(Error::Io { source, .. }) => {
                assert_eq!(source.kind(), io::ErrorKind::InvalidInput)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Why a windowed read stopped, in the tests above.
    #[derive(Debug)]
    enum Stop {
        Read(Error),
        Caller(&'static str),
    }

    impl From<Error> for Stop {
        fn from(e: Error) -> Self {
            Stop::Read(e)
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
