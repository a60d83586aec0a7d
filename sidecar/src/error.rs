//! The error type of the sidecar daemon: what the checkpoint engine reports (configuration,
//! I/O, store, formats, the local socket), and what only a daemon meets: peers, their
//! authentication and TLS files, and the memory budget.

use std::path::PathBuf;

use hotstart_proto::wire::{LinkError, Side};

/// Everything that can go wrong in the sidecar.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of the checkpoint engine's kinds (its tiers, formats, configuration, and the
    /// local socket: [`hotstart_ckpt::Error::Sidecar`]).
    #[error(transparent)]
    Ckpt(#[from] hotstart_ckpt::Error),

    /// A peer sidecar that could not be reached, refused a request, or sent something that
    /// breaks the protocol (a bad frame, a shard that does not match its checksums).
    #[error("peer {peer}: {reason}")]
    Peer { peer: String, reason: String },

    /// A connection whose cluster-token authentication failed.
    #[error("authentication with {peer} failed: {reason}")]
    Auth { peer: String, reason: String },

    /// A TLS file (`tls_dir`) that cannot be used: missing, unreadable, expired, not from the
    /// cluster's CA, or a key that is not the certificate's.
    #[error("TLS file {path}: {reason}", path = path.display())]
    Tls { path: PathBuf, reason: String },

    /// Memory the sidecar's budget cannot hold, even after evicting what may be evicted.
    #[error("memory budget of {budget} bytes cannot hold {need} more ({used} held): {reason}")]
    Budget {
        need: u64,
        used: u64,
        budget: u64,
        reason: String,
    },
}

impl From<LinkError> for Error {
    fn from(e: LinkError) -> Error {
        match e.side {
            Side::Peer => Error::Peer {
                peer: e.label,
                reason: e.reason,
            },
            Side::Local => Error::Ckpt(e.into()),
        }
    }
}

impl Error {
    /// An I/O error of `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        hotstart_ckpt::Error::io(op, path, source).into()
    }

    /// A store error of `what` on `key`.
    pub fn store(
        what: &'static str,
        key: impl Into<String>,
        source: hotstart_store::Error,
    ) -> Self {
        hotstart_ckpt::Error::store(what, key, source).into()
    }

    /// A manifest or header (`what`, at `location`) that cannot be used.
    pub fn format(
        what: &'static str,
        location: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        hotstart_ckpt::Error::format(what, location, reason).into()
    }

    /// A configuration that cannot be used.
    pub fn config(reason: impl Into<String>) -> Self {
        hotstart_ckpt::Error::Config {
            reason: reason.into(),
        }
        .into()
    }

    /// The engine's error inside, if this is one.
    pub fn as_ckpt(&self) -> Option<&hotstart_ckpt::Error> {
        match self {
            Error::Ckpt(e) => Some(e),
            _ => None,
        }
    }

    /// True when the thing asked for does not exist (a missing object, file or step).
    pub fn is_not_found(&self) -> bool {
        self.as_ckpt()
            .is_some_and(hotstart_ckpt::Error::is_not_found)
    }

    /// Step, chunk and reason when a chunk's copies are damaged or gone in every tier.
    pub fn corrupt(&self) -> Option<(u64, usize, String)> {
        match self.as_ckpt()? {
            hotstart_ckpt::Error::Corrupt {
                step,
                chunk,
                reason,
                ..
            } => Some((*step, *chunk, reason.clone())),
            _ => None,
        }
    }
}

/// `Result` with the sidecar's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
