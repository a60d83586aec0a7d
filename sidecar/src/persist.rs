//! After a commit: persistence to the local disk and the store (the checkpoint library's
//! persistence core of the job and rank, `crate::tiers`), replication to peers, progress events for the
//! training process, and the drain at shutdown.
//!
//! Every committed local shard is *pending* until each of its tiers (peers, disk, store) has
//! finished with it, successfully or not; the pending set is what the replication-lag gauge
//! and the drain look at. Its persistence to disk and store counts as *running* until the
//! retention that follows it (old steps removed from the tiers) is done too: the
//! `hotstart_persist_running_shards` gauge, which tells when the sidecar makes no more requests
//! to the store for what was saved. On SIGTERM the drain waits for the pending set to empty, at most the
//! grace period, and reports every shard still pending, with the tiers it never reached.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{error, info, warn};

use crate::Core;
use crate::memory::{Shard, ShardKey};
use crate::metrics::Failure;
use hotstart_ckpt::tier::TierKind;
use hotstart_proto::wire::{Conn, FdStream, LocalMsg};

/// The writer half of a training process's connection, for progress events.
pub(crate) type Events = Arc<Mutex<Conn<FdStream>>>;

/// What the drain found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Shards persisted to every tier.
    pub finished: usize,
    /// Shards still pending at the deadline, with the tiers that never finished.
    pub not_persisted: Vec<(ShardKey, Vec<TierKind>)>,
    /// Shards a tier failed (a full disk, a store that is down, no peer to hold a replica),
    /// with those tiers: every one newer than the newest step of its job and rank that
    /// reached every tier.
    pub failed: Vec<(ShardKey, Vec<TierKind>)>,
    /// Saves filled by their training process and not yet committed at the deadline.
    pub not_committed: u64,
}

impl DrainReport {
    /// Whether everything finished.
    pub fn complete(&self) -> bool {
        self.not_persisted.is_empty() && self.failed.is_empty() && self.not_committed == 0
    }
}

#[derive(Debug)]
struct Pending {
    committed: Instant,
    tiers: BTreeSet<TierKind>,
}

/// Committed local shards whose tiers have not all finished.
#[derive(Debug, Default)]
pub(crate) struct Inflight {
    pending: Mutex<BTreeMap<ShardKey, Pending>>,
    changed: Condvar,
    finished: Mutex<usize>,
    /// Shards a tier failed, and those tiers, until a newer step of their job and rank
    /// reaches every tier.
    failed: Mutex<BTreeMap<ShardKey, BTreeSet<TierKind>>>,
    /// Shards whose persistence to disk and store, retention included, is still running.
    running: AtomicU64,
    /// Saves owed: filled by their training process (which may then reuse its memory) and
    /// not yet committed and added here. The drain waits for them as for pending shards.
    owed: AtomicU64,
}

/// A filled save that the sidecar owes its training process, counted from `Filled` until it
/// is committed and its persistence registered, or refused.
pub(crate) struct Owed(Arc<Core>);

impl Owed {
    pub(crate) fn new(core: &Arc<Core>) -> Owed {
        core.inflight.owed.fetch_add(1, Ordering::AcqRel);
        Owed(core.clone())
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        let inflight = &self.0.inflight;
        inflight.owed.fetch_sub(1, Ordering::AcqRel);
        // Under the lock: a drain between its check and its wait cannot miss this.
        let _p = inflight.lock();
        inflight.changed.notify_all();
    }
}

/// One shard's persistence to disk and store, counted as running until dropped.
struct Running(Arc<Core>);

impl Running {
    fn start(core: &Arc<Core>) -> Running {
        core.inflight.running.fetch_add(1, Ordering::AcqRel);
        Running(core.clone())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.inflight.running.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Inflight {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ShardKey, Pending>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn add(&self, key: ShardKey, tiers: BTreeSet<TierKind>) {
        if tiers.is_empty() {
            return;
        }
        self.lock().insert(
            key,
            Pending {
                committed: Instant::now(),
                tiers,
            },
        );
    }

    /// `tier` is done with the shard `key`: it holds it (`ok`), or failed.
    fn done(&self, key: &ShardKey, tier: TierKind, ok: bool) {
        let mut p = self.lock();
        let mut failed = self.failed.lock().unwrap_or_else(PoisonError::into_inner);
        if !ok {
            failed.entry(key.clone()).or_default().insert(tier);
        }
        if let Some(e) = p.get_mut(key) {
            e.tiers.remove(&tier);
            if e.tiers.is_empty() {
                p.remove(key);
                if !failed.contains_key(key) {
                    *self.finished.lock().unwrap_or_else(PoisonError::into_inner) += 1;
                    // Every tier holds this step: older failures of its rank no longer matter.
                    failed
                        .retain(|k, _| k.job != key.job || k.rank != key.rank || k.step > key.step);
                }
            }
        }
        drop(failed);
        drop(p);
        self.changed.notify_all();
    }

    /// Shards whose persistence to disk and store (retention included) is still running.
    pub(crate) fn running(&self) -> u64 {
        self.running.load(Ordering::Acquire)
    }

    /// Age of the oldest shard still waiting for its peers, and how many wait.
    pub(crate) fn replication(&self) -> (Duration, u64) {
        let p = self.lock();
        let waiting = p.values().filter(|e| e.tiers.contains(&TierKind::Peer));
        let (mut oldest, mut n) = (Duration::ZERO, 0);
        for e in waiting {
            oldest = oldest.max(e.committed.elapsed());
            n += 1;
        }
        (oldest, n)
    }

    /// Waits until nothing is pending or owed, or `deadline`; what is left.
    pub(crate) fn drain(&self, deadline: Instant) -> DrainReport {
        let mut p = self.lock();
        while !p.is_empty() || self.owed.load(Ordering::Acquire) > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            p = self
                .changed
                .wait_timeout(p, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        DrainReport {
            finished: *self.finished.lock().unwrap_or_else(PoisonError::into_inner),
            not_persisted: p
                .iter()
                .map(|(k, e)| (k.clone(), e.tiers.iter().copied().collect()))
                .collect(),
            failed: self
                .failed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .map(|(k, tiers)| (k.clone(), tiers.iter().copied().collect()))
                .collect(),
            not_committed: self.owed.load(Ordering::Acquire),
        }
    }
}

fn send_event(events: &Option<Events>, tier: TierKind, res: &Result<(), String>) {
    if let Some(ev) = events {
        let msg = LocalMsg::Persisted {
            tier,
            error: res.as_ref().err().cloned(),
        };
        // The training process may be gone; the shard is persisted regardless.
        let _ = ev.lock().unwrap_or_else(PoisonError::into_inner).send(&msg);
    }
}

impl Core {
    /// The tiers a committed local shard goes to after memory.
    pub(crate) fn save_tiers(&self) -> Vec<TierKind> {
        let mut t = vec![TierKind::Memory];
        if self.replicates() {
            t.push(TierKind::Peer);
        }
        t.extend(self.tiers.kinds());
        t
    }

    /// Whether committed shards are copied to peers.
    pub(crate) fn replicates(&self) -> bool {
        self.cfg.replicas > 0 && (!self.cfg.peers.is_empty() || self.cfg.peers_dns.is_some())
    }

    /// Starts everything that follows the commit of a local shard: persistence to disk and
    /// store, replication to peers; each tier's outcome goes to `events` and the metrics.
    /// `asked` is when the segment was asked for.
    pub(crate) fn after_commit(
        self: &Arc<Self>,
        shard: Arc<Shard>,
        events: Option<Events>,
        asked: Instant,
    ) {
        self.pins.pin(&shard);
        let tiers: BTreeSet<TierKind> = self
            .save_tiers()
            .into_iter()
            .filter(|t| *t != TierKind::Memory)
            .collect();
        self.inflight.add(shard.key.clone(), tiers.clone());
        if tiers.contains(&TierKind::Peer) {
            let (core, sh, ev) = (self.clone(), shard.clone(), events.clone());
            let spawned = std::thread::Builder::new()
                .name("hotstart-replicate".into())
                .spawn(move || {
                    let res = core.replicate(&sh);
                    let res = match res {
                        Ok(peers) => {
                            info!(shard = %sh.key, ?peers, "replicated");
                            core.metrics
                                .saved(TierKind::Peer, sh.len(), asked.elapsed());
                            Ok(())
                        }
                        Err(e) => {
                            error!(shard = %sh.key, error = %e, "not replicated");
                            Err(e.to_string())
                        }
                    };
                    send_event(&ev, TierKind::Peer, &res);
                    core.inflight.done(&sh.key, TierKind::Peer, res.is_ok());
                });
            if let Err(e) = spawned {
                error!(shard = %shard.key, error = %e, "cannot start replication");
                send_event(&events, TierKind::Peer, &Err(e.to_string()));
                self.inflight.done(&shard.key, TierKind::Peer, false);
            }
        }
        let own: Vec<TierKind> = tiers
            .iter()
            .copied()
            .filter(|t| *t != TierKind::Peer)
            .collect();
        if own.is_empty() {
            return;
        }
        let running = Running::start(self);
        let fail_all = |why: String| {
            for &t in &own {
                self.metrics.failed(Failure::persist(t));
                send_event(&events, t, &Err(why.clone()));
                self.inflight.done(&shard.key, t, false);
            }
        };
        let k = &shard.key;
        let handle = self
            .tiers
            .rank(&k.job, k.rank, shard.world_size)
            .and_then(|p| {
                p.persist_staged(
                    k.step,
                    shard.seg.clone(),
                    shard.len() as usize,
                    shard.manifest_json.clone().into_bytes(),
                )
            });
        let (handle, persisting) = match handle {
            Ok(h) => h,
            Err(e) => return fail_all(e.to_string()),
        };
        let core = self.clone();
        let spawned = std::thread::Builder::new()
            .name("hotstart-persist-wait".into())
            .spawn(move || {
                let _running = running;
                for t in own {
                    let res = match handle.wait_persisted(t) {
                        Ok(()) => {
                            core.metrics.saved(t, shard.len(), asked.elapsed());
                            Ok(())
                        }
                        Err(e) => {
                            core.metrics.failed(Failure::persist(t));
                            Err(e.to_string())
                        }
                    };
                    send_event(&events, t, &res);
                    core.inflight.done(&shard.key, t, res.is_ok());
                }
                // Retention follows; the shard's persistence runs until it is done.
                if persisting.join().is_err() {
                    error!(shard = %shard.key, "persistence thread panicked");
                }
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start the persist watcher");
        }
    }

    /// Drains: waits for pending persistence and replication up to the grace period, and
    /// reports what never finished.
    pub(crate) fn drain(&self) -> DrainReport {
        let deadline = Instant::now() + self.cfg.grace;
        let (_, waiting) = self.inflight.replication();
        let pending =
            self.inflight.lock().len() as u64 + self.inflight.owed.load(Ordering::Acquire);
        if pending > 0 {
            info!(pending, waiting_for_peers = waiting, grace = ?self.cfg.grace, "draining: waiting for in-flight persistence");
        }
        let report = self.inflight.drain(deadline);
        for (key, tiers) in &report.not_persisted {
            let tiers: Vec<&str> = tiers.iter().map(|t| t.as_str()).collect();
            error!(shard = %key, ?tiers, "not persisted before exit: the grace period ran out");
        }
        for (key, tiers) in &report.failed {
            let tiers: Vec<&str> = tiers.iter().map(|t| t.as_str()).collect();
            error!(shard = %key, ?tiers, "not persisted before exit: these tiers failed it");
        }
        if report.not_committed > 0 {
            error!(
                saves = report.not_committed,
                "filled saves not committed before exit: the grace period ran out"
            );
        }
        if report.complete() {
            info!(
                finished = report.finished,
                "drained: everything committed is persisted"
            );
        }
        report
    }
}
