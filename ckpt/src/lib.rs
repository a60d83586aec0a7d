//! hotstart-ckpt: the GPU→host asynchronous checkpoint engine.
//!
//! This crate will own the checkpoint format (one safetensors file and one manifest per step and
//! rank), the engine that stages tensors into a reusable pool and persists them in the background
//! to the local disk tier and the object store tier, verified loads that fall back tier by tier,
//! and the sidecar daemon (`hotstart serve`) with its shared-memory tier and peer replication.
//! Everything it reads and writes goes through `hotstart-store`.
