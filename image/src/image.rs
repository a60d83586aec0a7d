//! [`Images`]: named trees in a store: build, list, inspect, read back, pull.
//!
//! An image is committed by two writes (see `layout.rs` for the keys): the tree manifest first,
//! then the image record, which names the manifest's blake3 hash. A reader takes the record,
//! then the tree, and checks the hash, so a build that died between the two writes, or a second
//! build racing the first, is seen either as the old image or as the new one, never a mix: if the
//! tree no longer matches the record it is read again, and a persistent mismatch is an error.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use hotstart_store::{ChunkStore, EntryKind, Store, Tree};
use serde::{Deserialize, Serialize};

use crate::build::{BuildConfig, Source, build_tree};
use crate::error::{Error, Result};
use crate::layout::{ArtifactDir, ImageRef};
use crate::mount::{LazyConfig, LazyMount, load_profile, read_profile};
use crate::profile::Profile;
use crate::report::MountReport;

/// The version of `image.json` this build writes and reads.
pub const RECORD_FORMAT: u32 = 1;

/// Counts of what a tree holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeCounts {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    /// Bytes of all regular files (hard links counted once).
    pub bytes: u64,
    /// Distinct chunks.
    pub chunks: u64,
    /// Plaintext bytes of the distinct chunks: what the store holds for this tree before
    /// compression.
    pub chunk_bytes: u64,
}

impl TreeCounts {
    /// Counts the entries and distinct chunks of `tree`.
    pub fn of(tree: &Tree) -> TreeCounts {
        let mut c = TreeCounts::default();
        let mut seen = HashSet::new();
        for e in &tree.entries {
            match &e.kind {
                EntryKind::Dir => c.dirs += 1,
                EntryKind::Symlink { .. } => c.symlinks += 1,
                EntryKind::Hardlink { .. } => c.hardlinks += 1,
                // A layer's whiteouts remove paths below it; they hold nothing.
                EntryKind::Whiteout => {}
                EntryKind::File { size, chunks } => {
                    c.files += 1;
                    c.bytes += size;
                    for r in chunks {
                        if seen.insert(r.id) {
                            c.chunks += 1;
                            c.chunk_bytes += r.len as u64;
                        }
                    }
                }
            }
        }
        c
    }

    /// File bytes per distinct chunk byte: above 1 when files share content.
    pub fn dedup_ratio(&self) -> f64 {
        if self.chunk_bytes == 0 {
            1.0
        } else {
            self.bytes as f64 / self.chunk_bytes as f64
        }
    }
}

/// `image.json`: what an image is and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageRecord {
    pub format: u32,
    /// `name:tag`.
    pub image: String,
    /// `dir:PATH`, `tar:PATH` or `oci:PATH`.
    pub source: String,
    /// Milliseconds since the Unix epoch.
    pub created_ms: u64,
    pub chunk_size: u64,
    /// blake3 of the encoded tree manifest.
    pub tree_blake3: String,
    pub counts: TreeCounts,
    /// Chunks this build stored that the store did not have yet.
    pub new_chunks: u64,
    /// Compressed bytes of those chunks.
    pub new_bytes: u64,
}

/// An image's content as `image inspect` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Inspection {
    pub record: ImageRecord,
    /// Distinct chunks of this image that other images in the store also use.
    pub shared_chunks: u64,
    /// Plaintext bytes of those chunks.
    pub shared_bytes: u64,
    /// Other images in the store.
    pub other_images: u64,
}

/// What a pull did.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PullReport {
    pub counts: TreeCounts,
    /// Chunks fetched from the store (the rest came from the local cache or were shared).
    pub fetched_chunks: u64,
    /// Compressed bytes fetched.
    pub fetched_bytes: u64,
    pub seconds: f64,
}

/// The images of one store, with the chunk store their contents live in. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Images {
    chunks: ChunkStore,
}

impl Images {
    /// Images in the store `chunks` is over.
    pub fn new(chunks: ChunkStore) -> Images {
        Images { chunks }
    }

    pub fn store(&self) -> &Store {
        self.chunks.store()
    }

    pub fn chunks(&self) -> &ChunkStore {
        &self.chunks
    }

    /// Builds `image` from `source` (a directory, OCI layout or tarball) and commits it,
    /// replacing an earlier image of the same name and tag.
    #[tracing::instrument(skip_all, fields(image = %image, source = %source.display()))]
    pub async fn build(
        &self,
        source: &Path,
        image: &ImageRef,
        cfg: &BuildConfig,
    ) -> Result<ImageRecord> {
        let source = Source::detect(source)?;
        let before = self.chunks.stats();
        let tree = build_tree(&source, &self.chunks, cfg).await?;
        let after = self.chunks.stats();
        let encoded = tree.encode()?;
        let record = ImageRecord {
            format: RECORD_FORMAT,
            image: image.to_string(),
            source: source.to_string(),
            created_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            chunk_size: cfg.chunk_size as u64,
            tree_blake3: blake3::hash(&encoded).to_hex().to_string(),
            counts: TreeCounts::of(&tree),
            new_chunks: after.uploaded - before.uploaded,
            new_bytes: after.uploaded_bytes - before.uploaded_bytes,
        };
        self.store().put(&image.tree_key(), encoded).await?;
        let json = serde_json::to_vec_pretty(&record).map_err(|e| Error::Format {
            what: "image record",
            key: image.record_key(),
            reason: e.to_string(),
        })?;
        self.store()
            .put(&image.record_key(), Bytes::from(json))
            .await?;
        tracing::info!(
            files = record.counts.files,
            bytes = record.counts.bytes,
            new_chunks = record.new_chunks,
            "image built"
        );
        Ok(record)
    }

    fn no_image(&self, image: &ImageRef) -> Error {
        Error::NoImage {
            image: image.to_string(),
            store: self.store().url().to_string(),
        }
    }

    /// The record of `image`.
    pub async fn record(&self, image: &ImageRef) -> Result<ImageRecord> {
        let key = image.record_key();
        let bytes = match self.store().get(&key).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(self.no_image(image)),
            Err(e) => return Err(e.into()),
        };
        parse_record(&key, &bytes)
    }

    /// The record and tree of `image`, the tree checked against the record.
    pub async fn open(&self, image: &ImageRef) -> Result<(ImageRecord, Tree)> {
        let mut last = String::new();
        for _ in 0..3 {
            // Both at once (a round trip saved); a tree from another build than the record is
            // caught by the hash and read again.
            let tree_key = image.tree_key();
            let (record, encoded) = tokio::try_join!(self.record(image), async {
                match self.store().get(&tree_key).await {
                    Ok(b) => Ok(b),
                    Err(e) if e.is_not_found() => Err(self.no_image(image)),
                    Err(e) => Err(e.into()),
                }
            })?;
            let got = blake3::hash(&encoded).to_hex().to_string();
            if got == record.tree_blake3 {
                let tree = tokio::task::spawn_blocking(move || Tree::decode(&encoded))
                    .await
                    .map_err(|e| Error::task("tree decode", e))??;
                return Ok((record, tree));
            }
            last = format!(
                "the manifest hashes to {got}, the record names {}",
                record.tree_blake3
            );
        }
        Err(Error::Format {
            what: "image",
            key: image.tree_key(),
            reason: last,
        })
    }

    /// Every image in the store, sorted by name and tag.
    pub async fn list(&self) -> Result<Vec<ImageRecord>> {
        let objects = self.store().list("images/").await?;
        let keys: Vec<String> = objects
            .into_iter()
            .filter(|o| ImageRef::from_record_key(&o.key).is_some())
            .map(|o| o.key)
            .collect();
        let mut out: Vec<ImageRecord> = futures::stream::iter(keys)
            .map(|key| async move {
                let bytes = self.store().get(&key).await?;
                parse_record(&key, &bytes)
            })
            .buffered(16)
            .try_collect()
            .await?;
        out.sort_by(|a, b| a.image.cmp(&b.image));
        Ok(out)
    }

    /// The record of `image` plus how much of it other images in the store share.
    pub async fn inspect(&self, image: &ImageRef) -> Result<Inspection> {
        let (record, tree) = self.open(image).await?;
        let mine: HashMap<_, u32> = chunk_lens(&tree);
        let others: Vec<ImageRef> = self
            .list()
            .await?
            .iter()
            .filter_map(|r| ImageRef::parse(&r.image).ok())
            .filter(|r| r != image)
            .collect();
        let mut shared = HashSet::new();
        for other in &others {
            // An image removed or rewritten meanwhile is skipped, not an error.
            let Ok((_, t)) = self.open(other).await else {
                continue;
            };
            for id in t.chunk_ids() {
                if mine.contains_key(&id) {
                    shared.insert(id);
                }
            }
        }
        Ok(Inspection {
            shared_chunks: shared.len() as u64,
            shared_bytes: shared.iter().map(|id| mine[id] as u64).sum(),
            other_images: others.len() as u64,
            record,
        })
    }

    /// Mounts `image` read-only and lazily at `mountpoint`, with its profile (see
    /// [`LazyMount`]).
    pub async fn mount(
        &self,
        image: &ImageRef,
        mountpoint: &Path,
        cfg: LazyConfig,
    ) -> Result<LazyMount> {
        crate::mount::prepare_mountpoint(mountpoint).await?;
        let artifacts = image.artifacts();
        // The profile is read while the record and tree are.
        let profile = read_profile(self.store(), Some(&artifacts), &cfg);
        let (_, tree) = self.open(image).await?;
        LazyMount::mount_with(
            self.chunks.clone(),
            &tree,
            &image.to_string(),
            Some(artifacts),
            mountpoint,
            cfg,
            profile,
        )
        .await
    }

    /// The profile and the reports of past mounts of `image` (oldest first).
    pub async fn stats(&self, image: &ImageRef) -> Result<(Profile, Vec<MountReport>)> {
        self.record(image).await?;
        artifact_stats(self.store(), &image.artifacts()).await
    }

    /// Extracts `image` into `dest` (which must not exist, or be empty) with parallel chunk
    /// fetches. The tree is written into a temporary directory beside `dest` and renamed into
    /// place, so `dest` is either absent or complete.
    #[tracing::instrument(skip_all, fields(image = %image, dest = %dest.display()))]
    pub async fn pull(&self, image: &ImageRef, dest: &Path) -> Result<PullReport> {
        let (_, tree) = self.open(image).await?;
        pull_tree(&tree, &self.chunks, dest).await
    }
}

/// Materialises `tree` into `dest` atomically (see [`Images::pull`]); usable for any tree.
pub async fn pull_tree(tree: &Tree, chunks: &ChunkStore, dest: &Path) -> Result<PullReport> {
    let start = Instant::now();
    match std::fs::read_dir(dest) {
        Ok(mut d) => {
            if d.next().is_some() {
                return Err(Error::source(dest, "destination exists and is not empty"));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("read destination", dest, e)),
    }
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| Error::io("create directory", &parent, e))?;
    let staging = tempfile::Builder::new()
        .prefix(".hotstart-pull-")
        .tempdir_in(&parent)
        .map_err(|e| Error::io("create staging directory", &parent, e))?;
    let before = chunks.stats();
    tree.materialize(staging.path(), chunks).await?;
    let after = chunks.stats();
    // The staging directory's own mode and mtime are the temp dir's; an image root is 0755.
    let _ = std::fs::set_permissions(
        staging.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    );
    let _ = std::fs::remove_dir(dest);
    let staged = staging.keep();
    std::fs::rename(&staged, dest).map_err(|e| {
        let _ = std::fs::remove_dir_all(&staged);
        Error::io("rename into place", dest, e)
    })?;
    Ok(PullReport {
        counts: TreeCounts::of(tree),
        fetched_chunks: after.fetched - before.fetched,
        fetched_bytes: after.fetched_bytes - before.fetched_bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The profile and run reports under `dir` (reports oldest first; unreadable ones skipped with a
/// warning).
pub async fn artifact_stats(
    store: &Store,
    dir: &ArtifactDir,
) -> Result<(Profile, Vec<MountReport>)> {
    let profile = load_profile(store, dir).await?;
    let runs = store.list(&dir.runs_prefix()).await?;
    let reports: Vec<Option<MountReport>> = futures::stream::iter(runs)
        .map(|o| async move {
            let bytes = store.get(&o.key).await?;
            Ok::<_, Error>(match serde_json::from_slice(&bytes) {
                Ok(r) => Some(r),
                Err(e) => {
                    tracing::warn!(key = %o.key, error = %e, "skipping an unreadable run report");
                    None
                }
            })
        })
        .buffered(16)
        .try_collect()
        .await?;
    Ok((profile, reports.into_iter().flatten().collect()))
}

fn chunk_lens(tree: &Tree) -> HashMap<hotstart_store::ChunkId, u32> {
    let mut out = HashMap::new();
    for e in &tree.entries {
        if let EntryKind::File { chunks, .. } = &e.kind {
            for c in chunks {
                out.insert(c.id, c.len);
            }
        }
    }
    out
}

/// Fuzz entry (`fuzz/`, not part of the API): an image's record and a mount's run report, as a
/// store returns them. A record that parses writes back to one that parses the same.
#[doc(hidden)]
pub fn fuzz_record(data: &[u8]) {
    if let Ok(r) = parse_record("fuzz", data) {
        let again = serde_json::to_vec(&r).expect("a record serialises");
        assert_eq!(parse_record("fuzz", &again).ok(), Some(r));
    }
    if let Ok(report) = serde_json::from_slice::<MountReport>(data) {
        let again = serde_json::to_vec(&report).expect("a report serialises");
        assert_eq!(
            serde_json::from_slice::<MountReport>(&again).ok(),
            Some(report)
        );
    }
}

fn parse_record(key: &str, bytes: &[u8]) -> Result<ImageRecord> {
    let record: ImageRecord = serde_json::from_slice(bytes).map_err(|e| Error::Format {
        what: "image record",
        key: key.to_string(),
        reason: e.to_string(),
    })?;
    if record.format != RECORD_FORMAT {
        return Err(Error::Format {
            what: "image record",
            key: key.to_string(),
            reason: format!(
                "format {}; this build reads format {RECORD_FORMAT}",
                record.format
            ),
        });
    }
    Ok(record)
}
