//! hotstart-snapshot: dependency snapshots.
//!
//! Turns "install the environment" on every node into "restore the environment someone already
//! installed". See [`key`] for what identifies an environment.

pub mod error;
pub mod key;

pub use error::{Error, Result};
pub use key::{Key, KeyInputs, KeySpec, Platform, PythonInfo};
