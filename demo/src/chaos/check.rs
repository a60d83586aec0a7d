//! The campaign's checker: which copies of each checkpoint survive the faults so far, and the
//! invariants a restore, the sidecars' memory and the processes must keep.
//!
//! **Copies.** The trainers report every tier that committed a step ([`View`] keeps them per
//! rank and step). The [`Ledger`] adds what the faults destroyed: a sidecar killed or stopped
//! takes its memory tier with it, and with it every replica it held for other ranks (which peer
//! holds a replica is the ring's choice, so a replica counts as lost when *any* other node went
//! down after it was reported); a node replaced with an empty disk takes that disk's copies;
//! a flipped byte spoils that tier's copy of that rank's step. A step is *held* when every rank
//! has at least one reported copy of it that no fault destroyed. Retention and recycling only
//! ever drop a step once a newer one is complete, or once the job went back to an older step
//! and saved again (the abandoned run's steps count no more from the restore on: see
//! [`crate::view::Saved::abandoned`]), so the newest held step is always reachable;
//! the store counts only when the nodes hold no complete step, as the sidecar lists the store
//! only then ([`Ledger::newest_held`]).
//!
//! **Invariants** (numbered as in the campaign's summary):
//! 1. a restored state is bit-exact (blake3 equal to the hash at save) and a restore never fails
//!    while a copy survives;
//! 2. every rank restores the same step, and it is at least the newest held step (never an
//!    older one while a newer complete one is reachable);
//! 3. steps trained again after a restore give the same losses, bit for bit;
//! 4. a sidecar never holds more than its budget (`hotstart_memory_peak_bytes`), and once saves
//!    drain it holds nothing but committed shards and a segment prepared per local rank: no
//!    segment or byte left behind by a fault, whatever the campaign did (the tier keeps older
//!    steps while its budget allows, as docs/SEMANTICS.md says);
//! 5. nothing hangs: every wait ends within its timeout, and a SIGTERMed sidecar drains and
//!    exits 0;
//! 6. a failed persist or replication never stops training: no trainer exits on its own, and
//!    the store tier takes new steps again once it is back.

use std::collections::BTreeSet;

use crate::cluster::Metrics;
use crate::view::{TIERS, View};

/// The invariants, as the summary names them.
pub const RULES: [&str; 6] = [
    "1. every persisted step is restorable bit-exact while a copy survives",
    "2. a restore returns the newest complete reachable step",
    "3. steps trained again reproduce the recorded losses bit for bit",
    "4. memory budgets hold and memory returns to a steady size",
    "5. no hangs: every wait ends within its timeout",
    "6. failed persists never stop training",
];

/// A broken invariant.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Violation {
    /// Index into [`RULES`].
    pub rule: usize,
    pub detail: String,
}

impl Violation {
    pub fn new(rule: usize, detail: impl Into<String>) -> Violation {
        Violation {
            rule,
            detail: detail.into(),
        }
    }

    /// The violation for an error the harness met (a timeout, a process that exited, a
    /// problem the view found).
    pub fn from_error(e: &crate::Error) -> Violation {
        use crate::Error;
        match e {
            Error::Timeout(_) => Violation::new(4, e.to_string()),
            Error::Exited { what, .. } if what.starts_with("trainer") => {
                Violation::new(5, format!("{e} (a trainer stopped on its own)"))
            }
            Error::Check(p) if p.contains("trained again") => Violation::new(2, p.clone()),
            Error::Check(p) => Violation::new(0, p.clone()),
            other => Violation::new(4, format!("the campaign could not go on: {other}")),
        }
    }
}

/// Copies destroyed by faults.
#[derive(Debug, Default)]
pub struct Ledger {
    /// (rank, step, tier)
    lost: BTreeSet<(usize, u64, &'static str)>,
}

impl Ledger {
    /// Node `node`'s sidecar is gone: its memory tier, and every replica it may have held.
    pub fn lose_memory(&mut self, view: &View, node: usize) {
        for (r, rank) in view.ranks.iter().enumerate() {
            for (&step, saved) in &rank.saved {
                if r == node && saved.done.contains_key("memory") {
                    self.lost.insert((r, step, "memory"));
                }
                if r != node && saved.done.contains_key("peer") {
                    self.lost.insert((r, step, "peer"));
                }
            }
        }
    }

    /// Node `node` starts again with an empty disk.
    pub fn lose_disk(&mut self, view: &View, node: usize) {
        if let Some(rank) = view.ranks.get(node) {
            for (&step, saved) in &rank.saved {
                if saved.done.contains_key("disk") {
                    self.lost.insert((node, step, "disk"));
                }
            }
        }
    }

    /// One tier's copy of one rank's step is spoilt.
    pub fn spoil(&mut self, rank: usize, step: u64, tier: &'static str) {
        self.lost.insert((rank, step, tier));
    }

    /// Whether rank `rank` has a surviving copy of `step` in `tier`. Retention is modelled as
    /// the nodes run it: a disk tier holds only its own rank's files, so it keeps the newest
    /// [`KEEP`] steps of that rank whatever the other ranks did; the store keeps the newest
    /// [`KEEP`] steps complete in it and every step newer than those.
    fn holds(&self, view: &View, rank: usize, step: u64, tier: &'static str) -> bool {
        let done = |r: usize, s: u64| view.ranks[r].saved.get(&s).is_some_and(|x| x.in_tier(tier));
        if !done(rank, step) || self.lost.contains(&(rank, step, tier)) {
            return false;
        }
        let newer = view.ranks[rank].saved.range(step + 1..).map(|(s, _)| *s);
        match tier {
            "disk" => newer.filter(|s| done(rank, *s)).count() < KEEP,
            "store" => {
                newer
                    .filter(|s| (0..view.ranks.len()).all(|r| done(r, *s)))
                    .count()
                    < KEEP
            }
            _ => true,
        }
    }

    /// Per rank, the tiers whose reported copy of `step` survives, in words.
    pub fn surviving(&self, view: &View, step: u64) -> String {
        (0..view.ranks.len())
            .map(|r| {
                let tiers: Vec<&str> = TIERS
                    .iter()
                    .copied()
                    .filter(|t| self.holds(view, r, step, t))
                    .collect();
                format!("rank {r}: {}", tiers.join("+"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The newest step every rank still holds a copy of in one of `tiers`.
    fn newest_in(&self, view: &View, tiers: &[&'static str]) -> Option<u64> {
        let first = view.ranks.first()?;
        first.saved.keys().rev().copied().find(|&s| {
            (0..view.ranks.len()).all(|r| tiers.iter().any(|t| self.holds(view, r, s, t)))
        })
    }

    /// The step a restore must return at least: the newest step every rank holds in the
    /// nodes' memory and disks. That is the sidecar's rule (docs/SEMANTICS.md, the sidecar's
    /// tenet 5): it lists the store only when the nodes hold no complete step, so that a store
    /// that is down cannot stall a restart. A newer step whose only copy of some rank is in the
    /// store is passed over for an older one complete in memory or on disk. The ledger's view
    /// of the nodes is conservative (a replica counts as lost when any peer went down), so it
    /// cannot tell that the nodes hold nothing, and sets no bound from the store.
    pub fn newest_held(&self, view: &View) -> Option<u64> {
        self.newest_in(view, &["memory", "peer", "disk"])
    }
}

/// Complete steps the disk and store tiers keep (the sidecar's default `--keep`).
pub const KEEP: usize = 2;

/// Invariant 2 for a restart: every rank `restored` (None: started fresh) the same step, and
/// no older than `held`.
pub fn restore_is_newest(restored: &[Option<u64>], held: Option<u64>) -> Result<(), Violation> {
    if let Some(r) = restored.iter().position(|s| *s != restored[0]) {
        return Err(Violation::new(
            1,
            format!(
                "ranks resumed from different steps: rank 0 from {:?}, rank {r} from {:?}",
                restored[0], restored[r]
            ),
        ));
    }
    if let Some(h) = held
        && restored[0].is_none_or(|s| s < h)
    {
        return Err(Violation::new(
            1,
            format!(
                "the job resumed from {} while step {h} was complete in a reachable tier",
                restored[0].map_or("scratch".to_string(), |s| format!("step {s}"))
            ),
        ));
    }
    Ok(())
}

/// Invariant 4 at any moment: no sidecar ever held more than its budget.
pub fn within_budget(node: usize, m: &Metrics) -> Result<(), Violation> {
    let budget = m.get("hotstart_memory_budget_bytes");
    let peak = m.get("hotstart_memory_peak_bytes");
    let used = m.get("hotstart_memory_used_bytes");
    if budget > 0.0 && (peak > budget || used > budget) {
        return Err(Violation::new(
            3,
            format!(
                "node {node} held {peak} bytes at its peak ({used} now), over its budget of {budget}"
            ),
        ));
    }
    Ok(())
}

/// What a sidecar holds once saves have drained.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Resident {
    pub used_bytes: f64,
    pub peak_bytes: f64,
    pub budget: f64,
    pub shards: f64,
    /// Shared-memory segments the process has open (memfds among its descriptors).
    pub segments: usize,
}

impl Resident {
    pub fn of(m: &Metrics, pid: Option<u32>) -> Resident {
        Resident {
            used_bytes: m.get("hotstart_memory_used_bytes"),
            peak_bytes: m.get("hotstart_memory_peak_bytes"),
            budget: m.get("hotstart_memory_budget_bytes"),
            shards: m.get("hotstart_memory_shards{origin=\"local\"}")
                + m.get("hotstart_memory_shards{origin=\"replica\"}"),
            segments: pid.map_or(0, memfds),
        }
    }
}

/// Shared-memory segments (memfds) process `pid` holds open.
pub fn memfds(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    dir.flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"))
        })
        .count()
}

/// Invariant 4 once saves drained. The memory tier keeps what its budget holds (older steps
/// stay as restore points until memory is wanted), so steady means: within the budget, at its
/// peak too, and nothing held but committed shards and a segment prepared per local rank (no
/// segment, and no byte, left behind by the faults).
pub fn steady(
    node: usize,
    r: &Resident,
    local_ranks: usize,
    segment_bytes: u64,
) -> Result<(), Violation> {
    let max_segments = r.shards as usize + local_ranks + 1;
    let max_bytes = (r.shards + local_ranks as f64 + 1.0) * segment_bytes as f64;
    if r.used_bytes > r.budget
        || r.peak_bytes > r.budget
        || r.segments > max_segments
        || r.used_bytes > max_bytes
    {
        return Err(Violation::new(
            3,
            format!(
                "node {node} holds {} bytes (peak {}, budget {}) in {} segments for {} shards once \
                 saves drained; steady is within the budget, with at most {max_segments} segments \
                 and {max_bytes} bytes",
                r.used_bytes, r.peak_bytes, r.budget, r.segments, r.shards
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Event;

    fn persisted(view: &mut View, rank: u32, step: u64, tier: &str) {
        view.apply(Event::Persisted {
            rank,
            step,
            tier: tier.into(),
            seconds: 0.1,
            error: None,
        });
    }

    #[test]
    fn a_step_is_held_while_every_rank_keeps_a_copy() {
        let mut v = View::new(2, false);
        for r in 0..2 {
            persisted(&mut v, r, 10, "memory");
            persisted(&mut v, r, 10, "disk");
            persisted(&mut v, r, 20, "memory");
            persisted(&mut v, r, 20, "peer");
        }
        let mut l = Ledger::default();
        assert_eq!(l.newest_held(&v), Some(20));
        // A newer step only rank 1 holds nowhere but in the store does not count while the
        // nodes hold a complete one.
        persisted(&mut v, 0, 30, "memory");
        persisted(&mut v, 1, 30, "store");
        assert_eq!(l.newest_held(&v), Some(20));
        // Node 0 lost: rank 0's memory copy and rank 1's replica (wherever it was) are gone;
        // rank 0's replica of 20 on node 1 survives.
        l.lose_memory(&v, 0);
        assert_eq!(l.newest_held(&v), Some(20));
        // Then node 1 too: step 20 is gone everywhere, step 10 survives on disk.
        l.lose_memory(&v, 1);
        assert_eq!(l.newest_held(&v), Some(10));
        l.spoil(1, 10, "disk");
        assert_eq!(l.newest_held(&v), None);
        // A disk keeps its rank's newest two steps, whatever the other ranks did.
        let mut w = View::new(2, false);
        for s in [10, 20, 30] {
            persisted(&mut w, 0, s, "disk");
        }
        persisted(&mut w, 1, 10, "disk");
        assert_eq!(Ledger::default().newest_held(&w), None);
    }

    /// Finding of seed 3 (`hotstart demo --chaos 15 --seed 3`, on a loaded machine): the job
    /// went back to an older step and saved again, which rightly removed the abandoned run's
    /// newer steps, while the ledger still counted them as held on disk and in the store.
    #[test]
    fn steps_the_job_went_back_past_count_no_more_until_saved_again() {
        let mut v = View::new(2, false);
        let save = |v: &mut View, r: u32, s: u64| {
            v.apply(Event::Saved {
                rank: r,
                step: s,
                stall_seconds: 0.0,
                wait_seconds: 0.0,
                hash: format!("h{s}"),
            });
            persisted(v, r, s, "disk");
            persisted(v, r, s, "store");
        };
        for r in 0..2 {
            for s in [10, 20, 30] {
                save(&mut v, r, s);
            }
        }
        let l = Ledger::default();
        assert_eq!(l.newest_held(&v), Some(30));
        // Rank 0 restores 10 (its newer copies were lost, say); rank 1 too.
        for r in 0..2 {
            v.apply(Event::Restored {
                rank: r,
                step: 10,
                sources: vec!["store".into()],
                seconds: 0.1,
                hash: "h10".into(),
            });
        }
        assert!(v.problems.is_empty(), "{:?}", v.problems);
        assert_eq!(l.newest_held(&v), Some(10));
        assert_eq!(v.ranks[0].newest_in(&["disk"]), Some(10));
        let restore = |v: &mut View, s: u64, from: &str| {
            for r in 0..2 {
                v.apply(Event::Restored {
                    rank: r,
                    step: s,
                    sources: vec![from.into()],
                    seconds: 0.1,
                    hash: format!("h{s}"),
                });
            }
        };
        // Killed again before any save: nothing was removed, and a restore may find step 30
        // again, which is held again from then on.
        restore(&mut v, 30, "disk");
        assert!(v.ranks[0].saved[&30].in_tier("disk"));
        assert_eq!(l.newest_held(&v), Some(30));
        // Back to 10 once more, then saved again: step 20 counts anew, from this save's own
        // reports only.
        restore(&mut v, 10, "store");
        for r in 0..2 {
            v.apply(Event::Saved {
                rank: r,
                step: 20,
                stall_seconds: 0.0,
                wait_seconds: 0.0,
                hash: "h20".into(),
            });
        }
        assert_eq!(l.newest_held(&v), Some(10));
        for r in 0..2 {
            persisted(&mut v, r, 20, "disk");
        }
        assert_eq!(l.newest_held(&v), Some(20));
        assert!(!v.ranks[0].saved[&20].in_tier("store"));
        assert!(v.problems.is_empty(), "{:?}", v.problems);
    }

    #[test]
    fn restores_older_than_the_newest_held_step_break_rule_2() {
        assert!(restore_is_newest(&[Some(20), Some(20)], Some(20)).is_ok());
        assert!(restore_is_newest(&[Some(30), Some(30)], Some(20)).is_ok());
        assert!(restore_is_newest(&[None, None], None).is_ok());
        assert_eq!(
            restore_is_newest(&[Some(10), Some(10)], Some(20))
                .unwrap_err()
                .rule,
            1
        );
        assert_eq!(
            restore_is_newest(&[None, None], Some(20)).unwrap_err().rule,
            1
        );
        assert_eq!(
            restore_is_newest(&[Some(20), Some(10)], None)
                .unwrap_err()
                .rule,
            1
        );
    }

    #[test]
    fn budget_and_steady_size() {
        let m = Metrics::parse(
            "hotstart_memory_budget_bytes 100\nhotstart_memory_peak_bytes 101\nhotstart_memory_used_bytes 50\n",
        );
        assert_eq!(within_budget(0, &m).unwrap_err().rule, 3);
        let r = Resident {
            used_bytes: 50.0,
            peak_bytes: 90.0,
            budget: 100.0,
            shards: 4.0,
            segments: 5,
        };
        assert!(steady(0, &r, 1, 10).is_ok());
        // A segment that is neither a shard nor a prepared one: left behind.
        let leaked = Resident { segments: 7, ..r };
        assert_eq!(steady(0, &leaked, 1, 10).unwrap_err().rule, 3);
        // Bytes beyond what the shards and a prepared segment take.
        let grown = Resident {
            used_bytes: 70.0,
            ..r
        };
        assert_eq!(steady(0, &grown, 1, 10).unwrap_err().rule, 3);
        let over = Resident {
            peak_bytes: 101.0,
            ..r
        };
        assert_eq!(steady(0, &over, 1, 10).unwrap_err().rule, 3);
    }
}
