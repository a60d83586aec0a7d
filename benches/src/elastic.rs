//! `restart --elastic`: a job that comes back with another number of ranks. A torchrun job
//! (`examples/torchrun/train.py`: FSDP2, AdamW, gloo) on simulated nodes, each with its own
//! sidecar (memory, one replica in a peer's memory, a store in SeaweedFS behind the emulated
//! remote link, benches/netem.sh), checkpoints step 2 with torch.distributed.checkpoint
//! through the sidecars (`--dcp`), and the same state with torch DCP's own FileSystemWriter
//! (uploaded to the same bucket). Then, same run, same state, in both directions (3 ranks → 2,
//! and 2 → 3):
//!
//! * the same ranks load it again from the sidecars' memory (a same-size restart);
//! * the job comes back with the other number of ranks and loads it, resharded, from the
//!   sidecars' memory. 3 → 2: node 3 is lost (its sidecar stopped, its memory gone), and the
//!   ranks that need old rank 3's shard take it from the replica on a peer. 2 → 3: node 3 joins
//!   with empty memory, and its rank takes what it needs from its peers;
//! * the new ranks load it from the store behind the link with hotstart's `StorageReader` (no
//!   sidecar);
//! * the new ranks load torch DCP's copy with its `FileSystemReader` through a fresh s3fs
//!   mount of the bucket (what a user has without hotstart).
//!
//! Each load is timed from the workers' timelines (the last rank through `read`, then through
//! `set_state_dict`), and each job from torchrun's launch to the first resumed step. Every
//! load prints the gathered digest of the whole state, which must equal the saved one.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, ensure};

use hotstart_fuse::FsConfig;

use crate::fuse::mounts::{self, Peer, Server, Target};
use crate::report::{Report, Row, median};
use crate::restart::{Remote, RestartArgs, Timeline, torchrun, unix_now};
use crate::sidecar::{Running, settings};

/// One load: the checkpoint read, `set_state_dict`, and launch → first resumed step.
#[derive(Debug, Clone, Copy)]
struct Load {
    read: f64,
    set: f64,
    to_step: f64,
}

impl Load {
    fn total(&self) -> f64 {
        self.read + self.set
    }
}

/// Runs train.py with `args` on `nproc` ranks, checks that it resumed from step 2 with the
/// saved state, and times it.
fn load(python: &Path, nproc: u32, args: &[String], saved: &str) -> anyhow::Result<Load> {
    let launched = unix_now();
    let out = torchrun(python, nproc, 0, args)?;
    let t = Timeline::parse(&out);
    ensure!(
        t.resumed == Some(2),
        "{}: did not resume from step 2:\n{out}",
        args.join(" ")
    );
    let state = state_of(&out, 0)?;
    ensure!(
        state == saved,
        "{}: loaded state {state}, saved {saved}: not bit-exact",
        args.join(" ")
    );
    let at = |e: &str| t.last(e, 0);
    Ok(Load {
        read: at("read")? - at("ready")?,
        set: at("loaded")? - at("read")?,
        to_step: at("step")? - launched,
    })
}

/// The `n`-th `state <digest>` line a job printed (0: after resuming).
fn state_of(out: &str, n: usize) -> anyhow::Result<String> {
    out.lines()
        .filter_map(|l| l.strip_prefix("state "))
        .nth(n)
        .map(String::from)
        .context("the job printed no state digest")
}

pub(crate) fn run(args: &RestartArgs, python: &Path, remote: &Remote) -> anyhow::Result<()> {
    // fp32 parameters plus AdamW's two moments: `--gib` per rank of the larger world.
    let params = args.gib * (1u64 << 30) as f64 * f64::from(SHRINK) / 12.0;
    let depth = ((params / (args.width * args.width) as f64).round() as u64).max(1);
    let total = 12 * depth * args.width * args.width;
    let label = format!(
        "{:.2} GiB of state (FSDP2, AdamW, {depth} layers of {w}×{w})",
        total as f64 / (1u64 << 30) as f64,
        w = args.width
    );
    eprintln!("restart --elastic: {label}, {} runs", args.runs);
    let base = tempfile::Builder::new()
        .prefix("hotstart-elastic-bench-")
        .tempdir_in("/var/tmp")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut report = Report::new(&format!("restart --elastic: {label}"));
    for (before, after) in [(SHRINK, GROW), (GROW, SHRINK)] {
        let bench = Direction {
            args,
            python,
            remote,
            rt: &rt,
            depth,
            total,
            before,
            after,
        };
        bench.run(base.path(), &mut report)?;
    }
    report.note(
        "Every load's gathered state digest equals the saved one (bit-exact). The loads from \
         memory read no shard from a disk or the store. A rank takes from a peer only the \
         64 KiB parts of chunks that hold the ranges it reads, each verified against its \
         chunk's id; the store: SeaweedFS behind \
         benches/netem.sh (10 ms RTT, 100 MB/s per connection); the peers on loopback, over \
         mutual TLS; gloo on CPU, OMP_NUM_THREADS=1.",
    );
    report.finish(args.markdown.as_deref())
}

/// The larger world, and the smaller.
const SHRINK: u32 = 3;
const GROW: u32 = 2;

/// One direction of the benchmark: a job saved by `before` ranks, loaded by `after`.
struct Direction<'a> {
    args: &'a RestartArgs,
    python: &'a Path,
    remote: &'a Remote,
    rt: &'a tokio::runtime::Runtime,
    depth: u64,
    total: u64,
    before: u32,
    after: u32,
}

impl Direction<'_> {
    /// `runs` times: the checkpoint saved by `before` ranks through their nodes' sidecars and by
    /// torch DCP's own writer; a same-size restart; then `after` ranks load it from the
    /// sidecars' memory (a node lost, or a new one with empty memory), from the store behind
    /// the link, and torch DCP's copy through s3fs. Adds the rows to `report`.
    fn run(&self, base: &Path, report: &mut Report) -> anyhow::Result<()> {
        let (before, after, args) = (self.before, self.after, self.args);
        let nodes_n = before.max(after);
        let mut same = Vec::new();
        let mut resharded = Vec::new();
        let mut from_store = Vec::new();
        let mut torch_s3fs = Vec::new();
        let mut peer_restores = 0.0;
        for run in 0..args.runs {
            let dir = base.join(format!("{before}-{after}-run-{run}"));
            std::fs::create_dir_all(&dir)?;
            let job = format!("elastic-{before}-{after}-{run}");
            let common = |steps: u32, save_every: u32| -> Vec<String> {
                [
                    "--width",
                    &args.width.to_string(),
                    "--depth",
                    &self.depth.to_string(),
                    "--timeline",
                    "--job",
                    &job,
                    "--steps",
                    &steps.to_string(),
                    "--save-every",
                    &save_every.to_string(),
                ]
                .map(String::from)
                .to_vec()
            };
            // The nodes: memory (a shard, its next save's segment, a peer's replica and
            // fetched shards fit), one replica each, the store behind the link.
            let shard = self.total / u64::from(before.min(after));
            let budget = 5 * shard + (256 << 20);
            let store = self.remote.url(&format!("hotstart-{before}-{after}-{run}"));
            let mut all = Vec::new();
            for i in 0..nodes_n {
                let mut s = settings(&format!("node-{i}"), &dir, budget)?;
                s.store = Some(store.clone());
                s.replicas = Some(1);
                all.push(s);
            }
            let listens: Vec<String> = all
                .iter()
                .map(|s| s.listen.clone().unwrap_or_default())
                .collect();
            for (i, s) in all.iter_mut().enumerate() {
                s.peers = Some(
                    (0..nodes_n as usize)
                        .filter(|&j| j != i)
                        .map(|j| format!("node-{j}={}", listens[j]))
                        .collect(),
                );
            }
            let mut nodes = all
                .into_iter()
                .map(Running::start)
                .collect::<anyhow::Result<Vec<_>>>()?;
            let sockets = |nodes: &[Running]| -> String {
                nodes
                    .iter()
                    .map(|n| n.socket.display().to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let savers = &nodes[..before as usize];

            // Step 2, through the sidecars, and with torch DCP's own writer (uploaded).
            let mut save = common(2, 2);
            save.extend(["--dcp".into(), "--sidecar".into(), sockets(savers)]);
            let saved = state_of(&torchrun(self.python, before, 0, &save)?, 0)?;
            let torch_dir = dir.join("torch-dcp");
            let mut save = common(2, 2);
            save.extend(["--torch-dcp".into(), torch_dir.display().to_string()]);
            let theirs = state_of(&torchrun(self.python, before, 0, &save)?, 0)?;
            ensure!(
                theirs == saved,
                "torch DCP's run saved another state: {theirs} against {saved}"
            );
            self.remote
                .upload(self.rt, &torch_dir, &format!("torch-{run}"))?;
            std::fs::remove_dir_all(&torch_dir)?;

            let mut again = common(3, 0);
            again.extend(["--dcp".into(), "--sidecar".into(), sockets(savers)]);
            same.push(load(self.python, before, &again, &saved)?);

            // Fewer ranks: the last node is lost, its sidecar stopped and its memory gone.
            // More: the nodes that did not save join with empty memory.
            nodes.truncate(after as usize);
            let restores = |nodes: &[Running], source: &str| -> f64 {
                nodes
                    .iter()
                    .map(|n| n.metric(&format!("hotstart_restores_total{{source=\"{source}\"}}")))
                    .sum()
            };
            let earlier = restores(&nodes, "peer");
            let mut moved = common(3, 0);
            moved.extend(["--dcp".into(), "--sidecar".into(), sockets(&nodes)]);
            resharded.push(load(self.python, after, &moved, &saved)?);
            peer_restores += restores(&nodes, "peer") - earlier;
            for source in ["disk", "store"] {
                let n = restores(&nodes, source);
                ensure!(
                    n == 0.0,
                    "the reshard from memory read {n} shards from the {source}"
                );
            }
            drop(nodes);

            let mut stored = common(3, 0);
            stored.extend(["--store".into(), store.clone()]);
            from_store.push(load(self.python, after, &stored, &saved)?);

            let scratch = dir.join("s3fs");
            std::fs::create_dir_all(&scratch)?;
            let view = hotstart_store::Store::open(&self.remote.url(""))?;
            let server = Server {
                weed: &self.remote.weed,
                bucket: &self.remote.bucket,
                store: &view,
                rt: self.rt.handle(),
                scratch: &scratch,
            };
            let mounted =
                mounts::mount(Target::Peer(Peer::S3fs), &server, FsConfig::default(), run)?;
            let mut torch_load = common(3, 0);
            torch_load.extend([
                "--torch-dcp".into(),
                mounted
                    .path()
                    .join(format!("torch-{run}"))
                    .display()
                    .to_string(),
            ]);
            torch_s3fs.push(load(self.python, after, &torch_load, &saved)?);
            drop(mounted);
            std::fs::remove_dir_all(&dir)?;
            eprintln!(
                "  {before} → {after}, run {run}: load {:.2} s same size from memory, {:.2} s \
                 resharded from memory, {:.2} s from the store, {:.2} s torch DCP through s3fs",
                same[run].total(),
                resharded[run].total(),
                from_store[run].total(),
                torch_s3fs[run].total()
            );
        }
        let med = |v: &[Load], f: fn(&Load) -> f64| {
            median(v.iter().map(|l| Duration::from_secs_f64(f(l))).collect())
        };
        let what = format!(
            "reshard load {before} → {after} ranks from the sidecars' memory (read + set_state_dict)"
        );
        let ours = med(&resharded, Load::total);
        let loads = [
            (
                "the same hotstart DCP load from the store behind the link".to_string(),
                &from_store,
                Some(5.0),
            ),
            (
                "torch DCP FileSystemReader through s3fs, same bucket".into(),
                &torch_s3fs,
                None,
            ),
            (
                format!("a same-size restart's load from memory ({before} → {before})"),
                &same,
                Some(1.0 / 1.5),
            ),
        ];
        for (peer, theirs, target) in loads {
            let theirs = med(theirs, Load::total);
            report.add(Row::rate(
                what.clone(),
                self.total,
                ours,
                peer,
                theirs,
                target,
            ));
        }
        let what = format!(
            "launch → first resumed step, {before} → {after} ranks from the sidecars' memory"
        );
        let ours = med(&resharded, |l| l.to_step);
        for (peer, theirs) in [
            ("the same from the store behind the link", &from_store),
            ("torch DCP FileSystemReader through s3fs", &torch_s3fs),
        ] {
            let theirs = med(theirs, |l| l.to_step);
            report.add(Row::time(what.clone(), ours, peer, theirs, None));
        }
        let ms = |v: &[Load], f: fn(&Load) -> f64| format!("{:.0}", med(v, f).as_secs_f64() * 1e3);
        report.note(format!(
            "{before} → {after}: load phases, medians in ms (read | set_state_dict): same size \
             from memory {} | {}; resharded from memory {} | {}; from the store {} | {}; torch \
             DCP through s3fs {} | {}. Over {} runs, {peer_restores:.0} restores of old shards \
             came from a peer's memory, the rest from the node's own (its ranks' shards and the \
             replicas it holds, which placement decides).",
            ms(&same, |l| l.read),
            ms(&same, |l| l.set),
            ms(&resharded, |l| l.read),
            ms(&resharded, |l| l.set),
            ms(&from_store, |l| l.read),
            ms(&from_store, |l| l.set),
            ms(&torch_s3fs, |l| l.read),
            ms(&torch_s3fs, |l| l.set),
            args.runs
        ));
        Ok(())
    }
}
