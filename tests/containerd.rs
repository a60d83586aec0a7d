//! `hotstart snapshotter` under a real containerd and runc: an OCI image (built here from this
//! machine's `sh` and `cat` and their libraries) is imported and unpacked through the
//! snapshotter, and containers run from it print what its layers hold, whiteouts applied. The
//! snapshotter is killed and restarted: containerd's snapshots are still served, and containers
//! still run. Removing the image removes the snapshots' directories.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use hotstart_testkit::{Containerd, spawn_tied};
use serde_json::json;
use sha2::{Digest, Sha256};

const IMAGE: &str = "hotstart.test/base:1";

fn sha256(data: &[u8]) -> String {
    let hex: String = Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

/// An uncompressed layer tarball: directories, then `files` (path, mode, bytes).
fn layer(files: &[(String, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut dirs = std::collections::BTreeSet::new();
    for (path, _, _) in files {
        let mut p = Path::new(path).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(d.to_path_buf());
            p = d.parent();
        }
    }
    for d in dirs {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, format!("{}/", d.display()), std::io::empty())
            .unwrap();
    }
    for (path, mode, data) in files {
        let mut h = tar::Header::new_ustar();
        h.set_mode(*mode);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data.as_slice()).unwrap();
    }
    b.into_inner().unwrap()
}

/// This machine's `sh` and `cat` with the libraries they load, at the same paths.
fn programs() -> Vec<(String, u32, Vec<u8>)> {
    let mut paths = vec!["/bin/sh".to_string(), "/bin/cat".to_string()];
    for bin in ["/bin/sh", "/bin/cat"] {
        let out = hotstart_testkit::run_ok(Command::new("ldd").arg(bin));
        for line in out.lines() {
            let lib = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next(),
                None => line.split_whitespace().next(),
            };
            if let Some(lib) = lib.filter(|l| l.starts_with('/'))
                && !paths.iter().any(|p| p == lib)
            {
                paths.push(lib.to_string());
            }
        }
    }
    paths
        .into_iter()
        .map(|p| {
            let data = std::fs::read(&p).unwrap();
            (p.trim_start_matches('/').to_string(), 0o755, data)
        })
        .collect()
}

/// An OCI archive of a two-layer image named [`IMAGE`], whose command prints what the layers
/// hold; returns its path and the bytes it should print.
fn image_archive(dir: &Path) -> (PathBuf, String) {
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
    let two = vec![
        (
            "data/hello.txt".into(),
            0o644,
            b"hello from layer two\n".to_vec(),
        ),
        ("etc/.wh.gone".into(), 0o644, Vec::new()),
    ];
    let layers = [layer(&one), layer(&two)];
    let mut blobs: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |data: Vec<u8>| {
        let d = sha256(&data);
        let size = data.len();
        blobs.push((d.clone(), data));
        (d, size)
    };
    let diff_ids: Vec<String> = layers.iter().map(|l| sha256(l)).collect();
    let script = "cat /etc/greeting /data/hello.txt; \
                  if [ -e /etc/gone ]; then echo gone-still-there; else echo gone-is-gone; fi; \
                  cat /data/big > /data/copy && cat /data/copy";
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "-c", script]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let (cd, cs) = add(serde_json::to_vec(&config).unwrap());
    let layer_descs: Vec<_> = layers
        .iter()
        .map(|l| {
            let (d, s) = add(l.clone());
            json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": s})
        })
        .collect();
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs},
        "layers": layer_descs,
    });
    let (md, ms) = add(serde_json::to_vec(&manifest).unwrap());
    let index = json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
            "annotations": {"io.containerd.image.name": IMAGE, "org.opencontainers.image.ref.name": "1"},
        }],
    });
    let mut b = tar::Builder::new(Vec::new());
    let mut put = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_ustar();
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, name, data).unwrap();
    };
    put("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#);
    put("index.json", &serde_json::to_vec(&index).unwrap());
    for (d, data) in &blobs {
        put(
            &format!("blobs/sha256/{}", d.trim_start_matches("sha256:")),
            data,
        );
    }
    let path = dir.join("image.tar");
    std::fs::write(&path, b.into_inner().unwrap()).unwrap();
    let expect = format!("hello from layer one\nhello from layer two\ngone-is-gone\n{big}");
    (path, expect)
}

struct Snapshotter {
    child: Child,
    root: PathBuf,
    socket: PathBuf,
}

impl Snapshotter {
    fn start(root: &Path, socket: &Path) -> Snapshotter {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hotstart"));
        cmd.arg("snapshotter")
            .arg("--root")
            .arg(root)
            .arg("--socket")
            .arg(socket);
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
        }
    }

    fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// The snapshots its metadata file names: (key, kind, parent).
    fn recorded(&self) -> Vec<(String, String, String)> {
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(self.root.join("metadata.json")).unwrap())
                .unwrap();
        m["snapshots"]
            .as_object()
            .unwrap()
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

fn run_container(c: &Containerd, id: &str) -> String {
    c.ctr_ok(&["run", "--rm", "--snapshotter", "hotstart", IMAGE, id])
}

#[test]
fn containerd_unpacks_and_runs_images_through_the_snapshotter_across_its_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("snapshotter.sock");
    let mut sn = Snapshotter::start(&dir.path().join("state"), &socket);
    let Some(c) = Containerd::start("hotstart", &socket) else {
        return;
    };
    let (archive, expect) = image_archive(dir.path());
    c.ctr_ok(&[
        "images",
        "import",
        "--snapshotter",
        "hotstart",
        archive.to_str().unwrap(),
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

    assert_eq!(run_container(&c, "first"), expect);

    // Killed and restarted: every snapshot containerd knows of is still served.
    sn.kill();
    let failed = c.ctr(&["run", "--rm", "--snapshotter", "hotstart", IMAGE, "down"]);
    assert!(!failed.status.success(), "ran with the snapshotter down");
    let sn = Snapshotter::start(&sn.root.clone(), &sn.socket.clone());
    // containerd redials a proxy plugin with a backoff (at most 3 s in containerd 1.6): until
    // then its calls fail as unavailable.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let out = c.ctr(&["run", "--rm", "--snapshotter", "hotstart", IMAGE, "second"]);
        if out.status.success() {
            assert_eq!(String::from_utf8_lossy(&out.stdout), expect);
            break;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("unavailable") && Instant::now() < deadline,
            "{err}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
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
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sn.recorded().is_empty() {
        assert!(Instant::now() < deadline, "left: {:?}", sn.recorded());
        std::thread::sleep(Duration::from_millis(100));
    }
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
