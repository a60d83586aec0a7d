//! Random fault campaigns (`hotstart demo --chaos N --seed S`): the demo's cluster of real
//! sidecars and trainers, and `N` faults drawn from a seed, each at a random moment, with every
//! invariant checked after each fault and at the end.
//!
//! **How a campaign runs.**
//!
//! ```text
//!  seed ──plan──▶ [(moment, fault)] × N        (plan.rs: the same seed, the same sequence)
//!  start every sidecar and trainer
//!  for each (moment, fault):
//!     wait for the last restart's restores; check them         (check.rs: rules 1–3)
//!     wait for the moment (k steps past the last recovery)     ("immediately": mid-restore)
//!     check memory budgets                                     (rule 4)
//!     inject: kill -9 trainer | kill -9 node (disk kept/lost) | SIGTERM sidecar |
//!             kill -9 every node | store outage | flip a byte | stop a trainer |
//!             cut peer links (a partition) | fill a node's disk tier
//!     record which copies the fault destroyed                  (check.rs: Ledger)
//!     restart what the fault stopped (every trainer, as a launcher does), or wait out the
//!     window and for the tier/training to move on again       (rules 5, 6)
//!  finish: train to a last step persisted everywhere, check the sidecars' steady memory, kill
//!  every node, restore that step from disk bit-exact, SIGTERM every sidecar (exit 0)
//! ```
//!
//! Sidecars reach their peers through fault proxies ([`crate::link`]) and run with a short
//! `--peer-timeout`, so a partition longer than it makes them give up on stalled peers; each
//! node's disk tier is a small tmpfs of its own, which a full-disk fault fills (mounting needs
//! root: without it, that kind is not drawn and the summary says so).
//!
//! Every wait has a timeout; a timeout, a trainer that stops on its own, a restored state whose
//! hash differs from the one at save, a replayed loss that differs, an older step restored while
//! a newer complete one survives, or a sidecar over its budget stops the campaign with a
//! [`Violation`], the seed and the history of faults so far. The summary counts faults by kind,
//! restores by the farthest tier they read, recovery times per kind and the checks passed.

pub mod check;
pub mod plan;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

pub use check::{RULES, Violation};
pub use plan::{Fault, FileTier, Moment, Planned};

use crate::cluster::{Cluster, FaultSetup};
use crate::scenario::{Demo, JOB, flip_byte};
use crate::view::{TIERS, View};
use crate::{DemoConfig, Error, Result};
use check::Ledger;
use hotstart_store::tree::rename2;

/// A campaign: the demo's cluster and `faults` faults drawn from `demo.seed`.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub demo: DemoConfig,
    pub faults: usize,
}

/// Recovery times of one kind of fault.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KindFigures {
    pub injected: usize,
    /// Faults whose recovery was measured (one that struck during the previous restart has it
    /// measured by the next).
    pub recovered: usize,
    pub p50_seconds: f64,
    pub p99_seconds: f64,
    pub max_seconds: f64,
}

/// What a campaign did and found.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosSummary {
    pub seed: u64,
    pub nodes: usize,
    pub state_bytes_per_rank: u64,
    pub every: u64,
    pub planned: usize,
    pub injected: usize,
    /// Kind → counts and recovery-time percentiles.
    pub kinds: BTreeMap<String, KindFigures>,
    /// Restores (one per rank) by the farthest tier they read a chunk from; "fresh" when no
    /// step survived.
    pub restores: BTreeMap<String, u64>,
    /// Invariant checks passed, per rule.
    pub checks: BTreeMap<String, u64>,
    /// The first broken invariant (the campaign stops there).
    pub violation: Option<Violation>,
    /// Every fault injected, with its moment and what it hit.
    pub history: Vec<String>,
    /// Kinds this campaign could not draw, and why.
    pub not_drawn: BTreeMap<String, String>,
    pub dir: PathBuf,
    pub seconds: f64,
}

struct Campaign {
    d: Demo,
    ledger: Ledger,
    state_bytes: u64,
    recoveries: BTreeMap<&'static str, Vec<f64>>,
    injected: BTreeMap<&'static str, usize>,
    restores: BTreeMap<String, u64>,
    checks: [u64; 6],
    history: Vec<String>,
    /// A restart whose restores are still to be checked: its fault's kind and when it struck.
    pending: Option<(&'static str, Instant)>,
    /// Per rank, the step it had reached at the last recovery.
    base: Vec<u64>,
    store_dir: Option<PathBuf>,
}

/// Runs a campaign. A broken invariant is not an `Err`: it is the summary's `violation`.
pub fn run(cfg: &ChaosConfig) -> Result<ChaosSummary> {
    let started = Instant::now();
    let mut layout = crate::scenario::layout(&cfg.demo);
    layout.grace = Duration::from_secs(20);
    // Mounting each node's small disk needs root.
    // SAFETY: geteuid has no preconditions.
    let can_mount = unsafe { libc::geteuid() } == 0;
    layout.faults = FaultSetup {
        links: true,
        // Room for the steps the disk tier keeps (2), one being written, and as many again.
        disk_bytes: can_mount.then(|| 8 * cfg.demo.state_bytes + (16 << 20)),
        peer_timeout: Some(PEER_TIMEOUT),
    };
    crate::scenario::preflight(&cfg.demo, &layout)?;
    let n = cfg.demo.nodes;
    let store_dir = cfg.demo.store.is_none().then(|| cfg.demo.dir.join("store"));
    let scope = plan::Scope {
        nodes: n,
        every: cfg.demo.every,
        local_store: store_dir.is_some(),
        disk_full: can_mount,
    };
    let plan = plan::plan(cfg.demo.seed, cfg.faults, scope);
    let mut not_drawn = BTreeMap::new();
    if !scope.local_store {
        for kind in [plan::KINDS[5], "byte flipped (store)"] {
            not_drawn.insert(
                kind.to_string(),
                "the store is not a local directory".to_string(),
            );
        }
    }
    if !scope.disk_full {
        not_drawn.insert(
            plan::KINDS[9].to_string(),
            "each node's disk must be a filesystem of its own, and mounting one needs root"
                .to_string(),
        );
    }
    let mut c = Campaign {
        d: Demo {
            cluster: Cluster::new(layout)?,
            view: View::new(n, cfg.demo.live),
            faults: Vec::new(),
            every: cfg.demo.every,
            finishing: vec![false; n],
            closed: vec![0; n],
        },
        ledger: Ledger::default(),
        state_bytes: cfg.demo.state_bytes,
        recoveries: BTreeMap::new(),
        injected: BTreeMap::new(),
        restores: BTreeMap::new(),
        checks: [0; 6],
        history: Vec::new(),
        pending: None,
        base: vec![0; n],
        store_dir,
    };
    c.d.view.say(format!(
        "chaos campaign: seed {}, {} faults, {n} nodes, {} of state per rank, a checkpoint every {} steps",
        cfg.demo.seed,
        plan.len(),
        crate::bytes(cfg.demo.state_bytes),
        cfg.demo.every
    ));
    let outcome = c.campaign(&plan);
    c.d.view.finish();
    // A store taken down when the campaign stopped is put back, so the directory stays usable.
    let _ = c.store_up();
    // Rule 3: the view compared every loss trained again with the first one.
    c.checks[2] = c.d.view.ranks.iter().map(|r| r.replayed).sum();
    let violation = match outcome {
        Ok(()) => None,
        Err(Broken::Rule(v)) => Some(v),
        Err(Broken::Harness(e)) => Some(Violation::from_error(&e)),
    };
    let kinds = plan::KINDS
        .iter()
        .filter_map(|k| {
            let injected = c.injected.get(k).copied()?;
            let mut times = c.recoveries.remove(k).unwrap_or_default();
            times.sort_by(f64::total_cmp);
            let pct = |p: f64| {
                if times.is_empty() {
                    0.0
                } else {
                    times[((times.len() as f64 * p).ceil() as usize).clamp(1, times.len()) - 1]
                }
            };
            Some((
                k.to_string(),
                KindFigures {
                    injected,
                    recovered: times.len(),
                    p50_seconds: pct(0.5),
                    p99_seconds: pct(0.99),
                    max_seconds: times.last().copied().unwrap_or(0.0),
                },
            ))
        })
        .collect();
    Ok(ChaosSummary {
        seed: cfg.demo.seed,
        nodes: n,
        state_bytes_per_rank: c.d.view.ranks.first().map_or(0, |r| r.state_bytes),
        every: cfg.demo.every,
        planned: plan.len(),
        injected: c.injected.values().sum(),
        kinds,
        restores: c.restores,
        checks: RULES
            .iter()
            .zip(c.checks)
            .map(|(r, n)| (r.to_string(), n))
            .collect(),
        violation,
        history: c.history,
        not_drawn,
        dir: cfg.demo.dir.clone(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Why a campaign stopped early.
enum Broken {
    Rule(Violation),
    Harness(Error),
}

impl From<Error> for Broken {
    fn from(e: Error) -> Broken {
        Broken::Harness(e)
    }
}

impl From<Violation> for Broken {
    fn from(v: Violation) -> Broken {
        Broken::Rule(v)
    }
}

type Step<T = ()> = std::result::Result<T, Broken>;

const READY: Duration = Duration::from_secs(120);
/// The sidecars' `--peer-timeout` in a campaign: partitions last 0.5–10 s, so about half of
/// them outlast it.
const PEER_TIMEOUT: Duration = Duration::from_secs(5);
const LONG: Duration = Duration::from_secs(180);

impl Campaign {
    fn campaign(&mut self, plan: &[Planned]) -> Step {
        let n = self.d.ranks();
        for i in 0..n {
            self.d.cluster.start_node(i, false)?;
        }
        self.d.cluster.wait_ready(READY)?;
        self.d.start_trainers(None)?;
        let e = self.d.every;
        self.d.until("the first checkpoint in memory", LONG, |v| {
            v.ranks
                .iter()
                .all(|r| r.newest_in(&["memory"]).is_some_and(|s| s >= e))
        })?;
        for (i, p) in plan.iter().enumerate() {
            match p.moment {
                Moment::After { steps, millis } => {
                    self.settle()?;
                    let want: Vec<u64> = self.base.iter().map(|b| b + steps).collect();
                    self.d.until(
                        &format!("{steps} steps before fault {}", i + 1),
                        LONG,
                        |v| v.ranks.iter().zip(&want).all(|(r, w)| r.step >= *w),
                    )?;
                    self.pause(Duration::from_millis(millis))?;
                }
                Moment::Immediately => {
                    // The previous restart is superseded: its restores are not awaited.
                    self.pending = None;
                }
            }
            self.memory_checks()?;
            let what = self.inject(&p.fault)?;
            self.history.push(format!(
                "{:>4}. [{:7.1}s] {} ({}){}",
                i + 1,
                self.d.view.elapsed().as_secs_f64(),
                p.fault,
                p.moment,
                what.map(|w| format!(": {w}")).unwrap_or_default()
            ));
            self.d
                .view
                .say(format!("FAULT {}/{}: {}", i + 1, plan.len(), p.fault));
            *self.injected.entry(p.fault.kind()).or_default() += 1;
        }
        self.settle()?;
        self.finish()
    }

    /// Takes in events for `d` (the clock, not a condition).
    fn pause(&mut self, d: Duration) -> Step {
        let end = Instant::now() + d;
        self.d
            .until("a pause", d + Duration::from_secs(5), move |_| {
                Instant::now() >= end
            })?;
        Ok(())
    }

    /// Rule 4 at any moment: refreshes every node's metrics and checks its budget.
    fn memory_checks(&mut self) -> Step {
        self.d.refresh();
        for (i, m) in self.d.view.metrics.iter().enumerate() {
            if let Some(m) = m {
                check::within_budget(i, m)?;
                self.checks[3] += 1;
            }
        }
        Ok(())
    }

    /// Kills every trainer and takes in what they said up to their end, so that every copy they
    /// reported is in the view before a fault is recorded against it.
    fn stop_trainers(&mut self) -> Step {
        self.d.kill_trainers()?;
        let n = self.d.ranks();
        Ok(self.d.drain(n)?)
    }

    /// Restarts the job: every trainer starts again and restores.
    fn restart(&mut self, kind: &'static str, at: Instant) -> Step {
        self.d.start_trainers(None)?;
        self.pending = Some((kind, at));
        Ok(())
    }

    /// Injects `fault`; what it hit, when that is worth saying.
    fn inject(&mut self, fault: &Fault) -> Step<Option<String>> {
        let kind = fault.kind();
        match *fault {
            Fault::KillTrainer { rank } => {
                self.d.cluster.kill_trainer(rank)?;
                let at = Instant::now();
                self.stop_trainers()?;
                self.restart(kind, at)?;
            }
            Fault::KillNode { node, lose_disk } => {
                self.d.cluster.kill_node(node)?;
                self.d.cluster.kill_trainer(node)?;
                let at = Instant::now();
                self.stop_trainers()?;
                self.ledger.lose_memory(&self.d.view, node);
                if lose_disk {
                    self.ledger.lose_disk(&self.d.view, node);
                }
                self.d.cluster.start_node(node, lose_disk)?;
                self.d.cluster.wait_ready(READY)?;
                self.restart(kind, at)?;
            }
            Fault::TermNode { node } => {
                self.d.cluster.kill_trainer(node)?;
                let at = Instant::now();
                let grace = self.d.cluster.layout.grace;
                let status = self
                    .d
                    .cluster
                    .terminate_node(node, grace + Duration::from_secs(30))?;
                if !status.success() {
                    return Err(Violation::new(
                        4,
                        format!("node {node}'s sidecar exited with {status} after SIGTERM"),
                    )
                    .into());
                }
                self.checks[4] += 1;
                self.stop_trainers()?;
                self.ledger.lose_memory(&self.d.view, node);
                self.d.cluster.start_node(node, false)?;
                self.d.cluster.wait_ready(READY)?;
                self.restart(kind, at)?;
            }
            Fault::KillAll => {
                for i in 0..self.d.ranks() {
                    self.d.cluster.kill_node(i)?;
                }
                let at = Instant::now();
                self.stop_trainers()?;
                for i in 0..self.d.ranks() {
                    self.ledger.lose_memory(&self.d.view, i);
                }
                for i in 0..self.d.ranks() {
                    self.d.cluster.start_node(i, false)?;
                }
                self.d.cluster.wait_ready(READY)?;
                self.restart(kind, at)?;
            }
            Fault::StoreOutage { millis } => {
                self.store_down()?;
                self.pause(Duration::from_millis(millis))?;
                self.store_up()?;
                // Rule 6: training went on, and the store takes new steps again.
                self.new_step_in("store", "the store tier to take a new step", kind)?;
            }
            Fault::FlipByte { tier, rank, pick } => return Ok(Some(self.flip(tier, rank, pick)?)),
            Fault::SlowTrainer { rank, millis } => {
                if !self.d.cluster.signal_trainer(rank, libc::SIGSTOP) {
                    return Ok(Some("the trainer was not running".into()));
                }
                let stopped = self.pause(Duration::from_millis(millis));
                self.d.cluster.signal_trainer(rank, libc::SIGCONT);
                stopped?;
                self.new_step_in("memory", "a new step in every rank's memory", kind)?;
            }
            Fault::Partition { node, from, millis } => {
                let others: Vec<usize> = match from {
                    Some(o) => vec![o],
                    None => (0..self.d.ranks()).filter(|&j| j != node).collect(),
                };
                for &o in &others {
                    self.d.cluster.set_cut(node, o, true)?;
                }
                let waited = self.pause(Duration::from_millis(millis));
                for &o in &others {
                    self.d.cluster.set_cut(node, o, false)?;
                }
                waited?;
                // Rule 6: training went on, and replication resumes once the links heal.
                self.new_step_in("peer", "a new step in a peer's memory for every rank", kind)?;
            }
            Fault::DiskFull { node, millis } => {
                let ballast = self.d.cluster.fill_disk(node)?;
                let waited = self.pause(Duration::from_millis(millis));
                drop(ballast);
                waited?;
                self.new_step_in("disk", "the disk tier to take a new step", kind)?;
            }
        }
        Ok(None)
    }

    /// Waits for every rank to have a step newer than the one it had saved in `tier` (training
    /// went on through the fault), then counts the fault of `kind` recovered.
    fn new_step_in(&mut self, tier: &str, what: &str, kind: &'static str) -> Step {
        let at = Instant::now();
        // Steps of a run the job went back from do not count: a rank that went back trains
        // towards them again, and is not newer than them until much later.
        let newest = self.newest_saved(true);
        self.d.until(what, LONG, |v| {
            v.ranks
                .iter()
                .zip(&newest)
                .all(|(r, n)| r.newest_in(&[tier]).is_some_and(|s| s > *n))
        })?;
        self.checks[5] += 1;
        self.recovered(kind, at);
        self.rebase();
        Ok(())
    }

    /// Per rank, the newest step it has saved: in the live run only, or in any run the job
    /// went back from too.
    fn newest_saved(&self, live_only: bool) -> Vec<u64> {
        self.d
            .view
            .ranks
            .iter()
            .map(|r| {
                r.saved
                    .iter()
                    .rev()
                    .find(|(_, s)| !(live_only && s.abandoned))
                    .map_or(0, |(&step, _)| step)
            })
            .collect()
    }

    fn rebase(&mut self) {
        self.base = self.d.view.ranks.iter().map(|r| r.step).collect();
    }

    fn recovered(&mut self, kind: &'static str, at: Instant) {
        self.recoveries
            .entry(kind)
            .or_default()
            .push(at.elapsed().as_secs_f64());
    }

    /// Waits for the pending restart's restores and checks them (rules 1–3).
    fn settle(&mut self) -> Step {
        let Some((kind, at)) = self.pending.take() else {
            return Ok(());
        };
        self.restored_since(at)?;
        self.recoveries.entry(kind).or_default().push(
            self.d
                .view
                .ranks
                .iter()
                .filter_map(|r| {
                    r.restores
                        .last()
                        .map(|x| x.at)
                        .filter(|t| *t > at)
                        .or(r.fresh)
                })
                .max()
                .map_or(0.0, |t| (t - at).as_secs_f64()),
        );
        Ok(())
    }

    /// Waits until every rank restored (or started fresh) after `at` and checks rules 1 and 2.
    fn restored_since(&mut self, at: Instant) -> Step {
        self.d
            .until("every rank to restore after the fault", LONG, |v| {
                v.ranks.iter().all(|r| {
                    r.restores.last().is_some_and(|x| x.at > at) || r.fresh.is_some_and(|f| f > at)
                })
            })?;
        let restored: Vec<Option<u64>> = self
            .d
            .view
            .ranks
            .iter()
            .map(|r| r.restores.last().filter(|x| x.at > at).map(|x| x.step))
            .collect();
        for r in &self.d.view.ranks {
            let tier = match r.restores.last().filter(|x| x.at > at) {
                None => "fresh".to_string(),
                Some(x) => x
                    .sources
                    .iter()
                    .filter_map(|s| TIERS.iter().position(|t| t == s))
                    .max()
                    .map_or("nothing".to_string(), |i| TIERS[i].to_string()),
            };
            *self.restores.entry(tier).or_default() += 1;
        }
        // Rule 1: the view compared every restored hash with the hash at save (a mismatch is
        // a problem, and `until` stops on problems).
        self.checks[0] += restored.iter().flatten().count() as u64;
        let held = self.ledger.newest_held(&self.d.view);
        check::restore_is_newest(&restored, held).map_err(|mut v| {
            if let Some(h) = held {
                v.detail.push_str(&format!(
                    " (copies of step {h} no fault destroyed: {})",
                    self.ledger.surviving(&self.d.view, h)
                ));
            }
            v.detail.push_str(&format!(
                " (restores: {})",
                self.d
                    .view
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(i, r)| format!(
                        "rank {i}: {}",
                        r.restores.last().filter(|x| x.at > at).map_or(
                            "fresh".into(),
                            |x| format!(
                                "step {} from {}",
                                x.step,
                                crate::scenario::describe_sources(&x.sources)
                            )
                        )
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            v
        })?;
        self.checks[1] += 1;
        self.rebase();
        Ok(())
    }

    /// The store directory, when the store is local.
    fn store(&self) -> Result<PathBuf> {
        self.store_dir
            .clone()
            .ok_or_else(|| Error::Protocol("this fault needs a local store".into()))
    }

    /// Takes the store down: a file takes its directory's name, so every request fails
    /// (ENOTDIR) until [`Campaign::store_up`]. The two swap names in one step: at no moment is
    /// the name free for a sidecar's write to make a new directory there.
    fn store_down(&mut self) -> Result<()> {
        let dir = self.store()?;
        let away = dir.with_extension("away");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create the store", e))?;
        std::fs::write(&away, b"the store is down\n")
            .map_err(|e| Error::io("make the store's stand-in", e))?;
        rename2(&dir, &away, true).map_err(|e| Error::io("take the store down", e))
    }

    fn store_up(&mut self) -> Result<()> {
        let dir = self.store()?;
        let away = dir.with_extension("away");
        if away.is_dir() {
            rename2(&away, &dir, true).map_err(|e| Error::io("put the store back", e))?;
            std::fs::remove_file(&away).map_err(|e| Error::io("remove the store's stand-in", e))?;
        }
        Ok(())
    }

    /// Flips one byte of rank `rank`'s newest step in `tier` that is there; what it hit.
    fn flip(&mut self, tier: FileTier, rank: usize, pick: u64) -> Step<String> {
        let root = match tier {
            FileTier::Disk => match self.d.cluster.nodes[rank].as_ref() {
                Some(node) => node.disk.clone(),
                None => return Ok("the node is down".into()),
            },
            FileTier::Store => self.store()?,
        };
        let steps: Vec<u64> = self.d.view.ranks[rank]
            .saved
            .iter()
            .rev()
            .filter(|(_, s)| s.done.contains_key(tier.name()))
            .map(|(&s, _)| s)
            .collect();
        for step in steps {
            let file = root.join(format!("{JOB}/step-{step}/rank-{rank}.safetensors"));
            let Ok(len) = std::fs::metadata(&file).map(|m| m.len()) else {
                continue;
            };
            if len == 0 {
                continue;
            }
            let at = pick % len;
            flip_byte(&file, at)?;
            self.ledger.spoil(rank, step, tier.name());
            return Ok(format!("byte {at} of {}", file.display()));
        }
        Ok("no copy there yet".into())
    }

    /// The end: every rank trains to a last step persisted everywhere; the sidecars' memory is
    /// checked at rest; every node is killed and the job restores that step from disk; SIGTERM
    /// drains every sidecar.
    fn finish(&mut self) -> Step {
        let e = self.d.every;
        let n = self.d.ranks();
        self.stop_trainers()?;
        // Past every step any rank has saved, in any run the job went back from: the check below
        // asks for this step to be the newest with every tier done.
        let saved = self.newest_saved(false);
        let newest = self.d.steps().into_iter().chain(saved).max().unwrap_or(0);
        let last = (newest / e + 2) * e;
        self.d.view.say(format!(
            "the campaign is over: the job trains to step {last}, persisted everywhere"
        ));
        let at = Instant::now();
        self.d.start_trainers(Some(last))?;
        self.restored_since(at)?;
        self.d
            .until("the last step persisted everywhere", LONG, |v| {
                v.ranks
                    .iter()
                    .all(|r| r.newest_in(&["memory", "peer", "disk", "store"]) == Some(last))
            })?;
        for r in 0..n {
            self.d.cluster.wait_trainer(r, LONG)?;
        }
        self.checks[5] += 1;
        // Rule 4 at rest: persistence has drained (no shard still persisting).
        self.d.until("persistence to drain", LONG, |v| {
            v.metrics
                .iter()
                .flatten()
                .all(|m| m.get("hotstart_persist_running_shards") == 0.0)
        })?;
        self.memory_checks()?;
        let segment = self.state_bytes + (1 << 20);
        for i in 0..n {
            if let Some(m) = self.d.view.metrics[i].clone() {
                let resident = check::Resident::of(&m, self.d.cluster.node_pid(i));
                self.d.view.say(format!(
                    "node {i} at rest: {} shards in {} segments, {}",
                    resident.shards,
                    resident.segments,
                    crate::bytes(resident.used_bytes as u64)
                ));
                check::steady(i, &resident, 1, segment)?;
                self.checks[3] += 1;
            }
        }
        // Every node lost at once: the last step comes back from disk, bit-exact.
        for i in 0..n {
            self.d.cluster.kill_node(i)?;
            self.ledger.lose_memory(&self.d.view, i);
        }
        for i in 0..n {
            self.d.cluster.start_node(i, false)?;
        }
        self.d.cluster.wait_ready(READY)?;
        let at = Instant::now();
        self.d.start_trainers(Some(last))?;
        self.restored_since(at)?;
        let steps: Vec<Option<u64>> = self
            .d
            .view
            .ranks
            .iter()
            .map(|r| r.restores.last().map(|x| x.step))
            .collect();
        if steps.iter().any(|s| *s != Some(last)) {
            return Err(Violation::new(
                0,
                format!("step {last}, persisted everywhere, came back as {steps:?}"),
            )
            .into());
        }
        for r in 0..n {
            self.d.cluster.wait_trainer(r, LONG)?;
        }
        self.d
            .view
            .say("SIGTERM to every sidecar: they drain and exit");
        for (id, status) in self
            .d
            .cluster
            .stop_nodes(self.d.cluster.layout.grace + LONG)?
        {
            if !status.success() {
                return Err(Violation::new(
                    4,
                    format!("sidecar {id} exited with {status} after SIGTERM"),
                )
                .into());
            }
            self.checks[4] += 1;
        }
        Ok(())
    }
}

/// The summary as text, for people.
pub fn table(s: &ChaosSummary) -> String {
    let mut out = String::new();
    let mut line = |l: String| {
        out.push_str(&l);
        out.push('\n');
    };
    line(format!(
        "hotstart chaos: seed {}, {} of {} faults injected, {} nodes, {} of state per rank, a checkpoint every {} steps, {:.0} s",
        s.seed,
        s.injected,
        s.planned,
        s.nodes,
        crate::bytes(s.state_bytes_per_rank),
        s.every,
        s.seconds
    ));
    line(String::new());
    line(format!(
        "{:<26} {:>8} {:>10} {:>12} {:>12} {:>12}",
        "fault", "injected", "recovered", "p50", "p99", "max"
    ));
    for (k, f) in &s.kinds {
        line(format!(
            "{:<26} {:>8} {:>10} {:>10.2} s {:>10.2} s {:>10.2} s",
            k, f.injected, f.recovered, f.p50_seconds, f.p99_seconds, f.max_seconds
        ));
    }
    line("(recovery: restarts, from the fault to every rank's state restored; store outage, full disk and partition, from the store's return, the disk freed or the links healed to a newer step in that tier for every rank; slow trainer, from its continuing to a newer step in every rank's memory; a fault whose restart the next fault struck at once has no recovery of its own, hence recovered < injected: the next one's covers both)".into());
    for (k, why) in &s.not_drawn {
        line(format!("not drawn: {k} ({why})"));
    }
    line(String::new());
    line(format!(
        "restores by the farthest tier read: {}",
        s.restores
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    line("invariant checks passed:".into());
    for (r, n) in &s.checks {
        line(format!("  {n:>6}  {r}"));
    }
    match &s.violation {
        None => line("violations: none".into()),
        Some(v) => {
            line(String::new());
            line(format!(
                "VIOLATION of rule {}",
                RULES[v.rule.min(RULES.len() - 1)]
            ));
            line(format!("  {}", v.detail));
            line(format!(
                "  seed {} (replay: hotstart demo --chaos {} --seed {})",
                s.seed, s.planned, s.seed
            ));
            line("  faults so far:".into());
            for h in &s.history {
                line(format!("  {h}"));
            }
        }
    }
    out
}
