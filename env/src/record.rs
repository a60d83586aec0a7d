//! Where snapshots live in a store, and the record that commits one.
//!
//! Everything sits under `envs/` of the store URL, so a store can hold checkpoints or images
//! beside environments and `hotstart env gc` touches only its own objects:
//!
//! ```text
//! envs/chunks/<2 hex>/<64 hex>          file contents, content-addressed (shared by all snapshots)
//! envs/snapshots/<key>/tree-<16 hex>    the encoded Tree (named by its own hash)
//! envs/snapshots/<key>/pack-<16 hex>    the chunks again, in one object ([`crate::pack`])
//! envs/snapshots/<key>/snapshot.json    the record: written last, only if absent
//! envs/snapshots/<key>/profile          hot chunks of lazy mounts (see [`EnvStore::artifacts`])
//! envs/snapshots/<key>/traces/<run>     the trace of a lazy mount still running
//! envs/snapshots/<key>/runs/<run>.json  the report of each finished lazy mount
//! envs/locks/<kind>-<host>-<pid>-<n>    who is capturing or collecting right now
//! ```
//!
//! **The record is the commit.** A capture uploads every chunk, then the tree, and only then
//! creates `snapshot.json` with a conditional write that succeeds for exactly one writer
//! ([`hotstart_store::Store::put_if_absent`]). Readers look for the record only, so a snapshot
//! whose upload was cut short is never seen, and when several nodes capture one key at once the
//! first complete one wins and the others keep theirs local.

use bytes::Bytes;
use hotstart_image::ArtifactDir;
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store, Tree};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::key::{Key, KeyInputs};
use crate::pack::PackRef;

/// The format version of `snapshot.json` written by this build.
pub const RECORD_FORMAT: u32 = 1;
/// The prefix, under the store URL, that holds everything of environment snapshots.
pub const ENV_PREFIX: &str = "envs";
const SNAPSHOTS: &str = "snapshots";
/// Largest record accepted (bounds what a hostile record can make us parse).
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// The commit record of one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub format: u32,
    /// The key, 64 hex digits.
    pub key: String,
    /// The tree object, relative to `envs/`.
    pub tree: String,
    /// What the key was computed from.
    pub inputs: KeyInputs,
    /// The absolute path the environment was installed at.
    pub captured_at: String,
    /// Seconds since the Unix epoch when the record was written.
    pub created_unix: u64,
    /// The machine that installed it.
    pub host: String,
    /// Regular files, bytes of file content, and distinct chunks.
    pub files: u64,
    pub bytes: u64,
    pub chunks: u64,
    /// Entries that mention `captured_at`, rewritten when restoring at another path.
    pub path_refs: Vec<PathRef>,
    /// The pack of the snapshot's chunks, fetched in bulk by a restore (see [`crate::pack`]);
    /// absent when the snapshot has no chunks, or was captured by a build without packs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack: Option<PackRef>,
}

/// An entry of a snapshot that names the path the snapshot was captured at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRef {
    /// Relative path in the tree.
    pub path: String,
    pub kind: PathRefKind,
}

/// How an entry names the capture path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PathRefKind {
    /// A text file (no NUL byte) whose bytes contain the path.
    Text,
    /// A binary file whose bytes contain the path (not rewritten: lengths are fixed).
    Binary,
    /// A symlink whose target starts with the path.
    Symlink,
}

impl SnapshotRecord {
    /// The key as a [`Key`].
    pub fn key(&self) -> Result<Key> {
        self.key.parse()
    }
}

/// The environment part of a store: chunks, trees and records under `envs/`. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EnvStore {
    root: Store,
    chunks: ChunkStore,
}

impl EnvStore {
    /// The environments under `store` (whose URL may carry its own prefix), with chunks cached as
    /// `chunk_cfg` says.
    pub fn new(store: &Store, mut chunk_cfg: ChunkStoreConfig) -> Result<EnvStore> {
        chunk_cfg.artifact = "env";
        let root = store.prefixed(ENV_PREFIX);
        let chunks = ChunkStore::new(root.clone(), chunk_cfg)?;
        Ok(EnvStore { root, chunks })
    }

    /// The store with `envs/` applied.
    pub fn root(&self) -> &Store {
        &self.root
    }

    /// The content chunks.
    pub fn chunks(&self) -> &ChunkStore {
        &self.chunks
    }

    /// The object key of the record of `key`.
    pub fn record_key(key: &Key) -> String {
        format!("{SNAPSHOTS}/{key}/snapshot.json")
    }

    /// The object key of a tree of `key` with encoded bytes `encoded`.
    pub fn tree_key(key: &Key, encoded: &[u8]) -> String {
        Self::object_key(key, "tree", encoded)
    }

    /// The object key of a pack of `key` with bytes `data`.
    pub fn pack_key(key: &Key, data: &[u8]) -> String {
        Self::object_key(key, "pack", data)
    }

    /// `snapshots/<key>/<kind>-<16 hex of the hash of data>`.
    fn object_key(key: &Key, kind: &str, data: &[u8]) -> String {
        let hash = blake3::hash(data).to_hex();
        format!("{SNAPSHOTS}/{key}/{kind}-{}", &hash[..16])
    }

    /// Where the lazy mounts of `key` keep their profile, traces and run reports, relative to
    /// [`EnvStore::root`] (which is the chunk store's store): beside the snapshot, so every node
    /// that mounts it replays the same profile, and `gc` removes them with it.
    pub fn artifacts(key: &Key) -> ArtifactDir {
        ArtifactDir::new(format!("{SNAPSHOTS}/{key}/"))
    }

    /// The committed snapshot of `key`, if there is one.
    pub async fn record(&self, key: &Key) -> Result<Option<SnapshotRecord>> {
        let name = Self::record_key(key);
        let data = match self.root.get(&name).await {
            Ok(d) => d,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let record = parse_record(key, &data)?;
        Ok(Some(record))
    }

    /// The tree a record names, decoded and validated.
    pub async fn tree(&self, record: &SnapshotRecord) -> Result<Tree> {
        let data = self.root.get(&record.tree).await.map_err(|e| {
            if e.is_not_found() {
                Error::BadSnapshot {
                    key: record.key.clone(),
                    reason: format!("its record names the tree {} which is missing", record.tree),
                }
            } else {
                e.into()
            }
        })?;
        let tree = Tree::decode(&data)?;
        Ok(tree)
    }

    /// Every committed snapshot, oldest first. Records that cannot be read are reported as
    /// `Err` entries with their object key, so one bad record hides nothing else.
    pub async fn list(&self) -> Result<Vec<std::result::Result<SnapshotRecord, (String, Error)>>> {
        let objects = self.root.list(SNAPSHOTS).await?;
        let mut out = Vec::new();
        for o in objects.iter().filter(|o| o.key.ends_with("/snapshot.json")) {
            let parsed = async {
                let key: Key = o
                    .key
                    .trim_start_matches(&format!("{SNAPSHOTS}/"))
                    .trim_end_matches("/snapshot.json")
                    .parse()?;
                let data = self.root.get(&o.key).await?;
                parse_record(&key, &data)
            }
            .await;
            out.push(parsed.map_err(|e| (o.key.clone(), e)));
        }
        out.sort_by_key(|r| r.as_ref().map(|r| r.created_unix).unwrap_or(0));
        Ok(out)
    }

    /// Creates the record of `record.key` unless one exists: `Ok(true)` when this call
    /// committed it.
    pub(crate) async fn commit(&self, key: &Key, record: &SnapshotRecord) -> Result<bool> {
        let json = serde_json::to_vec_pretty(record).map_err(|e| Error::BadSnapshot {
            key: record.key.clone(),
            reason: e.to_string(),
        })?;
        Ok(self
            .root
            .put_if_absent(&Self::record_key(key), Bytes::from(json))
            .await?)
    }
}

/// Fuzz entry (`fuzz/`, not part of the API): a snapshot record as a store returns it.
#[doc(hidden)]
pub fn fuzz_record(data: &[u8]) {
    let key = Key([7; 32]);
    if let Ok(r) = parse_record(&key, data) {
        let again = serde_json::to_vec(&r).expect("a record serialises");
        assert_eq!(parse_record(&key, &again).ok(), Some(r));
    }
}

fn parse_record(key: &Key, data: &[u8]) -> Result<SnapshotRecord> {
    let bad = |reason: String| Error::BadSnapshot {
        key: key.to_hex(),
        reason,
    };
    if data.len() as u64 > MAX_RECORD_BYTES {
        return Err(bad(format!("record is {} bytes", data.len())));
    }
    let record: SnapshotRecord =
        serde_json::from_slice(data).map_err(|e| bad(format!("unreadable record: {e}")))?;
    if record.format != RECORD_FORMAT {
        return Err(bad(format!(
            "record format {}; this build reads format {RECORD_FORMAT}",
            record.format
        )));
    }
    if record.key != key.to_hex() {
        return Err(bad(format!("record names another key {}", record.key)));
    }
    if !record.tree.starts_with(&format!("{SNAPSHOTS}/{key}/tree-")) {
        return Err(bad(format!(
            "record names a tree outside its snapshot: {}",
            record.tree
        )));
    }
    if let Some(pack) = &record.pack
        && !pack.object.starts_with(&format!("{SNAPSHOTS}/{key}/pack-"))
    {
        return Err(bad(format!(
            "record names a pack outside its snapshot: {}",
            pack.object
        )));
    }
    if !record.captured_at.starts_with('/') {
        return Err(bad(format!(
            "capture path {:?} is not absolute",
            record.captured_at
        )));
    }
    for r in &record.path_refs {
        hotstart_store::tree::check_entry_path(&r.path)?;
    }
    Ok(record)
}
