//! Helpers shared by the checkpoint engine's integration tests.
#![allow(dead_code)]

use std::collections::BTreeMap;

use bytes::Bytes;
use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, Extras, Loaded, StepSel, Tensor};
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

pub use hotstart_testkit::pattern;

/// A store on a fresh bucket of the shared SeaweedFS server, or `None` when it is unavailable
/// outside CI (the testkit prints why).
pub fn s3_store(test: &str) -> Option<Store> {
    let weed = SeaweedFs::shared()?;
    let bucket = weed.fresh_bucket(&test.replace('_', "-"));
    Some(
        Store::open_with(&format!("{bucket}/ckpt"), &weed.client_options())
            .expect("open SeaweedFS store"),
    )
}

/// A tensor set covering every dtype, a scalar, an empty tensor and one bigger than `chunk`.
pub fn sample_tensors(seed: u64, big: usize) -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, d) in Dtype::ALL.into_iter().enumerate() {
        let shape = vec![3, (i as u64 % 4) + 1];
        let n = hotstart_ckpt::tensor::byte_len(d, &shape).unwrap() as usize;
        out.push((
            format!("layer.{i}.{d}"),
            d,
            shape,
            pattern(n, seed + i as u64),
        ));
    }
    out.push(("scalar".into(), Dtype::F32, vec![], pattern(4, seed + 100)));
    out.push(("empty".into(), Dtype::BF16, vec![0, 7], vec![]));
    out.push((
        "big".into(),
        Dtype::U8,
        vec![big as u64],
        pattern(big, seed + 200),
    ));
    out
}

pub fn to_tensors(set: &[(String, Dtype, Vec<u64>, Vec<u8>)]) -> Vec<Tensor> {
    set.iter()
        .map(|(n, d, s, b)| Tensor::new(n.clone(), *d, s.clone(), Bytes::from(b.clone())).unwrap())
        .collect()
}

pub fn extras(seed: u64) -> Extras {
    let mut e = BTreeMap::new();
    e.insert("rng".to_string(), pattern(33, seed));
    e.insert("empty".to_string(), Vec::new());
    e.insert("loader".to_string(), b"epoch=3 batch=17".to_vec());
    e
}

/// Asserts that `loaded` holds exactly `set` (names, dtypes, shapes, bytes) and `extras`.
pub fn assert_loaded(loaded: &Loaded, set: &[(String, Dtype, Vec<u64>, Vec<u8>)], extras: &Extras) {
    assert_eq!(loaded.tensors.len(), set.len(), "tensor count");
    for ((n, d, s, b), t) in set.iter().zip(&loaded.tensors) {
        assert_eq!(&t.name, n);
        assert_eq!(t.dtype, *d, "{n}");
        assert_eq!(&t.shape, s, "{n}");
        assert!(t.data[..] == b[..], "bytes of {n} differ");
    }
    assert_eq!(&loaded.extras, extras);
}

/// An engine config for tests: small chunks so files have several.
pub fn config(job: &str) -> EngineConfig {
    let mut cfg = EngineConfig::new(job, 0, 1);
    cfg.chunk_size = 256 << 10;
    cfg.retry_backoff = std::time::Duration::from_millis(5);
    cfg.store_retries = 2;
    cfg.stripe.stripe_size = 5 << 20;
    cfg
}

pub fn engine(cfg: EngineConfig) -> Engine {
    Engine::new(cfg).expect("engine")
}

/// Loads `which` into a caller buffer for every tensor of `set`, asserts each buffer holds the
/// tensor's bytes and that nothing came back owned; the load's result (its chunk sources).
pub fn load_into_buffers(
    engine: &Engine,
    which: StepSel,
    set: &[(String, Dtype, Vec<u64>, Vec<u8>)],
) -> Loaded {
    let mut outs: Vec<Vec<u8>> = set.iter().map(|t| vec![0u8; t.3.len()]).collect();
    let bufs = set
        .iter()
        .zip(&mut outs)
        .map(|(t, out)| (t.0.clone(), &mut out[..]))
        .collect();
    let l = engine.load(which, Destination::Buffers(bufs)).unwrap();
    assert!(l.tensors.is_empty());
    for (t, out) in set.iter().zip(&outs) {
        assert!(out == &t.3, "bytes of {} differ", t.0);
    }
    l
}
