//! `hotstart snapshotter` under a real containerd and runc: an OCI image (built here from this
//! machine's `sh` and `cat` and their libraries) is imported and unpacked through the
//! snapshotter, and containers run from it print what its layers hold, whiteouts applied. The
//! snapshotter is killed and restarted: containerd's snapshots are still served, and containers
//! still run. Removing the image removes the snapshots' directories.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use hotstart_testkit::{Containerd, Registry, oci, spawn_tied};

const IMAGE: &str = "hotstart.test/base:1";

/// This machine's `sh` and `cat` with the libraries they load, at the same paths.
fn programs() -> Vec<(String, u32, Vec<u8>)> {
    let bins = [PathBuf::from("/bin/sh"), PathBuf::from("/bin/cat")];
    let mut paths: Vec<String> = bins.iter().map(|b| b.display().to_string()).collect();
    paths.extend(oci::libraries(&bins, None));
    paths
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p.trim_start_matches('/').to_string(), 0o755, data)
        })
        .collect()
}

/// The image every test runs: two layers, the first with `sh`, `cat`, a greeting, a file the
/// second removes and a few MiB of text; its command writes what the layers hold to
/// `/out/stdout` (see [`run`]).
struct TestImage {
    /// The OCI layout.
    layout: PathBuf,
    /// The layers' digests, bottom first.
    layers: Vec<String>,
    /// What the command writes to `/out/stdout`.
    expect: String,
    /// The contents of `/data/big` (in the first layer), which the command copies and writes out.
    big: Vec<u8>,
}

/// Writes [`TestImage`] as an OCI layout in `dir`, named `name`.
fn image_layout(dir: &Path, name: &str) -> TestImage {
    // A few MiB of text, read back through the container's own upper layer.
    let big: String = (0..200_000).map(|i| format!("line {i:07}\n")).collect();
    let mut one = programs();
    one.push((
        "etc/greeting".into(),
        0o644,
        b"hello from layer one\n".to_vec(),
    ));
    one.push(("etc/gone".into(), 0o644, b"removed by layer two\n".to_vec()));
    one.push(("data/big".into(), 0o644, big.clone().into_bytes()));
    one.push((
        "opt/old.txt".into(),
        0o644,
        b"hidden by layer two\n".to_vec(),
    ));
    let two = vec![
        (
            "data/hello.txt".into(),
            0o644,
            b"hello from layer two\n".to_vec(),
        ),
        ("etc/.wh.gone".into(), 0o644, Vec::new()),
        ("opt/.wh..wh..opq".into(), 0o644, Vec::new()),
        (
            "opt/new.txt".into(),
            0o644,
            b"opt from layer two\n".to_vec(),
        ),
    ];
    let script = "exec > /out/stdout 2> /out/stderr; \
                  cat /etc/greeting /data/hello.txt; \
                  if [ -e /etc/gone ]; then echo gone-still-there; else echo gone-is-gone; fi; \
                  if [ -e /opt/old.txt ]; then echo opaque-broken; else cat /opt/new.txt; fi; \
                  cat /data/big > /data/copy && cat /data/copy";
    let layout = oci::write_layout(
        &dir.join("layout"),
        name,
        &["/bin/sh", "-c", script],
        &["PATH=/bin"],
        &[oci::layer_tar(&one), oci::layer_tar(&two)],
        false,
    );
    TestImage {
        layout: layout.dir,
        layers: layout.layers,
        expect: format!(
            "hello from layer one\nhello from layer two\ngone-is-gone\nopt from layer two\n{big}"
        ),
        big: big.into_bytes(),
    }
}

struct Snapshotter {
    child: Child,
    root: PathBuf,
    socket: PathBuf,
    args: Vec<String>,
}

impl Snapshotter {
    fn start(root: &Path, socket: &Path) -> Snapshotter {
        Snapshotter::start_with(root, socket, &[])
    }

    /// Started with more arguments (a store to serve converted layers from).
    fn start_with(root: &Path, socket: &Path, args: &[String]) -> Snapshotter {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hotstart"));
        cmd.arg("snapshotter")
            .arg("--root")
            .arg(root)
            .arg("--socket")
            .arg(socket)
            .args(args);
        // Its log, across restarts, beside its state directory.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(root.with_extension("log"))
            .unwrap();
        cmd.stdout(log.try_clone().unwrap()).stderr(log);
        let mut child = spawn_tied(cmd, None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the snapshotter exited: {status}");
            }
            assert!(Instant::now() < deadline, "the snapshotter did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        Snapshotter {
            child,
            root: root.into(),
            socket: socket.into(),
            args: args.to_vec(),
        }
    }

    /// Killed (-9) and started again with the same arguments.
    fn restart(mut self) -> Snapshotter {
        self.kill();
        Snapshotter::start_with(&self.root.clone(), &self.socket.clone(), &self.args.clone())
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Everything it has logged.
    fn log(&self) -> String {
        std::fs::read_to_string(self.root.with_extension("log")).unwrap_or_default()
    }

    /// Its metadata file's snapshots.
    fn snapshots(&self) -> serde_json::Map<String, serde_json::Value> {
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.root.join("metadata.json")).unwrap())
                .unwrap();
        m["snapshots"].as_object().unwrap().clone()
    }

    /// The images its lazily served layers come from.
    fn lazy(&self) -> Vec<String> {
        self.snapshots()
            .values()
            .filter_map(|r| r["lazy"].as_str().map(String::from))
            .collect()
    }

    /// Waits until its metadata file names no snapshot: containerd's garbage collection
    /// removes them after the images that held them (20 s at most).
    fn wait_unrecorded(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.recorded().is_empty() {
            assert!(Instant::now() < deadline, "left: {:?}", self.recorded());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The snapshots its metadata file names: (key, kind, parent).
    fn recorded(&self) -> Vec<(String, String, String)> {
        self.snapshots()
            .iter()
            .map(|(k, r)| {
                (
                    k.clone(),
                    r["kind"].as_str().unwrap().to_string(),
                    r["parent"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    }
}

impl Drop for Snapshotter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One container run: whether ctr succeeded, ctr's stderr, and what the container wrote. The
/// container writes its output to files in a directory bind-mounted at `/out`, not to ctr's
/// pipes: under load ctr can lose the tail of a short-lived container's output (its copy from
/// the pipes races the task's exit).
struct Ran {
    ok: bool,
    ctr: String,
    stdout: String,
    stderr: String,
}

fn run(c: &Containerd, image: &str, id: &str) -> Ran {
    let out = tempfile::tempdir().unwrap();
    let mount = format!(
        "type=bind,src={},dst=/out,options=rbind:rw",
        out.path().display()
    );
    let o = c.ctr(&[
        "run",
        "--rm",
        "--snapshotter",
        "hotstart",
        "--mount",
        &mount,
        image,
        id,
    ]);
    let read = |f: &str| std::fs::read_to_string(out.path().join(f)).unwrap_or_default();
    Ran {
        ok: o.status.success(),
        ctr: String::from_utf8_lossy(&o.stderr).into_owned(),
        stdout: read("stdout"),
        stderr: read("stderr"),
    }
}

/// Runs a container, which must succeed; returns what it wrote to its stdout.
fn run_container(c: &Containerd, image: &str, id: &str) -> String {
    let r = run(c, image, id);
    assert!(
        r.ok,
        "container {id} failed: {}{}\ncontainerd's log:\n{}",
        r.ctr,
        r.stderr,
        c.log()
    );
    r.stdout
}

/// Runs a container, retrying while containerd redials a restarted snapshotter (a backoff of
/// at most 3 s in containerd 1.6: until then its calls fail as unavailable).
fn run_after_restart(c: &Containerd, image: &str, id: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = run(c, image, id);
        if r.ok {
            return r.stdout;
        }
        assert!(
            r.ctr.contains("unavailable") && Instant::now() < deadline,
            "{}",
            r.ctr
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn containerd_unpacks_and_runs_images_through_the_snapshotter_across_its_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("snapshotter.sock");
    let mut sn = Snapshotter::start(&dir.path().join("state"), &socket);
    let Some(c) = Containerd::start("hotstart", &socket) else {
        return;
    };
    let image = image_layout(dir.path(), IMAGE);
    let tarball = oci::archive(&image.layout);
    c.ctr_ok(&[
        "images",
        "import",
        "--snapshotter",
        "hotstart",
        tarball.to_str().unwrap(),
    ]);

    // Two committed layers, the second on the first, both in the snapshotter's record.
    let committed: Vec<_> = sn
        .recorded()
        .into_iter()
        .filter(|(_, kind, _)| kind == "committed")
        .collect();
    assert_eq!(committed.len(), 2, "{committed:?}");
    assert!(committed.iter().any(|(_, _, parent)| parent.is_empty()));
    assert!(committed.iter().any(|(_, _, parent)| !parent.is_empty()));
    let listed = c.ctr_ok(&["snapshots", "--snapshotter", "hotstart", "ls"]);
    assert_eq!(
        listed.lines().filter(|l| l.contains("Committed")).count(),
        2,
        "{listed}"
    );

    assert_eq!(run_container(&c, IMAGE, "first"), image.expect);

    // Killed and restarted: every snapshot containerd knows of is still served.
    sn.kill();
    let failed = c.ctr(&["run", "--rm", "--snapshotter", "hotstart", IMAGE, "down"]);
    assert!(!failed.status.success(), "ran with the snapshotter down");
    let sn = Snapshotter::start(&sn.root.clone(), &sn.socket.clone());
    assert_eq!(run_after_restart(&c, IMAGE, "second"), image.expect);
    let usage = c.ctr_ok(&["snapshots", "--snapshotter", "hotstart", "usage"]);
    assert!(usage.lines().count() >= 3, "{usage}");

    // Errors come back with containerd's kinds and say what is wrong.
    let out = c.ctr(&[
        "snapshots",
        "--snapshotter",
        "hotstart",
        "prepare",
        "k",
        "no-such-parent",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("not found"), "{err}");

    // The image removed and garbage collected: the snapshots and their directories go.
    c.ctr_ok(&["images", "rm", "--sync", IMAGE]);
    sn.wait_unrecorded();
    assert_eq!(
        std::fs::read_dir(sn.root.join("snapshots"))
            .unwrap()
            .count(),
        0
    );
    let mut buf = String::new();
    std::fs::File::open(sn.root.join("metadata.json"))
        .unwrap()
        .read_to_string(&mut buf)
        .unwrap();
    assert!(buf.contains("\"snapshots\":{}"), "{buf}");
}

/// `hotstart image stats --json --container` of the container image `reference`, once it
/// shows `starts` container starts: a start ends when containerd removes the container's
/// snapshot, which its garbage collector does shortly after the container is deleted.
fn container_stats(store: &Path, reference: &str, starts: usize) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = hotstart_testkit::run_ok(
            Command::new(env!("CARGO_BIN_EXE_hotstart"))
                .args(["image", "stats", "--json", "--store"])
                .arg(store)
                .args(["--container", reference]),
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let n = v["mounts"].as_array().map_or(0, Vec::len);
        if n >= starts || Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The layer digests containerd's content store holds.
/// Removes every image and checks that the snapshotter keeps no snapshot record or directory.
fn remove_images_leaving_nothing(c: &Containerd, sn: &Snapshotter) {
    c.remove_images();
    sn.wait_unrecorded();
    assert_eq!(
        std::fs::read_dir(sn.root.join("snapshots"))
            .unwrap()
            .count(),
        0
    );
}

fn content(c: &Containerd) -> String {
    c.ctr_ok(&["content", "ls", "--quiet"])
}

#[test]
fn converted_layers_are_served_lazily_and_what_cannot_be_is_unpacked() {
    let Some(registry) = Registry::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let name = format!("{}/hotstart/lazy:1", registry.host());
    let image = image_layout(dir.path(), &name);

    // Converted: one image in the store per layer, the layout annotated.
    let store = dir.path().join("store");
    let converted = dir.path().join("converted");
    let out = hotstart_testkit::run_ok(
        Command::new(env!("CARGO_BIN_EXE_hotstart"))
            .args(["image", "convert", "--store"])
            .arg(&store)
            .arg(&image.layout)
            .arg(&converted),
    );
    let layer_images: Vec<String> = image
        .layers
        .iter()
        .map(|d| {
            format!(
                "hotstart-layers/sha256-{}:latest",
                d.trim_start_matches("sha256:")
            )
        })
        .collect();
    for (d, l) in image.layers.iter().zip(&layer_images) {
        assert!(out.contains(&format!("{d} {l}")), "{out}");
    }

    let socket = dir.path().join("sn.sock");
    let cache = dir.path().join("cache");
    let args = vec![
        "--store".to_string(),
        store.display().to_string(),
        "--cache-dir".into(),
        cache.display().to_string(),
    ];
    let sn = Snapshotter::start_with(&dir.path().join("state"), &socket, &args);
    // Pushed to the registry by a containerd of its own: the node's starts with nothing.
    {
        let Some(pusher) = Containerd::start("hotstart", &socket) else {
            return;
        };
        let tarball = oci::archive(&converted);
        pusher.ctr_ok(&["images", "import", "--no-unpack", tarball.to_str().unwrap()]);
        pusher.ctr_ok(&["images", "push", "--plain-http", &name]);
    }
    let Some(c) = Containerd::start_cri("hotstart", &socket, "hotstart", &registry.host()) else {
        return;
    };

    // Pulled as a kubelet pulls, with the snapshotter: both layers mounted from the store,
    // neither downloaded.
    let pull = || c.cri_pull(&name);
    pull();
    let mut lazy = sn.lazy();
    lazy.sort();
    let mut want = layer_images.clone();
    want.sort();
    assert_eq!(lazy, want);
    let held = content(&c);
    for d in &image.layers {
        assert!(
            !held.contains(d.as_str()),
            "layer {d} was downloaded:\n{held}"
        );
    }
    assert_eq!(run_container(&c, &name, "lazy-1"), image.expect);

    // The container's removal ends its start: one report, and what it read first, across
    // both layers, is the image's one profile, while the layers stay mounted.
    let first = container_stats(&store, &name, 1);
    assert_eq!(first["profile"]["runs"], 1, "{first}");
    assert!(first["profile"]["chunks"].as_u64().unwrap() > 0, "{first}");
    let starts = first["mounts"].as_array().unwrap();
    assert_eq!(starts.len(), 1, "{first}");
    assert_eq!(starts[0]["tree"], name.as_str(), "{first}");
    assert!(starts[0]["chunks_read"].as_u64().unwrap() > 0, "{first}");
    // A second start on the same mounts is reported, and leaves the profile as it was.
    assert_eq!(run_container(&c, &name, "lazy-1b"), image.expect);
    let second = container_stats(&store, &name, 2);
    assert_eq!(second["mounts"].as_array().unwrap().len(), 2, "{second}");
    assert_eq!(second["profile"], first["profile"], "{second}");

    // Pulled again on new mounts, the image's profile is replayed before the container reads.
    c.remove_images();
    sn.wait_unrecorded();
    pull();
    assert_eq!(run_container(&c, &name, "lazy-2"), image.expect);
    let third = container_stats(&store, &name, 3);
    let starts = third["mounts"].as_array().unwrap();
    assert_eq!(starts.len(), 3, "{third}");
    assert!(
        starts[2]["prefetched_chunks"].as_u64().unwrap() > 0,
        "the start on new mounts replayed nothing: {third}"
    );
    assert_eq!(third["profile"]["runs"], 2, "{third}");

    // Killed and restarted: the lazy layers are mounted again, containers run again.
    let sn = sn.restart();
    assert_eq!(run_after_restart(&c, &name, "lazy-3"), image.expect);
    c.remove_images();

    // A layer the store does not have is downloaded and unpacked by containerd; the other one
    // is still served lazily, and the container reads both.
    let top = layer_images[1].trim_end_matches(":latest");
    std::fs::remove_dir_all(store.join("images").join(top)).unwrap();
    pull();
    assert_eq!(sn.lazy(), vec![layer_images[0].clone()]);
    let held = content(&c);
    assert!(held.contains(&image.layers[1]), "{held}");
    assert!(!held.contains(&image.layers[0]), "{held}");
    assert_eq!(run_container(&c, &name, "mixed"), image.expect);
    remove_images_leaving_nothing(&c, &sn);

    // The store unreachable during a start (a file where its directory was): containerd
    // downloads and unpacks every layer, the container runs, the log says why, and no
    // half-made lazy snapshot is left behind.
    let away = dir.path().join("store.away");
    std::fs::rename(&store, &away).unwrap();
    std::fs::write(&store, b"not a store").unwrap();
    let logged = sn.log().len();
    pull();
    assert!(sn.lazy().is_empty(), "{:?}", sn.lazy());
    let held = content(&c);
    for d in &image.layers {
        assert!(
            held.contains(d.as_str()),
            "layer {d} was not downloaded:\n{held}"
        );
    }
    assert_eq!(run_container(&c, &name, "unreachable"), image.expect);
    let log = sn.log().split_off(logged);
    assert!(
        log.contains("layer not served lazily; containerd unpacks it")
            && log.contains(&format!("cannot be mounted from {}", store.display()))
            && log.contains("Not a directory"),
        "{log}"
    );
    remove_images_leaving_nothing(&c, &sn);
    std::fs::remove_file(&store).unwrap();
    std::fs::rename(&away, &store).unwrap();

    // A corrupt chunk in the store (the last MiB of /data/big), and no cached copy: the read
    // that needs it fails with EIO inside the container; no wrong byte is served.
    std::fs::remove_dir_all(&cache).unwrap();
    let tail = &image.big[(image.big.len() - 1) / (1 << 20) * (1 << 20)..];
    let hex = blake3::hash(tail).to_hex().to_string();
    let chunk = store.join("chunks").join(&hex[..2]).join(&hex);
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&chunk, bytes).unwrap();
    pull();
    let r = run(&c, &name, "corrupt");
    assert!(!r.ok, "ran to the end over a corrupt chunk");
    assert!(
        r.stderr.contains("Input/output error"),
        "{}\n{}",
        r.stderr,
        r.ctr
    );
    assert!(
        image.expect.starts_with(&r.stdout),
        "served bytes that are not the file's"
    );
    c.remove_images();
}
