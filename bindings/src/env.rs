//! `hotstart.env.ensure`: dependency snapshots (`hotstart-env`) from Python.
//!
//! One blocking call, the GIL released throughout: compute the key, restore the snapshot on a
//! hit, or run the install command (its output goes to this process's stdout and stderr) and
//! publish on a miss. The outcome crosses as the JSON object `hotstart env ensure --json`
//! prints; `hotstart.env` turns it into an `EnsureResult`.
//!
//! A lazy mount is not offered here: it must be served by a process for as long as the job
//! reads from it, which `hotstart env ensure --lazy` is and a library call returning to its
//! caller is not.

use std::path::PathBuf;

use hotstart_env::{EnsureConfig, Error, RestoreOptions, default_cache_dir, ensure};
use hotstart_store::Store;
use pyo3::prelude::*;

use crate::errors::{ConfigError, HotstartError, StoreError};

pyo3::import_exception!(hotstart.errors, InstallFailed);
pyo3::import_exception!(hotstart.errors, TargetInUse);
pyo3::import_exception!(hotstart.errors, CorruptSnapshot);

/// The Python exception for a snapshot error.
fn to_py(e: Error) -> PyErr {
    let message = e.to_string();
    if let Some(code) = e.install_exit_code() {
        return InstallFailed::new_err((message, code));
    }
    if e.is_corrupt() {
        return CorruptSnapshot::new_err(message);
    }
    match e {
        Error::Config { .. } | Error::Python { .. } | Error::LazyRelocation { .. } => {
            ConfigError::new_err(message)
        }
        Error::TargetInUse { .. } => TargetInUse::new_err(message),
        Error::BadSnapshot { .. } => CorruptSnapshot::new_err(message),
        Error::Store(_) | Error::Io { .. } | Error::Restore { .. } => StoreError::new_err(message),
        _ => HotstartError::new_err(message),
    }
}

/// Makes `target` hold the environment of `locks`, `python` and `command`; returns the outcome
/// as JSON. See `hotstart.env.ensure`.
#[pyfunction]
#[pyo3(signature = (
    store, locks, target, command, *, python=None, relocatable=false, cache_dir=None,
    cache_size=None, hardlinks=true,
))]
#[allow(clippy::too_many_arguments)]
pub fn env_ensure(
    py: Python<'_>,
    store: String,
    locks: Vec<PathBuf>,
    target: PathBuf,
    command: Vec<String>,
    python: Option<String>,
    relocatable: bool,
    cache_dir: Option<PathBuf>,
    cache_size: Option<u64>,
    hardlinks: bool,
) -> PyResult<String> {
    if locks.is_empty() {
        return Err(ConfigError::new_err("give at least one lock file"));
    }
    let mut cfg = EnsureConfig::new(locks, target, command);
    if let Some(p) = python {
        cfg.python = p;
    }
    cfg.relocatable = relocatable;
    cfg.cache_dir = cache_dir.unwrap_or_else(default_cache_dir);
    if let Some(n) = cache_size {
        cfg.cache_capacity = n;
    }
    cfg.restore = RestoreOptions {
        link_from_cache: hardlinks,
        ..RestoreOptions::default()
    };
    py.detach(move || {
        let store = Store::open(&store)
            .map_err(|e| ConfigError::new_err(format!("store {store:?}: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| HotstartError::new_err(format!("start the I/O runtime: {e}")))?;
        let outcome = rt.block_on(ensure(&store, &cfg)).map_err(to_py)?;
        Ok(outcome.to_json().to_string())
    })
}
