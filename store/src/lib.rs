//! hotstart-store: the storage substrate every other hotstart crate reads and writes through.
//!
//! - [`StoreUrl`] / [`Store`]: a URL (`/path`, `file://`, `memory://`, `s3://bucket/prefix`, and
//!   `gs://` / `az://` behind features) opened as an `object_store` backend with its prefix applied.
//! - [`StripedReader`] / [`StripedWriter`]: one object read as many parallel ranged GETs, or
//!   written as a parallel multipart upload, under one process-wide [`ByteBudget`].
//! - [`ChunkStore`]: content-addressed, zstd-compressed chunks, verified on every read, with a
//!   bounded local disk cache and single-flight fetches.
//! - [`Tree`]: the manifest of a file tree (images and environment snapshots are trees).
//! - [`LruIndex`]: the least-recently-used bookkeeping of caches bounded by bytes; [`DiskCache`]:
//!   a directory of entry files bounded by bytes on top of it, the building block of the chunk
//!   cache and the FUSE stripe cache.
//! - [`transfer`]: whole files copied between local disk and a store, striped both ways.
//! - [`uring`]: local files written and read through io_uring with O_DIRECT.
//! - [`wrap`]: `ObjectStore` wrappers for tests and benchmarks: throttled, fault-injecting,
//!   counting.

pub mod budget;
pub mod chunk;
pub mod disk_cache;
pub mod error;
mod file_meta;
pub mod lru;
pub mod striped;
pub mod transfer;
pub mod tree;
pub mod uring;
pub mod url;
pub mod wrap;

pub use budget::ByteBudget;
pub use chunk::{ChunkCache, ChunkId, ChunkStore, ChunkStoreConfig};
pub use disk_cache::{DiskCache, EntryNames};
pub use error::{Error, Result};
pub use lru::LruIndex;
pub use striped::{StripeConfig, StripedReader, StripedWriter};
pub use tree::{Entry, EntryKind, MaterializeOptions, MaterializeStats, Tree};
pub use url::{ObjectInfo, REMOTE_MAX_BACKOFF, REMOTE_RETRIES, REMOTE_RETRY_FOR, Store, StoreUrl};

/// Re-exported so that users of this crate name the same `object_store` version.
pub use object_store;
