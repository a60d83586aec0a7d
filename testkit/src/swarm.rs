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

use std::io;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

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

/// Shapes what `dev` (in `ns`, or the root namespace) sends to `mbit`.
fn shape(ns: Option<&str>, dev: &str, mbit: u32) -> io::Result<()> {
    let rate = format!("{mbit}mbit");
    let burst = format!("{}k", (mbit / 8).max(64));
    let cmds: [Vec<&str>; 2] = [
        vec![
            "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1",
        ],
        vec![
            "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", &rate,
            "ceil", &rate, "burst", &burst, "cburst", &burst,
        ],
    ];
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
            shape(Some(&net.store_ns()), "eth0", mbit)?;
        }
        for i in 0..nodes {
            let (ns, dev) = (net.node_ns(i), net.node_dev(i));
            net.join(&ns, &dev, net.node_ip(i))?;
            if let Some(mbit) = shape_as.node_mbit {
                shape(Some(&ns), "eth0", mbit)?;
                shape(None, &dev, mbit)?;
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

    /// A command run inside node `i`'s namespace.
    pub fn command_in(&self, i: usize, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.node_ns(i)]).arg(prog);
        c
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
