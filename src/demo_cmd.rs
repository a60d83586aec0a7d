//! `hotstart demo`: the main job. Thin: flags become a `hotstart_demo::DemoConfig` (or, for the
//! trainer processes the demo starts, a `TrainerConfig`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use hotstart_sidecar::config::Size;

/// Runs a 3-node training job on this machine (3 sidecars and 3 trainers), checkpointing
/// through hotstart, and injects the faults a real job meets: a trainer killed with kill -9, a
/// whole node killed (sidecar and trainer, memory and disk lost), and a corrupt chunk on disk
/// found when every node restarts. After each, the job resumes from the nearest tier that holds
/// its newest checkpoint and the demo proves the state bit-exact: the restored state's hash
/// equals the hash taken when it was saved, and the steps trained again give the same losses to
/// the bit. At the end: the training stall per checkpoint, how fast each tier persisted, and
/// each fault's recovery time with the tiers its bytes came from.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    hotstart demo                         # 1 GiB of state per trainer, a local directory as the store\n  \
    hotstart demo --size 256MiB --json    # smaller, with a JSON summary on stdout\n  \
    AWS_ENDPOINT_URL=http://127.0.0.1:8333 AWS_ALLOW_HTTP=true hotstart demo --store s3://ckpt/demo\n  \
    hotstart demo --chaos 200 --seed 7   # 200 random faults (4 MiB of state, a checkpoint every 10 steps)\n  \
    hotstart demo --elastic               # a node lost for good: the job reshards onto 2 ranks from memory\n\n\
    Each sidecar may hold up to 6 times --size of shared memory, plus 512 MiB (its own rank's\n\
    newest checkpoint and the one being saved, and the same for the replicas it holds), so the default\n\
    1 GiB needs about 20 GiB of memory in all; each checkpoint is also written to the disk tier\n\
    and to the store (about 18 GiB of disk for the default; the demo checks both before it starts).")]
pub struct DemoArgs {
    /// Object store of the store tier (s3://bucket/prefix, a directory, ...) [default: a
    /// directory in the demo's working directory].
    #[arg(long)]
    store: Option<String>,
    /// Training state (parameters and Adam moments) per trainer, e.g. 1GiB or 256MiB [default:
    /// 1GiB; 4MiB with --chaos].
    #[arg(long)]
    size: Option<Size>,
    /// Training steps between checkpoints [default: 2000, about 15 s of training here for the
    /// rust trainers, longer than a step takes to persist to every tier, as in a real job; 10
    /// with --chaos]. The torch trainers run far fewer steps a second: give them --every 300
    /// and a small --size (16MiB) on a small machine.
    #[arg(long)]
    every: Option<u64>,
    /// Nodes, one sidecar and one trainer each (at least 3: a node is lost and its peers must
    /// hold its replicas).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Seed of the model's initialisation and of the synthetic data (and, with --chaos, of the
    /// faults: the same seed replays the same fault sequence).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Instead of the story's three faults, a random campaign of this many faults (trainers and
    /// sidecars killed, sidecars stopped, the store down, bytes flipped on disk and in the
    /// store, trainers stalled, peer links cut, a node's disk full), with the job's invariants
    /// checked after each one. Filling a disk needs root (each node's disk tier is then a small
    /// tmpfs of its own); without root that kind is left out and the summary says so.
    #[arg(long, value_name = "N")]
    chaos: Option<usize>,
    /// Instead of the story's three faults, the elastic story: the trainers hold one embedding
    /// table of the whole job, its rows split among them; a node is lost and not replaced, and
    /// the job goes on with one rank fewer, each rank loading the rows it now holds from the
    /// survivors' memory (byte ranges of the old ranks' checkpoints, nothing from disk or
    /// store); later a replacement node joins and the job grows back. After each reshard the
    /// demo proves the state bit-exact (the job's digest, a sum over rows, equal to the one
    /// saved) and that the steps trained again give the same losses.
    #[arg(long, conflicts_with = "chaos")]
    elastic: bool,
    /// Working directory for sockets, disk tiers, logs and the default store [default: a new
    /// temporary directory, removed at the end unless --keep; one that an interrupted demo
    /// left behind is removed by the next demo].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the working directory (logs, disk tiers, store) at the end.
    #[arg(long)]
    keep: bool,
    /// Print the summary as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    json: bool,
    /// The trainers: `rust` (this binary, no Python needed) or `torch` (a PyTorch model under
    /// torchrun, checkpointed through `hotstart.Checkpointer`; needs --python with torch and
    /// the hotstart package). The faults and the checks are the same.
    #[arg(long, value_enum, default_value_t = Trainer::Rust)]
    trainer: Trainer,
    /// The Python that runs the torch trainers.
    #[arg(long, default_value = "python3")]
    python: PathBuf,

    /// (internal) Run as one of the demo's trainer processes.
    #[arg(long, hide = true)]
    run_trainer: bool,
    #[arg(long, hide = true)]
    socket: Option<PathBuf>,
    #[arg(long, hide = true, default_value = "demo")]
    job: String,
    #[arg(long, hide = true, default_value_t = 0)]
    rank: u32,
    #[arg(long, hide = true, default_value_t = 1)]
    world_size: u32,
    #[arg(long, hide = true)]
    until: Option<u64>,
    #[arg(long, hide = true)]
    resume_agreement: Option<PathBuf>,
}

/// Steps between checkpoints by default: about 15 s of training here, longer than a step takes
/// to persist to every tier, as in a real job.
const DEFAULT_EVERY: u64 = 2000;

/// The demo's trainers, as the command line names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Trainer {
    Rust,
    Torch,
}

/// Checks that `python` can run the torch trainers, so that a missing package is one clear
/// error before any node starts.
fn torch_trainer(python: &std::path::Path) -> anyhow::Result<hotstart_demo::TrainerKind> {
    let out = std::process::Command::new(python)
        .args(["-c", "import torch, hotstart._demo_trainer"])
        .output()
        .with_context(|| format!("--trainer torch: run {}", python.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "--trainer torch needs a Python with torch and the hotstart package; {} has not: {}\n\
         Install them (`pip install torch` and the hotstart wheel) or name another with --python.",
        python.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(hotstart_demo::TrainerKind::Torch {
        python: python.to_path_buf(),
    })
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.run_trainer {
        let socket = args.socket.context("--run-trainer needs --socket")?;
        return Ok(hotstart_demo::trainer::run(
            &hotstart_demo::TrainerConfig {
                socket,
                job: args.job,
                rank: args.rank,
                world_size: args.world_size,
                state_bytes: args.size.map_or(1 << 30, |s| s.0),
                seed: args.seed,
                every: args.every.unwrap_or(DEFAULT_EVERY),
                until: args.until,
                agreement: args.resume_agreement,
                elastic: args.elastic,
            },
        )?);
    }
    anyhow::ensure!(args.nodes >= 3, "--nodes must be at least 3");
    let trainer = match args.trainer {
        Trainer::Rust => hotstart_demo::TrainerKind::Rust,
        Trainer::Torch => {
            anyhow::ensure!(
                args.chaos.is_none() && !args.elastic,
                "--chaos and --elastic run the Rust trainers; leave out --trainer torch"
            );
            torch_trainer(&args.python)?
        }
    };
    let (size, every) = match args.chaos {
        Some(_) => (4 << 20, 10),
        None => (1 << 30, DEFAULT_EVERY),
    };
    let size = args.size.map_or(size, |s| s.0);
    let every = args.every.unwrap_or(every);
    anyhow::ensure!(every >= 4, "--every must be at least 4 steps");
    let (dir, temp) = match &args.dir {
        Some(d) => (d.clone(), None),
        None => {
            let parent = Path::new("/var/tmp");
            remove_interrupted(parent);
            let t = tempfile::Builder::new()
                .prefix(&format!("{TEMP_PREFIX}{}-", std::process::id()))
                .tempdir_in(parent)
                .or_else(|_| tempfile::tempdir())
                .context("create the demo's working directory")?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let cfg = hotstart_demo::DemoConfig {
        exe: std::env::current_exe().context("find the hotstart binary")?,
        dir: dir.clone(),
        store: args.store,
        nodes: args.nodes,
        state_bytes: size,
        every,
        seed: args.seed,
        live: !args.json,
        trainer,
        elastic: args.elastic,
    };
    if let Some(faults) = args.chaos {
        return chaos(cfg, faults, args.json, args.keep, temp);
    }
    let result = hotstart_demo::run(&cfg);
    let keep = args.keep || result.is_err();
    if let Some(t) = temp
        && keep
    {
        let kept = t.keep();
        eprintln!(
            "hotstart demo: logs, disk tiers and store kept in {}",
            kept.display()
        );
    }
    let summary = result.with_context(|| format!("the demo failed; logs in {}", dir.display()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        eprintln!();
        eprint!("{}", hotstart_demo::table(&summary));
    }
    anyhow::ensure!(
        summary.problems.is_empty() && summary.faults.iter().all(|f| f.exact),
        "the demo found problems (see above)"
    );
    Ok(())
}

/// How the demo's own working directories are named: this, the demo's process id, `-`, and a
/// random tail.
const TEMP_PREFIX: &str = "hotstart-demo-";

/// Removes the working directories under `parent` that demos no longer running left behind
/// (stopped by a signal, which skips the removal at the end), unmounting the disk tiers a
/// chaos run mounted there first. Each one removed is said on stderr.
fn remove_interrupted(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for dir in entries.flatten().map(|e| e.path()) {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let Some(pid) = name
            .strip_prefix(TEMP_PREFIX)
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill(2) with signal 0 only checks that the process exists.
        let running = unsafe { libc::kill(pid, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
        if running || !dir.is_dir() {
            continue;
        }
        for mount in mounts_under(&dir) {
            if let Ok(target) = std::ffi::CString::new(mount.as_os_str().as_encoded_bytes()) {
                // SAFETY: a NUL-terminated path that outlives the call.
                unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
            }
        }
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => eprintln!(
                "hotstart demo: removed {}, left by an interrupted demo",
                dir.display()
            ),
            Err(e) => eprintln!(
                "hotstart demo: cannot remove {}, left by an interrupted demo: {e}",
                dir.display()
            ),
        }
    }
}

/// The mount points at or under `dir`, deepest first.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|m| m.starts_with(dir))
        .collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    found
}

/// `hotstart demo --chaos N`: the campaign, its summary, and a failure naming the seed when an
/// invariant broke (the working directory is then kept).
fn chaos(
    cfg: hotstart_demo::DemoConfig,
    faults: usize,
    json: bool,
    keep: bool,
    temp: Option<tempfile::TempDir>,
) -> anyhow::Result<()> {
    let dir = cfg.dir.clone();
    let seed = cfg.seed;
    let result =
        hotstart_demo::chaos::run(&hotstart_demo::chaos::ChaosConfig { demo: cfg, faults });
    let broken = !matches!(&result, Ok(s) if s.violation.is_none());
    if let Some(t) = temp
        && (keep || broken)
    {
        let kept = t.keep();
        eprintln!(
            "hotstart demo: logs, disk tiers and store kept in {}",
            kept.display()
        );
    }
    let summary = result.with_context(|| {
        format!(
            "the campaign failed (seed {seed}); logs in {}",
            dir.display()
        )
    })?;
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        eprintln!();
        eprint!("{}", hotstart_demo::chaos::table(&summary));
    }
    if let Some(v) = &summary.violation {
        anyhow::bail!(
            "seed {seed}: invariant {} broken: {}",
            hotstart_demo::chaos::RULES[v.rule.min(hotstart_demo::chaos::RULES.len() - 1)],
            v.detail
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_directories_of_demos_no_longer_running_are_removed() {
        let parent = tempfile::tempdir().unwrap();
        let mut exited = std::process::Command::new("true").spawn().unwrap();
        exited.wait().unwrap();
        let gone = parent
            .path()
            .join(format!("{TEMP_PREFIX}{}-abc", exited.id()));
        let running = parent
            .path()
            .join(format!("{TEMP_PREFIX}{}-def", std::process::id()));
        let other = parent.path().join("hotstart-demo-notapid");
        for d in [&gone, &running, &other] {
            std::fs::create_dir_all(d.join("node-0")).unwrap();
            std::fs::write(d.join("node-0/log"), b"x").unwrap();
        }
        remove_interrupted(parent.path());
        assert!(!gone.exists());
        assert!(running.join("node-0/log").is_file());
        assert!(other.join("node-0/log").is_file());
    }
}
