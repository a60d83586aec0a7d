//! Engine errors as Python exceptions.
//!
//! The exception classes live in `hotstart.errors` (plain Python, so they can also derive from
//! the builtin they resemble, such as `ValueError`); this module imports them when an error is
//! raised. The class is chosen from the root cause ([`Error::root`], which looks through a
//! failed persist), and the message is the engine's whole message.

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
    let message = e.to_string();
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

/// `StateDictError` with `message`, for input the binding refuses before the engine sees it.
pub fn state_dict(message: impl Into<String>) -> PyErr {
    StateDictError::new_err(message.into())
}
