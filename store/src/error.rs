//! The one error type of `hotstart-store`.

use std::path::PathBuf;

/// Everything that can go wrong in the storage substrate.
///
/// Variants carry what they concern (the URL, object key, chunk id or local path) so that a
/// message read in a log says where to look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A store URL that cannot be used.
    #[error("invalid store URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// An object that does not exist.
    #[error("object not found: {key}")]
    NotFound { key: String },

    /// A call to the object store that failed.
    #[error("object store error on {}: {source}", shown(key))]
    Store {
        key: String,
        #[source]
        source: object_store::Error,
    },

    /// An S3 request that could not be signed: no credentials are configured, and the instance
    /// metadata service, where the client looks for them last, gave none.
    #[error(
        "no S3 credentials to reach {}: none are set, and the instance metadata service \
         (where the client looks last, as on a cloud VM with a role) gave none ({source}); set \
         AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary \
         ones), or AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN",
        shown(key)
    )]
    NoCredentials {
        key: String,
        #[source]
        source: Box<object_store::Error>,
    },

    /// A ranged response that returned fewer or more bytes than asked for.
    #[error("short read of {key}: asked for bytes {start}..{end}, got {got} bytes")]
    Truncated {
        key: String,
        start: u64,
        end: u64,
        got: u64,
    },

    /// A range that does not lie inside the object.
    #[error("range {start}..{end} is outside {key} ({size} bytes)")]
    OutOfRange {
        key: String,
        start: u64,
        end: u64,
        size: u64,
    },

    /// Stored bytes whose content does not match their checksum or framing.
    #[error("corrupt chunk {id}: {reason}")]
    Corrupt { id: String, reason: String },

    /// A tree manifest or other stored structure that cannot be decoded.
    #[error("invalid {what}: {reason}")]
    Format { what: &'static str, reason: String },

    /// A tree entry whose path would leave the root it is materialised into.
    #[error("refusing tree entry {entry:?}: {reason}")]
    UnsafePath { entry: String, reason: String },

    /// Local file-system I/O.
    #[error("{op} {path}: {source}", path = path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// An object that changed while it was being read in stripes.
    #[error("{key} changed while it was being read; retry the read")]
    Changed { key: String },

    /// An error shared by several waiters of one single-flight fetch.
    #[error("{0}")]
    Shared(std::sync::Arc<Error>),

    /// A background task that panicked or was cancelled.
    #[error("{what} task failed: {message}")]
    Task { what: &'static str, message: String },

    /// A writer used after it was finished or aborted.
    #[error("writer for {key} is already {state}")]
    WriterClosed { key: String, state: &'static str },
}

impl Error {
    pub(crate) fn store(key: impl Into<String>, source: object_store::Error) -> Self {
        let key = key.into();
        match source {
            object_store::Error::NotFound { .. } => Error::NotFound { key },
            object_store::Error::Precondition { .. } => Error::Changed { key },
            source if asked_instance_metadata(&source) => Error::NoCredentials {
                key,
                source: Box::new(source),
            },
            source => Error::Store { key, source },
        }
    }

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

    /// The error behind any [`Error::Shared`] wrapping.
    pub fn root(&self) -> &Error {
        match self {
            Error::Shared(inner) => inner.root(),
            other => other,
        }
    }

    /// True when stored bytes failed verification.
    pub fn is_corrupt(&self) -> bool {
        matches!(self.root(), Error::Corrupt { .. })
    }

    /// The chunk whose stored bytes failed verification, when that is what this error says.
    pub fn damaged_chunk(&self) -> Option<crate::ChunkId> {
        match self.root() {
            Error::Corrupt { id, .. } => crate::ChunkId::from_hex(id).ok(),
            _ => None,
        }
    }

    /// True when the object or chunk does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self.root(), Error::NotFound { .. })
    }

    /// True for errors that a caller may retry with success, false for errors that will fail
    /// again (not found, corrupt data, bad input) and for a remote store's failed requests: its
    /// client already retried those (network trouble, throttling, 5xx) for as long as
    /// [`crate::REMOTE_RETRY_FOR`] allows, so retrying them again would only make an outage take
    /// several times that to surface.
    pub fn is_transient(&self) -> bool {
        match self.root() {
            Error::Store { source, .. } => match source {
                object_store::Error::Generic { store, .. } => !REMOTE_CLIENTS.contains(store),
                object_store::Error::JoinError { .. } => true,
                _ => false,
            },
            Error::Truncated { .. } => true,
            Error::Io { source, .. } => matches!(
                source.kind(),
                std::io::ErrorKind::Interrupted | std::io::ErrorKind::TimedOut
            ),
            _ => false,
        }
    }
}

/// A key as a message names it: the empty key (a listing of the whole store) as such.
fn shown(key: &str) -> &str {
    if key.is_empty() {
        "the store's root"
    } else {
        key
    }
}

/// Whether an S3 request failed while its client asked the instance metadata service for
/// credentials, which it does only when none are configured (object_store's names for the
/// service's paths).
fn asked_instance_metadata(e: &object_store::Error) -> bool {
    let object_store::Error::Generic { store: "S3", .. } = e else {
        return false;
    };
    let text = e.to_string();
    text.contains("/latest/api/token") || text.contains("/latest/meta-data/iam/")
}

/// The backends whose client retries its own requests (`object_store`'s names for them).
const REMOTE_CLIENTS: [&str; 4] = ["S3", "GCS", "MicrosoftAzure", "HTTP"];

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
