//! The one error type of `hotstart-env`.

use std::path::PathBuf;

/// Everything that can go wrong computing, capturing, publishing or restoring a snapshot.
///
/// Variants carry the key, path or command they concern so a line read in a log says where to
/// look.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration that cannot be used (no lock file, no install command, a bad path).
    #[error("invalid environment configuration: {reason}")]
    Config { reason: String },

    /// The interpreter could not be run or did not describe itself.
    #[error("cannot query the Python interpreter {python:?}: {reason}")]
    Python { python: String, reason: String },

    /// The install command ran and failed; nothing was published. `code` is its exit status
    /// (128 + the signal number when a signal killed it).
    #[error("install command {command:?} failed with exit code {code}; nothing was published")]
    InstallFailed { command: String, code: i32 },

    /// The install command could not be started.
    #[error("cannot run the install command {command:?}: {source}")]
    InstallSpawn {
        command: String,
        #[source]
        source: std::io::Error,
    },

    /// The target exists but this node did not create it with `ensure`; it is left alone.
    #[error(
        "{target} exists and was not created by `hotstart env ensure` on this node; remove it or \
         choose another target",
        target = target.display()
    )]
    TargetInUse { target: PathBuf },

    /// A snapshot record or tree in the store that cannot be used.
    #[error("snapshot {key}: {reason}")]
    BadSnapshot { key: String, reason: String },

    /// A restore that failed; nothing was left at the target. `repaired` says what was done
    /// about a damaged store (empty when nothing was).
    #[error("restoring snapshot {key} into {target}: {source}{repaired}", target = target.display())]
    Restore {
        key: String,
        target: PathBuf,
        #[source]
        source: Box<Error>,
        repaired: String,
    },

    /// A lazy mount that could not be made, or unmounted.
    #[error("lazy mount of snapshot {key} at {target}: {source}", target = target.display())]
    Mount {
        key: String,
        target: PathBuf,
        #[source]
        source: Box<hotstart_image::Error>,
    },

    /// A snapshot whose files name the path it was captured at, asked to be mounted lazily at
    /// another path: a read-only mount cannot rewrite them.
    #[error(
        "snapshot {key} was captured at {captured_at} and {refs} of its entries (e.g. {example}) \
         name that path; a lazy mount cannot rewrite them. Mount it at {captured_at}, or restore \
         it eagerly at {target}, which rewrites them",
        target = target.display()
    )]
    LazyRelocation {
        key: String,
        captured_at: String,
        target: PathBuf,
        refs: usize,
        example: String,
    },

    /// A store-side lock that is held by someone else (gc against a running capture).
    #[error("{what} is locked by {holder}; retry once it has finished")]
    Locked { what: String, holder: String },

    /// The storage substrate (object store, chunks, trees).
    #[error(transparent)]
    Store(#[from] hotstart_store::Error),

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

    pub(crate) fn config(reason: impl Into<String>) -> Self {
        Error::Config {
            reason: reason.into(),
        }
    }

    /// The exit code to leave with when the install command failed.
    pub fn install_exit_code(&self) -> Option<i32> {
        match self {
            Error::InstallFailed { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The chunk whose stored bytes failed verification, when that is what this error says.
    pub fn damaged_chunk(&self) -> Option<hotstart_store::ChunkId> {
        match self {
            Error::Store(e) => e.damaged_chunk(),
            _ => None,
        }
    }

    /// True when stored bytes failed verification.
    pub fn is_corrupt(&self) -> bool {
        match self {
            Error::Store(e) => e.is_corrupt(),
            Error::Restore { source, .. } => source.is_corrupt(),
            Error::Mount { source, .. } => source.is_corrupt(),
            _ => false,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
