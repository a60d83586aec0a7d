//! [`AtomicFileWriter::write_aligned`]: writes straight from the caller's memory, no copy.
//!
//! The copying path ([`AtomicFileWriter::write`]) moves every byte through the writer's pool,
//! which costs a memcpy of the whole file: for a checkpoint shard that is already sitting in a
//! page-aligned staging buffer, that copy is as expensive as the staging copy itself. Here the
//! kernel reads the caller's buffer directly:
//!
//! 1. **Eligibility.** The writer must be at a block boundary (no partially filled pool buffer),
//!    and, in direct mode, the caller's buffer must start on a 4096-byte boundary (the file
//!    offset always is at a block boundary). Otherwise the call falls back to the copying path,
//!    which gives the same file, only slower.
//! 2. **The ring is ours.** Pool writes still in flight are waited for first, so every
//!    completion reaped here belongs to a request into the caller's buffer.
//! 3. **Blocks with queue depth.** The aligned body (the whole buffer in buffered mode; its
//!    multiple of 4096 bytes in direct mode) is cut into `block_size` requests at consecutive
//!    file offsets, up to `queue_depth` in flight; each completion is settled like a pool write
//!    (short writes resubmitted for the rest, a refused direct write retried buffered, errors
//!    reported) and frees a slot for the next block. Preallocation grows the file ahead, as for
//!    the pool's blocks.
//! 4. **Never return with a request in flight.** The caller's slice is only borrowed for the
//!    call, so on every path, errors included, the call waits for all its requests before it
//!    returns; if even waiting fails the process aborts rather than let the kernel read freed
//!    memory (as [`UringReader::read_at`](super::super::UringReader::read_at) does).
//! 5. **The tail.** The last bytes that are not a multiple of 4096 (direct mode) go through the
//!    copying path into a pool buffer, zero-padded and cut back on commit as usual.

use io_uring::{opcode, types};
use std::os::fd::AsRawFd;
use tracing::error;

use super::{AtomicFileWriter, WriteSlot, WriterState, settle_write};
use crate::error::{Error, Result};
use crate::uring::ALIGN;

/// Marks the `user_data` of requests into the caller's buffer (pool requests carry a bare index).
const IN_PLACE: u64 = 1 << 63;

impl AtomicFileWriter {
    /// Appends `data`, writing it to the file straight from the caller's memory where possible:
    /// when the writer is at a block boundary and, in direct mode, `data` starts on a 4096-byte
    /// boundary (an [`AlignedBuf`](crate::uring::AlignedBuf) or a page-aligned slice of one).
    /// Anything else falls back to [`write`](Self::write)'s copying path; the file is the same
    /// either way. Returns once every byte has been handed to the kernel (the in-place part is
    /// written; a tail shorter than 4096 bytes may still sit in the pool until commit).
    ///
    /// After an error the writer is unusable, as after a failed `write`.
    pub fn write_aligned(&mut self, data: &[u8]) -> Result<()> {
        self.ensure_open()?;
        let result = self.write_aligned_inner(data);
        if result.is_err() {
            self.state = WriterState::Failed;
        }
        result
    }

    /// Bytes written so far straight from callers' memory by [`write_aligned`](Self::write_aligned).
    pub fn written_in_place(&self) -> u64 {
        self.in_place
    }

    fn write_aligned_inner(&mut self, data: &[u8]) -> Result<()> {
        let aligned = (data.as_ptr() as usize).is_multiple_of(ALIGN);
        if self.filling.is_some() || (self.mode.on && !aligned) {
            return self.write_inner(data);
        }
        let body = if self.mode.on {
            data.len() / ALIGN * ALIGN
        } else {
            data.len()
        };
        if body > 0 {
            while self.ring.in_flight > 0 {
                self.reap(self.ring.in_flight)?;
            }
            self.write_in_place(&data[..body])?;
        }
        self.write_inner(&data[body..])
    }

    /// Writes all of `body` at `next_offset` from the caller's memory; see the module docs.
    fn write_in_place(&mut self, body: &[u8]) -> Result<()> {
        let start = self.next_offset;
        let result = self.write_blocks(body, start);
        if self.ring.in_flight > 0 {
            // Only reached after an error: the kernel may still read `body`.
            if let Err(e) = self.ring.drain() {
                error!(path = %self.path.display(), error = %e, "cannot wait for io_uring writes from the caller's buffer; aborting");
                std::process::abort();
            }
        }
        result?;
        self.next_offset = start + body.len() as u64;
        self.len += body.len() as u64;
        self.in_place += body.len() as u64;
        Ok(())
    }

    /// Submits `body` in blocks at `start..` with up to `queue_depth` in flight and waits for
    /// them all; on error, returns at once (requests may still be in flight).
    fn write_blocks(&mut self, body: &[u8], start: u64) -> Result<()> {
        let depth = self.slots.len();
        let mut slots = vec![WriteSlot::default(); depth];
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut next = 0usize;
        loop {
            while next < body.len() {
                let Some(j) = free.pop() else { break };
                let len = self.block_size.min(body.len() - next);
                let offset = start + next as u64;
                self.preallocate_for(offset, offset + len as u64);
                slots[j] = WriteSlot {
                    offset,
                    len,
                    done: 0,
                    direct: self.mode.on,
                };
                self.push_in_place(body, start, j, &slots[j])?;
                next += len;
            }
            if self.ring.in_flight == 0 {
                return Ok(());
            }
            let done = self
                .ring
                .wait(1)
                .map_err(|e| Error::io("wait for writes to", &self.path, e))?;
            let mut result = Ok(());
            for &(tag, res) in &done {
                let j = (tag & !IN_PLACE) as usize;
                debug_assert!(tag & IN_PLACE != 0 && j < depth, "foreign completion {tag}");
                let res = self.maybe_inject(slots[j].direct, res);
                let finished = settle_write(
                    &mut self.mode,
                    &self.file,
                    &self.path,
                    &self.tmp_path,
                    &mut slots[j],
                    res,
                );
                result = match finished {
                    Ok(true) => {
                        free.push(j);
                        Ok(())
                    }
                    Ok(false) => self.push_in_place(body, start, j, &slots[j]),
                    Err(e) => Err(e),
                };
                if result.is_err() {
                    break;
                }
            }
            self.ring.recycle(done);
            // Resubmitted requests reach the kernel with the next wait.
            result?;
        }
    }

    /// Queues the rest of `slot`'s write, whose bytes are `body[slot.offset - start..]`.
    fn push_in_place(&mut self, body: &[u8], start: u64, j: usize, slot: &WriteSlot) -> Result<()> {
        let from = (slot.offset - start) as usize + slot.done;
        let rest = &body[from..from + (slot.len - slot.done)];
        let sqe = opcode::Write::new(
            types::Fd(self.file.as_raw_fd()),
            rest.as_ptr(),
            // block_size <= 1 GiB, checked by UringConfig::check.
            rest.len() as u32,
        )
        .offset(slot.offset + slot.done as u64)
        .build()
        .user_data(IN_PLACE | j as u64);
        // SAFETY: the request reads `rest`, a live sub-slice of the caller's `body`, which is
        // borrowed (shared, so nobody writes it) for the whole `write_aligned` call; that call
        // does not return before this request's completion is reaped: `write_in_place` drains
        // the ring on every path and aborts the process if even that fails. The descriptor is
        // `self.file`, open for at least as long.
        unsafe { self.ring.push(&sqe) }.map_err(|e| Error::io("write", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::super::super::testutil::{direct_supported, disk_dir, names, pattern, small_cfg};
    use super::super::super::{AlignedBuf, UringConfig, read_all};
    use super::*;

    fn aligned(data: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(data.len() + ALIGN);
        buf[..data.len()].copy_from_slice(data);
        buf
    }

    /// Writes `pieces` of `data` through `write_aligned` (each piece starting at `data`'s offset
    /// in `buf`), commits, and checks the bytes and how many went in place.
    fn write_pieces(cfg: &UringConfig, data: &[u8], cuts: &[usize], shift: usize) -> u64 {
        let dir = disk_dir();
        let path = dir.path().join("f");
        let mut buf = AlignedBuf::zeroed(data.len() + shift + ALIGN);
        buf[shift..shift + data.len()].copy_from_slice(data);
        let src = &buf[shift..shift + data.len()];
        let mut w = AtomicFileWriter::create(&path, cfg).unwrap();
        let mut at = 0;
        for &cut in cuts.iter().chain([&data.len()]) {
            w.write_aligned(&src[at..cut]).unwrap();
            at = cut;
        }
        assert_eq!(w.len(), data.len() as u64);
        let in_place = w.written_in_place();
        assert_eq!(w.commit().unwrap(), data.len() as u64);
        assert!(fs::read(&path).unwrap() == data, "bytes differ");
        assert!(read_all(&path, cfg).unwrap() == data);
        assert_eq!(names(dir.path()), ["f"]);
        in_place
    }

    #[test]
    fn aligned_buffers_are_written_in_place() {
        let dir = disk_dir();
        let direct = direct_supported(dir.path());
        for cfg in [UringConfig::default(), small_cfg()] {
            let bs = cfg.block_size;
            for (seed, len) in [0, 1, 4096, 4097, bs, 3 * bs + 4095, 20 * bs + 12_345]
                .into_iter()
                .enumerate()
            {
                let data = pattern(len, 300 + seed as u64);
                let in_place = write_pieces(&cfg, &data, &[], 0);
                let expect = if direct { len / ALIGN * ALIGN } else { len };
                assert_eq!(in_place, expect as u64, "len {len}");
            }
        }
    }

    #[test]
    fn mixes_with_copying_writes() {
        let cfg = small_cfg();
        let data = pattern(10 * cfg.block_size + 777, 31);
        let dir = disk_dir();
        let path = dir.path().join("f");
        let buf = aligned(&data);
        let mut w = AtomicFileWriter::create(&path, &cfg).unwrap();
        // A copying write that leaves a partial block: the next in-place write must copy too.
        w.write(&buf[..5000]).unwrap();
        w.write_aligned(&buf[5000..cfg.block_size]).unwrap();
        assert_eq!(w.written_in_place(), 0, "not at a block boundary");
        // Now at a block boundary, and the source offset is a multiple of 4096.
        w.write_aligned(&buf[cfg.block_size..8 * cfg.block_size])
            .unwrap();
        assert_eq!(w.written_in_place(), 7 * cfg.block_size as u64);
        w.write(&buf[8 * cfg.block_size..9 * cfg.block_size])
            .unwrap();
        w.write_aligned(&buf[9 * cfg.block_size..data.len()])
            .unwrap();
        w.commit().unwrap();
        assert!(fs::read(&path).unwrap() == data);
    }

    #[test]
    fn unaligned_input_falls_back_to_copying() {
        let dir = disk_dir();
        let cfg = small_cfg();
        let data = pattern(5 * cfg.block_size + 3, 37);
        let in_place = write_pieces(&cfg, &data, &[], 1);
        if direct_supported(dir.path()) {
            assert_eq!(in_place, 0, "an unaligned buffer is copied");
        }
        // A buffered writer needs no alignment.
        let buffered = UringConfig {
            direct: false,
            ..cfg
        };
        assert_eq!(
            write_pieces(&buffered, &data, &[3, 70_000], 1),
            data.len() as u64
        );
    }

    #[test]
    fn refused_direct_write_is_retried_buffered_in_place() {
        let dir = disk_dir();
        if !direct_supported(dir.path()) {
            panic!("{} does not support O_DIRECT", dir.path().display());
        }
        let path = dir.path().join("f");
        let cfg = small_cfg();
        let data = pattern(9 * cfg.block_size + 4096, 41);
        let buf = aligned(&data);
        let mut w = AtomicFileWriter::create(&path, &cfg).unwrap();
        w.inject_einval = true;
        w.write_aligned(&buf[..data.len()]).unwrap();
        assert!(!w.is_direct(), "fell back after the refused write");
        assert_eq!(w.written_in_place(), data.len() as u64);
        w.commit().unwrap();
        assert!(fs::read(&path).unwrap() == data);
    }

    #[test]
    fn tmpfs_writes_in_place_buffered() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("f");
        let cfg = UringConfig::default();
        let data = pattern(3 * cfg.block_size + 5, 43);
        let buf = aligned(&data);
        let mut w = AtomicFileWriter::create(&path, &cfg).unwrap();
        assert!(!w.is_direct());
        w.write_aligned(&buf[1..data.len()]).unwrap();
        assert_eq!(w.written_in_place(), data.len() as u64 - 1);
        w.commit().unwrap();
        assert!(fs::read(&path).unwrap() == data[1..]);
    }
}
