//! One conformance suite for every configuration of checkpoint tiers: the same saves, loads
//! and questions through the public `Engine` API against a disk tier, a store that is a local
//! directory, an S3 store (SeaweedFS), a disk tier in front of an S3 store, and a sidecar
//! (memory, disk and store). Every configuration must give the same answers and the same
//! bytes; a new configuration joins by adding one line to `every_configuration`.

#[path = "../../ckpt/tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;

use common::*;
use hotstart_ckpt::{Destination, Engine, EngineConfig, Error, StepSel};
use hotstart_sidecar::{Settings, Token};
use hotstart_store::Store;
use support::Running;

/// What every configuration must do; `exact_retention`: the engine applies retention itself
/// (with a sidecar, its memory keeps what its budget holds, so older steps may stay listed).
fn conform(what: &str, engine: &Engine, exact_retention: bool) {
    // Nothing saved: no step, and a load says so with its error kind.
    assert_eq!(engine.latest_complete_step().unwrap(), None, "{what}");
    assert!(
        matches!(
            engine.load(StepSel::Latest, Destination::Owned),
            Err(Error::NotFound { .. })
        ),
        "{what}: a load with nothing saved"
    );

    let sets: Vec<_> = (1..=3).map(|s| sample_tensors(s * 10, 600 << 10)).collect();
    for (i, set) in sets.iter().enumerate() {
        let step = i as u64 + 1;
        let h = engine.save(step, to_tensors(set), extras(step)).unwrap();
        h.wait()
            .unwrap_or_else(|e| panic!("{what}: save {step}: {e}"));
    }
    assert_eq!(engine.latest_complete_step().unwrap(), Some(3), "{what}");
    assert_eq!(
        engine.latest_complete_step_below(3).unwrap(),
        Some(2),
        "{what}"
    );
    let latest = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(latest.step, 3, "{what}");
    assert_loaded(&latest, &sets[2], &extras(3));
    let two = engine.load(StepSel::Step(2), Destination::Owned).unwrap();
    assert_loaded(&two, &sets[1], &extras(2));
    load_into_buffers(engine, StepSel::Step(3), &sets[2]);

    // keep = 2: steps 2 and 3 stay.
    let steps = engine.steps().unwrap();
    if exact_retention {
        assert_eq!(steps, [2, 3], "{what}");
    } else {
        assert!(steps.ends_with(&[2, 3]), "{what}: {steps:?}");
    }

    // A step saved again replaces its earlier copy everywhere.
    let again = sample_tensors(99, 600 << 10);
    engine
        .save(3, to_tensors(&again), extras(99))
        .unwrap()
        .wait()
        .unwrap_or_else(|e| panic!("{what}: save 3 again: {e}"));
    let l = engine.load(StepSel::Step(3), Destination::Owned).unwrap();
    assert_loaded(&l, &again, &extras(99));

    // A step nobody saved.
    assert!(
        matches!(
            engine.load(StepSel::Step(7), Destination::Owned),
            Err(Error::NotFound { step: Some(7), .. })
        ),
        "{what}: a load of a step never saved"
    );
}

fn cfg(job: &str) -> EngineConfig {
    let mut c = config(job);
    c.keep = 2;
    c
}

fn local_store(dir: &Path) -> Store {
    Store::open(dir.to_str().unwrap()).expect("a local directory is a store")
}

#[test]
fn every_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();

    conform("disk", &engine(cfg("c").disk(d.join("disk"))), true);
    conform(
        "local-directory store",
        &engine(cfg("c").store(local_store(&d.join("store")))),
        true,
    );
    match s3_store("conformance") {
        Some(s3) => conform("S3 store", &engine(cfg("c").store(s3)), true),
        None => eprintln!("skipping the S3 configurations: no SeaweedFS (see the testkit)"),
    }
    if let Some(s3) = s3_store("conformance-tiered") {
        let tiered = engine(cfg("c").disk(d.join("tiered-disk")).store(s3));
        conform("disk in front of an S3 store", &tiered, true);
    }

    let socket = d.join("s.sock");
    let settings = Settings {
        node_id: Some("solo".into()),
        listen: Some("127.0.0.1:0".into()),
        http: Some("127.0.0.1:0".into()),
        socket: Some(socket.clone()),
        memory_budget: Some("256MiB".parse().unwrap()),
        token: Some(Token::new("t0ken").unwrap()),
        disk_dir: Some(d.join("sidecar-disk")),
        store: Some(d.join("sidecar-store").display().to_string()),
        keep: Some(2),
        ..Settings::default()
    };
    let sidecar = Running::start(settings.resolve().unwrap());
    conform("sidecar", &engine(cfg("c").sidecar(&socket)), false);
    sidecar.stop();
}
