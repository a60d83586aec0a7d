//! The sidecar's configuration: one [`Settings`] per source (TOML file, environment, flags),
//! merged in that order of precedence (flags over environment over file over defaults), then
//! checked and resolved into a [`SidecarConfig`].
//!
//! Every setting has a TOML key, a flag and a `HOTSTART_*` variable; `docs/CONFIGURATION.md`
//! lists them. Sizes are bytes or a number with a unit (`512MiB`, `8GiB`, `4G`); durations are
//! seconds or a number with a unit (`500ms`, `25s`, `2m`). The cluster token is never read from
//! the TOML file or a flag (both end up in places others can read): it comes from
//! `HOTSTART_CLUSTER_TOKEN` or from a file named by `token_file` (a Kubernetes Secret mounted as
//! a file).
//!
//! **Refusals.** Without a token the daemon refuses to start, unless `insecure` is set *and*
//! every address it listens on or connects to is a loopback address. Without TLS (`tls_dir`,
//! see `crate::tls`) it refuses a peer address (listen or peer) that is not loopback: peer
//! links carry checkpoints, and leave the host encrypted or not at all. Peers named by DNS
//! are checked as they resolve, and a non-loopback answer is skipped where either rule holds. A peer list that names the
//! node itself, an empty or malformed node id, a replication factor larger than the number of
//! static peers with no DNS name to find more, and a zero memory budget are refused with a
//! message that names the setting.

use hotstart_ckpt::Error as CkptError;
use std::fmt;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Default peer port.
pub const DEFAULT_PEER_PORT: u16 = 7070;
/// Default HTTP port (`/livez`, `/readyz`, `/metrics`).
pub const DEFAULT_HTTP_PORT: u16 = 7071;
/// Default Unix socket.
pub const DEFAULT_SOCKET: &str = "/run/hotstart/sidecar.sock";
/// Default drain grace period: under Kubernetes' default 30 s termination grace.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(25);
/// The environment variable naming the directory of this node's TLS files.
pub const TLS_DIR_ENV: &str = "HOTSTART_TLS_DIR";
/// The environment variable holding the cluster token.
pub const TOKEN_ENV: &str = "HOTSTART_CLUSTER_TOKEN";

/// The shared secret that peers authenticate each other with. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl Token {
    /// A token from its bytes; surrounding whitespace (a trailing newline in a file) is dropped.
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<Token> {
        let t = bytes.as_ref().trim_ascii();
        if t.is_empty() {
            return Err(config("the cluster token is empty"));
        }
        Ok(Token(t.to_vec()))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// A peer named in the static list: its node id and `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticPeer {
    pub id: String,
    pub addr: String,
}

/// Everything `hotstart serve` needs, checked.
#[derive(Debug, Clone)]
pub struct SidecarConfig {
    /// This node's id: replicas name their origin by it, and a replacement node with the same
    /// id pulls them back.
    pub node_id: String,
    /// Failure-domain label (rack, zone); replicas avoid the node's own domain where possible.
    pub domain: String,
    /// Where peers connect.
    pub listen: SocketAddr,
    /// The Unix socket local training processes connect to.
    pub socket: PathBuf,
    /// Permission bits of the socket file.
    pub socket_mode: u32,
    /// Where `/livez`, `/readyz` and `/metrics` are served.
    pub http: SocketAddr,
    /// Peers by id and address.
    pub peers: Vec<StaticPeer>,
    /// A `name:port` that resolves to every peer (a Kubernetes headless service).
    pub peers_dns: Option<String>,
    /// Peers each shard is copied to.
    pub replicas: usize,
    /// Bytes of shared memory the memory tier may hold (staging, local shards and replicas).
    pub memory_budget: u64,
    /// Object store URL of the store tier.
    pub store: Option<String>,
    /// Root of the local disk tier.
    pub disk_dir: Option<PathBuf>,
    /// The cluster token; `None` only with `insecure` on loopback.
    pub token: Option<Token>,
    pub insecure: bool,
    /// The directory of this node's TLS files (`ca.crt`, `tls.crt`, `tls.key`); `None` only
    /// where every peer link stays on this host (loopback).
    pub tls_dir: Option<PathBuf>,
    /// How long SIGTERM waits for in-flight persistence.
    pub grace: Duration,
    /// How long a starting node looks for its shards on peers before it reports ready anyway.
    pub recovery_timeout: Duration,
    /// Complete steps kept per rank on disk and in the store (0 keeps everything).
    pub keep: usize,
    /// How long a peer connection may make no progress before it is dropped.
    pub peer_timeout: Duration,
    /// How often peers are probed (and the DNS name resolved again).
    pub probe_interval: Duration,
    /// How long a stage request waits for memory to be freed before it is refused.
    pub stage_timeout: Duration,
    /// Threads for checksums and copies; 0 picks the core count (at most 8).
    pub threads: usize,
    /// Whether this node shares image, environment and other chunks with its peers
    /// (`super::share`).
    pub share: bool,
    /// At most this many bytes of shared pieces are kept in memory to serve this node's
    /// processes and its peers, within the memory budget (they give way to checkpoints).
    pub share_cache: u64,
    /// A checkpoint chunk restored from the store through sharing is asked for in ranges of
    /// this many bytes when it is larger, each range from an owner of its own.
    pub share_piece: u64,
    /// Whether the steps held in memory are pinned for the GPU, where this build has GPU
    /// support and a driver and devices exist, so a restore into device tensors is copied by
    /// the sidecar without the restarted process pinning anything (`super::pin`).
    pub gpu_pin: bool,
}

/// Bytes of shared pieces a sidecar keeps by default.
pub const DEFAULT_SHARE_CACHE: u64 = 1 << 30;
/// The ranges large checkpoint chunks are shared in, by default.
pub const DEFAULT_SHARE_PIECE: u64 = 4 << 20;

/// One source of settings: every field optional. Deserialised from TOML (unknown keys are an
/// error), or filled from flags and environment by the CLI.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub struct Settings {
    pub node_id: Option<String>,
    pub domain: Option<String>,
    pub listen: Option<String>,
    pub socket: Option<PathBuf>,
    pub socket_mode: Option<String>,
    pub http: Option<String>,
    /// `id=host:port` entries (comma-separated in a flag or variable).
    pub peers: Option<Vec<String>>,
    pub peers_dns: Option<String>,
    pub replicas: Option<usize>,
    pub memory_budget: Option<Size>,
    pub store: Option<String>,
    pub disk_dir: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    pub insecure: Option<bool>,
    pub tls_dir: Option<PathBuf>,
    pub grace: Option<Seconds>,
    pub recovery_timeout: Option<Seconds>,
    pub keep: Option<usize>,
    pub peer_timeout: Option<Seconds>,
    pub probe_interval: Option<Seconds>,
    pub stage_timeout: Option<Seconds>,
    pub threads: Option<usize>,
    pub share: Option<bool>,
    pub share_cache: Option<Size>,
    pub share_piece: Option<Size>,
    pub gpu_pin: Option<bool>,
    /// Set from `HOTSTART_CLUSTER_TOKEN` by the CLI; never from the file.
    #[serde(skip)]
    pub token: Option<Token>,
}

/// `"1.5 GiB"` as `(1.5, "GiB")`: the leading number and what follows it, trimmed.
fn number_and_unit<'a>(s: &'a str, what: &str) -> std::result::Result<(f64, &'a str), String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n = num
        .parse()
        .map_err(|_| format!("{what} {s:?}: not a number"))?;
    Ok((n, unit.trim()))
}

/// A byte size: an integer, or a string with a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl std::str::FromStr for Size {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Size, String> {
        let (n, unit) = number_and_unit(s, "size")?;
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "ki" | "kib" => 1 << 10,
            "m" | "mb" => 1_000_000,
            "mi" | "mib" => 1 << 20,
            "g" | "gb" => 1_000_000_000,
            "gi" | "gib" => 1 << 30,
            "t" | "tb" => 1_000_000_000_000,
            "ti" | "tib" => 1 << 40,
            u => return Err(format!("size {s:?}: unknown unit {u:?}")),
        };
        let bytes = n * mult as f64;
        if !(0.0..1.8e19).contains(&bytes) {
            return Err(format!("size {s:?} is out of range"));
        }
        Ok(Size(bytes as u64))
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Size, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// A duration: seconds as a number, or a string with a unit (`ms`, `s`, `m`, `h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seconds(pub Duration);

impl std::str::FromStr for Seconds {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Seconds, String> {
        let (n, unit) = number_and_unit(s, "duration")?;
        let secs = match unit {
            "ms" => n / 1000.0,
            "" | "s" => n,
            "m" | "min" => n * 60.0,
            "h" => n * 3600.0,
            u => return Err(format!("duration {s:?}: unknown unit {u:?}")),
        };
        Duration::try_from_secs_f64(secs)
            .map(Seconds)
            .map_err(|e| format!("duration {s:?}: {e}"))
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Seconds, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(f64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Duration::try_from_secs_f64(n)
                .map(Seconds)
                .map_err(serde::de::Error::custom),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

fn config(reason: impl Into<String>) -> Error {
    Error::config(reason)
}

impl Settings {
    /// Settings from a TOML file.
    pub fn from_toml_file(path: &Path) -> Result<Settings> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
        Settings::from_toml(&text).map_err(|e| match e {
            Error::Ckpt(CkptError::Config { reason }) => {
                config(format!("{}: {reason}", path.display()))
            }
            e => e,
        })
    }

    /// Settings from TOML text.
    pub fn from_toml(text: &str) -> Result<Settings> {
        toml::from_str(text).map_err(|e| config(e.to_string()))
    }

    /// `self`, with every setting that `over` has replaced by it.
    pub fn merge(self, over: Settings) -> Settings {
        macro_rules! pick {
            ($($f:ident),*) => { Settings { $($f: over.$f.or(self.$f)),* } };
        }
        pick!(
            node_id,
            domain,
            listen,
            socket,
            socket_mode,
            http,
            peers,
            peers_dns,
            replicas,
            memory_budget,
            store,
            disk_dir,
            token_file,
            insecure,
            tls_dir,
            grace,
            recovery_timeout,
            keep,
            peer_timeout,
            probe_interval,
            stage_timeout,
            threads,
            share,
            share_cache,
            share_piece,
            gpu_pin,
            token
        )
    }

    /// Applies defaults and checks everything; see the module docs for what is refused.
    pub fn resolve(self) -> Result<SidecarConfig> {
        let node_id = match self.node_id {
            Some(id) => id,
            None => hostname()?,
        };
        check_node_id(&node_id)?;
        let domain = self.domain.unwrap_or_default();
        let listen = parse_addr("listen", self.listen.as_deref(), DEFAULT_PEER_PORT)?;
        let http = parse_addr("http", self.http.as_deref(), DEFAULT_HTTP_PORT)?;
        let socket_mode = match self.socket_mode.as_deref() {
            None => 0o660,
            Some(m) => u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .ok_or_else(|| config(format!("socket_mode {m:?}: not octal permission bits")))?,
        };
        let mut peers = Vec::new();
        for entry in self.peers.unwrap_or_default() {
            for p in entry.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                peers.push(parse_peer(p)?);
            }
        }
        for (i, p) in peers.iter().enumerate() {
            if p.id == node_id {
                return Err(config(format!(
                    "peers: {:?} is this node's own id; list only the other nodes",
                    p.id
                )));
            }
            if peers[..i].iter().any(|q| q.id == p.id) {
                return Err(config(format!("peers: {:?} is listed twice", p.id)));
            }
        }
        let peers_dns = self.peers_dns.filter(|d| !d.is_empty());
        if let Some(d) = &peers_dns
            && !d.contains(':')
        {
            return Err(config(format!(
                "peers_dns {d:?}: expected name:port, e.g. hotstart.ns.svc.cluster.local:{DEFAULT_PEER_PORT}"
            )));
        }
        let replicas = self.replicas.unwrap_or(1);
        if peers_dns.is_none() && replicas > peers.len() && !peers.is_empty() {
            return Err(config(format!(
                "replicas = {replicas} but only {} peers are listed",
                peers.len()
            )));
        }
        let memory_budget = match self.memory_budget {
            Some(Size(0)) => return Err(config("memory_budget is 0")),
            Some(Size(b)) => b,
            None => default_budget(),
        };
        let token = match (self.token, &self.token_file) {
            // Two tokens, one silently ignored, would read later as a peer that is unreachable.
            (Some(_), Some(path)) => {
                return Err(config(format!(
                    "both {TOKEN_ENV} and token_file ({}) give the cluster token: keep one",
                    path.display()
                )));
            }
            (Some(t), None) => Some(t),
            (None, Some(path)) => {
                let bytes =
                    std::fs::read(path).map_err(|e| Error::io("read token file", path, e))?;
                Some(Token::new(bytes)?)
            }
            (None, None) => None,
        };
        let insecure = self.insecure.unwrap_or(false);
        let cfg = SidecarConfig {
            node_id,
            domain,
            listen,
            socket: self.socket.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
            socket_mode,
            http,
            peers,
            peers_dns,
            replicas,
            memory_budget,
            store: self.store.filter(|s| !s.is_empty()),
            disk_dir: self.disk_dir,
            token,
            insecure,
            tls_dir: self.tls_dir,
            grace: self.grace.map_or(DEFAULT_GRACE, |s| s.0),
            recovery_timeout: self
                .recovery_timeout
                .map_or(Duration::from_secs(30), |s| s.0),
            keep: self.keep.unwrap_or(2),
            peer_timeout: self.peer_timeout.map_or(Duration::from_secs(30), |s| s.0),
            probe_interval: self.probe_interval.map_or(Duration::from_secs(5), |s| s.0),
            stage_timeout: self.stage_timeout.map_or(Duration::from_secs(60), |s| s.0),
            threads: self.threads.unwrap_or(0),
            share: self.share.unwrap_or(true),
            share_cache: self.share_cache.map_or(DEFAULT_SHARE_CACHE, |s| s.0),
            share_piece: self.share_piece.map_or(DEFAULT_SHARE_PIECE, |s| s.0),
            gpu_pin: self.gpu_pin.unwrap_or(true),
        };
        let part = hotstart_proto::share::RANGE_PART;
        if !(part..=hotstart_proto::share::MAX_PIECE_LEN).contains(&cfg.share_piece)
            || !cfg.share_piece.is_multiple_of(part)
        {
            return Err(config(format!(
                "share_piece {} is not a multiple of 64 KiB up to {} MiB: pick a size such as 4MiB",
                cfg.share_piece,
                hotstart_proto::share::MAX_PIECE_LEN >> 20
            )));
        }
        cfg.check_security()?;
        Ok(cfg)
    }
}

impl SidecarConfig {
    /// Without a token, only `insecure` on loopback addresses is allowed; without TLS, only
    /// peer links on loopback addresses.
    fn check_security(&self) -> Result<()> {
        if self.token.is_none() && !self.insecure {
            return Err(config(format!(
                "no cluster token: set {TOKEN_ENV} or token_file (or, for a test on loopback \
                 addresses only, --insecure)"
            )));
        }
        if self.loopback_only().is_none() {
            // A token and TLS: any address will do, and peers' names are resolved at each
            // probe, not here (a peer not scheduled yet does not stop this one).
            return Ok(());
        }
        let mut addrs = vec![("listen", self.listen)];
        for p in &self.peers {
            let resolved = p
                .addr
                .to_socket_addrs()
                .map_err(|e| config(format!("peer {} ({}): {e}", p.id, p.addr)))?;
            addrs.extend(resolved.map(|a| ("peers", a)));
        }
        // Every address at once, so one correction fixes them all.
        let outside = |addrs: &[(&str, SocketAddr)]| -> String {
            addrs
                .iter()
                .filter(|(_, a)| !a.ip().is_loopback())
                .map(|(what, a)| format!("{what} {a}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if self.token.is_none() {
            let with_http: Vec<_> = addrs.iter().copied().chain([("http", self.http)]).collect();
            let outside = outside(&with_http);
            if !outside.is_empty() {
                return Err(config(format!(
                    "--insecure (no cluster token) is only allowed on loopback addresses, and \
                     these are not: {outside}. Use 127.0.0.1 addresses for a single-node test, \
                     or set {TOKEN_ENV} (or token_file) on every node"
                )));
            }
        }
        let outside = outside(&addrs);
        if self.tls_dir.is_none() && !outside.is_empty() {
            return Err(config(format!(
                "peer links would leave this host in clear text ({outside}): set tls_dir \
                 (--tls-dir, {TLS_DIR_ENV}) to a directory holding ca.crt, tls.crt and tls.key \
                 from the cluster's CA (`hotstart tls init` makes them), or use 127.0.0.1 \
                 addresses for a single-host test"
            )));
        }
        Ok(())
    }

    /// Why peer links must stay on loopback addresses, if they must: no cluster token, or no
    /// TLS. A peer address found later (a DNS answer) that is not loopback is then skipped.
    pub(crate) fn loopback_only(&self) -> Option<&'static str> {
        if self.token.is_none() {
            Some("--insecure")
        } else if self.tls_dir.is_none() {
            Some("no tls_dir")
        } else {
            None
        }
    }
}

/// Node ids name replicas on the wire and in logs, and directories (`hotstart tls init`): 1 to
/// 253 bytes of `[A-Za-z0-9._-]`, not `.` or `..`.
pub(crate) fn check_node_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id != "."
        && id != ".."
        && id.len() <= 253
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(config(format!(
            "node id {id:?}: 1 to 253 characters of A-Z a-z 0-9 . _ -"
        )))
    }
}

fn parse_addr(what: &str, s: Option<&str>, default_port: u16) -> Result<SocketAddr> {
    let Some(s) = s else {
        return Ok(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), default_port));
    };
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port));
    }
    Err(config(format!(
        "{what} {s:?}: expected IP:PORT (e.g. 0.0.0.0:{default_port}) or an IP"
    )))
}

fn parse_peer(p: &str) -> Result<StaticPeer> {
    let Some((id, addr)) = p.split_once('=') else {
        return Err(config(format!(
            "peer {p:?}: expected id=host:port, e.g. node-b=10.0.0.2:{DEFAULT_PEER_PORT}"
        )));
    };
    let (id, addr) = (id.trim(), addr.trim());
    check_node_id(id)?;
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
        _ => {
            return Err(config(format!(
                "peer {id}: address {addr:?} is not host:port"
            )));
        }
    }
    Ok(StaticPeer {
        id: id.to_string(),
        addr: addr.to_string(),
    })
}

/// The host name, the default node id (stable for a Kubernetes StatefulSet's pods).
fn hostname() -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return Err(Error::io(
            "gethostname",
            "",
            std::io::Error::last_os_error(),
        ));
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8(buf[..end].to_vec()).map_err(|_| config("the host name is not UTF-8"))
}

/// Half of the memory this process may use: its memory cgroup's limit when there is one (v2 or
/// v1), else the machine's.
fn default_budget() -> u64 {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|own| cgroup_limit(&own, Path::new("/sys/fs/cgroup")));
    // SAFETY: sysconf only reads system configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let physical = (pages.max(0) as u64).saturating_mul(page.max(0) as u64);
    cgroup.unwrap_or(physical).min(physical.max(1)) / 2
}

/// The memory limit of the cgroup that `/proc/self/cgroup` (`own`) names, under the cgroup
/// file systems mounted at `root`: `memory.max` (v2) or `memory/memory.limit_in_bytes` (v1),
/// at the process's own cgroup path or, where that is not visible (a container's own cgroup
/// namespace), at the root. `None` when unlimited or unreadable.
fn cgroup_limit(own: &str, root: &Path) -> Option<u64> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    own.lines()
        .filter_map(|line| {
            let mut f = line.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            let path = path.trim_start_matches('/');
            let (dir, file) = if controllers.is_empty() {
                (root.to_path_buf(), "memory.max")
            } else if controllers.split(',').any(|c| c == "memory") {
                (root.join("memory"), "memory.limit_in_bytes")
            } else {
                return None;
            };
            read(dir.join(path).join(file)).or_else(|| read(dir.join(file)))
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_memory_limit_comes_from_the_cgroup_of_either_version() {
        let root = tempfile::tempdir().unwrap();
        let put = |rel: &str, text: &str| {
            let p = root.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        };
        // v1, at the process's own path; other controllers are not looked at.
        put("memory/job/memory.limit_in_bytes", "2147483648\n");
        put("cpu/job/cpu.shares", "1024\n");
        let v1 = "9:cpu,cpuacct:/job\n4:memory:/job\n";
        assert_eq!(cgroup_limit(v1, root.path()), Some(2 << 30));
        // v2 "max" is no limit; a number is.
        put("pod/memory.max", "max\n");
        assert_eq!(cgroup_limit("0::/pod\n", root.path()), None);
        put("pod/memory.max", "1073741824\n");
        assert_eq!(cgroup_limit("0::/pod\n", root.path()), Some(1 << 30));
        // A path not visible here (a container's namespace): the root's file.
        put("memory.max", "536870912\n");
        assert_eq!(
            cgroup_limit("0::/elsewhere\n", root.path()),
            Some(512 << 20)
        );
        assert_eq!(cgroup_limit("", root.path()), None);
    }

    fn base() -> Settings {
        Settings {
            node_id: Some("a".into()),
            listen: Some("127.0.0.1:7070".into()),
            http: Some("127.0.0.1:7071".into()),
            memory_budget: Some(Size(1 << 30)),
            ..Settings::default()
        }
    }

    #[test]
    fn sizes_and_durations_parse_with_units() {
        assert_eq!("4096".parse::<Size>().unwrap(), Size(4096));
        assert_eq!("8GiB".parse::<Size>().unwrap(), Size(8 << 30));
        assert_eq!("1.5 MiB".parse::<Size>().unwrap(), Size(3 << 19));
        assert_eq!("2G".parse::<Size>().unwrap(), Size(2_000_000_000));
        assert!("12 parsecs".parse::<Size>().is_err());
        assert!("-1".parse::<Size>().is_err());
        assert_eq!(
            "500ms".parse::<Seconds>().unwrap(),
            Seconds(Duration::from_millis(500))
        );
        assert_eq!(
            "25".parse::<Seconds>().unwrap(),
            Seconds(Duration::from_secs(25))
        );
        assert_eq!(
            "2m".parse::<Seconds>().unwrap(),
            Seconds(Duration::from_secs(120))
        );
        assert!("soon".parse::<Seconds>().is_err());
    }

    #[test]
    fn toml_file_then_flags_override() {
        let file = Settings::from_toml(
            r#"
            node_id = "node-a"
            domain = "rack-1"
            listen = "127.0.0.2:7070"
            peers = ["node-b=127.0.0.3:7070", "node-c=127.0.0.4:7070"]
            replicas = 2
            memory_budget = "2GiB"
            grace = "10s"
            insecure = true
            "#,
        )
        .unwrap();
        let flags = Settings {
            grace: Some(Seconds(Duration::from_secs(3))),
            http: Some("127.0.0.2:9000".into()),
            ..Settings::default()
        };
        let cfg = file.merge(flags).resolve().unwrap();
        assert_eq!(cfg.node_id, "node-a");
        assert_eq!(cfg.domain, "rack-1");
        assert_eq!(cfg.grace, Duration::from_secs(3));
        assert_eq!(cfg.http, "127.0.0.2:9000".parse().unwrap());
        assert_eq!(cfg.memory_budget, 2 << 30);
        assert_eq!(cfg.replicas, 2);
        assert_eq!(
            cfg.peers,
            vec![
                StaticPeer {
                    id: "node-b".into(),
                    addr: "127.0.0.3:7070".into()
                },
                StaticPeer {
                    id: "node-c".into(),
                    addr: "127.0.0.4:7070".into()
                }
            ]
        );
        assert!(Settings::from_toml("tokn = 'x'").is_err(), "unknown key");
        assert!(
            Settings::from_toml("token = 'x'").is_err(),
            "the token is never read from the file"
        );
    }

    #[test]
    fn no_token_is_refused_unless_insecure_on_loopback_and_no_tls_unless_on_loopback() {
        let err = base().resolve().unwrap_err().to_string();
        assert!(err.contains(TOKEN_ENV), "{err}");
        let insecure = Settings {
            insecure: Some(true),
            ..base()
        };
        insecure.clone().resolve().unwrap();
        let wide = Settings {
            listen: Some("0.0.0.0:7070".into()),
            ..insecure.clone()
        };
        let err = wide.resolve().unwrap_err().to_string();
        assert!(err.contains("loopback") && err.contains("listen"), "{err}");
        let remote_peer = Settings {
            peers: Some(vec!["b=10.1.2.3:7070".into()]),
            ..insecure.clone()
        };
        let err = remote_peer.resolve().unwrap_err().to_string();
        assert!(err.contains("not: peers 10.1.2.3:7070."), "{err}");
        // Every address that is not loopback is named at once.
        let both = Settings {
            listen: Some("0.0.0.0:7070".into()),
            peers: Some(vec!["b=10.1.2.3:7070".into(), "c=10.1.2.4:7070".into()]),
            ..insecure
        };
        let err = both.resolve().unwrap_err().to_string();
        assert!(
            err.contains("listen 0.0.0.0:7070, peers 10.1.2.3:7070, peers 10.1.2.4:7070"),
            "{err}"
        );
        // With a token, peer links off this host still need TLS: the error names them and the
        // setting.
        let with_token = Settings {
            listen: Some("0.0.0.0:7070".into()),
            peers: Some(vec!["b=10.1.2.3:7070".into()]),
            token: Some(Token::new("s3cret\n").unwrap()),
            ..base()
        };
        let err = with_token.clone().resolve().unwrap_err().to_string();
        assert!(
            err.contains("clear text (listen 0.0.0.0:7070, peers 10.1.2.3:7070)")
                && err.contains("tls_dir")
                && err.contains("hotstart tls init"),
            "{err}"
        );
        // With both, addresses are not checked, and a peer whose name does not resolve yet (a
        // pod not scheduled) does not stop this node from starting.
        let cfg = Settings {
            tls_dir: Some("/etc/hotstart/tls".into()),
            peers: Some(vec![
                "b=10.1.2.3:7070".into(),
                "c=not-yet.invalid:7070".into(),
            ]),
            ..with_token
        }
        .resolve()
        .unwrap();
        assert_eq!(cfg.peers.len(), 2);
        assert_eq!(cfg.token.unwrap().bytes(), b"s3cret");
        assert!(!format!("{:?}", Token::new("s3cret").unwrap()).contains("s3cret"));
    }

    #[test]
    fn bad_settings_name_themselves() {
        let cases: Vec<(Settings, &str)> = vec![
            (
                Settings {
                    share_piece: Some(Size(100_000)),
                    ..base()
                },
                "share_piece 100000 is not a multiple of 64 KiB",
            ),
            (
                Settings {
                    share_piece: Some(Size(128 << 20)),
                    ..base()
                },
                "up to 64 MiB",
            ),
            (
                Settings {
                    node_id: Some("a/b".into()),
                    ..base()
                },
                "node id",
            ),
            (
                Settings {
                    peers: Some(vec!["b:7070".into()]),
                    ..base()
                },
                "id=host:port",
            ),
            (
                Settings {
                    peers: Some(vec!["a=127.0.0.1:7070".into()]),
                    ..base()
                },
                "own id",
            ),
            (
                Settings {
                    peers: Some(vec!["b=127.0.0.1:1,b=127.0.0.1:2".into()]),
                    ..base()
                },
                "twice",
            ),
            (
                Settings {
                    peers: Some(vec!["b=127.0.0.1:1".into()]),
                    replicas: Some(2),
                    ..base()
                },
                "replicas",
            ),
            (
                Settings {
                    memory_budget: Some(Size(0)),
                    ..base()
                },
                "memory_budget",
            ),
            (
                Settings {
                    token: Some(Token::new("t0ken-from-the-environment").unwrap()),
                    token_file: Some("/etc/hotstart/token".into()),
                    ..base()
                },
                "both HOTSTART_CLUSTER_TOKEN and token_file (/etc/hotstart/token) give the cluster token",
            ),
            (
                Settings {
                    listen: Some("nowhere".into()),
                    ..base()
                },
                "listen",
            ),
            (
                Settings {
                    peers_dns: Some("svc.local".into()),
                    ..base()
                },
                "name:port",
            ),
            (
                Settings {
                    socket_mode: Some("999".into()),
                    ..base()
                },
                "socket_mode",
            ),
        ];
        for (s, want) in cases {
            let err = s
                .merge(Settings {
                    insecure: Some(true),
                    ..Settings::default()
                })
                .resolve()
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }
}
