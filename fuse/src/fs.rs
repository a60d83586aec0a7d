//! [`StripedFs`]: the filesystem logic as a plain async type over a [`Store`].
//!
//! Every operation takes inode numbers and names as FUSE does and returns plain values or an
//! [`FsError`]; nothing here knows about FUSE, so tests drive it directly.
//!
//! **Lookups.** A name is resolved from the inode table while its stat result is younger than
//! `stat_ttl`; otherwise the store is asked, with a HEAD of the key (a file) and a one-item
//! listing under `key/` (a directory) in parallel. When both exist the directory wins. Objects
//! written by other tools therefore appear within `stat_ttl`, and `readdir` always lists the store
//! afresh (one delimiter listing per directory), adding the files being written through the mount.
//!
//! **Names and open files.** This file holds the namespace: the inode table, stat and its TTL,
//! listing, mkdir, rmdir, unlink and rename, all of which only ask the store about keys.
//! `fs/files.rs` holds what happens to bytes: the handle table, open and create, read and write,
//! commit at flush, fsync and release, truncate, and the memory budget the handles share. The two
//! meet in the inode's [`Writing`] marker, which lets stat, readdir, unlink and rename see a file
//! that is still being written.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use hotstart_store::object_store::ObjectStoreExt;
use hotstart_store::{ByteBudget, Store};
use parking_lot::Mutex;

use crate::cache::StripeCache;
use crate::error::{FsError, FsResult};
use crate::inode::{FileKind, Inode, InodeTable, ROOT, Writing, join};
use crate::spill::SpillSpace;
use crate::{DIR_MARKER, FsConfig};

/// The attributes of one inode, as stat shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: FileKind,
    pub size: u64,
    pub mtime: SystemTime,
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub ino: u64,
    pub name: String,
    pub kind: FileKind,
}

/// Whether a stat result goes to the kernel in an entry reply, which it then references until
/// it forgets it (see `inode.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ref {
    Take,
    No,
}

/// The filesystem: an inode table and open handles over one store.
pub struct StripedFs {
    store: Store,
    cfg: FsConfig,
    budget: ByteBudget,
    transport: ByteBudget,
    spill: SpillSpace,
    cache: Option<StripeCache>,
    inodes: Mutex<InodeTable>,
    handles: Arc<HandleTable>,
    next_fh: AtomicU64,
}

impl std::fmt::Debug for StripedFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripedFs")
            .field("store", &self.store)
            .field("inodes", &self.inodes.lock().len())
            .field("open_handles", &self.handles.len())
            .finish()
    }
}

mod files;

use files::HandleTable;

impl StripedFs {
    /// A filesystem over `store`.
    pub fn new(store: Store, cfg: FsConfig) -> StripedFs {
        let cache = cfg.cache_dir.as_ref().and_then(|dir| {
            StripeCache::open(dir, cfg.cache_bytes)
                .inspect_err(|e| {
                    tracing::error!(dir = %dir.display(), error = %e, "stripe cache disabled");
                })
                .ok()
        });
        let budget = ByteBudget::new(cfg.memory_budget);
        let handles = HandleTable::new(&budget);
        StripedFs {
            cache,
            store,
            budget,
            // Window stripes land in buffers already counted in `budget`; see read.rs.
            transport: ByteBudget::new(usize::MAX >> 2),
            spill: SpillSpace::new(cfg.spill_dir.clone(), cfg.max_spill),
            inodes: Mutex::new(InodeTable::new(cfg.stat_ttl)),
            cfg,
            handles,
            next_fh: AtomicU64::new(1),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &FsConfig {
        &self.cfg
    }

    /// The memory budget shared by every handle (its `peak` shows the most ever held).
    pub fn budget(&self) -> &ByteBudget {
        &self.budget
    }

    /// The local disk limit shared by every spill file (its `peak` shows the most ever held).
    pub fn spill_space(&self) -> &SpillSpace {
        &self.spill
    }

    /// The local stripe cache, when one is configured.
    pub fn cache(&self) -> Option<&StripeCache> {
        self.cache.as_ref()
    }

    /// The store behind the filesystem.
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn attr(&self, ino: u64, node: &Inode) -> Attr {
        let (size, perm) = match node.kind {
            FileKind::File => (
                node.writing.as_ref().map_or(node.size, Writing::len),
                self.cfg.file_mode,
            ),
            FileKind::Dir => (0, self.cfg.dir_mode),
        };
        Attr {
            ino,
            kind: node.kind,
            size,
            mtime: node.mtime,
            perm,
            uid: self.cfg.uid,
            gid: self.cfg.gid,
        }
    }

    fn node(&self, ino: u64) -> FsResult<Inode> {
        self.inodes
            .lock()
            .get(ino)
            .cloned()
            .ok_or_else(|| FsError::NotFound {
                path: format!("<inode {ino}>"),
            })
    }

    fn check_writable(&self, path: &str) -> FsResult<()> {
        if self.cfg.read_only {
            return Err(FsError::ReadOnly { path: path.into() });
        }
        Ok(())
    }

    /// The path of `name` inside directory `parent`, refusing names that are not valid keys or
    /// that the store could not hold ([`Store::path_to_write`]: it holds no such object either).
    fn child_path(&self, parent: u64, name: &str) -> FsResult<String> {
        let dir = self.node(parent)?;
        if dir.kind != FileKind::Dir {
            return Err(FsError::NotDir { path: dir.path });
        }
        let path = join(&dir.path, name);
        if name == DIR_MARKER {
            return Err(FsError::NotFound { path });
        }
        if name.is_empty() || name == "." || name == ".." || name.contains('/') {
            return Err(FsError::Invalid {
                path,
                reason: "not a valid object key component".into(),
            });
        }
        self.store
            .path_to_write(&path)
            .map_err(|e| FsError::Invalid {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Ok(path)
    }

    /// The table's stat result for `path` while fresh; `Ref::Take` counts a kernel reference.
    fn cached(&self, path: &str, r: Ref) -> Option<Attr> {
        let mut t = self.inodes.lock();
        let ino = t.ino_of(path)?;
        let node = t.get(ino)?;
        let fresh =
            ino == ROOT || node.writing.is_some() || node.checked.elapsed() < self.cfg.stat_ttl;
        let attr = fresh.then(|| self.attr(ino, node))?;
        if r == Ref::Take {
            t.looked_up(ino);
        }
        Some(attr)
    }

    async fn dir_exists(&self, path: &str) -> FsResult<bool> {
        if path.is_empty() {
            return Ok(true);
        }
        let prefix = Store::path(path).map_err(|e| FsError::store(path, e))?;
        let under = format!("{path}/");
        let mut listing = self.store.object_store().list(Some(&prefix));
        while let Some(item) = listing.next().await {
            let meta = item.map_err(|e| FsError::backend(path, e))?;
            if meta.location.as_ref().starts_with(&under) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Asks the store what `path` is now.
    async fn probe(&self, path: &str) -> FsResult<Option<(FileKind, u64, SystemTime)>> {
        if path.is_empty() {
            return Ok(Some((FileKind::Dir, 0, SystemTime::UNIX_EPOCH)));
        }
        let key = Store::path(path).map_err(|e| FsError::store(path, e))?;
        let os = self.store.object_store();
        let (head, dir) = tokio::join!(os.head(&key), self.dir_exists(path));
        if dir? {
            return Ok(Some((FileKind::Dir, 0, SystemTime::now())));
        }
        match head {
            Ok(meta) => Ok(Some((FileKind::File, meta.size, meta.last_modified.into()))),
            Err(hotstart_store::object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(FsError::backend(path, e)),
        }
    }

    /// Asks the store about `path` and records the answer; `Ref::Take` counts a kernel reference
    /// in the same step, so the inode cannot be swept before the kernel holds it.
    async fn refresh(&self, path: &str, r: Ref) -> FsResult<Attr> {
        let found = self.probe(path).await?;
        let mut t = self.inodes.lock();
        match found {
            Some((kind, size, mtime)) => {
                let ino = t.upsert(path, kind, size, mtime);
                let node = t
                    .get(ino)
                    .ok_or_else(|| FsError::NotFound { path: path.into() })?;
                let attr = self.attr(ino, node);
                if r == Ref::Take {
                    t.looked_up(ino);
                }
                Ok(attr)
            }
            None => {
                if let Some(ino) = t.ino_of(path)
                    && let Some(node) = t.get(ino)
                    && node.writing.is_some()
                {
                    let attr = self.attr(ino, node);
                    if r == Ref::Take {
                        t.looked_up(ino);
                    }
                    return Ok(attr);
                }
                t.remove_path(path);
                Err(FsError::NotFound { path: path.into() })
            }
        }
    }

    async fn stat_path(&self, path: &str, r: Ref) -> FsResult<Attr> {
        match self.cached(path, r) {
            Some(a) => Ok(a),
            None => self.refresh(path, r).await,
        }
    }

    /// Resolves `name` in directory `parent`. The kernel then holds a reference to the inode
    /// until it forgets it; so do `create` and `mkdir`.
    pub async fn lookup(&self, parent: u64, name: &str) -> FsResult<Attr> {
        let path = self.child_path(parent, name)?;
        self.stat_path(&path, Ref::Take).await
    }

    /// The kernel dropped `nlookup` references to `ino` (FUSE `forget`): an inode it no longer
    /// references is dropped from the table unless it is being written.
    pub fn forget(&self, ino: u64, nlookup: u64) {
        self.inodes.lock().forget(ino, nlookup);
    }

    /// The attributes of `ino`, from the table while fresh, else from the store.
    pub async fn getattr(&self, ino: u64) -> FsResult<Attr> {
        let node = self.node(ino)?;
        self.stat_path(&node.path, Ref::No).await
    }

    /// Every entry of directory `ino` (without `.` and `..`), sorted by name.
    pub async fn readdir(&self, ino: u64) -> FsResult<Vec<DirEntry>> {
        let dir = self.node(ino)?;
        if dir.kind != FileKind::Dir {
            return Err(FsError::NotDir { path: dir.path });
        }
        let prefix = match dir.path.as_str() {
            "" => None,
            p => Some(Store::path(p).map_err(|e| FsError::store(p, e))?),
        };
        let listing = self
            .store
            .object_store()
            .list_with_delimiter(prefix.as_ref())
            .await
            .map_err(|e| FsError::backend(&dir.path, e))?;
        let mut found: BTreeMap<String, (FileKind, u64, SystemTime)> = BTreeMap::new();
        for obj in &listing.objects {
            let Some(name) = obj.location.filename() else {
                continue;
            };
            if name != DIR_MARKER {
                let mtime = obj.last_modified.into();
                found.insert(name.to_string(), (FileKind::File, obj.size, mtime));
            }
        }
        for p in &listing.common_prefixes {
            if let Some(name) = p.filename() {
                found.insert(name.to_string(), (FileKind::Dir, 0, SystemTime::now()));
            }
        }
        let mut t = self.inodes.lock();
        let mut out = Vec::with_capacity(found.len());
        for (name, (kind, size, mtime)) in found {
            let ino = t.upsert(&join(&dir.path, &name), kind, size, mtime);
            out.push(DirEntry { ino, name, kind });
        }
        for (ino, node) in t.writing_in(&dir.path) {
            let name = node
                .path
                .rsplit('/')
                .next()
                .unwrap_or(&node.path)
                .to_string();
            if !out.iter().any(|e| e.name == name) {
                out.push(DirEntry {
                    ino,
                    name,
                    kind: FileKind::File,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Makes an empty directory (a marker object).
    pub async fn mkdir(&self, parent: u64, name: &str) -> FsResult<Attr> {
        let path = self.child_path(parent, name)?;
        self.check_writable(&path)?;
        match self.stat_path(&path, Ref::No).await {
            Ok(_) => return Err(FsError::Exists { path }),
            Err(FsError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
        let marker = join(&path, DIR_MARKER);
        self.store
            .put(&marker, Bytes::new())
            .await
            .map_err(|e| FsError::store(&path, e))?;
        let mut t = self.inodes.lock();
        let ino = t.upsert(&path, FileKind::Dir, 0, SystemTime::now());
        let node = t.get(ino).ok_or_else(|| FsError::NotFound { path })?;
        let attr = self.attr(ino, node);
        t.looked_up(ino);
        Ok(attr)
    }

    /// Keys under directory `path` other than its marker, at most `limit` of them.
    async fn dir_contents(&self, path: &str, limit: usize) -> FsResult<Vec<String>> {
        let prefix = Store::path(path).map_err(|e| FsError::store(path, e))?;
        let marker = join(path, DIR_MARKER);
        let under = format!("{path}/");
        let mut listing = self.store.object_store().list(Some(&prefix));
        let mut out = Vec::new();
        while let Some(item) = listing.next().await {
            let meta = item.map_err(|e| FsError::backend(path, e))?;
            let key = meta.location.to_string();
            if key != marker && key.starts_with(&under) {
                out.push(key);
                if out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Removes an empty directory.
    pub async fn rmdir(&self, parent: u64, name: &str) -> FsResult<()> {
        let path = self.child_path(parent, name)?;
        self.check_writable(&path)?;
        match self.refresh(&path, Ref::No).await?.kind {
            FileKind::File => return Err(FsError::NotDir { path }),
            FileKind::Dir => {}
        }
        if !self.dir_contents(&path, 1).await?.is_empty() || self.inodes.lock().writing_under(&path)
        {
            return Err(FsError::NotEmpty { path });
        }
        self.store
            .delete(&join(&path, DIR_MARKER))
            .await
            .map_err(|e| FsError::store(&path, e))?;
        self.inodes.lock().remove_path(&path);
        Ok(())
    }

    /// Removes a file. A file still open for writing is dropped at its close instead of committed.
    pub async fn unlink(&self, parent: u64, name: &str) -> FsResult<()> {
        let path = self.child_path(parent, name)?;
        self.check_writable(&path)?;
        let writing = {
            let t = self.inodes.lock();
            t.ino_of(&path)
                .and_then(|i| t.get(i))
                .and_then(|n| n.writing.clone())
        };
        if let Some(w) = writing {
            w.cancelled.store(true, Ordering::Relaxed);
            self.store
                .delete(&path)
                .await
                .map_err(|e| FsError::store(&path, e))?;
            self.inodes.lock().remove_path(&path);
            return Ok(());
        }
        match self.refresh(&path, Ref::No).await?.kind {
            FileKind::Dir => return Err(FsError::IsDir { path }),
            FileKind::File => {}
        }
        self.store
            .delete(&path)
            .await
            .map_err(|e| FsError::store(&path, e))?;
        self.inodes.lock().remove_path(&path);
        Ok(())
    }

    fn is_writing(&self, path: &str) -> bool {
        let t = self.inodes.lock();
        t.ino_of(path)
            .and_then(|i| t.get(i))
            .is_some_and(|n| n.writing.is_some())
    }

    /// Renames a file (replacing a file at the target), or an empty directory. A non-empty
    /// directory is refused with EXDEV so that `mv` copies it instead.
    pub async fn rename(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
    ) -> FsResult<()> {
        let from = self.child_path(parent, name)?;
        let to = self.child_path(new_parent, new_name)?;
        self.check_writable(&from)?;
        if to.starts_with(&format!("{from}/")) {
            return Err(FsError::Invalid {
                path: to,
                reason: "cannot move a directory into itself".into(),
            });
        }
        if self.is_writing(&from) || self.is_writing(&to) {
            return Err(FsError::Busy {
                path: from,
                reason: "the file is open for writing",
            });
        }
        let src = self.refresh(&from, Ref::No).await?;
        if from == to {
            return Ok(());
        }
        let dst = match self.refresh(&to, Ref::No).await {
            Ok(a) => Some(a.kind),
            Err(FsError::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        match (src.kind, dst) {
            (_, Some(_)) if no_replace => return Err(FsError::Exists { path: to }),
            (FileKind::File, Some(FileKind::Dir)) => return Err(FsError::IsDir { path: to }),
            (FileKind::Dir, Some(FileKind::File)) => return Err(FsError::NotDir { path: to }),
            (FileKind::Dir, Some(FileKind::Dir))
                if !self.dir_contents(&to, 1).await?.is_empty() =>
            {
                return Err(FsError::NotEmpty { path: to });
            }
            _ => {}
        }
        let (src_key, dst_key) = match src.kind {
            FileKind::File => (from.clone(), to.clone()),
            FileKind::Dir => {
                if !self.dir_contents(&from, 1).await?.is_empty() {
                    return Err(FsError::CrossDevice { path: from });
                }
                (join(&from, DIR_MARKER), join(&to, DIR_MARKER))
            }
        };
        let os = self.store.object_store();
        let a = Store::path(&src_key).map_err(|e| FsError::store(&from, e))?;
        let b = Store::path(&dst_key).map_err(|e| FsError::store(&to, e))?;
        os.rename(&a, &b)
            .await
            .map_err(|e| FsError::backend(&from, e))?;
        let mut t = self.inodes.lock();
        t.rename(&from, &to);
        if let Some(ino) = t.ino_of(&to)
            && let Some(node) = t.get_mut(ino)
        {
            node.checked = Instant::now();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
