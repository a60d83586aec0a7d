//! The one error type of `hotstart-ckpt`.
//!
//! Variants carry the step, rank, tier, key or path they concern, so a line read in a log says
//! where to look. Staging and persistence failures happen on a background thread and may be read
//! by several waiters, so they are shared as [`Error::Staging`] and [`Error::Persist`] around an
//! `Arc`.

use std::path::PathBuf;
use std::sync::Arc;

use crate::TierKind;
use hotstart_proto::wire::{LinkError, Side};

/// Everything that can go wrong in the checkpoint engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration that cannot be used.
    #[error("invalid checkpoint configuration: {reason}")]
    Config { reason: String },

    /// A tensor whose description does not fit its bytes.
    #[error("invalid tensor {name:?}: {reason}")]
    Tensor { name: String, reason: String },

    /// Tensors or extras handed to `save` that cannot be written.
    #[error("invalid input for step {step}: {reason}")]
    Input { step: u64, reason: String },

    /// A manifest or safetensors header that cannot be decoded or is inconsistent.
    #[error("invalid {what} {location}: {reason}")]
    Format {
        what: &'static str,
        location: String,
        reason: String,
    },

    /// No copy of a chunk in any tier matches its checksum.
    #[error(
        "step {step} rank {rank}: chunk {chunk} is corrupt or missing in every tier ({reason})"
    )]
    Corrupt {
        step: u64,
        rank: u32,
        chunk: usize,
        reason: String,
    },

    /// No complete checkpoint to load (or not the asked step).
    #[error("no complete checkpoint{} for rank {rank} of job {job:?}", step.map(|s| format!(" at step {s}")).unwrap_or_default())]
    NotFound {
        job: String,
        step: Option<u64>,
        rank: u32,
    },

    /// Local file-system I/O.
    #[error("{op} {path}: {source}", path = path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The storage substrate (object store or io_uring files).
    #[error("{what} {key}: {source}")]
    Store {
        what: &'static str,
        key: String,
        #[source]
        source: Box<hotstart_store::Error>,
    },

    /// A tier that failed to persist a step (shared by every waiter of the save).
    #[error("step {step} rank {rank} was not persisted to the {tier} tier: {source}")]
    Persist {
        tier: TierKind,
        step: u64,
        rank: u32,
        #[source]
        source: Arc<Error>,
    },

    /// A save whose staging failed (shared by every waiter of the save).
    #[error("step {step} was not staged: {source}")]
    Staging {
        step: u64,
        #[source]
        source: Arc<Error>,
    },

    /// A save dropped because `max_inflight` checkpoints were in flight and the policy is `skip`.
    #[error("step {step} was skipped: {inflight} checkpoints already in flight")]
    Skipped { step: u64, inflight: usize },

    /// A caller buffer that does not fit the tensor loaded into it.
    #[error("step {step}: destination for tensor {name:?}: {reason}")]
    Destination {
        step: u64,
        name: String,
        reason: String,
    },

    /// A CUDA device tensor or destination that cannot be served: the build lacks the `cuda`
    /// feature, no CUDA driver is installed, no such device, or a driver call failed.
    #[error("CUDA: {reason}")]
    Cuda { reason: String },

    /// The sidecar (`hotstart serve`) could not be reached, refused a request, or broke the
    /// protocol of its Unix socket.
    #[error("sidecar at {socket}: {reason}")]
    Sidecar { socket: String, reason: String },

    /// A tier that cannot be read (a store that is down, a directory that cannot be listed),
    /// where its answer matters: without it, the newest checkpoint (or the step asked for)
    /// cannot be known. Never reported as "no checkpoint".
    #[error(
        "the {tier} tier cannot be read, so job {job:?}'s checkpoints there are unknown: {source}. \
         Nothing was loaded; fix the {tier} tier (is the store up, the directory readable?) and \
         retry, or leave it out of the configuration to load from the other tiers"
    )]
    Unavailable {
        tier: TierKind,
        job: String,
        #[source]
        source: Box<Error>,
    },

    /// A save of a step that this engine is still saving.
    #[error(
        "step {step} is already being saved by this process: a step is written by one save at \
         a time. Wait for the first save's handle (wait()) before saving the step again, or \
         save another step"
    )]
    InFlight { step: u64 },

    /// Another live process saves the same job and rank.
    #[error(
        "job {job:?} rank {rank} is already saved by another process ({holder}, lock {path}): two \
         writers of one rank overwrite each other's steps. Stop the other process, or give this \
         one another job name or rank",
        path = path.display()
    )]
    SecondWriter {
        job: String,
        rank: u32,
        holder: String,
        path: PathBuf,
    },

    /// A background thread that panicked or could not be started.
    #[error("{what} failed: {message}")]
    Task { what: &'static str, message: String },
}

impl Error {
    /// An I/O error of `op` on `path`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// A store error of `what` on `key`.
    pub fn store(
        what: &'static str,
        key: impl Into<String>,
        source: hotstart_store::Error,
    ) -> Self {
        Error::Store {
            what,
            key: key.into(),
            source: Box::new(source),
        }
    }

    /// A manifest or header (`what`, at `location`) that cannot be used.
    pub fn format(
        what: &'static str,
        location: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Format {
            what,
            location: location.into(),
            reason: reason.into(),
        }
    }

    /// `source`, met on `tier` while looking for job `job`'s checkpoints: the tier cannot be
    /// read.
    pub fn unavailable(tier: TierKind, job: &str, source: Error) -> Self {
        Error::Unavailable {
            tier,
            job: job.to_string(),
            source: Box::new(source),
        }
    }

    /// True for an error that says the place could not be read (I/O, store, sidecar link), as
    /// opposed to bytes that were read and found invalid.
    pub fn is_unreadable(&self) -> bool {
        matches!(
            self.root(),
            Error::Io { .. }
                | Error::Store { .. }
                | Error::Sidecar { .. }
                | Error::Unavailable { .. }
        ) && !self.is_not_found()
    }

    /// The error behind any [`Error::Persist`] or [`Error::Staging`] wrapping.
    pub fn root(&self) -> &Error {
        match self {
            Error::Persist { source, .. } | Error::Staging { source, .. } => source.root(),
            other => other,
        }
    }

    /// True for store errors that may succeed when retried
    /// ([`hotstart_store::Error::is_transient`]).
    pub fn is_transient(&self) -> bool {
        match self.root() {
            Error::Store { source, .. } => source.is_transient(),
            _ => false,
        }
    }

    /// True when the thing asked for does not exist (a missing object, file or step).
    pub fn is_not_found(&self) -> bool {
        match self.root() {
            Error::Store { source, .. } => source.is_not_found(),
            Error::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            Error::NotFound { .. } => true,
            _ => false,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<LinkError> for Error {
    fn from(e: LinkError) -> Error {
        let socket = match e.side {
            Side::Local => e.label,
            Side::Peer => format!("peer {}", e.label),
        };
        Error::Sidecar {
            socket,
            reason: e.reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_staging_keeps_the_kind_of_its_cause() {
        let cause = Arc::new(Error::Sidecar {
            socket: "/run/s.sock".into(),
            reason: "connect: No such file or directory".into(),
        });
        let e = Error::Staging {
            step: 7,
            source: cause,
        };
        // What a caller (and the Python layer) chooses the kind by.
        assert!(matches!(e.root(), Error::Sidecar { .. }), "{e:?}");
        assert!(e.is_unreadable());
        let said = e.to_string();
        assert!(
            said.starts_with("step 7 was not staged: sidecar at /run/s.sock"),
            "{said}"
        );
    }
}
