//! hotstart-fuse: a striped FUSE filesystem that mounts an object store as a directory.
//!
//! The crate has two halves, kept apart as in mountpoint-s3:
//!
//! - [`StripedFs`] (`fs.rs`): the filesystem logic as a plain async type over a
//!   [`hotstart_store::Store`]: lookup, getattr, readdir, open, read, write, flush, fsync, release,
//!   create, mkdir, rmdir, unlink, rename and setattr. It knows nothing of FUSE and is tested
//!   without mounting anything. Its parts: the inode table (`inode.rs`), the read-ahead of one read
//!   handle (`read.rs`) and the staged upload of one write handle (`write.rs`).
//! - [`mount`] (`fuse.rs` + `mount.rs`): a thin `fuser` adapter that hands every request to a
//!   tokio runtime and replies from there, plus mounting, unmounting and stale-mount recovery.
//!
//! Namespace: every object is a file, `/` in keys makes directories. A directory exists when any
//! key lies under it, or when its marker object `<dir>/.hotstart-dir` (zero bytes) does; `mkdir`
//! writes the marker, so directories made through the mount survive being emptied. The marker
//! name is reserved and never shown. Guarantees and refusals are written in docs/SEMANTICS.md.

mod error;
mod fs;
mod fuse;
mod inode;
mod mount;
mod read;
mod write;

use std::path::PathBuf;
use std::time::Duration;

pub use error::{FsError, FsResult};
pub use fs::{Attr, DirEntry, FileKind, StripedFs};
pub use mount::{MountConfig, MountHandle, clear_stale_mount, mount};

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
    /// Where spill files of out-of-order writers go (default: the system temp directory).
    pub spill_dir: Option<PathBuf>,
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
        }
    }
}
