//! Engine errors as Python exceptions.
//!
//! The exception classes live in `hotstart.errors` (plain Python, so they can also derive from
//! the builtin they resemble, such as `ValueError`); this module imports them when an error is
//! raised. The class is chosen from the root cause ([`Error::root`], which looks through a
//! failed staging or persist), and the message is the engine's whole message with the causes
//! behind it.

use hotstart_ckpt::Error;
use pyo3::PyErr;

pyo3::import_exception!(hotstart.errors, HotstartError);
pyo3::import_exception!(hotstart.errors, ConfigError);
pyo3::import_exception!(hotstart.errors, StateDictError);
pyo3::import_exception!(hotstart.errors, CorruptCheckpoint);
pyo3::import_exception!(hotstart.errors, NoCheckpoint);
pyo3::import_exception!(hotstart.errors, StoreError);
pyo3::import_exception!(hotstart.errors, SaveSkipped);
pyo3::import_exception!(hotstart.errors, CudaError);
pyo3::import_exception!(hotstart.errors, TierUnavailable);
pyo3::import_exception!(hotstart.errors, SidecarError);
pyo3::import_exception!(hotstart.errors, StepInFlight);
pyo3::import_exception!(hotstart.errors, SecondWriter);

/// The Python exception for an engine error.
pub fn to_py(e: Error) -> PyErr {
    let message = with_causes(&e);
    match e.root() {
        Error::Config { .. } => ConfigError::new_err(message),
        Error::Tensor { .. } | Error::Input { .. } | Error::Destination { .. } => {
            StateDictError::new_err(message)
        }
        Error::Format { .. } | Error::Corrupt { .. } => CorruptCheckpoint::new_err(message),
        Error::NotFound { .. } => NoCheckpoint::new_err(message),
        Error::Io { .. } | Error::Store { .. } => StoreError::new_err(message),
        Error::Skipped { .. } => SaveSkipped::new_err(message),
        Error::Cuda { .. } => CudaError::new_err(message),
        Error::Unavailable { .. } => TierUnavailable::new_err(message),
        Error::Sidecar { .. } => SidecarError::new_err(message),
        Error::InFlight { .. } => StepInFlight::new_err(message),
        Error::SecondWriter { .. } => SecondWriter::new_err(message),
        _ => HotstartError::new_err(message),
    }
}

/// The engine's message, followed by the causes behind it that it does not already say: an
/// object store's "error sending request" says why (a refused connection, a name that does not
/// resolve) only in its sources.
fn with_causes(e: &Error) -> String {
    let mut message = e.to_string();
    let mut causes: Vec<String> = Vec::new();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !message.contains(&text) && !causes.iter().any(|said| said.contains(&text)) {
            causes.push(text);
        }
        cause = c.source();
    }
    if !causes.is_empty() {
        message.push_str(&format!(" (caused by: {})", causes.join(": ")));
    }
    message
}

/// `StateDictError` with `message`, for input the binding refuses before the engine sees it.
pub fn state_dict(message: impl Into<String>) -> PyErr {
    StateDictError::new_err(message.into())
}
