//! The story the demo tells: a job trains and checkpoints, then meets the faults a real job
//! meets, and after each one resumes from the nearest tier with its state bit-exact.
//!
//! With `E` steps between checkpoints:
//!
//! 1. **Train.** Every node's sidecar starts, then every trainer; they train from scratch and
//!    checkpoint every `E` steps.
//! 2. **kill -9 a trainer.** Once every rank holds step `2E` in its sidecar's memory and rank 1
//!    is a few steps past it, rank 1 is SIGKILLed. As a launcher does when one rank of a job
//!    dies, the other trainers are stopped too, and all start again: each restores the newest
//!    step complete for every rank from its node's sidecar memory, then trains again the steps
//!    it had already trained, which must give the same losses to the bit.
//! 3. **kill -9 a node.** Once step `4E` is on the peers, node 2's sidecar and trainer are
//!    SIGKILLed (its memory is gone, and its disk with it: the replacement starts with an empty
//!    one). A new sidecar with the same node id pulls node 2's shards back from its peers before
//!    it reports ready; then the job restarts and every rank restores, rank 2 from what its
//!    node recovered.
//! 4. **A corrupt chunk, and every node restarted.** The trainers run to step `6E` and stop once
//!    it is persisted to disk and store; every sidecar is SIGKILLed (no memory survives), one
//!    byte of rank 0's file of step `6E` on node 0's disk is flipped, and the sidecars start
//!    again on their disks. Each rank restores from disk; rank 0's sidecar finds the bad chunk
//!    by its checksum and reads that chunk from the store instead.
//! 5. **Drain.** The trainers run one more checkpoint and stop; SIGTERM drains the sidecars.
//!
//! Every restore is checked against the hash the rank reported when it saved that step, and the
//! summary reports the stall of each checkpoint, how fast each tier persisted, and each fault's
//! recovery time with the tiers its bytes came from.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cluster::{Cluster, Msg};
use crate::view::{TIERS, View};
use crate::{DemoConfig, Error, Result};

pub(crate) const JOB: &str = "demo";
/// The steps a trainer is past a checkpoint when it is killed.
pub(crate) const PAST: u64 = 3;

/// Medians and extremes of a set of figures.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Spread {
    pub median: f64,
    pub max: f64,
    pub count: usize,
}

impl Spread {
    fn of(mut xs: Vec<f64>) -> Spread {
        xs.sort_by(f64::total_cmp);
        Spread {
            median: xs.get(xs.len() / 2).copied().unwrap_or(0.0),
            max: xs.last().copied().unwrap_or(0.0),
            count: xs.len(),
        }
    }
}

/// How one tier persisted checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct TierFigures {
    pub tier: String,
    /// Seconds from a save's start to the tier holding it.
    pub seconds: Spread,
    /// One rank's state over the median time.
    pub bytes_per_second: f64,
}

/// One fault and the job's recovery from it.
#[derive(Debug, Clone, Serialize)]
pub struct FaultReport {
    pub fault: String,
    /// From the fault to every rank's state restored (processes started again included).
    pub recovery_seconds: f64,
    /// The step every rank resumed from.
    pub step: u64,
    /// Per rank: where its bytes came from, e.g. "memory" or "disk + store (1 of 17 chunks)".
    pub sources: Vec<String>,
    /// Per rank: how long its load took.
    pub restore_seconds: Vec<f64>,
    /// Every restored state equals the state saved, and every step trained again gave the same
    /// loss.
    pub exact: bool,
    /// Losses of steps trained again after this restore, summed over the ranks, all compared
    /// bit for bit.
    pub replayed_steps: u64,
}

/// What the demo measured.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub nodes: usize,
    /// The trainers: "rust" or "torch".
    pub trainer: String,
    pub state_bytes_per_rank: u64,
    pub store: String,
    pub dir: PathBuf,
    /// Training's wait per checkpoint (`save` to `wait_staged`), in seconds, in the steady
    /// state: every save of a trainer process but its first.
    pub stall_seconds: Spread,
    /// Of that wait, the copy (`wait_staged` after `save` returned).
    pub copy_seconds: Spread,
    /// Of that wait, the time before the copy began: `save` waiting for the segment prepared
    /// for it after the last commit (an older step's, once its persistence lets go, or memory
    /// the sidecar allocates).
    pub queued_seconds: Spread,
    /// The wait of the first save of each trainer process (after each fault's restart), which
    /// asks for its segment itself and maps memory new to it.
    pub first_stall_seconds: Spread,
    /// The floor of that wait: one rank's state copied into memory already mapped (a parallel
    /// memcpy over as many threads as a trainer's engine copies with), median of five, seconds.
    pub copy_floor_seconds: f64,
    /// The same copy made by every trainer at once, as they do when they save the same step
    /// (each its own bytes; on a machine with fewer cores than the trainers' copy threads,
    /// the floor of a save the trainers make together).
    pub copy_floor_together_seconds: f64,
    pub tiers: Vec<TierFigures>,
    pub faults: Vec<FaultReport>,
    pub problems: Vec<String>,
    pub seconds: f64,
}

pub(crate) struct Demo {
    pub(crate) cluster: Cluster,
    pub(crate) view: View,
    pub(crate) faults: Vec<FaultReport>,
    pub(crate) every: u64,
    /// Trainers that will exit on their own (they were given a last step).
    pub(crate) finishing: Vec<bool>,
    /// Per rank, the newest trainer generation whose stdout has closed.
    pub(crate) closed: Vec<u32>,
}

impl Demo {
    /// Takes in events and metrics until `done(view)`, failing after `timeout` or when a trainer
    /// exits that was not told to.
    pub(crate) fn until(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&View) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut drawn = Instant::now() - Duration::from_secs(1);
        loop {
            if done(&self.view) {
                self.refresh();
                return Ok(());
            }
            if let Some(p) = self.view.problems.first() {
                return Err(Error::Check(p.clone()));
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout(what.to_string()));
            }
            match self.cluster.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Msg::Event(e)) => self.view.apply(e),
                Ok(Msg::Closed { rank, generation }) => {
                    let r = rank as usize;
                    self.closed[r] = self.closed[r].max(generation);
                    if generation == self.cluster.trainer_generation(r)
                        && self.cluster.trainers[r].is_some()
                    {
                        self.view.ranks[r].running = false;
                        if !self.finishing[r] {
                            let status = self.cluster.wait_trainer(r, Duration::from_secs(10))?;
                            return Err(Error::Exited {
                                what: format!("trainer {rank}"),
                                status: status.to_string(),
                                log: self.cluster.layout.dir.join(format!("trainer-{rank}.log")),
                            });
                        }
                    }
                }
                Err(_) => {}
            }
            if drawn.elapsed() > Duration::from_millis(500) {
                self.refresh();
                drawn = Instant::now();
            }
        }
    }

    pub(crate) fn refresh(&mut self) {
        for i in 0..self.view.metrics.len() {
            self.view.metrics[i] = self.cluster.metrics(i);
        }
        self.view.draw();
    }

    pub(crate) fn ranks(&self) -> usize {
        self.view.ranks.len()
    }

    /// Takes in everything the trainers of ranks `0..n` said, up to their stdout closing: once
    /// they are killed, the view then holds their last words.
    pub(crate) fn drain(&mut self, n: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while (0..n).any(|r| self.closed[r] < self.cluster.trainer_generation(r)) {
            match self.cluster.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Msg::Event(e)) => self.view.apply(e),
                Ok(Msg::Closed { rank, generation }) => {
                    let r = rank as usize;
                    self.closed[r] = self.closed[r].max(generation);
                }
                Err(_) if Instant::now() > deadline => {
                    return Err(Error::Timeout(
                        "the killed trainers' output to close".into(),
                    ));
                }
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// Starts every trainer of a job of [`Cluster::world_size`] ranks (to `until`, or until
    /// killed).
    pub(crate) fn start_trainers(&mut self, until: Option<u64>) -> Result<()> {
        let agreement = self.cluster.next_job_start();
        for r in 0..self.cluster.world_size {
            self.finishing[r] = until.is_some();
            self.cluster.start_trainer(r, until, &agreement)?;
        }
        Ok(())
    }

    pub(crate) fn kill_trainers(&mut self) -> Result<()> {
        for r in 0..self.ranks() {
            self.cluster.kill_trainer(r)?;
            self.view.ranks[r].running = false;
        }
        Ok(())
    }

    /// Waits until every rank has restored after `since`, then records the fault.
    fn recovered(&mut self, fault: &str, since: Instant) -> Result<()> {
        let n = self.ranks();
        self.until(
            &format!("every rank to restore after: {fault}"),
            Duration::from_secs(300),
            |v| {
                v.ranks
                    .iter()
                    .all(|r| r.restores.last().is_some_and(|x| x.at > since))
            },
        )?;
        let restores: Vec<_> = (0..n)
            .map(|r| self.view.ranks[r].restores.last().cloned())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::Check("a rank has no restore".into()))?;
        let step = restores[0].step;
        if let Some(r) = restores.iter().position(|x| x.step != step) {
            return Err(Error::Check(format!(
                "rank {r} resumed from step {} and rank 0 from step {step}",
                restores[r].step
            )));
        }
        let recovery = restores.iter().map(|x| x.at).max().unwrap_or(since) - since;
        let sources: Vec<String> = restores
            .iter()
            .map(|x| describe_sources(&x.sources))
            .collect();
        self.view.say(format!(
            "recovered in {:.1} s: every rank resumed from step {step} ({}); state bit-exact: {}",
            recovery.as_secs_f64(),
            per_rank(&sources),
            if restores.iter().all(|x| x.exact) {
                "yes"
            } else {
                "NO"
            }
        ));
        self.faults.push(FaultReport {
            fault: fault.to_string(),
            recovery_seconds: recovery.as_secs_f64(),
            step,
            sources,
            restore_seconds: restores.iter().map(|x| x.seconds).collect(),
            exact: restores.iter().all(|x| x.exact),
            replayed_steps: 0,
        });
        Ok(())
    }

    /// Trains until every rank has trained again every step it had trained before the last
    /// fault (each loss compared), and records how many there were.
    fn replayed(&mut self, before: &[u64]) -> Result<()> {
        let counted: Vec<u64> = self.view.ranks.iter().map(|r| r.replayed).collect();
        let want = before.to_vec();
        self.until(
            "the steps trained before the fault to be trained again",
            Duration::from_secs(300),
            move |v| v.ranks.iter().zip(&want).all(|(r, &w)| r.step >= w),
        )?;
        let replayed: u64 = self
            .view
            .ranks
            .iter()
            .zip(&counted)
            .map(|(r, c)| r.replayed - c)
            .sum();
        if let Some(f) = self.faults.last_mut() {
            f.replayed_steps = replayed;
        }
        self.view.say(format!(
            "{replayed} steps trained again after the restore (summed over the ranks): every loss \
             equal to the bit"
        ));
        Ok(())
    }

    /// Says `what` starts, starts every node's sidecar, waits until all are ready and starts
    /// every trainer.
    pub(crate) fn start_job(&mut self, what: String) -> Result<()> {
        self.view.say(what);
        for i in 0..self.cluster.layout.nodes {
            self.cluster.start_node(i, false)?;
        }
        self.cluster.wait_ready(Duration::from_secs(120))?;
        self.start_trainers(None)
    }

    /// SIGTERMs every sidecar and checks that each drained and exited cleanly.
    pub(crate) fn stop_sidecars(&mut self) -> Result<()> {
        self.view
            .say("SIGTERM to every sidecar: they drain and exit");
        for (id, status) in self.cluster.stop_nodes(Duration::from_secs(90))? {
            if !status.success() {
                return Err(Error::Check(format!(
                    "sidecar {id} exited with {status} after SIGTERM"
                )));
            }
        }
        Ok(())
    }

    pub(crate) fn steps(&self) -> Vec<u64> {
        self.view.ranks.iter().map(|r| r.step).collect()
    }
}

/// Each rank's sources, in words, on one line.
pub(crate) fn per_rank(sources: &[String]) -> String {
    sources
        .iter()
        .enumerate()
        .map(|(r, s)| format!("rank {r}: {s}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a rank's chunks came from, in words.
pub(crate) fn describe_sources(chunks: &[String]) -> String {
    let mut counts: BTreeMap<usize, (&str, usize)> = BTreeMap::new();
    for c in chunks {
        let order = TIERS.iter().position(|t| t == c).unwrap_or(TIERS.len());
        counts.entry(order).or_insert((c.as_str(), 0)).1 += 1;
    }
    match counts.len() {
        0 => "nothing".into(),
        1 => counts
            .values()
            .next()
            .map_or(String::new(), |(t, _)| t.to_string()),
        _ => counts
            .values()
            .map(|(t, n)| format!("{t} ({n} of {} chunks)", chunks.len()))
            .collect::<Vec<_>>()
            .join(" + "),
    }
}

/// Flips one byte in the middle of `file`; the offset.
fn corrupt(file: &std::path::Path) -> Result<u64> {
    let len = std::fs::metadata(file)
        .map_err(|e| Error::io("stat the file to corrupt", e))?
        .len();
    let at = len / 2;
    flip_byte(file, at)?;
    Ok(at)
}

/// Flips byte `at` of `file` (and makes it durable).
pub(crate) fn flip_byte(file: &std::path::Path, at: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .map_err(|e| Error::io("open the file to corrupt", e))?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at)
        .map_err(|e| Error::io("read", e))?;
    f.write_all_at(&[b[0] ^ 0x5A], at)
        .map_err(|e| Error::io("write", e))?;
    f.sync_all().map_err(|e| Error::io("sync", e))?;
    Ok(())
}

/// Runs the whole demo.
/// Refuses to start when the machine cannot hold the demo, rather than have the kernel kill a
/// sidecar halfway: the sidecars' memory budgets must fit in the memory available now, and the
/// disk tiers plus a local store (two complete steps and one being written, per rank and tier)
/// in the free space of the working directory.
pub(crate) fn preflight(cfg: &DemoConfig, layout: &crate::cluster::Layout) -> Result<()> {
    let n = cfg.nodes as u64;
    let memory = n * layout.memory_budget;
    if let Some(available) = mem_available()
        && available < memory
    {
        return Err(Error::Resources(format!(
            "{} nodes with {} of state each need about {} of memory; {} is available: \
             try a smaller --size",
            n,
            crate::bytes(cfg.state_bytes),
            crate::bytes(memory),
            crate::bytes(available)
        )));
    }
    let tiers = if cfg.store.is_some() { 1 } else { 2 };
    let disk = n * cfg.state_bytes * 3 * tiers;
    std::fs::create_dir_all(&cfg.dir).map_err(|source| Error::Io {
        what: "create the demo directory",
        source,
    })?;
    if let Some(free) = free_bytes(&cfg.dir)
        && free < disk
    {
        return Err(Error::Resources(format!(
            "the disk tiers{} need about {} in {}; {} is free: try a smaller --size or \
             another --dir",
            if tiers == 2 { " and the store" } else { "" },
            crate::bytes(disk),
            cfg.dir.display(),
            crate::bytes(free)
        )));
    }
    Ok(())
}

/// `MemAvailable` of /proc/meminfo, in bytes.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Bytes free to an unprivileged user on the file system of `dir`.
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is NUL-terminated and `st` is writable memory of the struct's size.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    // SAFETY: statvfs filled the struct when it returned 0.
    (rc == 0)
        .then(|| unsafe { st.assume_init() })
        .map(|st| st.f_bavail * st.f_frsize)
}

/// The layout of the demo's cluster for `cfg` (the store a directory under `cfg.dir` unless set).
pub(crate) fn layout(cfg: &DemoConfig) -> crate::cluster::Layout {
    let store = match &cfg.store {
        Some(s) => s.clone(),
        None => cfg.dir.join("store").display().to_string(),
    };
    crate::cluster::Layout {
        exe: cfg.exe.clone(),
        dir: cfg.dir.clone(),
        nodes: cfg.nodes,
        store,
        // The newest committed step of the node's own rank and one being staged, and the same
        // for each of the (at most two) ranks whose replicas the ring places on this node.
        memory_budget: cfg.state_bytes.saturating_mul(6) + (512 << 20),
        job: JOB.into(),
        state_bytes: cfg.state_bytes,
        seed: cfg.seed,
        every: cfg.every,
        grace: Duration::from_secs(60),
        faults: Default::default(),
        trainer: cfg.trainer.clone(),
        elastic: cfg.elastic,
    }
}

pub fn run(cfg: &DemoConfig) -> Result<Summary> {
    let started = Instant::now();
    let n = cfg.nodes;
    let e = cfg.every;
    let layout = layout(cfg);
    let store = layout.store.clone();
    preflight(cfg, &layout)?;
    let mut demo = Demo {
        cluster: Cluster::new(layout)?,
        view: View::new(n, cfg.live),
        faults: Vec::new(),
        every: e,
        finishing: vec![false; n],
        closed: vec![0; n],
    };
    let res = if cfg.elastic {
        crate::elastic::story(&mut demo, cfg)
    } else {
        story(&mut demo, cfg)
    };
    demo.view.finish();
    res?;
    let v = &demo.view;
    let (mut stalls, mut copies, mut queued) = (Vec::new(), Vec::new(), Vec::new());
    let mut first = Vec::new();
    let mut per_tier: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &v.ranks {
        for s in r.saved.values().chain(&r.retired) {
            if s.first {
                first.push(s.stall);
            } else {
                stalls.push(s.stall);
                copies.push(s.stall - s.wait);
                queued.push(s.wait);
            }
            for (t, secs) in &s.done {
                if let Some(tier) = TIERS.iter().find(|x| *x == t) {
                    per_tier.entry(tier).or_default().push(*secs);
                }
            }
        }
    }
    let bytes = v.ranks.first().map_or(0, |r| r.state_bytes);
    let tiers = TIERS
        .iter()
        .filter_map(|t| {
            let s = Spread::of(per_tier.remove(t)?);
            Some(TierFigures {
                tier: t.to_string(),
                bytes_per_second: bytes as f64 / s.median.max(1e-9),
                seconds: s,
            })
        })
        .collect();
    Ok(Summary {
        nodes: n,
        trainer: match cfg.trainer {
            crate::TrainerKind::Rust => "rust",
            crate::TrainerKind::Torch { .. } => "torch",
        }
        .into(),
        state_bytes_per_rank: bytes,
        store,
        dir: cfg.dir.clone(),
        stall_seconds: Spread::of(stalls),
        copy_seconds: Spread::of(copies),
        queued_seconds: Spread::of(queued),
        first_stall_seconds: Spread::of(first),
        copy_floor_seconds: copy_floor(bytes as usize, 1),
        copy_floor_together_seconds: copy_floor(bytes as usize, n),
        tiers,
        faults: demo.faults.clone(),
        problems: v.problems.clone(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The median time of `copiers` parallel copies at once, each of `bytes` bytes into
/// pre-faulted memory of its own over as many threads as an engine copies with by default (the
/// cores, at most 8): one trainer's save alone, or every trainer's at the same step.
fn copy_floor(bytes: usize, copiers: usize) -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 8));
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..copiers)
        .map(|_| (vec![1u8; bytes], vec![2u8; bytes]))
        .collect();
    let piece = bytes.div_ceil(threads).max(1);
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                for (src, dst) in &mut pairs {
                    for (d, from) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                        s.spawn(move || d.copy_from_slice(from));
                    }
                }
            });
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn story(d: &mut Demo, cfg: &DemoConfig) -> Result<()> {
    let n = d.ranks();
    let e = d.every;
    let ready = Duration::from_secs(120);
    let long = Duration::from_secs(600);
    let store = d.cluster.layout.store.clone();
    d.start_job(format!(
        "starting {n} sidecars (hotstart serve; peers over mutual TLS 1.3) and {n} trainers with {} of state each; a checkpoint every {e} steps; store {store}",
        crate::bytes(cfg.state_bytes),
    ))?;

    // Fault 1: a training process dies.
    d.view.say(format!(
        "training; fault 1 comes once step {} is in every sidecar's memory",
        2 * e
    ));
    d.until("step 2E in memory and rank 1 past it", long, |v| {
        v.ranks
            .iter()
            .all(|r| r.newest_in(&["memory"]).is_some_and(|s| s >= 2 * e))
            && v.ranks[1].step >= 2 * e + PAST
    })?;
    let before = d.steps();
    let fault = "kill -9 of the trainer of rank 1";
    d.cluster.kill_trainer(1)?;
    let t = Instant::now();
    d.view.say(format!(
        "FAULT 1: {fault} at step {}; the job restarts",
        before[1]
    ));
    d.kill_trainers()?;
    d.start_trainers(None)?;
    d.recovered(fault, t)?;
    d.replayed(&before)?;

    // Fault 2: a node dies, sidecar and trainer.
    d.view
        .say(format!("fault 2 comes once step {} is on the peers", 4 * e));
    d.until(
        "step 4E replicated to peers and rank 2 past it",
        long,
        |v| {
            v.ranks
                .iter()
                .all(|r| r.newest_in(&["memory", "peer"]).is_some_and(|s| s >= 4 * e))
                && v.ranks[2].step >= 4 * e + PAST
        },
    )?;
    let before = d.steps();
    let fault = "kill -9 of node 2 (sidecar and trainer; its memory and disk are lost)";
    d.cluster.kill_node(2)?;
    d.cluster.kill_trainer(2)?;
    let t = Instant::now();
    d.view.say(format!(
        "FAULT 2: {fault}; a replacement node-2 starts with an empty disk"
    ));
    d.kill_trainers()?;
    d.cluster.start_node(2, true)?;
    d.cluster.wait_ready(ready)?;
    d.view
        .say("node-2 is ready: it pulled its shards back from its peers; the job restarts");
    d.start_trainers(None)?;
    d.recovered(fault, t)?;
    d.replayed(&before)?;

    // Fault 3: a corrupt chunk on disk, found when every node restarts.
    let last = (d.steps().into_iter().max().unwrap_or(0) / e + 2) * e;
    d.view.say(format!(
        "the trainers run to step {last} and stop once it is on disk and in the store"
    ));
    d.kill_trainers()?;
    d.start_trainers(Some(last))?;
    d.until("the last step persisted everywhere", long, |v| {
        v.ranks
            .iter()
            .all(|r| r.newest_in(&["memory", "peer", "disk", "store"]) == Some(last))
    })?;
    for r in 0..n {
        d.cluster.wait_trainer(r, Duration::from_secs(120))?;
    }
    let disk = d.cluster.nodes[0]
        .as_ref()
        .map(|node| node.disk.clone())
        .ok_or_else(|| Error::Check("node 0 is not running".into()))?;
    for i in 0..n {
        d.cluster.kill_node(i)?;
    }
    let file = disk.join(format!("{JOB}/step-{last}/rank-0.safetensors"));
    let at = corrupt(&file)?;
    let fault = "every node killed (no memory survives) and one byte flipped in rank 0's file on node 0's disk";
    let t = Instant::now();
    d.view.say(format!(
        "FAULT 3: every sidecar SIGKILLed; byte {at} of {} flipped; the nodes and the job restart",
        file.display()
    ));
    for i in 0..n {
        d.cluster.start_node(i, false)?;
    }
    d.cluster.wait_ready(ready)?;
    d.start_trainers(Some(last + e))?;
    d.recovered(fault, t)?;

    // Drain.
    d.until("one more checkpoint persisted everywhere", long, |v| {
        v.ranks
            .iter()
            .all(|r| r.newest_in(&["memory", "peer", "disk", "store"]) == Some(last + e))
    })?;
    for r in 0..n {
        d.cluster.wait_trainer(r, Duration::from_secs(120))?;
    }
    d.stop_sidecars()
}
