//! Capture: an installed directory becomes a published snapshot.
//!
//! 1. Take a shared store lock (see [`crate::store_lock`]) so gc cannot delete a chunk this
//!    capture finds already present and reuses.
//! 2. Build the [`Tree`]: every file is cut into chunks, each hashed and uploaded unless the store
//!    already holds it, which deduplicates against every earlier snapshot (and within this one).
//!    At the same time, find the entries that name the directory's own path (shebangs,
//!    `pyvenv.cfg`, activate scripts, absolute symlinks), so a restore elsewhere can rewrite them.
//! 3. Read the chunks back and upload them again as one pack ([`crate::pack`]).
//! 4. Upload the encoded tree under a name derived from its hash, then commit the record with a
//!    conditional create (see [`crate::record`]). When another node committed first, its
//!    snapshot stands, this capture's tree and pack objects are removed, and the caller is told.

use std::path::Path;
use std::time::{Instant, SystemTime};

use hotstart_store::Tree;
use hotstart_store::chunk::ChunkStats;

use crate::error::{Error, Result};
use crate::key::{Key, KeyInputs, path_string};
use crate::pack::PackRef;
use crate::record::{EnvStore, PathRef, PathRefKind, RECORD_FORMAT, SnapshotRecord};
use crate::store_lock::{LockKind, LockTiming, StoreLock};

// Public here as before; it lives in `chunking` so that `pack` need not import this module.
pub use crate::chunking::CHUNK_SIZE;

/// What a capture did.
#[derive(Debug, Clone)]
pub struct CaptureReport {
    /// The committed record: this capture's, or the one another node committed first.
    pub record: SnapshotRecord,
    /// Whether this capture's record is the committed one.
    pub won: bool,
    /// Chunks and compressed bytes uploaded, and chunks the store already held.
    pub uploaded_chunks: u64,
    pub uploaded_bytes: u64,
    pub deduplicated_chunks: u64,
    pub seconds: f64,
}

/// Captures `dir` as the snapshot of `key` and publishes it.
#[tracing::instrument(skip_all, fields(key = %key.short(), dir = %dir.display()))]
pub async fn capture(
    env: &EnvStore,
    key: &Key,
    inputs: &KeyInputs,
    dir: &Path,
    timing: LockTiming,
) -> Result<CaptureReport> {
    let started = Instant::now();
    let lock = StoreLock::acquire(env.root(), LockKind::Capture, timing).await?;
    let before = env.chunks().stats();
    let res = build_and_commit(env, key, inputs, dir).await;
    lock.release().await;
    let (record, won) = res?;
    let after = env.chunks().stats();
    let delta = |f: fn(&ChunkStats) -> u64| f(&after) - f(&before);
    Ok(CaptureReport {
        record,
        won,
        uploaded_chunks: delta(|s| s.uploaded),
        uploaded_bytes: delta(|s| s.uploaded_bytes),
        deduplicated_chunks: delta(|s| s.deduplicated),
        seconds: started.elapsed().as_secs_f64(),
    })
}

async fn build_and_commit(
    env: &EnvStore,
    key: &Key,
    inputs: &KeyInputs,
    dir: &Path,
) -> Result<(SnapshotRecord, bool)> {
    let captured_at = path_string(dir)?;
    let scan_dir = dir.to_path_buf();
    let needle = captured_at.clone();
    let scan = tokio::task::spawn_blocking(move || scan_path_refs(&scan_dir, &needle));
    let tree = Tree::build(dir, env.chunks(), CHUNK_SIZE).await?;
    let path_refs = scan.await.map_err(|e| Error::task("path scan", e))??;
    let pack = match crate::pack::build(&tree, dir, env.chunks()).await? {
        Some((data, chunks)) => {
            let object = EnvStore::pack_key(key, &data);
            let size = data.len() as u64;
            env.root().put(&object, data).await?;
            Some(PackRef {
                object,
                chunks,
                size,
            })
        }
        None => None,
    };
    let encoded = tree.encode()?;
    let tree_key = EnvStore::tree_key(key, &encoded);
    env.root().put(&tree_key, encoded).await?;
    let record = SnapshotRecord {
        format: RECORD_FORMAT,
        key: key.to_hex(),
        tree: tree_key.clone(),
        inputs: inputs.clone(),
        captured_at,
        created_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
        host: crate::util::hostname(),
        files: tree.file_count() as u64,
        bytes: tree.total_bytes(),
        chunks: tree.chunk_ids().len() as u64,
        path_refs,
        pack: pack.clone(),
    };
    if env.commit(key, &record).await? {
        return Ok((record, true));
    }
    let winner = env.record(key).await?.ok_or_else(|| Error::BadSnapshot {
        key: key.to_hex(),
        reason: "the store refused to create the record but holds none".into(),
    })?;
    if winner.tree != tree_key {
        env.root().delete(&tree_key).await?;
    }
    if let Some(ours) = pack
        && winner.pack.as_ref().map(|p| &p.object) != Some(&ours.object)
    {
        env.root().delete(&ours.object).await?;
    }
    Ok((winner, false))
}

/// The entries under `root` that name `needle` (an absolute path): files whose bytes contain it,
/// and symlinks whose target is it or lies under it.
pub(crate) fn scan_path_refs(root: &Path, needle: &str) -> Result<Vec<PathRef>> {
    let finder = memchr::memmem::Finder::new(needle.as_bytes());
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| Error::io("read directory", &dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("read directory", &dir, e))?;
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue; // Tree::build refuses such names with a clear error
            };
            let path = if rel.is_empty() {
                name
            } else {
                format!("{rel}/{name}")
            };
            let abs = entry.path();
            let ft = entry.file_type().map_err(|e| Error::io("stat", &abs, e))?;
            if ft.is_dir() {
                stack.push((abs, path));
            } else if ft.is_symlink() {
                let target =
                    std::fs::read_link(&abs).map_err(|e| Error::io("read symlink", &abs, e))?;
                let target = target.to_string_lossy();
                if crate::relocate::under(&target, needle) {
                    out.push(PathRef {
                        path,
                        kind: PathRefKind::Symlink,
                    });
                }
            } else if ft.is_file() {
                let data = std::fs::read(&abs).map_err(|e| Error::io("read", &abs, e))?;
                if finder.find(&data).is_some() {
                    let kind = if memchr::memchr(0, &data).is_some() {
                        PathRefKind::Binary
                    } else {
                        PathRefKind::Text
                    };
                    out.push(PathRef { path, kind });
                }
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
