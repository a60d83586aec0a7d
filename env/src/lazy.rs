//! `ensure` with a lazy mount: on a hit the snapshot is mounted read-only at the target
//! through `hotstart-image`'s lazy mount instead of being written out.
//!
//! 1. Key, node locks and what is at the target, as for an eager `ensure` ([`crate::ensure`]).
//!    A target that already holds the environment (a real directory this node made) is used as
//!    it is: nothing is mounted.
//! 2. Miss: install and capture exactly as `ensure` does; the target is then a real directory.
//!    (An empty directory at the target is installed into.)
//! 3. Hit: the snapshot must be mountable at the target. A snapshot whose files name the path it
//!    was captured at ([`crate::record::PathRef`]: `pyvenv.cfg`, shebangs, symlinks) is refused at
//!    any other path ([`Error::LazyRelocation`]): a read-only mount cannot rewrite them, so it
//!    is mounted only where it was captured (binary files that name the path are not rewritten
//!    by an eager restore either, so they do not stop a mount).
//! 4. The mountpoint: an absent target is created (and removed again at unmount); an empty
//!    directory is mounted on as it is; an older environment this node made there is removed
//!    first (as an eager restore replaces it); anything else is refused
//!    ([`Error::TargetInUse`]).
//! 5. Mount ([`LazyMount`]) with the snapshot's artifact directory
//!    ([`EnvStore::artifacts`]): the profile that earlier mounts of this snapshot recorded, on
//!    any node, is replayed ahead of the job, and this mount's first reads are recorded into it.
//!    From a remote store, the replay's chunks come from the snapshot's pack ([`crate::pack`]):
//!    announced before the replay starts, fetched in ranged GETs of at most 4 MiB in the order
//!    the profile wants them, instead of one GET per chunk. The profile is read as soon as the key
//!    is known (while the record and the tree are), the pack's index as soon as the record is
//!    (while the tree is).
//!    The node locks are released once mounted: a later `ensure` of the target finds a directory
//!    it did not make and refuses it, rather than waiting for the mount to end.
//!
//! [`MountedEnv::unmount`] stops the prefetcher, unmounts, merges this run's trace into the
//! profile and stores the run's report beside the snapshot.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::FutureExt;
use hotstart_image::{LazyConfig, LazyMount, MountReport, PlanHook, read_profile};
use hotstart_store::{ChunkId, ChunkStore, Store};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::ensure::{Action, EnsureConfig, Found, Outcome, install_and_capture, prepare};
use crate::error::{Error, Result};
use crate::key::{Key, path_string};
use crate::pack::{IndexRead, PackLoad, PackRef};
use crate::record::{EnvStore, PathRefKind, SnapshotRecord};
use crate::restore::remove_tree;

/// What [`ensure_lazy`] did.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub enum LazyOutcome {
    /// A hit: the snapshot is mounted at the target until [`MountedEnv::unmount`].
    Mounted(MountedEnv),
    /// The target already held the environment, or a miss installed (and published) it: a real
    /// directory, nothing mounted.
    Eager(Outcome),
}

/// A snapshot mounted lazily at its target.
#[derive(Debug)]
pub struct MountedEnv {
    pub key: Key,
    /// The absolute target (the mountpoint).
    pub target: PathBuf,
    /// Regular files and bytes of file content in the snapshot.
    pub files: u64,
    pub bytes: u64,
    /// Seconds from the call to the mount being served.
    pub seconds: f64,
    mount: LazyMount,
    /// Whether the mountpoint was created by this mount (and is removed at unmount).
    created: bool,
    /// The fetch of the replay's chunks from the pack, once the replay has planned it.
    pack: PackSlot,
}

type PackSlot = Arc<Mutex<Option<JoinHandle<PackLoad>>>>;

/// Ranged GETs of a pack in flight at once for a replay: the first ranges, which the job needs
/// first, do not share the link with many later ones.
const PLANNED_RANGES_IN_FLIGHT: usize = 8;

/// The hook that fetches a replay's planned chunks from the pack `pack` (see the module
/// documentation) and leaves the fetch in `slot`. The pack's index is read from now on, while
/// the tree is fetched and the profile planned.
fn fetch_plan_from_pack(chunks: ChunkStore, pack: PackRef, slot: PackSlot) -> PlanHook {
    let index = Arc::new(Mutex::new(Some(IndexRead::start(&chunks, &pack))));
    PlanHook(Arc::new(move |plan: Vec<ChunkId>| {
        let (chunks, slot) = (chunks.clone(), slot.clone());
        // A second replay reads the index again.
        let index = lock(&index)
            .take()
            .unwrap_or_else(|| IndexRead::start(&chunks, &pack));
        async move {
            let loading = crate::pack::start_planned(&chunks, index, &plan).await;
            let fetch = tokio::spawn(loading.fetch(PLANNED_RANGES_IN_FLIGHT));
            *lock(&slot) = Some(fetch);
        }
        .boxed()
    }))
}

/// `m` locked, also after a panic elsewhere (what it guards stays consistent).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The kernel read-ahead of an environment's lazy mount: the kernel's own default. Imports
/// touch a shared library's pages here and there; a wider window only fetches more chunks.
pub const LAZY_READ_AHEAD: u64 = 128 << 10;

/// [`LazyConfig`] as an environment wants it ([`LAZY_READ_AHEAD`], named `hotstart-env`).
pub fn lazy_config() -> LazyConfig {
    let mut cfg = LazyConfig::default();
    cfg.mount.fs_name = "hotstart-env".to_string();
    cfg.mount.kernel_read_ahead = Some(LAZY_READ_AHEAD);
    cfg
}

/// Makes `cfg.target` hold the environment of `cfg`'s inputs, mounting the snapshot lazily on a
/// hit; see the module documentation.
#[tracing::instrument(skip_all, fields(target = %cfg.target.display()))]
pub async fn ensure_lazy(
    store: &Store,
    cfg: &EnsureConfig,
    mut lazy: LazyConfig,
) -> Result<LazyOutcome> {
    let p = prepare(cfg).await?;
    match p.found {
        Found::Present => return Ok(LazyOutcome::Eager(p.done(Action::Present))),
        Found::Foreign if !is_empty_dir(&p.target) => {
            return Err(Error::TargetInUse { target: p.target });
        }
        _ => {}
    }
    let env = EnvStore::new(store, cfg.chunk_config())?;
    // The profile is read while the record and the tree are, and the pack's index while the
    // tree is.
    let artifacts = EnvStore::artifacts(&p.key);
    let profile = read_profile(env.chunks().store(), Some(&artifacts), &lazy);
    let Some(record) = env.record(&p.key).await? else {
        return Ok(LazyOutcome::Eager(install_and_capture(p, cfg, &env).await?));
    };
    check_mountable_at(&record, &p.target)?;
    let pack = PackSlot::default();
    if let Some(r) = record.pack.clone().filter(|_| !env.root().is_local()) {
        lazy.on_plan = Some(fetch_plan_from_pack(env.chunks().clone(), r, pack.clone()));
    }
    let tree = env.tree(&record).await?;
    let created = match p.found {
        Found::Ours => {
            // An older environment this node made: replaced, as an eager restore would.
            remove_tree(&p.target);
            p.node.clear(&p.target);
            create_dir(&p.target)?;
            true
        }
        Found::Absent => {
            create_dir(&p.target)?;
            true
        }
        // An empty directory: mounted on as it is.
        Found::Foreign | Found::Present => false,
    };
    let label = format!("env:{}", p.key.short());
    let mounted = LazyMount::mount_with(
        env.chunks().clone(),
        &tree,
        &label,
        Some(artifacts),
        &p.target,
        lazy,
        profile,
    )
    .await;
    let mount = match mounted {
        Ok(m) => m,
        Err(e) => {
            if created {
                let _ = std::fs::remove_dir(&p.target);
            }
            return Err(Error::Mount {
                key: record.key.clone(),
                target: p.target,
                source: Box::new(e),
            });
        }
    };
    Ok(LazyOutcome::Mounted(MountedEnv {
        key: p.key,
        target: p.target.clone(),
        files: record.files,
        bytes: record.bytes,
        seconds: p.started.elapsed().as_secs_f64(),
        mount,
        created,
        pack,
    }))
}

/// Refuses a snapshot whose entries name its capture path at any other path.
fn check_mountable_at(record: &SnapshotRecord, target: &Path) -> Result<()> {
    if record.captured_at == path_string(target)? {
        return Ok(());
    }
    let naming: Vec<&str> = record
        .path_refs
        .iter()
        .filter(|r| r.kind != PathRefKind::Binary)
        .map(|r| r.path.as_str())
        .collect();
    match naming.first() {
        None => Ok(()),
        Some(example) => Err(Error::LazyRelocation {
            key: record.key.clone(),
            captured_at: record.captured_at.clone(),
            target: target.to_path_buf(),
            refs: naming.len(),
            example: example.to_string(),
        }),
    }
}

fn is_empty_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
        && std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_none())
}

fn create_dir(path: &Path) -> Result<()> {
    std::fs::create_dir(path).map_err(|e| Error::io("create mountpoint", path, e))
}

impl MountedEnv {
    /// The mount (its run id, live counters, prefetch progress).
    pub fn mount(&self) -> &LazyMount {
        &self.mount
    }

    /// The mount, to wait for its prefetch ([`LazyMount::prefetch_done`]).
    pub fn mount_mut(&mut self) -> &mut LazyMount {
        &mut self.mount
    }

    /// Stops prefetching, unmounts, merges this run's reads into the snapshot's profile, stores
    /// the run's report beside the snapshot and removes the mountpoint if the mount created it.
    pub async fn unmount(self) -> Result<Unmounted> {
        let report = self.mount.unmount().await.map_err(|e| Error::Mount {
            key: self.key.to_hex(),
            target: self.target.clone(),
            source: Box::new(e),
        })?;
        if self.created
            && let Err(e) = std::fs::remove_dir(&self.target)
        {
            tracing::warn!(target = %self.target.display(), error = %e, "could not remove the mountpoint");
        }
        let fetch = lock(&self.pack).take();
        let packed = match fetch {
            Some(f) if f.is_finished() => f.await.unwrap_or_default(),
            Some(f) => {
                // Cut short by the unmount: what it held is no longer wanted.
                f.abort();
                PackLoad::default()
            }
            None => PackLoad::default(),
        };
        Ok(Unmounted {
            key: self.key,
            target: self.target,
            files: self.files,
            bytes: self.bytes,
            seconds: self.seconds,
            packed,
            report,
        })
    }
}

/// A lazy mount of a snapshot, once it has ended.
#[derive(Debug, Clone)]
pub struct Unmounted {
    pub key: Key,
    pub target: PathBuf,
    /// The snapshot's regular files and bytes.
    pub files: u64,
    pub bytes: u64,
    /// Seconds it took to mount.
    pub seconds: f64,
    /// What fetching the replay's chunks from the snapshot's pack did (all zero when the store
    /// is a local directory, there was no profile, or the fetch was cut short by the unmount).
    pub packed: PackLoad,
    /// What the mount did (reads, hit rate, prefetch, stall), as stored beside the snapshot.
    pub report: MountReport,
}

impl Unmounted {
    /// The outcome as `hotstart env ensure --lazy --json` prints it: `action` `mounted`, `key`,
    /// `target`, `seconds` (to mount), the snapshot's `files` and `bytes`, the chunks, bytes
    /// and GETs of the pack fetched for the replay (`packed_chunks`, `packed_bytes`,
    /// `pack_requests`), and the run's report under `mount`.
    pub fn to_json(&self) -> serde_json::Value {
        json!({
            "action": "mounted",
            "key": self.key.to_hex(),
            "target": self.target,
            "seconds": self.seconds,
            "files": self.files,
            "bytes": self.bytes,
            "packed_chunks": self.packed.chunks,
            "packed_bytes": self.packed.bytes,
            "pack_requests": self.packed.requests,
            "mount": self.report,
        })
    }
}

impl std::fmt::Display for Unmounted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "unmounted {} from {}: {}",
            self.key.short(),
            self.target.display(),
            self.report.summary()
        )
    }
}

/// One line for people: what is mounted where.
impl std::fmt::Display for MountedEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "mounted {} at {} lazily in {:.2} s: {} files, {} (run {}; files are fetched as they \
             are first read, the recorded profile ahead of them)",
            self.key.short(),
            self.target.display(),
            self.seconds,
            self.files,
            humansize::format_size(self.bytes, humansize::BINARY),
            self.mount.run()
        )
    }
}
