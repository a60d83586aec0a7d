//! Turning a source into a [`Tree`] whose file contents are chunks in a [`ChunkStore`].
//!
//! Three sources, told apart by what is on disk (not by name):
//!
//! - a **directory**: walked by [`Tree::build`] (modes, owners, mtimes, xattrs, symlinks, hard
//!   links by inode; sockets, FIFOs and device nodes skipped with a warning);
//! - an **OCI image layout** (a directory with `oci-layout` and `index.json`): its layers applied
//!   in order, see `build/oci.rs`;
//! - a **layer tarball** (`.tar`, gzip or zstd compressed): applied as one layer, see
//!   `build/layers.rs`, which also refuses hostile entries.

pub mod layers;
pub mod oci;

use std::fmt;
use std::path::{Path, PathBuf};

use hotstart_store::tree::DEFAULT_CHUNK_SIZE;
use hotstart_store::{ChunkStore, Tree};

pub use layers::{Layer, LayerLimits};

use crate::error::{Error, Result};

/// How an image is built.
#[derive(Debug, Clone)]
pub struct BuildConfig {
    /// Bytes per chunk (the last chunk of a file is shorter).
    pub chunk_size: usize,
    /// The platform to take from a multi-platform OCI index, e.g. `linux/arm64` (default: this
    /// machine's).
    pub platform: Option<String>,
    /// Bounds on what tarball entries may claim.
    pub limits: LayerLimits,
    /// Build a layer tarball as one layer of an overlay stack: its whiteouts and opaque
    /// markers are kept as overlayfs represents them instead of applied (what
    /// `hotstart image convert` builds; see `layers.rs`).
    pub overlay_layer: bool,
}

impl Default for BuildConfig {
    fn default() -> Self {
        BuildConfig {
            chunk_size: DEFAULT_CHUNK_SIZE,
            platform: None,
            limits: LayerLimits::default(),
            overlay_layer: false,
        }
    }
}

/// What an image is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Dir(PathBuf),
    Tar(PathBuf),
    Oci(PathBuf),
}

impl Source {
    /// Classifies `path`: an OCI layout, another directory, or a file taken as a tarball.
    pub fn detect(path: &Path) -> Result<Source> {
        let path =
            &std::fs::canonicalize(path).map_err(|e| Error::io("resolve source", path, e))?;
        let meta = std::fs::metadata(path).map_err(|e| Error::io("stat source", path, e))?;
        Ok(if meta.is_dir() {
            if oci::is_layout(path) {
                Source::Oci(path.to_path_buf())
            } else {
                Source::Dir(path.to_path_buf())
            }
        } else if meta.is_file() {
            Source::Tar(path.to_path_buf())
        } else {
            return Err(Error::source(path, "neither a directory nor a file"));
        })
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Dir(p) => write!(f, "dir:{}", p.display()),
            Source::Tar(p) => write!(f, "tar:{}", p.display()),
            Source::Oci(p) => write!(f, "oci:{}", p.display()),
        }
    }
}

/// Builds the tree of `source`, storing its file contents in `chunks`.
pub async fn build_tree(source: &Source, chunks: &ChunkStore, cfg: &BuildConfig) -> Result<Tree> {
    let chunk_size = cfg.chunk_size.max(1);
    match source {
        Source::Dir(dir) => Ok(Tree::build(dir, chunks, chunk_size).await?),
        Source::Tar(path) => {
            let layers = vec![Layer { path: path.clone() }];
            layers::tree_from_layers(layers, chunks, chunk_size, cfg.limits, cfg.overlay_layer)
                .await
        }
        Source::Oci(dir) => {
            let (dir2, platform) = (dir.clone(), cfg.platform.clone());
            let layers =
                tokio::task::spawn_blocking(move || oci::layers(&dir2, platform.as_deref()))
                    .await
                    .map_err(|e| Error::task("OCI layout", e))??;
            layers::tree_from_layers(layers, chunks, chunk_size, cfg.limits, false).await
        }
    }
}
