//! Trees that try to escape their root are refused and write nothing outside it.

use bytes::Bytes;
use hotstart_store::tree::ChunkRef;
use hotstart_store::{ChunkStore, ChunkStoreConfig, Entry, EntryKind, Error, Store, Tree};

fn entry(path: &str, kind: EntryKind) -> Entry {
    Entry {
        path: path.into(),
        kind,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime_ns: 0,
        xattrs: Default::default(),
    }
}

async fn file_kind(chunks: &ChunkStore, data: &'static [u8]) -> EntryKind {
    let id = chunks.put(Bytes::from_static(data)).await.unwrap();
    EntryKind::File {
        size: data.len() as u64,
        chunks: vec![ChunkRef {
            id,
            len: data.len() as u32,
        }],
    }
}

#[tokio::test]
async fn writing_through_a_symlink_is_refused() {
    let chunks = ChunkStore::new(
        Store::open("memory://").unwrap(),
        ChunkStoreConfig::default(),
    )
    .unwrap();
    let outside = tempfile::tempdir().unwrap();
    let dest = tempfile::tempdir().unwrap();
    let tree = Tree {
        entries: vec![
            entry(
                "lib",
                EntryKind::Symlink {
                    target: outside.path().display().to_string(),
                },
            ),
            entry("lib/passwd", file_kind(&chunks, b"owned").await),
        ],
    };
    let err = tree.materialize(dest.path(), &chunks).await.unwrap_err();
    match &err {
        Error::UnsafePath { entry, reason } => {
            assert_eq!(entry, "lib/passwd");
            assert!(reason.contains("symlink"), "{reason}");
        }
        other => panic!("expected UnsafePath, got {other}"),
    }
    assert_eq!(
        std::fs::read_dir(outside.path()).unwrap().count(),
        0,
        "nothing written outside"
    );
}

#[tokio::test]
async fn escaping_paths_and_bad_links_are_refused_before_writing() {
    let chunks = ChunkStore::new(
        Store::open("memory://").unwrap(),
        ChunkStoreConfig::default(),
    )
    .unwrap();
    let file = file_kind(&chunks, b"x").await;
    let cases = vec![
        vec![entry("../escape", file.clone())],
        vec![entry("/etc/passwd", file.clone())],
        vec![entry("a/../../escape", file.clone())],
        vec![
            entry("ok", file.clone()),
            entry(
                "link",
                EntryKind::Hardlink {
                    target: "missing".into(),
                },
            ),
        ],
        vec![entry("b", file.clone()), entry("a", file.clone())], // out of order
    ];
    for entries in cases {
        let dest = tempfile::tempdir().unwrap();
        let tree = Tree {
            entries: entries.clone(),
        };
        let err = tree.materialize(dest.path(), &chunks).await.unwrap_err();
        assert!(
            matches!(err, Error::UnsafePath { .. }),
            "{entries:?}: {err}"
        );
        assert_eq!(
            std::fs::read_dir(dest.path()).unwrap().count(),
            0,
            "{entries:?}"
        );
        // The same tree is refused at decode time too.
        assert!(Tree::decode(&tree.encode().unwrap()).is_err());
    }
}

#[tokio::test]
async fn a_corrupt_chunk_fails_the_materialisation() {
    let store = Store::open("memory://").unwrap();
    let chunks = ChunkStore::new(store.clone(), ChunkStoreConfig::default()).unwrap();
    let kind = file_kind(&chunks, b"the real content").await;
    let EntryKind::File { chunks: refs, .. } = &kind else {
        unreachable!()
    };
    let other = zstd::bulk::compress(b"forged content!!", 3).unwrap();
    store
        .put(&refs[0].id.key(), Bytes::from(other))
        .await
        .unwrap();
    let tree = Tree {
        entries: vec![entry("f", kind.clone())],
    };
    let dest = tempfile::tempdir().unwrap();
    let err = tree.materialize(dest.path(), &chunks).await.unwrap_err();
    assert!(err.is_corrupt(), "{err}");
}
