//! Listing snapshots, and collecting the ones no longer wanted.
//!
//! gc runs under the exclusive store lock ([`crate::store_lock`]), so no capture is between
//! "this chunk is already there" and its commit while chunks are deleted. Then:
//!
//! 1. Snapshots chosen by key or by age lose their record first (from then on nobody restores
//!    them) and then their trees and packs.
//! 2. The chunks of every remaining snapshot's tree are the live set. A tree that cannot be read
//!    for any reason but being gone stops gc before anything else is deleted: deleting chunks on
//!    a partial view could break a snapshot that is fine.
//! 3. Trees and packs no record names (left by a capture that lost the race to commit, or that
//!    died before committing), lazy-mount artifacts (profile, traces, run reports) of snapshots
//!    that are gone, and chunks outside the live set are deleted once older than the grace
//!    period, so an upload in progress by a capture that took its lock after gc finished is not
//!    touched.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use futures::{StreamExt, TryStreamExt};
use hotstart_store::ChunkId;

use crate::error::{Error, Result};
use crate::key::Key;
use crate::record::{EnvStore, SnapshotRecord};
use crate::store_lock::{LockKind, LockTiming, StoreLock};

/// What to collect.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Delete snapshots created longer ago than this.
    pub older_than: Option<Duration>,
    /// Delete these snapshots.
    pub keys: Vec<Key>,
    /// Unreferenced objects younger than this are kept.
    pub grace: Duration,
    /// Report what would be deleted, delete nothing.
    pub dry_run: bool,
    pub lock_timing: LockTiming,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            older_than: None,
            keys: Vec::new(),
            grace: Duration::from_secs(3600),
            dry_run: false,
            lock_timing: LockTiming::default(),
        }
    }
}

/// What gc deleted (or, in a dry run, would delete).
#[derive(Debug, Clone, Default)]
pub struct GcReport {
    /// Keys of the snapshots removed.
    pub snapshots: Vec<String>,
    /// Snapshots kept.
    pub kept: usize,
    /// Tree and pack objects removed (of removed snapshots, and orphans).
    pub trees: u64,
    pub packs: u64,
    /// Lazy-mount artifacts removed (profiles, traces, run reports of removed snapshots).
    pub artifacts: u64,
    /// Chunks removed and their stored bytes.
    pub chunks: u64,
    pub chunk_bytes: u64,
    /// Snapshots whose tree is gone (they cannot be restored; remove them by key).
    pub broken: Vec<String>,
}

/// A summary of the environment store, for `hotstart env ls`.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    pub snapshots: Vec<SnapshotRecord>,
    /// Records that could not be read: object key and why.
    pub unreadable: Vec<(String, String)>,
    /// Chunks stored and their stored (compressed) bytes.
    pub chunks: u64,
    pub chunk_bytes: u64,
}

/// Every snapshot and the chunk totals.
pub async fn list(env: &EnvStore) -> Result<Listing> {
    let mut out = Listing::default();
    for r in env.list().await? {
        match r {
            Ok(rec) => out.snapshots.push(rec),
            Err((key, e)) => out.unreadable.push((key, e.to_string())),
        }
    }
    for o in env.root().list("chunks").await? {
        out.chunks += 1;
        out.chunk_bytes += o.size;
    }
    Ok(out)
}

/// Collects as `opts` says; see the module documentation.
#[tracing::instrument(skip_all, fields(dry_run = opts.dry_run))]
pub async fn gc(env: &EnvStore, opts: &GcOptions) -> Result<GcReport> {
    let lock = StoreLock::acquire(env.root(), LockKind::Gc, opts.lock_timing).await?;
    let res = collect(env, opts).await;
    lock.release().await;
    res
}

async fn collect(env: &EnvStore, opts: &GcOptions) -> Result<GcReport> {
    let now = SystemTime::now();
    let mut report = GcReport::default();
    let mut live_records = Vec::new();
    let mut doomed = Vec::new();
    for r in env.list().await? {
        let rec = match r {
            Ok(rec) => rec,
            Err((key, e)) => {
                return Err(Error::BadSnapshot {
                    key,
                    reason: format!("unreadable record ({e}); remove it before running gc"),
                });
            }
        };
        let key = rec.key()?;
        let age = now
            .duration_since(SystemTime::UNIX_EPOCH + Duration::from_secs(rec.created_unix))
            .unwrap_or_default();
        let old = opts.older_than.is_some_and(|limit| age > limit);
        if old || opts.keys.contains(&key) {
            doomed.push(rec);
        } else {
            live_records.push(rec);
        }
    }
    report.kept = live_records.len();

    // The live set, before anything is deleted.
    let mut live: HashSet<ChunkId> = HashSet::new();
    // Trees and packs that live records name.
    let mut live_objects: HashSet<String> = HashSet::new();
    for rec in &live_records {
        live_objects.extend(rec.pack.iter().map(|p| p.object.clone()));
        match env.tree(rec).await {
            Ok(tree) => {
                live.extend(tree.chunk_ids());
                live_objects.insert(rec.tree.clone());
            }
            Err(Error::BadSnapshot { .. }) => report.broken.push(rec.key.clone()),
            Err(e) => return Err(e),
        }
    }

    let mut deletions: Vec<String> = Vec::new();
    for rec in &doomed {
        report.snapshots.push(rec.key.clone());
        if !opts.dry_run {
            // The record first: from here on nobody starts restoring it.
            env.root()
                .delete(&EnvStore::record_key(&rec.key()?))
                .await?;
        }
    }
    let old_enough =
        |modified: SystemTime| now.duration_since(modified).unwrap_or_default() >= opts.grace;
    let doomed_keys: HashSet<&str> = doomed.iter().map(|r| r.key.as_str()).collect();
    let live_keys: HashSet<&str> = live_records.iter().map(|r| r.key.as_str()).collect();
    for o in env.root().list("snapshots").await? {
        let mut parts = o.key.split('/').skip(1);
        let (Some(key), Some(file)) = (parts.next(), parts.next()) else {
            continue;
        };
        if file == "snapshot.json" || live_objects.contains(&o.key) {
            continue;
        }
        let tree = file.starts_with("tree-");
        if tree || file.starts_with("pack-") {
            if doomed_keys.contains(key) || old_enough(o.last_modified) {
                if tree {
                    report.trees += 1;
                } else {
                    report.packs += 1;
                }
                deletions.push(o.key);
            }
        } else if doomed_keys.contains(key)
            || (!live_keys.contains(key) && old_enough(o.last_modified))
        {
            // Lazy mounts' profile, traces and run reports of a snapshot that is gone.
            report.artifacts += 1;
            deletions.push(o.key);
        }
    }
    for o in env.root().list("chunks").await? {
        let Some(id) = o
            .key
            .rsplit('/')
            .next()
            .and_then(|h| ChunkId::from_hex(h).ok())
        else {
            continue;
        };
        if !live.contains(&id) && old_enough(o.last_modified) {
            report.chunks += 1;
            report.chunk_bytes += o.size;
            deletions.push(o.key);
        }
    }
    if !opts.dry_run {
        futures::stream::iter(deletions)
            .map(|k| async move { env.root().delete(&k).await })
            .buffer_unordered(32)
            .try_collect::<()>()
            .await?;
    }
    Ok(report)
}
