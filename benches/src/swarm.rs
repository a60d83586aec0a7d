//! A job's nodes starting together: N nodes, each a Linux network namespace with its own
//! sidecar (`hotstart serve`), start the same artifact at the same moment, with and without
//! sharing, against SeaweedFS in a namespace of its own (testkit's `SwarmNet`: the store's link
//! and every node's link shaped with `tc`).
//!
//! Artifacts, same run:
//! - **env**: an eager `hotstart env ensure` of an environment snapshot (`--env-mib`, random
//!   bytes, three quarters in 1 MiB files and the rest in small ones), from a fresh chunk
//!   cache on every node; ready when `ensure` exits, every node's tree checked file by file.
//! - **ckpt**: a data-parallel job's step (every rank the same `--ckpt-mib` tensor), in the
//!   store only (every sidecar restarted empty, no disk tier), restored by every rank at once
//!   through its sidecar; ready when the rank's tensor is in place and its hash checked.
//!
//! For each N: the bytes the store's link sent (its interface counter) divided by what one
//! node alone makes it send (the artifact, with its metadata and HTTP overhead); p50 and p99
//! of the time to ready, against N nodes each reading the store (sidecars with `--no-share`,
//! or no sidecar for `env`) and against one node alone. At the largest N, two faults: one
//! node's link throttled to a tenth (`--fault-runs` times, each against a round without it run
//! just before), and one node's sidecar sending corrupt pieces, for each artifact. And how
//! busy this machine's cores were during each round: every "node" here shares the same cores,
//! so N nodes do N times the decompressing, hashing, verifying and writing of one on them.
//! That is measured as the floor of the env rows: the same N restores at once from a snapshot
//! in a local directory (no network, no store, no sharing), the fastest N restores can be
//! here. The checkpoint rows' floor is reckoned, not run: the CPU time one node alone's
//! checkpoint restore took, N times over, spread on this machine's cores (what N nodes need if
//! each spends what one node does; with sharing each also sends its share of the pieces to the
//! others, so the floor is low).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, Extras, StepSel, Tensor};
use hotstart_testkit::swarm::{Shape, Sidecars, SwarmNet, env_install_program, file_tree};
use hotstart_testkit::{SeaweedFs, pattern, spawn_tied, workspace_root};

use crate::report::median;

#[derive(Debug, clap::Args)]
pub struct SwarmArgs {
    /// Node counts, each in a swarm of its own.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    nodes: Vec<usize>,
    /// Size of the environment.
    #[arg(long, default_value_t = 64)]
    env_mib: usize,
    /// Size of each rank's checkpoint shard.
    #[arg(long, default_value_t = 64)]
    ckpt_mib: usize,
    /// The sidecars' `--share-piece`: the ranges a chunk (64 MiB) is shared in.
    #[arg(long, default_value = "4MiB")]
    share_piece: String,
    /// What the store's link sends, in Mbit/s.
    #[arg(long, default_value_t = 800)]
    store_mbit: u32,
    /// Each node's link, each way, in Mbit/s.
    #[arg(long, default_value_t = 1000)]
    node_mbit: u32,
    /// At the largest N, how many times the throttled-peer comparison runs: each time a
    /// sharing round without the fault, then one with it (the first without is the table's own
    /// sharing round). These cores make one round's p99 move by tens of percent from run to
    /// run; the ratios of the pairs and their median are reported.
    #[arg(long, default_value_t = 1)]
    fault_runs: usize,
    /// The node whose link is throttled and whose sidecar corrupts what it sends (0 to N − 1),
    /// the same in every run; by default, the node that read the most from the store in the
    /// sharing round just run (it owns the most pieces), which may change from run to run.
    #[arg(long)]
    fault_node: Option<usize>,
    /// Write the table here (Markdown).
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// (internal) A rank of the data-parallel job: saves or restores its step through its sidecar.
#[derive(Debug, clap::Args)]
pub struct SwarmRank {
    #[arg(long)]
    socket: PathBuf,
    #[arg(long)]
    rank: u32,
    #[arg(long)]
    world: u32,
    #[arg(long)]
    mib: usize,
    /// Restore instead of saving.
    #[arg(long)]
    restore: bool,
}

const JOB: &str = "swarm";
const PEERS_UP: Duration = Duration::from_secs(60);

/// Every rank's tensor: the same bytes (data-parallel replicas).
fn replica(mib: usize) -> Vec<u8> {
    pattern(mib << 20, 53)
}

/// The rank process.
pub fn rank(args: &SwarmRank) -> anyhow::Result<()> {
    let cfg = EngineConfig::new(JOB, args.rank, args.world).sidecar(&args.socket);
    let engine = Engine::new(cfg)?;
    let want = replica(args.mib);
    if args.restore {
        let mut buf = vec![0u8; want.len()];
        let loaded = engine.load(
            StepSel::Latest,
            Destination::Buffers([("w".to_string(), &mut buf[..])].into()),
        )?;
        ensure!(loaded.step == 1, "restored step {}", loaded.step);
        ensure!(
            blake3::hash(&buf) == blake3::hash(&want),
            "rank {}: the restored bytes differ",
            args.rank
        );
    } else {
        let t = Tensor::new("w", Dtype::U8, vec![want.len() as u64], want)?;
        let h = engine.save(1, vec![t], Extras::new())?;
        h.wait_staged()?;
        h.wait()?;
    }
    Ok(())
}

/// The `hotstart` binary beside this one, built if it is not there.
fn hotstart_exe() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?
        .parent()
        .context("benchmark binary has no directory")?
        .join("hotstart");
    if !exe.exists() {
        let status = Command::new("cargo")
            .args([
                "build",
                "--profile",
                "bench",
                "-p",
                "hotstart",
                "--bin",
                "hotstart",
            ])
            .current_dir(workspace_root().context("no workspace root")?)
            .status()?;
        ensure!(
            status.success(),
            "cargo build of the hotstart binary failed"
        );
    }
    ensure!(exe.exists(), "{} is missing", exe.display());
    Ok(exe)
}

/// Times to ready of one round, and the bytes the store sent.
#[derive(Debug, Clone)]
struct Round {
    times: Vec<Duration>,
    store_bytes: u64,
    /// The share of this machine's CPU time that was busy during the round.
    busy: f64,
}

/// This machine's CPU time so far, busy and in all (`/proc/stat`, in clock ticks).
fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let ticks: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    let total: u64 = ticks.iter().sum();
    // idle and iowait
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// The busy share of CPU time between two readings of [`cpu_ticks`].
fn busy_since(before: (u64, u64)) -> f64 {
    let now = cpu_ticks();
    (now.0 - before.0) as f64 / (now.1 - before.1).max(1) as f64
}

impl Round {
    fn p50(&self) -> Duration {
        median(self.times.clone())
    }

    /// The 99th percentile (the slowest node, for N ≤ 100).
    fn p99(&self) -> Duration {
        let mut t = self.times.clone();
        t.sort();
        let i = ((t.len() as f64 * 0.99).ceil() as usize).clamp(1, t.len()) - 1;
        t[i]
    }
}

/// Runs `children` (started at once) to the end; each one's time from `started`, in order.
fn wait_all(started: Instant, children: Vec<(String, Child)>) -> anyhow::Result<Vec<Duration>> {
    let waits: Vec<_> = children
        .into_iter()
        .map(|(what, c)| {
            std::thread::spawn(move || -> anyhow::Result<Duration> {
                let out = c.wait_with_output()?;
                let took = started.elapsed();
                ensure!(
                    out.status.success(),
                    "{what} failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                Ok(took)
            })
        })
        .collect();
    waits
        .into_iter()
        .map(|w| {
            w.join()
                .map_err(|_| anyhow::anyhow!("a waiting thread panicked"))?
        })
        .collect()
}

/// One swarm of `n` nodes and what it runs.
struct Swarm<'n> {
    net: &'n SwarmNet,
    weed: &'n SeaweedFs,
    sidecars: Sidecars<'n>,
    exe: PathBuf,
    work: PathBuf,
    bucket: String,
    lock: PathBuf,
    install: String,
    reference: std::collections::BTreeMap<PathBuf, (u32, String)>,
    ckpt_mib: usize,
    share_piece: String,
}

impl Swarm<'_> {
    fn python() -> PathBuf {
        workspace_root()
            .map(|r| r.join(".venv/bin/python"))
            .unwrap_or_else(|| "python3".into())
    }

    fn env_store(&self) -> String {
        format!("{}/envs", self.bucket)
    }

    fn ckpt_store(&self) -> String {
        format!("{}/ckpt", self.bucket)
    }

    /// `hotstart env ensure` of the environment into `dir`, from `store`.
    fn ensure_cmd(&self, store: &str, dir: &Path) -> Command {
        let mut c = Command::new(&self.exe);
        c.envs(self.weed.env())
            .env("HOTSTART_ENV_PYTHON", Swarm::python())
            .env_remove("HOTSTART_SHARE")
            .args(["env", "ensure", "--relocatable", "--json", "--store", store])
            .arg("--lock")
            .arg(&self.lock)
            .arg("--target")
            .arg(dir.join("env"))
            .arg("--cache-dir")
            .arg(dir.join("cache"))
            .arg("--")
            .arg(Swarm::python())
            .args(["-c", &self.install])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    /// Every sidecar (re)started empty with `args`, node `odd` (if any) with `odd_env` too.
    fn restart(
        &mut self,
        args: &[&str],
        odd: Option<(usize, &[(&str, &str)])>,
    ) -> anyhow::Result<()> {
        for i in 0..self.net.nodes() {
            self.sidecars.stop(i, false);
        }
        for i in 0..self.net.nodes() {
            let env = match odd {
                Some((j, env)) if j == i => env,
                _ => &[],
            };
            self.sidecars.start(i, args, env)?;
        }
        self.sidecars.wait_peers(PEERS_UP)?;
        Ok(())
    }

    /// Every node ensures the environment at once from `store` (`share`: through its
    /// sidecar); every tree checked.
    fn env_round(&self, tag: &str, store: &str, share: bool) -> anyhow::Result<Round> {
        let n = self.net.nodes();
        let before = self.net.store_sent()?;
        let ticks = cpu_ticks();
        let started = Instant::now();
        let mut children = Vec::new();
        for i in 0..n {
            let mut c = self.ensure_cmd(store, &self.work.join(format!("{tag}/n{i}")));
            if share {
                c.env("HOTSTART_SHARE", self.sidecars.socket(i));
            }
            children.push((
                format!("env ensure on n{i}"),
                spawn_tied(c, Some(&self.net.node_ns(i)))?,
            ));
        }
        let times = wait_all(started, children)?;
        let busy = busy_since(ticks);
        let store_bytes = self.net.store_sent()? - before;
        for i in 0..n {
            let dir = self.work.join(format!("{tag}/n{i}"));
            let got = file_tree(&dir.join("env"))?;
            ensure!(got == self.reference, "{tag}: n{i}'s environment differs");
            std::fs::remove_dir_all(&dir)?;
        }
        Ok(Round {
            times,
            store_bytes,
            busy,
        })
    }

    /// The rank processes, one per node, all at once.
    fn ranks(&self, restore: bool) -> anyhow::Result<Vec<Duration>> {
        let n = self.net.nodes();
        let bench = std::env::current_exe()?;
        let started = Instant::now();
        let mut children = Vec::new();
        for i in 0..n {
            let mut c = Command::new(&bench);
            c.args([
                "swarm-rank",
                "--rank",
                &i.to_string(),
                "--world",
                &n.to_string(),
            ])
            .args(["--mib", &self.ckpt_mib.to_string()])
            .arg("--socket")
            .arg(self.sidecars.socket(i))
            .env("HOTSTART_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            if restore {
                c.arg("--restore");
            }
            children.push((
                format!("rank {i}"),
                spawn_tied(c, Some(&self.net.node_ns(i)))?,
            ));
        }
        wait_all(started, children)
    }

    /// The two faults of `artifact`, each a `round` of sidecars restarted (the odd one with
    /// its environment): a node (`--fault-node`, or the one that read the most from the store
    /// in the sharing round just run) with its link at a tenth (`--fault-runs` times,
    /// each after a round without the fault, the first of which is `shared`), then sending
    /// corrupt pieces.
    fn faults(
        &mut self,
        artifact: &'static str,
        args: &SwarmArgs,
        shared: &Round,
        round: impl Fn(&mut Self, Option<(usize, &[(&str, &str)])>) -> anyhow::Result<Round>,
    ) -> anyhow::Result<Faults> {
        let served = format!("hotstart_share_served_bytes_total{{artifact=\"{artifact}\"}}");
        let n = self.net.nodes();
        // The node that read the most from the store owns the most pieces (a node reads the
        // store for the pieces it owns, for its peers too): throttled, the most wait on it.
        // A checkpoint's sidecars read their own store, whose reads they count; an
        // environment's pieces name their store, and only those a node's own processes had
        // from it are counted.
        let read = match artifact {
            "ckpt" => "hotstart_store_bytes_total{op=\"get\"}".to_string(),
            _ => format!("hotstart_share_bytes_total{{artifact=\"{artifact}\",source=\"store\"}}"),
        };
        let read = read.as_str();
        let busiest = (0..n).max_by(|&a, &b| {
            let (a, b) = (self.sidecars.metric(a, read), self.sidecars.metric(b, read));
            a.total_cmp(&b)
        });
        let node = match args.fault_node {
            Some(node) => {
                ensure!(
                    node < n,
                    "--fault-node {node}: the swarm has nodes 0 to {}",
                    n - 1
                );
                node
            }
            None => busiest.unwrap_or(0),
        };
        let served_shared = (
            self.sidecars.metric(node, &served),
            self.sidecars.metric(node, read),
        );
        let node_mbit = args.node_mbit;
        let mut throttled = Vec::new();
        for k in 0..args.fault_runs.max(1) {
            let without = match k {
                0 => shared.clone(),
                _ => {
                    eprintln!("  {n} nodes: {artifact}, sharing ({})", k + 1);
                    round(self, None)?
                }
            };
            eprintln!("  {n} nodes: {artifact}, sharing, n{node}'s link at a tenth");
            self.net.reshape_node(node, node_mbit / 10)?;
            let r = round(self, None);
            self.net.reshape_node(node, node_mbit)?;
            throttled.push((without, r?));
        }
        eprintln!("  {n} nodes: {artifact}, sharing, n{node} sending corrupt pieces");
        let r = round(self, Some((node, CORRUPT)))?;
        let id = Sidecars::id(node);
        let bad = self.sidecars.total(&format!(
            "hotstart_share_peer_failures_total{{peer=\"{id}\",kind=\"corrupt\"}}"
        ));
        let sent = self.sidecars.metric(node, &served);
        Ok(Faults {
            artifact,
            node,
            chosen: args.fault_node.is_some(),
            served: served_shared,
            throttled,
            corrupt: (r, bad, sent),
        })
    }

    /// The sidecars' arguments for the checkpoint rounds.
    fn ckpt_args(&self, share: bool) -> Vec<String> {
        let budget = format!("{}MiB", self.ckpt_mib * 4 + 512);
        let mut a = vec![
            "--store".to_string(),
            self.ckpt_store(),
            "--memory-budget".into(),
            budget,
            "--replicas".into(),
            "0".into(),
            "--share-piece".into(),
            self.share_piece.clone(),
        ];
        if !share {
            a.push("--no-share".into());
        }
        a
    }

    /// Every rank restores the step from the store at once, through sidecars restarted empty.
    fn ckpt_round(
        &mut self,
        share: bool,
        odd: Option<(usize, &[(&str, &str)])>,
    ) -> anyhow::Result<Round> {
        let args = self.ckpt_args(share);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        self.restart(&refs, odd)?;
        let before = self.net.store_sent()?;
        let ticks = cpu_ticks();
        let times = self.ranks(true)?;
        Ok(Round {
            times,
            busy: busy_since(ticks),
            store_bytes: self.net.store_sent()? - before,
        })
    }
}

/// The faults at the largest N, for one artifact.
#[derive(Debug, Clone)]
struct Faults {
    artifact: &'static str,
    /// The faulty node: `--fault-node` (`chosen`), else the one that read the most from the
    /// store in the sharing round, so that it owns the most pieces (an artifact of a few pieces
    /// may leave a given node none); the bytes it served and read from the store in that round.
    node: usize,
    chosen: bool,
    served: (f64, f64),
    /// Sharing rounds without the fault and with the node's link at a tenth, in pairs.
    throttled: Vec<(Round, Round)>,
    /// The round, the corrupt pieces its peers counted, and the bytes it served.
    corrupt: (Round, f64, f64),
}

/// A sidecar that sends corrupt pieces.
const CORRUPT: &[(&str, &str)] = &[("HOTSTART_FAULT_CORRUPT_SHARED", "1")];

/// What one N measured.
#[derive(Debug, Clone)]
struct Measured {
    n: usize,
    /// The N restores at once from a local directory.
    env_floor: Round,
    env_alone: Round,
    env_shared: Round,
    ckpt_alone: Round,
    ckpt_shared: Round,
    /// At the largest N, for env and ckpt: one node's link at a tenth, and one node's sidecar
    /// corrupting what it sends (with the corrupt pieces its peers counted).
    faults: Vec<Faults>,
}

fn measure(args: &SwarmArgs, n: usize, exe: &Path, faults: bool) -> anyhow::Result<Measured> {
    let shape = Shape {
        store_mbit: Some(args.store_mbit),
        node_mbit: Some(args.node_mbit),
    };
    let net = SwarmNet::up(n, shape)?;
    let weed = SeaweedFs::start_in_netns(&net.store_ns(), net.store_ip())?;
    let tmp = tempfile::Builder::new()
        .prefix("hotstart-swarm-")
        .tempdir_in("/var/tmp")?;
    let work = tmp.path().to_path_buf();
    // HOTSTART_BENCH_KEEP=1 keeps the work directory (the sidecars' logs) for a look after.
    let _tmp = if std::env::var_os("HOTSTART_BENCH_KEEP").is_some() {
        eprintln!("  keeping {}", tmp.keep().display());
        None
    } else {
        Some(tmp)
    };
    let lock = work.join("requirements.txt");
    std::fs::write(&lock, "swarm-bench==1\n")?;
    let (_, install) = env_install_program(args.env_mib);
    let sidecars = Sidecars::new(&net, exe, &work.join("sidecars"), weed.env())?;
    let mut s = Swarm {
        net: &net,
        weed: &weed,
        sidecars,
        exe: exe.to_path_buf(),
        work: work.clone(),
        bucket: weed.fresh_bucket("swarm"),
        lock,
        install,
        reference: Default::default(),
        ckpt_mib: args.ckpt_mib,
        share_piece: args.share_piece.clone(),
    };
    eprintln!("  {n} nodes: capturing the environment");
    let capture = work.join("capture");
    let out = s.ensure_cmd(&s.env_store(), &capture).output()?;
    ensure!(
        out.status.success(),
        "capture: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    s.reference = file_tree(&capture.join("env"))?;
    // The same snapshot in a local directory, for the floor.
    let local = work.join("local-store");
    let local = local.to_str().context("work directory path")?;
    let out = s.ensure_cmd(local, &work.join("capture-local")).output()?;
    ensure!(
        out.status.success(),
        "capture into {local}: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    eprintln!("  {n} nodes: env, each from a local directory (the floor)");
    let env_floor = s.env_round("floor", local, false)?;
    eprintln!("  {n} nodes: env, each from the store");
    let env_alone = s.env_round("alone", &s.env_store(), false)?;
    eprintln!("  {n} nodes: env, sharing");
    s.restart(&["--memory-budget", "512MiB"], None)?;
    let env_shared = s.env_round("shared", &s.env_store(), true)?;
    let mut all_faults = Vec::new();
    if faults && n > 2 {
        all_faults.push(s.faults("env", args, &env_shared, |s, odd| {
            s.restart(&["--memory-budget", "512MiB"], odd)?;
            s.env_round("fault", &s.env_store(), true)
        })?);
    }

    eprintln!("  {n} nodes: ckpt, saving");
    let args_save = s.ckpt_args(true);
    let refs: Vec<&str> = args_save.iter().map(String::as_str).collect();
    s.restart(&refs, None)?;
    s.ranks(false)?;
    eprintln!("  {n} nodes: ckpt, each from the store");
    let ckpt_alone = s.ckpt_round(false, None)?;
    eprintln!("  {n} nodes: ckpt, sharing");
    let ckpt_shared = s.ckpt_round(true, None)?;
    if faults && n > 2 {
        all_faults.push(s.faults("ckpt", args, &ckpt_shared, |s, odd| s.ckpt_round(true, odd))?);
    }
    drop(s);
    Ok(Measured {
        n,
        env_floor,
        env_alone,
        env_shared,
        ckpt_alone,
        ckpt_shared,
        faults: all_faults,
    })
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

pub fn run(args: &SwarmArgs) -> anyhow::Result<()> {
    if let Some(why) = SwarmNet::unavailable() {
        bail!("the swarm benchmark runs nodes as network namespaces: {why}");
    }
    let exe = hotstart_exe()?;
    let mut nodes = args.nodes.clone();
    nodes.sort_unstable();
    nodes.dedup();
    ensure!(
        nodes.first() == Some(&1),
        "--nodes must include 1 (one node alone)"
    );
    let largest = *nodes.last().unwrap_or(&1);
    let mut all = Vec::new();
    for &n in &nodes {
        eprintln!("swarm of {n}:");
        all.push(measure(args, n, &exe, n == largest)?);
    }
    let one = &all[0];
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // One node's checkpoint restore in CPU seconds: busy share × cores × the round's length.
    let ckpt_cpu = one.ckpt_alone.busy * cores as f64 * one.ckpt_alone.p99().as_secs_f64();
    let (env_size, ckpt_size) = (
        one.env_alone.store_bytes as f64,
        one.ckpt_alone.store_bytes as f64,
    );
    let mut md = format!(
        "### Chunk sharing: N nodes starting the same artifact at once\n\n\
         Store link {} Mbit/s, node links {} Mbit/s; env {} MiB, ckpt {} MiB per rank in 64 MiB chunks shared in {} ranges. \
         Store bytes are the store link's own counter, over what one node alone makes it send \
         (env {:.1} MB, ckpt {:.1} MB). Times from the start of all N to each node ready, in s. \
         The floor, env: the same N env restores at once from a local directory, no network; \
         ckpt: the CPU time one node alone's checkpoint round took (its busy share × {} cores × \
         its length), N times over, spread on {} cores.\n\n\
         | artifact | N | store sent ÷ artifact, sharing | each from the store | p50 / p99 sharing | p50 / p99 each from the store | p99 sharing ÷ one node alone | p99 floor · sharing ÷ floor | CPU busy, sharing · each from the store |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        args.store_mbit,
        args.node_mbit,
        args.env_mib,
        args.ckpt_mib,
        args.share_piece,
        env_size / 1e6,
        ckpt_size / 1e6,
        cores,
        cores,
    );
    for m in &all {
        let rows = [
            (
                "env",
                &m.env_shared,
                &m.env_alone,
                env_size,
                one.env_alone.p99(),
                m.env_floor.p99(),
            ),
            (
                "ckpt",
                &m.ckpt_shared,
                &m.ckpt_alone,
                ckpt_size,
                one.ckpt_alone.p99(),
                Duration::from_secs_f64(ckpt_cpu * m.n as f64 / cores as f64),
            ),
        ];
        for (what, shared, alone, size, solo, floor) in rows {
            let floor = format!(
                "{} · {:.2}",
                secs(floor),
                shared.p99().as_secs_f64() / floor.as_secs_f64()
            );
            md.push_str(&format!(
                "| {what} | {} | {:.2} | {:.2} | {} / {} | {} / {} | {:.2} | {floor} | {:.0}% · {:.0}% |\n",
                m.n,
                shared.store_bytes as f64 / size,
                alone.store_bytes as f64 / size,
                secs(shared.p50()),
                secs(shared.p99()),
                secs(alone.p50()),
                secs(alone.p99()),
                shared.p99().as_secs_f64() / solo.as_secs_f64(),
                shared.busy * 100.0,
                alone.busy * 100.0,
            ));
        }
    }
    let big = all.last().context("no swarm")?;
    md.push('\n');
    for f in &big.faults {
        let (size, intact) = match f.artifact {
            "env" => (env_size, "every tree equal to the captured one"),
            _ => (ckpt_size, "every rank's bytes checked"),
        };
        // The other nodes: the throttled one's own start is bound by its own link.
        let others = |r: &Round| Round {
            busy: r.busy,
            times: r
                .times
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != f.node)
                .map(|(_, t)| *t)
                .collect(),
            store_bytes: r.store_bytes,
        };
        let change = |(without, with): &(Round, Round)| {
            others(with).p99().as_secs_f64() / others(without).p99().as_secs_f64() - 1.0
        };
        let pairs: Vec<String> = f
            .throttled
            .iter()
            .map(|pair| {
                format!(
                    "{} · {} s ({:+.0}%)",
                    secs(others(&pair.0).p99()),
                    secs(others(&pair.1).p99()),
                    change(pair) * 100.0
                )
            })
            .collect();
        let mut changes: Vec<f64> = f.throttled.iter().map(change).collect();
        changes.sort_by(f64::total_cmp);
        let list = |v: Vec<String>| v.join(", ");
        md.push_str(&format!(
            "- N = {}, {}, node {} ({}; in the sharing round it served {:.1} MB and read {:.1} MB from the store) with its link at a tenth, in {} pairs of rounds: the other nodes' p99 without · with the fault {}; median {:+.0}% (target ≤ +10%); node {} itself {} s; the store sent {}× the artifact.\n",
            big.n,
            f.artifact,
            f.node,
            if f.chosen {
                "--fault-node"
            } else {
                "the one that read the most from the store"
            },
            f.served.0 / 1e6,
            f.served.1 / 1e6,
            f.throttled.len(),
            list(pairs),
            changes[changes.len() / 2] * 100.0,
            f.node,
            list(f.throttled.iter().map(|p| secs(p.1.times[f.node])).collect()),
            list(
                f.throttled
                    .iter()
                    .map(|p| format!("{:.2}", p.1.store_bytes as f64 / size))
                    .collect()
            ),
        ));
        let (c, bad, sent) = &f.corrupt;
        md.push_str(&format!(
            "- N = {}, {}, node {}'s sidecar corrupting every piece it sends ({:.1} MB sent): {intact}, {bad} corrupt pieces counted by its {} peers in all, p99 {} s, the store sent {:.2}× the artifact.\n",
            big.n,
            f.artifact,
            f.node,
            sent / 1e6,
            big.n - 1,
            secs(c.p99()),
            c.store_bytes as f64 / size
        ));
    }
    println!("{md}");
    if let Some(path) = &args.markdown {
        std::fs::write(path, &md)?;
    }
    Ok(())
}
