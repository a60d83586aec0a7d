//! The local disk tier: `<root>/<job>/step-<N>/rank-<R>.*`, written through io_uring.
//!
//! The safetensors file goes through [`AtomicFileWriter::write_aligned`] (temporary name,
//! `O_DIRECT` writes of `block_size` with `queue_depth` in flight issued straight from the
//! page-aligned staging buffer, with no copy, as soon as 64 MiB more are staged, so writing
//! overlaps staging; `fdatasync`, rename, directory fsync), then the
//! manifest the same way; so after a crash the final names show whole files or nothing, and a
//! manifest is never on disk without its data. Reads use one [`UringReader`] per reader; chunk
//! slices of a page-aligned buffer at chunk-aligned offsets go from disk straight into the
//! destination.

use std::fs;
use std::io;
use std::path::PathBuf;

use hotstart_store::uring::{AtomicFileWriter, UringConfig, UringReader, write_file_atomic};

use super::{Source, Staging, Tier, TierKind, TierReader};
use crate::error::{Error, Result};
use crate::format::{self, MAX_MANIFEST_LEN};

/// The data file is written as staging goes, in calls of at least this many bytes (a multiple
/// of the `O_DIRECT` alignment) or the rest of the file.
const WRITE_PIECE: usize = 64 << 20;

/// A local directory holding checkpoints.
#[derive(Debug, Clone)]
pub struct DiskTier {
    root: PathBuf,
    uring: UringConfig,
    kind: TierKind,
}

impl DiskTier {
    /// A tier rooted at `root` (created when first written).
    pub fn new(root: impl Into<PathBuf>, uring: UringConfig) -> DiskTier {
        DiskTier {
            root: root.into(),
            uring,
            kind: TierKind::Disk,
        }
    }

    /// The store tier of a store that is a local directory (the embedded default), written and
    /// read as the disk tier is: the store's own layout (key `a/b` is `<dir>/a/b`), each file
    /// appearing whole under its name (a temporary name, `fdatasync`, rename, directory fsync:
    /// durable, which the store's own local writer is not), at the disk's speed rather than
    /// through the object store's buffered writes.
    pub fn for_local_store(dir: impl Into<PathBuf>, uring: UringConfig) -> DiskTier {
        DiskTier {
            kind: TierKind::Store,
            ..DiskTier::new(dir, uring)
        }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.root.join(key)
    }

    fn make_parent(&self, path: &std::path::Path) -> Result<()> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
        }
        Ok(())
    }

    /// Makes the directory of `path`, then runs `create`, which makes a file in it; again, up to
    /// three more times, when the directory was gone by then. Every rank's files of a step
    /// share its directory, on a node's disk and in a local store that every node writes, and
    /// the last rank to remove its files from a step removes the directory too
    /// ([`Tier::remove_rank`]): that can land between another rank's making the directory and
    /// creating its file there.
    fn in_parent<T>(
        &self,
        path: &std::path::Path,
        what: &'static str,
        mut create: impl FnMut() -> std::result::Result<T, hotstart_store::Error>,
    ) -> Result<T> {
        let mut tries = 0;
        loop {
            self.make_parent(path)?;
            match create() {
                Err(e) if tries < 3 && no_such_directory(&e) => tries += 1,
                res => return res.map_err(|e| store_err(what, path, e)),
            }
        }
    }
}

/// Whether `e` is a file-system call that found no such file or directory.
fn no_such_directory(e: &hotstart_store::Error) -> bool {
    matches!(e.root(), hotstart_store::Error::Io { source, .. } if source.kind() == io::ErrorKind::NotFound)
}

fn store_err(what: &'static str, path: &std::path::Path, e: hotstart_store::Error) -> Error {
    Error::store(what, path.display().to_string(), e)
}

impl Source for DiskTier {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn reader(&self, key: &str, len: u64) -> Result<Box<dyn TierReader + '_>> {
        let path = self.path(key);
        let r = UringReader::open(&path, &self.uring).map_err(|e| store_err("open", &path, e))?;
        DiskReader::boxed(r, path, len)
    }

    fn local_file(&self, key: &str, len: u64) -> Option<fs::File> {
        of_len(fs::File::open(self.path(key)).ok()?, len)
    }
}

/// `file` when it is `len` bytes long.
fn of_len(file: fs::File, len: u64) -> Option<fs::File> {
    (file.metadata().ok()?.len() == len).then_some(file)
}

impl Tier for DiskTier {
    fn put_file(&self, key: &str, data: &Staging) -> Result<()> {
        let path = self.path(key);
        let mut w = self.in_parent(&path, "create", || {
            AtomicFileWriter::create(&path, &self.uring)
        })?;
        w.reserve(data.len() as u64)
            .map_err(|e| store_err("reserve", &path, e))?;
        // Straight from the page-aligned staging buffer (no copy into the writer's pool): as
        // soon as a piece is staged, everything staged so far in one call, so the queue only
        // drains between calls while staging is still ahead of the disk. A staging failure
        // drops the writer: no file.
        let mut done = 0;
        while done < data.len() {
            let staged = data.prefix(done + WRITE_PIECE)?;
            w.write_aligned(&staged[done..])
                .map_err(|e| store_err("write", &path, e))?;
            done = staged.len();
        }
        w.commit().map_err(|e| store_err("commit", &path, e))?;
        Ok(())
    }

    fn put_manifest(&self, key: &str, json: Vec<u8>) -> Result<()> {
        let path = self.path(key);
        self.in_parent(&path, "write manifest", || {
            write_file_atomic(&path, &json, &self.uring)
        })?;
        Ok(())
    }

    fn get_manifest(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.path(key);
        let meta = match fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("stat", &path, e)),
        };
        if meta.len() > MAX_MANIFEST_LEN {
            return Err(Error::format(
                "manifest",
                path.display().to_string(),
                format!("{} bytes exceeds {MAX_MANIFEST_LEN}", meta.len()),
            ));
        }
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("read", &path, e)),
        }
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let path = self.path(key);
        path.try_exists().map_err(|e| Error::io("stat", &path, e))
    }

    fn list_steps(&self, job: &str) -> Result<Vec<u64>> {
        let dir = self.path(job);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("list", &dir, e)),
        };
        let mut steps = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
            if let Some(step) = entry.file_name().to_str().and_then(format::parse_step_dir) {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    fn list_objects(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let mut out = Vec::new();
        let start = self.path(prefix.trim_end_matches('/'));
        let mut dirs = vec![(start, prefix.trim_end_matches('/').to_string())];
        while let Some((dir, key)) = dirs.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("list", &dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                let child = if key.is_empty() {
                    name
                } else {
                    format!("{key}/{name}")
                };
                let meta = match entry.metadata() {
                    Ok(m) => m,
                    // Removed since the directory was read.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(Error::io("stat", entry.path(), e)),
                };
                if meta.is_dir() {
                    dirs.push((entry.path(), child));
                } else if meta.is_file() {
                    out.push((child, meta.len()));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    fn remove_rank(&self, job: &str, step: u64, rank: u32) -> Result<()> {
        let dir = self.path(&format::step_prefix(job, step));
        let manifest = self.path(&format::manifest_key(job, step, rank));
        let data = self.path(&format::data_key(job, step, rank));
        for path in [&manifest, &data] {
            match fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", path, e)),
            }
        }
        // Temporary files of writes that never committed (a process killed mid-write).
        let tmp_prefixes = [
            format!(".rank-{rank}.safetensors.tmp-"),
            format!(".rank-{rank}.manifest.json.tmp-"),
        ];
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let name = entry.file_name();
                let name = name.to_string_lossy();
                if tmp_prefixes.iter().any(|p| name.starts_with(p.as_str())) {
                    let _ = fs::remove_file(entry.path());
                }
            }
        }
        // Succeeds only once every rank's files are gone.
        let _ = fs::remove_dir(&dir);
        Ok(())
    }

    fn local_path(&self, key: &str) -> Option<PathBuf> {
        Some(self.path(key))
    }
}

/// A step's file of a disk tier that another process (the sidecar) opened and handed over:
/// read as the tier's own files are, through a duplicate of its descriptor per reader, with
/// direct I/O when it was opened so.
pub(crate) struct HandedFile {
    file: fs::File,
    /// Names the file in errors.
    label: PathBuf,
    /// The tier the file belongs to.
    kind: TierKind,
    uring: UringConfig,
}

impl HandedFile {
    pub(crate) fn new(file: fs::File, label: PathBuf, kind: TierKind, uring: UringConfig) -> Self {
        HandedFile {
            file,
            label,
            kind,
            uring,
        }
    }
}

impl Source for HandedFile {
    fn kind(&self) -> TierKind {
        self.kind
    }

    fn reader(&self, _key: &str, len: u64) -> Result<Box<dyn TierReader + '_>> {
        let path = &self.label;
        let file = self
            .file
            .try_clone()
            .map_err(|e| Error::io("duplicate the descriptor of", path, e))?;
        let r = UringReader::from_file(file, path, &self.uring)
            .map_err(|e| store_err("open", path, e))?;
        DiskReader::boxed(r, path.clone(), len)
    }

    fn local_file(&self, _key: &str, len: u64) -> Option<fs::File> {
        of_len(self.file.try_clone().ok()?, len)
    }
}

struct DiskReader {
    r: UringReader,
    path: PathBuf,
}

impl DiskReader {
    /// A reader of a step's file, which must be `len` bytes long.
    fn boxed<'a>(r: UringReader, path: PathBuf, len: u64) -> Result<Box<dyn TierReader + 'a>> {
        if r.len() != len {
            return Err(Error::format(
                "safetensors file",
                path.display().to_string(),
                format!("{} bytes on disk, manifest says {len}", r.len()),
            ));
        }
        Ok(Box::new(DiskReader { r, path }))
    }
}

impl TierReader for DiskReader {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.r
            .read_at(offset, buf)
            .map_err(|e| store_err("read", &self.path, e))
    }

    fn read_windows(
        &mut self,
        offset: u64,
        len: usize,
        bufs: &mut [&mut [u8]],
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        /// Why the read stopped: the file, or the caller's `f`.
        enum Stop {
            Read(hotstart_store::Error),
            Caller(Error),
        }
        impl From<hotstart_store::Error> for Stop {
            fn from(e: hotstart_store::Error) -> Self {
                Stop::Read(e)
            }
        }
        self.r
            .read_windows(offset, len as u64, bufs, |w| f(w).map_err(Stop::Caller))
            .map_err(|stop| match stop {
                Stop::Read(e) => store_err("read", &self.path, e),
                Stop::Caller(e) => e,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another rank removing its files of a step removes the step's directory once it is empty:
    /// a write that made the directory just before finds it gone and makes it again.
    #[test]
    fn a_step_directory_removed_under_a_write_is_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DiskTier::for_local_store(dir.path(), UringConfig::default());
        let key = format::manifest_key("job", 7, 0);
        let mut removed = 0;
        tier.in_parent(&tier.path(&key), "write manifest", || {
            if removed < 2 {
                removed += 1;
                tier.remove_rank("job", 7, 1).unwrap();
            }
            write_file_atomic(&tier.path(&key), b"{}", &tier.uring)
        })
        .unwrap();
        assert_eq!(removed, 2);
        assert_eq!(tier.get_manifest(&key).unwrap().unwrap(), b"{}");

        // A directory that cannot be made is an error at once, not a loop.
        let blocked = DiskTier::new(dir.path().join("file"), UringConfig::default());
        fs::write(dir.path().join("file"), b"").unwrap();
        let err = blocked.put_manifest(&key, b"{}".to_vec()).unwrap_err();
        assert!(err.to_string().contains("create directory"), "{err}");
    }
}
