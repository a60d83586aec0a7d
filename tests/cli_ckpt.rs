//! End-to-end: `hotstart ckpt ls|show|verify|gc` run as the real binary against checkpoints
//! written by the engine, in a local disk-tier directory and in a `file://` store.

use std::path::Path;
use std::process::{Command, Output};

use bytes::Bytes;
use hotstart_ckpt::{Dtype, Engine, EngineConfig, Tensor};
use hotstart_store::Store;
use hotstart_testkit::pattern;

const CHUNK: usize = 64 << 10;

fn hotstart(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(args)
        .output()
        .expect("run hotstart")
}

fn ok(args: &[&str]) -> String {
    let out = hotstart(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command that must fail; its stderr.
fn fails(args: &[&str]) -> String {
    let out = hotstart(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
    stderr
}

/// Three tensors: 300 KiB of F32 (several chunks), a BF16 matrix and an empty I64.
fn tensors(step: u64, rank: u32) -> Vec<Tensor> {
    let seed = step * 10 + rank as u64;
    vec![
        Tensor::new(
            "model.w",
            Dtype::F32,
            vec![300, 256],
            Bytes::from(pattern(300 * 256 * 4, seed)),
        )
        .unwrap(),
        Tensor::new(
            "model.b",
            Dtype::BF16,
            vec![3, 4],
            Bytes::from(pattern(24, seed + 1)),
        )
        .unwrap(),
        Tensor::new("empty", Dtype::I64, vec![0], Bytes::new()).unwrap(),
    ]
}

fn engine(rank: u32, cfg: impl Fn(EngineConfig) -> EngineConfig) -> Engine {
    let mut c = cfg(EngineConfig::new("run-1", rank, 2));
    c.keep = 0;
    c.chunk_size = CHUNK;
    Engine::new(c).unwrap()
}

/// Saves `steps` on both ranks and `torn` on rank 0 only.
fn write(cfg: impl Fn(EngineConfig) -> EngineConfig, steps: &[u64], torn: &[u64]) {
    let (r0, r1) = (engine(0, &cfg), engine(1, &cfg));
    for &s in steps {
        r0.save(s, tensors(s, 0), Default::default())
            .unwrap()
            .wait()
            .unwrap();
        r1.save(s, tensors(s, 1), Default::default())
            .unwrap()
            .wait()
            .unwrap();
    }
    for &s in torn {
        r0.save(s, tensors(s, 0), Default::default())
            .unwrap()
            .wait()
            .unwrap();
    }
}

fn step_bytes(root: &Path, step: u64) -> u64 {
    std::fs::read_dir(root.join(format!("run-1/step-{step}")))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn line_of(out: &str, step: u64) -> &str {
    out.lines()
        .find(|l| l.split_whitespace().nth(1) == Some(&step.to_string()))
        .unwrap_or_else(|| panic!("no line for step {step} in\n{out}"))
}

#[test]
fn ls_show_verify_gc_on_a_disk_tier() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let root = dir.path();
    write(|c| c.disk(root), &[10, 20, 30], &[15, 40]);
    let at = root.to_str().unwrap();

    // ls: every step, its ranks, bytes and state.
    let ls = ok(&["ckpt", "ls", at, "--job", "run-1"]);
    for s in [10, 20, 30] {
        let line = line_of(&ls, s);
        assert!(line.contains("run-1") && line.contains(" 2/2 "), "{line}");
        assert!(line.contains(&step_bytes(root, s).to_string()), "{line}");
        assert!(line.ends_with("complete"), "{line}");
    }
    for s in [15, 40] {
        let line = line_of(&ls, s);
        assert!(line.contains(" 1/2 "), "{line}");
        assert!(
            line.contains("incomplete (rank 1 has no manifest)"),
            "{line}"
        );
    }
    // Without --job: every job.
    let all = ok(&["ckpt", "ls", at]);
    assert_eq!(all.lines().filter(|l| l.starts_with("run-1 ")).count(), 5);

    // show: the tensor index.
    let show = ok(&[
        "ckpt", "show", at, "--job", "run-1", "--step", "20", "--rank", "1",
    ]);
    assert!(
        show.contains("job run-1 step 20 rank 1 of 2: 3 tensors"),
        "{show}"
    );
    let row = |name: &str| {
        show.lines()
            .find(|l| l.starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in\n{show}"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert_eq!(row("model.w"), "model.w F32 [300, 256] 307200");
    assert_eq!(row("model.b"), "model.b BF16 [3, 4] 24");
    assert_eq!(row("empty"), "empty I64 [0] 0");
    // A step that is not there names the steps that are.
    let stderr = fails(&["ckpt", "show", at, "--job", "run-1", "--step", "7"]);
    assert!(
        stderr.contains("no manifest of step 7 rank 0") && stderr.contains("[10, 15, 20, 30, 40]"),
        "{stderr}"
    );
    // Default: the newest complete step, rank 0.
    assert!(ok(&["ckpt", "show", at, "--job", "run-1"]).contains("step 30 rank 0 of 2"));

    // verify: every complete step passes...
    let verify = ok(&["ckpt", "verify", at, "--job", "run-1"]);
    for s in [10, 20, 30] {
        for r in [0, 1] {
            assert!(
                verify.contains(&format!("checked step {s} rank {r}: ")),
                "{verify}"
            );
        }
    }
    assert!(verify.contains("ok: 6 rank file(s) verified"), "{verify}");
    // ... until a byte in chunk 2 of step 20 rank 1 is flipped.
    let file = root.join("run-1/step-20/rank-1.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[2 * CHUNK + 123] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    for args in [
        vec!["ckpt", "verify", at, "--job", "run-1"],
        vec!["ckpt", "verify", at, "--job", "run-1", "--step", "20"],
    ] {
        let out = hotstart(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "verify passed a flipped byte");
        assert!(
            stderr.contains("step 20 rank 1 chunk 2: checksum mismatch"),
            "{stderr}"
        );
        assert_eq!(stderr.matches("BAD ").count(), 1, "{stderr}");
    }
    assert!(ok(&["ckpt", "verify", at, "--job", "run-1", "--step", "30"]).contains("ok: 2"));

    // gc --keep 2: the newest two complete steps stay, older ones and the older torn step go,
    // the newer torn step (maybe still persisting) stays.
    // --keep 0 keeps everything, as it does everywhere else; a job that is not there (a typo)
    // is an error, not "kept 0".
    let all = ok(&["ckpt", "gc", at, "--job", "run-1", "--keep", "0"]);
    assert!(!all.contains("removed"), "{all}");
    for args in [
        vec!["ckpt", "gc", at, "--job", "run-11", "--keep", "2"],
        vec!["ckpt", "ls", at, "--job", "run-11"],
    ] {
        let stderr = fails(&args);
        assert!(
            stderr.contains("job \"run-11\" has no steps") && stderr.contains("ckpt ls"),
            "{args:?}: {stderr}"
        );
    }
    // A job's own folder given as the location: no jobs there, and the listing says where to
    // look instead.
    let inside = root.join("run-1");
    let out = hotstart(&["ckpt", "ls", inside.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains("no checkpoints at") && stderr.contains("--job"),
        "{stderr}"
    );
    // A location that is not there says what to pass instead, each cause once.
    let missing = hotstart(&["ckpt", "ls", "/nonexistent/checkpoints"]);
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(
        !missing.status.success()
            && stderr.contains("is not a directory")
            && stderr.contains("store URL")
            && !stderr.contains("entity not found: entity not found"),
        "{stderr}"
    );
    // A reader that went away (`| head -1`) ends the listing quietly: stdout is a pipe whose
    // read end is closed before the command starts, so its first write fails.
    for args in [
        vec!["ckpt", "ls", at],
        vec!["ckpt", "show", at, "--job", "run-1"],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_hotstart"))
            .args(&args)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.is_empty(),
            "{args:?}: {stderr}"
        );
    }

    let gc = ok(&["ckpt", "gc", at, "--job", "run-1", "--keep", "2"]);
    assert!(
        gc.contains("removed step 10") && gc.contains("removed step 15"),
        "{gc}"
    );
    assert!(gc.contains("kept 2 complete step(s): [20, 30]"), "{gc}");
    assert!(
        gc.contains(
            "left alone 1 newer incomplete step(s) (a save may still be writing them): [40]"
        ),
        "{gc}"
    );
    let mut left: Vec<String> = std::fs::read_dir(root.join("run-1"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["step-20", "step-30", "step-40"]);
    let data = std::fs::read(root.join("run-1/step-30/rank-0.safetensors")).unwrap();
    assert!(data.len() > 300 * 256 * 4, "kept steps keep their data");
}

#[test]
fn ls_and_verify_a_store_url() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let url = format!("file://{}", dir.path().display());
    let store = Store::open(&url).unwrap();
    write(|c| c.store(store.clone()), &[7], &[]);
    let ls = ok(&["ckpt", "ls", &url]);
    assert!(line_of(&ls, 7).ends_with("complete"), "{ls}");
    let verify = ok(&["ckpt", "verify", &url, "--job", "run-1", "--step", "7"]);
    assert!(verify.contains("ok: 2 rank file(s) verified"), "{verify}");
    let out = hotstart(&["ckpt", "show", &url, "--job", "run-1", "--step", "8"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("step 8"));
}

/// A step some rank committed whose files were damaged or lost since is damage, reported and
/// failed by `verify` without `--step` too, not skipped as a torn save; a torn save still is.
#[test]
fn verify_reports_committed_steps_whose_files_were_lost_or_cut() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let root = dir.path();
    write(|c| c.disk(root), &[10, 20, 30], &[40]);
    let at = root.to_str().unwrap();
    let step = |s: u64| root.join(format!("run-1/step-{s}"));
    // Step 30 rank 1: cut short. Step 20 rank 1: its data file gone. Step 10 rank 0: a
    // manifest byte flipped.
    let data = step(30).join("rank-1.safetensors");
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    std::fs::remove_file(step(20).join("rank-1.safetensors")).unwrap();
    let manifest = step(10).join("rank-0.manifest.json");
    let mut bytes = std::fs::read(&manifest).unwrap();
    bytes[5] ^= 1;
    std::fs::write(&manifest, bytes).unwrap();

    let out = hotstart(&["ckpt", "verify", at, "--job", "run-1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains(&format!(
            "BAD step 30 rank 1: the data file has {} bytes where its manifest says {len}",
            len - 10
        )),
        "{stderr}"
    );
    assert!(
        stderr.contains("BAD step 20 rank 1: no data file, though its manifest is there"),
        "{stderr}"
    );
    assert!(stderr.contains("BAD step 10 rank 0: "), "{stderr}");
    assert_eq!(stderr.matches("BAD ").count(), 3, "{stderr}");
    assert!(stderr.contains("verify failed: 3 problem(s)"), "{stderr}");
    // The whole ranks of the damaged steps are still checked; the torn save is skipped.
    for (s, r) in [(30, 0), (20, 0), (10, 1)] {
        assert!(
            stdout.contains(&format!("checked step {s} rank {r}: ")),
            "{stdout}"
        );
    }
    assert!(!stdout.contains("checked step 20 rank 1"), "{stdout}");
    assert!(stdout.contains("skipped step 40: incomplete"), "{stdout}");
    // Asked for by number, the torn save names the rank that never committed.
    let stderr = fails(&["ckpt", "verify", at, "--job", "run-1", "--step", "40"]);
    assert!(
        stderr.contains("BAD step 40 rank 1: no manifest: this rank's save never committed"),
        "{stderr}"
    );
}
