//! hotstart-image: lazy images with hot-block record and replay.
//!
//! An **image** is a [`hotstart_store::Tree`] whose file contents are chunks in a
//! [`hotstart_store::ChunkStore`], built from a directory, a layer tarball or an OCI image layout
//! ([`Images::build`]), and stored under a name and tag (see [`layout`] for the keys). Any tree in
//! a store can be **mounted lazily** ([`LazyMount`]): read-only, a chunk fetched at its first read
//! into a bounded local cache, the first read of each chunk recorded, the record merged into a
//! **profile** beside the tree, and the profile replayed ahead of the job on the next mount.
//!
//! - [`build`]: sources to trees; tarball and OCI layers applied in order with whiteouts and
//!   opaque directories, hostile entries refused.
//! - [`Images`]: build, list, inspect, open, mount, pull and report on named images.
//! - [`ImageFs`] (`fs.rs`): the read-only filesystem, a plain type served by `hotstart-fuse`'s
//!   adapter; [`Loader`] (`loader.rs`): memory and disk caches, single-flight fetches, demand
//!   before prefetch, the counters; [`decode`]: prefetched chunks decoded at the lowest CPU
//!   priority; `prefetch.rs`: replay with an adaptive window;
//!   `profile.rs`: traces and profiles; [`LazyMount`] (`mount.rs`): all of it for one mount;
//!   [`MountReport`] (`report.rs`) and [`metrics`]: what a mount did.

pub mod build;
pub mod convert;
pub mod decode;
pub mod error;
pub mod fs;
pub mod image;
pub mod layout;
pub mod loader;
pub mod metrics;
pub mod mount;
pub mod prefetch;
pub mod profile;
pub mod report;
#[cfg(feature = "containerd")]
pub mod snapshotter;
pub mod warm;

pub use build::{BuildConfig, Source};
pub use convert::{
    Converted, ConvertedLayer, LAYER_ANNOTATION, container_image, convert, layer_image,
};
pub use error::{Error, Result};
pub use fs::{ImageFs, WarmFile, WarmRun};
pub use image::{
    ImageRecord, Images, Inspection, PullReport, TreeCounts, artifact_stats, pull_tree,
};
pub use layout::{ArtifactDir, ImageRef};
pub use loader::{Loader, LoaderStats};
pub use mount::{LazyConfig, LazyMount, PlanHook, ProfileRead, read_profile};
pub use prefetch::PrefetchConfig;
pub use profile::{Profile, Trace};
pub use report::MountReport;
