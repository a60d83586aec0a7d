//! A real PyTorch job restarting after a fault, end to end: `examples/torchrun/train.py` (FSDP2,
//! AdamW, gloo) under `torchrun --max-restarts 1`, checkpointing every second step through a
//! sidecar that this process runs. One worker kills itself with SIGKILL after step 3, a step
//! after the save of step 2 (a fault during training, once the save's own work is done: the
//! sidecar's commit hashing no longer shares the cores with the restart); torchrun stops the
//! others and starts every worker again, and they load step 2 from the sidecar's memory. Every
//! worker prints when each phase ends (`--timeline`), so the restart is cut into phases:
//! torchrun noticing the fault and starting the workers again, `import torch`, joining the
//! process group, building the model, giving the fresh optimizer its state, loading the
//! checkpoint, and the first step.
//!
//! The floor, same run, same model and sizes: the same workers under torchrun doing what any
//! restarted worker must do at least (start, import torch, join the group, build the model)
//! and then copying as many bytes as their state holds from memory into memory already faulted
//! in (`--floor`), all ranks at once, right after each restart's job has ended (so both fault
//! in memory freed moments before). Rows (medians of `--runs`):
//!
//! * kill → every rank has its state loaded, against the floor (target ≤ 1.5×, a ratio ≥ 0.67);
//! * kill → every rank has finished its first step, against the floor plus one step of the
//!   same job not interrupted (no target: the step's length is the model's, not hotstart's);
//! * the state load itself (`ck.load` into the model's and optimizer's tensors, then
//!   `set_state_dict`) against the floor's memcpy of the same bytes (target ≥ 0.8), and against
//!   the same memcpy made as a restart must make it: AdamW's two moments (two thirds of the
//!   bytes) go into memory new to the process, a restarted optimizer's fresh state, which the
//!   copy faults in (no target: it says what the fresh memory costs on the machine).
//!
//! **A replacement node that starts cold** (`--cold`): the job saved step 1 on node A (its
//! sidecar: memory, disk, and a local-directory store) and, the same state, with
//! torch.distributed.checkpoint's own FileSystemWriter (the path a user has without hotstart).
//! Then a new node, holding nothing (no venv, no caches, the page cache dropped), makes the
//! job's environment (torch from `benches/env/torch.txt` and the hotstart package built from
//! this checkout, about 5 GB) and resumes to its first step, three ways: `hotstart env ensure`
//! restores the venv from the store and a new sidecar fetches the shards from A's memory (a
//! peer); the same with the venv mounted lazily (`env ensure --lazy`, replaying the profile of
//! one earlier lazy start); the same with a sidecar whose disk tier is a copy of A's (a node
//! that came back with its disk) or that reads the store; and what a user does without hotstart,
//! `uv pip install` of the same lock (cold uv cache, the wheels on local disk) and DCP's
//! FileSystemReader from the local disk. Each row is node start → every rank's first step done,
//! with its phases.
//!
//! `--remote` keeps the store in a SeaweedFS bucket behind the emulated remote link
//! (benches/netem.sh), and puts the wheels and the DCP files in the same bucket: the user
//! without hotstart installs from them and loads DCP through a fresh s3fs mount on each new node.
//! A peer's memory stays on loopback (the cluster's network is not emulated).
//!
//! The image phase, the same environment as a container image started through containerd and
//! `hotstart snapshotter`, is the `container` benchmark with the job's packages (`container
//! --packages torch,torchgen,typing_extensions,numpy,nvidia,cuda --imports torch`;
//! `container-torch` in `hotstart-benches all`).
//!
//! Needs the project's venv (`scripts/setup.sh`: torch and the built package), about
//! `3 × nproc × gib` GiB of memory for each sidecar beside the workers' own, and root for the
//! page-cache drops of `--cold`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};

use hotstart_fuse::FsConfig;
use hotstart_testkit::SeaweedFs;

use crate::fuse::mounts::{self, Mounted, Peer, Server, Target};
use crate::report::{Report, Row, median};
use crate::sidecar::{Running, settings};
use crate::store_striped::RemoteLink;
use crate::store_uring::drop_page_cache;

/// Options of `hotstart-benches restart`.
#[derive(Debug, clap::Args)]
pub struct RestartArgs {
    /// GiB of checkpointed state per rank (its shards of the parameters and of AdamW's two
    /// moments, fp32).
    #[arg(long, default_value_t = 2.0)]
    pub(crate) gib: f64,
    /// Worker processes (ranks) on this node.
    #[arg(long, default_value_t = 2)]
    nproc: u32,
    /// Width of the model's hidden layers (its depth follows from --gib).
    #[arg(long, default_value_t = 4096)]
    pub(crate) width: u64,
    #[arg(long, default_value_t = 3)]
    pub(crate) runs: usize,
    /// Also measure a replacement node that starts cold (state from a peer's memory, from the
    /// store, and DCP from the local disk).
    #[arg(long)]
    cold: bool,
    /// With --cold: keep the store (the venv's snapshot and the checkpoints) in SeaweedFS behind
    /// the emulated remote link (benches/netem.sh), and give uv + DCP the same bucket through
    /// s3fs, so the wheels and the DCP files cross the same link.
    #[arg(long, requires = "cold")]
    remote: bool,
    /// Instead: a job of 3 ranks on 3 simulated nodes (a sidecar each) that loses a node and
    /// comes back as 2 ranks, and one of 2 ranks that comes back as 3 on a new node, each
    /// resharding from the sidecars' memory, against the same load from the store behind the
    /// emulated remote link and torch DCP through s3fs (see `elastic`). --gib is then the
    /// state of each rank of 3 (the same state in both directions).
    #[arg(long, conflicts_with_all = ["cold", "nproc"])]
    elastic: bool,
    /// The Python with torch and hotstart (default: the project's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Also write the table here (Markdown, and JSON beside it).
    #[arg(long)]
    pub(crate) markdown: Option<PathBuf>,
}

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// What the workers printed with `--timeline`: per event and attempt, each rank's time.
#[derive(Debug, Default)]
pub(crate) struct Timeline {
    at: BTreeMap<(String, u32), Vec<f64>>,
    /// `floor-copy` seconds, per rank.
    copies: Vec<f64>,
    /// `floor-fresh-copy` seconds, per rank.
    fresh_copies: Vec<f64>,
    /// The step the restarted job resumed from, if it said so.
    pub(crate) resumed: Option<u64>,
}

impl Timeline {
    pub(crate) fn parse(out: &str) -> Timeline {
        let mut t = Timeline::default();
        for line in out.lines() {
            let w: Vec<&str> = line.split_whitespace().collect();
            match w.as_slice() {
                ["at", event, time, "rank", _, "attempt", attempt] => {
                    if let (Ok(time), Ok(attempt)) = (time.parse(), attempt.parse()) {
                        t.at.entry((event.to_string(), attempt))
                            .or_default()
                            .push(time);
                    }
                }
                ["floor-copy", secs, ..] => t.copies.extend(secs.parse::<f64>().ok()),
                ["floor-fresh-copy", secs, ..] => t.fresh_copies.extend(secs.parse::<f64>().ok()),
                ["resumed", step, ..] => t.resumed = step.parse().ok(),
                _ => {}
            }
        }
        t
    }

    /// When the last rank got to `event` in `attempt`.
    pub(crate) fn last(&self, event: &str, attempt: u32) -> anyhow::Result<f64> {
        self.at
            .get(&(event.to_string(), attempt))
            .and_then(|v| v.iter().copied().reduce(f64::max))
            .with_context(|| format!("no rank printed 'at {event}' in attempt {attempt}"))
    }

    /// When the first rank got to `event` in `attempt`.
    fn first(&self, event: &str, attempt: u32) -> anyhow::Result<f64> {
        self.at
            .get(&(event.to_string(), attempt))
            .and_then(|v| v.iter().copied().reduce(f64::min))
            .with_context(|| format!("no rank printed 'at {event}' in attempt {attempt}"))
    }
}

/// The phases of one restart (seconds), and of the floor.
#[derive(Debug, Clone, Copy)]
struct Phases {
    /// Kill → the first restarted worker runs its first line.
    respawn: f64,
    import: f64,
    group: f64,
    build: f64,
    /// The fresh optimizer's state (get_state_dict).
    ready: f64,
    /// The checkpoint read into the state dict (`ck.load`).
    read: f64,
    /// `set_state_dict`.
    set: f64,
    step: f64,
    /// An uninterrupted first step of the same job (attempt 0).
    plain_step: f64,
}

impl Phases {
    fn of(t: &Timeline) -> anyhow::Result<Phases> {
        let kill = t.first("kill", 0)?;
        let at = |e: &str| t.last(e, 1);
        Ok(Phases {
            respawn: t.first("start", 1)? - kill,
            import: at("imported")? - t.first("start", 1)?,
            group: at("group")? - at("imported")?,
            build: at("built")? - at("group")?,
            ready: at("ready")? - at("built")?,
            read: at("read")? - at("ready")?,
            set: at("loaded")? - at("read")?,
            step: at("step")? - at("loaded")?,
            plain_step: t.last("step", 0)? - t.last("built", 0)?,
        })
    }

    fn until_loaded(&self) -> f64 {
        self.respawn + self.import + self.group + self.build + self.ready + self.load()
    }

    /// The state load: read, then set into the model and optimizer.
    fn load(&self) -> f64 {
        self.read + self.set
    }
}

/// The floor's phases: start → built, and the copy.
#[derive(Debug, Clone, Copy)]
struct Floor {
    import: f64,
    group: f64,
    build: f64,
    copy: f64,
    /// The same copy with the optimizer's share into memory new to the process.
    fresh_copy: f64,
}

impl Floor {
    fn of(t: &Timeline) -> anyhow::Result<Floor> {
        let at = |e: &str| t.last(e, 0);
        ensure!(
            !t.copies.is_empty() && !t.fresh_copies.is_empty(),
            "the floor printed no copy times"
        );
        let slowest = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        Ok(Floor {
            import: at("imported")? - t.first("start", 0)?,
            group: at("group")? - at("imported")?,
            build: at("built")? - at("group")?,
            copy: slowest(&t.copies),
            fresh_copy: slowest(&t.fresh_copies),
        })
    }

    fn total(&self) -> f64 {
        self.import + self.group + self.build + self.copy
    }
}

/// Runs train.py under torchrun with `args`; its stdout, then its stderr.
pub(crate) fn torchrun(
    python: &Path,
    nproc: u32,
    restarts: u32,
    args: &[String],
) -> anyhow::Result<String> {
    let train = workspace().join("examples/torchrun/train.py");
    let out = Command::new(python)
        .args(["-m", "torch.distributed.run"])
        .arg(format!("--nproc-per-node={nproc}"))
        .arg(format!("--max-restarts={restarts}"))
        .args(["--monitor-interval=0.1", "--master-addr=127.0.0.1"])
        .arg(format!("--master-port={}", hotstart_testkit::free_port()?))
        .arg(&train)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("HOTSTART_SOCKET")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {} -m torch.distributed.run", python.display()))?;
    let output = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "torchrun {}: {}\n{output}",
        args.join(" "),
        out.status
    );
    Ok(output)
}

pub fn run(args: &RestartArgs) -> anyhow::Result<()> {
    ensure!(
        args.gib > 0.0 && args.nproc > 0 && args.runs > 0 && args.width > 0,
        "--gib, --nproc, --width and --runs must be positive"
    );
    // First, before this process starts any thread: it sets the server's variables in the
    // environment, where the sidecars' store reads them.
    let remote = (args.remote || args.elastic).then(Remote::up).transpose()?;
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| workspace().join(".venv/bin/python"));
    ensure!(
        python.exists(),
        "{} is missing: run scripts/setup.sh (it installs torch and the package), or pass --python",
        python.display()
    );
    if let Some(remote) = remote.as_ref().filter(|_| args.elastic) {
        return crate::elastic::run(args, &python, remote);
    }
    // fp32 parameters plus AdamW's two moments, sharded over the ranks.
    let params = args.gib * (1u64 << 30) as f64 * args.nproc as f64 / 12.0;
    let depth = ((params / (args.width * args.width) as f64).round() as u64).max(1);
    let model = vec![
        "--width".to_string(),
        args.width.to_string(),
        "--depth".into(),
        depth.to_string(),
        "--timeline".into(),
        "--no-digest".into(),
    ];
    let state_bytes = 12 * depth * args.width * args.width / args.nproc as u64;
    let size = format!(
        "{} ranks × {:.2} GiB",
        args.nproc,
        state_bytes as f64 / (1u64 << 30) as f64
    );
    let label = format!(
        "{size} (FSDP2, AdamW, {depth} layers of {w}×{w})",
        w = args.width
    );
    eprintln!("restart: {label}, {} runs", args.runs);
    let base = tempfile::Builder::new()
        .prefix("hotstart-restart-bench-")
        .tempdir_in("/var/tmp")?;
    let mut restarts = Vec::new();
    let mut floors = Vec::new();
    for run in 0..args.runs {
        let dir = base.path().join(format!("run-{run}"));
        std::fs::create_dir_all(&dir)?;
        let budget = (3.0 * args.nproc as f64 * state_bytes as f64) as u64 + (256 << 20);
        let sidecar = Running::start(settings("restart", &dir, budget)?)?;
        let mut job = model.clone();
        job.extend([
            "--job".into(),
            format!("restart-{run}"),
            "--steps".into(),
            "4".into(),
            "--save-every".into(),
            "2".into(),
            "--kill-rank".into(),
            (args.nproc - 1).to_string(),
            "--kill-step".into(),
            "3".into(),
            "--sidecar".into(),
            sidecar.socket.display().to_string(),
        ]);
        let output = torchrun(&python, args.nproc, 1, &job)?;
        let timeline = Timeline::parse(&output);
        drop(sidecar);
        ensure!(
            timeline.resumed == Some(2),
            "the restarted job did not resume from step 2 (it said {:?}):\n{output}",
            timeline.resumed
        );
        let phases = Phases::of(&timeline)?;
        eprintln!(
            "  run {run}: kill → loaded {:.2} s {phases:?}",
            phases.until_loaded()
        );
        restarts.push(phases);

        // The floor right after the job: both fault in memory freed moments before. On a VM
        // that hands memory freed long ago back to its host, faulting that in again is several
        // times slower, and it would fall on whichever ran first.
        let mut floor_args = model.clone();
        floor_args.extend(["--floor", "--job", "floor", "--steps", "1"].map(String::from));
        let floor = Floor::of(&Timeline::parse(&torchrun(
            &python,
            args.nproc,
            0,
            &floor_args,
        )?))?;
        eprintln!("  run {run}: floor {:.2} s {floor:?}", floor.total());
        floors.push(floor);
    }
    let secs = Duration::from_secs_f64;
    let med = |f: &dyn Fn(&Phases) -> f64| median(restarts.iter().map(|p| secs(f(p))).collect());
    let fmed = |f: &dyn Fn(&Floor) -> f64| median(floors.iter().map(|p| secs(f(p))).collect());
    let mut report = Report::new(&format!("restart: a PyTorch job under torchrun, {label}"));
    report.add(Row::time(
        format!("process restart (kill -9 of a worker) → every rank's state loaded from the sidecar's memory, {size}"),
        med(&|p| p.until_loaded()),
        "floor: process start + import torch + group + model build + memcpy of the state",
        fmed(&|f| f.total()),
        Some(1.0 / 1.5),
    ));
    report.add(Row::time(
        format!("process restart → first resumed step done, {size}"),
        med(&|p| p.until_loaded() + p.step),
        "the floor + one step of the same job, not interrupted",
        fmed(&|f| f.total()) + med(&|p| p.plain_step),
        None,
    ));
    report.add(Row::rate(
        format!("state load (ck.load into the model's and optimizer's tensors, then set_state_dict), {size}"),
        state_bytes,
        med(&|p| p.load()),
        "memcpy of the same bytes into faulted memory, each rank at once",
        fmed(&|f| f.copy),
        Some(0.8),
    ));
    report.add(Row::rate(
        format!("state load (ck.load into the model's and optimizer's tensors, then set_state_dict), {size}"),
        state_bytes,
        med(&|p| p.load()),
        "the same memcpy with AdamW's two thirds into memory new to the process, as after a restart",
        fmed(&|f| f.fresh_copy),
        None,
    ));
    if args.cold {
        let model = Model {
            args: model,
            state_bytes,
            size,
        };
        let theirs = cold(
            args,
            &python,
            &model,
            base.path(),
            remote.as_ref(),
            &mut report,
        )?;
        // What no new node can beat on this machine: its workers must still start, import
        // torch, build the model and take a step.
        let bound = fmed(&|f| f.total()) + med(&|p| p.plain_step);
        report.note(format!(
            "A new node whose venv and state took no time at all would still take the floor plus \
             one step measured above ({:.2} s): at most {:.2}× uv + DCP's {:.2} s on this machine.",
            bound.as_secs_f64(),
            theirs.as_secs_f64() / bound.as_secs_f64(),
            theirs.as_secs_f64()
        ));
    }
    // The same target without a second process's noise: each restart against its own
    // workers' start, import, group and build plus the memcpy of its run's floor.
    let mut own: Vec<f64> = restarts
        .iter()
        .zip(&floors)
        .map(|(p, f)| p.until_loaded() / (p.import + p.group + p.build + f.copy))
        .collect();
    own.sort_by(f64::total_cmp);
    report.note(format!(
        "Against the restarted workers' own start, import torch, group and model build plus the \
         memcpy (the floor without a process of its own, whose phases move ±40% from run to run \
         on this VM), kill → state loaded took {:.2}× the time (median of the runs; target ≤ 1.5×).",
        own.get(own.len() / 2).copied().unwrap_or_default()
    ));
    let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    report.note(format!(
        "Phases, medians in ms (restart | floor): torchrun notices the kill and starts the workers {} | –; \
         import torch {} | {}; process group {} | {}; model build {} | {}; fresh optimizer state \
         (get_state_dict) {} | –; checkpoint load {} (read {}, set_state_dict {}) | memcpy {} (into \
         new memory: {}); first step {} (uninterrupted: {}).",
        ms(med(&|p| p.respawn)),
        ms(med(&|p| p.import)),
        ms(fmed(&|f| f.import)),
        ms(med(&|p| p.group)),
        ms(fmed(&|f| f.group)),
        ms(med(&|p| p.build)),
        ms(fmed(&|f| f.build)),
        ms(med(&|p| p.ready)),
        ms(med(&|p| p.load())),
        ms(med(&|p| p.read)),
        ms(med(&|p| p.set)),
        ms(fmed(&|f| f.copy)),
        ms(fmed(&|f| f.fresh_copy)),
        ms(med(&|p| p.step)),
        ms(med(&|p| p.plain_step)),
    ));
    report.note(format!(
        "Each phase ends when the last rank is through it. torchrun --monitor-interval 0.1; gloo on \
         CPU, OMP_NUM_THREADS=1; the sidecar holds memory only (budget {:.1} GiB), in this process.",
        (3.0 * args.nproc as f64 * state_bytes as f64) / (1u64 << 30) as f64
    ));
    report.finish(args.markdown.as_deref())
}

/// One replacement node, from the moment it starts to its first step: the environment phase
/// (install or restore into the venv), torchrun starting the workers, the workers' start to
/// their first step, and the state load alone.
#[derive(Debug, Clone, Copy)]
struct Cold {
    env: f64,
    launch: f64,
    to_step: f64,
    load: f64,
    /// What a lazily mounted venv did.
    lazy: Option<LazyRun>,
}

impl Cold {
    /// `began` and `env_done`: unix times at which the node began and its environment was ready.
    fn of(t: &Timeline, began: f64, env_done: f64) -> anyhow::Result<Cold> {
        ensure!(
            t.resumed == Some(1),
            "the cold start did not resume from step 1"
        );
        let start = t.first("start", 0)?;
        Ok(Cold {
            env: env_done - began,
            launch: start - env_done,
            to_step: t.last("step", 0)? - start,
            load: t.last("loaded", 0)? - t.last("ready", 0)?,
            lazy: None,
        })
    }

    /// From the node's start to every rank's first step done.
    fn total(&self) -> f64 {
        self.env + self.launch + self.to_step
    }
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `--remote`: one bucket of a SeaweedFS server behind the emulated remote link. It holds
/// hotstart's store and, for uv + DCP, the wheels and the DCP checkpoint (read through s3fs).
pub(crate) struct Remote {
    pub(crate) weed: SeaweedFs,
    pub(crate) bucket: String,
    /// Declared last: the link goes down once the server has stopped.
    _link: RemoteLink,
}

impl Remote {
    /// Brings the link and the server up and sets the server's variables (`AWS_ENDPOINT_URL`,
    /// keys) in this process's environment, where stores opened from a URL read them. Call it
    /// before any other thread of this process starts.
    fn up() -> anyhow::Result<Remote> {
        let (link, weed) = RemoteLink::up()?;
        for (k, v) in weed.env() {
            // SAFETY: called first in `run`, before this process starts a thread that could
            // read the environment at the same time.
            unsafe { std::env::set_var(k, v) };
        }
        let url = weed.fresh_bucket("restart");
        let bucket = url.trim_start_matches("s3://").to_string();
        Ok(Remote {
            weed,
            bucket,
            _link: link,
        })
    }

    /// The URL of `prefix` in the bucket.
    pub(crate) fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// Copies every file under `dir` to `prefix/` in the bucket, keeping their relative paths.
    pub(crate) fn upload(
        &self,
        rt: &tokio::runtime::Runtime,
        dir: &Path,
        prefix: &str,
    ) -> anyhow::Result<()> {
        let store = hotstart_store::Store::open(&self.url(""))?;
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for entry in std::fs::read_dir(&d).with_context(|| format!("read {}", d.display()))? {
                let path = entry?.path();
                if path.is_dir() {
                    todo.push(path);
                    continue;
                }
                let key = format!("{prefix}/{}", path.strip_prefix(dir)?.display());
                let cfg = hotstart_store::StripeConfig::default();
                rt.block_on(hotstart_store::transfer::upload_file(
                    &path,
                    &store,
                    &key,
                    cfg,
                    &|_| {},
                ))
                .with_context(|| format!("upload {} to {key}", path.display()))?;
            }
        }
        Ok(())
    }

    /// A fresh s3fs mount of the bucket (default options: no cache of its own), for uv + DCP.
    fn s3fs(&self, env: &JobEnv, scratch: &Path) -> anyhow::Result<Mounted> {
        let server = Server {
            weed: &self.weed,
            bucket: &self.bucket,
            store: &env.store,
            rt: env.runtime.handle(),
            scratch,
        };
        mounts::mount(Target::Peer(Peer::S3fs), &server, FsConfig::default(), 0)
    }
}

/// The job's environment on a new node: torch (from `benches/env/torch.txt`, a wheelhouse
/// downloaded once by `scripts/wheelhouse.sh`) and the hotstart package built from this
/// checkout, installed with uv or restored by `hotstart env ensure`.
struct JobEnv {
    lock: PathBuf,
    target: PathBuf,
    uv_cache: PathBuf,
    uv: PathBuf,
    python: PathBuf,
    /// Where uv finds the wheels on this machine: the wheelhouse and the package's wheel.
    wheels: Vec<PathBuf>,
    runtime: tokio::runtime::Runtime,
    store: hotstart_store::Store,
    base: hotstart_env::EnsureConfig,
}

impl JobEnv {
    /// Downloads the wheelhouse, builds the package's wheel, and captures the venv that uv makes
    /// into the store at `store` (a URL or a directory; an `ensure` miss, not timed).
    fn prepare(python: &Path, dir: &Path, store: &str) -> anyhow::Result<JobEnv> {
        let root = workspace();
        let status = Command::new("bash")
            .arg(root.join("scripts/wheelhouse.sh"))
            .args(["torch", "benches/env/torch.txt"])
            .current_dir(root)
            .env("HOTSTART_WHEELHOUSE_PYTHON", python)
            .status()?;
        ensure!(status.success(), "scripts/wheelhouse.sh torch failed");
        let wheels = dir.join("wheels");
        let maturin = root.join(".venv/bin/maturin");
        let uv = root.join(".venv/bin/uv");
        ensure!(
            maturin.exists() && uv.exists(),
            "{} or {} is missing: run scripts/setup.sh",
            maturin.display(),
            uv.display()
        );
        let status = Command::new(&maturin)
            .args(["build", "--release", "--quiet", "--out"])
            .arg(&wheels)
            .current_dir(root.join("bindings"))
            .status()?;
        ensure!(
            status.success(),
            "maturin build of the hotstart package failed"
        );
        let lock = dir.join("requirements.txt");
        std::fs::write(
            &lock,
            format!(
                "{}hotstart\n",
                std::fs::read_to_string(root.join("benches/env/torch.txt"))?
            ),
        )?;
        let target = dir.join("venv");
        let uv_cache = dir.join("uv-cache");
        let wheels = vec![root.join(".cache/wheelhouse/torch"), wheels];
        let install = install_command(&uv, python, &wheels, &target, &lock, &uv_cache);
        let mut base = hotstart_env::EnsureConfig::new(vec![lock.clone()], target.clone(), install);
        base.python = python.display().to_string();
        base.cache_dir = dir.join("env-capture");
        let env = JobEnv {
            lock,
            target,
            uv_cache,
            uv,
            python: python.to_path_buf(),
            wheels,
            runtime: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?,
            store: hotstart_store::Store::open(store)?,
            base,
        };
        let hotstart_env::Action::Installed {
            install_seconds,
            capture,
        } = env.ensure(&env.base.cache_dir)?
        else {
            bail!("the first ensure of the job's venv should install it");
        };
        let captured = capture
            .as_ref()
            .as_ref()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        eprintln!(
            "  the job's venv: installed by uv in {install_seconds:.2} s, captured in {:.2} s \
             ({} files, {:.2} GB)",
            captured.seconds,
            captured.record.files,
            captured.record.bytes as f64 / 1e9
        );
        std::fs::remove_dir_all(&env.base.cache_dir)?;
        Ok(env)
    }

    /// The `ensure` of this venv on a node whose chunk cache is `cache`.
    fn cfg(&self, cache: &Path) -> hotstart_env::EnsureConfig {
        let mut cfg = self.base.clone();
        cfg.cache_dir = cache.to_path_buf();
        cfg
    }

    fn ensure(&self, cache: &Path) -> anyhow::Result<hotstart_env::Action> {
        let cfg = self.cfg(cache);
        let ensure = hotstart_env::ensure(&self.store, &cfg);
        Ok(self.runtime.block_on(ensure)?.action)
    }

    /// A node that holds nothing: no venv, no caches, the page cache dropped.
    fn clear(&self, node: &Path) -> anyhow::Result<()> {
        for dir in [&self.target, &self.uv_cache, &node.to_path_buf()] {
            match std::fs::remove_dir_all(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("remove {}", dir.display()));
                }
                _ => {}
            }
        }
        drop_page_cache().context("drop the page cache (needs root)")
    }

    /// uv installs the lock into the venv, cold cache, the wheels found in `links`.
    fn install(&self, links: &[PathBuf]) -> anyhow::Result<()> {
        let install = install_command(
            &self.uv,
            &self.python,
            links,
            &self.target,
            &self.lock,
            &self.uv_cache,
        );
        let out = Command::new(&install[0]).args(&install[1..]).output()?;
        ensure!(
            out.status.success(),
            "uv install of {}: {}",
            self.lock.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// `hotstart env ensure` restores the venv, with an empty chunk cache at `cache`.
    fn restore(&self, cache: &Path) -> anyhow::Result<()> {
        let action = self.ensure(cache)?;
        ensure!(
            matches!(action, hotstart_env::Action::Restored(_)),
            "expected a restore, got {action:?}"
        );
        Ok(())
    }

    /// `hotstart env ensure --lazy` mounts the venv, with an empty chunk cache at `cache`; the
    /// mount serves until `unmount`, which also merges this start's reads into the profile.
    fn mount(&self, cache: &Path) -> anyhow::Result<hotstart_env::MountedEnv> {
        let cfg = self.cfg(cache);
        let lazy = hotstart_env::ensure_lazy(&self.store, &cfg, hotstart_env::lazy_config());
        let hotstart_env::LazyOutcome::Mounted(mounted) = self.runtime.block_on(lazy)? else {
            bail!("expected a lazy mount of the job's venv");
        };
        Ok(mounted)
    }

    /// Unmounts a lazy venv; what it fetched and how long reads waited.
    fn unmount(&self, mounted: hotstart_env::MountedEnv) -> anyhow::Result<LazyRun> {
        let done = self.runtime.block_on(mounted.unmount())?;
        let r = &done.report;
        Ok(LazyRun {
            fetched: (r.prefetched_bytes + r.demand_fetch_bytes) as f64 / done.bytes.max(1) as f64,
            stall: r.stall_seconds,
        })
    }

    fn python(&self) -> PathBuf {
        self.target.join("bin/python")
    }
}

/// uv's command that installs `lock` into the venv `target` with the cache `cache` (no bytecode,
/// as uv does by default), the wheels found in `links`.
fn install_command(
    uv: &Path,
    python: &Path,
    links: &[PathBuf],
    target: &Path,
    lock: &Path,
    cache: &Path,
) -> Vec<String> {
    let uv = crate::env::Uv {
        uv,
        python,
        find_links: links,
    };
    uv.install(target, lock, cache, false)
}

/// What a lazily mounted venv did in one new node's start.
#[derive(Debug, Clone, Copy)]
struct LazyRun {
    /// The fraction of its bytes that were fetched.
    fetched: f64,
    /// Seconds its readers waited for chunks (the mount report's stall).
    stall: f64,
}

/// `12–14`: the range of `f` over the lazy starts among `starts`, each value as `show` writes it.
fn lazy_range(starts: &[Cold], f: fn(&LazyRun) -> f64, show: fn(f64) -> String) -> String {
    let values = starts.iter().filter_map(|c| c.lazy.as_ref().map(f));
    let lo = show(values.clone().fold(f64::INFINITY, f64::min));
    let hi = show(values.fold(0.0, f64::max));
    if lo == hi { lo } else { format!("{lo}–{hi}") }
}

/// Where a new node's sidecar finds the state.
#[derive(Clone, Copy)]
enum Source {
    Peer,
    Disk,
    Store,
}

/// How a new node makes the job's environment.
#[derive(Clone, Copy)]
enum MakeEnv {
    Uv,
    Restore,
    Lazy,
}

/// The job's model as train.py builds it, and its checkpointed state.
struct Model {
    /// train.py's arguments that build it (and print the timeline).
    args: Vec<String>,
    /// Checkpointed bytes per rank.
    state_bytes: u64,
    /// `2 ranks × 1.97 GiB`, for the rows.
    size: String,
}

/// The replacement-node rows (see the module docs); the median of uv + DCP from start to step.
fn cold(
    args: &RestartArgs,
    python: &Path,
    model: &Model,
    base: &Path,
    remote: Option<&Remote>,
    report: &mut Report,
) -> anyhow::Result<Duration> {
    let Model {
        args: model,
        state_bytes,
        size,
    } = model;
    let state_bytes = *state_bytes;
    let dir = base.join("cold");
    std::fs::create_dir_all(&dir)?;
    let budget = (3.0 * args.nproc as f64 * state_bytes as f64) as u64 + (256 << 20);
    let store = match remote {
        Some(r) => r.url("store"),
        None => dir.join("store").display().to_string(),
    };
    let env = JobEnv::prepare(python, &dir, &store)?;
    let mut a_settings = settings("node-a", &dir, budget)?;
    a_settings.store = Some(store.clone());
    a_settings.disk_dir = Some(dir.join("a-disk"));
    let a = Running::start(a_settings)?;
    let job = |extra: &[&str]| -> Vec<String> {
        let mut v = model.to_vec();
        v.extend(["--job", "cold"].map(String::from));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    // Step 1, saved through A (waited for in every tier), and with torch's own DCP writer.
    let a_socket = a.socket.display().to_string();
    torchrun(
        python,
        args.nproc,
        0,
        &job(&["--steps", "1", "--save-every", "1", "--sidecar", &a_socket]),
    )?;
    let dcp_dir = dir.join("dcp");
    torchrun(
        python,
        args.nproc,
        0,
        &job(&[
            "--steps",
            "1",
            "--save-every",
            "1",
            "--torch-dcp",
            &dcp_dir.display().to_string(),
        ]),
    )?;
    // Behind the link, uv + DCP read the same bucket: the wheels and the DCP files go there.
    let scratch = dir.join("s3fs");
    if let Some(r) = remote {
        std::fs::create_dir_all(&scratch)?;
        r.upload(&env.runtime, &dcp_dir, "dcp")?;
        r.upload(&env.runtime, &env.wheels[0], "wheels/torch")?;
        r.upload(&env.runtime, &env.wheels[1], "wheels/hotstart")?;
    }

    // A new node: nothing local, page cache dropped; its environment made as `make` says, then
    // the job resumed from the venv.
    let node = dir.join("node");
    // uv + DCP (`how` empty) read the wheels and the DCP files from this disk, or from the
    // bucket through a fresh s3fs mount, made as part of the node's environment.
    let resume = |make: MakeEnv, how: &[&str]| -> anyhow::Result<Cold> {
        env.clear(&node)?;
        let began = unix_now();
        let mut how: Vec<String> = how.iter().map(|s| s.to_string()).collect();
        let mut s3fs = None;
        let mounted = match make {
            MakeEnv::Uv => {
                let (wheels, dcp) = match remote {
                    None => (env.wheels.clone(), dcp_dir.clone()),
                    Some(r) => {
                        let files = s3fs.insert(r.s3fs(&env, &scratch)?).path();
                        let wheels = ["wheels/torch", "wheels/hotstart"].map(|w| files.join(w));
                        (wheels.to_vec(), files.join("dcp"))
                    }
                };
                env.install(&wheels)?;
                how.extend(["--torch-dcp".into(), dcp.display().to_string()]);
                None
            }
            MakeEnv::Restore => env.restore(&node).map(|()| None)?,
            MakeEnv::Lazy => Some(env.mount(&node)?),
        };
        let env_done = unix_now();
        let mut extra = vec!["--steps", "2", "--save-every", "0"];
        extra.extend(how.iter().map(String::as_str));
        let out = torchrun(&env.python(), args.nproc, 0, &job(&extra));
        drop(s3fs);
        let lazy = mounted.map(|m| env.unmount(m)).transpose()?;
        Ok(Cold {
            lazy,
            ..Cold::of(&Timeline::parse(&out?), began, env_done)?
        })
    };
    // A node that comes back with its disk keeps its disk tier: a copy of A's, made once.
    let kept_disk = dir.join("kept-disk");
    let status = Command::new("cp")
        .arg("-a")
        .arg(dir.join("a-disk"))
        .arg(&kept_disk)
        .status()?;
    ensure!(status.success(), "copy A's disk tier");
    // The new node's sidecar: nothing in memory, and only the one source of the state.
    let sidecar = |source: Source, name: &str| -> anyhow::Result<Running> {
        let node_dir = dir.join(name);
        std::fs::create_dir_all(&node_dir)?;
        let mut s = settings("node-new", &node_dir, budget)?;
        match source {
            Source::Peer => s.peers = Some(vec![format!("node-a={}", a.peer)]),
            Source::Disk => s.disk_dir = Some(kept_disk.clone()),
            Source::Store => s.store = Some(store.clone()),
        }
        Running::start(s)
    };
    let from = |make: MakeEnv, source: Source, name: &str| -> anyhow::Result<Cold> {
        let new_node = sidecar(source, name)?;
        resume(make, &["--sidecar", &new_node.socket.display().to_string()])
    };
    let variants = [
        (
            MakeEnv::Restore,
            Source::Peer,
            "restored (env ensure)",
            "a peer's memory",
        ),
        (
            MakeEnv::Lazy,
            Source::Peer,
            "mounted lazily (env ensure --lazy)",
            "a peer's memory",
        ),
        (
            MakeEnv::Restore,
            Source::Disk,
            "restored (env ensure)",
            "the node's own disk tier, kept",
        ),
        (
            MakeEnv::Restore,
            Source::Store,
            "restored (env ensure)",
            if remote.is_some() {
                "the store (SeaweedFS behind the emulated link)"
            } else {
                "the store (a local directory)"
            },
        ),
    ];
    // The lazy venv's profile: one lazy start before any is timed.
    from(MakeEnv::Lazy, Source::Peer, "record")?;
    let mut ours: Vec<Vec<Cold>> = vec![Vec::new(); variants.len()];
    let mut theirs = Vec::new();
    for run in 0..args.runs {
        theirs.push(resume(MakeEnv::Uv, &[])?);
        for (i, (make, source, ..)) in variants.iter().enumerate() {
            ours[i].push(from(*make, *source, &format!("new-{run}-{i}"))?);
        }
        eprintln!(
            "  cold run {run}: uv + DCP {:?}; {:?}",
            theirs[run],
            ours.iter().map(|v| v[run]).collect::<Vec<_>>(),
        );
    }
    drop(a);
    env.clear(&node)?;
    let secs = Duration::from_secs_f64;
    let med = |v: &[Cold], f: fn(&Cold) -> f64| median(v.iter().map(|c| secs(f(c))).collect());
    let (dcp_peer, theirs_total) = if remote.is_some() {
        (
            "DCP FileSystemReader from the bucket through s3fs, cold page cache",
            "uv pip install (cold cache, the wheels in the bucket through s3fs) + DCP \
             FileSystemReader from the bucket through s3fs",
        )
    } else {
        (
            "DCP FileSystemReader from the local disk, cold page cache",
            "uv pip install (cold cache, local wheelhouse) + DCP FileSystemReader from the local \
             disk",
        )
    };
    for ((make, _, venv, name), ours) in variants.iter().zip(&ours) {
        report.add(Row::time(
            format!("new node: start → first step done, venv {venv}, state from {name}, {size}"),
            med(ours, Cold::total),
            theirs_total,
            med(&theirs, Cold::total),
            Some(5.0),
        ));
        if matches!(make, MakeEnv::Restore) {
            report.add(Row::rate(
                format!("new node: the state load from {name}, {size}"),
                state_bytes,
                med(ours, |c| c.load),
                dcp_peer,
                med(&theirs, |c| c.load),
                None,
            ));
        }
    }
    let ms = |v: &[Cold], f: fn(&Cold) -> f64| format!("{:.0}", med(v, f).as_secs_f64() * 1e3);
    let phases = |v: &[Cold]| {
        format!(
            "environment {} + torchrun starting the workers {} + workers' start → first step {} \
             (of which the state load {})",
            ms(v, |c| c.env),
            ms(v, |c| c.launch),
            ms(v, |c| c.to_step),
            ms(v, |c| c.load)
        )
    };
    let ours_phases = variants
        .iter()
        .zip(&ours)
        .map(|((_, _, venv, name), v)| format!("venv {venv}, state from {name}: {}", phases(v)))
        .collect::<Vec<_>>()
        .join("; ");
    report.note(format!(
        "New-node phases, medians in ms: {ours_phases}; uv + DCP: {}. The lazy venv fetched {}% \
         of its bytes, replaying the profile of one earlier lazy start; its readers waited {} s \
         for chunks (the mount's stall).",
        phases(&theirs),
        lazy_range(
            &ours.concat(),
            |l| l.fetched,
            |v| format!("{:.0}", v * 100.0)
        ),
        lazy_range(&ours.concat(), |l| l.stall, |v| format!("{v:.2}")),
    ));
    let where_ = if remote.is_some() {
        "One SeaweedFS bucket behind the emulated remote link (benches/netem.sh: 10 ms RTT, \
         100 MB/s per TCP connection; the server shares this machine's two cores) holds the \
         store (the venv's snapshot, A's checkpoints) and, for uv + DCP, the wheels and the DCP \
         files, read through a fresh s3fs mount (default options) on each new node. A peer's \
         memory is reached over loopback: the cluster's own network is not emulated."
    } else {
        "No emulated link: store, wheelhouse and DCP files are all on this machine's disk."
    };
    report.note(format!(
        "New-node rows: step 1 was saved on node A (sidecar with memory, disk and the store) and \
         with torch's own DCP FileSystemWriter. Each new node starts with no venv, no chunk or \
         uv cache and the page cache dropped, makes the job's venv (torch and the hotstart \
         package, 5 GB; the snapshot in the store) and resumes step 1 from that venv: through a \
         new sidecar whose only peer is A, through one whose disk tier is a copy of A's (a node \
         that came back with its disk), through one that reads A's store, or with uv's install \
         and DCP's FileSystemReader. {where_}"
    ));
    Ok(med(&theirs, Cold::total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_is_cut_into_phases() {
        let out = "\
at start 100.0 rank 0 attempt 0
at built 101.0 rank 0 attempt 0
at built 101.5 rank 1 attempt 0
at step 104.5 rank 1 attempt 0
at step 104.0 rank 0 attempt 0
at kill 105.0 rank 1 attempt 0
at start 106.0 rank 0 attempt 1
at start 106.5 rank 1 attempt 1
at imported 108.0 rank 0 attempt 1
at imported 108.2 rank 1 attempt 1
at group 108.3 rank 1 attempt 1
at built 110.3 rank 0 attempt 1
at ready 111.3 rank 1 attempt 1
at read 111.6 rank 1 attempt 1
at loaded 111.8 rank 0 attempt 1
at step 114.8 rank 0 attempt 1
resumed 1 in 5.0 s (world 2)
noise
";
        let t = Timeline::parse(out);
        assert_eq!(t.resumed, Some(1));
        let p = Phases::of(&t).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(p.respawn, 1.0) && close(p.import, 2.2) && close(p.group, 0.1));
        assert!(close(p.build, 2.0) && close(p.ready, 1.0) && close(p.load(), 0.5));
        assert!(close(p.read, 0.3) && close(p.set, 0.2));
        assert!(close(p.step, 3.0) && close(p.plain_step, 3.0));
        assert!(close(p.until_loaded(), 6.8));
        assert!(Floor::of(&t).is_err(), "no floor-copy line");
    }

    #[test]
    fn a_floor_takes_each_copy_from_its_slowest_rank() {
        let out = "\
at start 100.0 rank 0 attempt 0
at imported 102.0 rank 0 attempt 0
at imported 102.5 rank 1 attempt 0
at group 102.6 rank 1 attempt 0
at built 104.6 rank 0 attempt 0
floor-copy 0.250000 bytes 6 rank 0
floor-copy 0.300000 bytes 6 rank 1
floor-fresh-copy 0.900000 bytes 6 rank 1
floor-fresh-copy 0.700000 bytes 6 rank 0
";
        let f = Floor::of(&Timeline::parse(out)).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(f.import, 2.5) && close(f.group, 0.1) && close(f.build, 2.0));
        assert!(close(f.copy, 0.3) && close(f.fresh_copy, 0.9));
        assert!(close(f.total(), 4.9));
        let without_fresh: String = out
            .lines()
            .filter(|l| !l.starts_with("floor-fresh-copy"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(Floor::of(&Timeline::parse(&without_fresh)).is_err());
    }

    #[test]
    fn a_cold_start_counts_from_the_node_start() {
        let out = "\
at start 110.5 rank 1 attempt 0
at start 110.0 rank 0 attempt 0
at ready 113.0 rank 0 attempt 0
at ready 113.5 rank 1 attempt 0
at loaded 115.0 rank 0 attempt 0
at loaded 116.0 rank 1 attempt 0
at step 118.0 rank 0 attempt 0
at step 119.0 rank 1 attempt 0
resumed 1 in 6.0 s (world 2)
";
        let c = Cold::of(&Timeline::parse(out), 100.0, 107.0).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(c.env, 7.0) && close(c.launch, 3.0) && close(c.to_step, 9.0));
        assert!(close(c.load, 2.5) && close(c.total(), 19.0));
        let other_step = out.replace("resumed 1", "resumed 0");
        assert!(Cold::of(&Timeline::parse(&other_step), 100.0, 107.0).is_err());
    }
}
