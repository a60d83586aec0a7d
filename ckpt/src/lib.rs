//! hotstart-ckpt: the asynchronous checkpoint engine.
//!
//! A training process hands [`Tensor`]s (owned bytes, or borrowed host memory) and [`Extras`]
//! to [`Engine::save`], which copies them into a reusable, page-aligned staging buffer over
//! several threads and returns a [`SaveHandle`] at once. [`SaveHandle::wait_staged`] is the only
//! wait training needs; persistence to the local disk tier (io_uring, `O_DIRECT`) and the object
//! store tier (striped multipart uploads) continues in the background, checksummed per chunk,
//! with the manifest written last as the commit. [`Engine::load`] reads the newest complete step
//! back, verifying every chunk and falling back from disk to store chunk by chunk.
//!
//! With a sidecar ([`EngineConfig::sidecar`], or `HOTSTART_SOCKET` through
//! [`EngineConfig::sidecar_from_env`]), saves stage straight into the shared memory of the
//! node's sidecar daemon (`hotstart serve`, the `hotstart-sidecar` crate), which keeps the step in memory
//! across a crash of the training process, copies it to peer nodes, persists it to disk and
//! store, and serves loads from the nearest tier that holds it.
//!
//! Tensors may also live in CUDA device memory ([`Tensor::from_device`], and
//! [`Destination::Device`] on load). With the `cuda` feature, device tensors are copied by the
//! GPU into pinned staging memory on a dedicated stream per device; without it, or on a machine
//! without a CUDA driver, they are refused with [`Error::Cuda`] and host tensors work as
//! always (see [`cuda`]).
//!
//! The on-storage format (one safetensors file and one JSON manifest per step and rank) is in
//! [`format`](mod@format) and `docs/FORMAT.md`.
//!
//! Modules: [`tensor`] (what is saved), [`format`](mod@format) (names, header, manifest, parsers),
//! `engine` (the entry points: configuration, save, retention), `admission` (the bound on
//! saves in flight), `save` (the one save pipeline: stage, hash, then the tiers or the
//! sidecar), `staging` (the buffer pool, parallel copies and hashes), [`cuda`] (the GPU path),
//! [`tier`] (disk and store), [`index`] (which steps a tier holds, and when one is complete), [`retention`] (which
//! steps a tier keeps), `load` (verified
//! reads), [`Persistence`] (one rank's tiers: completeness, retention, the sinks and the verified
//! reader, which the engine and the sidecar both call), `inner` (the state an engine's parts
//! share over it), `owner` (one writer per job and rank), [`handle`] (save progress),
//! [`inspect`] (offline listing, verification and retention: the `hotstart ckpt` commands),
//! `client` (the engine's client of the sidecar, over the frames, messages and shared memory of
//! `hotstart-proto`, which the sidecar speaks too).

pub mod cuda;
pub mod error;
pub mod format;
pub mod handle;
pub mod index;
pub mod inspect;
pub mod parts;
pub mod retention;
pub mod tensor;
pub mod tier;

mod admission;
mod client;
mod engine;
mod inner;
mod load;
mod owner;
mod persistence;
mod save;
mod staging;

pub use engine::{
    DEFAULT_CHUNK_SIZE, DEFAULT_SIDECAR_WAIT, Engine, EngineConfig, SOCKET_ENV, WhenFull,
};
pub use error::{Error, Result};
pub use handle::{Phase, SaveHandle, SaveStatus};
pub use inspect::Checkpoints;
pub use load::{Destination, DeviceBuffer, DeviceRoute, Loaded, Plan, StepSel};
pub use persistence::Persistence;
pub use staging::{default_threads, hash_chunks, map_chunks};
pub use tensor::{Dtype, Extras, LoadedTensor, Tensor};
pub use tier::TierKind;
