//! hotstart-prefetch: lazy images with hot-block record and replay.
//!
//! An **image** is a [`hotstart_store::Tree`] whose file contents are chunks in a
//! [`hotstart_store::ChunkStore`], built from a directory, a layer tarball or an OCI image layout
//! ([`Images::build`]), and stored under a name and tag (see [`layout`] for the keys).
//!
//! - [`build`]: sources to trees; tarball and OCI layers applied in order with whiteouts and
//!   opaque directories, hostile entries refused.
//! - [`Images`]: build, list, inspect, open and pull named images.
pub mod build;
pub mod error;
pub mod image;
pub mod layout;

pub use build::{BuildConfig, Source};
pub use error::{Error, Result};
pub use image::{ImageRecord, Images, Inspection, PullReport, TreeCounts, pull_tree};
pub use layout::{ArtifactDir, ImageRef};
