//! One writer per job and rank: the owner lock.
//!
//! Two processes that save as the same job and rank write the same keys and retire each other's
//! steps; neither can tell from its own saves. So the first save of an engine takes an exclusive
//! `flock` on `<dir>/.hotstart-owners/<job>/rank-<R>.lock`, where `dir` is the first local place
//! this rank's checkpoints go through: its disk tier, its store when that is a local directory,
//! or the directory of the sidecar's socket (shared by every process on the node that saves
//! through that sidecar). The lock file names its holder (process id, host, start time), and a
//! second process's save is refused with [`Error::SecondWriter`] naming it. The lock goes with
//! the engine, or with the process: a process killed with `kill -9` leaves nothing held, so a
//! restarted trainer takes it at once. Engines of one process share its lock, and are one writer
//! to retention: they share the record of its saves ([`writes`]).
//!
//! Locks are per node. Two writers on different nodes that share only an object store are not
//! detected (see docs/SEMANTICS.md).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::persistence::Writes;

/// A held owner lock; released when the last engine of this process holding it is dropped
/// (or when the process ends).
#[derive(Debug)]
pub(crate) struct OwnerLock {
    _file: File,
}

/// The locks this process holds. Engines of one process share them: a process that opens a
/// second engine for its rank (a new `StorageWriter` per save, say) is still one writer.
static HELD: Mutex<BTreeMap<PathBuf, Weak<OwnerLock>>> = Mutex::new(BTreeMap::new());

/// The saves of the writers this process's engines make up, by lock file: engines that share
/// an owner lock are one writer, and each one's retention must see the others' saves.
static WRITES: Mutex<BTreeMap<PathBuf, Weak<Writes>>> = Mutex::new(BTreeMap::new());

/// The saves of the writer of `job`'s `rank` under `dir` in this process, shared by every
/// engine of the process that saves there, as the lock is.
pub(crate) fn writes(dir: &Path, job: &str, rank: u32) -> Arc<Writes> {
    let Ok(w) = one_per_path(&WRITES, lock_path(dir, job, rank), |_| {
        Ok::<_, Infallible>(Writes::default())
    });
    w
}

/// This process's one `T` for `path` in `all`: the live one, or one made now (and forgotten
/// once nothing holds it).
fn one_per_path<T, E>(
    all: &Mutex<BTreeMap<PathBuf, Weak<T>>>,
    path: PathBuf,
    make: impl FnOnce(&PathBuf) -> std::result::Result<T, E>,
) -> std::result::Result<Arc<T>, E> {
    let mut all = all.lock().unwrap_or_else(PoisonError::into_inner);
    all.retain(|_, w| w.strong_count() > 0);
    if let Some(live) = all.get(&path).and_then(Weak::upgrade) {
        return Ok(live);
    }
    let made = Arc::new(make(&path)?);
    all.insert(path, Arc::downgrade(&made));
    Ok(made)
}

/// The lock file of `job`'s `rank` under `dir`.
pub(crate) fn lock_path(dir: &Path, job: &str, rank: u32) -> PathBuf {
    dir.join(".hotstart-owners")
        .join(job)
        .join(format!("rank-{rank}.lock"))
}

/// Takes the owner lock of `job`'s `rank` under `dir` (or shares this process's), or says
/// who holds it.
pub(crate) fn acquire(dir: &Path, job: &str, rank: u32) -> Result<Arc<OwnerLock>> {
    one_per_path(&HELD, lock_path(dir, job, rank), |path| {
        take(path.clone(), job, rank)
    })
}

fn take(path: PathBuf, job: &str, rank: u32) -> Result<OwnerLock> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io("create", parent, e))?;
    }
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io("open", &path, e))?;
    // SAFETY: flock on a descriptor this function owns; no memory is involved.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io("lock", &path, e));
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        let holder = holder.trim();
        return Err(Error::SecondWriter {
            job: job.to_string(),
            rank,
            holder: if holder.is_empty() {
                "a process that has not written its name yet".into()
            } else {
                holder.to_string()
            },
            path,
        });
    }
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let me = format!(
        "pid {} on {} since unix time {since}",
        std::process::id(),
        hostname()
    );
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(me.as_bytes()));
    written.map_err(|e| Error::io("write", &path, e))?;
    Ok(OwnerLock { _file: file })
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "this host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_holder_is_refused_with_its_name_and_this_process_shares_its_own() {
        let dir = tempfile::tempdir().unwrap();
        let first = acquire(dir.path(), "a/job", 3).unwrap();
        // A second engine of this process shares the lock.
        let shared = acquire(dir.path(), "a/job", 3).unwrap();
        assert!(Arc::ptr_eq(&first, &shared));
        drop((first, shared));

        // Another process's lock: an open file description of its own, holding the flock.
        let other = take(lock_path(dir.path(), "a/job", 3), "a/job", 3).unwrap();
        let err = acquire(dir.path(), "a/job", 3).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, Error::SecondWriter { rank: 3, .. }), "{err}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "{text}"
        );
        // Another rank and another job are someone else's.
        let _other_rank = acquire(dir.path(), "a/job", 4).unwrap();
        let _other_job = acquire(dir.path(), "b", 3).unwrap();
        drop(other);
        let _again = acquire(dir.path(), "a/job", 3).unwrap();
    }
}
