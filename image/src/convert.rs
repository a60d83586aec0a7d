//! `hotstart image convert`: an OCI image whose layers the containerd snapshotter can serve
//! lazily.
//!
//! Each layer of the source image becomes an image in the store named by the layer's digest
//! ([`layer_image`]), so a layer shared by many images is built and stored once. The converted
//! image is the source image with one annotation on each layer naming that image
//! ([`LAYER_ANNOTATION`]). containerd hands a layer's `containerd.io/snapshot/` annotations to
//! the snapshotter when it unpacks the layer; the blobs are the source's, unchanged, so a node
//! without the snapshotter (or one that cannot reach the store) pulls and unpacks the converted
//! image as it would the source.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::build::BuildConfig;
use crate::build::oci::{self, ImageManifest};
use crate::error::{Error, Result};
use crate::image::{Images, TreeCounts};
use crate::layout::ImageRef;

/// The layer annotation (and so the snapshot label) that names the image serving a layer.
pub const LAYER_ANNOTATION: &str = "containerd.io/snapshot/hotstart.layer";

/// The image in the store that serves the layer whose blob is `digest` (`sha256:<hex>`).
pub fn layer_image(digest: &str) -> Result<ImageRef> {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    ImageRef::parse(&format!("hotstart-layers/sha256-{hex}:latest"))
}

/// Where the starts of the container image `reference` (as containerd pulled it, e.g.
/// `registry.example:5000/team/train:v3`) keep their one profile and their reports: all the
/// image's lazily served layers replay that profile, and every container start on them adds a
/// report (see `snapshotter/lazy.rs`). Named by a hash of the reference, since a reference may
/// hold what store names may not (a registry's port, capitals).
pub fn container_image(reference: &str) -> ImageRef {
    let hex = blake3::hash(reference.as_bytes()).to_hex();
    ImageRef {
        name: format!("hotstart-containers/{}", &hex[..32]),
        tag: crate::layout::DEFAULT_TAG.to_string(),
    }
}

/// One converted layer.
#[derive(Debug, Clone)]
pub struct ConvertedLayer {
    /// The layer blob's digest.
    pub digest: String,
    /// The image that serves it.
    pub image: ImageRef,
    /// False when the store already held it (another image has the same layer).
    pub built: bool,
    pub counts: TreeCounts,
}

/// What [`convert`] wrote.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The converted manifest's digest.
    pub manifest: String,
    pub layers: Vec<ConvertedLayer>,
}

/// Converts the image in the OCI layout `src` (for `cfg.platform`) into the new layout `dest`,
/// storing each layer's tree through `images`.
pub async fn convert(
    images: &Images,
    src: &Path,
    dest: &Path,
    cfg: &BuildConfig,
) -> Result<Converted> {
    if dest.exists() && std::fs::read_dir(dest).map_or(true, |mut d| d.next().is_some()) {
        return Err(Error::source(
            dest,
            "exists and is not empty; convert into a new directory",
        ));
    }
    let (src2, platform) = (src.to_path_buf(), cfg.platform.clone());
    let (manifest, blobs) = tokio::task::spawn_blocking(move || {
        let m = oci::image_manifest(&src2, platform.as_deref())?;
        let blobs = m.layer_blobs(&src2)?;
        Ok::<_, Error>((m, blobs))
    })
    .await
    .map_err(|e| Error::Task {
        what: "read the OCI layout",
        message: e.to_string(),
    })??;

    // Each layer is served as itself under overlayfs: its whiteouts stay whiteouts.
    let cfg = &BuildConfig {
        overlay_layer: true,
        ..cfg.clone()
    };
    let mut layers = Vec::new();
    for (digest, path) in blobs {
        let image = layer_image(&digest)?;
        let (built, counts) = match images.record(&image).await {
            Ok(r) => (false, r.counts),
            Err(Error::NoImage { .. }) => (true, images.build(&path, &image, cfg).await?.counts),
            Err(e) => return Err(e),
        };
        layers.push(ConvertedLayer {
            digest,
            image,
            built,
            counts,
        });
    }
    let (src2, dest2, names) = (
        src.to_path_buf(),
        dest.to_path_buf(),
        layers
            .iter()
            .map(|l| l.image.to_string())
            .collect::<Vec<_>>(),
    );
    let manifest =
        tokio::task::spawn_blocking(move || write_layout(&src2, &dest2, &manifest, &names))
            .await
            .map_err(|e| Error::Task {
                what: "write the converted layout",
                message: e.to_string(),
            })??;
    Ok(Converted { manifest, layers })
}

/// Writes `dest`: the source's blobs (hard-linked where possible), the manifest annotated with
/// `names` (one per layer), and an index naming it; returns the manifest's digest.
fn write_layout(src: &Path, dest: &Path, m: &ImageManifest, names: &[String]) -> Result<String> {
    let bad = |why: String| Error::source(src, why);
    let mut doc: serde_json::Value =
        serde_json::from_slice(&m.bytes).map_err(|e| bad(format!("manifest: {e}")))?;
    let mut referenced = vec![
        doc["config"]["digest"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ];
    let layers = doc["layers"]
        .as_array_mut()
        .ok_or_else(|| bad("the manifest has no layers".into()))?;
    if layers.len() != names.len() {
        return Err(bad("the manifest changed while it was converted".into()));
    }
    for (layer, name) in layers.iter_mut().zip(names) {
        referenced.push(layer["digest"].as_str().unwrap_or_default().to_string());
        let obj = layer
            .as_object_mut()
            .ok_or_else(|| bad("a layer descriptor is not an object".into()))?;
        let ann = obj
            .entry("annotations")
            .or_insert_with(|| serde_json::json!({}));
        ann[LAYER_ANNOTATION] = serde_json::Value::String(name.clone());
    }
    let bytes = serde_json::to_vec(&doc).expect("a manifest serializes");
    let digest = format!("sha256:{}", oci::hex(&Sha256::digest(&bytes)));

    let blobs = dest.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| Error::io("create", &blobs, e))?;
    for d in referenced {
        let from = oci::blob_path(src, &d)?;
        let to = oci::blob_path(dest, &d)?;
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(|e| Error::io("copy blob", &from, e))?;
        }
    }
    write(&oci::blob_path(dest, &digest)?, &bytes)?;
    let mut desc = serde_json::json!({
        "mediaType": m.media_type,
        "digest": digest,
        "size": bytes.len(),
    });
    if !m.annotations.is_empty() {
        desc["annotations"] = serde_json::Value::Object(m.annotations.clone());
    }
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [desc],
    });
    write(
        &dest.join("index.json"),
        &serde_json::to_vec(&index).expect("an index serializes"),
    )?;
    write(
        &dest.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    Ok(digest)
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io("write", path, e))
}
