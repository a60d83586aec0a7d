//! Random tensor sets (every dtype, shapes with empty and zero-size dimensions, 0 B to a few MiB)
//! round-trip bit-exact through each tier.

mod common;

use common::*;
use hotstart_ckpt::{Destination, Dtype, StepSel};
use hotstart_store::Store;
use proptest::prelude::*;

type Set = Vec<(String, Dtype, Vec<u64>, Vec<u8>)>;

fn tensor_set() -> impl Strategy<Value = Set> {
    let one = (
        proptest::sample::select(Dtype::ALL.to_vec()),
        proptest::collection::vec(prop_oneof![Just(0u64), 1u64..5, 1u64..600], 0..4),
        any::<u64>(),
    );
    proptest::collection::vec(one, 0..8).prop_map(|ts| {
        ts.into_iter()
            .enumerate()
            .map(|(i, (d, shape, seed))| {
                let n = hotstart_ckpt::tensor::byte_len(d, &shape).unwrap() as usize;
                (format!("t{i}.\"quoted\\name ✓"), d, shape, pattern(n, seed))
            })
            .collect()
    })
}

fn roundtrip(cfg: hotstart_ckpt::EngineConfig, set: &Set, extra: &hotstart_ckpt::Extras) {
    let engine = engine(cfg);
    engine
        .save(1, to_tensors(set), extra.clone())
        .unwrap()
        .wait()
        .unwrap();
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, set, extra);

    // Every other tensor into a caller buffer (filled from the chunks that cover it, across
    // chunk boundaries); the rest come back owned.
    let mut outs: Vec<Vec<u8>> = set.iter().map(|t| vec![0xA5; t.3.len()]).collect();
    let bufs = set
        .iter()
        .zip(&mut outs)
        .step_by(2)
        .map(|(t, out)| (t.0.clone(), &mut out[..]))
        .collect();
    let l = engine
        .load(StepSel::Latest, Destination::Buffers(bufs))
        .unwrap();
    let rest: Vec<(&str, &[u8])> = l
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), &t.data[..]))
        .collect();
    let want_rest: Vec<(&str, &[u8])> = set
        .iter()
        .skip(1)
        .step_by(2)
        .map(|t| (t.0.as_str(), &t.3[..]))
        .collect();
    assert_eq!(rest, want_rest);
    for (t, out) in set.iter().zip(&outs).step_by(2) {
        assert!(out == &t.3, "{} loaded into its buffer", t.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_sets_round_trip(set in tensor_set(), big in prop_oneof![Just(0usize), 1usize..(3 << 20)], chunk in prop_oneof![Just(4096usize), Just(64 << 10), Just(1 << 20)], extra in proptest::collection::btree_map("[a-z]{1,8}", proptest::collection::vec(any::<u8>(), 0..64), 0..4)) {
        let mut set = set;
        set.push(("big".into(), Dtype::U8, vec![big as u64], pattern(big, big as u64)));
        let mut cfg = config("p");
        cfg.chunk_size = chunk;
        let dir = tempfile::tempdir().unwrap();
        roundtrip(cfg.clone().disk(dir.path()), &set, &extra);
        roundtrip(cfg.clone().store(Store::open("memory://").unwrap()), &set, &extra);
        let sdir = tempfile::tempdir().unwrap();
        roundtrip(cfg.store(Store::open(sdir.path().to_str().unwrap()).unwrap()), &set, &extra);
    }
}
