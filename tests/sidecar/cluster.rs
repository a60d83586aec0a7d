//! Sidecars and training processes as real processes on loopback.
//!
//! Every cluster gets addresses of its own, `127.A.B.<node + 1>` with A from the process id and
//! B from a counter, so the fixed ports (7070 peers, 7071 HTTP) never collide with another
//! test or test process. Children are tied to this process (they die with it, even on SIGKILL)
//! and killed when dropped.

use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hotstart_sidecar::metrics;
use hotstart_testkit::spawn_tied;

pub const PEER_PORT: u16 = 7070;
pub const HTTP_PORT: u16 = 7071;
/// Watchdog for anything a test waits for.
pub const WATCHDOG: Duration = Duration::from_secs(120);
pub const TOKEN: &str = "test-cluster-token-4f1c";

/// Settings every serve variable could carry in from the environment of the test run.
const SERVE_ENV: &[&str] = &[
    "HOTSTART_CONFIG",
    "HOTSTART_NODE_ID",
    "HOTSTART_DOMAIN",
    "HOTSTART_LISTEN",
    "HOTSTART_SOCKET",
    "HOTSTART_SOCKET_MODE",
    "HOTSTART_HTTP",
    "HOTSTART_PEERS",
    "HOTSTART_PEERS_DNS",
    "HOTSTART_REPLICAS",
    "HOTSTART_MEMORY_BUDGET",
    "HOTSTART_STORE",
    "HOTSTART_DISK_DIR",
    "HOTSTART_CLUSTER_TOKEN",
    "HOTSTART_CLUSTER_TOKEN_FILE",
    "HOTSTART_INSECURE",
    "HOTSTART_GRACE",
    "HOTSTART_RECOVERY_TIMEOUT",
    "HOTSTART_KEEP",
    "HOTSTART_PEER_TIMEOUT",
    "HOTSTART_PROBE_INTERVAL",
    "HOTSTART_STAGE_TIMEOUT",
    "HOTSTART_THREADS",
];

/// A set of sidecars that know each other.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    base: (u8, u8),
    pub size: usize,
    /// Store URL and the environment a client needs for it.
    pub store: Option<(String, Vec<(String, String)>)>,
    /// Arguments every node gets.
    pub args: Vec<String>,
    /// `--memory-budget` of every node.
    pub budget: String,
    /// Environment variables of one node: (node, name, value).
    pub node_env: Vec<(usize, String, String)>,
}

impl Cluster {
    pub fn new(size: usize) -> Cluster {
        static NEXT: AtomicU8 = AtomicU8::new(1);
        let a = 20 + (std::process::id() % 200) as u8;
        let b = NEXT.fetch_add(1, Ordering::Relaxed);
        Cluster {
            dir: tempfile::tempdir().expect("temp dir"),
            base: (a, b),
            size,
            store: None,
            args: Vec::new(),
            budget: "512MiB".into(),
            node_env: Vec::new(),
        }
    }

    pub fn ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(127, self.base.0, self.base.1, i as u8 + 1)
    }

    pub fn id(i: usize) -> String {
        format!("node-{i}")
    }

    pub fn socket(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("node-{i}.sock"))
    }

    /// The arguments of node `i` (disk tier in `disk`).
    fn serve_args(&self, i: usize, disk: &Path) -> Vec<String> {
        let peers: Vec<String> = (0..self.size)
            .filter(|&j| j != i)
            .map(|j| format!("{}={}:{PEER_PORT}", Cluster::id(j), self.ip(j)))
            .collect();
        let mut a: Vec<String> = vec![
            "serve".into(),
            "--node-id".into(),
            Cluster::id(i),
            "--listen".into(),
            format!("{}:{PEER_PORT}", self.ip(i)),
            "--http".into(),
            format!("{}:{HTTP_PORT}", self.ip(i)),
            "--socket".into(),
            self.socket(i).display().to_string(),
            "--disk-dir".into(),
            disk.display().to_string(),
            "--probe-interval".into(),
            "1s".into(),
            "--peer-timeout".into(),
            "10s".into(),
            "--recovery-timeout".into(),
            "20s".into(),
            "--memory-budget".into(),
            self.budget.clone(),
        ];
        if !peers.is_empty() {
            a.push("--peers".into());
            a.push(peers.join(","));
        }
        if let Some((url, _)) = &self.store {
            a.push("--store".into());
            a.push(url.clone());
        }
        a.extend(self.args.iter().cloned());
        a
    }

    /// Starts node `i` (generation `gen` gets a disk directory of its own: a replaced node
    /// starts with an empty disk) and waits until it is ready.
    pub fn start(&self, i: usize, generation: u32) -> Node {
        let node = self.start_unready(i, generation);
        node.wait_ready();
        node
    }

    /// [`Cluster::start`] without waiting: the node may still be recovering.
    pub fn start_unready(&self, i: usize, generation: u32) -> Node {
        let disk = self.dir.path().join(format!("disk-{i}-{generation}"));
        self.spawn(i, &self.serve_args(i, &disk), true, generation)
    }

    /// Spawns `hotstart` with `args` as node `i`; with `token`, in a cluster with the token.
    pub fn spawn(&self, i: usize, args: &[String], token: bool, generation: u32) -> Node {
        let log = self.dir.path().join(format!("node-{i}-{generation}.log"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hotstart"));
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"));
        for k in SERVE_ENV {
            cmd.env_remove(k);
        }
        cmd.env("HOTSTART_LOG", "info");
        if token {
            cmd.env("HOTSTART_CLUSTER_TOKEN", TOKEN);
        }
        if let Some((_, env)) = &self.store {
            cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        }
        for (_, k, v) in self.node_env.iter().filter(|e| e.0 == i) {
            cmd.env(k, v);
        }
        let child = spawn_tied(cmd, None).expect("spawn hotstart serve");
        Node {
            child: Some(child),
            log,
            http: SocketAddr::from((self.ip(i), HTTP_PORT)),
            peer: SocketAddr::from((self.ip(i), PEER_PORT)),
            socket: self.socket(i),
        }
    }

    /// Starts every node (in parallel: they find each other while they recover).
    pub fn start_all(&self) -> Vec<Node> {
        self.start_all_as(0)
    }

    /// [`Cluster::start_all`] as generation `generation` (empty disks for a new one).
    pub fn start_all_as(&self, generation: u32) -> Vec<Node> {
        let nodes: Vec<Node> = (0..self.size)
            .map(|i| self.start_unready(i, generation))
            .collect();
        for n in &nodes {
            n.wait_ready();
        }
        nodes
    }
}

/// A running sidecar.
pub struct Node {
    child: Option<Child>,
    pub log: PathBuf,
    pub http: SocketAddr,
    pub peer: SocketAddr,
    pub socket: PathBuf,
}

impl Node {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn get(&self, path: &str) -> std::io::Result<hotstart_testkit::Response> {
        hotstart_testkit::get(self.http, path, Duration::from_secs(10))
    }

    /// Waits until the log holds `what`; panics with the log if the watchdog fires.
    pub fn wait_for_log(&self, what: &str) {
        let deadline = Instant::now() + WATCHDOG;
        while !self.log().contains(what) {
            assert!(
                Instant::now() < deadline,
                "no {what:?} in the log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for `/readyz`; panics with the log if the process exits or the watchdog fires.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + WATCHDOG;
        loop {
            if matches!(self.get("/readyz"), Ok(r) if r.status == 200) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sidecar never ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn metrics(&self) -> String {
        let r = self.get("/metrics").expect("GET /metrics");
        assert_eq!(r.status, 200);
        r.text()
    }

    /// One sample of `/metrics`, e.g. `hotstart_restores_total{source="memory"}`.
    pub fn metric(&self, name: &str) -> f64 {
        let page = self.metrics();
        metrics::sample(&page, name).unwrap_or_else(|| panic!("no {name} in\n{page}"))
    }

    /// Waits until the sample `name` reads `want` (watchdog: panics with the page).
    pub fn wait_metric(&self, name: &str, want: f64) {
        let deadline = Instant::now() + WATCHDOG;
        while self.metric(name) != want {
            assert!(
                Instant::now() < deadline,
                "{name} never reached {want}:\n{}",
                self.metrics()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then waits for the exit (watchdog: SIGKILL and panic).
    pub fn sigterm(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let pid = libc::pid_t::try_from(c.id()).expect("pid");
        let t = Instant::now();
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        loop {
            if let Some(status) = c.try_wait().expect("wait") {
                return status;
            }
            if t.elapsed() > WATCHDOG {
                let _ = c.kill();
                panic!("sidecar ignored SIGTERM:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to exit by itself.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let mut c = self.child.take().expect("running");
        let t = Instant::now();
        loop {
            if let Some(status) = c.try_wait().expect("wait") {
                return status;
            }
            if t.elapsed() > WATCHDOG {
                let _ = c.kill();
                panic!("hotstart did not exit:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A training process of this node: `sidecar trainer <args>` with `HOTSTART_SOCKET`.
    pub fn trainer(&self, args: &[&str]) -> Trainer {
        Trainer::spawn(&self.socket, args)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A running stand-in training process.
pub struct Trainer {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Trainer {
    pub fn spawn(socket: &Path, args: &[&str]) -> Trainer {
        let exe = std::env::current_exe().expect("test binary");
        let mut cmd = Command::new(exe);
        cmd.arg("trainer")
            .args(args)
            .env("HOTSTART_SOCKET", socket)
            .env("HOTSTART_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = spawn_tied(cmd, None).expect("spawn trainer");
        let out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        Trainer {
            child: Some(child),
            lines,
            stderr,
        }
    }

    /// The next line on stdout; panics (with stderr) if the process ends first.
    pub fn line(&mut self) -> String {
        match self.lines.recv_timeout(WATCHDOG) {
            Ok(l) => l,
            Err(_) => {
                let status = self.child.as_mut().and_then(|c| {
                    let _ = c.kill();
                    c.wait().ok()
                });
                let err = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
                panic!(
                    "trainer ended ({status:?}) without the line expected:\n{}",
                    err.join().unwrap_or_default()
                );
            }
        }
    }

    /// Reads lines until `want`; the lines before it.
    pub fn until(&mut self, want: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let l = self.line();
            if l == want {
                return seen;
            }
            seen.push(l);
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the exit: status, every stdout line left, stderr.
    pub fn finish(mut self) -> (ExitStatus, Vec<String>, String) {
        let mut c = self.child.take().expect("running");
        let t = Instant::now();
        let status = loop {
            if let Some(s) = c.try_wait().expect("wait") {
                break s;
            }
            if t.elapsed() > WATCHDOG {
                let _ = c.kill();
                panic!("trainer did not exit");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader ends at end of stream, once the process is gone.
        let lines: Vec<String> = self.lines.iter().collect();
        let err = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        (status, lines, err.join().unwrap_or_default())
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs a trainer to the end and returns its `restored <step> <source> <ms>` line, split;
/// panics with its stderr if it failed.
pub fn restore(node: &Node, args: &[&str]) -> (u64, String) {
    let (status, lines, err) = node.trainer(args).finish();
    assert!(
        status.success(),
        "restore failed ({status}): {err}\nsidecar log:\n{}",
        node.log()
    );
    let line = lines
        .iter()
        .find(|l| l.starts_with("restored "))
        .unwrap_or_else(|| panic!("no restore line in {lines:?}"));
    let parts: Vec<&str> = line.split(' ').collect();
    (parts[1].parse().expect("step"), parts[2].to_string())
}
