//! Building images from directories and tarballs, and pulling them back: every file's bytes,
//! mode, link target and hard link equal the source's. Hostile tarballs are refused, naming the
//! entry, and leave no image behind.

mod common;

use common::*;
use hotstart_image::build::{Layer, LayerLimits, layers::tree_from_layers};
use hotstart_image::{BuildConfig, Error, ImageRef, Images, pull_tree};

fn name(s: &str) -> ImageRef {
    ImageRef::parse(s).unwrap()
}

#[tokio::test]
async fn a_directory_builds_and_pulls_back_identical() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    sample_dir(&src);
    let images = local_images(&work.path().join("store"));
    let image = name("sample/dir:v1");
    let rec = images
        .build(&src, &image, &BuildConfig::default())
        .await
        .unwrap();
    assert!(rec.source.starts_with("dir:"), "{}", rec.source);
    assert_eq!(rec.counts.hardlinks, 1);
    // dup-b repeats dup-a: stored once.
    assert!(rec.counts.dedup_ratio() > 1.0, "{:?}", rec.counts);

    let dest = work.path().join("pulled");
    let report = images.pull(&image, &dest).await.unwrap();
    assert_eq!(report.counts, rec.counts);
    assert_trees_equal(&src, &dest);
    // Pulling into a non-empty directory is refused; the directory is left as it was.
    let err = images.pull(&image, &dest).await.unwrap_err();
    assert!(err.to_string().contains("not empty"), "{err}");
    assert_trees_equal(&src, &dest);

    // A second image of the same content stores no new chunk; inspect sees what they share.
    let again = images
        .build(&src, &name("sample/dir:v2"), &BuildConfig::default())
        .await
        .unwrap();
    assert_eq!(again.new_chunks, 0);
    let listed: Vec<String> = images
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.image)
        .collect();
    assert_eq!(listed, ["sample/dir:v1", "sample/dir:v2"]);
    let inspected = images.inspect(&image).await.unwrap();
    assert_eq!(inspected.shared_chunks, rec.counts.chunks);
    assert_eq!(inspected.other_images, 1);
}

#[tokio::test]
async fn tarballs_plain_gzip_and_zstd_build_the_same_image() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    sample_dir(&src);
    // Whiteouts in a single layer hide nothing of that layer and never appear in the image.
    let raw = tar_with_markers(&src, "lib/libhuge.so", "share");
    let images = local_images(&work.path().join("store"));
    let mut trees = Vec::new();
    for (i, (ext, bytes)) in [
        ("tar", raw.clone()),
        ("tar.gz", gzip(&raw)),
        ("tar.zst", zstd(&raw)),
    ]
    .into_iter()
    .enumerate()
    {
        // Compression is told from the bytes, not the name.
        let file = work.path().join(format!("layer{i}.bin"));
        std::fs::write(&file, bytes).unwrap();
        let image = name(&format!("sample/tar:{}", ext.replace('.', "-")));
        let rec = images
            .build(&file, &image, &BuildConfig::default())
            .await
            .unwrap();
        assert!(rec.source.starts_with("tar:"), "{}", rec.source);
        let (_, tree) = images.open(&image).await.unwrap();
        let dest = work.path().join(format!("pulled-{i}"));
        pull_tree(&tree, images.chunks(), &dest).await.unwrap();
        assert_trees_equal(&src, &dest);
        trees.push(tree);
    }
    assert_eq!(trees[0], trees[1]);
    assert_eq!(trees[0], trees[2]);
}

#[tokio::test]
async fn layers_apply_in_order_with_whiteouts_and_opaque_directories() {
    let work = tempfile::tempdir().unwrap();
    let (f, d) = (file_entry, dir_entry);
    let layers = [
        tar(&[
            d("etc/"),
            f("etc/a", b"a0"),
            f("etc/b", b"b0"),
            d("opt/"),
            d("opt/old/"),
            f("opt/old/1", b"1"),
            d("opt/old/sub/"),
            f("opt/old/sub/2", b"2"),
            d("tmp/"),
            f("tmp/f", b"f"),
            tar_entry(b"lib", SYMLINK, 0o777, b"usr/lib", b"", None),
        ]),
        tar(&[
            f("etc/.wh.a", b""),
            f("opt/old/3", b"3"),
            f("opt/old/.wh..wh..opq", b""),
            f("tmp", b"now a file"),
            f("new", b"new"),
            tar_entry(b"etc/b2", HARDLINK, 0o644, b"etc/b", b"", None),
            // A directory replaces the symlink: nothing is written through it.
            d("lib/"),
            f("lib/x", b"x"),
        ]),
        tar(&[
            f(".wh.new", b""),
            f("etc/b", b"b2"),
            f("etc/.wh.ghost", b""),
        ]),
    ];
    let mut paths = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let p = work.path().join(format!("l{i}.tar.gz"));
        std::fs::write(&p, gzip(l)).unwrap();
        paths.push(Layer { path: p });
    }
    let images = local_images(&work.path().join("store"));
    let tree = tree_from_layers(
        paths,
        images.chunks(),
        1 << 20,
        LayerLimits::default(),
        false,
    )
    .await
    .unwrap();
    let dest = work.path().join("out");
    pull_tree(&tree, images.chunks(), &dest).await.unwrap();

    let want = work.path().join("want");
    for (p, data) in [
        ("etc/b", &b"b2"[..]),
        ("etc/b2", b"b0"),
        ("opt/old/3", b"3"),
        ("tmp", b"now a file"),
        ("lib/x", b"x"),
    ] {
        std::fs::create_dir_all(want.join(p).parent().unwrap()).unwrap();
        std::fs::write(want.join(p), data).unwrap();
    }
    for p in ["etc", "opt", "opt/old", "lib"] {
        std::fs::set_permissions(
            want.join(p),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
    }
    for p in ["etc/b", "etc/b2", "opt/old/3", "tmp", "lib/x"] {
        std::fs::set_permissions(
            want.join(p),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
    }
    assert_trees_equal_but_mtimes(&want, &dest);
}

#[tokio::test]
async fn one_layer_keeps_its_whiteouts_and_opaque_markers_for_overlayfs() {
    use hotstart_store::EntryKind;
    let work = tempfile::tempdir().unwrap();
    let f = file_entry;
    let layer = tar(&[
        f("etc/.wh.gone", b""),
        f("opt/old/.wh..wh..opq", b""),
        f("opt/old/3", b"3"),
        f(".wh.top", b""),
    ]);
    let p = work.path().join("l.tar");
    std::fs::write(&p, layer).unwrap();
    let images = local_images(&work.path().join("store"));
    let build = |n: usize, keep: bool| {
        let layers = vec![Layer { path: p.clone() }; n];
        tree_from_layers(
            layers,
            images.chunks(),
            1 << 20,
            LayerLimits::default(),
            keep,
        )
    };
    let tree = build(1, true).await.unwrap();
    let kinds: Vec<(&str, &EntryKind)> = tree
        .entries
        .iter()
        .map(|e| (e.path.as_str(), &e.kind))
        .collect();
    assert!(
        kinds.contains(&("etc/gone", &EntryKind::Whiteout)),
        "{kinds:?}"
    );
    assert!(kinds.contains(&("top", &EntryKind::Whiteout)), "{kinds:?}");
    let old = tree.entries.iter().find(|e| e.path == "opt/old").unwrap();
    assert_eq!(
        old.xattrs.get("trusted.overlay.opaque").map(Vec::as_slice),
        Some(&b"y"[..])
    );
    assert!(tree.entries.iter().any(|e| e.path == "opt/old/3"));
    // Applied (the default), a lone layer's markers leave nothing behind.
    let applied = build(1, false).await.unwrap();
    assert!(
        applied
            .entries
            .iter()
            .all(|e| e.kind != EntryKind::Whiteout && e.xattrs.is_empty())
    );
    // Kept markers only make sense for one layer.
    let e = build(2, true).await.unwrap_err();
    assert!(e.to_string().contains("one layer"), "{e}");
}

/// Builds `archive` and expects it refused, naming `entry`; no image may be left.
async fn refused(archive: Vec<u8>, entry: &str, reason: &str, limits: LayerLimits) {
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("hostile.tar");
    std::fs::write(&file, archive).unwrap();
    let images: Images = local_images(&work.path().join("store"));
    let cfg = BuildConfig {
        limits,
        ..BuildConfig::default()
    };
    let err = images
        .build(&file, &name("hostile"), &cfg)
        .await
        .unwrap_err();
    match &err {
        Error::Hostile {
            entry: e,
            reason: r,
            ..
        } => {
            assert_eq!(e, entry, "{err}");
            assert!(r.contains(reason), "{err}");
        }
        other => panic!("expected a refusal of {entry:?}, got {other}"),
    }
    assert!(images.list().await.unwrap().is_empty());
    assert!(images.open(&name("hostile")).await.is_err());
}

#[tokio::test]
async fn hostile_tarballs_are_refused_naming_the_entry() {
    let f = |n: &[u8], data: &[u8]| tar_entry(n, REGULAR, 0o644, b"", data, None);
    let ok = f(b"fine", b"fine");
    let limits = LayerLimits::default();
    refused(
        tar(&[ok.clone(), f(b"../escape", b"x")]),
        "../escape",
        "escapes",
        limits,
    )
    .await;
    refused(
        tar(&[f(b"a/../../escape", b"x")]),
        "a/../../escape",
        "escapes",
        limits,
    )
    .await;
    refused(
        tar(&[f(b"/etc/cron.d/x", b"x")]),
        "/etc/cron.d/x",
        "absolute",
        limits,
    )
    .await;
    refused(
        tar(&[f(b"a//b", b"x")]),
        "a//b",
        "empty path component",
        limits,
    )
    .await;
    refused(
        tar(&[tar_entry(
            b"h",
            HARDLINK,
            0o644,
            b"../../etc/shadow",
            b"",
            None,
        )]),
        "h",
        "escapes",
        limits,
    )
    .await;
    refused(
        tar(&[tar_entry(b"h", HARDLINK, 0o644, b"nothing", b"", None)]),
        "h",
        "not a file in the image",
        limits,
    )
    .await;
    refused(
        tar(&[
            ok.clone(),
            tar_entry(b"d", HARDLINK, 0o644, b"./", b"", None),
        ]),
        "d",
        "root",
        limits,
    )
    .await;
}

#[tokio::test]
async fn a_file_written_through_a_symlink_is_refused_and_nothing_lands_outside() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().to_str().unwrap().as_bytes().to_vec();
    for (link, through) in [
        (
            tar_entry(b"lib", SYMLINK, 0o777, &target, b"", None),
            &b"lib/passwd"[..],
        ),
        (
            tar_entry(b"up", SYMLINK, 0o777, b"..", b"", None),
            b"up/escape",
        ),
        (
            tar_entry(b"d/l", SYMLINK, 0o777, b"/etc", b"", None),
            b"d/l/x/y",
        ),
    ] {
        let file = tar_entry(through, REGULAR, 0o644, b"", b"owned", None);
        let entry = std::str::from_utf8(through).unwrap();
        refused(tar(&[link, file]), entry, "symlink", LayerLimits::default()).await;
    }
    // A hard link through a symlink too.
    let archive = tar(&[
        tar_entry(b"f", REGULAR, 0o644, b"", b"x", None),
        tar_entry(b"lib", SYMLINK, 0o777, &target, b"", None),
        tar_entry(b"lib/h", HARDLINK, 0o644, b"f", b"", None),
    ]);
    refused(archive, "lib/h", "symlink", LayerLimits::default()).await;
    assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
}

#[tokio::test]
async fn absurd_sizes_and_truncated_archives_are_refused() {
    let small = LayerLimits {
        max_file_size: 1 << 20,
        ..LayerLimits::default()
    };
    // 8 GiB claimed, 10 bytes present: the archive ends inside the entry.
    let lie = tar_entry(
        b"big",
        REGULAR,
        0o644,
        b"",
        b"0123456789",
        Some(b"77777777777\0"),
    );
    refused(lie.clone(), "big", "archive ends", LayerLimits::default()).await;
    // Above the limit: refused before any of it is read.
    refused(tar(&[lie]), "big", "limit", small).await;
    // GNU base-256 size field claiming ~2^88 bytes.
    let mut huge = vec![0x80u8];
    huge.extend([0xff; 11]);
    let e = tar_entry(b"huge", REGULAR, 0o644, b"", b"", Some(&huge));
    let work = tempfile::tempdir().unwrap();
    let file = work.path().join("huge.tar");
    std::fs::write(&file, tar(&[e])).unwrap();
    let images = local_images(&work.path().join("store"));
    assert!(
        images
            .build(&file, &name("huge"), &BuildConfig::default())
            .await
            .is_err()
    );
    assert!(images.list().await.unwrap().is_empty());
    // A tarball cut inside a file's data.
    let mut cut = tar(&[tar_entry(b"f", REGULAR, 0o644, b"", &[7u8; 5000], None)]);
    cut.truncate(512 + 1000);
    refused(cut, "f", "archive ends", LayerLimits::default()).await;
    // Not a tarball at all.
    std::fs::write(
        &file,
        b"this is not a tar archive, just some text that is long enough".repeat(20),
    )
    .unwrap();
    let err = images
        .build(&file, &name("text"), &BuildConfig::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Source { .. }), "{err}");
}
