//! An OCI image layout as `hotstart image build` reads it from a directory a user or a registry
//! filled: the index, and the nested indexes and manifests it names by digest, down to the
//! image manifest and its layers' descriptors. The input is the index, then (after each 0xFF
//! byte, which JSON text never holds) a blob stored under its own SHA-256.
#![no_main]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use hotstart_fuzz::{scratch, set_bound};
use hotstart_image::build::oci;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fn layout() -> &'static std::path::Path {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("oci");
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("write oci-layout");
        dir
    })
}

fuzz_target!(init: set_bound(64 << 20), |data: &[u8]| {
    let dir = layout();
    // Blobs of earlier inputs may stay (a name is its content's hash, so none is ever wrong),
    // cleared now and then so they do not fill the memory.
    static INPUTS: AtomicU64 = AtomicU64::new(0);
    let blobs = dir.join("blobs").join("sha256");
    if INPUTS.fetch_add(1, Ordering::Relaxed) % 4096 == 0 {
        let _ = std::fs::remove_dir_all(&blobs);
    }
    std::fs::create_dir_all(&blobs).expect("create blobs/sha256");
    let mut parts = data.split(|&b| b == 0xFF);
    let index = parts.next().unwrap_or_default();
    std::fs::write(dir.join("index.json"), index).expect("write index.json");
    for blob in parts {
        let hex: String = Sha256::digest(blob).iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(blobs.join(hex), blob).expect("write a blob");
    }
    for platform in ["linux/amd64", "linux/arm64/v8"] {
        if let Ok(m) = oci::image_manifest(dir, Some(platform)) {
            let _ = m.layer_blobs(dir);
        }
    }
});
