//! A container image layer as `hotstart image build` and the snapshotter ingest it: a tar
//! stream, plain, gzip or zstd, applied to a tree with whiteouts applied or kept. Hostile names,
//! links and sizes are refused; a tree that builds encodes and decodes the same.
#![no_main]

use std::sync::OnceLock;

use hotstart_fuzz::{scratch, set_bound, split};
use hotstart_image::build::layers::tree_from_layers;
use hotstart_image::build::{Layer, LayerLimits};
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store, Tree};
use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

fuzz_target!(init: set_bound(64 << 20), |data: &[u8]| {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(|| scratch("layer").join("layer.tar"));
    let (flags, tar) = split(data);
    std::fs::write(path, tar).expect("write the layer");
    let store = Store::open("memory://").expect("a memory store");
    let chunks = ChunkStore::new(store, ChunkStoreConfig::default()).expect("a chunk store");
    let limits = LayerLimits {
        max_file_size: 1 << 20,
        max_entries: 4096,
    };
    let keep_whiteouts = flags & 1 == 1;
    let layers = vec![Layer { path: path.clone() }];
    let built = runtime().block_on(tree_from_layers(layers, &chunks, 4096, limits, keep_whiteouts));
    if let Ok(tree) = built {
        let again = Tree::decode(&tree.encode().expect("a tree encodes")).expect("decodes");
        assert_eq!(again, tree);
    }
});
