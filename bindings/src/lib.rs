//! hotstart-py: the `hotstart` Python package.
//!
//! This crate will own the pyo3 extension (built with maturin, abi3) that exposes the checkpoint
//! engine to Python training loops: `hotstart.Checkpointer`, torch and numpy state dicts, and the
//! torch.distributed.checkpoint storage backends.
