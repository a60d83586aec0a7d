//! Local spill files, and the one limit on the disk they may use together.
//!
//! A file written through the mount keeps its bytes in a local, unnamed temporary file (in
//! `spill_dir`) in two cases: while it streams to the store, as a **copy** (the "tee") so that a
//! writer that later seeks back can abort the multipart upload and go on from local disk; and
//! after such a seek back, as the file itself, uploaded whole at commit. Both are written with
//! plain positioned writes, so they mostly live in the page cache and are gone at close without
//! ever reaching the disk.
//!
//! Every spill file reserves its length (holes included) from a [`SpillSpace`] shared by the
//! mount before it grows, so all of them together never hold more than `max_spill` bytes. A
//! reservation that does not fit fails with [`SpillError::Full`] at once (no waiting: the bytes are
//! already in the application's hands). The file and its reservation go when the handle drops it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a spill file could not take more bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpillError {
    /// The mount's spill limit is reached.
    #[error(
        "local spill space exhausted: all spill files together may hold {limit} bytes (--max-spill-mib)"
    )]
    Full { limit: u64 },
    /// Local file I/O failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl SpillError {
    /// ENOSPC for a full limit or a full disk, EIO for other I/O errors.
    pub fn errno(&self) -> i32 {
        match self {
            SpillError::Full { .. } => libc::ENOSPC,
            SpillError::Io(e) if e.raw_os_error() == Some(libc::ENOSPC) => libc::ENOSPC,
            SpillError::Io(_) => libc::EIO,
        }
    }
}

/// The directory and byte limit shared by every spill file of a mount. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SpillSpace {
    inner: Arc<SpaceInner>,
}

#[derive(Debug)]
struct SpaceInner {
    dir: Option<PathBuf>,
    capacity: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

impl SpillSpace {
    /// At most `capacity` bytes in spill files under `dir` (the system temp directory if `None`).
    pub fn new(dir: Option<PathBuf>, capacity: u64) -> SpillSpace {
        SpillSpace {
            inner: Arc::new(SpaceInner {
                dir,
                capacity,
                used: AtomicU64::new(0),
                peak: AtomicU64::new(0),
            }),
        }
    }

    /// The limit in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Bytes reserved by spill files now.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// The most bytes ever reserved at once.
    pub fn peak(&self) -> u64 {
        self.inner.peak.load(Ordering::Relaxed)
    }

    fn take(&self, n: u64) -> Result<(), SpillError> {
        let cap = self.inner.capacity;
        let used = &self.inner.used;
        let mut cur = used.load(Ordering::Relaxed);
        loop {
            let next = cur.checked_add(n).filter(|&v| v <= cap);
            let Some(next) = next else {
                return Err(SpillError::Full { limit: cap });
            };
            match used.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    self.inner.peak.fetch_max(next, Ordering::Relaxed);
                    return Ok(());
                }
                Err(now) => cur = now,
            }
        }
    }

    fn give(&self, n: u64) {
        self.inner.used.fetch_sub(n, Ordering::Relaxed);
    }

    /// A new, empty, unnamed spill file (deleted by the kernel when closed, even after a crash).
    pub fn create(&self) -> Result<SpillFile, SpillError> {
        if self.inner.capacity == 0 {
            return Err(SpillError::Full { limit: 0 });
        }
        let file = match &self.inner.dir {
            Some(dir) => tempfile::tempfile_in(dir),
            None => tempfile::tempfile(),
        }?;
        Ok(SpillFile {
            file,
            space: self.clone(),
            reserved: 0,
        })
    }
}

/// One spill file and the bytes it has reserved from its [`SpillSpace`].
#[derive(Debug)]
pub struct SpillFile {
    file: File,
    space: SpillSpace,
    reserved: u64,
}

impl SpillFile {
    /// Makes sure `len` bytes are reserved (a file never gives back space while it grows).
    fn reserve(&mut self, len: u64) -> Result<(), SpillError> {
        if len > self.reserved {
            self.space.take(len - self.reserved)?;
            self.reserved = len;
        }
        Ok(())
    }

    /// Writes `data` at `offset`, reserving space first.
    pub fn write_at(&mut self, data: &[u8], offset: u64) -> Result<(), SpillError> {
        self.reserve(offset + data.len() as u64)?;
        self.file.write_all_at(data, offset)?;
        Ok(())
    }

    /// Fills `out` from `offset`.
    pub fn read_at(&self, out: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(out, offset)
    }

    /// Sets the length (zeros when growing), keeping the reservation in step.
    pub fn set_len(&mut self, len: u64) -> Result<(), SpillError> {
        self.reserve(len)?;
        self.file.set_len(len)?;
        self.space.give(self.reserved - len);
        self.reserved = len;
        Ok(())
    }
}

impl Drop for SpillFile {
    fn drop(&mut self) {
        self.space.give(self.reserved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_holds_across_files_and_comes_back_on_drop() {
        let space = SpillSpace::new(None, 100);
        let mut a = space.create().unwrap();
        a.write_at(&[1; 60], 0).unwrap();
        let mut b = space.create().unwrap();
        let err = b.write_at(&[2; 50], 0).unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC, "{err}");
        b.write_at(&[2; 40], 0).unwrap();
        assert_eq!(space.used(), 100);
        a.set_len(10).unwrap();
        assert_eq!(space.used(), 50);
        let mut out = [0u8; 10];
        a.read_at(&mut out, 0).unwrap();
        assert_eq!(out, [1; 10]);
        drop((a, b));
        assert_eq!(space.used(), 0);
        assert_eq!(space.peak(), 100);
        assert!(SpillSpace::new(None, 0).create().is_err());
    }
}
