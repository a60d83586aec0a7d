//! [`Filesystem`]: what a filesystem implements to be served by the thin `fuser` adapter
//! (`fuse.rs`) and mounted by [`mount_fs`](crate::mount_fs).
//!
//! Every operation takes inode numbers and names as FUSE does and returns plain values or an
//! [`FsError`], whose errno the adapter replies with. Operations that change anything default to
//! [`FsError::ReadOnly`], so a read-only filesystem implements only lookup, getattr, readdir,
//! open, read (and readlink and xattrs if it has them). Two implementations: [`StripedFs`] (the
//! store as a directory, below) and the lazy image filesystem of `hotstart-image`.
//!
//! How long the kernel may trust what it was told is the filesystem's [`CachePolicy`]: a store
//! that other tools change needs short TTLs; an immutable image can let the kernel keep entries,
//! attributes, negative lookups and file pages for as long as it is mounted.

use std::future::Future;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::error::{FsError, FsResult};
use crate::fs::{Attr, DirEntry, StripedFs};
use crate::inode::FileKind;

/// What an inode is, as the kernel is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    File,
    Dir,
    Symlink,
    /// A character device 0/0: how overlayfs marks a path removed by an upper layer.
    Whiteout,
}

/// The attributes of one inode, as stat shows them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAttr {
    pub ino: u64,
    pub kind: NodeKind,
    pub size: u64,
    pub mtime: SystemTime,
    /// Permission bits (`mode & 0o7777`).
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeEntry {
    pub ino: u64,
    pub name: String,
    pub kind: NodeKind,
}

/// How long the kernel may keep what it learns from the filesystem.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePolicy {
    /// How long a name → inode lookup and an inode's attributes are trusted.
    pub ttl: Duration,
    /// How long "no such name" is trusted (`None`: not cached).
    pub negative_ttl: Option<Duration>,
    /// Keep an inode's page cache across opens (the file's bytes cannot change under it).
    pub keep_page_cache: bool,
    /// Opening a file or directory needs no handle and closing one nothing to finish (a tree
    /// that never changes): where the kernel supports it, it is told to send no open, opendir,
    /// flush or release at all, and it then keeps file pages and directory listings cached.
    /// [`Filesystem::open`] is then never called, and reads and listings get handle 0.
    pub stateless_open: bool,
    /// Listings carry every entry's attributes (READDIRPLUS), so the kernel learns a listed
    /// directory's names in one request instead of one lookup each (Python lists a package
    /// directory, then opens what it found). For filesystems whose [`Filesystem::getattr`]
    /// answers from memory; each entry listed then counts as one lookup of its inode, which
    /// the kernel later forgets.
    pub listing_attrs: bool,
}

/// What made the kernel ask about an inode (see [`Filesystem::ttl_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// A lookup of its name, or its attributes: a process is about to use it.
    Use,
    /// It was listed in its directory; nothing was opened.
    Listing,
}

fn read_only(what: &str, ino: u64) -> FsError {
    FsError::ReadOnly {
        path: format!("<inode {ino}> ({what})"),
    }
}

/// A filesystem the adapter can serve. See the module documentation.
pub trait Filesystem: Send + Sync + 'static {
    /// What the kernel may cache.
    fn cache_policy(&self) -> CachePolicy;

    /// Resolves `name` in directory `parent`; the kernel then references the inode until it
    /// forgets it.
    fn lookup(&self, parent: u64, name: &str) -> impl Future<Output = FsResult<NodeAttr>> + Send;

    /// How long the kernel may trust the entry and attributes of `ino` it is about to be given,
    /// where that differs from the policy's TTL. A filesystem that wants to hear of the next
    /// use of an inode answers zero: the kernel then looks its name up again on the next path
    /// walk through it, and asks for its attributes again, instead of answering from its cache.
    fn ttl_of(&self, ino: u64, asked: Asked) -> Option<Duration> {
        let _ = (ino, asked);
        None
    }

    /// The kernel dropped `nlookup` references to `ino`.
    fn forget(&self, ino: u64, nlookup: u64) {
        let _ = (ino, nlookup);
    }

    fn getattr(&self, ino: u64) -> impl Future<Output = FsResult<NodeAttr>> + Send;

    /// Every entry of directory `ino`, without `.` and `..`.
    fn readdir(&self, ino: u64) -> impl Future<Output = FsResult<Vec<NodeEntry>>> + Send;

    /// Opens `ino`; returns a file handle.
    fn open(&self, ino: u64, flags: i32) -> impl Future<Output = FsResult<u64>> + Send;

    /// Up to `size` bytes of open file `fh` (inode `ino`) at `offset`.
    fn read(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
        size: usize,
    ) -> impl Future<Output = FsResult<Bytes>> + Send;

    fn release(&self, fh: u64) -> impl Future<Output = FsResult<()>> + Send {
        let _ = fh;
        async { Ok(()) }
    }

    /// The target of symlink `ino`.
    fn readlink(&self, ino: u64) -> impl Future<Output = FsResult<Vec<u8>>> + Send {
        async move {
            Err(FsError::Invalid {
                path: format!("<inode {ino}>"),
                reason: "not a symlink".into(),
            })
        }
    }

    /// Whether the filesystem has extended attributes; when it has none the kernel is told so
    /// once (ENOSYS) and stops asking.
    fn has_xattrs(&self) -> bool {
        false
    }

    /// The value of xattr `name` of `ino`, `None` if it has no such attribute.
    fn getxattr(
        &self,
        ino: u64,
        name: &str,
    ) -> impl Future<Output = FsResult<Option<Vec<u8>>>> + Send {
        let _ = (ino, name);
        async { Ok(None) }
    }

    /// The names of the xattrs of `ino`.
    fn listxattr(&self, ino: u64) -> impl Future<Output = FsResult<Vec<String>>> + Send {
        let _ = ino;
        async { Ok(Vec::new()) }
    }

    /// Truncates `ino` to `size` (the only attribute change supported).
    fn setattr(
        &self,
        ino: u64,
        size: Option<u64>,
    ) -> impl Future<Output = FsResult<NodeAttr>> + Send {
        let _ = size;
        async move { Err(read_only("setattr", ino)) }
    }

    /// Creates and opens file `name` in `parent`.
    fn create(
        &self,
        parent: u64,
        name: &str,
        flags: i32,
    ) -> impl Future<Output = FsResult<(NodeAttr, u64)>> + Send {
        let _ = (name, flags);
        async move { Err(read_only("create", parent)) }
    }

    fn mkdir(&self, parent: u64, name: &str) -> impl Future<Output = FsResult<NodeAttr>> + Send {
        let _ = name;
        async move { Err(read_only("mkdir", parent)) }
    }

    fn unlink(&self, parent: u64, name: &str) -> impl Future<Output = FsResult<()>> + Send {
        let _ = name;
        async move { Err(read_only("unlink", parent)) }
    }

    fn rmdir(&self, parent: u64, name: &str) -> impl Future<Output = FsResult<()>> + Send {
        let _ = name;
        async move { Err(read_only("rmdir", parent)) }
    }

    fn rename(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
    ) -> impl Future<Output = FsResult<()>> + Send {
        let _ = (name, new_parent, new_name, no_replace);
        async move { Err(read_only("rename", parent)) }
    }

    /// Writes `data` at `offset` of open file `fh`; returns the bytes taken.
    fn write(
        &self,
        fh: u64,
        offset: u64,
        data: &[u8],
    ) -> impl Future<Output = FsResult<usize>> + Send {
        let _ = (offset, data);
        async move {
            Err(FsError::BadHandle {
                fh,
                reason: "not open for writing",
            })
        }
    }

    fn flush(&self, fh: u64) -> impl Future<Output = FsResult<()>> + Send {
        let _ = fh;
        async { Ok(()) }
    }

    fn fsync(&self, fh: u64) -> impl Future<Output = FsResult<()>> + Send {
        let _ = fh;
        async { Ok(()) }
    }
}

impl From<FileKind> for NodeKind {
    fn from(k: FileKind) -> NodeKind {
        match k {
            FileKind::File => NodeKind::File,
            FileKind::Dir => NodeKind::Dir,
        }
    }
}

impl From<Attr> for NodeAttr {
    fn from(a: Attr) -> NodeAttr {
        NodeAttr {
            ino: a.ino,
            kind: a.kind.into(),
            size: a.size,
            mtime: a.mtime,
            perm: a.perm,
            nlink: if a.kind == FileKind::Dir { 2 } else { 1 },
            uid: a.uid,
            gid: a.gid,
        }
    }
}

impl From<DirEntry> for NodeEntry {
    fn from(e: DirEntry) -> NodeEntry {
        NodeEntry {
            ino: e.ino,
            name: e.name,
            kind: e.kind.into(),
        }
    }
}

/// The store as a directory: every call goes to [`StripedFs`]'s method of the same name.
impl Filesystem for StripedFs {
    fn cache_policy(&self) -> CachePolicy {
        // Objects change under the mount: trust nothing longer than the stat TTL, and let every
        // open see the object's current bytes.
        CachePolicy {
            ttl: self.config().stat_ttl,
            negative_ttl: None,
            keep_page_cache: false,
            stateless_open: false,
            // Attributes of listed objects may need a request each.
            listing_attrs: false,
        }
    }

    async fn lookup(&self, parent: u64, name: &str) -> FsResult<NodeAttr> {
        StripedFs::lookup(self, parent, name).await.map(Into::into)
    }

    fn forget(&self, ino: u64, nlookup: u64) {
        StripedFs::forget(self, ino, nlookup);
    }

    async fn getattr(&self, ino: u64) -> FsResult<NodeAttr> {
        StripedFs::getattr(self, ino).await.map(Into::into)
    }

    async fn readdir(&self, ino: u64) -> FsResult<Vec<NodeEntry>> {
        let entries = StripedFs::readdir(self, ino).await?;
        Ok(entries.into_iter().map(Into::into).collect())
    }

    async fn open(&self, ino: u64, flags: i32) -> FsResult<u64> {
        StripedFs::open(self, ino, flags).await
    }

    async fn read(&self, _ino: u64, fh: u64, offset: u64, size: usize) -> FsResult<Bytes> {
        StripedFs::read(self, fh, offset, size).await
    }

    async fn release(&self, fh: u64) -> FsResult<()> {
        StripedFs::release(self, fh).await
    }

    async fn setattr(&self, ino: u64, size: Option<u64>) -> FsResult<NodeAttr> {
        StripedFs::setattr(self, ino, size).await.map(Into::into)
    }

    async fn create(&self, parent: u64, name: &str, flags: i32) -> FsResult<(NodeAttr, u64)> {
        let (a, fh) = StripedFs::create(self, parent, name, flags).await?;
        Ok((a.into(), fh))
    }

    async fn mkdir(&self, parent: u64, name: &str) -> FsResult<NodeAttr> {
        StripedFs::mkdir(self, parent, name).await.map(Into::into)
    }

    async fn unlink(&self, parent: u64, name: &str) -> FsResult<()> {
        StripedFs::unlink(self, parent, name).await
    }

    async fn rmdir(&self, parent: u64, name: &str) -> FsResult<()> {
        StripedFs::rmdir(self, parent, name).await
    }

    async fn rename(
        &self,
        parent: u64,
        name: &str,
        new_parent: u64,
        new_name: &str,
        no_replace: bool,
    ) -> FsResult<()> {
        StripedFs::rename(self, parent, name, new_parent, new_name, no_replace).await
    }

    async fn write(&self, fh: u64, offset: u64, data: &[u8]) -> FsResult<usize> {
        StripedFs::write(self, fh, offset, data).await
    }

    async fn flush(&self, fh: u64) -> FsResult<()> {
        StripedFs::flush(self, fh).await
    }

    async fn fsync(&self, fh: u64) -> FsResult<()> {
        StripedFs::fsync(self, fh).await
    }
}
