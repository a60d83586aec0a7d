//! The one error type of `hotstart-fuse`, and the errno each variant becomes in a FUSE reply.
//!
//! Every refusal carries the path it concerns so that the log line written when it is returned
//! says where to look; [`FsError::errno`] is the only place errors turn into numbers.

use hotstart_store::Error as StoreError;

use crate::spill::SpillError;

/// Everything a filesystem operation can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FsError {
    /// No such file or directory.
    #[error("{path}: no such file or directory")]
    NotFound { path: String },
    /// The name is taken.
    #[error("{path}: already exists")]
    Exists { path: String },
    /// A directory was expected.
    #[error("{path}: not a directory")]
    NotDir { path: String },
    /// A file was expected.
    #[error("{path}: is a directory")]
    IsDir { path: String },
    /// A directory that still holds entries.
    #[error("{path}: directory not empty")]
    NotEmpty { path: String },
    /// An operation this filesystem refuses by design (see docs/SEMANTICS.md).
    #[error("{path}: refused: {reason}")]
    Refused { path: String, reason: &'static str },
    /// An argument this filesystem cannot honour (a name that is not a valid key, a write out of
    /// order after streaming began).
    #[error("{path}: invalid: {reason}")]
    Invalid { path: String, reason: String },
    /// The mount is read-only.
    #[error("{path}: read-only mount")]
    ReadOnly { path: String },
    /// The file is being written through another handle.
    #[error("{path}: busy: {reason}")]
    Busy { path: String, reason: &'static str },
    /// A rename the store cannot do in one step (a non-empty directory); `mv` falls back to copying.
    #[error("{path}: cannot rename a non-empty directory in an object store")]
    CrossDevice { path: String },
    /// A handle that is not open (or not open for this kind of I/O).
    #[error("bad file handle {fh}: {reason}")]
    BadHandle { fh: u64, reason: &'static str },
    /// A write handle that failed earlier (its upload was aborted: nothing became visible).
    #[error("{path}: an earlier error failed this file; nothing was made visible")]
    Poisoned { path: String },
    /// The object changed while it was open for reading.
    #[error("{path}: the object changed while it was open; reopen it")]
    Stale { path: String },
    /// The object store failed (network, server, truncated or damaged response).
    #[error("{path}: {source}")]
    Store {
        path: String,
        #[source]
        source: StoreError,
    },
    /// A listing or metadata request to the backend failed.
    #[error("{path}: {source}")]
    Backend {
        path: String,
        #[source]
        source: hotstart_store::object_store::Error,
    },
    /// A local spill file could not take the bytes (the spill limit is reached, or local I/O
    /// failed).
    #[error("{path}: spill file: {source}")]
    Spill {
        path: String,
        #[source]
        source: SpillError,
    },
}

impl FsError {
    /// Wraps a store error, keeping "not found" and "changed" precise.
    pub fn store(path: impl Into<String>, source: StoreError) -> FsError {
        let path = path.into();
        match source.root() {
            StoreError::NotFound { .. } => FsError::NotFound { path },
            StoreError::Changed { .. } => FsError::Stale { path },
            _ => FsError::Store { path, source },
        }
    }

    /// Wraps a backend (`object_store`) error, keeping "not found" precise.
    pub fn backend(
        path: impl Into<String>,
        source: hotstart_store::object_store::Error,
    ) -> FsError {
        let path = path.into();
        match source {
            hotstart_store::object_store::Error::NotFound { .. } => FsError::NotFound { path },
            source => FsError::Backend { path, source },
        }
    }

    /// The errno a FUSE reply carries for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound { .. } => libc::ENOENT,
            FsError::Exists { .. } => libc::EEXIST,
            FsError::NotDir { .. } => libc::ENOTDIR,
            FsError::IsDir { .. } => libc::EISDIR,
            FsError::NotEmpty { .. } => libc::ENOTEMPTY,
            FsError::Refused { .. } => libc::EPERM,
            FsError::Invalid { .. } => libc::EINVAL,
            FsError::ReadOnly { .. } => libc::EROFS,
            FsError::Busy { .. } => libc::EBUSY,
            FsError::CrossDevice { .. } => libc::EXDEV,
            FsError::BadHandle { .. } => libc::EBADF,
            FsError::Poisoned { .. } => libc::EIO,
            FsError::Stale { .. } => libc::ESTALE,
            FsError::Spill { source, .. } => source.errno(),
            FsError::Store { .. } | FsError::Backend { .. } => libc::EIO,
        }
    }
}

/// `Result` with this crate's [`FsError`].
pub type FsResult<T> = Result<T, FsError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_keep_their_meaning() {
        let nf = FsError::store(
            "a",
            StoreError::NotFound {
                key: "a".to_string(),
            },
        );
        assert_eq!(nf.errno(), libc::ENOENT);
        let short = FsError::store(
            "a",
            StoreError::Truncated {
                key: "a".into(),
                start: 0,
                end: 10,
                got: 5,
            },
        );
        assert_eq!(short.errno(), libc::EIO);
        assert!(short.to_string().contains("short read"), "{short}");
    }
}
