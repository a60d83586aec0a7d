//! Open files: the handle table, and open, create, read, write, flush, fsync, release and
//! truncate on [`StripedFs`].
//!
//! **Handles.** `open` for reading pins the object's size and ETag ([`StripedReader::open`]) and
//! reads through a [`ReadHandle`] (read-ahead). Opening for writing needs a new name (`create`)
//! or `O_TRUNC` (the object is replaced whole at commit; overwriting in place is refused with
//! EPERM because objects cannot be modified in place); it returns a [`WriteHandle`]. The file's
//! inode carries a [`Writing`] marker until the handle commits, so stat and readdir show it at
//! its current length. `flush` and `fsync` commit what was written so far; writes may go on and
//! `release` commits what no earlier commit published.
//!
//! **Memory.** Read-ahead buffers and upload parts of every handle draw from one [`ByteBudget`].
//! The handle table is the budget's [`Reclaim`]: when an acquire cannot be served, it takes back
//! the read-ahead of read handles that no request holds (a handle is locked for the length of
//! each request on it), and every unlock announces that its handle may be reclaimed now. See
//! `read.rs` for why a demand read must not wait for memory that an idle handle holds.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use hotstart_store::budget::Reclaim;
use hotstart_store::object_store::ObjectStoreExt;
use hotstart_store::{ByteBudget, Store, StripeConfig, StripedReader};
use parking_lot::Mutex;

use super::{Attr, Ref, StripedFs};
use crate::DIR_MARKER;
use crate::cache::{self, StripeCache};
use crate::error::{FsError, FsResult};
use crate::inode::{FileKind, Writing};
use crate::read::{Cached, ReadAhead, ReadHandle};
use crate::write::WriteHandle;

/// One open file: read through read-ahead, or written through a staged upload.
enum Handle {
    Read(ReadHandle),
    Write(WriteHandle),
}

type Shared<T> = Arc<tokio::sync::Mutex<T>>;

/// Open handles by number.
pub(super) struct HandleTable(Mutex<HashMap<u64, Shared<Handle>>>);

impl HandleTable {
    /// An empty table, registered as the reclaimer of `budget`.
    pub(super) fn new(budget: &ByteBudget) -> Arc<HandleTable> {
        let table = Arc::new(HandleTable(Mutex::new(HashMap::new())));
        let reclaim: Arc<dyn Reclaim> = table.clone();
        budget.set_reclaim(Arc::downgrade(&reclaim));
        table
    }

    /// Handles open now.
    pub(super) fn len(&self) -> usize {
        self.0.lock().len()
    }
}

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

impl StripedFs {
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
                    // Written on after a commit (see `flush`): stat shows it as being written
                    // again, until the next commit.
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
    /// Another descriptor of the same handle (a forked child's copy, a shell's `dup2`) may go on
    /// writing: the next commit publishes the whole file again.
    pub async fn flush(&self, fh: u64) -> FsResult<()> {
        let mut h = self.lock(fh).await?;
        match &mut *h {
            Handle::Write(w) => self.commit(fh, w).await,
            Handle::Read(_) => Ok(()),
        }
    }

    /// fsync(2): the object is visible and durable when this returns; later writes are published
    /// by the next commit.
    pub async fn fsync(&self, fh: u64) -> FsResult<()> {
        self.flush(fh).await
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
