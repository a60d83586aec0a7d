//! Many nodes on one machine: a Linux network namespace per node and one for the object store,
//! each joined by a veth pair to a bridge, links shaped with `tc` (HTB).
//!
//! ```text
//!   this process (root namespace) ── bridge hsw<id>b 198.19.<k>.254/24
//!        │                 │                 │
//!   veth hsw<id>s    veth hsw<id>n0 ... veth hsw<id>n<N-1>
//!        │                 │                 │
//!   ns hsw<id>-store  ns hsw<id>-n0  ...  ns hsw<id>-n<N-1>
//!   .100 (the store)  .1                  .N
//! ```
//!
//! The addresses come from 198.18.0.0/15, the range reserved for network benchmarks, and
//! nothing routes them off this machine: every packet stays between these namespaces and the
//! bridge. The store's link is shaped where the store sends (its namespace's egress), and a
//! node's link both ways (its own egress, and the bridge port's egress toward it). The bytes
//! the store sent are read from its interface's counters ([`SwarmNet::store_sent`]).
//!
//! Needs root (CAP_NET_ADMIN) and iproute2; [`SwarmNet::unavailable`] says why not otherwise.
//! Everything is removed when the value is dropped, and anything left by a process that died
//! is removed by the next [`SwarmNet::up`].

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Link shaping, in megabits per second (`None`: unshaped).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shape {
    /// What the store may send.
    pub store_mbit: Option<u32>,
    /// Each node's link, each way.
    pub node_mbit: Option<u32>,
}

/// The namespaces, bridge and links of one swarm.
#[derive(Debug)]
pub struct SwarmNet {
    id: String,
    subnet: u8,
    nodes: usize,
}

const PREFIX: &str = "hsw";

fn ip(args: &[&str]) -> io::Result<()> {
    run("ip", args)
}

fn run(prog: &str, args: &[&str]) -> io::Result<()> {
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| io::Error::new(e.kind(), format!("{prog}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{prog} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

fn in_ns(ns: &str, prog: &str, args: &[&str]) -> io::Result<()> {
    let mut all = vec!["netns", "exec", ns, prog];
    all.extend_from_slice(args);
    ip(&all)
}

/// Shapes what `dev` (in `ns`, or the root namespace) sends to `mbit`; `again`: it was shaped
/// before, and only the rate changes.
fn shape(ns: Option<&str>, dev: &str, mbit: u32, again: bool) -> io::Result<()> {
    let rate = format!("{mbit}mbit");
    let burst = format!("{}k", (mbit / 8).max(64));
    let class: Vec<&str> = vec![
        "class",
        if again { "change" } else { "add" },
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        &rate,
        "ceil",
        &rate,
        "burst",
        &burst,
        "cburst",
        &burst,
    ];
    let qdisc = vec![
        "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1",
    ];
    let cmds = if again {
        vec![class]
    } else {
        vec![qdisc, class]
    };
    for args in cmds {
        match ns {
            Some(ns) => in_ns(ns, "tc", &args)?,
            None => run("tc", &args)?,
        }
    }
    Ok(())
}

impl SwarmNet {
    /// Why this machine cannot make a swarm (not root, no `ip` or `tc`), or `None`.
    pub fn unavailable() -> Option<String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Some("network namespaces need root".into());
        }
        for prog in ["ip", "tc"] {
            let found = Command::new(prog)
                .arg("-V")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !found {
                return Some(format!("`{prog}` (iproute2) is not installed"));
            }
        }
        None
    }

    /// Makes `nodes` node namespaces (at most 99) and the store's, joined and shaped as
    /// `shape` says.
    pub fn up(nodes: usize, shape_as: Shape) -> io::Result<SwarmNet> {
        assert!((1..100).contains(&nodes), "1 to 99 nodes");
        sweep();
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let net = SwarmNet {
            id: format!("{:x}{n:x}", pid % 0x10000),
            subnet: ((pid.wrapping_mul(7) + n * 31) % 250 + 1) as u8,
            nodes,
        };
        // On error `net` drops and removes what was made.
        let br = net.bridge();
        ip(&["link", "add", &br, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{}/24", net.host_ip()), "dev", &br])?;
        ip(&["link", "set", &br, "up"])?;
        net.join(&net.store_ns(), &net.store_dev(), net.store_ip())?;
        if let Some(mbit) = shape_as.store_mbit {
            shape(Some(&net.store_ns()), "eth0", mbit, false)?;
        }
        for i in 0..nodes {
            let (ns, dev) = (net.node_ns(i), net.node_dev(i));
            net.join(&ns, &dev, net.node_ip(i))?;
            if let Some(mbit) = shape_as.node_mbit {
                shape(Some(&ns), "eth0", mbit, false)?;
                shape(None, &dev, mbit, false)?;
            }
        }
        Ok(net)
    }

    /// Makes namespace `ns` with `eth0` at `addr`, its peer `dev` on the bridge.
    fn join(&self, ns: &str, dev: &str, addr: Ipv4Addr) -> io::Result<()> {
        ip(&["netns", "add", ns])?;
        ip(&[
            "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns,
        ])?;
        ip(&["link", "set", dev, "master", &self.bridge()])?;
        ip(&["link", "set", dev, "up"])?;
        in_ns(
            ns,
            "ip",
            &["addr", "add", &format!("{addr}/24"), "dev", "eth0"],
        )?;
        in_ns(ns, "ip", &["link", "set", "eth0", "up"])?;
        in_ns(ns, "ip", &["link", "set", "lo", "up"])
    }

    fn bridge(&self) -> String {
        format!("{PREFIX}{}b", self.id)
    }

    fn store_dev(&self) -> String {
        format!("{PREFIX}{}s", self.id)
    }

    fn node_dev(&self, i: usize) -> String {
        format!("{PREFIX}{}n{i}", self.id)
    }

    /// Nodes.
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The namespace of node `i`.
    pub fn node_ns(&self, i: usize) -> String {
        format!("{PREFIX}{}-n{i}", self.id)
    }

    /// Node `i`'s address.
    pub fn node_ip(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.subnet, 1 + i as u8)
    }

    /// The store's namespace.
    pub fn store_ns(&self) -> String {
        format!("{PREFIX}{}-store", self.id)
    }

    /// The store's address.
    pub fn store_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.subnet, 100)
    }

    /// This process's address on the bridge.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.subnet, 254)
    }

    /// Sets node `i`'s link, each way, to `mbit` (it must have been shaped by [`SwarmNet::up`]).
    pub fn reshape_node(&self, i: usize, mbit: u32) -> io::Result<()> {
        shape(Some(&self.node_ns(i)), "eth0", mbit, true)?;
        shape(None, &self.node_dev(i), mbit, true)
    }

    /// Bytes the store's namespace has sent over its link so far (payload and headers).
    pub fn store_sent(&self) -> io::Result<u64> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.store_ns()])
            .args(["cat", "/sys/class/net/eth0/statistics/tx_bytes"])
            .output()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .map_err(|e| io::Error::other(format!("store link counter: {e}")))
    }

    fn remove(&self) {
        let _ = ip(&["netns", "del", &self.store_ns()]);
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.node_ns(i)]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

impl Drop for SwarmNet {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Removes the namespaces and bridges of swarms whose process is gone (their ids start with
/// the low 16 bits of the pid, so only those of processes not running are removed).
fn sweep() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    let running = |id: &str| {
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return true;
        };
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .any(|pid| id.starts_with(&format!("{:x}", pid % 0x10000)))
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some((id, _)) = rest.split_once('-') else {
            continue;
        };
        if !running(id) {
            let _ = ip(&["netns", "del", name]);
            let _ = ip(&["link", "del", &format!("{PREFIX}{id}b")]);
        }
    }
}

/// The peer port of every node's sidecar.
pub const PEER_PORT: u16 = 7070;
/// The HTTP port (`/metrics`) of every node's sidecar.
pub const HTTP_PORT: u16 = 7071;

/// A sidecar (`hotstart serve`) in every node of a [`SwarmNet`], peers of each other over
/// mutual TLS with a cluster token, as a real deployment runs them.
#[derive(Debug)]
pub struct Sidecars<'n> {
    net: &'n SwarmNet,
    exe: PathBuf,
    dir: PathBuf,
    /// Variables every sidecar gets (the store's credentials, say).
    env: Vec<(String, String)>,
    children: Vec<Option<Child>>,
}

impl<'n> Sidecars<'n> {
    /// Sidecars of `exe` (the `hotstart` binary) for `net`, with their TLS files, token,
    /// sockets and logs in `dir`; none is started yet.
    pub fn new(
        net: &'n SwarmNet,
        exe: &Path,
        dir: &Path,
        env: Vec<(String, String)>,
    ) -> io::Result<Sidecars<'n>> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("token"), "swarm cluster token 0123456789abcdef")?;
        let nodes: Vec<String> = (0..net.nodes()).map(Sidecars::id).collect();
        let out = Command::new(exe)
            .args(["tls", "init"])
            .arg(dir.join("tls"))
            .args(&nodes)
            .output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "hotstart tls init: {}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(Sidecars {
            net,
            exe: exe.to_path_buf(),
            dir: dir.to_path_buf(),
            env,
            children: (0..net.nodes()).map(|_| None).collect(),
        })
    }

    /// Node `i`'s id.
    pub fn id(i: usize) -> String {
        format!("n{i}")
    }

    /// Node `i`'s sidecar socket (`HOTSTART_SHARE` of its processes).
    pub fn socket(&self, i: usize) -> PathBuf {
        self.dir.join(format!("n{i}.sock"))
    }

    /// Node `i`'s sidecar log (every start appends).
    pub fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("n{i}.log"))
    }

    /// Starts node `i`'s sidecar with `args` and `env` beyond the common ones.
    pub fn start(&mut self, i: usize, args: &[&str], env: &[(&str, &str)]) -> io::Result<()> {
        let peers: Vec<String> = (0..self.net.nodes())
            .filter(|&j| j != i)
            .map(|j| format!("{}={}:{PEER_PORT}", Sidecars::id(j), self.net.node_ip(j)))
            .collect();
        let ip = self.net.node_ip(i);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(i))?;
        let mut c = Command::new(&self.exe);
        c.args(["serve", "--node-id", &Sidecars::id(i)])
            .args(["--listen", &format!("{ip}:{PEER_PORT}")])
            .args(["--http", &format!("{ip}:{HTTP_PORT}")])
            .arg("--socket")
            .arg(self.socket(i))
            .arg("--tls-dir")
            .arg(self.dir.join(format!("tls/{}", Sidecars::id(i))))
            .arg("--token-file")
            .arg(self.dir.join("token"))
            .args(["--probe-interval", "1s"])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(env.iter().copied())
            .env_remove("HOTSTART_SHARE")
            .env(
                "HOTSTART_LOG",
                std::env::var("HOTSTART_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if !peers.is_empty() {
            c.args(["--peers", &peers.join(",")]);
        }
        let child = crate::spawn_tied(c, Some(&self.net.node_ns(i)))?;
        self.children[i] = Some(child);
        Ok(())
    }

    /// Stops node `i`'s sidecar: SIGKILL with `kill`, else SIGTERM (and SIGKILL after 10 s).
    pub fn stop(&mut self, i: usize, kill: bool) {
        if let Some(mut c) = self.children[i].take() {
            if kill {
                let _ = c.kill();
                let _ = c.wait();
            } else {
                crate::terminate(&mut c, Duration::from_secs(10));
            }
        }
    }

    /// Freezes node `i`'s sidecar (SIGSTOP: its connections stay open and nothing answers on
    /// them), or thaws it (SIGCONT).
    pub fn freeze(&self, i: usize, frozen: bool) {
        if let Some(c) = &self.children[i] {
            let signal = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
            let pid = libc::pid_t::try_from(c.id()).unwrap_or(0);
            if pid > 0 {
                // SAFETY: a signal to a child this process started and has not reaped.
                unsafe { libc::kill(pid, signal) };
            }
        }
    }

    /// Whether node `i`'s sidecar was started and not stopped.
    pub fn running(&self, i: usize) -> bool {
        self.children[i].is_some()
    }

    /// One sample of node `i`'s `/metrics`, e.g. `hotstart_peers{state="up"}` (0 when absent
    /// or unreachable).
    pub fn metric(&self, i: usize, sample: &str) -> f64 {
        let addr = SocketAddr::from((self.net.node_ip(i), HTTP_PORT));
        let page = crate::get(addr, "/metrics", Duration::from_secs(5))
            .map(|r| r.text())
            .unwrap_or_default();
        page.lines()
            .find_map(|l| l.strip_prefix(sample)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// The sum of a sample over every running sidecar.
    pub fn total(&self, sample: &str) -> f64 {
        (0..self.net.nodes())
            .filter(|&i| self.running(i))
            .map(|i| self.metric(i, sample))
            .sum()
    }

    /// Waits (up to `limit`) until every running sidecar is ready and sees every other one up.
    pub fn wait_peers(&self, limit: Duration) -> io::Result<()> {
        let running: Vec<usize> = (0..self.net.nodes()).filter(|&i| self.running(i)).collect();
        let deadline = Instant::now() + limit;
        let ready = |i: usize| {
            let addr = SocketAddr::from((self.net.node_ip(i), HTTP_PORT));
            crate::get(addr, "/readyz", Duration::from_secs(5)).is_ok_and(|r| r.status == 200)
        };
        for &i in &running {
            while !ready(i)
                || self.metric(i, "hotstart_peers{state=\"up\"}") < (running.len() - 1) as f64
            {
                if Instant::now() > deadline {
                    return Err(io::Error::other(format!(
                        "n{i} never saw its peers up; its log: {}",
                        self.log(i).display()
                    )));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }
}

impl Drop for Sidecars<'_> {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.stop(i, true);
        }
    }
}

/// Every file under `dir`: its mode and the BLAKE3 of its bytes, to compare restored trees.
pub fn file_tree(dir: &Path) -> io::Result<BTreeMap<PathBuf, (u32, String)>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, (u32, String)>) -> io::Result<()> {
        for e in std::fs::read_dir(dir)? {
            let p = e?.path();
            let meta = std::fs::symlink_metadata(&p)?;
            if meta.is_dir() {
                walk(root, &p, out)?;
            } else {
                let data = if meta.is_symlink() {
                    std::fs::read_link(&p)?
                        .into_os_string()
                        .into_encoded_bytes()
                } else {
                    std::fs::read(&p)?
                };
                let rel = p
                    .strip_prefix(root)
                    .map_err(io::Error::other)?
                    .to_path_buf();
                let mode = meta.permissions().mode() & 0o7777;
                out.insert(rel, (mode, blake3::hash(&data).to_hex().to_string()));
            }
        }
        Ok(())
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out)?;
    Ok(out)
}

/// A Python program that writes an environment of about `mib` MiB into `$HOTSTART_ENV_TARGET`
/// (an install command for `hotstart env ensure`): three quarters in files of 1 MiB, the rest
/// in small files of 1 to 16 KB, random bytes from a fixed seed (so compression does not
/// shrink them). `(files, the program)`.
pub fn env_install_program(mib: usize) -> (usize, String) {
    let big = (mib * 3 / 4).max(1);
    let small = ((mib - big.min(mib)) << 20) / 8500;
    let program = format!(
        r#"
import os, random
t = os.environ["HOTSTART_ENV_TARGET"]
r = random.Random(53)
os.makedirs(os.path.join(t, "lib", "small"), exist_ok=True)
for i in range({big}):
    with open(os.path.join(t, "lib", f"big{{i}}.so"), "wb") as f:
        f.write(r.randbytes(1 << 20))
for i in range({small}):
    with open(os.path.join(t, "lib", "small", f"m{{i}}.py"), "wb") as f:
        f.write(r.randbytes(r.randint(1000, 16000)))
"#
    );
    (big + small, program)
}
