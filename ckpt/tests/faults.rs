//! Damaged tiers and failing stores: corrupt bytes are never returned, failed persists never
//! look complete, and the engine recovers when the store does.

mod common;

use std::sync::Arc;

use common::*;
use hotstart_ckpt::{Destination, Error, Phase, StepSel, TierKind};
use hotstart_store::Store;
use hotstart_store::wrap::{Faults, Interceptor, Op, Throttle, ThrottleConfig};

fn flip_byte(path: &std::path::Path, at: u64) {
    let mut b = std::fs::read(path).unwrap();
    b[at as usize] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

#[test]
fn flipped_byte_on_disk_is_served_from_store() {
    let disk = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path().to_str().unwrap()).unwrap();
    let engine = engine(config("j").disk(disk.path()).store(store));
    let set = sample_tensors(5, 1 << 20);
    engine
        .save(7, to_tensors(&set), extras(5))
        .unwrap()
        .wait()
        .unwrap();

    // A byte in the third chunk (chunk size 256 KiB) of the disk copy.
    let disk_file = disk.path().join("j/step-7/rank-0.safetensors");
    flip_byte(&disk_file, 2 * (256 << 10) + 17);
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(5));
    assert_eq!(l.chunk_sources[2], TierKind::Store);
    assert_eq!(l.chunk_sources[0], TierKind::Disk);
    assert!(
        l.chunk_sources
            .iter()
            .filter(|k| **k == TierKind::Store)
            .count()
            == 1
    );
    // The same into caller buffers: the damaged chunk is read again from the store and
    // rewrites what the bad copy had already put into them.
    let l = load_into_buffers(&engine, StepSel::Latest, &set);
    assert_eq!(l.chunk_sources[2], TierKind::Store);

    // Damage the same chunk in the store too: no good copy anywhere.
    let store_file = store_dir.path().join("j/step-7/rank-0.safetensors");
    flip_byte(&store_file, 2 * (256 << 10) + 99);
    match engine.load(StepSel::Latest, Destination::Owned) {
        Err(Error::Corrupt {
            step, rank, chunk, ..
        }) => {
            assert_eq!((step, rank, chunk), (7, 0, 2));
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let msg = engine
        .load(StepSel::Step(7), Destination::Owned)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("step 7") && msg.contains("rank 0") && msg.contains("chunk 2"),
        "{msg}"
    );
}

#[test]
fn missing_disk_file_falls_back_to_store() {
    let disk = tempfile::tempdir().unwrap();
    let engine = engine(
        config("j")
            .disk(disk.path())
            .store(Store::open("memory://").unwrap()),
    );
    let set = sample_tensors(6, 600 << 10);
    engine
        .save(3, to_tensors(&set), extras(6))
        .unwrap()
        .wait()
        .unwrap();
    std::fs::remove_file(disk.path().join("j/step-3/rank-0.safetensors")).unwrap();
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(6));
    assert!(l.chunk_sources.iter().all(|k| *k == TierKind::Store));
}

#[test]
fn corrupt_store_gets_are_detected() {
    let faults = Arc::new(Faults::default());
    let store = Store::open("memory://")
        .unwrap()
        .wrap(|inner| faults.clone().wrap(inner));
    let engine = engine(config("j").store(store));
    let set = sample_tensors(7, 300 << 10);
    engine
        .save(1, to_tensors(&set), extras(7))
        .unwrap()
        .wait()
        .unwrap();
    faults.corrupt_gets();
    let e = engine
        .load(StepSel::Step(1), Destination::Owned)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Corrupt { .. } | Error::Format { .. } | Error::NotFound { .. }
        ),
        "{e:?}"
    );
    faults.heal();
    assert_loaded(
        &engine.load(StepSel::Step(1), Destination::Owned).unwrap(),
        &set,
        &extras(7),
    );
}

fn failing_store_case(op: Op, big: usize) {
    let faults = Arc::new(Faults::default());
    let store = Store::open("memory://")
        .unwrap()
        .wrap(|inner| faults.clone().wrap(inner));
    let disk = tempfile::tempdir().unwrap();
    let engine = engine(config("j").disk(disk.path()).store(store));
    let set1 = sample_tensors(1, big);
    engine
        .save(1, to_tensors(&set1), extras(1))
        .unwrap()
        .wait()
        .unwrap();

    faults.fail_from(op, 1);
    let set2 = sample_tensors(2, big);
    let h = engine.save(2, to_tensors(&set2), extras(2)).unwrap();
    h.wait_staged().unwrap();
    h.wait_persisted(TierKind::Disk).unwrap();
    let e = h.wait_persisted(TierKind::Store).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Persist {
                tier: TierKind::Store,
                step: 2,
                ..
            }
        ),
        "{e:?}"
    );
    assert!(h.wait().is_err());
    assert!(matches!(h.status().store, Phase::Failed(_)));
    faults.heal();
    assert_eq!(engine.complete_steps(TierKind::Store).unwrap(), vec![1]);
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![1, 2]);

    // Recovered: the next save reaches both tiers.
    let set3 = sample_tensors(3, big);
    engine
        .save(3, to_tensors(&set3), extras(3))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(engine.complete_steps(TierKind::Store).unwrap(), vec![1, 3]);
    // The store alone serves step 3 bit-exact.
    std::fs::remove_dir_all(disk.path().join("j/step-3")).unwrap();
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 3);
    assert_loaded(&l, &set3, &extras(3));
}

#[test]
fn failing_part_uploads_are_reported() {
    // Bigger than one 5 MiB stripe: a multipart upload.
    failing_store_case(Op::PutPart, 6 << 20);
}

#[test]
fn failing_puts_are_reported() {
    // Smaller than a stripe: one PUT for the file (and the manifest).
    failing_store_case(Op::Put, 100 << 10);
}

#[test]
fn transient_failure_is_retried() {
    let faults = Arc::new(Faults::default());
    let store = Store::open("memory://")
        .unwrap()
        .wrap(|inner| faults.clone().wrap(inner));
    let engine = engine(config("j").store(store));
    faults.fail_nth(Op::Put, 1);
    let set = sample_tensors(4, 1000);
    engine
        .save(1, to_tensors(&set), extras(4))
        .unwrap()
        .wait()
        .unwrap();
    assert_loaded(
        &engine.load(StepSel::Latest, Destination::Owned).unwrap(),
        &set,
        &extras(4),
    );
}

/// A remote store that answers every request with 503: its client retries each request for a
/// bounded time and the engine does not retry that again, so one listing costs at most
/// `1 + REMOTE_RETRIES` requests (not that many again per engine retry) and ends in
/// `Unavailable` naming the store tier.
#[test]
fn a_store_outage_is_retried_once_by_its_client_then_reported() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            if head.starts_with(b"GET ") {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            let _ = conn.write_all(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            );
        }
    });
    let option = |k: &str, v: &str| (k.to_string(), v.to_string());
    let store = Store::open_with(
        "s3://down/runs",
        &[
            option("aws_endpoint", &endpoint),
            option("aws_allow_http", "true"),
            option("aws_region", "us-east-1"),
            option("aws_access_key_id", "k"),
            option("aws_secret_access_key", "s"),
        ],
    )
    .unwrap();
    let engine = engine(config("j").store(store));
    match engine.steps() {
        Err(Error::Unavailable { tier, .. }) => assert_eq!(tier, TierKind::Store),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // The client stops at REMOTE_RETRIES, or earlier once REMOTE_RETRY_FOR has passed; an
    // engine that retried the listing too would have sent up to three times as many.
    let sent = requests.load(Ordering::SeqCst);
    assert!(
        (2..=1 + hotstart_store::REMOTE_RETRIES).contains(&sent),
        "{sent} listing requests"
    );
}

#[test]
fn damaged_manifests_are_not_complete() {
    let disk = tempfile::tempdir().unwrap();
    let engine = engine(config("j").disk(disk.path()));
    let set = sample_tensors(8, 1000);
    engine
        .save(1, to_tensors(&set), extras(8))
        .unwrap()
        .wait()
        .unwrap();
    engine
        .save(2, to_tensors(&set), extras(8))
        .unwrap()
        .wait()
        .unwrap();
    let m2 = disk.path().join("j/step-2/rank-0.manifest.json");
    let good = std::fs::read(&m2).unwrap();
    for bad in [&good[..good.len() / 2], b"", b"{}", b"garbage\x00\xff"] {
        std::fs::write(&m2, bad).unwrap();
        assert_eq!(engine.latest_complete_step().unwrap(), Some(1));
        assert_eq!(
            engine
                .load(StepSel::Latest, Destination::Owned)
                .unwrap()
                .step,
            1
        );
        assert!(engine.load(StepSel::Step(2), Destination::Owned).is_err());
    }
    // A manifest of another step copied over is refused too.
    let m1 = std::fs::read(disk.path().join("j/step-1/rank-0.manifest.json")).unwrap();
    std::fs::write(&m2, m1).unwrap();
    assert_eq!(engine.latest_complete_step().unwrap(), Some(1));
}

#[test]
fn skip_policy_counts_skips() {
    let mut cfg = config("j").store(Store::open("memory://").unwrap());
    cfg.max_inflight = 1;
    cfg.when_full = hotstart_ckpt::WhenFull::Skip;
    let throttle = Arc::new(Throttle::new(ThrottleConfig {
        latency: std::time::Duration::from_millis(300),
        ..Default::default()
    }));
    let throttled = Store::open("memory://")
        .unwrap()
        .wrap(|inner| throttle.clone().wrap(inner));
    cfg.store = Some(throttled);
    let engine = engine(cfg);
    let set = sample_tensors(1, 8 << 20);
    let h1 = engine.save(1, to_tensors(&set), extras(1)).unwrap();
    let h2 = engine.save(2, to_tensors(&set), extras(1)).unwrap();
    // The first save holds the only staging buffer until it has persisted.
    assert!(matches!(
        h2.wait_staged(),
        Err(Error::Skipped { step: 2, .. })
    ));
    assert_eq!(engine.skipped(), 1);
    h1.wait().unwrap();
    engine.wait_idle(); // the slot is handed back just after the last tier reports
    engine
        .save(3, to_tensors(&set), extras(1))
        .unwrap()
        .wait()
        .unwrap();
}
