//! OCI images written offline, for containerd tests and benchmarks: layer tarballs, the layout
//! (`oci-layout`, `index.json`, `blobs/sha256/`), and the libraries a program needs.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

/// `sha256:<hex>` of `data`.
pub fn sha256(data: &[u8]) -> String {
    let hex: String = Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

fn header(mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

/// An uncompressed layer tarball owned by root: the parent directories of `files` (path
/// relative to the root, mode, bytes), then the files.
pub fn layer_tar(files: &[(String, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (path, _, _) in files {
        let mut p = Path::new(path).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(d.to_path_buf());
            p = d.parent();
        }
    }
    for d in dirs {
        let mut h = header(0o755, 0);
        h.set_entry_type(tar::EntryType::Directory);
        b.append_data(&mut h, format!("{}/", d.display()), std::io::empty())
            .expect("a tar entry in memory");
    }
    for (path, mode, data) in files {
        let mut h = header(*mode, data.len() as u64);
        b.append_data(&mut h, path, data.as_slice())
            .expect("a tar entry in memory");
    }
    b.into_inner().expect("a tarball in memory")
}

/// A layer tarball of the directory `root` (its contents at the layer's root).
pub fn dir_tar(root: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", root)
        .unwrap_or_else(|e| panic!("tar {}: {e}", root.display()));
    b.into_inner().expect("a tarball in memory")
}

/// The shared libraries `programs` load (as `ldd` resolves them on this machine), absolute
/// paths, each once; those under `inside` (the programs' own tree) are left out.
pub fn libraries(programs: &[PathBuf], inside: Option<&Path>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for p in programs {
        let Ok(o) = Command::new("ldd").arg(p).output() else {
            continue;
        };
        for line in String::from_utf8_lossy(&o.stdout).lines() {
            let lib = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(lib) = lib.filter(|l| l.starts_with('/'))
                && !inside.is_some_and(|i| Path::new(lib).starts_with(i))
                && !out.iter().any(|o| o == lib)
            {
                out.push(lib.to_string());
            }
        }
    }
    out
}

/// An OCI image layout written by [`write_layout`].
#[derive(Debug, Clone)]
pub struct Layout {
    pub dir: PathBuf,
    /// The layer blobs' digests, bottom first.
    pub layers: Vec<String>,
    /// The layer blobs' bytes together (what a full pull downloads).
    pub layer_bytes: u64,
}

/// Writes an OCI layout at `dir` of one linux/amd64 image named `name` (the
/// `io.containerd.image.name` annotation, which `ctr images import` takes), whose layers are
/// the tarballs `layers` (bottom first; gzip-compressed when `gzip`) and whose process is `cmd`
/// with `env`.
pub fn write_layout(
    dir: &Path,
    name: &str,
    cmd: &[&str],
    env: &[&str],
    layers: &[Vec<u8>],
    gzip: bool,
) -> Layout {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("create the layout");
    let add = |data: &[u8]| {
        let d = sha256(data);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), data).expect("write a blob");
        (d, data.len())
    };
    let diff_ids: Vec<String> = layers.iter().map(|l| sha256(l)).collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": env, "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (cd, cs) = add(&serde_json::to_vec(&config).expect("JSON"));
    let (mut digests, mut layer_bytes, mut descs) = (Vec::new(), 0u64, Vec::new());
    for l in layers {
        let (blob, media) = if gzip {
            let mut z = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            z.write_all(l).expect("gzip in memory");
            (
                z.finish().expect("gzip in memory"),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            )
        } else {
            (l.clone(), "application/vnd.oci.image.layer.v1.tar")
        };
        let (d, s) = add(&blob);
        layer_bytes += s as u64;
        digests.push(d.clone());
        descs.push(serde_json::json!({"mediaType": media, "digest": d, "size": s}));
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": descs,
    });
    let (md, ms) = add(&serde_json::to_vec(&manifest).expect("JSON"));
    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
        }],
    });
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&index).expect("JSON"),
    )
    .expect("write index.json");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("write oci-layout");
    Layout {
        dir: dir.to_path_buf(),
        layers: digests,
        layer_bytes,
    }
}

/// The layout at `dir` as a tarball beside it (what `ctr images import` reads).
pub fn archive(dir: &Path) -> PathBuf {
    let path = dir.with_extension("tar");
    std::fs::write(&path, dir_tar(dir)).expect("write the archive");
    path
}
