//! OCI image layouts: `oci-layout`, `index.json` and `blobs/<alg>/<hex>` in a directory, as
//! written by `skopeo copy ... oci:DIR`, `docker buildx --output type=oci` or `umoci`.
//!
//! The index is followed to one image manifest: nested indexes are descended, and where an index
//! lists several manifests the one for this machine's platform (`linux/amd64`, `linux/arm64`,
//! ...) is taken unless a platform is given. The manifest's layers are then applied in order
//! (see `layers.rs`). Every blob read (index, manifest, layer) is first checked against the
//! SHA-256 digest that names it, so a tampered layout is refused before anything in it is
//! parsed, and a digest is only ever used as a file name after it has been checked to be 64 hex
//! digits, so it cannot point outside `blobs/`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::layers::Layer;
use crate::error::{Error, Result};

/// Largest index or manifest read into memory.
const MAX_JSON: u64 = 16 << 20;

#[derive(Debug, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    platform: Option<Platform>,
    #[serde(default)]
    annotations: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct Platform {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    variant: Option<String>,
}

/// An index or a manifest (the fields this reader needs of either).
#[derive(Debug, Deserialize)]
struct Document {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

const INDEX_TYPES: [&str; 2] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
];
const MANIFEST_TYPES: [&str; 2] = [
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];
const LAYER_TYPES: [&str; 8] = [
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar",
];

/// Whether `dir` looks like an OCI image layout.
pub fn is_layout(dir: &Path) -> bool {
    dir.join("oci-layout").is_file() && dir.join("index.json").is_file()
}

/// This machine's platform in OCI terms, e.g. `linux/amd64`.
pub fn host_platform() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!("linux/{arch}")
}

/// The image manifest an index leads to.
#[derive(Debug)]
pub struct ImageManifest {
    /// The annotations of the index's entry it was reached through (an image name, a tag).
    pub annotations: serde_json::Map<String, serde_json::Value>,
    /// Its media type (from the manifest, or the descriptor that named it).
    pub media_type: String,
    /// The manifest as stored, verified against its digest.
    pub bytes: Vec<u8>,
}

impl ImageManifest {
    /// Its layers' blobs, bottom first: (descriptor index, digest, path), each verified.
    pub fn layer_blobs(&self, dir: &Path) -> Result<Vec<(String, PathBuf)>> {
        let doc = parse(dir, &self.bytes)?;
        let mut out = Vec::new();
        for d in doc.layers {
            if !LAYER_TYPES.contains(&d.media_type.as_str()) {
                return Err(Error::source(
                    dir,
                    format!(
                        "layer {} has media type {:?}, which is not a tar layer",
                        d.digest, d.media_type
                    ),
                ));
            }
            let path = blob_path(dir, &d.digest)?;
            verify_file(&path, &d.digest)?;
            out.push((d.digest, path));
        }
        Ok(out)
    }
}

/// The layers of the image in the layout at `dir`, bottom first, each verified.
pub fn layers(dir: &Path, platform: Option<&str>) -> Result<Vec<Layer>> {
    let m = image_manifest(dir, platform)?;
    Ok(m.layer_blobs(dir)?
        .into_iter()
        .map(|(_, path)| Layer { path })
        .collect())
}

/// The image manifest for `platform` (this machine's by default) in the layout at `dir`.
pub fn image_manifest(dir: &Path, platform: Option<&str>) -> Result<ImageManifest> {
    let layout = read_bounded(&dir.join("oci-layout"), MAX_JSON)?;
    let layout: serde_json::Value = serde_json::from_slice(&layout)
        .map_err(|e| Error::source(dir.join("oci-layout"), format!("not JSON: {e}")))?;
    if layout.get("imageLayoutVersion").and_then(|v| v.as_str()) != Some("1.0.0") {
        return Err(Error::source(
            dir.join("oci-layout"),
            "imageLayoutVersion is not 1.0.0",
        ));
    }
    let index_path = dir.join("index.json");
    let mut bytes = read_bounded(&index_path, MAX_JSON)?;
    let mut doc = parse(&index_path, &bytes)?;
    let wanted = platform.map_or_else(host_platform, str::to_string);
    let mut annotations = None;
    // An index (possibly nested) down to one manifest; a depth bound stops cycles.
    for _ in 0..8 {
        if !doc.layers.is_empty() || MANIFEST_TYPES.contains(&doc.media_type.as_str()) {
            return Ok(ImageManifest {
                annotations: annotations.unwrap_or_default(),
                media_type: doc.media_type,
                bytes,
            });
        }
        let chosen =
            choose(&doc.manifests, &wanted).map_err(|reason| Error::source(&index_path, reason))?;
        if annotations.is_none() {
            annotations = Some(chosen.annotations.clone());
        }
        let (path, blob) = blob(dir, &chosen.digest, MAX_JSON)?;
        let media_type = chosen.media_type.clone();
        doc = parse(&path, &blob)?;
        bytes = blob;
        if doc.media_type.is_empty() {
            doc.media_type = media_type;
        }
    }
    Err(Error::source(index_path, "indexes nested more than 8 deep"))
}

fn parse(path: &Path, bytes: &[u8]) -> Result<Document> {
    serde_json::from_slice(bytes)
        .map_err(|e| Error::source(path, format!("not an OCI document: {e}")))
}

/// The manifest of an index to follow.
fn choose<'a>(manifests: &'a [Descriptor], wanted: &str) -> Result<&'a Descriptor, String> {
    let candidates: Vec<&Descriptor> = manifests
        .iter()
        .filter(|d| {
            INDEX_TYPES.contains(&d.media_type.as_str())
                || MANIFEST_TYPES.contains(&d.media_type.as_str())
        })
        .collect();
    match candidates.as_slice() {
        [] => Err("the index lists no image manifest".into()),
        [one] => Ok(one),
        many => {
            let name = |p: &Platform| match &p.variant {
                Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                None => format!("{}/{}", p.os, p.architecture),
            };
            let matches = |d: &&&Descriptor| {
                d.platform.as_ref().is_some_and(|p| {
                    let full = name(p);
                    full == wanted || format!("{}/{}", p.os, p.architecture) == wanted
                })
            };
            many.iter().find(matches).copied().ok_or_else(|| {
                let listed: Vec<String> = many
                    .iter()
                    .filter_map(|d| d.platform.as_ref().map(name))
                    .collect();
                format!(
                    "no manifest for platform {wanted}; the index has {} (choose one with --platform)",
                    listed.join(", ")
                )
            })
        }
    }
}

/// `blobs/sha256/<hex>` for a well-formed digest.
pub fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .ok_or_else(|| {
            Error::source(
                dir,
                format!("digest {digest:?} is not sha256:<64 lowercase hex>"),
            )
        })?;
    Ok(dir.join("blobs").join("sha256").join(hex))
}

/// A small blob, read and verified.
fn blob(dir: &Path, digest: &str, max: u64) -> Result<(PathBuf, Vec<u8>)> {
    let path = blob_path(dir, digest)?;
    let bytes = read_bounded(&path, max)?;
    let got = hex(&Sha256::digest(&bytes));
    if format!("sha256:{got}") != digest {
        return Err(Error::source(
            &path,
            format!("content hashes to sha256:{got}, not {digest}"),
        ));
    }
    Ok((path, bytes))
}

/// Streams a (possibly large) blob through SHA-256 and compares with its digest.
fn verify_file(path: &Path, digest: &str) -> Result<()> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("open blob", path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::io("read blob", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    let got = hex(&h.finalize());
    if format!("sha256:{got}") != digest {
        return Err(Error::source(
            path,
            format!("content hashes to sha256:{got}, not {digest}"),
        ));
    }
    Ok(())
}

fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>> {
    let f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut out = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::io("read", path, e))?;
    if out.len() as u64 > max {
        return Err(Error::source(path, format!("larger than {max} bytes")));
    }
    Ok(out)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_cannot_name_paths() {
        let dir = Path::new("/layout");
        for bad in [
            "sha256:../../etc/passwd",
            "sha512:00",
            "sha256:ABCDEF",
            &format!("sha256:{}/", "a".repeat(63)),
        ] {
            assert!(blob_path(dir, bad).is_err(), "{bad}");
        }
        let ok = format!("sha256:{}", "0f".repeat(32));
        assert_eq!(
            blob_path(dir, &ok).unwrap(),
            dir.join("blobs/sha256").join("0f".repeat(32))
        );
    }

    #[test]
    fn platform_choice() {
        let d = |arch: &str| Descriptor {
            media_type: MANIFEST_TYPES[0].into(),
            digest: String::new(),
            platform: Some(Platform {
                os: "linux".into(),
                architecture: arch.into(),
                variant: None,
            }),
            annotations: Default::default(),
        };
        let list = [d("amd64"), d("arm64")];
        assert_eq!(
            choose(&list, "linux/arm64")
                .unwrap()
                .platform
                .as_ref()
                .unwrap()
                .architecture,
            "arm64"
        );
        let err = choose(&list, "linux/s390x").unwrap_err();
        assert!(err.contains("linux/amd64, linux/arm64"), "{err}");
    }
}
