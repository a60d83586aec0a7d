//! Storage tiers: where a staged checkpoint is persisted and where a load reads it back.
//!
//! One trait, [`Tier`] (a [`Source`] that loads read from, and more), with one implementation
//! per medium: [`disk::DiskTier`] (a local directory written through io_uring, `O_DIRECT` where
//! possible) and [`store::StoreTier`] (any `hotstart-store` backend: a directory, `memory://`,
//! S3; wrappers such as `Faults` or `Throttle` compose underneath). The engine only speaks the
//! trait. The two memory tiers of [`TierKind`] (the sidecar's own shared memory and its peers')
//! are not `Tier`s: they hold whole verified files, not objects under keys, and live in the
//! sidecar (the `hotstart-sidecar` crate).
//!
//! A tier stores objects under keys of the form `<job>/step-<N>/rank-<R>.<ext>` (see
//! [`crate::format`]). Every write is atomic on its own (rename on disk, a single PUT or a
//! completed multipart upload in a store); the engine orders them so the manifest, the commit,
//! is always written after the data it describes and removed before it.
//!
//! The trait is blocking: the store tier drives its async client on the engine's runtime. Calls
//! come from the engine's background threads, never from an async context.

pub mod disk;
pub mod store;

use crate::error::{Error, Result};
pub use crate::staging::{Region, Staged, Staging};

pub use hotstart_proto::TierKind;

/// Reads ranges of one object, keeping whatever per-reader state the medium needs (a ring).
pub trait TierReader: Send {
    /// Fills `buf` with the object's bytes at `offset`.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()>;

    /// Reads `len` bytes from `offset` on, in order, a window at a time: window `i` (as long as
    /// the first buffer, the last one shorter) goes into `bufs[i % bufs.len()]`, then `f` gets
    /// its bytes. A reader that can read ahead keeps the next windows in flight while `f` runs
    /// (the disk's does, see [`UringReader::read_windows`]); this default reads one window at a
    /// time. Stops at the first error, from the object or from `f`.
    ///
    /// [`UringReader::read_windows`]: hotstart_store::uring::UringReader::read_windows
    fn read_windows(
        &mut self,
        offset: u64,
        len: usize,
        bufs: &mut [&mut [u8]],
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        let width = bufs.first().map_or(0, |b| b.len());
        let count = bufs.len();
        for (i, at) in (0..len).step_by(width.max(1)).enumerate() {
            let n = width.min(len - at);
            let buf = match bufs.get_mut(i % count.max(1)).and_then(|b| b.get_mut(..n)) {
                Some(buf) if n > 0 => buf,
                _ => {
                    return Err(Error::Task {
                        what: "read",
                        message: format!(
                            "{count} buffers, the first {width} bytes long, cannot hold {len} bytes read in windows"
                        ),
                    });
                }
            };
            self.read_at(offset + at as u64, buf)?;
            f(buf)?;
        }
        Ok(())
    }
}

/// What a load reads a step's file from: a [`Tier`], or a file a sidecar handed over.
pub trait Source: Send + Sync {
    /// Which tier the bytes come from.
    fn kind(&self) -> TierKind;

    /// A reader of `key`, which must be `len` bytes long.
    fn reader(&self, key: &str, len: u64) -> Result<Box<dyn TierReader + '_>>;

    /// `key` as a file of this machine, opened for reading, where this source keeps it in one
    /// that is `len` bytes long: what a load into new memory maps privately instead of reading
    /// (see [`crate::Plan`]). None for a source without local files.
    fn local_file(&self, _key: &str, _len: u64) -> Option<std::fs::File> {
        None
    }
}

/// One place checkpoints are kept.
pub trait Tier: Source {
    /// Writes a safetensors file atomically (all or nothing under `key`). Called as soon as
    /// staging starts: a tier may write the prefix already staged ([`Staging::prefix`]) while
    /// the rest is copied, or wait for the whole file ([`Staging::complete`]). An error from
    /// either (staging failed) must leave nothing under `key`.
    fn put_file(&self, key: &str, data: &Staging) -> Result<()>;

    /// Writes a manifest atomically.
    fn put_manifest(&self, key: &str, json: Vec<u8>) -> Result<()>;

    /// A manifest's bytes, `None` when it does not exist; errors on one larger than
    /// [`crate::format::MAX_MANIFEST_LEN`].
    fn get_manifest(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Whether an object exists.
    fn exists(&self, key: &str) -> Result<bool>;

    /// Steps that have a `step-<N>` directory (or prefix) under `job`, in any state.
    fn list_steps(&self, job: &str) -> Result<Vec<u64>>;

    /// Every object under `prefix` (a key prefix ending in `/`, or empty for all), recursively:
    /// `(key, size)` with keys relative to the tier's root, sorted. On disk this includes the
    /// hidden temporary files of writes in progress or interrupted.
    fn list_objects(&self, prefix: &str) -> Result<Vec<(String, u64)>>;

    /// Removes one rank's objects of one step: manifest first, so a torn removal never leaves a
    /// commit without its data; leftovers of interrupted writes too.
    fn remove_rank(&self, job: &str, step: u64, rank: u32) -> Result<()>;

    /// The local file that holds `key`, for a tier kept in local files.
    fn local_path(&self, _key: &str) -> Option<std::path::PathBuf> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object held in memory, read with the trait's default windows.
    struct Memory(Vec<u8>);

    impl TierReader for Memory {
        fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
            let at = offset as usize;
            buf.copy_from_slice(&self.0[at..at + buf.len()]);
            Ok(())
        }
    }

    #[test]
    fn default_windows_cover_the_range_in_order_and_stop_at_an_error() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut r = Memory(data.clone());
        let (mut a, mut b) = (vec![0; 3000], vec![0; 3000]);
        let mut got = Vec::new();
        r.read_windows(5, 9_000, &mut [&mut a, &mut b], &mut |w| {
            got.push(w.to_vec());
            Ok(())
        })
        .unwrap();
        assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), [3000; 3]);
        assert!(got.concat() == data[5..9_005]);

        let mut calls = 0;
        let err = r
            .read_windows(0, 9_000, &mut [&mut a], &mut |_| {
                calls += 1;
                Err(Error::Task {
                    what: "test",
                    message: "stop".into(),
                })
            })
            .unwrap_err();
        assert!(matches!(err, Error::Task { what: "test", .. }) && calls == 1);

        let mut empty: [&mut [u8]; 0] = [];
        let err = r
            .read_windows(0, 10, &mut empty, &mut |_| Ok(()))
            .unwrap_err();
        assert!(err.to_string().contains("cannot hold"), "{err}");
    }
}
