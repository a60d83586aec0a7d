//! A real PyTorch job restarting after a fault, end to end: `examples/torchrun/train.py` (FSDP2,
//! AdamW, gloo) under `torchrun --max-restarts 1`, checkpointing every step through a sidecar
//! that this process runs. One worker kills itself with SIGKILL right after its first save is
//! staged; torchrun stops the others and starts every worker again, and they load their shards
//! from the sidecar's memory. Every worker prints when each phase ends (`--timeline`), so the
//! restart is cut into phases: torchrun noticing the fault and starting the workers again,
//! `import torch`, joining the process group, building the model, giving the fresh optimizer
//! its state, loading the checkpoint, and the first step.
//!
//! The floor, same run, same model and sizes: the same workers under torchrun doing what any
//! restarted worker must do at least (start, import torch, join the group, build the model)
//! and then copying as many bytes as their state holds from memory into memory already faulted
//! in (`--floor`), all ranks at once. Rows (medians of `--runs`):
//!
//! * kill → every rank has its state loaded, against the floor (target ≤ 1.5×, a ratio ≥ 0.67);
//! * kill → every rank has finished its first step, against the floor plus one step of the
//!   same job not interrupted (no target: the step's length is the model's, not hotstart's);
//! * the state load itself (`ck.load` into the model's and optimizer's tensors, then
//!   `set_state_dict`) against the floor's memcpy of the same bytes (target ≥ 0.8).
//!
//! **A replacement node that starts cold** (`--cold`): the job saved step 1 on node A (its
//! sidecar: memory, disk, and a local-directory store) and, the same state, with
//! torch.distributed.checkpoint's own FileSystemWriter (the path a user has without hotstart).
//! Then new workers start on a node that holds nothing, each to its first step: through a new
//! sidecar that fetches the shards from A's memory (a peer), through one that reads the store,
//! and with DCP's FileSystemReader from the local disk, the page cache dropped before each. The
//! environment phase (installing or restoring torch) is not in this run: see `env`.
//!
//! Needs the project's venv (`scripts/setup.sh`: torch and the built package), about
//! `3 × nproc × gib` GiB of memory for each sidecar beside the workers' own, and root for the
//! page-cache drops of `--cold`.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};

use crate::report::{Report, Row, median};
use crate::sidecar::{Running, settings};
use crate::store_uring::drop_page_cache;

/// Options of `hotstart-benches restart`.
#[derive(Debug, clap::Args)]
pub struct RestartArgs {
    /// GiB of checkpointed state per rank (its shards of the parameters and of AdamW's two
    /// moments, fp32).
    #[arg(long, default_value_t = 2.0)]
    gib: f64,
    /// Worker processes (ranks) on this node.
    #[arg(long, default_value_t = 2)]
    nproc: u32,
    /// Width of the model's hidden layers (its depth follows from --gib).
    #[arg(long, default_value_t = 4096)]
    width: u64,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also measure a replacement node that starts cold (state from a peer's memory, from the
    /// store, and DCP from the local disk).
    #[arg(long)]
    cold: bool,
    /// The Python with torch and hotstart (default: the project's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Also write the table here (Markdown, and JSON beside it).
    #[arg(long)]
    markdown: Option<PathBuf>,
}

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// What the workers printed with `--timeline`: per event and attempt, each rank's time.
#[derive(Debug, Default)]
struct Timeline {
    at: BTreeMap<(String, u32), Vec<f64>>,
    /// `floor-copy` seconds, per rank.
    copies: Vec<f64>,
    /// The step the restarted job resumed from, if it said so.
    resumed: Option<u64>,
}

impl Timeline {
    fn parse(out: &str) -> Timeline {
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
                ["resumed", step, ..] => t.resumed = step.parse().ok(),
                _ => {}
            }
        }
        t
    }

    /// When the last rank got to `event` in `attempt`.
    fn last(&self, event: &str, attempt: u32) -> anyhow::Result<f64> {
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
}

impl Floor {
    fn of(t: &Timeline) -> anyhow::Result<Floor> {
        let at = |e: &str| t.last(e, 0);
        ensure!(!t.copies.is_empty(), "the floor printed no copy time");
        Ok(Floor {
            import: at("imported")? - t.first("start", 0)?,
            group: at("group")? - at("imported")?,
            build: at("built")? - at("group")?,
            copy: t.copies.iter().copied().fold(0.0, f64::max),
        })
    }

    fn total(&self) -> f64 {
        self.import + self.group + self.build + self.copy
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Runs train.py under torchrun with `args`; its stdout.
fn torchrun(python: &Path, nproc: u32, restarts: u32, args: &[String]) -> anyhow::Result<String> {
    let train = workspace().join("examples/torchrun/train.py");
    let out = Command::new(python)
        .args(["-m", "torch.distributed.run"])
        .arg(format!("--nproc-per-node={nproc}"))
        .arg(format!("--max-restarts={restarts}"))
        .args(["--monitor-interval=0.1", "--master-addr=127.0.0.1"])
        .arg(format!("--master-port={}", free_port()?))
        .arg(&train)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("HOTSTART_SOCKET")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {} -m torch.distributed.run", python.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "torchrun {}: {}\n{stdout}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

pub fn run(args: &RestartArgs) -> anyhow::Result<()> {
    ensure!(
        args.gib > 0.0 && args.nproc > 0 && args.runs > 0 && args.width > 0,
        "--gib, --nproc, --width and --runs must be positive"
    );
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| workspace().join(".venv/bin/python"));
    ensure!(
        python.exists(),
        "{} is missing: run scripts/setup.sh (it installs torch and the package), or pass --python",
        python.display()
    );
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
    let label = format!(
        "{} ranks × {:.2} GiB (FSDP2, AdamW, {depth} layers of {w}×{w})",
        args.nproc,
        state_bytes as f64 / (1u64 << 30) as f64,
        w = args.width
    );
    eprintln!("restart: {label}, {} runs", args.runs);
    let base = tempfile::Builder::new()
        .prefix("hotstart-restart-bench-")
        .tempdir_in("/var/tmp")?;
    let mut restarts = Vec::new();
    let mut floors = Vec::new();
    for run in 0..args.runs {
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

        let dir = base.path().join(format!("run-{run}"));
        std::fs::create_dir_all(&dir)?;
        let budget = (3.0 * args.nproc as f64 * state_bytes as f64) as u64 + (256 << 20);
        let sidecar = Running::start(settings("restart", &dir, budget)?)?;
        let mut job = model.clone();
        job.extend([
            "--job".into(),
            format!("restart-{run}"),
            "--steps".into(),
            "2".into(),
            "--save-every".into(),
            "1".into(),
            "--kill-rank".into(),
            (args.nproc - 1).to_string(),
            "--kill-step".into(),
            "1".into(),
            "--sidecar".into(),
            sidecar.socket.display().to_string(),
        ]);
        let timeline = Timeline::parse(&torchrun(&python, args.nproc, 1, &job)?);
        drop(sidecar);
        ensure!(
            timeline.resumed == Some(1),
            "the restarted job did not resume from step 1 (it said {:?})",
            timeline.resumed
        );
        let phases = Phases::of(&timeline)?;
        eprintln!(
            "  run {run}: kill → loaded {:.2} s {phases:?}",
            phases.until_loaded()
        );
        restarts.push(phases);
    }
    let secs = Duration::from_secs_f64;
    let med = |f: &dyn Fn(&Phases) -> f64| median(restarts.iter().map(|p| secs(f(p))).collect());
    let fmed = |f: &dyn Fn(&Floor) -> f64| median(floors.iter().map(|p| secs(f(p))).collect());
    let mut report = Report::new(&format!("restart: a PyTorch job under torchrun, {label}"));
    report.add(Row::time(
        format!("process restart (kill -9 of a worker) → every rank's state loaded from the sidecar's memory, {label}"),
        med(&|p| p.until_loaded()),
        "floor: process start + import torch + group + model build + memcpy of the state",
        fmed(&|f| f.total()),
        Some(1.0 / 1.5),
    ));
    report.add(Row::time(
        format!("process restart → first resumed step done, {label}"),
        med(&|p| p.until_loaded() + p.step),
        "the floor + one step of the same job, not interrupted",
        fmed(&|f| f.total()) + med(&|p| p.plain_step),
        None,
    ));
    report.add(Row::rate(
        format!("state load (ck.load into the model's and optimizer's tensors, then set_state_dict), {label}"),
        state_bytes,
        med(&|p| p.load()),
        "memcpy of the same bytes into faulted memory, each rank at once",
        fmed(&|f| f.copy),
        Some(0.8),
    ));
    if args.cold {
        cold(
            args,
            &python,
            &model,
            state_bytes,
            &label,
            base.path(),
            &mut report,
        )?;
    }
    let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1000.0);
    report.note(format!(
        "Phases, medians in ms (restart | floor): torchrun notices the kill and starts the workers {} | –; \
         import torch {} | {}; process group {} | {}; model build {} | {}; fresh optimizer state \
         (get_state_dict) {} | –; checkpoint load {} (read {}, set_state_dict {}) | memcpy {}; first \
         step {} (uninterrupted: {}).",
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

/// One cold start: process start → first step done, and the load phase alone.
#[derive(Debug, Clone, Copy)]
struct Cold {
    to_step: f64,
    load: f64,
}

impl Cold {
    fn of(t: &Timeline) -> anyhow::Result<Cold> {
        ensure!(
            t.resumed == Some(1),
            "the cold start did not resume from step 1"
        );
        Ok(Cold {
            to_step: t.last("step", 0)? - t.first("start", 0)?,
            load: t.last("loaded", 0)? - t.last("ready", 0)?,
        })
    }
}

/// The replacement-node rows (see the module docs).
fn cold(
    args: &RestartArgs,
    python: &Path,
    model: &[String],
    state_bytes: u64,
    label: &str,
    base: &Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    let dir = base.join("cold");
    std::fs::create_dir_all(&dir)?;
    let budget = (3.0 * args.nproc as f64 * state_bytes as f64) as u64 + (256 << 20);
    let store = dir.join("store");
    let mut a_settings = settings("node-a", &dir, budget)?;
    a_settings.store = Some(store.display().to_string());
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
    let dcp = dcp_dir.display().to_string();
    torchrun(
        python,
        args.nproc,
        0,
        &job(&["--steps", "1", "--save-every", "1", "--torch-dcp", &dcp]),
    )?;

    let resume = |how: &[&str]| -> anyhow::Result<Cold> {
        drop_page_cache().context("drop the page cache (needs root)")?;
        let mut extra = vec!["--steps", "2", "--save-every", "0"];
        extra.extend_from_slice(how);
        Cold::of(&Timeline::parse(&torchrun(
            python,
            args.nproc,
            0,
            &job(&extra),
        )?))
    };
    let (mut peer, mut from_store, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..args.runs {
        // A new node each time: a sidecar with nothing in memory and no disk tier.
        let b_dir = dir.join(format!("b-{run}"));
        std::fs::create_dir_all(&b_dir)?;
        let mut b_settings = settings("node-b", &b_dir, budget)?;
        b_settings.peers = Some(vec![format!("node-a={}", a.peer)]);
        let b = Running::start(b_settings)?;
        peer.push(resume(&["--sidecar", &b.socket.display().to_string()])?);
        drop(b);
        let c_dir = dir.join(format!("c-{run}"));
        std::fs::create_dir_all(&c_dir)?;
        let mut c_settings = settings("node-c", &c_dir, budget)?;
        c_settings.store = Some(store.display().to_string());
        let c = Running::start(c_settings)?;
        from_store.push(resume(&["--sidecar", &c.socket.display().to_string()])?);
        drop(c);
        theirs.push(resume(&["--torch-dcp", &dcp])?);
        eprintln!(
            "  cold run {run}: peer {:?}, store {:?}, DCP {:?}",
            peer[run], from_store[run], theirs[run]
        );
    }
    drop(a);
    let secs = Duration::from_secs_f64;
    let med = |v: &[Cold], f: fn(&Cold) -> f64| median(v.iter().map(|c| secs(f(c))).collect());
    let dcp_peer = "DCP FileSystemReader from the local disk, cold page cache";
    for (name, ours) in [
        ("a peer's memory", &peer),
        ("the store (a local directory)", &from_store),
    ] {
        report.add(Row::time(
            format!("new node, cold: process start → first step done, state from {name}, {label}"),
            med(ours, |c| c.to_step),
            dcp_peer,
            med(&theirs, |c| c.to_step),
            None,
        ));
        report.add(Row::rate(
            format!("new node, cold: the state load, from {name}, {label}"),
            state_bytes,
            med(ours, |c| c.load),
            dcp_peer,
            med(&theirs, |c| c.load),
            None,
        ));
    }
    report.note(
        "New-node rows: step 1 was saved on node A (sidecar with memory, disk and a local-directory \
         store) and with torch's own DCP FileSystemWriter; each cold start resumes it on a node \
         holding nothing (a new sidecar whose only peer is A, or whose store is A's store), page \
         cache dropped first. The environment phase (torch's 4.2 GB venv) is not in this run: see \
         the env benchmark for restores against pip and uv.",
    );
    Ok(())
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
}
