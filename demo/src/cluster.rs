//! The demo's processes: one sidecar (`hotstart serve`) per node and one trainer per rank, all
//! children of the demo, on loopback ports of their own.
//!
//! Each node has a socket, a disk-tier directory and a log file under the demo's directory; a
//! replaced node (its sidecar started again after it was killed) gets a new, empty disk
//! directory, as a new machine would. Every sidecar shares one cluster token (generated per
//! run), lists the other nodes as static peers and keeps one replica of each shard on a peer.
//! Trainers run the same binary (`hotstart demo --run-trainer ...`), or a PyTorch trainer under
//! torchrun ([`TrainerKind`]); their stdout is a stream of
//! [`Event`]s, read by one thread per trainer into one channel, and their stderr goes to a log
//! file. Every child dies with the demo (`PR_SET_PDEATHSIG`), so an interrupted demo leaves
//! nothing running.

use std::fs::File;
use std::hash::{BuildHasher, RandomState};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use crate::event::Event;
use crate::link::Links;
use crate::{Error, Result, TrainerKind};

/// What the cluster is made of.
#[derive(Debug, Clone)]
pub struct Layout {
    /// The `hotstart` binary (the demo runs itself as trainers, and as sidecars).
    pub exe: PathBuf,
    /// Sockets, disk tiers and logs go here.
    pub dir: PathBuf,
    /// Nodes, one rank each.
    pub nodes: usize,
    /// The store tier's URL.
    pub store: String,
    /// Each sidecar's memory budget, in bytes.
    pub memory_budget: u64,
    pub job: String,
    pub state_bytes: u64,
    pub seed: u64,
    pub every: u64,
    /// How long a SIGTERMed sidecar may drain (`--grace`).
    pub grace: Duration,
    /// The faults a campaign may inject into the cluster's links and disks.
    pub faults: FaultSetup,
    /// What the trainers are.
    pub trainer: TrainerKind,
    /// The trainers train the elastic job's shards ([`crate::shard`]).
    pub elastic: bool,
}

/// What a cluster prepares so that faults can be injected into it; nothing by default.
#[derive(Debug, Clone, Default)]
pub struct FaultSetup {
    /// Sidecars reach their peers through fault proxies ([`Links`]), so a partition can cut
    /// chosen links.
    pub links: bool,
    /// Each node's disk tier is a tmpfs of this many bytes of its own (mounted by the cluster,
    /// which needs root), so that it can be filled up.
    pub disk_bytes: Option<u64>,
    /// The sidecars' `--peer-timeout` (how long a stalled peer connection is waited for).
    pub peer_timeout: Option<Duration>,
}

/// A message from the trainers' reader threads.
#[derive(Debug)]
pub enum Msg {
    /// An event a trainer reported.
    Event(Event),
    /// A trainer's stdout closed (it exited or was killed); `generation` tells which start.
    Closed { rank: u32, generation: u32 },
}

/// A running sidecar.
pub struct Node {
    pub id: String,
    pub http: SocketAddr,
    pub socket: PathBuf,
    pub disk: PathBuf,
    pub log: PathBuf,
    child: Child,
}

/// A running trainer.
pub struct Trainer {
    pub rank: u32,
    pub generation: u32,
    child: Child,
}

/// The whole cluster; children are killed when it is dropped.
pub struct Cluster {
    pub layout: Layout,
    token: String,
    peer_ports: Vec<u16>,
    http_ports: Vec<u16>,
    /// Starts of each node so far (a new start after a kill is a replacement node).
    node_generations: Vec<u32>,
    trainer_generations: Vec<u32>,
    /// Starts of the whole job so far: each has its own file to agree on a step through.
    job_starts: u32,
    pub nodes: Vec<Option<Node>>,
    pub trainers: Vec<Option<Trainer>>,
    /// Ranks of the job the trainers start next, rank `r` on node `r` (every node by default;
    /// fewer after a node is lost and not replaced).
    pub world_size: usize,
    /// The peer links' fault proxies, with [`FaultSetup::links`].
    links: Option<Links>,
    /// Disk directories with a tmpfs of their own mounted ([`FaultSetup::disk_bytes`]).
    mounts: Vec<PathBuf>,
    tx: Sender<Msg>,
    pub rx: Receiver<Msg>,
}

/// TCP ports on 127.0.0.1, free now, for the sidecars. A restarted node binds its ports again,
/// so they are taken below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`): the
/// kernel never hands one of those to another socket (a bind to port 0, a `connect`) while the
/// node is down. Where that range leaves no room below it, the kernel picks them.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    const LOWEST: u16 = 10_000;
    let err = |e| Error::io("pick free ports", e);
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut listeners = Vec::with_capacity(n);
    if let Some(span) = ephemeral.checked_sub(LOWEST).filter(|s| *s > 0) {
        // From a random place, so that two runs at once rarely try the same ports.
        let start = RandomState::new().hash_one(std::process::id()) % u64::from(span);
        for k in 0..u64::from(span) {
            if listeners.len() == n {
                break;
            }
            let port = LOWEST + ((start + k) % u64::from(span)) as u16;
            if let Ok(l) = TcpListener::bind(("127.0.0.1", port)) {
                listeners.push(l);
            }
        }
    }
    while listeners.len() < n {
        listeners.push(TcpListener::bind("127.0.0.1:0").map_err(err)?);
    }
    listeners
        .iter()
        .map(|l| Ok(l.local_addr().map_err(err)?.port()))
        .collect()
}

fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag of the calling (child) process and is
    // async-signal-safe, as a pre_exec hook must be.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
}

/// A CA made for this run and a certificate per node under `layout.dir/tls`: peer links are
/// TLS 1.3, both sides showing a certificate of that CA, as a real cluster's are.
fn make_certificates(layout: &Layout) -> Result<()> {
    let dir = layout.dir.join("tls");
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("remove the last run's certificates", e)),
    }
    let out = Command::new(&layout.exe)
        .args(["tls", "init"])
        .arg(&dir)
        .args((0..layout.nodes).map(Cluster::node_id))
        .args(["--days", "2"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| Error::io("run hotstart tls init", e))?;
    if !out.status.success() {
        return Err(Error::Check(format!(
            "hotstart tls init failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

impl Cluster {
    /// A cluster of `layout.nodes` nodes, none started yet.
    pub fn new(layout: Layout) -> Result<Cluster> {
        std::fs::create_dir_all(&layout.dir)
            .map_err(|e| Error::io("create the demo directory", e))?;
        let ports = free_ports(2 * layout.nodes)?;
        let (peer_ports, http_ports) = ports.split_at(layout.nodes);
        let token = blake3::hash(format!("{:?}{}", Instant::now(), std::process::id()).as_bytes())
            .to_hex()
            .to_string();
        let (tx, rx) = channel();
        if layout.faults.disk_bytes.is_some() {
            private_mounts()?;
        }
        let links = if layout.faults.links {
            Some(Links::start(peer_ports)?)
        } else {
            None
        };
        make_certificates(&layout)?;
        Ok(Cluster {
            token,
            peer_ports: peer_ports.to_vec(),
            http_ports: http_ports.to_vec(),
            node_generations: vec![0; layout.nodes],
            trainer_generations: vec![0; layout.nodes],
            job_starts: 0,
            nodes: (0..layout.nodes).map(|_| None).collect(),
            trainers: (0..layout.nodes).map(|_| None).collect(),
            world_size: layout.nodes,
            links,
            mounts: Vec::new(),
            tx,
            rx,
            layout,
        })
    }

    pub fn node_id(i: usize) -> String {
        format!("node-{i}")
    }

    /// Starts node `i`'s sidecar; `fresh_disk` gives it a new, empty disk directory (a
    /// replacement machine). Does not wait for it to be ready.
    pub fn start_node(&mut self, i: usize, fresh_disk: bool) -> Result<()> {
        let id = Self::node_id(i);
        if fresh_disk || self.node_generations[i] == 0 {
            // The machine it replaces is gone, and its disk with it.
            if self.node_generations[i] > 0 {
                let old = self.disk_dir(i);
                self.unmount(&old);
            }
            self.node_generations[i] += 1;
        }
        let disk = self.disk_dir(i);
        if let Some(bytes) = self.layout.faults.disk_bytes {
            self.mount_tmpfs(&disk, bytes)?;
        }
        let l = &self.layout;
        let socket = l.dir.join(format!("{id}.sock"));
        let log = l.dir.join(format!("{id}.log"));
        let peers: Vec<String> = (0..l.nodes)
            .filter(|&j| j != i)
            .map(|j| {
                let port = match &self.links {
                    Some(links) => links.port(i, j),
                    None => self.peer_ports[j],
                };
                format!("{}=127.0.0.1:{port}", Self::node_id(j))
            })
            .collect();
        let http = SocketAddr::from(([127, 0, 0, 1], self.http_ports[i]));
        let mut cmd = Command::new(&l.exe);
        cmd.arg("serve")
            .args(["--node-id", &id])
            .args(["--listen", &format!("127.0.0.1:{}", self.peer_ports[i])])
            .args(["--http", &http.to_string()])
            .arg("--socket")
            .arg(&socket)
            .arg("--disk-dir")
            .arg(&disk)
            .args(["--store", &l.store])
            .args(["--peers", &peers.join(",")])
            .args(["--replicas", "1"])
            .arg("--tls-dir")
            .arg(l.dir.join("tls").join(&id))
            .args(["--memory-budget", &l.memory_budget.to_string()])
            .args([
                "--probe-interval",
                "1s",
                "--recovery-timeout",
                "20s",
                "--grace",
                &format!("{}s", l.grace.as_secs().max(1)),
            ])
            .args(
                l.faults
                    .peer_timeout
                    .map(|t| format!("--peer-timeout={}s", t.as_secs().max(1))),
            )
            .env("HOTSTART_CLUSTER_TOKEN", &self.token)
            .env("HOTSTART_LOG", "info")
            .env_remove("HOTSTART_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Self::append(&log)?);
        die_with_parent(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| Error::io("start hotstart serve", e))?;
        self.nodes[i] = Some(Node {
            id,
            http,
            socket,
            disk,
            log,
            child,
        });
        Ok(())
    }

    /// Node `i`'s disk-tier directory (its current machine's).
    fn disk_dir(&self, i: usize) -> PathBuf {
        self.layout.dir.join(format!(
            "{}-disk-{}",
            Self::node_id(i),
            self.node_generations[i]
        ))
    }

    /// Mounts a tmpfs of `bytes` at `dir`, once.
    fn mount_tmpfs(&mut self, dir: &Path, bytes: u64) -> Result<()> {
        if self.mounts.iter().any(|m| m == dir) {
            return Ok(());
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create a disk directory", e))?;
        let cstr = |s: &str| std::ffi::CString::new(s).expect("no NUL");
        let target = cstr(&dir.display().to_string());
        let (fstype, options) = (cstr("tmpfs"), cstr(&format!("size={bytes}")));
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                fstype.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                options.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(Error::Resources(format!(
                "cannot mount a {bytes}-byte tmpfs at {} for the full-disk fault ({}); run as root, or without that fault",
                dir.display(),
                std::io::Error::last_os_error()
            )));
        }
        self.mounts.push(dir.to_path_buf());
        Ok(())
    }

    fn unmount(&mut self, dir: &Path) {
        if let Some(k) = self.mounts.iter().position(|m| m == dir) {
            let target = std::ffi::CString::new(dir.display().to_string()).expect("no NUL");
            // SAFETY: a NUL-terminated path that outlives the call. MNT_DETACH: a process still
            // holding a file there (a sidecar being reaped) does not keep the mount.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            self.mounts.swap_remove(k);
        }
    }

    /// Cuts (or heals) the links between nodes `a` and `b`, both ways.
    pub fn set_cut(&self, a: usize, b: usize, cut: bool) -> Result<()> {
        let links = self.links.as_ref().ok_or_else(|| {
            Error::Protocol("a partition needs the cluster's link proxies".into())
        })?;
        links.set_cut(a, b, cut);
        Ok(())
    }

    /// Fills node `i`'s disk tier for as long as the returned guard lives: a ballast file takes
    /// every free byte, and again whatever the sidecar frees, until the guard is dropped and
    /// the ballast removed.
    pub fn fill_disk(&self, i: usize) -> Result<Ballast> {
        if self.layout.faults.disk_bytes.is_none() {
            return Err(Error::Protocol(
                "a full disk needs the cluster's own disk mounts".into(),
            ));
        }
        Ballast::fill(self.disk_dir(i).join(".ballast"))
    }

    fn append(log: &Path) -> Result<File> {
        File::options()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|e| Error::io("open a log file", e))
    }

    /// Waits until every running node answers `/readyz` with 200.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut waiting = None;
            for node in self.nodes.iter_mut().flatten() {
                if let Some(status) = node.child.try_wait().map_err(|e| Error::io("wait", e))? {
                    return Err(Error::Exited {
                        what: format!("sidecar {}", node.id),
                        status: status.to_string(),
                        log: node.log.clone(),
                    });
                }
                if !matches!(get(node.http, "/readyz"), Ok((200, _))) {
                    waiting = Some(node.id.clone());
                }
            }
            let Some(id) = waiting else { return Ok(()) };
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!("sidecar {id} to become ready")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A new start of the whole job: the directory its trainers agree on the step to resume
    /// from through.
    pub fn next_job_start(&mut self) -> PathBuf {
        self.job_starts += 1;
        self.layout.dir.join(format!("resume-{}", self.job_starts))
    }

    /// Starts rank `rank`'s trainer (of a job of [`Cluster::world_size`] ranks) on node
    /// `rank`'s sidecar, resuming from the step agreed in
    /// `agreement` ([`Cluster::next_job_start`]); it trains until `until` (or until killed).
    pub fn start_trainer(
        &mut self,
        rank: usize,
        until: Option<u64>,
        agreement: &Path,
    ) -> Result<()> {
        self.trainer_generations[rank] += 1;
        let generation = self.trainer_generations[rank];
        let l = &self.layout;
        let socket = l.dir.join(format!("{}.sock", Self::node_id(rank)));
        let log = l.dir.join(format!("trainer-{rank}.log"));
        let mut cmd = match &l.trainer {
            TrainerKind::Rust => {
                let mut c = Command::new(&l.exe);
                c.args(["demo", "--run-trainer"]);
                c
            }
            TrainerKind::Torch { python } => {
                let mut c = Command::new(python);
                c.args(["-m", "torch.distributed.run", "--standalone"])
                    .args(["--nproc-per-node", "1", "--max-restarts", "0"])
                    .args(["-m", "hotstart._demo_trainer"]);
                c
            }
        };
        cmd.arg("--socket")
            .arg(&socket)
            .args(["--job", &l.job])
            .args(["--rank", &rank.to_string()])
            .args(["--world-size", &self.world_size.to_string()])
            .args(["--size", &l.state_bytes.to_string()])
            .args(["--seed", &l.seed.to_string()])
            .args(["--every", &l.every.to_string()])
            .arg("--resume-agreement")
            .arg(agreement)
            .env("HOTSTART_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Self::append(&log)?);
        if let Some(u) = until {
            cmd.args(["--until", &u.to_string()]);
        }
        if l.elastic {
            cmd.arg("--elastic");
        }
        // A group of its own: a torchrun agent and its worker are killed and signalled together.
        cmd.process_group(0);
        die_with_parent(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| Error::io("start a trainer", e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Protocol("no trainer stdout".into()))?;
        let tx = self.tx.clone();
        let rank = rank as u32;
        std::thread::Builder::new()
            .name(format!("demo-trainer-{rank}"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    match serde_json::from_str::<Event>(&line) {
                        Ok(e) if e.rank() == rank => {
                            if tx.send(Msg::Event(e)).is_err() {
                                return;
                            }
                        }
                        _ => eprintln!("demo: trainer {rank} said something unexpected: {line}"),
                    }
                }
                let _ = tx.send(Msg::Closed { rank, generation });
            })
            .map_err(|e| Error::io("start a reader thread", e))?;
        self.trainers[rank as usize] = Some(Trainer {
            rank,
            generation,
            child,
        });
        Ok(())
    }

    /// The generation of rank `rank`'s current trainer.
    pub fn trainer_generation(&self, rank: usize) -> u32 {
        self.trainer_generations[rank]
    }

    /// SIGKILLs rank `rank`'s trainer (its whole process group) and reaps it.
    pub fn kill_trainer(&mut self, rank: usize) -> Result<()> {
        if let Some(mut t) = self.trainers[rank].take() {
            if matches!(t.child.try_wait(), Ok(None)) {
                // SAFETY: killpg(2) of the group our own unreaped child leads (checked just
                // above, and only this thread reaps it): its id cannot have been recycled.
                unsafe { libc::killpg(t.child.id() as i32, libc::SIGKILL) };
            }
            kill(&mut t.child)?;
        }
        Ok(())
    }

    /// Waits for rank `rank`'s trainer to exit on its own; its exit status.
    pub fn wait_trainer(&mut self, rank: usize, timeout: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let Some(t) = self.trainers[rank].as_mut() else {
            return Err(Error::Protocol(format!("trainer {rank} is not running")));
        };
        loop {
            if let Some(s) = t.child.try_wait().map_err(|e| Error::io("wait", e))? {
                self.trainers[rank] = None;
                return Ok(s);
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(format!("trainer {rank} to finish")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs node `i`'s sidecar and reaps it.
    pub fn kill_node(&mut self, i: usize) -> Result<()> {
        if let Some(mut n) = self.nodes[i].take() {
            kill(&mut n.child)?;
        }
        Ok(())
    }

    /// SIGTERMs node `i`'s sidecar (it drains) and waits for it to exit; its exit status.
    pub fn terminate_node(&mut self, i: usize, timeout: Duration) -> Result<ExitStatus> {
        let Some(mut n) = self.nodes[i].take() else {
            return Err(Error::Protocol(format!("node {i} is not running")));
        };
        // SAFETY: kill(2) with the pid of our own unreaped child: it cannot be recycled.
        unsafe { libc::kill(n.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = n.child.try_wait().map_err(|e| Error::io("wait", e))? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                kill(&mut n.child)?;
                return Err(Error::Timeout(format!("sidecar {} to drain", n.id)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` (SIGSTOP, SIGCONT) to rank `rank`'s trainer (its whole process group);
    /// false when it is not running.
    pub fn signal_trainer(&mut self, rank: usize, signal: i32) -> bool {
        let Some(t) = self.trainers[rank].as_mut() else {
            return false;
        };
        if !matches!(t.child.try_wait(), Ok(None)) {
            return false;
        }
        // SAFETY: killpg(2) of the group our own child leads, not yet reaped (checked just above,
        // and only this thread reaps it): its id cannot have been recycled.
        unsafe { libc::killpg(t.child.id() as i32, signal) == 0 }
    }

    /// The process id of node `i`'s sidecar, when it runs.
    pub fn node_pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].as_ref().map(|n| n.child.id())
    }

    /// SIGTERMs every sidecar (they drain persistence) and waits for them to exit.
    pub fn stop_nodes(&mut self, timeout: Duration) -> Result<Vec<(String, ExitStatus)>> {
        let mut out = Vec::new();
        for n in self.nodes.iter_mut().flatten() {
            // SAFETY: kill(2) with the pid of our own unreaped child: it cannot be recycled.
            unsafe { libc::kill(n.child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + timeout;
        for slot in &mut self.nodes {
            let Some(mut n) = slot.take() else { continue };
            let status = loop {
                if let Some(s) = n.child.try_wait().map_err(|e| Error::io("wait", e))? {
                    break s;
                }
                if Instant::now() > deadline {
                    kill(&mut n.child)?;
                    return Err(Error::Timeout(format!("sidecar {} to drain", n.id)));
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            out.push((n.id, status));
        }
        Ok(out)
    }

    /// Node `i`'s metrics, or `None` when it is not running or does not answer.
    pub fn metrics(&self, i: usize) -> Option<Metrics> {
        let node = self.nodes[i].as_ref()?;
        match get(node.http, "/metrics") {
            Ok((200, body)) => Some(Metrics::parse(&body)),
            _ => None,
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for t in self.trainers.iter_mut().flatten() {
            let _ = kill(&mut t.child);
        }
        for n in self.nodes.iter_mut().flatten() {
            let _ = kill(&mut n.child);
        }
        // What the disks hold outlives their mounts: a failed campaign's disk tiers are there to
        // read afterwards.
        for m in self.mounts.clone() {
            let kept = m.with_extension("kept");
            let copied = copy_tree(&m, &kept).is_ok();
            self.unmount(&m);
            if copied && std::fs::remove_dir(&m).is_ok() {
                let _ = std::fs::rename(&kept, &m);
            }
        }
    }
}

/// Moves the calling thread (and the processes and threads it starts from now on) into a mount
/// namespace of its own, so that the disks the cluster mounts are seen by its sidecars alone
/// and go away with the last of them, however the demo ends.
fn private_mounts() -> Result<()> {
    let root = std::ffi::CString::new("/").expect("no NUL");
    // SAFETY: unshare and mount with valid, NUL-terminated arguments; they change this
    // thread's mount namespace only.
    let ok = unsafe {
        libc::unshare(libc::CLONE_NEWNS) == 0
            && libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) == 0
    };
    if ok {
        Ok(())
    } else {
        Err(Error::Resources(format!(
            "cannot make a mount namespace for the nodes' disks ({}); run as root, or without the full-disk fault",
            std::io::Error::last_os_error()
        )))
    }
}

/// Copies the files and directories under `from` to `to`.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// A file that keeps a filesystem full while it lives ([`Cluster::fill_disk`]).
pub struct Ballast {
    path: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    filler: Option<std::thread::JoinHandle<()>>,
}

impl Ballast {
    fn fill(path: PathBuf) -> Result<Ballast> {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut file = File::create(&path).map_err(|e| Error::io("create a ballast file", e))?;
        // The first fill before returning: the disk is full when the fault is said to begin.
        top_up(&mut file);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let filler = std::thread::Builder::new()
            .name("demo-ballast".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    top_up(&mut file);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
            .map_err(|e| Error::io("start a ballast thread", e))?;
        Ok(Ballast {
            path,
            stop,
            filler: Some(filler),
        })
    }
}

/// Appends to `file` until its filesystem has no byte left.
fn top_up(file: &mut File) {
    let big = vec![0u8; 1 << 20];
    for size in [1 << 20, 4096, 1] {
        while file.write_all(&big[..size]).is_ok() {}
    }
}

impl Drop for Ballast {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.filler.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn kill(child: &mut Child) -> Result<()> {
    // Already gone is fine: kill only fails for a reaped child, which wait below reports.
    let _ = child.kill();
    child.wait().map_err(|e| Error::io("reap a child", e))?;
    Ok(())
}

/// One plain HTTP/1.1 GET; the status and body.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.take(16 << 20).read_to_string(&mut text)?;
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response from {addr}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Ok((status, body))
}

/// A sidecar's metrics: `name{labels}` → value, as exported in Prometheus text format.
#[derive(Debug, Default, Clone)]
pub struct Metrics(std::collections::HashMap<String, f64>);

impl Metrics {
    pub fn parse(text: &str) -> Metrics {
        Metrics(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (k, v) = l.rsplit_once(' ')?;
                    Some((k.to_string(), v.parse().ok()?))
                })
                .collect(),
        )
    }

    /// The value of `series` (`name` or `name{label="value"}`), 0 when absent.
    pub fn get(&self, series: &str) -> f64 {
        self.0.get(series).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_distinct_and_outside_the_ephemeral_range() {
        let ports = free_ports(8).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 8, "{ports:?}");
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let first: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
        if first > 10_000 {
            assert!(
                ports.iter().all(|p| (10_000..first).contains(p)),
                "{ports:?} (ephemeral from {first})"
            );
        }
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
