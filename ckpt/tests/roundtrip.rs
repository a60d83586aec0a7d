//! Round trips through every tier configuration and every store backend: the same tests run on
//! the disk tier alone, on a store alone (memory, local directory, SeaweedFS S3) and on both.

mod common;

use std::path::Path;

use common::*;
use hotstart_ckpt::format::Region;
use hotstart_ckpt::{Destination, Dtype, EngineConfig, Error, StepSel, Tensor, TierKind};
use hotstart_store::Store;

/// Saves two steps, checks status, loads both back bit-exact, checks the files with the
/// `safetensors` crate (when a directory holds them), and checks `latest_complete_step`.
fn conformance(cfg: EngineConfig, files_at: Option<&Path>) {
    let tiers: Vec<TierKind> = [
        (TierKind::Disk, cfg.disk_dir.is_some()),
        (TierKind::Store, cfg.store.is_some()),
    ]
    .into_iter()
    .filter_map(|(k, on)| on.then_some(k))
    .collect();
    let engine = engine(cfg);
    assert_eq!(engine.latest_complete_step().unwrap(), None);
    let set1 = sample_tensors(1, 700 << 10);
    let set2 = sample_tensors(2, 1 << 20);
    let h1 = engine.save(10, to_tensors(&set1), extras(1)).unwrap();
    h1.wait_staged().unwrap();
    for t in &tiers {
        h1.wait_persisted(*t).unwrap();
    }
    let h2 = engine.save(20, to_tensors(&set2), extras(2)).unwrap();
    h2.wait().unwrap();
    let st = h2.status();
    for t in &tiers {
        assert!(matches!(st.tier(*t), hotstart_ckpt::Phase::Done));
        assert_eq!(engine.complete_steps(*t).unwrap(), vec![10, 20]);
    }
    assert_eq!(engine.latest_complete_step().unwrap(), Some(20));
    assert_eq!(engine.latest_complete_step_below(20).unwrap(), Some(10));
    assert_eq!(engine.latest_complete_step_below(10).unwrap(), None);

    let latest = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(latest.step, 20);
    assert_loaded(&latest, &set2, &extras(2));
    assert_eq!(latest.metadata["step"], "20");
    assert_eq!(latest.rank, 0);
    // Not in the file: replicas of a data-parallel job write the same bytes.
    assert!(!latest.metadata.contains_key("rank"));
    assert_eq!(latest.metadata["world_size"], "1");
    let first = engine.load(StepSel::Step(10), Destination::Owned).unwrap();
    assert_loaded(&first, &set1, &extras(1));
    assert!(first.chunk_sources.iter().all(|k| *k == tiers[0]));

    // Into buffers shaped after the manifest of the newest step, decided before anything is
    // read; a plan's error fails the load. The plan is handed the step's local file, to map,
    // where a local tier keeps one.
    let mut shaped: Vec<(String, Vec<u8>)> = Vec::new();
    let mut handed: Option<Vec<u8>> = None;
    let (slot, near) = (&mut shaped, &mut handed);
    let planned = Destination::Planned(Box::new(move |m, file| {
        *near = file.map(|mut f| {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut bytes).unwrap();
            bytes
        });
        *slot = m
            .tensors
            .iter()
            .map(|t| {
                let len = hotstart_ckpt::tensor::byte_len(t.dtype, &t.shape).unwrap() as usize;
                (t.name.clone(), vec![0xA5; len])
            })
            .collect();
        Ok(Destination::Buffers(
            slot.iter_mut()
                .map(|(n, b)| (n.clone(), &mut b[..]))
                .collect(),
        ))
    }));
    let l = engine.load(StepSel::Latest, planned).unwrap();
    assert_eq!(l.step, 20);
    assert!(
        l.tensors.is_empty(),
        "every tensor went to a planned buffer"
    );
    assert_eq!(shaped.len(), set2.len());
    for (name, _, _, bytes) in &set2 {
        let got = &shaped.iter().find(|(n, _)| n == name).unwrap().1;
        assert!(got == bytes, "{name}");
    }
    let refused = Destination::Planned(Box::new(|_, _| {
        Err(hotstart_ckpt::Error::Config {
            reason: "no room for it".into(),
        })
    }));
    let err = engine.load(StepSel::Latest, refused).unwrap_err();
    assert!(err.to_string().contains("no room for it"), "{err}");

    // Into caller buffers.
    let mut big = vec![0u8; set2.last().unwrap().3.len()];
    let mut scalar = vec![0u8; 4];
    let mut bufs = std::collections::HashMap::new();
    bufs.insert("big".to_string(), &mut big[..]);
    bufs.insert("scalar".to_string(), &mut scalar[..]);
    let l = engine
        .load(StepSel::Step(20), Destination::Buffers(bufs))
        .unwrap();
    assert_eq!(l.tensors.len(), set2.len() - 2);
    assert_eq!(big, set2.last().unwrap().3);
    assert_eq!(scalar, set2.iter().find(|t| t.0 == "scalar").unwrap().3);

    // The whole file into one page-aligned buffer sized after the manifest: every tensor at
    // its range; a buffer of another length fails before anything is read.
    let mut file = hotstart_store::uring::AlignedBuf::zeroed(0);
    let mut ranges = Vec::new();
    let (slot, at) = (&mut file, &mut ranges);
    let planned = Destination::Planned(Box::new(move |m, _| {
        *at = m
            .tensors
            .iter()
            .map(|t| (t.name.clone(), m.tensor_range(t)))
            .collect();
        *slot = hotstart_store::uring::AlignedBuf::zeroed(m.file_len as usize);
        Ok(Destination::File(&mut slot[..]))
    }));
    let l = engine.load(StepSel::Latest, planned).unwrap();
    assert!(
        l.tensors.is_empty(),
        "every tensor is in the caller's buffer"
    );
    assert_eq!(ranges.len(), set2.len());
    for (name, r) in &ranges {
        let want = &set2.iter().find(|t| &t.0 == name).unwrap().3;
        assert!(file[r.start as usize..r.end as usize] == want[..], "{name}");
    }
    let mut short = vec![0u8; file.len() - 1];
    let err = engine
        .load(StepSel::Step(20), Destination::File(&mut short))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Destination { reason, .. } if reason.contains("bytes for")),
        "{err}"
    );
    assert!(
        short.iter().all(|b| *b == 0),
        "nothing read into a refused buffer"
    );

    // A buffer that holds the file already (as a mapping of the local file would), with its
    // last byte flipped: that chunk is read again from the tiers, the others are kept.
    let mut held = file.to_vec();
    *held.last_mut().unwrap() ^= 0xFF;
    let l = engine
        .load(StepSel::Step(20), Destination::Held(&mut held))
        .unwrap();
    assert!(l.tensors.is_empty());
    assert!(held == file[..], "the flipped chunk was read again");
    // Only a tier kept in local files hands the plan one, with the step's bytes.
    match &handed {
        Some(bytes) => assert!(bytes[..] == file[..], "the plan's file is the step's"),
        None => assert!(
            files_at.is_none(),
            "no file for the plan, yet files are at {files_at:?}"
        ),
    }

    if let Some(dir) = files_at {
        let path = dir.join("job-a/step-20/rank-0.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), set2.len());
        for (n, d, s, b) in &set2 {
            let v = st.tensor(n).unwrap();
            assert_eq!(v.dtype().to_string(), d.to_string(), "{n}");
            let shape: Vec<u64> = v.shape().iter().map(|&x| x as u64).collect();
            assert_eq!(&shape, s);
            assert_eq!(v.data(), &b[..], "{n}");
        }
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta["step"], "20");
        assert!(!meta.contains_key("rank"));
        assert_eq!(meta["world_size"], "1");
        assert!(dir.join("job-a/step-20/rank-0.manifest.json").exists());
    }
}

#[test]
fn disk_tier_only() {
    let dir = tempfile::tempdir().unwrap();
    conformance(config("job-a").disk(dir.path()), Some(dir.path()));
}

#[test]
fn memory_store_only() {
    conformance(
        config("job-a").store(Store::open("memory://").unwrap()),
        None,
    );
}

#[test]
fn local_dir_store_only() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().to_str().unwrap()).unwrap();
    conformance(config("job-a").store(store), Some(dir.path()));
    // Written at the disk's speed, in the store's own layout: the object store's reader (a
    // file:// URL) verifies every chunk of what the engine wrote, and an engine reading through
    // it (a wrapped store never takes the direct path) loads the same bytes.
    let url = format!("file://{}", dir.path().display());
    let report = hotstart_ckpt::Checkpoints::open(&url)
        .unwrap()
        .verify("job-a", None)
        .unwrap();
    assert!(report.ok() && report.checked.len() == 2, "{report:?}");
    let through = Store::open(&url).unwrap().wrap(|inner| inner);
    assert_eq!(through.local_dir(), None);
    let mut cfg = config("job-a").store(through);
    cfg.keep = 0;
    let l = engine(cfg)
        .load(StepSel::Latest, Destination::Owned)
        .unwrap();
    assert_eq!(l.step, 20);
    assert_loaded(&l, &sample_tensors(2, 1 << 20), &extras(2));
}

#[test]
fn seaweedfs_store_only() {
    let Some(store) = s3_store("ckpt_seaweed_only") else {
        return;
    };
    conformance(config("job-a").store(store), None);
}

#[test]
fn disk_and_seaweedfs() {
    let Some(store) = s3_store("ckpt_disk_and_seaweed") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    conformance(
        config("job-a").disk(dir.path()).store(store),
        Some(dir.path()),
    );
}

#[test]
fn disk_and_memory_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open("memory://").unwrap();
    conformance(
        config("job-a").disk(dir.path()).store(store),
        Some(dir.path()),
    );
}

#[test]
fn borrowed_tensors_and_staging_reuse() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("job-b").disk(dir.path());
    cfg.keep = 2;
    let engine = engine(cfg);
    let mut params = pattern(3 << 20, 9);
    for step in 1..=4u64 {
        // SAFETY: `params` outlives the save and is not touched until wait_staged returns.
        let t = unsafe {
            Tensor::from_raw(
                "w",
                Dtype::F32,
                vec![(3 << 20) / 4],
                params.as_ptr(),
                params.len(),
            )
        }
        .unwrap();
        let h = engine.save(step, vec![t], Default::default()).unwrap();
        h.wait_staged().unwrap();
        let expect = params.clone();
        params.iter_mut().for_each(|b| *b = b.wrapping_add(1)); // the optimizer step
        h.wait().unwrap();
        let l = engine
            .load(StepSel::Step(step), Destination::Owned)
            .unwrap();
        assert!(l.tensors[0].data[..] == expect[..], "step {step}");
    }
    // Retention kept the newest two.
    engine.wait_idle();
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![3, 4]);
    assert!(!dir.path().join("job-b/step-1").exists());
}

#[test]
fn bad_input_is_refused() {
    let engine = engine(config("job-c").store(Store::open("memory://").unwrap()));
    let t = || Tensor::new("x", Dtype::U8, vec![1], vec![1u8]).unwrap();
    let input = |r: Result<_, Error>, says: &str| match r {
        Err(Error::Input { step: 1, reason }) => assert!(reason.contains(says), "{reason}"),
        Err(e) => panic!("expected Input, got {e}"),
        Ok(_) => panic!("expected Input ({says}), got a save"),
    };
    input(
        engine.save(1, vec![t(), t()], Default::default()),
        "given twice",
    );
    assert!(matches!(
        Tensor::new("y", Dtype::F32, vec![2], vec![0u8; 7]),
        Err(Error::Tensor { name, .. }) if name == "y"
    ));
    assert!(Tensor::new("__metadata__", Dtype::U8, vec![1], vec![0u8]).is_ok());
    let meta = Tensor::new("__metadata__", Dtype::U8, vec![1], vec![0u8]).unwrap();
    input(engine.save(1, vec![meta], Default::default()), "reserved");
    let config = |cfg: EngineConfig| match hotstart_ckpt::Engine::new(cfg) {
        Err(Error::Config { .. }) => {}
        Err(e) => panic!("expected Config, got {e}"),
        Ok(_) => panic!("expected Config, got an engine"),
    };
    config(EngineConfig::new("../x", 0, 1).store(Store::open("memory://").unwrap()));
    config(EngineConfig::new("ok", 2, 2).store(Store::open("memory://").unwrap()));
    config(EngineConfig::new("ok", 0, 1));
}

/// `Engine::manifest` reads any rank's manifest whatever world size wrote it, which is how a job
/// of another size finds the saved world size and loads each saved rank (resharding).
#[test]
fn manifest_of_another_rank_and_world_size() {
    let dir = tempfile::tempdir().unwrap();
    for rank in 0..2 {
        let mut cfg = config("job-m").disk(dir.path());
        (cfg.rank, cfg.world_size) = (rank, 2);
        let e = engine(cfg);
        let t = Tensor::new("x", Dtype::U8, vec![3], vec![rank as u8; 3]).unwrap();
        let extras = [("who".to_string(), vec![rank as u8])].into();
        e.save(5, vec![t], extras).unwrap().wait().unwrap();
    }
    // A job of one rank: step 5 is complete for the world size that saved it, and found as
    // such, but it is not complete for this world size...
    let single = engine(config("job-m").disk(dir.path()));
    assert_eq!(single.latest_complete_step().unwrap(), None);
    assert_eq!(single.latest_checkpoint().unwrap(), Some((5, 2)));
    // ...so loading it is refused, saying why and what loads it.
    for which in [StepSel::Latest, StepSel::Step(5)] {
        let e = single.load(which, Destination::Owned).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("saved by 2 ranks") && text.contains("StorageReader"),
            "{text}"
        );
    }
    // A step that only one of its two ranks committed is not a checkpoint at all.
    let mut cfg = config("job-m").disk(dir.path());
    (cfg.rank, cfg.world_size) = (0, 2);
    let t = Tensor::new("x", Dtype::U8, vec![3], vec![9; 3]).unwrap();
    engine(cfg)
        .save(6, vec![t], Default::default())
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(single.latest_checkpoint().unwrap(), Some((5, 2)));
    // Going back from a step finds only older checkpoints, of any world size.
    assert_eq!(single.latest_checkpoint_below(6).unwrap(), Some((5, 2)));
    assert_eq!(single.latest_checkpoint_below(5).unwrap(), None);
    // ...but every saved rank's manifest is readable and names the saved world size.
    for rank in 0..2u32 {
        let m = single.manifest(5, rank).unwrap();
        assert_eq!((m.step, m.rank, m.world_size), (5, rank, 2));
        assert_eq!(m.decode_extras().unwrap()["who"], vec![rank as u8]);
        let mut cfg = config("job-m").disk(dir.path());
        (cfg.rank, cfg.world_size) = (rank, m.world_size);
        let l = engine(cfg)
            .load(StepSel::Step(5), Destination::Owned)
            .unwrap();
        assert!(l.tensors[0].data[..] == [rank as u8; 3]);
    }
    let missing = single.manifest(5, 2).unwrap_err();
    assert!(missing.is_not_found(), "{missing}");
    assert!(single.manifest(7, 0).unwrap_err().is_not_found());
}

/// A job that went back to an older step (it restored one) and trains again: once its save of
/// that step is persisted, this rank's copies of the newer steps of the abandoned run are
/// removed, and retention keeps the steps of the run that goes on, never the one just saved.
#[test]
fn a_save_after_going_back_removes_the_abandoned_newer_steps() {
    let disk = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let open = || {
        let store = hotstart_store::Store::open(store_dir.path().to_str().unwrap()).unwrap();
        let mut cfg = config("back").disk(disk.path()).store(store);
        cfg.keep = 2;
        engine(cfg)
    };
    let set = |step: u64| sample_tensors(step, 1 << 10);
    let first = open();
    for step in [10, 20, 30, 40] {
        first
            .save(step, to_tensors(&set(step)), extras(step))
            .unwrap()
            .wait()
            .unwrap();
    }
    first.wait_idle(); // retention follows each save's persistence
    for tier in [TierKind::Disk, TierKind::Store] {
        assert_eq!(first.complete_steps(tier).unwrap(), vec![30, 40]);
    }
    drop(first);
    // A new process resumed from step 20 (say 30 and 40 were incomplete on another rank).
    let second = open();
    second
        .save(20, to_tensors(&set(20)), extras(20))
        .unwrap()
        .wait()
        .unwrap();
    second.wait_idle();
    for tier in [TierKind::Disk, TierKind::Store] {
        assert_eq!(second.complete_steps(tier).unwrap(), vec![20], "{tier}");
    }
    let l = second.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 20);
    assert_loaded(&l, &set(20), &extras(20));
    // The run goes on: its own newer steps are kept as usual.
    for step in [30, 40] {
        second
            .save(step, to_tensors(&set(step)), extras(step))
            .unwrap()
            .wait()
            .unwrap();
    }
    second.wait_idle();
    for tier in [TierKind::Disk, TierKind::Store] {
        assert_eq!(second.complete_steps(tier).unwrap(), vec![30, 40], "{tier}");
    }
}

/// A job that came back with fewer ranks: retention counts the older world's complete steps as
/// complete (kept while they are among the newest `keep`, never cleared as torn saves), and
/// removes them whole, the ranks the new world does not have included, once they are not.
#[test]
fn retention_after_a_job_shrinks_keeps_and_then_removes_the_larger_worlds_steps_whole() {
    let store_dir = tempfile::tempdir().unwrap();
    let open = |rank: u32, world_size: u32| {
        let store = hotstart_store::Store::open(store_dir.path().to_str().unwrap()).unwrap();
        let mut cfg = config("shrink").store(store);
        (cfg.rank, cfg.world_size, cfg.keep) = (rank, world_size, 2);
        engine(cfg)
    };
    let save = |e: &hotstart_ckpt::Engine, step: u64| {
        let t = Tensor::new("x", Dtype::U8, vec![4], vec![step as u8; 4]).unwrap();
        e.save(step, vec![t], Default::default())
            .unwrap()
            .wait()
            .unwrap();
        e.wait_idle();
    };
    for rank in 0..3 {
        save(&open(rank, 3), 4);
    }
    let files = |step: u64| -> Vec<String> {
        let dir = store_dir.path().join("shrink").join(format!("step-{step}"));
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    let all3: Vec<String> = (0..3)
        .flat_map(|r| {
            [
                format!("rank-{r}.manifest.json"),
                format!("rank-{r}.safetensors"),
            ]
        })
        .collect();
    assert_eq!(files(4), all3);
    // Two ranks save step 6: step 4 (3 ranks) is one of the 2 newest complete ones, kept whole.
    let two = [open(0, 2), open(1, 2)];
    for e in &two {
        save(e, 6);
    }
    assert_eq!(files(4), all3);
    assert_eq!(two[0].latest_checkpoint_below(6).unwrap(), Some((4, 3)));
    // Step 8 pushes it out: each rank removes its files at its first save that sees step 4
    // beyond the newest 2 (rank 0 saves first, while step 8 is not complete yet), and the new
    // world's last rank removes rank 2's with its own.
    for e in &two {
        save(e, 8);
    }
    assert_eq!(files(4), ["rank-0.manifest.json", "rank-0.safetensors"]);
    save(&two[0], 10);
    assert_eq!(files(4), Vec::<String>::new());
    assert_eq!(two[0].latest_checkpoint().unwrap(), Some((8, 2)));
    assert_eq!(two[0].latest_checkpoint_below(8).unwrap(), Some((6, 2)));
}

/// Byte ranges of stored tensors land straight in caller buffers (a resharding reader's load),
/// beside whole tensors; a range past its tensor's end, or two that take the same bytes, are
/// refused before anything is read.
#[test]
fn regions_of_tensors_load_into_caller_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config("regions").disk(dir.path());
    cfg.chunk_size = 4096;
    let e = engine(cfg);
    let big: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let small = vec![5u8; 8];
    let tensors = vec![
        Tensor::new("big", Dtype::U8, vec![20_000], big.clone()).unwrap(),
        Tensor::new("small", Dtype::U8, vec![8], small.clone()).unwrap(),
    ];
    e.save(1, tensors, Default::default())
        .unwrap()
        .wait()
        .unwrap();
    let (mut a, mut b, mut whole) = (vec![0u8; 5000], vec![0u8; 3], vec![0u8; 8]);
    let regions = vec![
        ("big".to_string(), Some(3000), &mut a[..]),
        ("big".to_string(), Some(19_997), &mut b[..]),
        ("small".to_string(), None, &mut whole[..]),
    ];
    let l = e
        .load(StepSel::Step(1), Destination::Regions(regions))
        .unwrap();
    assert!(l.tensors.is_empty());
    assert!(a[..] == big[3000..8000] && b[..] == big[19_997..] && whole == small);

    let mut past = [0u8; 4];
    let e2 = e
        .load(
            StepSel::Step(1),
            Destination::Regions(vec![("big".into(), Some(19_997), &mut past[..])]),
        )
        .unwrap_err();
    assert!(matches!(e2, Error::Destination { .. }), "{e2}");
    let (mut x, mut y) = (vec![0u8; 100], vec![0u8; 100]);
    let overlap = vec![
        ("big".to_string(), Some(0), &mut x[..]),
        ("big".to_string(), Some(50), &mut y[..]),
    ];
    let e3 = e
        .load(StepSel::Step(1), Destination::Regions(overlap))
        .unwrap_err();
    assert!(e3.to_string().contains("two destinations"), "{e3}");
    let mut short = [0u8; 7];
    let e4 = e
        .load(
            StepSel::Step(1),
            Destination::Regions(vec![("small".into(), None, &mut short[..])]),
        )
        .unwrap_err();
    assert!(e4.to_string().contains("7 bytes for 8 bytes"), "{e4}");

    // Only the chunks that hold the ranges and the header are read: a damaged chunk elsewhere
    // does not stop the load, and one the ranges lie in does.
    let file = dir.path().join("regions/step-1/rank-0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 10_000;
    bytes[at] ^= 1;
    std::fs::write(&file, &bytes).unwrap();
    let m = e.manifest(1, 0).unwrap();
    let damaged = at / 4096;
    let mut head = [0u8; 100];
    let l = e
        .load(
            StepSel::Step(1),
            Destination::Regions(vec![("big".into(), Some(0), &mut head[..])]),
        )
        .unwrap();
    assert!(head[..] == big[..100]);
    let wanted = [Region {
        tensor: "big".into(),
        offset: 0,
        len: 100,
    }];
    let read = m.chunks_for(&wanted).unwrap();
    assert!(
        !read.contains(&damaged) && read.len() < m.chunks.len(),
        "{read:?}"
    );
    assert_eq!(l.chunk_sources.len(), read.len());
    let data_at = (at as u64 - m.data_offset) as usize;
    let mut hit = [0u8; 10];
    let e5 = e
        .load(
            StepSel::Step(1),
            Destination::Regions(vec![("big".into(), Some(data_at as u64), &mut hit[..])]),
        )
        .unwrap_err();
    assert!(
        matches!(e5, Error::Corrupt { chunk, .. } if chunk == damaged),
        "{e5}"
    );
}

/// A step asked for by number is loaded only once every rank committed it, as the newest is:
/// one rank's files of a step another rank never finished are not a checkpoint.
#[test]
fn a_step_asked_for_by_number_loads_only_when_complete() {
    let dir = tempfile::tempdir().unwrap();
    let open = |rank: u32| {
        let mut cfg = config("torn").disk(dir.path());
        (cfg.rank, cfg.world_size) = (rank, 2);
        engine(cfg)
    };
    let sets: Vec<_> = (0..2).map(|r| sample_tensors(20 + r, 4096)).collect();
    let save = |rank: u32| {
        open(rank)
            .save(1, to_tensors(&sets[rank as usize]), extras(rank as u64))
            .unwrap()
            .wait()
            .unwrap();
    };
    save(1);
    for rank in 0..2 {
        let e = open(rank);
        assert_eq!(e.latest_complete_step().unwrap(), None);
        let err = e
            .load(StepSel::Step(1), Destination::Owned)
            .map(|_| ())
            .unwrap_err();
        assert!(err.is_not_found(), "rank {rank}: {err}");
    }
    save(0);
    for rank in 0..2 {
        let l = open(rank)
            .load(StepSel::Step(1), Destination::Owned)
            .unwrap();
        assert_loaded(&l, &sets[rank as usize], &extras(rank as u64));
    }
}
