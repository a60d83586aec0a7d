//! End-to-end: the nodes of a job restore one environment at the same moment and share its
//! chunks through their sidecars, on a real network of Linux namespaces (one per node and one
//! for SeaweedFS, joined by a bridge, the store's link shaped with `tc`).
//!
//! Asserts, on the bytes the store's link really sent: with sharing, three nodes cost the store
//! about one node's reads, against three without; every node's environment equals the one
//! captured, file by file. Then the faults: a peer killed while the others restore (they finish
//! from the next owner or the store, equal), a node whose sidecar is gone (it reads the store
//! itself), and a peer that sends corrupt pieces (caught, counted, avoided after its first bad
//! piece, nothing wrong written anywhere).
//!
//! Needs root and iproute2 for the namespaces (CI runs as root and must run it); elsewhere it
//! says why it skips.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hotstart_testkit::swarm::{Shape, SwarmNet};
use hotstart_testkit::{SeaweedFs, get, spawn_tied, terminate, workspace_root};

const NODES: usize = 3;
const PEER_PORT: u16 = 7070;
const HTTP_PORT: u16 = 7071;

/// Writes the test environment into `$HOTSTART_ENV_TARGET`: 12 files of 1 MiB and 300 small
/// ones, random (so compression does not shrink them) from a fixed seed.
const INSTALL: &str = r#"
import os, random
t = os.environ["HOTSTART_ENV_TARGET"]
r = random.Random(53)
os.makedirs(os.path.join(t, "lib", "small"), exist_ok=True)
for i in range(12):
    with open(os.path.join(t, "lib", f"big{i}.so"), "wb") as f:
        f.write(r.randbytes(1 << 20))
for i in range(300):
    with open(os.path.join(t, "lib", "small", f"m{i}.py"), "wb") as f:
        f.write(r.randbytes(r.randint(1000, 16000)))
"#;

fn python() -> PathBuf {
    workspace_root().unwrap().join(".venv/bin/python")
}

/// Every file under `dir`: its mode and the BLAKE3 of its bytes.
fn tree(dir: &Path) -> BTreeMap<PathBuf, (u32, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, (u32, String)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                walk(root, &p, out);
            } else {
                let data = std::fs::read(&p).unwrap();
                let rel = p.strip_prefix(root).unwrap().to_path_buf();
                let mode = meta.permissions().mode() & 0o7777;
                out.insert(rel, (mode, blake3::hash(&data).to_hex().to_string()));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

struct Swarm {
    net: SwarmNet,
    weed: SeaweedFs,
    work: tempfile::TempDir,
    store: String,
    lock: PathBuf,
    sidecars: Vec<Option<Child>>,
}

impl Swarm {
    fn node_http(&self, i: usize) -> SocketAddr {
        SocketAddr::from((self.net.node_ip(i), HTTP_PORT))
    }

    fn socket(&self, i: usize) -> PathBuf {
        self.work.path().join(format!("n{i}.sock"))
    }

    fn hotstart(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_hotstart"));
        c.envs(self.weed.env())
            .env("HOTSTART_ENV_PYTHON", python())
            .env_remove("HOTSTART_SHARE")
            .stdin(Stdio::null());
        c
    }

    fn start_sidecar(&mut self, i: usize, corrupt: bool) {
        let peers: Vec<String> = (0..NODES)
            .filter(|&j| j != i)
            .map(|j| format!("n{j}={}:{PEER_PORT}", self.net.node_ip(j)))
            .collect();
        let ip = self.net.node_ip(i);
        let log = std::fs::File::create(self.work.path().join(format!("n{i}.log"))).unwrap();
        let mut c = self.hotstart();
        c.args(["serve", "--node-id", &format!("n{i}")])
            .args(["--listen", &format!("{ip}:{PEER_PORT}")])
            .args(["--http", &format!("{ip}:{HTTP_PORT}")])
            .arg("--socket")
            .arg(self.socket(i))
            .args(["--peers", &peers.join(",")])
            .arg("--tls-dir")
            .arg(self.work.path().join(format!("tls/n{i}")))
            .arg("--token-file")
            .arg(self.work.path().join("token"))
            .args(["--memory-budget", "256MiB", "--probe-interval", "1s"])
            .args(["--peer-timeout", "5s"])
            .env("HOTSTART_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if corrupt {
            c.env("HOTSTART_FAULT_CORRUPT_SHARED", "1");
        }
        let child = spawn_tied(c, Some(&self.net.node_ns(i))).unwrap();
        self.sidecars[i] = Some(child);
    }

    fn stop_sidecar(&mut self, i: usize, kill: bool) {
        if let Some(mut c) = self.sidecars[i].take() {
            if kill {
                let _ = c.kill();
                let _ = c.wait();
            } else {
                terminate(&mut c, Duration::from_secs(10));
            }
        }
    }

    /// Stops every sidecar and starts it again, empty (node 2's sending corrupt pieces when
    /// `corrupt`), and waits until they see each other.
    fn restart_all(&mut self, corrupt: bool) {
        for i in 0..NODES {
            self.stop_sidecar(i, false);
        }
        for i in 0..NODES {
            self.start_sidecar(i, corrupt && i == 2);
        }
        self.wait_peers();
    }

    /// A metric of node `i`'s sidecar (0 when absent).
    fn metric(&self, i: usize, sample: &str) -> f64 {
        let page = get(self.node_http(i), "/metrics", Duration::from_secs(5))
            .map(|r| r.text())
            .unwrap_or_default();
        page.lines()
            .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// Waits until every running sidecar sees every other running one up.
    fn wait_peers(&self) {
        let running: Vec<usize> = (0..NODES).filter(|&i| self.sidecars[i].is_some()).collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        for &i in &running {
            while self.metric(i, "hotstart_peers{state=\"up\"}") < (running.len() - 1) as f64 {
                assert!(Instant::now() < deadline, "n{i} never saw its peers up");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Starts `hotstart env ensure` on node `i` into a fresh target and cache (`tag` names
    /// them), sharing through the node's sidecar when `share`.
    fn ensure(&self, i: usize, tag: &str, share: bool) -> Child {
        let dir = self.work.path().join(format!("{tag}/n{i}"));
        let mut c = self.hotstart();
        c.args([
            "env",
            "ensure",
            "--relocatable",
            "--json",
            "--store",
            &self.store,
        ])
        .arg("--lock")
        .arg(&self.lock)
        .arg("--target")
        .arg(dir.join("env"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        // The install command enters the key: the capture's, never run on a hit.
        .arg("--")
        .arg(python())
        .args(["-c", INSTALL])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        if share {
            c.env("HOTSTART_SHARE", self.socket(i));
        }
        spawn_tied(c, Some(&self.net.node_ns(i))).unwrap()
    }

    /// Runs ensures on `nodes` at once; the bytes the store's link sent meanwhile.
    fn round(&self, tag: &str, nodes: &[usize], share: bool, reference: &Tree) -> u64 {
        let before = self.net.store_sent().unwrap();
        let children: Vec<(usize, Child)> = nodes
            .iter()
            .map(|&i| (i, self.ensure(i, tag, share)))
            .collect();
        self.finish(tag, children, reference);
        self.net.store_sent().unwrap() - before
    }

    /// Waits for ensures and checks that each restored the environment whole.
    fn finish(&self, tag: &str, children: Vec<(usize, Child)>, reference: &Tree) {
        for (i, c) in children {
            let out = c.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{tag}: ensure on n{i} failed: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let got = tree(&self.work.path().join(format!("{tag}/n{i}/env")));
            assert_eq!(&got, reference, "{tag}: n{i}'s environment differs");
        }
    }
}

type Tree = BTreeMap<PathBuf, (u32, String)>;

#[test]
fn nodes_share_an_environment_through_their_sidecars() {
    if let Some(why) = SwarmNet::unavailable() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the swarm test, but {why}"
        );
        eprintln!("skipping the swarm test: {why}");
        return;
    }
    // The store sends 200 Mbit/s (25 MB/s): sharing shows in the bytes, and a restore lasts
    // long enough to kill a peer during it.
    let net = SwarmNet::up(
        NODES,
        Shape {
            store_mbit: Some(200),
            node_mbit: None,
        },
    )
    .unwrap();
    let weed = SeaweedFs::start_in_netns(&net.store_ns(), net.store_ip()).unwrap();
    let store = format!("{}/envs", weed.fresh_bucket("swarm"));
    let work = tempfile::tempdir().unwrap();
    let lock = work.path().join("requirements.txt");
    std::fs::write(&lock, "swarm-test==1\n").unwrap();
    std::fs::write(
        work.path().join("token"),
        "swarm test token 0123456789abcdef",
    )
    .unwrap();
    let nodes: Vec<String> = (0..NODES).map(|i| format!("n{i}")).collect();
    let tls = Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(["tls", "init"])
        .arg(work.path().join("tls"))
        .args(&nodes)
        .status()
        .unwrap();
    assert!(tls.success());
    let mut s = Swarm {
        net,
        weed,
        work,
        store,
        lock,
        sidecars: (0..NODES).map(|_| None).collect(),
    };

    // Capture, from this process over the bridge.
    let capture = s.work.path().join("capture/env");
    let out = s
        .hotstart()
        .args([
            "env",
            "ensure",
            "--relocatable",
            "--json",
            "--store",
            &s.store,
        ])
        .arg("--lock")
        .arg(&s.lock)
        .arg("--target")
        .arg(&capture)
        .arg("--cache-dir")
        .arg(s.work.path().join("capture/cache"))
        .arg("--")
        .arg(python())
        .args(["-c", INSTALL])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = tree(&capture);
    assert_eq!(reference.len(), 312);

    for i in 0..NODES {
        s.start_sidecar(i, false);
    }
    s.wait_peers();
    let all: Vec<usize> = (0..NODES).collect();

    // Every node from the store, then every node sharing.
    let alone = s.round("alone", &all, false, &reference);
    let shared = s.round("shared", &all, true, &reference);
    let one = alone as f64 / NODES as f64;
    eprintln!(
        "store sent {alone} bytes to {NODES} nodes reading alone, {shared} sharing ({:.2}x one node's)",
        shared as f64 / one
    );
    assert!(
        (shared as f64) < 1.25 * one,
        "sharing: the store sent {shared} bytes, one node alone reads {one:.0}"
    );
    let from_peers: f64 = (0..NODES)
        .map(|i| {
            s.metric(
                i,
                "hotstart_share_bytes_total{artifact=\"env\",source=\"peer\"}",
            )
        })
        .sum();
    let served: f64 = (0..NODES)
        .map(|i| s.metric(i, "hotstart_share_served_bytes_total{artifact=\"env\"}"))
        .sum();
    assert!(
        from_peers > 0.0 && from_peers == served,
        "{from_peers} from peers, {served} served"
    );

    // A peer killed while the others restore: they finish, from the next owner or the store.
    // (Fresh sidecars, so that nothing is cached.)
    s.restart_all(false);
    let children: Vec<(usize, Child)> = [0, 1]
        .iter()
        .map(|&i| (i, s.ensure(i, "kill", true)))
        .collect();
    let from_peer = "hotstart_share_bytes_total{artifact=\"env\",source=\"peer\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.metric(0, from_peer) == 0.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    s.stop_sidecar(2, true);
    s.finish("kill", children, &reference);
    // A node whose sidecar is gone reads the store itself.
    let alone_n2 = s.ensure(2, "nosidecar", true);
    s.finish("nosidecar", vec![(2, alone_n2)], &reference);

    // A peer that corrupts every piece it sends: caught, counted, avoided, nothing wrong kept.
    s.restart_all(true);
    s.round("corrupt", &[0, 1], true, &reference);
    for i in [0, 1] {
        let bad = s.metric(
            i,
            "hotstart_share_peer_failures_total{peer=\"n2\",kind=\"corrupt\"}",
        );
        // Requests already in flight to it when the first bad piece arrived may fail too;
        // none is sent after.
        assert!(
            (1.0..=8.0).contains(&bad),
            "n{i} counted {bad} corrupt pieces from n2"
        );
    }
    for i in 0..NODES {
        s.stop_sidecar(i, false);
    }
}
