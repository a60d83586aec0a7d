//! Node-local coordination: file locks, and what this node put at each target.
//!
//! Lives under `<cache dir>/env/`:
//!
//! ```text
//! locks/target-<32 hex>.lock   one per target path: whoever holds it may change the target
//! locks/key-<64 hex>.lock      one per key: concurrent ensures of a key install it once
//! targets/<32 hex>.json        the target's state: key, installing or ready, its inode
//! ```
//!
//! Locks are `flock(2)` locks: the kernel drops them when the holder dies, however it dies, so a
//! crashed `ensure` never blocks the next one. Concurrent `ensure` calls on one node for one key
//! queue on these locks; the first does the work and each later one finds the target ready (or
//! the snapshot published) and reuses it. The install command inherits the target lock, so if
//! `ensure` is killed while its installer keeps running, the next `ensure` of that target waits
//! for the installer to exit rather than racing it.
//!
//! The state file tells an environment this node made (which `ensure` may replace or resume)
//! from a directory someone else put there (which it never touches). It records the boot it was
//! made in: restores are not synced to disk (they can always be redone), so after a reboot a
//! target is restored again instead of being trusted.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::key::Key;

/// Node-local state of environment targets.
#[derive(Debug, Clone)]
pub struct NodeState {
    dir: PathBuf,
}

/// A held node lock; released when dropped (or when the process dies).
#[derive(Debug)]
pub struct NodeLock {
    file: File,
}

/// What this node last did at a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetState {
    pub target: String,
    pub key: String,
    pub phase: Phase,
    /// Device and inode of the target directory once it is ready.
    pub dev: u64,
    pub ino: u64,
    /// The boot it was made in (`/proc/sys/kernel/random/boot_id`). Restores are not synced to
    /// disk, so after a reboot a ready target is restored again rather than trusted.
    #[serde(default)]
    pub boot_id: String,
}

/// Where an ensure got to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// The install command was started; the target may be half-installed.
    Installing,
    /// The target holds the environment of `key`.
    Ready,
}

impl NodeState {
    /// State kept in `dir` (created if missing).
    pub fn open(dir: &Path) -> Result<NodeState> {
        for sub in ["locks", "targets"] {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(|e| Error::io("create directory", &d, e))?;
        }
        Ok(NodeState {
            dir: dir.to_path_buf(),
        })
    }

    fn target_id(target: &Path) -> String {
        let h = blake3::hash(target.as_os_str().as_encoded_bytes()).to_hex();
        h[..32].to_string()
    }

    /// Waits for the lock of `target`.
    pub async fn lock_target(&self, target: &Path) -> Result<NodeLock> {
        let path = self
            .dir
            .join("locks")
            .join(format!("target-{}.lock", Self::target_id(target)));
        lock(path, format!("target {}", target.display())).await
    }

    /// Waits for the lock of `key`.
    pub async fn lock_key(&self, key: &Key) -> Result<NodeLock> {
        let path = self.dir.join("locks").join(format!("key-{key}.lock"));
        lock(path, format!("key {}", key.short())).await
    }

    fn state_path(&self, target: &Path) -> PathBuf {
        self.dir
            .join("targets")
            .join(format!("{}.json", Self::target_id(target)))
    }

    /// The recorded state of `target`, if any. An unreadable state file counts as none.
    pub fn read(&self, target: &Path) -> Option<TargetState> {
        let data = std::fs::read(self.state_path(target)).ok()?;
        let state: TargetState = serde_json::from_slice(&data).ok()?;
        (Path::new(&state.target) == target).then_some(state)
    }

    /// Records `state` (atomically: a temporary file renamed over the old one).
    pub fn write(&self, state: &TargetState) -> Result<()> {
        let path = self.state_path(Path::new(&state.target));
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let json = serde_json::to_vec_pretty(state).unwrap_or_default();
        std::fs::write(&tmp, json)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io("write target state", &path, e)
            })
    }

    /// Forgets `target`.
    pub fn clear(&self, target: &Path) {
        let _ = std::fs::remove_file(self.state_path(target));
    }
}

impl TargetState {
    /// The state of a ready `target` holding `key`, with its current inode.
    pub fn ready(target: &Path, key: &Key) -> Result<TargetState> {
        let m = std::fs::metadata(target).map_err(|e| Error::io("stat", target, e))?;
        Ok(TargetState {
            target: crate::key::path_string(target)?,
            key: key.to_hex(),
            phase: Phase::Ready,
            dev: m.dev(),
            ino: m.ino(),
            boot_id: boot_id(),
        })
    }

    /// Whether the target holds `key`, made in this boot.
    pub fn holds(&self, key: &Key) -> bool {
        self.phase == Phase::Ready && self.key == key.to_hex() && self.boot_id == boot_id()
    }

    /// Whether the directory with metadata `m` is the one this state describes: the same inode
    /// when ready; any when an install was started (its inode was not known yet).
    pub fn describes(&self, m: &std::fs::Metadata) -> bool {
        self.phase == Phase::Installing || (m.dev() == self.dev && m.ino() == self.ino)
    }
}

/// This boot's id; empty where the kernel does not say.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

async fn lock(path: PathBuf, what: String) -> Result<NodeLock> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io("open lock file", &path, e))?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open and owned by `file`, which outlives the call.
    if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io("lock", &path, err));
        }
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        tracing::info!(%what, holder = holder.trim(), "waiting for another ensure on this node");
        let p = path.clone();
        let file = tokio::task::spawn_blocking(move || {
            // SAFETY: as above; this thread owns `file` until it returns it.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(Error::io("lock", &p, std::io::Error::last_os_error()));
            }
            Ok(file)
        })
        .await
        .map_err(|e| Error::task("node lock", e))??;
        return Ok(NodeLock::holding(file));
    }
    Ok(NodeLock::holding(file))
}

impl NodeLock {
    fn holding(mut file: File) -> NodeLock {
        // Who holds it, for the "waiting" message of the next one; best effort.
        let _ = file.set_len(0);
        let _ = writeln!(
            file,
            "pid {} on {}",
            std::process::id(),
            crate::util::hostname()
        );
        NodeLock { file }
    }

    /// A duplicate of the lock's descriptor without close-on-exec, for a child process to
    /// inherit so that the lock is held until the child (and what it leaves running) exits too.
    pub fn inheritable(&self) -> Result<OwnedFd> {
        // SAFETY: the descriptor is open; F_DUPFD returns a new descriptor (without FD_CLOEXEC)
        // or -1.
        let fd = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_DUPFD, 3) };
        if fd < 0 {
            return Err(Error::io(
                "duplicate lock descriptor",
                "",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lock_waits_for_its_holder() {
        let dir = tempfile::tempdir().unwrap();
        let state = NodeState::open(dir.path()).unwrap();
        let target = Path::new("/opt/venv");
        let held = state.lock_target(target).await.unwrap();
        let s2 = state.clone();
        let waiter = tokio::spawn(async move { s2.lock_target(Path::new("/opt/venv")).await });
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!waiter.is_finished(), "the second lock waits");
        // Another target is independent.
        let _other = state.lock_target(Path::new("/opt/other")).await.unwrap();
        drop(held);
        let _second = tokio::time::timeout(std::time::Duration::from_secs(30), waiter)
            .await
            .expect("the waiter gets the lock once it is released")
            .unwrap()
            .unwrap();
    }

    #[test]
    fn state_round_trips_and_checks_the_inode() {
        let dir = tempfile::tempdir().unwrap();
        let state = NodeState::open(&dir.path().join("state")).unwrap();
        let target = dir.path().join("venv");
        std::fs::create_dir(&target).unwrap();
        let key = Key([7; 32]);
        assert!(state.read(&target).is_none());
        let ready = TargetState::ready(&target, &key).unwrap();
        state.write(&ready).unwrap();
        assert_eq!(state.read(&target).unwrap(), ready);
        assert!(ready.describes(&std::fs::metadata(&target).unwrap()));
        assert!(ready.holds(&key) && !ready.holds(&Key([8; 32])));
        let before_reboot = TargetState {
            boot_id: "another boot".into(),
            ..ready.clone()
        };
        assert!(
            !before_reboot.holds(&key),
            "made before a reboot: restored again"
        );
        // Someone replaced the directory (the old one still exists, so the inode differs).
        std::fs::rename(&target, dir.path().join("moved")).unwrap();
        std::fs::create_dir(&target).unwrap();
        assert!(!ready.describes(&std::fs::metadata(&target).unwrap()));
        state.clear(&target);
        assert!(state.read(&target).is_none());
    }
}
