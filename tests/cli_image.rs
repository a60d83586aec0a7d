//! End-to-end: `hotstart image build/ls/inspect/mount/stats/pull` as a user runs them, on a
//! local-directory store and on SeaweedFS. The mount runs as a child process, is read through
//! like any directory, and is stopped with SIGINT like a user's Ctrl-C.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hotstart_testkit::tree::{assert_trees_equal, sample_dir};
use hotstart_testkit::{SeaweedFs, run_ok};

fn hotstart(env: &[(String, String)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hotstart"));
    c.envs(env.iter().map(|(k, v)| (k, v)));
    c
}

/// A `hotstart image mount` child, stopped (SIGINT) and waited for on drop.
struct MountProc {
    child: Option<Child>,
}

impl MountProc {
    fn start(cmd: &mut Command, mountpoint: &Path) -> MountProc {
        let child = cmd.stdout(Stdio::null()).spawn().expect("spawn mount");
        let m = MountProc { child: Some(child) };
        let deadline = Instant::now() + Duration::from_secs(60);
        // Mounted once the directory shows the image's entries.
        while std::fs::read_dir(mountpoint).map_or(true, |mut d| d.next().is_none()) {
            assert!(Instant::now() < deadline, "mount did not appear");
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    /// Ctrl-C; returns whether the process exited successfully.
    fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        let _ = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status();
        child.wait().expect("wait for mount").success()
    }
}

impl Drop for MountProc {
    fn drop(&mut self) {
        self.stop();
    }
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

fn image_round_trip(store: &str, env: &[(String, String)], work: &Path) {
    let src = work.join("src");
    sample_dir(&src);
    let cmd = |args: &[&str]| {
        let mut c = hotstart(env);
        c.arg("image").args(args).args(["--store", store]);
        c
    };
    let out = run_ok(
        cmd(&[
            "build",
            src.to_str().unwrap(),
            "--name",
            "ml/app:1",
            "--chunk-kib",
            "64",
        ])
        .current_dir(work),
    );
    assert!(out.contains("built ml/app:1"), "{out}");
    let listing = run_ok(&mut cmd(&["ls"]));
    assert!(
        listing.contains("ml/app:1") && listing.contains("dir:"),
        "{listing}"
    );
    let inspect = json(&run_ok(&mut cmd(&["inspect", "ml/app:1", "--json"])));
    assert_eq!(inspect["record"]["counts"]["hardlinks"], 1);

    // Two mounts, each with a fresh local cache: the first records, the second prefetches.
    for run in 0..2 {
        let mp = work.join(format!("mnt-{run}"));
        std::fs::create_dir_all(&mp).unwrap();
        let report = work.join(format!("report-{run}.json"));
        let cache = work.join(format!("cache-{run}"));
        let mut m = MountProc::start(
            cmd(&["mount", "ml/app:1", mp.to_str().unwrap()])
                .args(["--cache-dir", cache.to_str().unwrap()])
                .args(["--report", report.to_str().unwrap()]),
            &mp,
        );
        assert_trees_equal(&src, &mp);
        assert!(m.stop(), "the mount exits cleanly on SIGINT");
        let r = json(&std::fs::read_to_string(&report).unwrap());
        assert!(r["chunks_read"].as_u64().unwrap() > 0, "{r}");
        if run == 1 {
            assert_eq!(r["planned_chunks"], r["chunks_read"], "{r}");
            assert!(r["hit_rate"].as_f64().unwrap() > 0.0, "{r}");
        }
        // Nothing is left mounted.
        assert!(std::fs::read_dir(&mp).unwrap().next().is_none());
    }
    let stats = json(&run_ok(&mut cmd(&["stats", "ml/app:1", "--json"])));
    assert_eq!(stats["profile"]["runs"], 2, "{stats}");
    assert_eq!(stats["mounts"].as_array().unwrap().len(), 2, "{stats}");
    let prom = run_ok(&mut cmd(&["stats", "ml/app:1", "--prometheus"]));
    assert!(
        prom.contains("hotstart_image_hit_ratio{tree=\"ml/app:1\""),
        "{prom}"
    );

    let dest = work.join("pulled");
    let cache = work.join("pull-cache");
    run_ok(
        cmd(&["pull", "ml/app:1", dest.to_str().unwrap()])
            .args(["--cache-dir", cache.to_str().unwrap()]),
    );
    assert_trees_equal(&src, &dest);
}

#[test]
fn image_commands_on_a_local_directory_store() {
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    image_round_trip(store.to_str().unwrap(), &[], work.path());
}

#[test]
fn image_commands_on_seaweedfs() {
    let Some(weed) = SeaweedFs::shared() else {
        return;
    };
    let bucket = weed.fresh_bucket("cli-image");
    let work = tempfile::tempdir().unwrap();
    image_round_trip(&format!("{bucket}/images"), &weed.env(), work.path());
}

#[test]
fn bad_images_get_clear_errors() {
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    // A tarball whose entry climbs out of the root.
    let mut header = [0u8; 512];
    header[..9].copy_from_slice(b"../escape");
    header[100..107].copy_from_slice(b"0000644");
    header[124..135].copy_from_slice(b"00000000001");
    header[156] = b'0';
    header[257..263].copy_from_slice(b"ustar\0");
    header[148..156].copy_from_slice(b"        ");
    let sum: u32 = header.iter().map(|b| *b as u32).sum();
    header[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    let mut tar = header.to_vec();
    tar.extend_from_slice(&[b'x'; 512]);
    tar.extend_from_slice(&[0u8; 1024]);
    std::fs::write(work.path().join("evil.tar"), tar).unwrap();
    let out = hotstart(&[])
        .args(["image", "build"])
        .arg(work.path().join("evil.tar"))
        .args(["--store", store.to_str().unwrap(), "--name", "evil"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"../escape\"") && err.contains("escapes"),
        "{err}"
    );

    for args in [
        vec!["image", "inspect", "nothing:here"],
        vec!["image", "pull", "nothing", "/tmp/never"],
    ] {
        let out = hotstart(&[])
            .args(&args)
            .args(["--store", store.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no image nothing"), "{args:?}: {err}");
    }
    let out = hotstart(&[])
        .args([
            "image",
            "inspect",
            "Bad/Name",
            "--store",
            store.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid image name \"Bad/Name\""), "{err}");
}

/// Whether the kernel's mount table lists anything at `path` (absolute, as the table names it).
fn mounted_at(path: &Path) -> bool {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let path = path.to_str().unwrap();
    table.lines().any(|l| l.split(' ').nth(4) == Some(path))
}

/// Mount points given as a bare name in the working directory: a mount stopped with Ctrl-C
/// while a file in it is open is still detached (lazily), and a second mount on a live one is
/// refused, naming how to unmount it, before any prefetch starts.
#[test]
fn mounts_at_a_bare_name_are_detached_when_busy_and_never_stacked() {
    let work = tempfile::tempdir().unwrap();
    let work = work.path().canonicalize().unwrap();
    let store = work.join("store");
    let src = work.join("src");
    sample_dir(&src);
    let cmd = |args: &[&str]| {
        let mut c = hotstart(&[]);
        c.arg("image")
            .args(args)
            .args(["--store", store.to_str().unwrap()])
            .current_dir(&work);
        c
    };
    run_ok(&mut cmd(&["build", "src", "--name", "app:1"]));
    let mp = work.join("mnt");
    std::fs::create_dir(&mp).unwrap();
    let mut m = MountProc::start(&mut cmd(&["mount", "app:1", "mnt"]), &mp);
    assert!(mounted_at(&mp));

    let second = cmd(&["mount", "app:1", "mnt"]).output().unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        err.contains("already has a FUSE file system mounted") && err.contains("fusermount3 -u"),
        "{err}"
    );
    assert!(
        !err.contains("prefetch"),
        "nothing started for the refused mount: {err}"
    );

    let first = std::fs::read_dir(&mp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_file())
        .expect("a file in the image");
    let held = std::fs::File::open(&first).unwrap();
    assert!(m.stop(), "the mount exits cleanly on SIGINT");
    drop(held);
    assert!(
        !mounted_at(&mp),
        "nothing is left mounted at {}",
        mp.display()
    );
    assert!(std::fs::read_dir(&mp).unwrap().next().is_none());
}

/// A chunk size out of range is refused by the argument parser, before anything is built.
#[test]
fn chunk_sizes_out_of_range_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    for kib in ["0", "100000000"] {
        let out = hotstart(&[])
            .args(["image", "build"])
            .arg(work.path())
            .args(["--store", store.to_str().unwrap(), "--name", "x:1"])
            .args(["--chunk-kib", kib])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{kib}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--chunk-kib") && err.contains("4..=65536"),
            "{kib}: {err}"
        );
        assert!(!store.exists(), "nothing was written for {kib}");
    }
}
