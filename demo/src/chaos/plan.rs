//! The fault generator: a seed becomes a list of faults, each with the moment it strikes.
//!
//! Everything random in a campaign comes from here, drawn up front from one counter-based
//! generator ([`crate::model::mix`] over the seed and a counter), so a seed always gives the same
//! sequence: the same kinds, targets, windows and moments. Moments are counted in training steps
//! (a number of steps after the job last recovered, plus a few milliseconds), so a fault falls
//! at a random phase of the checkpoint cycle: while a save is staged, committed, replicated or
//! persisted. A fault that restarts processes may also strike *immediately* after the one before
//! it, while the job is still restoring and a replacement node is still recovering.

use std::fmt;

use crate::model::mix;

/// The counter-based generator of a campaign.
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    counter: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { seed, counter: 0 }
    }

    pub fn draw(&mut self) -> u64 {
        self.counter += 1;
        mix(mix(self.seed) ^ self.counter)
    }

    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.draw() % (hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.draw() % den < num
    }
}

/// Which persistent copy a flipped byte lands in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FileTier {
    Disk,
    Store,
}

impl FileTier {
    pub fn name(self) -> &'static str {
        match self {
            FileTier::Disk => "disk",
            FileTier::Store => "store",
        }
    }
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// kill -9 of a trainer; the job restarts (as a launcher restarts every rank).
    KillTrainer { rank: usize },
    /// kill -9 of a node's sidecar and trainer; the replacement keeps the disk or starts with an
    /// empty one (a new machine).
    KillNode { node: usize, lose_disk: bool },
    /// SIGTERM of a node's sidecar (it drains and exits 0) with its trainer killed, as when its
    /// pod is stopped; it starts again on the same disk.
    TermNode { node: usize },
    /// Every sidecar and trainer killed at once (power loss): only disks and the store survive.
    KillAll,
    /// The store tier refuses every request for a window (its directory is replaced by a file).
    StoreOutage { millis: u64 },
    /// One byte flipped in a rank's newest copy of a step in a tier; `pick` chooses the byte.
    FlipByte {
        tier: FileTier,
        rank: usize,
        pick: u64,
    },
    /// A trainer stopped (SIGSTOP) for a window, wherever it was (often mid-stage), then
    /// continued: the other ranks' saves run ahead and its own overlap theirs.
    SlowTrainer { rank: usize, millis: u64 },
    /// The links between node `node` and node `from` (every peer of it when `None`) cut for a
    /// window, then healed: connections stall rather than fail ([`crate::link`]).
    Partition {
        node: usize,
        from: Option<usize>,
        millis: u64,
    },
    /// Node `node`'s disk tier full for a window (a ballast file takes every free byte, again
    /// as the sidecar frees some), then freed.
    DiskFull { node: usize, millis: u64 },
}

/// The kinds, in the order summaries list them.
pub const KINDS: [&str; 10] = [
    "kill -9 trainer",
    "kill -9 node (disk kept)",
    "kill -9 node (disk lost)",
    "SIGTERM sidecar",
    "kill -9 every node",
    "store outage",
    "byte flipped",
    "slow trainer",
    "network partition",
    "full disk",
];

impl Fault {
    /// Its kind, one of [`KINDS`].
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillTrainer { .. } => KINDS[0],
            Fault::KillNode {
                lose_disk: false, ..
            } => KINDS[1],
            Fault::KillNode {
                lose_disk: true, ..
            } => KINDS[2],
            Fault::TermNode { .. } => KINDS[3],
            Fault::KillAll => KINDS[4],
            Fault::StoreOutage { .. } => KINDS[5],
            Fault::FlipByte { .. } => KINDS[6],
            Fault::SlowTrainer { .. } => KINDS[7],
            Fault::Partition { .. } => KINDS[8],
            Fault::DiskFull { .. } => KINDS[9],
        }
    }

    /// Whether the job restarts after it (every trainer restores).
    pub fn restarts(&self) -> bool {
        matches!(
            self,
            Fault::KillTrainer { .. }
                | Fault::KillNode { .. }
                | Fault::TermNode { .. }
                | Fault::KillAll
        )
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::KillTrainer { rank } => write!(f, "kill -9 of trainer {rank}"),
            Fault::KillNode { node, lose_disk } => write!(
                f,
                "kill -9 of node {node} (sidecar and trainer; disk {})",
                if *lose_disk { "lost" } else { "kept" }
            ),
            Fault::TermNode { node } => write!(f, "SIGTERM of node {node}'s sidecar"),
            Fault::KillAll => write!(f, "kill -9 of every node (disks kept)"),
            Fault::StoreOutage { millis } => write!(f, "store unavailable for {millis} ms"),
            Fault::FlipByte { tier, rank, pick } => write!(
                f,
                "a byte flipped in rank {rank}'s newest {} copy (pick {pick:#x})",
                tier.name()
            ),
            Fault::SlowTrainer { rank, millis } => {
                write!(f, "trainer {rank} stopped for {millis} ms")
            }
            Fault::Partition {
                node,
                from: Some(other),
                millis,
            } => write!(f, "node {node} cut off from node {other} for {millis} ms"),
            Fault::Partition {
                node,
                from: None,
                millis,
            } => write!(f, "node {node} cut off from every peer for {millis} ms"),
            Fault::DiskFull { node, millis } => {
                write!(f, "node {node}'s disk tier full for {millis} ms")
            }
        }
    }
}

/// When a fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moment {
    /// Once every rank trained `steps` steps past the last recovery, then `millis` later.
    After { steps: u64, millis: u64 },
    /// At once, while the previous fault's restart is still under way.
    Immediately,
}

impl fmt::Display for Moment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Moment::After { steps, millis } => {
                write!(f, "{steps} steps + {millis} ms after recovery")
            }
            Moment::Immediately => write!(f, "during the previous restart"),
        }
    }
}

/// One fault of a campaign and its moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub moment: Moment,
    pub fault: Fault,
}

/// What the generator may choose from.
#[derive(Debug, Clone, Copy)]
pub struct Scope {
    pub nodes: usize,
    /// Steps between checkpoints.
    pub every: u64,
    /// The store is a local directory (store outages and store flips need one).
    pub local_store: bool,
    /// Each node's disk tier can be filled (a filesystem of its own; mounting one needs root).
    pub disk_full: bool,
}

/// The campaign of `faults` faults for `seed`.
pub fn plan(seed: u64, faults: usize, scope: Scope) -> Vec<Planned> {
    let mut rng = Rng::new(seed);
    let n = scope.nodes as u64;
    let mut out: Vec<Planned> = Vec::with_capacity(faults);
    while out.len() < faults {
        let previous = out.last().map(|p| p.fault.clone());
        // A flipped byte is found when every node restarts and reads its disk: half the time
        // that comes at once.
        if let Some(Fault::FlipByte { .. }) = previous
            && rng.chance(1, 2)
        {
            out.push(Planned {
                moment: Moment::Immediately,
                fault: Fault::KillAll,
            });
            continue;
        }
        let fault = loop {
            let f = match rng.range(0, 99) {
                0..=21 => Fault::KillTrainer {
                    rank: rng.range(0, n - 1) as usize,
                },
                22..=35 => Fault::KillNode {
                    node: rng.range(0, n - 1) as usize,
                    lose_disk: rng.chance(1, 2),
                },
                36..=45 => Fault::TermNode {
                    node: rng.range(0, n - 1) as usize,
                },
                46..=53 => Fault::KillAll,
                54..=65 => Fault::StoreOutage {
                    millis: rng.range(200, 3000),
                },
                66..=83 => Fault::FlipByte {
                    tier: if rng.chance(1, 2) {
                        FileTier::Disk
                    } else {
                        FileTier::Store
                    },
                    rank: rng.range(0, n - 1) as usize,
                    pick: rng.draw(),
                },
                84..=89 => Fault::SlowTrainer {
                    rank: rng.range(0, n - 1) as usize,
                    millis: rng.range(200, 3000),
                },
                90..=94 => {
                    let node = rng.range(0, n - 1);
                    Fault::Partition {
                        node: node as usize,
                        from: (n > 2 && rng.chance(1, 2))
                            .then(|| ((node + rng.range(1, n - 1)) % n) as usize),
                        // Past the sidecars' peer timeout about half the time.
                        millis: rng.range(500, 10_000),
                    }
                }
                _ => Fault::DiskFull {
                    node: rng.range(0, n - 1) as usize,
                    millis: rng.range(500, 8000),
                },
            };
            let needs_store = matches!(
                f,
                Fault::StoreOutage { .. }
                    | Fault::FlipByte {
                        tier: FileTier::Store,
                        ..
                    }
            );
            let needs_mount = matches!(f, Fault::DiskFull { .. });
            if (!needs_store || scope.local_store) && (!needs_mount || scope.disk_full) {
                break f;
            }
        };
        let during_restart =
            previous.as_ref().is_some_and(Fault::restarts) && fault.restarts() && rng.chance(1, 6);
        let moment = if during_restart {
            Moment::Immediately
        } else {
            Moment::After {
                steps: rng.range(1, 3 * scope.every),
                millis: rng.range(0, 150),
            }
        };
        out.push(Planned { moment, fault });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCOPE: Scope = Scope {
        nodes: 3,
        every: 10,
        local_store: true,
        disk_full: true,
    };

    #[test]
    fn a_seed_gives_the_same_campaign() {
        assert_eq!(plan(7, 200, SCOPE), plan(7, 200, SCOPE));
        assert_ne!(plan(7, 50, SCOPE), plan(8, 50, SCOPE));
    }

    #[test]
    fn every_kind_comes_and_targets_exist() {
        let p = plan(1, 2000, SCOPE);
        for kind in KINDS {
            assert!(p.iter().any(|f| f.fault.kind() == kind), "{kind}");
        }
        for f in &p {
            let target = match f.fault {
                Fault::KillTrainer { rank }
                | Fault::FlipByte { rank, .. }
                | Fault::SlowTrainer { rank, .. } => rank,
                Fault::KillNode { node, .. }
                | Fault::TermNode { node }
                | Fault::DiskFull { node, .. } => node,
                Fault::Partition { node, from, .. } => {
                    assert_ne!(from, Some(node), "{}", f.fault);
                    from.unwrap_or(0).max(node)
                }
                _ => 0,
            };
            assert!(target < 3, "{}", f.fault);
            if f.moment == Moment::Immediately {
                assert!(f.fault.restarts(), "{}", f.fault);
            }
        }
    }

    #[test]
    fn a_remote_store_is_never_taken_down_or_flipped() {
        let remote = Scope {
            local_store: false,
            ..SCOPE
        };
        for f in plan(3, 1000, remote) {
            assert!(
                !matches!(
                    f.fault,
                    Fault::StoreOutage { .. }
                        | Fault::FlipByte {
                            tier: FileTier::Store,
                            ..
                        }
                ),
                "{}",
                f.fault
            );
        }
    }

    #[test]
    fn no_disk_is_filled_where_none_can_be_mounted() {
        let unmounted = Scope {
            disk_full: false,
            ..SCOPE
        };
        let p = plan(4, 1000, unmounted);
        assert!(!p.iter().any(|f| matches!(f.fault, Fault::DiskFull { .. })));
        assert!(p.iter().any(|f| matches!(f.fault, Fault::Partition { .. })));
    }
}
