//! The one error type of `hotstart-image`.

use std::path::PathBuf;

/// Everything building, reading, mounting or pulling an image can fail with.
///
/// Variants carry what they concern (the image name, the source file and the entry in it, the
/// local path) so that a message read in a log says where to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The storage substrate failed (store, chunk, tree).
    #[error(transparent)]
    Store(#[from] hotstart_store::Error),

    /// An image name or tag that is not allowed.
    #[error("invalid image name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },

    /// No image of that name and tag in the store.
    #[error("no image {image} in {store}")]
    NoImage { image: String, store: String },

    /// A build source (directory, tarball, OCI layout) that cannot be read as one.
    #[error("{path}: {reason}", path = path.display())]
    Source { path: PathBuf, reason: String },

    /// An entry of a tarball or OCI layer that is refused: it would escape the image root, write
    /// through a symlink, link to something that is not there, or lies about its size.
    #[error("{path}: refusing entry {entry:?}: {reason}", path = path.display())]
    Hostile {
        path: PathBuf,
        entry: String,
        reason: String,
    },

    /// A stored record (image record, profile, run report) that cannot be decoded.
    #[error("invalid {what} {key}: {reason}")]
    Format {
        what: &'static str,
        key: String,
        reason: String,
    },

    /// Local file-system I/O.
    #[error("{op} {path}: {source}", path = path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A background task that panicked or was cancelled.
    #[error("{what} task failed: {message}")]
    Task { what: &'static str, message: String },
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn task(what: &'static str, e: tokio::task::JoinError) -> Self {
        Error::Task {
            what,
            message: e.to_string(),
        }
    }

    pub(crate) fn source(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Source {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// True when stored bytes failed verification.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, Error::Store(e) if e.is_corrupt())
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
