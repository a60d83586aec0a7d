//! Node recovery: a starting sidecar pulls the shards its peers hold for it before it reports
//! ready.
//!
//! A replacement node has the lost node's id, so every replica the lost node pushed names it as
//! origin. While `recovering`, the sidecar asks every peer for its inventory, keeps the shards
//! whose origin is this node, and fetches, for every (job, rank), the newest step any peer
//! holds (verified as it arrives, like every fetch). It is done once every known peer has
//! answered and every fetch has been tried, or when the recovery timeout runs out (peers that
//! never answered are logged; their shards are then found at restore time, or on disk or in the
//! store). A first start, with nothing on any peer, is done as soon as the peers answer. A
//! SIGTERM while recovering ends it at once: the sidecar then drains and exits, not waiting for
//! peers that are not there.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::Core;
use crate::lifecycle::State;
use crate::members::Member;
use crate::memory::ShardKey;
use crate::metrics::Failure;
use crate::wire::Held;

/// What recovery did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Shards pulled back into memory.
    pub shards: usize,
    pub bytes: u64,
    /// Peers that never answered before the deadline.
    pub unreachable: Vec<String>,
}

impl Core {
    /// Pulls this node's shards back from its peers; see the module docs.
    pub(crate) fn recover(&self) -> RecoveryReport {
        let deadline = Instant::now() + self.cfg.recovery_timeout;
        let mut report = RecoveryReport::default();
        let mut answered: Vec<String> = Vec::new();
        let mut tried: Vec<ShardKey> = Vec::new();
        loop {
            if self.life.get() == State::Draining {
                info!("recovery stopped: the sidecar is shutting down");
                break;
            }
            self.probe();
            let members = self.members.up();
            // Newest step held for this node per (job, rank), and who holds it.
            let mut wanted: BTreeMap<(String, u32), (ShardKey, Vec<Member>)> = BTreeMap::new();
            for m in &members {
                let held = match self.connect(m).and_then(|mut c| c.inventory(None)) {
                    Ok(h) => h,
                    Err(e) => {
                        warn!(peer = %m.id.node, error = %e, "no inventory from a peer");
                        continue;
                    }
                };
                if !answered.contains(&m.id.node) {
                    answered.push(m.id.node.clone());
                }
                for s in held
                    .into_iter()
                    .filter(|s| s.held == Held::Memory && s.origin == self.me.node)
                {
                    let key = ShardKey {
                        job: s.job,
                        rank: s.rank,
                        step: s.step,
                    };
                    let e = wanted
                        .entry((key.job.clone(), key.rank))
                        .or_insert_with(|| (key.clone(), Vec::new()));
                    if key.step > e.0.step {
                        *e = (key, vec![m.clone()]);
                    } else if key.step == e.0.step {
                        e.1.push(m.clone());
                    }
                }
            }
            for (key, holders) in wanted.into_values() {
                if tried.contains(&key) || self.memory.get(&key).is_some() {
                    continue;
                }
                tried.push(key.clone());
                match self.fetch_from_peers(&key, &holders, None) {
                    Some((shard, from, _)) => {
                        info!(shard = %key, peer = %from, bytes = shard.len(), "recovered from a peer");
                        self.metrics.recovered(shard.len());
                        report.shards += 1;
                        report.bytes += shard.len();
                        self.memory.insert(shard);
                    }
                    None => {
                        self.metrics.failed(Failure::Recovery);
                        warn!(shard = %key, "could not recover a shard from any peer holding it");
                    }
                }
            }
            if self.all_answered(&answered) {
                break;
            }
            if Instant::now() >= deadline {
                report.unreachable = self
                    .members
                    .snapshot()
                    .into_iter()
                    .map(|m| m.id.node)
                    .filter(|n| !answered.contains(n))
                    .collect();
                warn!(unreachable = ?report.unreachable, "recovery timed out; ready without these peers");
                break;
            }
            std::thread::sleep(
                Duration::from_millis(500).min(deadline.saturating_duration_since(Instant::now())),
            );
        }
        info!(
            shards = report.shards,
            bytes = report.bytes,
            "recovery done"
        );
        report
    }
}
