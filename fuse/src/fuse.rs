//! The thin `fuser` adapter: each FUSE request becomes one task on a tokio runtime that calls a
//! [`Filesystem`] ([`StripedFs`](crate::StripedFs), or the lazy image filesystem) and replies
//! from there.
//!
//! fuser reads requests on its session thread(s) and calls these methods; none of them blocks:
//! they convert arguments (names must be UTF-8, as object keys are), spawn the operation through
//! one helper (`FuseAdapter::serve`), and return, so a slow GET or part upload never holds up
//! other requests. Replies carry the errno of [`FsError::errno`](crate::FsError::errno); errors
//! other than ENOENT are logged with the operation. Directory listings are taken once at opendir
//! and served by offset from that snapshot. `forget` (and `batch_forget`, one inode at a time)
//! goes to the inode table at once (no task), so inodes the kernel has dropped do not pile up.
//! At `init` the kernel is asked for 1 MiB reads and writes per request, atomic `O_TRUNC` on
//! open (so "open existing without truncation" can be told apart), and a `max_background` large
//! enough for many parallel reads.
//!
//! A request is first run on the session thread that read it, as far as it goes without
//! waiting: what the filesystem answers from memory (a lookup, a read of cached bytes) is
//! answered there, with no hand-off between threads; an operation that must wait (a GET) goes on
//! as a task. For a process that opens thousands of small files one after another (Python
//! importing packages), the hand-off was a large part of each request's time. `ioctl` is
//! answered ENOTTY at once (Python asks `isatty` of every file it opens).
//!
//! What the kernel may cache comes from the filesystem's [`CachePolicy`]: the TTL of entries and
//! attributes, whether "no such name" is cached too (a negative entry), and whether an open keeps
//! the inode's page cache (and, with it, symlink targets); a filesystem may give single inodes
//! another TTL in lookups, attributes and listings ([`Filesystem::ttl_of`]). A filesystem whose
//! attributes are at hand ([`CachePolicy::listing_attrs`]) answers listings with READDIRPLUS: every
//! entry with its attributes, which the kernel keeps as if it had looked each name up (an import of
//! numpy and pandas from a lazy mount sent 705 lookups instead of 1,136). Symlinks and extended
//! attributes are passed through; a filesystem without xattrs answers ENOSYS once, so the kernel
//! stops asking. A filesystem whose opens are stateless ([`CachePolicy::stateless_open`]) answers
//! open, opendir and flush ENOSYS where the kernel supports that, so it stops sending them (and
//! release): three of the four requests that opening and closing a small file took; listings are
//! then served by offset from [`Filesystem::readdir`] and kept in the kernel's page cache.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Waker};
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs,
    ReplyWrite, ReplyXattr, Request, TimeOrNow, WriteFlags,
};
use parking_lot::Mutex;

use crate::error::FsError;
use crate::filesystem::{Asked, CachePolicy, Filesystem, NodeAttr, NodeEntry, NodeKind};

/// Bytes per FUSE read or write request asked of the kernel.
pub const MAX_IO: u32 = 1 << 20;

pub(crate) struct FuseAdapter<F> {
    fs: Arc<F>,
    rt: tokio::runtime::Handle,
    policy: CachePolicy,
    max_background: u16,
    dirs: Arc<Mutex<HashMap<u64, Arc<Listing>>>>,
    next_dir: AtomicU64,
    /// The kernel sends no open, flush or release (set at `init`).
    no_open: bool,
    /// The kernel sends no opendir or releasedir (set at `init`).
    no_opendir: bool,
}

/// A reply that can carry an error; every reply a spawned request sends is one.
trait ErrorReply {
    fn fail(self, errno: Errno);
}

macro_rules! error_reply {
    ($($reply:ty),*) => {$(
        impl ErrorReply for $reply {
            fn fail(self, errno: Errno) {
                self.error(errno);
            }
        }
    )*};
}

error_reply!(
    ReplyAttr,
    ReplyCreate,
    ReplyData,
    ReplyDirectory,
    ReplyDirectoryPlus,
    ReplyEmpty,
    ReplyEntry,
    ReplyOpen,
    ReplyWrite,
    ReplyXattr
);

impl<F: Filesystem> FuseAdapter<F> {
    /// Runs `op` as a task on the runtime, then replies with `ok` and its value, or with the
    /// errno of its error (logged under `what`).
    fn serve<R, T>(
        &self,
        what: &'static str,
        reply: R,
        op: impl Future<Output = Result<T, FsError>> + Send + 'static,
        ok: impl FnOnce(R, T) + Send + 'static,
    ) where
        R: ErrorReply + Send + 'static,
        T: Send + 'static,
    {
        self.run(async move {
            match op.await {
                Ok(v) => ok(reply, v),
                Err(e) => reply.fail(errno(what, &e)),
            }
        });
    }

    /// [`serve`](Self::serve) for an operation whose success carries nothing: replies ok.
    fn serve_empty(
        &self,
        what: &'static str,
        reply: ReplyEmpty,
        op: impl Future<Output = Result<(), FsError>> + Send + 'static,
    ) {
        self.serve(what, reply, op, |r, ()| r.ok());
    }

    /// Runs `task` on this thread until it first has to wait, then as a task on the runtime.
    fn run(&self, task: impl Future<Output = ()> + Send + 'static) {
        let _rt = self.rt.enter();
        let mut task = Box::pin(task);
        // A task left pending is polled again by the runtime at once, with its own waker.
        let mut cx = Context::from_waker(Waker::noop());
        if task.as_mut().poll(&mut cx).is_pending() {
            self.rt.spawn(task);
        }
    }

    pub(crate) fn new(fs: Arc<F>, rt: tokio::runtime::Handle, max_background: u16) -> Self {
        FuseAdapter {
            policy: fs.cache_policy(),
            fs,
            rt,
            max_background,
            dirs: Arc::new(Mutex::new(HashMap::new())),
            next_dir: AtomicU64::new(1),
            no_open: false,
            no_opendir: false,
        }
    }
}

fn file_type(kind: NodeKind) -> FileType {
    match kind {
        NodeKind::File => FileType::RegularFile,
        NodeKind::Dir => FileType::Directory,
        NodeKind::Symlink => FileType::Symlink,
        NodeKind::Whiteout => FileType::CharDevice,
    }
}

fn file_attr(a: &NodeAttr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: MAX_IO,
        flags: 0,
    }
}

fn errno(op: &'static str, e: &FsError) -> Errno {
    let code = e.errno();
    if code == libc::ENOENT {
        tracing::debug!(op, error = %e);
    } else {
        tracing::warn!(op, errno = code, error = %e, "request failed");
    }
    Errno::from_i32(code)
}

/// An xattr value or name list: its size when asked for the size, else the bytes if they fit.
fn xattr_reply(reply: ReplyXattr, size: u32, bytes: &[u8]) {
    if size == 0 {
        reply.size(bytes.len() as u32);
    } else if bytes.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(bytes);
    }
}

/// A directory's entries as listed at opendir (or at a stateless readdir), served by offset:
/// `.` at 1, `..` at 2, then the entries; each entry carries the offset of the next. With
/// attributes (for READDIRPLUS) it also holds the directory's own, which `.` and `..` carry
/// (the kernel uses neither).
struct Listing {
    entries: Vec<NodeEntry>,
    attrs: Option<(NodeAttr, Vec<NodeAttr>)>,
}

impl Listing {
    async fn take<F: Filesystem>(fs: &F, ino: u64, with_attrs: bool) -> Result<Listing, FsError> {
        let entries = fs.readdir(ino).await?;
        let attrs = if with_attrs {
            let own = fs.getattr(ino).await?;
            let mut attrs = Vec::with_capacity(entries.len());
            for e in &entries {
                attrs.push(fs.getattr(e.ino).await?);
            }
            Some((own, attrs))
        } else {
            None
        };
        Ok(Listing { entries, attrs })
    }

    /// `(position, inode, kind, name)` of every entry from `offset` on; the kernel asks for the
    /// entries after one with `position + 1`.
    fn from(
        &self,
        ino: INodeNo,
        offset: u64,
    ) -> impl Iterator<Item = (usize, INodeNo, FileType, &str)> {
        let dots = [
            (ino, FileType::Directory, "."),
            (ino, FileType::Directory, ".."),
        ];
        let listed = self
            .entries
            .iter()
            .map(|e| (INodeNo(e.ino), file_type(e.kind), e.name.as_str()));
        dots.into_iter()
            .chain(listed)
            .enumerate()
            .skip(offset as usize)
            .map(|(i, (ino, kind, name))| (i, ino, kind, name))
    }

    fn reply(&self, mut reply: ReplyDirectory, ino: INodeNo, offset: u64) {
        for (i, ino, kind, name) in self.from(ino, offset) {
            if reply.add(ino, i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn reply_plus<F: Filesystem>(
        &self,
        fs: &F,
        mut reply: ReplyDirectoryPlus,
        ino: INodeNo,
        offset: u64,
        ttl: Duration,
    ) {
        let Some((own, attrs)) = &self.attrs else {
            // Only listings of a filesystem with `listing_attrs` are asked for attributes.
            return reply.error(Errno::EIO);
        };
        for (i, ino, _, name) in self.from(ino, offset) {
            let attr = i.checked_sub(2).map_or(own, |i| &attrs[i]);
            let ttl = fs.ttl_of(attr.ino, Asked::Listing).unwrap_or(ttl);
            if reply.add(
                ino,
                i as u64 + 1,
                name,
                &ttl,
                &file_attr(attr),
                Generation(0),
            ) {
                break;
            }
        }
        reply.ok();
    }
}

/// A name as UTF-8, or EINVAL (object keys are UTF-8).
fn utf8(name: &OsStr) -> Result<String, Errno> {
    name.to_str().map(str::to_string).ok_or_else(|| {
        tracing::warn!(?name, "refusing a name that is not UTF-8");
        Errno::EINVAL
    })
}

macro_rules! name_or_reply {
    ($name:expr, $reply:ident) => {
        match utf8($name) {
            Ok(n) => n,
            Err(e) => return $reply.error(e),
        }
    };
}

impl<F: Filesystem> fuser::Filesystem for FuseAdapter<F> {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let mut wanted = InitFlags::FUSE_ATOMIC_O_TRUNC
            | InitFlags::FUSE_ASYNC_READ
            | InitFlags::FUSE_BIG_WRITES
            | InitFlags::FUSE_MAX_PAGES;
        if self.policy.listing_attrs {
            // Every part of every listing (not "auto", under which only a listing's first
            // part carries attributes).
            wanted |= InitFlags::FUSE_DO_READDIRPLUS;
        }
        if self.policy.keep_page_cache {
            // Symlink targets cannot change either: the kernel keeps them as it keeps pages.
            wanted |= InitFlags::FUSE_CACHE_SYMLINKS;
        }
        if let Err(missing) = config.add_capabilities(wanted) {
            tracing::warn!(?missing, "kernel lacks FUSE capabilities");
        }
        let _ = config.set_max_write(MAX_IO);
        let _ = config.set_max_readahead(MAX_IO);
        let _ = config.set_max_background(self.max_background);
        let _ = config.set_congestion_threshold(self.max_background / 4 * 3);
        if self.policy.stateless_open {
            let offered = config.capabilities();
            self.no_open = offered.contains(InitFlags::FUSE_NO_OPEN_SUPPORT);
            self.no_opendir = offered.contains(InitFlags::FUSE_NO_OPENDIR_SUPPORT);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let name = name_or_reply!(name, reply);
        let (fs, ttl) = (self.fs.clone(), self.policy.ttl);
        let Some(negative) = self.policy.negative_ttl else {
            return self.serve(
                "lookup",
                reply,
                async move {
                    fs.lookup(parent.0, &name)
                        .await
                        .map(|a| (fs.ttl_of(a.ino, Asked::Use), a))
                },
                move |r, (own, a)| r.entry(&own.unwrap_or(ttl), &file_attr(&a), Generation(0)),
            );
        };
        // A cached "no such name": an entry reply for inode 0, valid for `negative`.
        self.run(async move {
            match fs.lookup(parent.0, &name).await {
                Ok(a) => {
                    let ttl = fs.ttl_of(a.ino, Asked::Use).unwrap_or(ttl);
                    reply.entry(&ttl, &file_attr(&a), Generation(0))
                }
                Err(e) if e.errno() == libc::ENOENT => {
                    let none = NodeAttr {
                        ino: 0,
                        kind: NodeKind::File,
                        size: 0,
                        mtime: SystemTime::UNIX_EPOCH,
                        perm: 0,
                        nlink: 0,
                        uid: 0,
                        gid: 0,
                    };
                    reply.entry(&negative, &file_attr(&none), Generation(0));
                }
                Err(e) => reply.error(errno("lookup", &e)),
            }
        });
    }

    // fuser's default `batch_forget` calls this once per inode (its element type is not public,
    // so it cannot be overridden to take the table's lock once).
    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let (fs, ttl) = (self.fs.clone(), self.policy.ttl);
        self.serve(
            "getattr",
            reply,
            async move {
                fs.getattr(ino.0)
                    .await
                    .map(|a| (fs.ttl_of(a.ino, Asked::Use), a))
            },
            move |r, (own, a)| r.attr(&own.unwrap_or(ttl), &file_attr(&a)),
        );
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let (fs, ttl) = (self.fs.clone(), self.policy.ttl);
        self.serve(
            "setattr",
            reply,
            async move { fs.setattr(ino.0, size).await },
            move |r, a| r.attr(&ttl, &file_attr(&a)),
        );
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let name = name_or_reply!(name, reply);
        let (fs, ttl) = (self.fs.clone(), self.policy.ttl);
        self.serve(
            "mkdir",
            reply,
            async move { fs.mkdir(parent.0, &name).await },
            move |r, a| r.entry(&ttl, &file_attr(&a), Generation(0)),
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_or_reply!(name, reply);
        let fs = self.fs.clone();
        self.serve_empty(
            "unlink",
            reply,
            async move { fs.unlink(parent.0, &name).await },
        );
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let name = name_or_reply!(name, reply);
        let fs = self.fs.clone();
        self.serve_empty(
            "rmdir",
            reply,
            async move { fs.rmdir(parent.0, &name).await },
        );
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let name = name_or_reply!(name, reply);
        let newname = name_or_reply!(newname, reply);
        if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            tracing::warn!(%name, %newname, "RENAME_EXCHANGE is not supported by object stores");
            return reply.error(Errno::EINVAL);
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let fs = self.fs.clone();
        let op = async move {
            fs.rename(parent.0, &name, newparent.0, &newname, no_replace)
                .await
        };
        self.serve_empty("rename", reply, op);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if self.no_open {
            // Stateless: the kernel opens without us from now on.
            return reply.error(Errno::ENOSYS);
        }
        let fs = self.fs.clone();
        let open_flags = if self.policy.keep_page_cache {
            FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty()
        };
        self.serve(
            "open",
            reply,
            async move { fs.open(ino.0, flags.0).await },
            move |r, fh| r.opened(FileHandle(fh), open_flags),
        );
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let fs = self.fs.clone();
        self.serve(
            "readlink",
            reply,
            async move { fs.readlink(ino.0).await },
            move |r, target| r.data(&target),
        );
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if !self.fs.has_xattrs() {
            return reply.error(Errno::ENOSYS);
        }
        let name = name_or_reply!(name, reply);
        let fs = self.fs.clone();
        self.run(async move {
            match fs.getxattr(ino.0, &name).await {
                Ok(Some(value)) => xattr_reply(reply, size, &value),
                Ok(None) => reply.error(Errno::NO_XATTR),
                Err(e) => reply.error(errno("getxattr", &e)),
            }
        });
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        if !self.fs.has_xattrs() {
            return reply.error(Errno::ENOSYS);
        }
        let fs = self.fs.clone();
        self.serve(
            "listxattr",
            reply,
            async move { fs.listxattr(ino.0).await },
            move |r, names| {
                let mut list = Vec::new();
                for n in names {
                    list.extend_from_slice(n.as_bytes());
                    list.push(0);
                }
                xattr_reply(r, size, &list);
            },
        );
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let name = name_or_reply!(name, reply);
        let (fs, ttl) = (self.fs.clone(), self.policy.ttl);
        let op = async move { fs.create(parent.0, &name, flags).await };
        self.serve("create", reply, op, move |r, (a, fh)| {
            let attr = file_attr(&a);
            r.created(
                &ttl,
                &attr,
                Generation(0),
                FileHandle(fh),
                FopenFlags::empty(),
            );
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let fs = self.fs.clone();
        self.serve(
            "read",
            reply,
            async move { fs.read(ino.0, fh.0, offset, size as usize).await },
            move |r, bytes| r.data(&bytes),
        );
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // The request buffer is reused by fuser: the bytes are copied once into the task.
        let (fs, data) = (self.fs.clone(), data.to_vec());
        self.serve(
            "write",
            reply,
            async move { fs.write(fh.0, offset, &data).await },
            move |r, n| r.written(n as u32),
        );
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if self.no_open {
            // Nothing to finish at close: the kernel stops sending flush.
            return reply.error(Errno::ENOSYS);
        }
        let fs = self.fs.clone();
        self.serve_empty("flush", reply, async move { fs.flush(fh.0).await });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let fs = self.fs.clone();
        self.serve_empty("release", reply, async move { fs.release(fh.0).await });
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _ds: bool, reply: ReplyEmpty) {
        let fs = self.fs.clone();
        self.serve_empty("fsync", reply, async move { fs.fsync(fh.0).await });
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.no_opendir {
            // Listings are served by offset (`readdir`) and cached by the kernel.
            return reply.error(Errno::ENOSYS);
        }
        let fs = self.fs.clone();
        let dirs = self.dirs.clone();
        let fh = self.next_dir.fetch_add(1, Ordering::Relaxed);
        let attrs = self.policy.listing_attrs;
        let op = async move { Listing::take(&*fs, ino.0, attrs).await };
        self.serve("opendir", reply, op, move |r, listing| {
            dirs.lock().insert(fh, Arc::new(listing));
            r.opened(FileHandle(fh), FopenFlags::empty());
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        if self.no_opendir && fh.0 == 0 {
            let fs = self.fs.clone();
            let op = async move { Listing::take(&*fs, ino.0, false).await };
            return self.serve("readdir", reply, op, move |r, listing| {
                listing.reply(r, ino, offset);
            });
        }
        let Some(listing) = self.dirs.lock().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        listing.reply(reply, ino, offset);
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        let ttl = self.policy.ttl;
        if self.no_opendir && fh.0 == 0 {
            let fs = self.fs.clone();
            let op = async move { Listing::take(&*fs, ino.0, true).await };
            let fs = self.fs.clone();
            return self.serve("readdirplus", reply, op, move |r, listing| {
                listing.reply_plus(&*fs, r, ino, offset, ttl);
            });
        }
        let Some(listing) = self.dirs.lock().get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        listing.reply_plus(&*self.fs, reply, ino, offset, ttl);
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.dirs.lock().remove(&fh.0);
        reply.ok();
    }

    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        // What any file that is not a terminal answers (`isatty` asks with TCGETS).
        reply.error(Errno::ENOTTY);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Object stores have no fixed capacity: report a large, mostly free filesystem so tools
        // that check free space proceed.
        let blocks = 1u64 << 40;
        reply.statfs(blocks, blocks, blocks, 1 << 32, 1 << 32, 4096, 1024, 4096);
    }

    /// Not implemented, on purpose and without the warning the default prints at every mount:
    /// ENOSYS tells the kernel to stop asking; it then lets `access(2)` through but for what the
    /// mount's own flags refuse (writes on a read-only mount), the operations themselves still
    /// checked when they come.
    fn access(&self, _req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS);
    }
}
