//! Helpers shared by the store's integration tests.
#![allow(dead_code)]

use bytes::Bytes;
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

/// Deterministic incompressible bytes (see `hotstart_testkit::pattern`).
pub fn pattern(len: usize, seed: u64) -> Bytes {
    Bytes::from(hotstart_testkit::pattern(len, seed))
}

/// A store on a fresh bucket of the shared SeaweedFS server, or `None` (with a printed reason)
/// when the server is not available outside CI. In CI a missing server fails the test.
pub fn s3_store(test: &str) -> Option<Store> {
    let weed = SeaweedFs::shared()?;
    let bucket = weed.fresh_bucket(&test.replace('_', "-"));
    Some(
        Store::open_with(&format!("{bucket}/conformance"), &weed.client_options())
            .expect("open SeaweedFS store"),
    )
}

#[allow(unused_imports)]
pub use hotstart_testkit::tree::{assert_trees_equal, sample_dir};
