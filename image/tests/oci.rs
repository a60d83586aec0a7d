//! Building images from OCI image layouts: layers in order with whiteouts and opaque
//! directories, platform choice in a multi-platform index, and tampered layouts refused.

mod common;

use std::path::Path;

use common::*;
use common::{dir_entry as d, file_entry as f};
use hotstart_image::{BuildConfig, Error, ImageRef};
use serde_json::json;
use sha2::{Digest, Sha256};

/// Writes `data` as a blob of the layout; returns its digest.
fn blob(layout: &Path, data: &[u8]) -> String {
    let hex: String = Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = layout.join("blobs/sha256");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(&hex), data).unwrap();
    format!("sha256:{hex}")
}

fn layer_desc(layout: &Path, media: &str, data: &[u8]) -> serde_json::Value {
    json!({"mediaType": media, "digest": blob(layout, data), "size": data.len()})
}

/// A manifest over `layers` (already written); returns its descriptor.
fn manifest(
    layout: &Path,
    layers: Vec<serde_json::Value>,
    platform: Option<(&str, &str)>,
) -> serde_json::Value {
    let config = blob(
        layout,
        br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}}"#,
    );
    let m = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 1},
        "layers": layers,
    });
    let bytes = serde_json::to_vec(&m).unwrap();
    let mut d = json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": blob(layout, &bytes),
        "size": bytes.len(),
    });
    if let Some((os, arch)) = platform {
        d["platform"] = json!({"os": os, "architecture": arch});
    }
    d
}

fn write_index(layout: &Path, manifests: Vec<serde_json::Value>) {
    std::fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .unwrap();
    let index = json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests});
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
}

/// The two layers every test uses, and the tree they make.
fn two_layers(layout: &Path) -> Vec<serde_json::Value> {
    let base = tar(&[
        d("usr/"),
        d("usr/lib/"),
        f("usr/lib/a.so", b"a"),
        f("usr/lib/b.so", b"b"),
        d("var/"),
        d("var/cache/"),
        f("var/cache/old", b"old"),
        tar_entry(b"lib", SYMLINK, 0o777, b"usr/lib", b"", None),
    ]);
    let top = tar(&[
        f("usr/lib/.wh.a.so", b""),
        f("var/cache/.wh..wh..opq", b""),
        f("var/cache/new", b"new"),
        f("usr/lib/c.so", b"c"),
    ]);
    vec![
        layer_desc(
            layout,
            "application/vnd.oci.image.layer.v1.tar+gzip",
            &gzip(&base),
        ),
        layer_desc(
            layout,
            "application/vnd.oci.image.layer.v1.tar+zstd",
            &zstd(&top),
        ),
    ]
}

fn expected(dir: &Path) {
    for (p, data) in [
        ("usr/lib/b.so", &b"b"[..]),
        ("usr/lib/c.so", b"c"),
        ("var/cache/new", b"new"),
    ] {
        std::fs::create_dir_all(dir.join(p).parent().unwrap()).unwrap();
        std::fs::write(dir.join(p), data).unwrap();
    }
    std::os::unix::fs::symlink("usr/lib", dir.join("lib")).unwrap();
}

#[tokio::test]
async fn an_oci_layout_builds_its_layers_in_order() {
    let work = tempfile::tempdir().unwrap();
    let layout = work.path().join("layout");
    let layers = two_layers(&layout);
    write_index(&layout, vec![manifest(&layout, layers, None)]);
    let images = local_images(&work.path().join("store"));
    let image = ImageRef::parse("oci/app:1").unwrap();
    let rec = images
        .build(&layout, &image, &BuildConfig::default())
        .await
        .unwrap();
    assert!(rec.source.starts_with("oci:"), "{}", rec.source);
    let dest = work.path().join("out");
    images.pull(&image, &dest).await.unwrap();
    let want = work.path().join("want");
    expected(&want);
    assert_trees_equal_but_mtimes(&want, &dest);
}

#[tokio::test]
async fn a_multi_platform_index_takes_the_asked_platform() {
    let work = tempfile::tempdir().unwrap();
    let layout = work.path().join("layout");
    let ours = two_layers(&layout);
    let other = vec![layer_desc(
        &layout,
        "application/vnd.oci.image.layer.v1.tar",
        &tar(&[f("other-arch", b"x")]),
    )];
    let host = hotstart_image::build::oci::host_platform();
    let (_, arch) = host.split_once('/').unwrap();
    let foreign = if arch == "s390x" { "riscv64" } else { "s390x" };
    // A nested index: the top index names a second index that lists both platforms.
    let inner = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            manifest(&layout, other, Some(("linux", foreign))),
            manifest(&layout, ours, Some(("linux", arch))),
        ],
    });
    let inner = serde_json::to_vec(&inner).unwrap();
    let inner_desc = json!({
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "digest": blob(&layout, &inner),
        "size": inner.len(),
    });
    write_index(&layout, vec![inner_desc]);
    let images = local_images(&work.path().join("store"));
    let (mine, theirs) = (
        ImageRef::parse("m:host").unwrap(),
        ImageRef::parse("m:foreign").unwrap(),
    );
    images
        .build(&layout, &mine, &BuildConfig::default())
        .await
        .unwrap();
    let cfg = BuildConfig {
        platform: Some(format!("linux/{foreign}")),
        ..BuildConfig::default()
    };
    images.build(&layout, &theirs, &cfg).await.unwrap();
    let want = work.path().join("want");
    expected(&want);
    let dest = work.path().join("host");
    images.pull(&mine, &dest).await.unwrap();
    assert_trees_equal_but_mtimes(&want, &dest);
    let (_, tree) = images.open(&theirs).await.unwrap();
    let paths: Vec<&str> = tree.entries.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["other-arch"]);
    // A platform the index does not have is an error listing the ones it has.
    let cfg = BuildConfig {
        platform: Some("plan9/mips".into()),
        ..BuildConfig::default()
    };
    let err = images
        .build(&layout, &mine, &cfg)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("linux/{foreign}")), "{err}");
}

#[tokio::test]
async fn tampered_layouts_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let images = local_images(&work.path().join("store"));
    let image = ImageRef::parse("bad").unwrap();

    // A layer whose bytes no longer match its digest.
    let layout = work.path().join("tampered");
    let layers = two_layers(&layout);
    let digest = layers[1]["digest"]
        .as_str()
        .unwrap()
        .strip_prefix("sha256:")
        .unwrap()
        .to_string();
    write_index(&layout, vec![manifest(&layout, layers, None)]);
    let path = layout.join("blobs/sha256").join(&digest);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let err = images
        .build(&layout, &image, &BuildConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Source { .. }), "{err}");
    assert!(err.to_string().contains("hashes to"), "{err}");

    // A digest that tries to name a path outside blobs/.
    let layout = work.path().join("escape");
    std::fs::create_dir_all(&layout).unwrap();
    let evil = json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:../../../etc/passwd", "size": 1});
    write_index(&layout, vec![manifest(&layout, vec![evil], None)]);
    let err = images
        .build(&layout, &image, &BuildConfig::default())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("not sha256:<64 lowercase hex>"),
        "{err}"
    );

    // A layer that is not a tar.
    let layout = work.path().join("foreign-media");
    let odd = layer_desc(&layout, "application/vnd.example.thing", b"x");
    write_index(&layout, vec![manifest(&layout, vec![odd], None)]);
    let err = images
        .build(&layout, &image, &BuildConfig::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a tar layer"), "{err}");

    // A hostile entry inside a layer is refused like in a plain tarball.
    let layout = work.path().join("hostile");
    let l = layer_desc(
        &layout,
        "application/vnd.oci.image.layer.v1.tar",
        &tar(&[f("../x", b"x")]),
    );
    write_index(&layout, vec![manifest(&layout, vec![l], None)]);
    let err = images
        .build(&layout, &image, &BuildConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Hostile { ref entry, .. } if entry == "../x"),
        "{err}"
    );
    assert!(images.list().await.unwrap().is_empty());
}
