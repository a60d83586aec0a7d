//! Property tests: striped reads equal a plain GET for random objects, ranges, stripe sizes and
//! budgets; a random directory tree survives build → encode → decode → materialise exactly.

mod common;

use std::os::unix::fs::PermissionsExt;

use bytes::Bytes;
use futures::TryStreamExt;
use hotstart_store::{
    ByteBudget, ChunkStore, ChunkStoreConfig, Store, StripeConfig, StripedReader, Tree,
};
use proptest::prelude::*;

use common::{assert_trees_equal, pattern};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn striped_reads_equal_a_plain_get(
        size in 0usize..300_000,
        seed in any::<u64>(),
        stripe in 1usize..70_000,
        in_flight in 1usize..10,
        budget in 1usize..200_000,
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let rt = runtime();
        rt.block_on(async {
            let store = Store::open("memory://").unwrap();
            let data = pattern(size, seed);
            store.put("obj", data.clone()).await.unwrap();
            let whole = store.get("obj").await.unwrap();
            let (mut lo, mut hi) = (a.index(size + 1), b.index(size + 1));
            if lo > hi { std::mem::swap(&mut lo, &mut hi); }
            let budget = ByteBudget::new(budget);
            let cfg = StripeConfig { stripe_size: stripe, max_in_flight: in_flight, budget: budget.clone() };
            let r = StripedReader::open(&store, "obj", cfg).await.unwrap();

            let streamed: Vec<Bytes> = r.stream(lo as u64..hi as u64).try_collect().await.unwrap();
            prop_assert_eq!(&streamed.concat()[..], &whole[lo..hi]);
            let at = r.read_at(lo as u64, hi - lo).await.unwrap();
            prop_assert_eq!(&at[..], &whole[lo..hi]);
            prop_assert!(budget.peak() <= budget.capacity());
            prop_assert_eq!(budget.in_use(), 0);
            Ok(())
        })?;
    }
}

/// A random file tree: (relative path, content seed, size, mode), plus symlinks.
#[derive(Debug, Clone)]
struct Spec {
    files: Vec<(Vec<String>, u64, usize, u32)>,
    links: Vec<(Vec<String>, String)>,
}

fn name() -> impl Strategy<Value = String> {
    "[a-c]{1,2}"
}

fn spec() -> impl Strategy<Value = Spec> {
    let file = (
        prop::collection::vec(name(), 1..4),
        any::<u64>(),
        0usize..40_000,
        prop::sample::select(vec![0o644u32, 0o600, 0o755, 0o444]),
    );
    let link = (prop::collection::vec(name(), 1..3), "[a-z./]{1,12}");
    (
        prop::collection::vec(file, 0..12),
        prop::collection::vec(link, 0..3),
    )
        .prop_map(|(files, links)| Spec { files, links })
}

/// Creates what it can of `spec` under `root` (a path that is already a file cannot also be a
/// directory; such entries are skipped, as a real tree could not hold both).
fn create(root: &std::path::Path, spec: &Spec) {
    for (parts, seed, size, mode) in &spec.files {
        let p = root.join(parts.join("/"));
        if std::fs::create_dir_all(p.parent().unwrap()).is_err()
            || p.exists()
            || p.symlink_metadata().is_ok()
        {
            continue;
        }
        std::fs::write(&p, pattern(*size, *seed)).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode)).unwrap();
    }
    for (parts, target) in &spec.links {
        let p = root.join(parts.join("/"));
        if std::fs::create_dir_all(p.parent().unwrap()).is_err() || p.symlink_metadata().is_ok() {
            continue;
        }
        std::os::unix::fs::symlink(target, &p).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn tree_build_materialize_round_trips(spec in spec(), chunk_size in 1usize..20_000) {
        let rt = runtime();
        rt.block_on(async {
            let src = tempfile::tempdir().unwrap();
            create(src.path(), &spec);
            let store = Store::open("memory://").unwrap();
            let chunks = ChunkStore::new(store, ChunkStoreConfig::default()).unwrap();
            let tree = Tree::build(src.path(), &chunks, chunk_size).await.unwrap();
            let tree = Tree::decode(&tree.encode().unwrap()).unwrap();
            let dest = tempfile::tempdir().unwrap();
            tree.materialize(&dest.path().join("out"), &chunks).await.unwrap();
            assert_trees_equal(src.path(), &dest.path().join("out"));
        });
    }
}
