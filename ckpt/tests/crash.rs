//! Crash tests with real processes: a trainer is killed with SIGKILL while a big step persists.
//!
//! The trainer is this test program run again as a child process (`trainer`, which does
//! nothing unless [`TRAINER_ENV`] names its directories), so it is a process of its own, as a
//! training job is, and writes the tensors the test recomputes.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, StepSel, Tensor, TierKind};
use hotstart_store::Store;
use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};

/// `DISK_DIR:STORE_DIR`: run as the trainer, with these tiers.
const TRAINER_ENV: &str = "HOTSTART_CRASH_TRAINER";

/// Step 1 holds 1 MiB and is waited for until persisted everywhere ("persisted 1"). Step 2
/// holds 192 MiB; the trainer prints "staged 2" once staging is done and then waits for the
/// persist, which the store tier makes slow (a throttled local-directory store), so a kill
/// after "staged 2" lands mid-persist. Tensor bytes are one tensor `w` of `pattern(len, step)`.
#[test]
fn trainer() {
    let Some(dirs) = std::env::var_os(TRAINER_ENV) else {
        return; // Only the child process trains.
    };
    let dirs = dirs.into_string().unwrap();
    let (disk, store_dir) = dirs.split_once(':').unwrap();
    let throttle = Arc::new(Throttle::new(ThrottleConfig {
        latency: Duration::from_millis(200),
        per_request_bytes_per_sec: None,
        total_bytes_per_sec: Some(8 << 20),
    }));
    let store = Store::open(store_dir)
        .unwrap()
        .wrap(|inner| throttle.clone().wrap(inner));
    let mut cfg = EngineConfig::new("crash-job", 0, 1).disk(disk).store(store);
    cfg.chunk_size = 1 << 20;
    let engine = Engine::new(cfg).unwrap();
    let mut out = std::io::stdout();
    // The harness's "test trainer ... " has no line end of its own.
    writeln!(out).unwrap();
    for (step, len) in [(1u64, 1usize << 20), (2, 192 << 20)] {
        let w = Tensor::new("w", Dtype::U8, vec![len as u64], pattern(len, step)).unwrap();
        let h = engine.save(step, vec![w], Default::default()).unwrap();
        h.wait_staged().unwrap();
        writeln!(out, "staged {step}").unwrap();
        out.flush().unwrap();
        h.wait().unwrap();
        writeln!(out, "persisted {step}").unwrap();
        out.flush().unwrap();
    }
}

#[test]
fn kill_9_mid_persist_leaves_previous_step_loadable() {
    let disk = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let dirs = format!("{}:{}", disk.path().display(), store_dir.path().display());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "trainer", "--nocapture", "--test-threads", "1"])
        .env(TRAINER_ENV, dirs)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        // The test harness's own lines ("running 1 test") are not the trainer's.
        if !line.starts_with("staged ") && !line.starts_with("persisted ") {
            continue;
        }
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
