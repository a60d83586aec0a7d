//! The elastic story (`hotstart demo --elastic`): a node is lost and no replacement comes, so
//! the job goes on with fewer ranks; later a replacement joins and it grows back.
//!
//! The trainers hold one embedding table of the whole job, its rows split among the ranks
//! ([`crate::shard`]). With `E` steps between checkpoints and `N` nodes:
//!
//! 1. **Train.** Every sidecar and `N` trainers start; they train from scratch, checkpointing
//!    every `E` steps (each step in the sidecar's memory, replicated to a peer, on disk and in
//!    the store).
//! 2. **A node lost for good.** Once step `2E` is on the peers and every rank is past it, node
//!    `N-1` (sidecar and trainer) is SIGKILLed and not replaced. As an elastic launcher does,
//!    the other trainers are stopped and the job starts again with `N-1` ranks. Each loads the
//!    rows it now holds, as byte ranges of the old ranks' checkpoints, from the survivors'
//!    memory (its own node's, or a peer's: the lost rank's replicas). The demo checks that the
//!    job's digest after the reshard equals the digest the `N` ranks saved, that no chunk came
//!    from disk or store, and that the steps trained again give the same job-wide losses.
//! 3. **The job grows back.** Once the smaller job's next checkpoint is on the peers, a
//!    replacement node `N-1` starts with an empty disk and the job restarts with `N` ranks,
//!    resharding again from memory; the same checks.
//! 4. **Drain.** Once a newer checkpoint is on every tier the trainers stop; SIGTERM drains the
//!    sidecars.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::scenario::{Demo, FaultReport, PAST, describe_sources, per_rank};
use crate::view::View;
use crate::{DemoConfig, Error, Result};

/// Per step that every rank of `0..world` saved: the job's state digest (the sum of the
/// ranks' parts). A step a rank saved without reporting it (killed between the two) is left
/// out.
fn saved_digests(view: &View, world: usize) -> BTreeMap<u64, u128> {
    job_sums(view, world, |r| {
        r.saved
            .iter()
            .filter_map(|(&step, s)| Some((step, crate::shard::parse(&s.hash)?)))
            .collect()
    })
}

/// Per step that every rank of `0..world` trained: the job's loss digest.
fn loss_digests(view: &View, world: usize) -> BTreeMap<u64, u128> {
    job_sums(view, world, |r| r.loss_digests.clone())
}

fn job_sums(
    view: &View,
    world: usize,
    part: impl Fn(&crate::view::Rank) -> BTreeMap<u64, u128>,
) -> BTreeMap<u64, u128> {
    let parts: Vec<_> = view.ranks[..world].iter().map(part).collect();
    let Some((first, rest)) = parts.split_first() else {
        return BTreeMap::new();
    };
    first
        .iter()
        .filter_map(|(&step, &d)| {
            rest.iter()
                .try_fold(d, |sum, p| Some(sum.wrapping_add(*p.get(&step)?)))
                .map(|sum| (step, sum))
        })
        .collect()
}

impl Demo {
    /// Restarts the job with `world` ranks after `fault` (at `since`), checks its reshard
    /// against what the job of `from` ranks saved and trained, and records it.
    fn reshard(&mut self, fault: &str, since: Instant, from: usize, world: usize) -> Result<()> {
        self.kill_trainers()?;
        self.drain(from)?;
        let saved = saved_digests(&self.view, from);
        let losses = loss_digests(&self.view, from);
        self.cluster.world_size = world;
        self.start_trainers(None)?;
        self.until(
            &format!("every rank of {world} to reshard after: {fault}"),
            Duration::from_secs(300),
            |v| {
                v.ranks[..world]
                    .iter()
                    .all(|r| r.reshards.last().is_some_and(|(x, _)| x.at > since))
            },
        )?;
        let reshards: Vec<_> = (0..world)
            .filter_map(|r| self.view.ranks[r].reshards.last().cloned())
            .collect();
        let step = reshards[0].0.step;
        if let Some(r) = reshards.iter().position(|(x, _)| x.step != step) {
            return Err(Error::Check(format!(
                "rank {r} resharded step {} and rank 0 step {step}",
                reshards[r].0.step
            )));
        }
        let digest = reshards
            .iter()
            .fold(0u128, |sum, (_, d)| sum.wrapping_add(*d));
        let Some(&want) = saved.get(&step) else {
            return Err(Error::Check(format!(
                "step {step} was resharded, but not every one of the {from} ranks reported \
                 saving it: nothing to compare with"
            )));
        };
        let exact = digest == want;
        if !exact {
            self.view.problems.push(format!(
                "the job's state resharded from step {step} onto {world} ranks has digest \
                 {} and the {from} ranks saved {}",
                crate::shard::hex(digest),
                crate::shard::hex(want)
            ));
        }
        let recovery = reshards.iter().map(|(x, _)| x.at).max().unwrap_or(since) - since;
        let sources: Vec<String> = reshards
            .iter()
            .map(|(x, _)| describe_sources(&x.sources))
            .collect();
        self.view.say(format!(
            "resharded in {:.1} s: {world} ranks resumed from step {step} of {from} ({}); the job's digest equal to the one saved: {}",
            recovery.as_secs_f64(),
            per_rank(&sources),
            if exact { "yes" } else { "NO" }
        ));
        self.faults.push(FaultReport {
            fault: fault.to_string(),
            recovery_seconds: recovery.as_secs_f64(),
            step,
            sources,
            restore_seconds: reshards.iter().map(|(x, _)| x.seconds).collect(),
            exact,
            replayed_steps: 0,
        });

        // The steps the bigger job trained past the step, trained again: the same losses.
        let last = losses.keys().next_back().copied().unwrap_or(step);
        self.until(
            "the steps trained before the reshard to be trained again",
            Duration::from_secs(300),
            |v| v.ranks[..world].iter().all(|r| r.step >= last),
        )?;
        let again = loss_digests(&self.view, world);
        let mut replayed = 0;
        for s in step + 1..=last {
            match (losses.get(&s), again.get(&s)) {
                (Some(before), Some(now)) if before == now => replayed += 1,
                (Some(_), Some(_)) => self.view.problems.push(format!(
                    "step {s} trained again by {world} ranks has other losses than by {from}"
                )),
                _ => self.view.problems.push(format!(
                    "step {s}: not every rank of {from} and of {world} reported its losses"
                )),
            }
        }
        if let Some(f) = self.faults.last_mut() {
            f.replayed_steps = replayed;
        }
        self.view.say(format!(
            "{replayed} steps trained again by {world} ranks: the job's losses equal to the bit"
        ));
        Ok(())
    }
}

/// Waits until every rank of `0..world` has a step newer than `after` on the peers and is
/// `PAST` steps beyond it.
fn until_replicated(d: &mut Demo, world: usize, after: u64) -> Result<()> {
    d.until(
        "a newer step on the peers and every rank past it",
        Duration::from_secs(600),
        move |v| {
            let newest = v.ranks[..world]
                .iter()
                .map(|r| r.newest_in(&["memory", "peer"]).unwrap_or(0))
                .min()
                .unwrap_or(0);
            newest > after && v.ranks[..world].iter().all(|r| r.step >= newest + PAST)
        },
    )
}

pub(crate) fn story(d: &mut Demo, cfg: &DemoConfig) -> Result<()> {
    let n = d.ranks();
    let e = d.every;
    let lost = n - 1;
    let store = d.cluster.layout.store.clone();
    d.start_job(format!(
        "starting {n} sidecars (hotstart serve; peers over mutual TLS 1.3) and {n} trainers, one embedding table split among them ({} of state each); a checkpoint every {e} steps; store {store}",
        crate::bytes(cfg.state_bytes),
    ))?;

    d.view.say(format!(
        "training; node-{lost} is lost once step {} is on the peers",
        2 * e
    ));
    until_replicated(d, n, 2 * e - 1)?;
    let fault = format!(
        "kill -9 of node {lost} (sidecar and trainer), not replaced: the job goes on with {} ranks",
        n - 1
    );
    d.cluster.kill_node(lost)?;
    d.cluster.kill_trainer(lost)?;
    let t = Instant::now();
    d.view.say(format!(
        "FAULT: {fault}; each rank loads the rows it now holds from the survivors' memory"
    ));
    d.reshard(&fault, t, n, n - 1)?;

    let step = d.faults.last().map_or(0, |f| f.step);
    d.view.say(format!(
        "training on {} ranks; a replacement node-{lost} joins once a newer step is on the peers",
        n - 1
    ));
    until_replicated(d, n - 1, step)?;
    d.cluster.start_node(lost, true)?;
    d.cluster.wait_ready(Duration::from_secs(120))?;
    let t = Instant::now();
    let fault = format!("a replacement node {lost} joins: the job grows back to {n} ranks");
    d.view.say(format!(
        "{fault}; each rank loads its rows from the cluster's memory"
    ));
    d.reshard(&fault, t, n - 1, n)?;

    let step = d.faults.last().map_or(0, |f| f.step);
    d.view
        .say("training on; the demo ends once a newer step is on every tier");
    d.until(
        "a newer step persisted everywhere",
        Duration::from_secs(600),
        |v| {
            v.ranks.iter().all(|r| {
                r.newest_in(&["memory", "peer", "disk", "store"])
                    .is_some_and(|s| s > step)
            })
        },
    )?;
    d.kill_trainers()?;
    d.stop_sidecars()
}
