//! What the demo knows, from the trainers' events and the sidecars' metrics, and how it shows
//! it: a live block of lines on a terminal (one per node and per rank, under the current
//! phase), plain log lines otherwise.
//!
//! It also checks as events arrive: a restored state's hash must equal the hash the rank
//! reported when it saved that step, and a loss of a step trained again after a restore must
//! have the same bits as the first time that step was trained.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cluster::Metrics;
use crate::event::Event;

/// The tiers in the order a restore tries them.
pub const TIERS: [&str; 4] = ["memory", "peer", "disk", "store"];

/// One checkpoint of one rank.
#[derive(Debug, Default, Clone)]
pub struct Saved {
    pub hash: String,
    pub stall: f64,
    /// Of `stall`, the time before the copy began (see [`Event::Saved`]).
    pub wait: f64,
    /// Tier → seconds from the save's start to that tier holding it.
    pub done: BTreeMap<String, f64>,
    /// Tier → error.
    pub failed: BTreeMap<String, String>,
    /// The job went back to an older step after this one was saved: the rank's next save
    /// removes it (docs/SEMANTICS.md, retention), so none of its copies counts any more, until
    /// it is saved again.
    pub abandoned: bool,
    /// The first save of its trainer process: its engine had no segment prepared yet and
    /// mapped memory new to it (the other saves take the one prepared after the last commit).
    pub first: bool,
}

impl Saved {
    /// Whether `tier` holds this step (reported there, and not abandoned since).
    pub fn in_tier(&self, tier: &str) -> bool {
        !self.abandoned && self.done.contains_key(tier)
    }
}

/// One restore of one rank.
#[derive(Debug, Clone)]
pub struct Restore {
    pub step: u64,
    /// The tier of each chunk.
    pub sources: Vec<String>,
    pub seconds: f64,
    /// When the demo heard of it.
    pub at: Instant,
    /// The hash equals the one reported when the step was saved.
    pub exact: bool,
}

/// Everything about one rank.
#[derive(Debug, Default)]
pub struct Rank {
    pub step: u64,
    pub loss: f32,
    pub state_bytes: u64,
    pub running: bool,
    /// Step → loss bits, as first trained.
    pub losses: BTreeMap<u64, u32>,
    pub saved: BTreeMap<u64, Saved>,
    pub restores: Vec<Restore>,
    /// When the rank last started with no checkpoint to restore.
    pub fresh: Option<Instant>,
    /// Losses of steps trained again after a restore, compared with the first time.
    pub replayed: u64,
    /// The rank's trainer process has saved since it started.
    pub saved_since_start: bool,
    /// Saves of the rows this rank held before its last reshard (kept for the stall figures).
    pub retired: Vec<Saved>,
    /// With `--elastic`: step → this rank's part of the job's loss digest, since its last
    /// reshard.
    pub loss_digests: BTreeMap<u64, u128>,
    /// With `--elastic`: the rank's reshards, each with its part of the job's state digest.
    pub reshards: Vec<(Restore, u128)>,
}

impl Rank {
    /// The newest step saved with every tier in `tiers` done.
    pub fn newest_in(&self, tiers: &[&str]) -> Option<u64> {
        self.saved
            .iter()
            .rev()
            .find(|(_, s)| tiers.iter().all(|t| s.in_tier(t)))
            .map(|(&step, _)| step)
    }
}

/// The demo's view of the job.
pub struct View {
    pub ranks: Vec<Rank>,
    /// Problems found: wrong restored state, replayed losses that differ, failed tiers.
    pub problems: Vec<String>,
    pub metrics: Vec<Option<Metrics>>,
    lines: Option<Lines>,
    started: Instant,
}

/// The live block on a terminal.
struct Lines {
    _multi: MultiProgress,
    phase: ProgressBar,
    nodes: Vec<ProgressBar>,
    ranks: Vec<ProgressBar>,
}

fn gib(bytes: f64) -> String {
    format!("{:.2} GiB", bytes / (1u64 << 30) as f64)
}

impl View {
    /// A view of `ranks` ranks; live lines when `live` and stderr is a terminal.
    pub fn new(ranks: usize, live: bool) -> View {
        let lines = (live && std::io::stderr().is_terminal()).then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(8));
            let style = ProgressStyle::with_template("{prefix:>8} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner());
            let bar = |prefix: String| {
                let b = multi.add(ProgressBar::new_spinner());
                b.set_style(style.clone());
                b.set_prefix(prefix);
                b
            };
            Lines {
                phase: bar("demo".into()),
                nodes: (0..ranks).map(|i| bar(format!("node-{i}"))).collect(),
                ranks: (0..ranks).map(|r| bar(format!("rank {r}"))).collect(),
                _multi: multi,
            }
        });
        View {
            ranks: (0..ranks).map(|_| Rank::default()).collect(),
            problems: Vec::new(),
            metrics: vec![None; ranks],
            lines,
            started: Instant::now(),
        }
    }

    /// A line of the demo's story: the phase line on a terminal (and printed above the live
    /// block), a log line otherwise.
    pub fn say(&self, text: impl AsRef<str>) {
        let t = self.started.elapsed().as_secs_f64();
        let line = format!("[{t:7.1}s] {}", text.as_ref());
        match &self.lines {
            Some(l) => {
                l.phase.println(&line);
                l.phase.set_message(text.as_ref().to_string());
            }
            None => eprintln!("{line}"),
        }
    }

    /// Takes one trainer event into account.
    pub fn apply(&mut self, event: Event) {
        let r = event.rank() as usize;
        let Some(rank) = self.ranks.get_mut(r) else {
            return;
        };
        match event {
            Event::Started { state_bytes, .. } => {
                rank.state_bytes = state_bytes;
                rank.running = true;
                rank.saved_since_start = false;
            }
            Event::Fresh { .. } => {
                rank.step = 0;
                rank.fresh = Some(Instant::now());
                for saved in rank.saved.values_mut() {
                    saved.abandoned = true;
                }
            }
            Event::Restored {
                step,
                sources,
                seconds,
                hash,
                ..
            } => {
                let saved = rank.saved.entry(step).or_default();
                // Restored, so not removed: a run that went back past it saved nothing since.
                saved.abandoned = false;
                // A trainer killed right after its save was staged never reported the state's
                // hash, yet the sidecar keeps the step (it survives from `wait_staged` on). Its
                // first restore sets the hash: the losses of the steps trained again from it
                // must then equal the first run's (a wrong state would not give them), and every
                // later restore of the step must give this hash.
                if saved.hash.is_empty() {
                    saved.hash = hash.clone();
                }
                let exact = saved.hash == hash;
                if !exact {
                    self.problems.push(format!(
                        "rank {r}: the state restored from step {step} differs from the state saved ({hash} restored, {} saved)",
                        saved.hash
                    ));
                }
                for (_, newer) in rank.saved.range_mut(step + 1..) {
                    newer.abandoned = true;
                }
                rank.step = step;
                rank.restores.push(Restore {
                    step,
                    sources,
                    seconds,
                    at: Instant::now(),
                    exact,
                });
            }
            Event::Resharded {
                step,
                sources,
                seconds,
                hash,
                ..
            } => {
                // The rank now holds other rows: its earlier saves and losses were of those.
                rank.retired
                    .extend(std::mem::take(&mut rank.saved).into_values());
                rank.losses.clear();
                rank.loss_digests.clear();
                rank.step = step;
                let digest = crate::shard::parse(&hash).unwrap_or_else(|| {
                    self.problems
                        .push(format!("rank {r}: a reshard's digest is not one: {hash:?}"));
                    0
                });
                // Whether it is exact is for the job as a whole: the sum of every rank's part.
                let restore = Restore {
                    step,
                    sources,
                    seconds,
                    at: Instant::now(),
                    exact: false,
                };
                rank.reshards.push((restore, digest));
            }
            Event::Step {
                step,
                loss_bits,
                loss_digest,
                ..
            } => {
                if let Some(d) = loss_digest.as_deref() {
                    match crate::shard::parse(d) {
                        Some(d) => {
                            rank.loss_digests.insert(step, d);
                        }
                        None => self
                            .problems
                            .push(format!("rank {r}: a loss digest is not one: {d:?}")),
                    }
                }
                rank.step = step;
                rank.loss = f32::from_bits(loss_bits);
                match rank.losses.get(&step) {
                    Some(&first) if first == loss_bits => rank.replayed += 1,
                    Some(&first) => self.problems.push(format!(
                        "rank {r}: step {step} trained again after a restore has loss {} instead of {}",
                        f32::from_bits(loss_bits),
                        f32::from_bits(first)
                    )),
                    None => {
                        rank.losses.insert(step, loss_bits);
                    }
                }
            }
            Event::Saved {
                step,
                stall_seconds,
                wait_seconds,
                hash,
                ..
            } => {
                let saved = rank.saved.entry(step).or_default();
                // A step saved again after a restore holds the same state.
                if !saved.hash.is_empty() && saved.hash != hash {
                    self.problems.push(format!(
                        "rank {r}: step {step} saved again with a different state"
                    ));
                }
                if saved.abandoned {
                    // The copies of the abandoned run's save are gone or going; this save's
                    // tiers report anew.
                    *saved = Saved::default();
                }
                saved.hash = hash;
                saved.stall = stall_seconds;
                saved.wait = wait_seconds;
                saved.first = !rank.saved_since_start;
                rank.saved_since_start = true;
            }
            Event::Persisted {
                step,
                tier,
                seconds,
                error,
                ..
            } => {
                let saved = rank.saved.entry(step).or_default();
                match error {
                    None => {
                        saved.done.insert(tier, seconds);
                    }
                    Some(e) => {
                        saved.failed.insert(tier, e);
                    }
                }
            }
        }
    }

    /// Redraws the live block (no-op without a terminal).
    pub fn draw(&self) {
        let Some(l) = &self.lines else { return };
        for (i, bar) in l.nodes.iter().enumerate() {
            bar.set_message(match &self.metrics[i] {
                None => "down".to_string(),
                Some(m) => {
                    let state = ["starting", "recovering", "ready", "draining"]
                        .into_iter()
                        .find(|s| m.get(&format!("hotstart_sidecar_state{{state=\"{s}\"}}")) == 1.0)
                        .unwrap_or("?");
                    format!(
                        "{state:<10} memory {} of {} (own {}, replicas {})  replication lag {:.1} s  peers up {}",
                        gib(m.get("hotstart_memory_used_bytes")),
                        gib(m.get("hotstart_memory_budget_bytes")),
                        gib(m.get("hotstart_memory_shard_bytes{origin=\"local\"}")),
                        gib(m.get("hotstart_memory_shard_bytes{origin=\"replica\"}")),
                        m.get("hotstart_replication_lag_seconds"),
                        m.get("hotstart_peers{state=\"up\"}"),
                    )
                }
            });
        }
        for (r, bar) in l.ranks.iter().enumerate() {
            let rank = &self.ranks[r];
            let last = rank.saved.iter().next_back().map(|(step, s)| {
                let tiers: Vec<String> = TIERS
                    .iter()
                    .map(|t| {
                        let mark = if s.done.contains_key(*t) {
                            "✓"
                        } else if s.failed.contains_key(*t) {
                            "✗"
                        } else {
                            "…"
                        };
                        format!("{t} {mark}")
                    })
                    .collect();
                format!(
                    "checkpoint {step} ({} ms stall): {}",
                    (s.stall * 1e3).round(),
                    tiers.join("  ")
                )
            });
            bar.set_message(format!(
                "step {:>6}  loss {:.4}  {}",
                rank.step,
                rank.loss,
                last.unwrap_or_default()
            ));
        }
    }

    /// Clears the live block.
    pub fn finish(&self) {
        if let Some(l) = &self.lines {
            l.phase.finish_and_clear();
            for b in l.nodes.iter().chain(&l.ranks) {
                b.finish_and_clear();
            }
        }
    }

    /// Time since the demo began.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}
