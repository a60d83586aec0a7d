//! Crash tests with real processes: a trainer is killed with SIGKILL while a big step persists.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::*;
use hotstart_ckpt::{Destination, StepSel, TierKind};
use hotstart_store::Store;

#[test]
fn kill_9_mid_persist_leaves_previous_step_loadable() {
    let disk = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckpt-test-trainer"))
        .args([
            disk.path().to_str().unwrap(),
            store_dir.path().to_str().unwrap(),
            "crash-job",
            "192",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push(line.clone());
        if line == "staged 2" {
            break;
        }
    }
    assert_eq!(seen, ["staged 1", "persisted 1", "staged 2"]);
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(!status.success());

    let open = || {
        let store = Store::open(store_dir.path().to_str().unwrap()).unwrap();
        let mut cfg = config("crash-job").disk(disk.path()).store(store);
        cfg.chunk_size = 1 << 20;
        cfg.keep = 1;
        engine(cfg)
    };
    let engine = open();
    // The throttled store cannot have finished 192 MiB; the disk is checked either way.
    assert_eq!(engine.complete_steps(TierKind::Store).unwrap(), vec![1]);
    let disk_steps = engine.complete_steps(TierKind::Disk).unwrap();
    eprintln!("disk tier complete steps after the kill: {disk_steps:?}");
    let step1 = engine.load(StepSel::Step(1), Destination::Owned).unwrap();
    assert!(step1.tensors[0].data[..] == pattern(1 << 20, 1)[..]);
    match engine.latest_complete_step().unwrap() {
        Some(1) => assert_eq!(disk_steps, vec![1], "torn step 2 reported complete"),
        Some(2) => {
            // The disk tier committed before the kill: then step 2 must be whole.
            let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
            assert!(l.tensors[0].data[..] == pattern(192 << 20, 2)[..]);
        }
        other => panic!("latest complete step {other:?}"),
    }
    let torn_dir = disk.path().join("crash-job/step-2");
    if disk_steps == vec![1] && torn_dir.exists() {
        eprintln!(
            "torn step 2 on disk: {:?}",
            std::fs::read_dir(&torn_dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect::<Vec<_>>()
        );
    }

    // A restarted trainer saves step 3; retention (keep 1) removes step 1 and the torn step 2.
    let set = sample_tensors(3, 2 << 20);
    engine
        .save(3, to_tensors(&set), extras(3))
        .unwrap()
        .wait()
        .unwrap();
    engine.wait_idle(); // retention runs right after each tier reports the step persisted
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![3]);
    assert_eq!(engine.complete_steps(TierKind::Store).unwrap(), vec![3]);
    assert!(!torn_dir.exists(), "torn step 2 not removed from disk");
    assert!(!disk.path().join("crash-job/step-1").exists());
    let store_left: Vec<_> = walk(store_dir.path());
    assert!(
        store_left.iter().all(|p| p.contains("step-3")),
        "store still holds {store_left:?}"
    );
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(3));
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}
