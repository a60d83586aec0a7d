//! hotstart-py: the native half of the `hotstart` Python package (`hotstart._core`).
//!
//! The Python half (`bindings/python/hotstart`) walks state dicts, keeps the caller's tensors
//! alive and builds the results; this crate is the thin layer between it and the checkpoint
//! engine (`hotstart-ckpt`):
//!
//! - [`engine`]: `Engine`, one rank's engine: save, manifests, verified loads, retention;
//! - [`handle`]: `SaveHandle`, a save in flight, which owns the Python objects whose memory
//!   the engine reads until the staging copy is over;
//! - [`memory`]: tensors and load destinations described by address and length, checked
//!   (lengths, null addresses, overlaps) before the engine sees them;
//! - [`errors`]: engine errors as `hotstart.errors` exceptions carrying the engine's message;
//! - [`env`]: `hotstart.env.ensure`, dependency snapshots (`hotstart-env`).
//!
//! Every call that can block (back-pressure on save, waits, loads, listings) releases the GIL.

pub mod engine;
pub mod env;
pub mod errors;
pub mod handle;
pub mod memory;

use pyo3::prelude::*;

/// Logs of the engine go to stderr, filtered by `HOTSTART_LOG` (EnvFilter syntax, default
/// `warn`), unless the process already installed a subscriber.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("HOTSTART_LOG").unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a log written to a file stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[pymodule]
mod _core {
    #[pymodule_export]
    use super::engine::Engine;
    #[pymodule_export]
    use super::env::env_ensure;
    #[pymodule_export]
    use super::handle::SaveHandle;

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        super::init_logging();
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("CUDA_BUILT", hotstart_ckpt::cuda::ENABLED)?;
        Ok(())
    }
}
