//! Real FUSE mounts: a local-directory store and a SeaweedFS store, written and read with plain
//! std::fs calls through the mount, checked byte for byte through the mount and in the store.
//!
//! Every mount is held by a [`Mounted`] guard whose drop unmounts (lazily if busy), so a failing
//! assertion never leaves a mount behind. The runtime serving requests drops after the mount.

use std::io::{ErrorKind, Write};
use std::path::Path;
use std::process::Command;

use hotstart_fuse::{FsConfig, MountConfig, MountHandle};
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

/// A mount plus the runtime serving it; dropping unmounts first, then stops the runtime.
struct Mounted {
    handle: Option<MountHandle>,
    _dir: tempfile::TempDir,
    rt: Option<tokio::runtime::Runtime>,
}

impl Mounted {
    fn new(store: Store, fs: FsConfig) -> Mounted {
        // Why a request failed (the filesystem's warnings) appears in a failing test's output;
        // HOTSTART_LOG (e.g. `hotstart_fuse=debug`) asks for more.
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("HOTSTART_LOG")
                    .unwrap_or_else(|_| "warn".into()),
            )
            .try_init();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cfg = MountConfig {
            fs,
            ..MountConfig::default()
        };
        let handle = hotstart_fuse::mount(store, dir.path(), cfg, rt.handle().clone())
            .expect("mount (needs /dev/fuse, fusermount3 and root)");
        Mounted {
            handle: Some(handle),
            _dir: dir,
            rt: Some(rt),
        }
    }

    fn path(&self) -> &Path {
        self.handle.as_ref().unwrap().mountpoint()
    }

    fn store(&self) -> Store {
        self.handle.as_ref().unwrap().fs().store().clone()
    }

    fn get(&self, key: &str) -> Vec<u8> {
        let store = self.store();
        let key = key.to_string();
        self.rt
            .as_ref()
            .unwrap()
            .block_on(async move { store.get(&key).await.unwrap().to_vec() })
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            let mp = h.mountpoint().to_path_buf();
            if let Err(e) = h.unmount() {
                eprintln!("unmount {}: {e}", mp.display());
            }
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    hotstart_testkit::pattern(len, seed)
}

fn config(stripe: usize) -> FsConfig {
    FsConfig {
        stripe_size: stripe,
        max_read_ahead: 8 << 20,
        memory_budget: 64 << 20,
        ..FsConfig::default()
    }
}

/// Files of many sizes written through the mount equal what reads back through the mount and
/// what the store holds.
fn sizes_round_trip(m: &Mounted, stripe: usize) {
    let sizes = [0, 1, stripe - 1, stripe, stripe + 1, 40 << 20, 100 << 20];
    std::fs::create_dir(m.path().join("sizes")).unwrap();
    for (i, &len) in sizes.iter().enumerate() {
        let data = pattern(len, i as u64);
        let p = m.path().join(format!("sizes/f{i}"));
        if i % 2 == 0 {
            std::fs::write(&p, &data).unwrap();
        } else {
            let mut f = std::fs::File::create(&p).unwrap();
            for chunk in data.chunks(100_000) {
                f.write_all(chunk).unwrap();
            }
            f.sync_all().unwrap();
        }
        assert_eq!(
            std::fs::metadata(&p).unwrap().len(),
            len as u64,
            "size of f{i}"
        );
        assert!(
            std::fs::read(&p).unwrap() == data,
            "f{i} ({len} B) through the mount"
        );
        assert!(
            m.get(&format!("sizes/f{i}")) == data,
            "f{i} ({len} B) in the store"
        );
    }
    let mut names: Vec<String> = std::fs::read_dir(m.path().join("sizes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["f0", "f1", "f2", "f3", "f4", "f5", "f6"]);
}

/// A child started while a file is being written gets a copy of its descriptor and closes it
/// when it execs (close-on-exec), which commits the file so far; the writer goes on and its own
/// close publishes the whole file.
fn write_across_a_child_exec(m: &Mounted, stripe: usize) {
    let data = pattern(2 * stripe + 12_345, 42);
    let p = m.path().join("forked");
    let mut f = std::fs::File::create(&p).unwrap();
    // Once while the file is held in memory, once after it began streaming.
    let mut written = 0;
    for end in [stripe / 2, stripe + 1] {
        f.write_all(&data[written..end]).unwrap();
        written = end;
        assert!(Command::new("true").status().unwrap().success());
        assert!(
            m.get("forked") == data[..end],
            "the child's close published the file so far"
        );
    }
    f.write_all(&data[stripe + 1..]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    assert!(std::fs::read(&p).unwrap() == data, "through the mount");
    assert!(m.get("forked") == data, "in the store");
}

fn namespace_and_refusals(m: &Mounted) {
    let root = m.path();
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    std::fs::write(root.join("a/b/x"), b"x").unwrap();
    std::fs::rename(root.join("a/b/x"), root.join("a/y")).unwrap();
    assert_eq!(std::fs::read(root.join("a/y")).unwrap(), b"x");
    assert_eq!(m.get("a/y"), b"x");
    std::fs::remove_dir(root.join("a/b")).unwrap();
    let err = std::fs::remove_dir(root.join("a")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTEMPTY), "{err}");
    // Overwriting in place (no O_TRUNC) is refused; with O_TRUNC it replaces the object.
    let err = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("a/y"))
        .unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    std::fs::write(root.join("a/y"), b"replaced").unwrap();
    assert_eq!(m.get("a/y"), b"replaced");
    std::fs::remove_file(root.join("a/y")).unwrap();
    assert_eq!(
        std::fs::metadata(root.join("a/y")).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Objects written by other tools appear.
    let store = m.store();
    m.rt.as_ref()
        .unwrap()
        .block_on(store.put("outside/obj", bytes::Bytes::from_static(b"hi")))
        .unwrap();
    assert_eq!(std::fs::read(root.join("outside/obj")).unwrap(), b"hi");
}

/// Runs python3 `script` with `args`; a failure shows its output under `what`.
fn python(what: &str, script: &str, args: &[&Path]) {
    let out = Command::new("python3")
        .args(["-c", script])
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python {what} through the mount: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn python_zipfile(m: &Mounted) {
    let zip = m.path().join("archive.zip");
    let member = m.path().join("member.bin");
    std::fs::write(&member, pattern(300_000, 9)).unwrap();
    let script = r#"
import sys, zipfile
zf = zipfile.ZipFile(sys.argv[1], "w", compression=zipfile.ZIP_DEFLATED)
zf.writestr("a.txt", "hello " * 1000)
zf.write(sys.argv[2], "member.bin")
with zf.open("streamed.bin", "w") as f:
    for i in range(10):
        f.write(bytes([i]) * 10000)
zf.close()
zf = zipfile.ZipFile(sys.argv[1])
assert zf.testzip() is None
assert zf.read("a.txt") == b"hello " * 1000
assert zf.read("member.bin") == open(sys.argv[2], "rb").read()
assert zf.read("streamed.bin") == b"".join(bytes([i]) * 10000 for i in range(10))
print("zip ok")
"#;
    python("zipfile", script, &[&zip, &member]);
    assert_eq!(m.get("archive.zip"), std::fs::read(&zip).unwrap());
}

/// A ~30 MiB archive whose members are larger than a stripe: zipfile seeks back to patch each
/// member's header after streaming it, long after the first stripe was uploaded.
fn python_zipfile_large(m: &Mounted) {
    let zip = m.path().join("large.zip");
    let script = r#"
import random, sys, zipfile
def body(seed, n):
    return random.Random(seed).randbytes(n)
members = [("big1.bin", 1, 12 << 20, zipfile.ZIP_STORED),
           ("small.txt", 2, 100_000, zipfile.ZIP_DEFLATED),
           ("mid.bin", 3, 5 << 20, zipfile.ZIP_DEFLATED),
           ("tail.bin", 5, 3 << 20, zipfile.ZIP_STORED)]
src = sys.argv[2] + "/big1.src"
with open(src, "wb") as f:
    f.write(body(1, 12 << 20))
with zipfile.ZipFile(sys.argv[1], "w") as zf:
    for name, seed, n, comp in members:
        if name == "big1.bin":
            zf.write(src, name, compress_type=comp)
        else:
            zf.writestr(zipfile.ZipInfo(name), body(seed, n), compress_type=comp)
    with zf.open("streamed.bin", "w", force_zip64=True) as f:
        for i in range(10):
            f.write(body(100 + i, 1 << 20))
with zipfile.ZipFile(sys.argv[1]) as zf:
    assert zf.testzip() is None
    for name, seed, n, _ in members:
        assert zf.read(name) == body(seed, n), name
    assert zf.read("streamed.bin") == b"".join(body(100 + i, 1 << 20) for i in range(10))
print("large zip ok")
"#;
    let scratch = tempfile::tempdir().unwrap();
    python("zipfile (large)", script, &[&zip, scratch.path()]);
    let through_mount = std::fs::read(&zip).unwrap();
    assert!(through_mount.len() > 30 << 20, "{}", through_mount.len());
    assert!(m.get("large.zip") == through_mount, "store and mount agree");
    let fs = m.handle.as_ref().unwrap().fs();
    assert_eq!(fs.spill_space().used(), 0, "spill files go at close");
    assert!(fs.spill_space().peak() > 0);
}

/// Mounts `store` with `stripe`-byte stripes and runs every check that holds whatever the store:
/// the kernel's read-ahead window, then the checks above in turn. Returns the mount for checks of
/// the store's own.
fn mount_and_check(store: Store, stripe: usize) -> Mounted {
    let m = Mounted::new(store, config(stripe));
    assert_eq!(
        hotstart_fuse::bdi::read_ahead(m.path()).unwrap(),
        MountConfig::default().kernel_read_ahead.unwrap(),
        "the kernel reads ahead by the configured window, not its 128 KiB default"
    );
    sizes_round_trip(&m, stripe);
    write_across_a_child_exec(&m, stripe);
    namespace_and_refusals(&m);
    python_zipfile(&m);
    python_zipfile_large(&m);
    m
}

#[test]
fn local_directory_store() {
    let store_dir = tempfile::tempdir().unwrap();
    let store = Store::open(store_dir.path().to_str().unwrap()).unwrap();
    let m = mount_and_check(store, 1 << 20);
    let budget = m.handle.as_ref().unwrap().fs().budget();
    assert!(budget.peak() <= budget.capacity());
    // The store directory holds plain files: any tool reads them.
    assert_eq!(
        std::fs::read(store_dir.path().join("sizes/f5")).unwrap(),
        pattern(40 << 20, 5)
    );
    assert!(std::fs::read(store_dir.path().join("sizes/f6")).unwrap() == pattern(100 << 20, 6));

    // Names a directory store cannot hold are refused when the file is made (EINVAL), not at
    // its close with an I/O error after the bytes were written; a name just under the limit
    // and one whose '#' is followed by more than digits are stored.
    for (name, ok) in [
        ("ckpt#1", false),
        ("a#12", false),
        ("b#1x", true),
        ("c#d#1", true),
        (&"n".repeat(251)[..], false),
        (&"m".repeat(250)[..], true),
    ] {
        let path = m.path().join(name);
        match std::fs::write(&path, b"bytes") {
            Ok(()) => {
                assert!(ok, "{name} was accepted");
                assert_eq!(
                    std::fs::read(store_dir.path().join(name)).unwrap(),
                    b"bytes"
                );
            }
            Err(e) => {
                assert!(!ok, "{name}: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{name}: {e}");
                assert!(!path.exists());
            }
        }
    }
}

#[test]
fn seaweedfs_store() {
    let Some(weed) = SeaweedFs::shared() else {
        return;
    };
    let bucket = weed.fresh_bucket("fuse-mount");

    let store = Store::open_with(&format!("{bucket}/m"), &weed.client_options()).unwrap();
    mount_and_check(store, 5 << 20);
}

/// Aborts the FUSE connection of the mount at `mountpoint` through fusectl, as a watchdog does
/// when requests hang: every pending and later request fails at once. Returns whether it could.
fn abort_connection(mountpoint: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    // "<id> <parent> <major>:<minor> <root> <mountpoint> ..."; the connection is the minor.
    let conn = info.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(4).map(Path::new) == Some(mountpoint)).then(|| f[2].split(':').nth(1))?
    });
    conn.is_some_and(|c| std::fs::write(format!("/sys/fs/fuse/connections/{c}/abort"), "1").is_ok())
}

/// Eight readers of `big` and three writers of 12 MiB files under `root`, all at once; every
/// byte checked.
fn readers_and_writers(root: &Path, big: &[u8]) {
    let start = std::sync::Barrier::new(11);
    std::thread::scope(|s| {
        for r in 0..8 {
            let start = &start;
            s.spawn(move || {
                use std::io::Read;
                let mut f = std::fs::File::open(root.join("big")).unwrap();
                start.wait();
                let mut buf = vec![0u8; [64 << 10, 1 << 20, 300_001][r % 3]];
                let mut off = 0;
                loop {
                    let n = f.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    assert!(buf[..n] == big[off..off + n], "reader {r} at {off}");
                    off += n;
                }
                assert_eq!(off, big.len(), "reader {r} read it all");
            });
        }
        for w in 0..3 {
            let start = &start;
            s.spawn(move || {
                let data = pattern(12 << 20, 100 + w);
                let mut f = std::fs::File::create(root.join(format!("w{w}"))).unwrap();
                start.wait();
                for chunk in data.chunks(1 << 20) {
                    f.write_all(chunk).unwrap();
                }
                drop(f);
                assert!(std::fs::read(root.join(format!("w{w}"))).unwrap() == data);
            });
        }
    });
}

/// Eight readers of one 32 MiB file and three writers of other files at once, in a memory
/// budget far below what their read-ahead windows would like to hold (16 MiB against 8 × 2
/// windows of up to 8 MiB): every byte is right, the budget holds, and nothing stalls. The
/// readers share the file's page cache, so the kernel often serves one reader through another's
/// handle and leaves handles idle with read-ahead in them; demand reads must take that memory
/// back rather than wait for it (this run once hung with every request unanswered).
#[test]
fn concurrent_readers_and_writers() {
    let store_dir = tempfile::tempdir().unwrap();
    let big = pattern(32 << 20, 77);
    std::fs::write(store_dir.path().join("big"), &big).unwrap();
    let store = Store::open(store_dir.path().to_str().unwrap()).unwrap();
    let m = Mounted::new(
        store,
        FsConfig {
            stripe_size: 1 << 20,
            max_read_ahead: 8 << 20,
            memory_budget: 16 << 20,
            ..FsConfig::default()
        },
    );
    let root = m.path().to_path_buf();
    let (done, finished) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        readers_and_writers(&root, &big);
        let _ = done.send(());
    });
    match finished.recv_timeout(std::time::Duration::from_secs(180)) {
        Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(panic) = worker.join() {
                std::panic::resume_unwind(panic);
            }
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            // Fail the stuck requests (ENOTCONN) so the readers, writers and unmount can finish.
            let aborted = abort_connection(m.path());
            panic!("stalled: requests unanswered for 3 minutes (connection aborted: {aborted})");
        }
    }
    for w in 0..3 {
        let stored = std::fs::read(store_dir.path().join(format!("w{w}"))).unwrap();
        assert!(stored == pattern(12 << 20, 100 + w), "w{w} in the store");
    }
    let budget = m.handle.as_ref().unwrap().fs().budget().clone();
    assert!(budget.peak() > 0);
    assert!(
        budget.peak() <= budget.capacity(),
        "peak {} of {}",
        budget.peak(),
        budget.capacity()
    );
    // release() reaches the filesystem after close() returns: wait for the last permits.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while budget.in_use() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(budget.in_use(), 0, "every handle gave its memory back");
}

/// Run as a child process by `stale_mount_after_a_crash_is_cleared` (through the test binary):
/// mounts, signals readiness, then waits to be SIGKILLed.
#[test]
fn crash_helper() {
    let Ok(spec) = std::env::var("HOTSTART_CRASH_HELPER") else {
        return;
    };
    let mut parts = spec.split('|');
    let (Some(store), Some(mp), Some(ready)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("bad HOTSTART_CRASH_HELPER {spec:?}");
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = Store::open(store).unwrap();
    let handle = hotstart_fuse::mount(
        store,
        Path::new(mp),
        MountConfig::default(),
        rt.handle().clone(),
    )
    .unwrap();
    std::fs::write(ready, b"").unwrap();
    std::thread::sleep(std::time::Duration::from_secs(60));
    drop(handle);
}

#[test]
fn stale_mount_after_a_crash_is_cleared() {
    if std::env::var("HOTSTART_CRASH_HELPER").is_ok() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store_dir = tempfile::tempdir().unwrap();
    let ready_dir = tempfile::tempdir().unwrap();
    let ready = ready_dir.path().join("ready");
    let spec = format!(
        "{}|{}|{}",
        store_dir.path().display(),
        dir.path().display(),
        ready.display()
    );
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_helper", "--nocapture"])
        .env("HOTSTART_CRASH_HELPER", spec)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !ready.exists() {
        assert!(std::time::Instant::now() < deadline, "helper did not mount");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let err = std::fs::metadata(dir.path()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOTCONN), "{err}");
    let store = Store::open(store_dir.path().to_str().unwrap()).unwrap();
    let m = Mounted::new(store, config(1 << 20));
    std::fs::write(m.path().join("after"), b"ok").unwrap();
    assert_eq!(m.get("after"), b"ok");
    drop(m);
    // Whatever this test leaves at the directory is detached before the tempdir goes.
    let _ = Command::new("fusermount3")
        .arg("-uz")
        .arg(dir.path())
        .output();
}
