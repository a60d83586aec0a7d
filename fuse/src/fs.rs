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
//! **Handles.** `open` for reading pins the object's size and ETag ([`StripedReader::open`]) and
//! reads through a [`ReadHandle`] (read-ahead). Opening for writing needs a new name (`create`)
//! or `O_TRUNC` (the object is replaced whole at commit; overwriting in place is refused with
//! EPERM because objects cannot be modified in place); it returns a [`WriteHandle`]. The file's
//! inode carries a [`Writing`] marker until the handle commits, so stat and readdir show it at
//! its current length. `flush` and `fsync` commit; `release` commits if nothing has yet.
//!
//! **Memory.** Read-ahead buffers and upload parts of every handle draw from one [`ByteBudget`].
//! The handle table is the budget's [`Reclaim`]: when an acquire cannot be served, it takes back
//! the read-ahead of read handles that no request holds (a handle is locked for the length of
//! each request on it), and every unlock announces that its handle may be reclaimed now. See
//! `read.rs` for why a demand read must not wait for memory that an idle handle holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use hotstart_store::budget::Reclaim;
use hotstart_store::object_store::ObjectStoreExt;
use hotstart_store::{ByteBudget, Store, StripeConfig, StripedReader};
use parking_lot::Mutex;

use crate::cache::{self, StripeCache};
use crate::error::{FsError, FsResult};
use crate::inode::{Inode, InodeTable, ROOT, Writing, join};
use crate::read::{Cached, ReadAhead, ReadHandle};
use crate::spill::SpillSpace;
use crate::write::WriteHandle;
use crate::{DIR_MARKER, FsConfig};

/// What an inode is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
}

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

enum Handle {
    Read(ReadHandle),
    Write(WriteHandle),
}

type Shared<T> = Arc<tokio::sync::Mutex<T>>;

/// Open handles by number.
#[derive(Default)]
struct HandleTable(Mutex<HashMap<u64, Shared<Handle>>>);

impl Reclaim for HandleTable {
    /// Takes back the read-ahead of read handles that no request is using (their lock is free).
    fn reclaim(&self, wanted: usize) -> usize {
        let open: Vec<Shared<Handle>> = self.0.lock().values().cloned().collect();
        let mut freed = 0;
        for h in open {
            if freed >= wanted {
                break;
            }
            if let Ok(mut h) = h.try_lock()
                && let Handle::Read(r) = &mut *h
            {
                freed += r.reclaim();
            }
        }
        if freed > 0 {
            tracing::debug!(freed, wanted, "took back read-ahead of idle handles");
        }
        freed
    }
}

/// A handle locked for one request; unlocking tells memory waiters it may be reclaimed now.
struct Locked {
    guard: Option<tokio::sync::OwnedMutexGuard<Handle>>,
    budget: ByteBudget,
}

impl std::ops::Deref for Locked {
    type Target = Handle;
    fn deref(&self) -> &Handle {
        self.guard.as_deref().expect("held until drop")
    }
}

impl std::ops::DerefMut for Locked {
    fn deref_mut(&mut self) -> &mut Handle {
        self.guard.as_deref_mut().expect("held until drop")
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.budget.reclaimable();
    }
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
            .field("open_handles", &self.handles.0.lock().len())
            .finish()
    }
}

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
        let handles = Arc::new(HandleTable::default());
        let reclaim: Arc<dyn Reclaim> = handles.clone();
        budget.set_reclaim(Arc::downgrade(&reclaim));
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

    /// The path of `name` inside directory `parent`, refusing names that are not valid keys.
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
        Store::path(&path).map_err(|e| FsError::Invalid {
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

    fn stripe_cfg(&self, budget: &ByteBudget) -> StripeConfig {
        StripeConfig {
            stripe_size: self.cfg.stripe_size,
            max_in_flight: self.cfg.max_in_flight,
            budget: budget.clone(),
        }
    }

    fn insert_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles
            .0
            .lock()
            .insert(fh, Arc::new(tokio::sync::Mutex::new(h)));
        fh
    }

    /// Locks handle `fh` for one request.
    async fn lock(&self, fh: u64) -> FsResult<Locked> {
        let h = self.handles.0.lock().get(&fh).cloned();
        let h = h.ok_or(FsError::BadHandle {
            fh,
            reason: "not open",
        })?;
        Ok(Locked {
            guard: Some(h.lock_owned().await),
            budget: self.budget.clone(),
        })
    }

    /// Starts a write handle for `path` (inode `ino`), marking the inode as being written.
    fn start_write(&self, ino: u64, path: &str) -> FsResult<u64> {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let shared = Writing::new(fh);
        {
            let mut t = self.inodes.lock();
            let node = t
                .get_mut(ino)
                .ok_or_else(|| FsError::NotFound { path: path.into() })?;
            if node.writing.is_some() {
                return Err(FsError::Busy {
                    path: path.into(),
                    reason: "the file is already open for writing",
                });
            }
            node.writing = Some(shared.clone());
            node.mtime = SystemTime::now();
        }
        let cfg = self.stripe_cfg(&self.budget);
        let w = WriteHandle::new(
            self.store.clone(),
            path.to_string(),
            cfg,
            self.spill.clone(),
            shared,
        );
        self.handles
            .0
            .lock()
            .insert(fh, Arc::new(tokio::sync::Mutex::new(Handle::Write(w))));
        Ok(fh)
    }

    /// The cache identity of the version of `path` being opened (a HEAD after the reader pinned
    /// its ETag: if the object changed in between, the reader's GETs fail with ESTALE).
    async fn cached_view(&self, c: &StripeCache, path: &str, size: u64) -> FsResult<Cached> {
        let key = Store::path(path).map_err(|e| FsError::store(path, e))?;
        let meta = self
            .store
            .object_store()
            .head(&key)
            .await
            .map_err(|e| FsError::backend(path, e))?;
        if meta.size != size {
            return Err(FsError::Stale { path: path.into() });
        }
        let mtime = meta.last_modified.into();
        Ok(Cached {
            cache: c.clone(),
            version: cache::version(path, meta.e_tag.as_deref(), size, mtime),
            stripe: self.cfg.stripe_size.max(1) as u64,
            in_flight: self.cfg.max_in_flight,
        })
    }

    /// Opens `ino` with open(2) `flags`; returns the handle.
    pub async fn open(&self, ino: u64, flags: i32) -> FsResult<u64> {
        let node = self.node(ino)?;
        if node.kind == FileKind::Dir {
            return Err(FsError::IsDir { path: node.path });
        }
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            let cfg = self.stripe_cfg(&self.transport);
            let reader = StripedReader::open(&self.store, &node.path, cfg)
                .await
                .map_err(|e| FsError::store(&node.path, e))?;
            let limits = ReadAhead {
                initial: self.cfg.initial_read_ahead,
                max: self.cfg.max_read_ahead,
            };
            let cached = match &self.cache {
                Some(c) => Some(self.cached_view(c, &node.path, reader.size()).await?),
                None => None,
            };
            let h = ReadHandle::new(node.path, reader, self.budget.clone(), limits, cached);
            return Ok(self.insert_handle(Handle::Read(h)));
        }
        self.check_writable(&node.path)?;
        if flags & libc::O_TRUNC == 0 {
            let size = self.getattr(ino).await?.size;
            if size > 0 {
                let e = FsError::Refused {
                    path: node.path,
                    reason: "opening an existing file for writing needs O_TRUNC \
                             (objects are replaced whole, never modified in place)",
                };
                tracing::warn!(error = %e, "open refused");
                return Err(e);
            }
        }
        self.start_write(ino, &node.path)
    }

    /// Creates (or replaces, at commit) file `name` in `parent` and opens it for writing.
    pub async fn create(&self, parent: u64, name: &str, flags: i32) -> FsResult<(Attr, u64)> {
        let path = self.child_path(parent, name).map_err(|e| match e {
            FsError::NotFound { path } => FsError::Invalid {
                path,
                reason: format!("{DIR_MARKER} is reserved for directory markers"),
            },
            e => e,
        })?;
        self.check_writable(&path)?;
        if flags & libc::O_EXCL != 0 && self.stat_path(&path, Ref::No).await.is_ok() {
            return Err(FsError::Exists { path });
        }
        let ino = {
            let mut t = self.inodes.lock();
            let ino = t.upsert(&path, FileKind::File, 0, SystemTime::now());
            if let Some(n) = t.get_mut(ino)
                && n.writing.is_none()
            {
                n.kind = FileKind::File;
                n.size = 0;
            }
            // Counted with the upsert, so that no sweep drops the new inode in between.
            t.looked_up(ino);
            ino
        };
        let fh = self
            .start_write(ino, &path)
            .inspect_err(|_| self.forget(ino, 1))?;
        let attr = {
            let t = self.inodes.lock();
            let node = t.get(ino).ok_or_else(|| FsError::NotFound { path })?;
            self.attr(ino, node)
        };
        Ok((attr, fh))
    }

    /// Up to `size` bytes at `offset` (fewer only at the end of the file).
    pub async fn read(&self, fh: u64, offset: u64, size: usize) -> FsResult<Bytes> {
        let mut h = self.lock(fh).await?;
        match &mut *h {
            Handle::Read(r) => r.read(offset, size).await,
            Handle::Write(w) => w.read(offset, size),
        }
    }

    /// Writes `data` at `offset` through a write handle.
    pub async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<usize> {
        let mut h = self.lock(fh).await?;
        match &mut *h {
            Handle::Write(w) => {
                if w.is_committed() {
                    // Re-opened empty file (see `flush`): stat shows it as being written again.
                    let mut t = self.inodes.lock();
                    if let Some(ino) = t.ino_of(w.key())
                        && let Some(node) = t.get_mut(ino)
                        && node.writing.is_none()
                    {
                        node.writing = Some(w.shared().clone());
                    }
                }
                w.write(offset, data).await
            }
            Handle::Read(_) => Err(FsError::BadHandle {
                fh,
                reason: "not open for writing",
            }),
        }
    }

    async fn commit(&self, fh: u64, w: &mut WriteHandle) -> FsResult<()> {
        let was_committed = w.is_committed();
        let res = w.commit().await;
        let mut t = self.inodes.lock();
        if let Some(ino) = t.ino_of(w.key())
            && let Some(node) = t.get_mut(ino)
            && node.writing.as_ref().is_some_and(|s| s.fh == fh)
        {
            node.writing = None;
            match &res {
                Ok(len) if !was_committed => {
                    node.size = *len;
                    node.mtime = SystemTime::now();
                    node.checked = Instant::now();
                }
                // Failed: whatever the store holds (the old version, or nothing) is the truth.
                _ => node.checked = Instant::now() - self.cfg.stat_ttl,
            }
        }
        res.map(|_| ())
    }

    /// close(2) of one descriptor: commits a write handle, so close reports upload errors.
    /// An empty file committed this way may still be written through another descriptor of the
    /// same handle (shells `dup2` and close before writing): it is then committed again.
    pub async fn flush(&self, fh: u64) -> FsResult<()> {
        let mut h = self.lock(fh).await?;
        match &mut *h {
            Handle::Write(w) => self.commit(fh, w).await,
            Handle::Read(_) => Ok(()),
        }
    }

    /// fsync(2): the object is visible and durable when this returns. Later writes to the
    /// handle are refused (the object is immutable once committed).
    pub async fn fsync(&self, fh: u64) -> FsResult<()> {
        let mut h = self.lock(fh).await?;
        match &mut *h {
            Handle::Write(w) => self.commit(fh, w).await,
            Handle::Read(_) => Ok(()),
        }
    }

    /// The last close: commits if nothing did, and forgets the handle.
    pub async fn release(&self, fh: u64) -> FsResult<()> {
        let h = self
            .handles
            .0
            .lock()
            .remove(&fh)
            .ok_or(FsError::BadHandle {
                fh,
                reason: "not open",
            })?;
        let mut h = h.lock().await;
        match &mut *h {
            Handle::Write(w) => self.commit(fh, w).await,
            Handle::Read(_) => Ok(()),
        }
    }

    /// Sets the size (truncate); other attributes are fixed by the mount options.
    pub async fn setattr(&self, ino: u64, size: Option<u64>) -> FsResult<Attr> {
        let Some(size) = size else {
            return self.getattr(ino).await;
        };
        let node = self.node(ino)?;
        self.check_writable(&node.path)?;
        if node.kind == FileKind::Dir {
            return Err(FsError::IsDir { path: node.path });
        }
        if let Some(w) = &node.writing {
            let mut h = self.lock(w.fh).await?;
            if let Handle::Write(w) = &mut *h {
                w.truncate(size).await?;
            }
        } else if size == 0 {
            self.store
                .put(&node.path, Bytes::new())
                .await
                .map_err(|e| FsError::store(&node.path, e))?;
            self.inodes
                .lock()
                .upsert(&node.path, FileKind::File, 0, SystemTime::now());
        } else if self.refresh(&node.path, Ref::No).await?.size != size {
            let e = FsError::Refused {
                path: node.path,
                reason: "changing the size of a stored object other than to zero",
            };
            tracing::warn!(error = %e, "truncate refused");
            return Err(e);
        }
        self.getattr(ino).await
    }
}

#[cfg(test)]
#[path = "fs_tests.rs"]
mod tests;
