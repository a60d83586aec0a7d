//! Restore: a published snapshot becomes a directory, all at once or not at all.
//!
//! 1. Read the record and the tree it names (both verified: the record against its key, the tree
//!    by its decoder, every chunk against its hash as it is read).
//! 2. From a remote store, read the index of the snapshot's pack and announce the chunks it will
//!    provide; fetch them in bulk, in tree order, and hold them in memory while the next step
//!    runs and waits for them (see [`crate::pack`]).
//! 3. Materialise the tree into a temporary directory beside the target (same file system, so
//!    the final rename is atomic): many files at once, each fetching several chunks ahead, so
//!    chunk fetches run in parallel. A file is hard-linked from the local chunk cache when the
//!    cache is on the same file system and holds it (a file of one chunk as that chunk, a larger
//!    one whole: see [`ChunkCache::link_to`](hotstart_store::ChunkCache::link_to) and
//!    [`ChunkCache::file_key`](hotstart_store::ChunkCache::file_key)); everything else is written
//!    and then becomes the cache's copy. Modes, symlinks, hard links and mtimes are as captured.
//! 4. If the target is not where the snapshot was captured, relocate (see [`crate::relocate`]).
//! 5. Rename the temporary directory into place, or, when an older environment occupies the
//!    target and may be replaced, swap the two atomically (`renameat2(RENAME_EXCHANGE)`) and then
//!    delete the old one.
//!
//! Any failure removes the temporary directory; an interrupted restore leaves only that
//! temporary directory, which the next `ensure` of the same target removes. The target itself
//! is never half written.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use futures::FutureExt;
use hotstart_store::{MaterializeOptions, Tree};

use crate::error::{Error, Result};
use crate::pack::{IndexRead, PackLoad};
use crate::record::{EnvStore, SnapshotRecord};
use crate::relocate::{RelocateReport, relocate_dir};
use crate::util::rename2;

/// How a restore writes files.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Files materialised at once (each also fetches up to 8 chunks ahead).
    pub concurrency: usize,
    /// Hard-link single-chunk files from the local chunk cache where possible.
    pub link_from_cache: bool,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            concurrency: 64,
            link_from_cache: true,
        }
    }
}

/// What a restore did.
#[derive(Debug, Clone, Default)]
pub struct RestoreReport {
    /// Regular files and bytes of file content restored.
    pub files: u64,
    pub bytes: u64,
    /// Files hard-linked from the chunk cache instead of written.
    pub linked: u64,
    /// Chunks and compressed bytes fetched from the store one by one, and chunks served by the
    /// cache.
    pub fetched_chunks: u64,
    pub fetched_bytes: u64,
    pub cache_hits: u64,
    /// Chunks held from the snapshot's pack ([`crate::pack`]), and the bytes, GETs and seconds
    /// that fetched them.
    pub packed_chunks: u64,
    pub packed_bytes: u64,
    pub pack_requests: u64,
    pub pack_seconds: f64,
    /// What was rewritten because the target differs from the capture path.
    pub relocated: Option<RelocateReport>,
    pub seconds: f64,
}

/// Restores the snapshot `record` at `target`. An existing `target` is replaced (atomically)
/// only when `replace` is true; otherwise it is [`Error::TargetInUse`].
#[tracing::instrument(skip_all, fields(key = %&record.key[..16], target = %target.display()))]
pub async fn restore(
    env: &EnvStore,
    record: &SnapshotRecord,
    target: &Path,
    replace: bool,
    opts: &RestoreOptions,
) -> Result<RestoreReport> {
    let started = Instant::now();
    // A local directory serves each chunk as fast as a pack would; from a remote store the
    // pack's index is read while the tree is.
    let index = match &record.pack {
        Some(pack) if !env.root().is_local() => Some(IndexRead::start(env.chunks(), pack)),
        _ => None,
    };
    let tree = env.tree(record).await?;
    let exists = std::fs::symlink_metadata(target).is_ok();
    if exists && !replace {
        return Err(Error::TargetInUse {
            target: target.to_path_buf(),
        });
    }
    let tmp = temp_beside(target, "tmp")?;
    let before = env.chunks().stats();
    let res = fill(env, record, index, &tree, &tmp, target, opts).await;
    env.chunks().release_held();
    let mut report = match res {
        Ok(r) => r,
        Err(e) => {
            remove_tree(&tmp);
            let repaired = repair(env, record, &e).await;
            return Err(Error::Restore {
                key: record.key.clone(),
                target: target.to_path_buf(),
                source: Box::new(e),
                repaired,
            });
        }
    };
    if let Err(e) = put_in_place(&tmp, target, exists) {
        remove_tree(&tmp);
        return Err(e);
    }
    let after = env.chunks().stats();
    report.fetched_chunks = after.fetched - before.fetched;
    report.fetched_bytes = after.fetched_bytes - before.fetched_bytes;
    report.cache_hits = after.cache_hits - before.cache_hits;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// After a restore that failed on a damaged chunk: when the store's own copy is damaged, deletes
/// it and the snapshot's record, so that the next `ensure` installs and publishes the snapshot
/// anew and uploads the chunk again, where it would otherwise keep the record and reuse the
/// damaged copy forever. Returns what it did, to be said after the error.
async fn repair(env: &EnvStore, record: &SnapshotRecord, e: &Error) -> String {
    let Some(id) = e.damaged_chunk() else {
        return String::new();
    };
    match env.chunks().delete_if_damaged(&id).await {
        Ok(true) => {}
        Ok(false) => return String::new(),
        Err(err) => {
            tracing::warn!(chunk = %id.to_hex(), error = %err,
                "could not check or delete the store's copy of a damaged chunk");
            return String::new();
        }
    }
    let deleted = match record.key() {
        Ok(key) => env
            .root()
            .delete(&EnvStore::record_key(&key))
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match deleted {
        Ok(()) => format!(
            "; the store's copy of chunk {} was damaged and is deleted, and so is this \
             snapshot's record: the next ensure installs and publishes it anew",
            id.to_hex()
        ),
        Err(err) => format!(
            "; the store's copy of chunk {} was damaged and is deleted, but this snapshot's \
             record could not be ({err}): run `hotstart env gc --key {}`, then ensure again",
            id.to_hex(),
            record.key
        ),
    }
}

async fn fill(
    env: &EnvStore,
    record: &SnapshotRecord,
    index: Option<IndexRead>,
    tree: &Tree,
    tmp: &Path,
    target: &Path,
    opts: &RestoreOptions,
) -> Result<RestoreReport> {
    std::fs::create_dir(tmp).map_err(|e| Error::io("create directory", tmp, e))?;
    let loading = match index {
        Some(index) => Some(crate::pack::start(env.chunks(), index, tree).await),
        None => None,
    };
    let mopts = MaterializeOptions {
        concurrency: opts.concurrency,
        link_from_cache: opts.link_from_cache,
    };
    let fetch_pack = async {
        match loading {
            Some(l) => l.fetch(env.chunks().config().concurrency).await,
            None => PackLoad::default(),
        }
    };
    // Both at once; a failed materialisation stops the fetch (its announcements end with it).
    let (packed, stats) = futures::future::try_join(
        fetch_pack.map(Ok),
        tree.materialize_with(tmp, env.chunks(), &mopts),
    )
    .await?;
    let new = crate::key::path_string(target)?;
    let relocated = if record.captured_at != new {
        let (dir, refs, old) = (
            tmp.to_path_buf(),
            record.path_refs.clone(),
            record.captured_at.clone(),
        );
        let report = tokio::task::spawn_blocking(move || relocate_dir(&dir, &refs, &old, &new))
            .await
            .map_err(|e| Error::task("relocate", e))??;
        Some(report)
    } else {
        None
    };
    Ok(RestoreReport {
        files: stats.files,
        bytes: stats.bytes,
        linked: stats.linked,
        packed_chunks: packed.chunks,
        packed_bytes: packed.bytes,
        pack_requests: packed.requests,
        pack_seconds: packed.seconds,
        relocated,
        ..Default::default()
    })
}

/// Moves the finished `tmp` to `target`: a rename when the target is free, an atomic swap (and
/// removal of the old tree) when it is occupied.
fn put_in_place(tmp: &Path, target: &Path, exists: bool) -> Result<()> {
    if !exists {
        return rename2(tmp, target, false).map_err(|e| Error::io("rename into place", target, e));
    }
    rename2(tmp, target, true).map_err(|e| Error::io("swap into place", target, e))?;
    // `tmp` now holds the previous environment.
    remove_tree(tmp);
    Ok(())
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh name beside `target`: `.<name>.hotstart-<what>-<pid>-<n>`.
pub(crate) fn temp_beside(target: &Path, what: &str) -> Result<PathBuf> {
    let name = target
        .file_name()
        .ok_or_else(|| Error::config(format!("{} has no file name", target.display())))?;
    Ok(target.with_file_name(format!(
        ".{}.hotstart-{what}-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    )))
}

/// Removes what earlier, interrupted restores or replacements of `target` left beside it. Call
/// only while holding the target's node lock.
pub(crate) fn remove_leftovers(target: &Path) -> Result<()> {
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Ok(());
    };
    let prefix = format!(".{}.hotstart-", name.to_string_lossy());
    let entries = match std::fs::read_dir(parent) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("read directory", parent, e)),
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            tracing::info!(path = %entry.path().display(), "removing what an interrupted restore left");
            remove_tree(&entry.path());
        }
    }
    Ok(())
}

/// Removes a file or directory tree, logging (not failing) when it cannot.
pub(crate) fn remove_tree(path: &Path) {
    let res = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "could not remove");
    }
}
