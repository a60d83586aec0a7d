//! hotstart-fuse: a striped FUSE filesystem that mounts an object store as a directory.
//!
//! The crate has two halves, kept apart as in mountpoint-s3:
//!
//! - [`StripedFs`] (`fs.rs` for names, `fs/files.rs` for open files): the filesystem logic as a
//!   plain async type over a [`hotstart_store::Store`]: lookup, forget, getattr, readdir, open,
//!   read, write, flush, fsync, release, create, mkdir, rmdir, unlink, rename and setattr. It knows
//!   nothing of FUSE and is tested without mounting anything. Its parts: the inode table
//!   (`inode.rs`), the read-ahead of one read handle (`read.rs`), the staged upload of one write
//!   handle (`write.rs`) and the local spill files with their shared disk limit (`spill.rs`), and
//!   the optional local stripe cache (`cache.rs`).
//! - [`mount()`] (`fuse.rs` + `mount.rs`): a thin `fuser` adapter that hands every request to a
//!   tokio runtime and replies from there, plus mounting, unmounting and stale-mount recovery.
//!   The adapter serves any [`Filesystem`] (`filesystem.rs`): `StripedFs` is one, the lazy
//!   read-only image filesystem of `hotstart-image` another; [`mount_fs`] mounts either.
//!
//! Namespace: every object is a file, `/` in keys makes directories. A directory exists when any
//! key lies under it, or when its marker object `<dir>/.hotstart-dir` (zero bytes) does; `mkdir`
//! writes the marker, so directories made through the mount survive being emptied. The marker
//! name is reserved and never shown. Guarantees and refusals are written in docs/SEMANTICS.md.

pub mod bdi;
mod cache;
mod error;
mod filesystem;
mod fs;
mod fuse;
mod inode;
mod mount;
mod mountinfo;
mod read;
mod spill;
mod write;

use std::path::PathBuf;
use std::time::Duration;

pub use cache::StripeCache;
pub use error::{FsError, FsResult};
pub use filesystem::{Asked, CachePolicy, Filesystem, NodeAttr, NodeEntry, NodeKind};
pub use fs::{Attr, DirEntry, StripedFs};
pub use inode::{FileKind, join};
pub use mount::{
    MountConfig, MountHandle, MountOptions, PageCache, clear_stale_mount, mount, mount_fs,
    prepare_mountpoint,
};
pub use spill::{SpillError, SpillSpace};

/// The zero-byte object that makes an empty directory exist: `<dir>/.hotstart-dir`.
pub const DIR_MARKER: &str = ".hotstart-dir";

/// How the filesystem reads, writes and presents objects.
#[derive(Debug, Clone)]
pub struct FsConfig {
    /// Refuse every change with EROFS.
    pub read_only: bool,
    /// Bytes per ranged GET and per multipart part (at least 5 MiB for AWS S3 parts).
    pub stripe_size: usize,
    /// Stripes in flight per read window or per upload.
    pub max_in_flight: usize,
    /// The first read-ahead window of a sequential reader; doubled on every window consumed.
    pub initial_read_ahead: usize,
    /// The largest read-ahead window.
    pub max_read_ahead: usize,
    /// Bytes all handles together may hold in read-ahead buffers and upload parts.
    pub memory_budget: usize,
    /// How long a stat result (and a kernel entry/attribute) is trusted before the store is asked
    /// again.
    pub stat_ttl: Duration,
    /// Owner of every file and directory.
    pub uid: u32,
    /// Group of every file and directory.
    pub gid: u32,
    /// Permission bits of files.
    pub file_mode: u16,
    /// Permission bits of directories.
    pub dir_mode: u16,
    /// Where spill files go (default: the system temp directory): local copies of files being
    /// streamed, and files written out of order. It should be on disk, not tmpfs.
    pub spill_dir: Option<PathBuf>,
    /// Bytes all spill files together may hold. A streamed file whose local copy no longer fits
    /// drops it (a later seek back is ENOSPC); a file written out of order that no longer fits
    /// gets ENOSPC.
    pub max_spill: u64,
    /// A directory where whole stripes read from the store are kept and served from on later
    /// reads (none by default).
    pub cache_dir: Option<PathBuf>,
    /// Bytes the stripe cache may hold on disk (least recently used evicted first).
    pub cache_bytes: u64,
}

impl Default for FsConfig {
    fn default() -> Self {
        FsConfig {
            read_only: false,
            stripe_size: 8 << 20,
            max_in_flight: 16,
            initial_read_ahead: 1 << 20,
            max_read_ahead: 64 << 20,
            memory_budget: 1 << 30,
            stat_ttl: Duration::from_secs(1),
            // SAFETY: getuid/getgid take no arguments, cannot fail and touch no memory.
            uid: unsafe { libc::getuid() },
            // SAFETY: as above.
            gid: unsafe { libc::getgid() },
            file_mode: 0o644,
            dir_mode: 0o755,
            spill_dir: None,
            max_spill: 16 << 30,
            cache_dir: None,
            cache_bytes: 10 << 30,
        }
    }
}
