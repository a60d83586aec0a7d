//! [`ImageFs`]: a [`Tree`] served read-only, its file contents read lazily through a
//! [`Loader`]. A plain type: the FUSE adapter of `hotstart-fuse` serves it through the
//! [`Filesystem`] trait, and tests call it directly.
//!
//! The whole namespace is built in memory when the filesystem is made: inode 1 is the root,
//! every tree entry gets the next number, and a hard link is one more name of its target's inode
//! (whose link count says how many names it has). Lookups, attributes, listings, symlink targets
//! and xattrs never touch the store. A read finds the chunks that cover its range (by binary
//! search over each file's chunk offsets), asks the loader for them concurrently, and returns
//! the requested slice; a chunk that cannot be fetched or fails verification makes that read
//! EIO, and only that file's reads that touch it.
//!
//! Nothing can change, so the kernel may cache everything for as long as it likes: entries,
//! attributes and negative lookups get the configured TTL, open files keep their page cache,
//! symlink targets are cached, and listings carry every entry's attributes, so a process that
//! lists a directory and then opens what it found (Python's import system) sends no lookup for
//! those names.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use hotstart_fuse::{
    Asked, CachePolicy, Filesystem, FsError, FsResult, NodeAttr, NodeEntry, NodeKind,
};
use hotstart_store::tree::ChunkRef;
use hotstart_store::{ChunkId, Entry, EntryKind, Tree};
use parking_lot::Mutex;

use crate::loader::Loader;

const ROOT: u64 = 1;

#[derive(Debug)]
enum Data {
    Dir {
        children: BTreeMap<String, u64>,
    },
    File {
        size: u64,
        chunks: Vec<ChunkRef>,
        offsets: Vec<u64>,
    },
    Symlink {
        target: String,
    },
    /// An overlay whiteout (a character device 0/0 to the kernel).
    Whiteout,
}

#[derive(Debug)]
struct Node {
    path: String,
    data: Data,
    perm: u16,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
    nlink: u32,
    xattrs: BTreeMap<String, Vec<u8>>,
}

/// A read-only, lazily read tree.
pub struct ImageFs {
    /// Inode `i` is `nodes[i - 1]`.
    nodes: Vec<Node>,
    loader: Arc<Loader>,
    ttl: Duration,
    /// Files the page-cache warmer has taken on (see `warm.rs`), until the job first uses
    /// each. The warmer itself only lists directories, which is not a use.
    warming: Mutex<HashMap<u64, WarmState>>,
    /// Whether any node has an xattr: without any, the kernel is told xattrs are not
    /// supported and stops asking (overlayfs asks for its markers on every lower lookup).
    xattrs: bool,
}

#[derive(Debug)]
enum WarmState {
    /// Its pages are not stored yet; a use now leaves it to its reads.
    Pending,
    /// These chunks' pages were stored (or are being stored) in the kernel's page cache: a
    /// use now is counted as reading them, since those reads will not reach the filesystem.
    Stored(Vec<(ChunkId, u32)>),
}

/// A file the warmer stores pages of: runs of adjacent planned chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmFile {
    pub ino: u64,
    /// Its path in the tree (relative, `/`-separated).
    pub path: String,
    pub size: u64,
    pub runs: Vec<WarmRun>,
}

/// Adjacent chunks of one file, from `offset` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmRun {
    /// The place of its earliest chunk in the plan.
    pub rank: usize,
    pub offset: u64,
    pub chunks: Vec<(ChunkId, u32)>,
}

impl std::fmt::Debug for ImageFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageFs")
            .field("inodes", &self.nodes.len())
            .finish()
    }
}

fn time(ns: i64) -> SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH - Duration::from_nanos(ns.unsigned_abs())
    }
}

impl ImageFs {
    /// The filesystem of `tree` (already validated: sorted, parents first, hard links after
    /// their targets), reading through `loader`; the kernel may cache for `ttl`.
    pub fn new(tree: &Tree, loader: Arc<Loader>, ttl: Duration) -> ImageFs {
        let mut nodes = vec![Node {
            path: String::new(),
            data: Data::Dir {
                children: BTreeMap::new(),
            },
            perm: 0o755,
            uid: 0,
            gid: 0,
            mtime: UNIX_EPOCH,
            nlink: 2,
            xattrs: BTreeMap::new(),
        }];
        let mut ino_of: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
        ino_of.insert("", ROOT);
        for e in &tree.entries {
            let (dir, name) = e.path.rsplit_once('/').unwrap_or(("", &e.path));
            // Validation put parents first; an entry whose parent is missing or not a
            // directory is unreachable, so it is left out rather than attached elsewhere.
            let Some(&parent) = ino_of.get(dir) else {
                tracing::warn!(path = %e.path, "tree entry without a parent directory; hidden");
                continue;
            };
            let ino = match &e.kind {
                EntryKind::Hardlink { target } => match ino_of.get(target.as_str()) {
                    Some(&t) => {
                        nodes[t as usize - 1].nlink += 1;
                        t
                    }
                    None => continue,
                },
                EntryKind::Dir => push_node(
                    &mut nodes,
                    e,
                    Data::Dir {
                        children: BTreeMap::new(),
                    },
                ),
                EntryKind::File { size, chunks } => {
                    let mut offsets = Vec::with_capacity(chunks.len());
                    let mut at = 0u64;
                    for c in chunks {
                        offsets.push(at);
                        at += c.len as u64;
                    }
                    push_node(
                        &mut nodes,
                        e,
                        Data::File {
                            size: *size,
                            chunks: chunks.clone(),
                            offsets,
                        },
                    )
                }
                EntryKind::Symlink { target } => push_node(
                    &mut nodes,
                    e,
                    Data::Symlink {
                        target: target.clone(),
                    },
                ),
                EntryKind::Whiteout => push_node(&mut nodes, e, Data::Whiteout),
            };
            ino_of.insert(&e.path, ino);
            let parent_node = &mut nodes[parent as usize - 1];
            match &mut parent_node.data {
                Data::Dir { children } => {
                    children.insert(name.to_string(), ino);
                }
                _ => {
                    tracing::warn!(path = %e.path, "tree entry under a non-directory; hidden");
                    continue;
                }
            }
            if matches!(nodes[ino as usize - 1].data, Data::Dir { .. }) && ino != parent {
                nodes[parent as usize - 1].nlink += 1;
            }
        }
        let xattrs = nodes.iter().any(|n| !n.xattrs.is_empty());
        ImageFs {
            nodes,
            loader,
            ttl,
            warming: Mutex::default(),
            xattrs,
        }
    }

    /// The files holding the chunks of `plan`, each with its runs of planned chunks (and each
    /// run with its place in the plan); every one is marked pending, so that the kernel gets
    /// its entry and attributes with no TTL until the job uses it (see `warm.rs`). Call before
    /// the filesystem is mounted, so that no entry of these files was given out for longer.
    pub fn plan_warming(&self, plan: &[(ChunkId, u32)]) -> Vec<WarmFile> {
        let order: HashMap<ChunkId, usize> = plan
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (*id, i))
            .collect();
        let mut files = Vec::new();
        // One node per inode: a file with hard links appears once.
        for (i, n) in self.nodes.iter().enumerate() {
            let Data::File {
                size,
                chunks,
                offsets,
            } = &n.data
            else {
                continue;
            };
            let mut runs: Vec<WarmRun> = Vec::new();
            let mut prev_planned = false;
            for (c, &at) in chunks.iter().zip(offsets) {
                let Some(&rank) = order.get(&c.id) else {
                    prev_planned = false;
                    continue;
                };
                match runs.last_mut() {
                    Some(run) if prev_planned => {
                        run.rank = run.rank.min(rank);
                        run.chunks.push((c.id, c.len));
                    }
                    _ => runs.push(WarmRun {
                        rank,
                        offset: at,
                        chunks: vec![(c.id, c.len)],
                    }),
                }
                prev_planned = true;
            }
            if !runs.is_empty() {
                files.push(WarmFile {
                    ino: i as u64 + 1,
                    path: n.path.clone(),
                    size: *size,
                    runs,
                });
            }
        }
        let mut pending = self.warming.lock();
        for f in &files {
            pending.insert(f.ino, WarmState::Pending);
        }
        files
    }

    /// Whether the warmer may store the pages of `chunks` of `ino`: true if the job has not
    /// used the file yet, and from now on a use counts as reading them (with those stored
    /// before).
    pub fn claim_for_warming(&self, ino: u64, chunks: &[(ChunkId, u32)]) -> bool {
        let mut files = self.warming.lock();
        let Some(state) = files.get_mut(&ino) else {
            return false;
        };
        match state {
            WarmState::Pending => *state = WarmState::Stored(chunks.to_vec()),
            WarmState::Stored(stored) => stored.extend_from_slice(chunks),
        }
        true
    }

    /// Whether `ino` is still to be warmed (the job has not used it yet).
    pub fn warming(&self, ino: u64) -> bool {
        self.warming.lock().contains_key(&ino)
    }

    /// The warmer is done: files it did not get to get the usual TTL again (their reads
    /// reach the filesystem as any other file's).
    pub fn end_warming(&self) {
        self.warming
            .lock()
            .retain(|_, s| matches!(s, WarmState::Stored(_)));
    }

    /// The loader reads go through.
    pub fn loader(&self) -> &Arc<Loader> {
        &self.loader
    }

    fn node(&self, ino: u64) -> FsResult<&Node> {
        ino.checked_sub(1)
            .and_then(|i| self.nodes.get(i as usize))
            .ok_or_else(|| FsError::NotFound {
                path: format!("<inode {ino}>"),
            })
    }

    fn attr(&self, ino: u64, n: &Node) -> NodeAttr {
        let (kind, size) = match &n.data {
            Data::Dir { .. } => (NodeKind::Dir, 0),
            Data::File { size, .. } => (NodeKind::File, *size),
            Data::Symlink { target } => (NodeKind::Symlink, target.len() as u64),
            Data::Whiteout => (NodeKind::Whiteout, 0),
        };
        NodeAttr {
            ino,
            kind,
            size,
            mtime: n.mtime,
            perm: n.perm,
            nlink: n.nlink,
            uid: n.uid,
            gid: n.gid,
        }
    }

    fn kind(n: &Node) -> NodeKind {
        match n.data {
            Data::Dir { .. } => NodeKind::Dir,
            Data::File { .. } => NodeKind::File,
            Data::Symlink { .. } => NodeKind::Symlink,
            Data::Whiteout => NodeKind::Whiteout,
        }
    }

    /// Reads `len` bytes at `offset` of file `ino` (fewer at the end of the file).
    pub async fn read_at(&self, ino: u64, offset: u64, len: usize) -> FsResult<Bytes> {
        let n = self.node(ino)?;
        let Data::File {
            size,
            chunks,
            offsets,
        } = &n.data
        else {
            return Err(match n.data {
                Data::Dir { .. } => FsError::IsDir {
                    path: n.path.clone(),
                },
                _ => FsError::Invalid {
                    path: n.path.clone(),
                    reason: "not a regular file".into(),
                },
            });
        };
        if offset >= *size || len == 0 {
            self.loader.count_read(0);
            return Ok(Bytes::new());
        }
        let end = (offset + len as u64).min(*size);
        // The chunk holding `offset`, and every following one that starts before `end`.
        let first = offsets.partition_point(|&o| o <= offset) - 1;
        let last = offsets.partition_point(|&o| o < end) - 1;
        let wanted = &chunks[first..=last];
        let fetched =
            futures::future::join_all(wanted.iter().map(|c| self.loader.demand(c.id, c.len))).await;
        let mut parts = Vec::with_capacity(wanted.len());
        for (i, (res, c)) in fetched.into_iter().zip(wanted).enumerate() {
            let data = res.map_err(|source| FsError::Store {
                path: n.path.clone(),
                source,
            })?;
            if data.len() != c.len as usize {
                return Err(FsError::Store {
                    path: n.path.clone(),
                    source: hotstart_store::Error::Corrupt {
                        id: c.id.to_hex(),
                        reason: format!("{} bytes, the tree says {}", data.len(), c.len),
                    },
                });
            }
            let start = offsets[first + i];
            let from = offset.saturating_sub(start) as usize;
            let to = ((end - start) as usize).min(data.len());
            parts.push(data.slice(from..to));
        }
        let out = if parts.len() == 1 {
            parts.pop().unwrap_or_default()
        } else {
            let mut buf = BytesMut::with_capacity((end - offset) as usize);
            for p in parts {
                buf.extend_from_slice(&p);
            }
            buf.freeze()
        };
        self.loader.count_read(out.len() as u64);
        Ok(out)
    }
}

impl Filesystem for ImageFs {
    fn cache_policy(&self) -> CachePolicy {
        CachePolicy {
            ttl: self.ttl,
            negative_ttl: Some(self.ttl),
            keep_page_cache: true,
            stateless_open: true,
            listing_attrs: true,
        }
    }

    fn ttl_of(&self, ino: u64, asked: Asked) -> Option<Duration> {
        let mut files = self.warming.lock();
        if !files.contains_key(&ino) {
            return None;
        }
        match asked {
            Asked::Listing => Some(Duration::ZERO),
            // The job is about to use it: what was stored counts as read now.
            Asked::Use => {
                if let Some(WarmState::Stored(chunks)) = files.remove(&ino) {
                    drop(files);
                    for (id, len) in chunks {
                        self.loader.served_from_page_cache(id, len);
                    }
                }
                None
            }
        }
    }

    async fn lookup(&self, parent: u64, name: &str) -> FsResult<NodeAttr> {
        let dir = self.node(parent)?;
        let Data::Dir { children } = &dir.data else {
            return Err(FsError::NotDir {
                path: dir.path.clone(),
            });
        };
        let ino = *children.get(name).ok_or_else(|| FsError::NotFound {
            path: hotstart_fuse::join(&dir.path, name),
        })?;
        Ok(self.attr(ino, self.node(ino)?))
    }

    async fn getattr(&self, ino: u64) -> FsResult<NodeAttr> {
        Ok(self.attr(ino, self.node(ino)?))
    }

    async fn readdir(&self, ino: u64) -> FsResult<Vec<NodeEntry>> {
        let dir = self.node(ino)?;
        let Data::Dir { children } = &dir.data else {
            return Err(FsError::NotDir {
                path: dir.path.clone(),
            });
        };
        children
            .iter()
            .map(|(name, &ino)| {
                Ok(NodeEntry {
                    ino,
                    name: name.clone(),
                    kind: Self::kind(self.node(ino)?),
                })
            })
            .collect()
    }

    async fn open(&self, ino: u64, flags: i32) -> FsResult<u64> {
        let n = self.node(ino)?;
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return Err(FsError::ReadOnly {
                path: n.path.clone(),
            });
        }
        match n.data {
            Data::Dir { .. } => Err(FsError::IsDir {
                path: n.path.clone(),
            }),
            // Reads carry the inode; the handle is the inode too.
            _ => Ok(ino),
        }
    }

    async fn read(&self, ino: u64, _fh: u64, offset: u64, size: usize) -> FsResult<Bytes> {
        self.read_at(ino, offset, size).await
    }

    async fn readlink(&self, ino: u64) -> FsResult<Vec<u8>> {
        let n = self.node(ino)?;
        match &n.data {
            Data::Symlink { target } => Ok(target.as_bytes().to_vec()),
            _ => Err(FsError::Invalid {
                path: n.path.clone(),
                reason: "not a symlink".into(),
            }),
        }
    }

    fn has_xattrs(&self) -> bool {
        self.xattrs
    }

    async fn getxattr(&self, ino: u64, name: &str) -> FsResult<Option<Vec<u8>>> {
        Ok(self.node(ino)?.xattrs.get(name).cloned())
    }

    async fn listxattr(&self, ino: u64) -> FsResult<Vec<String>> {
        Ok(self.node(ino)?.xattrs.keys().cloned().collect())
    }
}

/// Adds the inode of entry `e` holding `data`; returns its number.
fn push_node(nodes: &mut Vec<Node>, e: &Entry, data: Data) -> u64 {
    let is_dir = matches!(data, Data::Dir { .. });
    nodes.push(Node {
        path: e.path.clone(),
        data,
        perm: (e.mode & 0o7777) as u16,
        uid: e.uid,
        gid: e.gid,
        mtime: time(e.mtime_ns),
        nlink: if is_dir { 2 } else { 1 },
        xattrs: e.xattrs.clone(),
    });
    nodes.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

    fn entry(path: &str, kind: EntryKind) -> Entry {
        Entry {
            path: path.to_string(),
            kind,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_ns: 0,
            xattrs: BTreeMap::new(),
        }
    }

    fn file(path: &str, chunks: &[&[u8]]) -> Entry {
        let refs: Vec<ChunkRef> = chunks
            .iter()
            .map(|c| ChunkRef {
                id: ChunkId::of(c),
                len: c.len() as u32,
            })
            .collect();
        let size = refs.iter().map(|c| c.len as u64).sum();
        entry(path, EntryKind::File { size, chunks: refs })
    }

    fn planned(data: &[&[u8]]) -> Vec<(ChunkId, u32)> {
        data.iter()
            .map(|c| (ChunkId::of(c), c.len() as u32))
            .collect()
    }

    #[tokio::test]
    async fn warming_hides_a_file_from_the_kernel_cache_until_the_job_uses_it() {
        let (a0, a1, a2, b0, c0, e0) = (
            &[1u8; 100][..],
            &[2u8; 200][..],
            &[3u8; 300][..],
            &[4u8; 400][..],
            &[5u8; 500][..],
            &[6u8; 600][..],
        );
        let tree = Tree {
            entries: vec![
                entry("d", EntryKind::Dir),
                file("d/a", &[a0, a1, a2]),
                file("d/b", &[b0]),
                file("d/c", &[c0]),
                file("d/e", &[e0]),
            ],
        };
        let chunks = ChunkStore::new(
            Store::open("memory://").unwrap(),
            ChunkStoreConfig::default(),
        )
        .unwrap();
        let loader = Arc::new(Loader::new(chunks, 1 << 20));
        let fs = ImageFs::new(&tree, loader.clone(), Duration::from_secs(60));
        let ino = |name: &'static str| {
            let fs = &fs;
            async move {
                let d = fs.lookup(ROOT, "d").await.unwrap().ino;
                fs.lookup(d, name).await.unwrap().ino
            }
        };
        let (a, b, c, e) = (
            ino("a").await,
            ino("b").await,
            ino("c").await,
            ino("e").await,
        );

        // The plan reads b0, then a1 and a2, then e0; a0 and c0 are cold.
        let files = fs.plan_warming(&planned(&[b0, a1, a2, e0]));
        let ranks: Vec<(&str, Vec<usize>)> = files
            .iter()
            .map(|f| (f.path.as_str(), f.runs.iter().map(|r| r.rank).collect()))
            .collect();
        assert_eq!(
            ranks,
            [("d/a", vec![1]), ("d/b", vec![0]), ("d/e", vec![3])]
        );
        let a_file = &files[0];
        assert_eq!(a_file.size, 600);
        assert_eq!(
            a_file.runs,
            [WarmRun {
                rank: 1,
                offset: 100,
                chunks: planned(&[a1, a2]),
            }]
        );

        let job = Asked::Use;
        // Until the job uses them, files to warm are listed with no TTL, and a listing is no
        // use.
        for f in [a, b, e] {
            assert_eq!(fs.ttl_of(f, Asked::Listing), Some(Duration::ZERO));
        }
        assert_eq!(fs.ttl_of(c, Asked::Listing), None, "not planned");
        assert_eq!(loader.stats().chunks_read, 0, "a listing is not a read");

        // a's pages are stored; the job's first lookup counts them as read (as hits).
        assert!(fs.claim_for_warming(a, &a_file.runs[0].chunks));
        assert_eq!(fs.ttl_of(a, job), None);
        let s = loader.stats();
        assert_eq!((s.chunks_read, s.chunk_bytes_read, s.hits), (2, 500, 2));
        assert_eq!(
            fs.ttl_of(a, Asked::Listing),
            None,
            "the usual TTL from now on"
        );
        assert_eq!(fs.ttl_of(a, job), None);
        assert_eq!(loader.stats().chunks_read, 2, "counted once");

        // b is used before the warmer gets to it: it is left to its reads.
        assert_eq!(fs.ttl_of(b, job), None);
        assert!(!fs.claim_for_warming(b, &files[1].runs[0].chunks));
        assert_eq!(loader.stats().chunks_read, 2);

        // The warmer ends without e: e gets the usual TTL back, and nothing was read.
        fs.end_warming();
        assert_eq!(fs.ttl_of(e, Asked::Listing), None);
        assert_eq!(fs.ttl_of(e, job), None);
        assert_eq!(loader.stats().chunks_read, 2);
    }
}
