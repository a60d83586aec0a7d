//! The sidecar's metrics: every name is a constant here (and listed in `docs/METRICS.md`);
//! counters and histograms are plain atomics, gauges are read when `/metrics` is rendered.
//! Names follow `hotstart_<what>_<unit>` in base units; counters end in `_total`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hotstart_store::wrap::{Counter, Op};

use crate::lifecycle::State;
use crate::memory::MemoryStats;
use hotstart_ckpt::cuda::SharedCopy;
use hotstart_ckpt::tier::TierKind;

/// Gauge, 1 for the current lifecycle state (label `state`), 0 for the others.
pub const SIDECAR_STATE: &str = "hotstart_sidecar_state";
/// Gauge: the memory budget.
pub const MEMORY_BUDGET_BYTES: &str = "hotstart_memory_budget_bytes";
/// Gauge: shared memory charged to the budget now (every segment the sidecar holds).
pub const MEMORY_USED_BYTES: &str = "hotstart_memory_used_bytes";
/// Gauge: the most shared memory ever charged at once.
pub const MEMORY_PEAK_BYTES: &str = "hotstart_memory_peak_bytes";
/// Gauge: bytes of committed shards in memory, by `origin` (`local`, `replica`).
pub const MEMORY_SHARD_BYTES: &str = "hotstart_memory_shard_bytes";
/// Gauge: committed shards in memory, by `origin`.
pub const MEMORY_SHARDS: &str = "hotstart_memory_shards";
/// Counter: shards evicted from memory.
pub const EVICTIONS_TOTAL: &str = "hotstart_evictions_total";
/// Counter: bytes evicted from memory.
pub const EVICTED_BYTES_TOTAL: &str = "hotstart_evicted_bytes_total";
/// Counter: segments created for training processes to stage into.
pub const SEGMENTS_CREATED_TOTAL: &str = "hotstart_memory_segments_created_total";
/// Counter: segments of older steps staged into again.
pub const SEGMENTS_RECYCLED_TOTAL: &str = "hotstart_memory_segments_recycled_total";
/// Counter: bytes persisted or replicated, by `tier` (`peer`, `disk`, `store`).
pub const PERSISTED_BYTES_TOTAL: &str = "hotstart_persisted_bytes_total";
/// Histogram: seconds from a training process asking for a segment to a tier holding the
/// step, by `tier` (`memory`: staged and committed; `peer`, `disk`, `store`).
pub const SAVE_DURATION_SECONDS: &str = "hotstart_save_duration_seconds";
/// Counter: restores served, by `source` tier.
pub const RESTORES_TOTAL: &str = "hotstart_restores_total";
/// Histogram: seconds the sidecar took to serve a restore, by `source`.
pub const RESTORE_DURATION_SECONDS: &str = "hotstart_restore_duration_seconds";
/// Gauge: seconds since the oldest committed local shard that is not yet on its peers was
/// committed (0 when every one is).
pub const REPLICATION_LAG_SECONDS: &str = "hotstart_replication_lag_seconds";
/// Gauge: committed local shards waiting for replication.
pub const REPLICATION_PENDING_SHARDS: &str = "hotstart_replication_pending_shards";
/// Gauge: committed local shards whose persistence to disk and store, and the retention that
/// follows it, is still running.
pub const PERSIST_RUNNING_SHARDS: &str = "hotstart_persist_running_shards";
/// Counter: shards a starting node pulled back from its peers.
pub const RECOVERED_SHARDS_TOTAL: &str = "hotstart_recovered_shards_total";
/// Counter: bytes a starting node pulled back from its peers.
pub const RECOVERED_BYTES_TOTAL: &str = "hotstart_recovered_bytes_total";
/// Counter: restores into a process's device tensors the sidecar was asked to copy itself, by
/// `result` (`copied`: from its memory pinned for the GPU; `refused`: the process copied).
pub const GPU_UPLOADS_TOTAL: &str = "hotstart_gpu_uploads_total";
/// Counter: bytes the sidecar copied into processes' device tensors.
pub const GPU_UPLOAD_BYTES_TOTAL: &str = "hotstart_gpu_upload_bytes_total";
/// Counter: seconds of the copies into processes' device tensors, by `phase` (`open`: the IPC
/// handles; `copy`: issuing the copies and waiting for what opening and closing did not hide;
/// `close`: the handles again). The phases add up to the copies' time.
pub const GPU_UPLOAD_SECONDS_TOTAL: &str = "hotstart_gpu_upload_seconds_total";
/// Counter: processes' device allocations opened from IPC handles for those copies.
pub const GPU_UPLOAD_HANDLES_TOTAL: &str = "hotstart_gpu_upload_handles_total";
/// Counter: steps in memory the sidecar registered as pinned memory for the GPU, by `result`
/// (`pinned`, `failed`).
pub const GPU_PINS_TOTAL: &str = "hotstart_gpu_pins_total";
/// Counter: seconds spent registering steps as pinned memory.
pub const GPU_PIN_SECONDS_TOTAL: &str = "hotstart_gpu_pin_seconds_total";
/// Gauge: bytes of steps in memory pinned for the GPU now.
pub const GPU_PINNED_BYTES: &str = "hotstart_gpu_pinned_bytes";
/// Gauge: committed steps waiting for the pinning thread.
pub const GPU_PIN_WAITING_STEPS: &str = "hotstart_gpu_pin_waiting_steps";
/// Gauge: peers by `state` (`up`: answered the last probe; `down`).
pub const PEERS: &str = "hotstart_peers";
/// Counter: failures by `kind` (see [`Failure`]).
pub const FAILURES_TOTAL: &str = "hotstart_failures_total";
/// Counter: requests the sidecar made to the object store, by `op`.
pub const STORE_REQUESTS_TOTAL: &str = "hotstart_store_requests_total";
/// Counter: payload bytes to and from the object store, by `op`.
pub const STORE_BYTES_TOTAL: &str = "hotstart_store_bytes_total";

/// Counter: bytes of shared pieces this node's processes received, by `artifact` and `source`
/// (`cache`: this sidecar had it; `peer`; `store`: this sidecar read it).
pub const SHARE_BYTES_TOTAL: &str = "hotstart_share_bytes_total";
/// Counter: bytes of shared pieces this sidecar sent to peers, by `artifact`.
pub const SHARE_SERVED_BYTES_TOTAL: &str = "hotstart_share_served_bytes_total";
/// Gauge: bytes of shared pieces kept in memory (charged to the memory budget, and given back
/// before any shard is evicted).
pub const SHARE_CACHE_BYTES: &str = "hotstart_share_cache_bytes";
/// Counter: pieces a peer did not provide, by `peer` and `kind` (`corrupt`: a frame did not
/// match its id, and the peer is avoided; `error`: unreachable, refused or timed out).
pub const SHARE_PEER_FAILURES_TOTAL: &str = "hotstart_share_peer_failures_total";
/// Counter: ranges of checkpoint chunks from peers kept (and so passed on), by `when`
/// (`on_arrival`: checked against the chunk's parts' values verified beforehand;
/// `with_chunk`: once every range of the chunk was in).
pub const SHARE_RANGES_KEPT_TOTAL: &str = "hotstart_share_ranges_kept_total";

/// What failed, as the `kind` label of [`FAILURES_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A connection whose authentication failed.
    Auth,
    /// A connection dropped for breaking the protocol (bad frame, bad length, bad tag).
    Frame,
    /// A shard whose bytes do not match its checksums (pushed, fetched or committed).
    Checksum,
    /// A request refused for want of memory.
    Budget,
    /// Persisting to the disk tier.
    PersistDisk,
    /// Persisting to the store tier.
    PersistStore,
    /// Replicating a shard to a peer.
    Replicate,
    /// Serving a restore.
    Restore,
    /// Pulling shards back from peers at start.
    Recovery,
    /// A peer that could not be reached or answered with an error.
    Peer,
}

impl Failure {
    const ALL: [Failure; 10] = [
        Failure::Auth,
        Failure::Frame,
        Failure::Checksum,
        Failure::Budget,
        Failure::PersistDisk,
        Failure::PersistStore,
        Failure::Replicate,
        Failure::Restore,
        Failure::Recovery,
        Failure::Peer,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Auth => "auth",
            Failure::Frame => "frame",
            Failure::Checksum => "checksum",
            Failure::Budget => "budget",
            Failure::PersistDisk => "persist_disk",
            Failure::PersistStore => "persist_store",
            Failure::Replicate => "replicate",
            Failure::Restore => "restore",
            Failure::Recovery => "recovery",
            Failure::Peer => "peer",
        }
    }

    /// The persist failure of a tier.
    pub fn persist(tier: TierKind) -> Failure {
        match tier {
            TierKind::Disk => Failure::PersistDisk,
            TierKind::Store => Failure::PersistStore,
            TierKind::Memory | TierKind::Peer => Failure::Replicate,
        }
    }
}

/// Bucket bounds (seconds) of every duration histogram.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

#[derive(Debug, Default)]
struct Histogram {
    /// Per bucket (not cumulative), plus one for +Inf.
    counts: [AtomicU64; BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|&b| s <= b)
            .unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(
            d.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    fn render(&self, out: &mut String, name: &str, label: &str, value: &str) {
        let mut cumulative = 0;
        for (i, b) in BUCKETS
            .iter()
            .map(|b| b.to_string())
            .chain(["+Inf".into()])
            .enumerate()
        {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{label}=\"{value}\",le=\"{b}\"}} {cumulative}"
            );
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{{{label}=\"{value}\"}} {sum}");
        let _ = writeln!(out, "{name}_count{{{label}=\"{value}\"}} {cumulative}");
    }
}

fn tier_index(t: TierKind) -> usize {
    TierKind::ALL.iter().position(|&k| k == t).unwrap_or(0)
}

/// Counters and histograms of one sidecar.
#[derive(Debug, Default)]
pub struct Metrics {
    restores: [AtomicU64; 4],
    restore_seconds: [Histogram; 4],
    save_seconds: [Histogram; 4],
    persisted_bytes: [AtomicU64; 4],
    failures: [AtomicU64; Failure::ALL.len()],
    recovered_shards: AtomicU64,
    recovered_bytes: AtomicU64,
    /// Uploads copied and refused; the bytes copied, the handles opened, and the microseconds
    /// opening, copying and closing.
    uploads: [AtomicU64; 2],
    upload_bytes: AtomicU64,
    upload_handles: AtomicU64,
    upload_micros: [AtomicU64; 3],
    share: std::sync::Mutex<ShareCounts>,
}

/// The chunk-sharing counters, by their labels.
#[derive(Debug, Default)]
struct ShareCounts {
    /// (artifact, source) → bytes.
    received: BTreeMap<(String, &'static str), u64>,
    /// artifact → bytes.
    served: BTreeMap<String, u64>,
    /// (peer, kind) → pieces.
    peer_failures: BTreeMap<(String, &'static str), u64>,
    /// when → ranges.
    ranges_kept: BTreeMap<&'static str, u64>,
}

/// Gauges read when metrics are rendered.
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    pub state: Option<State>,
    pub memory: MemoryStats,
    pub peers_up: u64,
    pub peers_down: u64,
    pub replication_lag: Duration,
    pub replication_pending: u64,
    pub persist_running: u64,
    pub share_cache: u64,
    pub pins: PinCounts,
}

/// What pinning steps for the GPU has done (all 0 where the sidecar does not pin).
#[derive(Debug, Clone, Copy, Default)]
pub struct PinCounts {
    pub pinned: u64,
    pub failed: u64,
    pub seconds: f64,
    /// Bytes pinned now.
    pub held_bytes: u64,
    /// Steps waiting to be pinned.
    pub waiting: u64,
}

impl Metrics {
    /// A restore served from `source` in `took`.
    pub fn restored(&self, source: TierKind, took: Duration) {
        self.restores[tier_index(source)].fetch_add(1, Ordering::Relaxed);
        self.restore_seconds[tier_index(source)].observe(took);
    }

    /// A step that reached `tier` `took` after its segment was asked for.
    pub fn saved(&self, tier: TierKind, bytes: u64, took: Duration) {
        self.save_seconds[tier_index(tier)].observe(took);
        if tier != TierKind::Memory {
            self.persisted_bytes[tier_index(tier)].fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// One failure of `kind`.
    pub fn failed(&self, kind: Failure) {
        let i = Failure::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.failures[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Failures of `kind` so far.
    pub fn failures(&self, kind: Failure) -> u64 {
        let i = Failure::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.failures[i].load(Ordering::Relaxed)
    }

    /// A shard pulled back from a peer at start.
    pub fn recovered(&self, bytes: u64) {
        self.recovered_shards.fetch_add(1, Ordering::Relaxed);
        self.recovered_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// An upload into a process's device tensors: what was copied, or `None` when refused.
    pub fn uploaded(&self, done: Option<&SharedCopy>) {
        self.uploads[usize::from(done.is_none())].fetch_add(1, Ordering::Relaxed);
        let Some(d) = done else { return };
        self.upload_bytes.fetch_add(d.bytes, Ordering::Relaxed);
        self.upload_handles.fetch_add(d.handles, Ordering::Relaxed);
        for (i, took) in [d.open, d.copy, d.close].into_iter().enumerate() {
            self.upload_micros[i].fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        }
    }

    fn share(&self) -> std::sync::MutexGuard<'_, ShareCounts> {
        self.share
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A shared piece of `bytes` handed to a process of this node, from `source`.
    pub fn shared(&self, artifact: &str, source: &'static str, bytes: u64) {
        *self
            .share()
            .received
            .entry((artifact.to_string(), source))
            .or_default() += bytes;
    }

    /// A shared piece of `bytes` sent to a peer.
    pub fn served(&self, artifact: &str, bytes: u64) {
        *self.share().served.entry(artifact.to_string()).or_default() += bytes;
    }

    /// A piece `peer` did not provide: `corrupt` or `error`.
    pub fn share_peer_failed(&self, peer: &str, kind: &'static str) {
        *self
            .share()
            .peer_failures
            .entry((peer.to_string(), kind))
            .or_default() += 1;
    }

    /// A range of a checkpoint chunk from a peer kept: `on_arrival` or `with_chunk`.
    pub fn range_kept(&self, when: &'static str) {
        *self.share().ranges_kept.entry(when).or_default() += 1;
    }

    fn render_share(&self, out: &mut String) {
        let head = |out: &mut String, name: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        };
        let s = self.share();
        head(
            out,
            SHARE_BYTES_TOTAL,
            "Bytes of shared pieces this node's processes received, by artifact and source.",
        );
        for ((artifact, source), v) in &s.received {
            let _ = writeln!(
                out,
                "{SHARE_BYTES_TOTAL}{{artifact=\"{artifact}\",source=\"{source}\"}} {v}"
            );
        }
        head(
            out,
            SHARE_SERVED_BYTES_TOTAL,
            "Bytes of shared pieces sent to peers, by artifact.",
        );
        for (artifact, v) in &s.served {
            let _ = writeln!(
                out,
                "{SHARE_SERVED_BYTES_TOTAL}{{artifact=\"{artifact}\"}} {v}"
            );
        }
        head(
            out,
            SHARE_PEER_FAILURES_TOTAL,
            "Shared pieces a peer did not provide, by peer and kind (corrupt, error).",
        );
        for ((peer, kind), v) in &s.peer_failures {
            let _ = writeln!(
                out,
                "{SHARE_PEER_FAILURES_TOTAL}{{peer=\"{peer}\",kind=\"{kind}\"}} {v}"
            );
        }
        head(
            out,
            SHARE_RANGES_KEPT_TOTAL,
            "Ranges of checkpoint chunks from peers kept and passed on, by when they were \
             checked (on_arrival, with_chunk).",
        );
        for (when, v) in &s.ranges_kept {
            let _ = writeln!(out, "{SHARE_RANGES_KEPT_TOTAL}{{when=\"{when}\"}} {v}");
        }
    }

    /// Everything, in Prometheus text format.
    pub fn render(&self, g: &Gauges, store: Option<&Counter>) -> String {
        let mut out = String::with_capacity(8 << 10);
        let head = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        head(
            &mut out,
            SIDECAR_STATE,
            "gauge",
            "1 for the sidecar's lifecycle state.",
        );
        for s in State::ALL {
            let v = u8::from(g.state == Some(s));
            let _ = writeln!(out, "{SIDECAR_STATE}{{state=\"{s}\"}} {v}");
        }
        let m = &g.memory;
        for (name, help, v) in [
            (
                MEMORY_BUDGET_BYTES,
                "Bytes of shared memory the memory tier may hold.",
                m.budget,
            ),
            (
                MEMORY_USED_BYTES,
                "Bytes of shared memory held now.",
                m.used,
            ),
            (
                MEMORY_PEAK_BYTES,
                "Most bytes of shared memory ever held at once.",
                m.peak,
            ),
        ] {
            head(&mut out, name, "gauge", help);
            let _ = writeln!(out, "{name} {v}");
        }
        head(
            &mut out,
            MEMORY_SHARD_BYTES,
            "gauge",
            "Bytes of committed shards in memory.",
        );
        let _ = writeln!(
            out,
            "{MEMORY_SHARD_BYTES}{{origin=\"local\"}} {}",
            m.local_bytes
        );
        let _ = writeln!(
            out,
            "{MEMORY_SHARD_BYTES}{{origin=\"replica\"}} {}",
            m.replica_bytes
        );
        head(
            &mut out,
            MEMORY_SHARDS,
            "gauge",
            "Committed shards in memory.",
        );
        let _ = writeln!(
            out,
            "{MEMORY_SHARDS}{{origin=\"local\"}} {}",
            m.local_shards
        );
        let _ = writeln!(
            out,
            "{MEMORY_SHARDS}{{origin=\"replica\"}} {}",
            m.replica_shards
        );
        head(
            &mut out,
            EVICTIONS_TOTAL,
            "counter",
            "Shards evicted from memory.",
        );
        let _ = writeln!(out, "{EVICTIONS_TOTAL} {}", m.evictions);
        head(
            &mut out,
            EVICTED_BYTES_TOTAL,
            "counter",
            "Bytes evicted from memory.",
        );
        let _ = writeln!(out, "{EVICTED_BYTES_TOTAL} {}", m.evicted_bytes);
        head(
            &mut out,
            SEGMENTS_CREATED_TOTAL,
            "counter",
            "Segments created for training processes to stage into.",
        );
        let _ = writeln!(out, "{SEGMENTS_CREATED_TOTAL} {}", m.created);
        head(
            &mut out,
            SEGMENTS_RECYCLED_TOTAL,
            "counter",
            "Segments of older steps staged into again.",
        );
        let _ = writeln!(out, "{SEGMENTS_RECYCLED_TOTAL} {}", m.recycled);
        head(
            &mut out,
            PERSISTED_BYTES_TOTAL,
            "counter",
            "Bytes persisted or replicated, by tier.",
        );
        for t in [TierKind::Peer, TierKind::Disk, TierKind::Store] {
            let v = self.persisted_bytes[tier_index(t)].load(Ordering::Relaxed);
            let _ = writeln!(out, "{PERSISTED_BYTES_TOTAL}{{tier=\"{t}\"}} {v}");
        }
        head(
            &mut out,
            SAVE_DURATION_SECONDS,
            "histogram",
            "Seconds from a segment being asked for to a tier holding the step.",
        );
        for t in TierKind::ALL {
            self.save_seconds[tier_index(t)].render(
                &mut out,
                SAVE_DURATION_SECONDS,
                "tier",
                t.as_str(),
            );
        }
        head(
            &mut out,
            RESTORES_TOTAL,
            "counter",
            "Restores served, by source tier.",
        );
        for t in TierKind::ALL {
            let v = self.restores[tier_index(t)].load(Ordering::Relaxed);
            let _ = writeln!(out, "{RESTORES_TOTAL}{{source=\"{t}\"}} {v}");
        }
        head(
            &mut out,
            RESTORE_DURATION_SECONDS,
            "histogram",
            "Seconds to serve a restore, by source tier.",
        );
        for t in TierKind::ALL {
            self.restore_seconds[tier_index(t)].render(
                &mut out,
                RESTORE_DURATION_SECONDS,
                "source",
                t.as_str(),
            );
        }
        head(
            &mut out,
            REPLICATION_LAG_SECONDS,
            "gauge",
            "Age of the oldest committed local shard not yet on its peers.",
        );
        let _ = writeln!(
            out,
            "{REPLICATION_LAG_SECONDS} {}",
            g.replication_lag.as_secs_f64()
        );
        head(
            &mut out,
            REPLICATION_PENDING_SHARDS,
            "gauge",
            "Committed local shards waiting for replication.",
        );
        let _ = writeln!(
            out,
            "{REPLICATION_PENDING_SHARDS} {}",
            g.replication_pending
        );
        head(
            &mut out,
            PERSIST_RUNNING_SHARDS,
            "gauge",
            "Committed local shards whose persistence to disk and store (retention included) is running.",
        );
        let _ = writeln!(out, "{PERSIST_RUNNING_SHARDS} {}", g.persist_running);
        head(
            &mut out,
            SHARE_CACHE_BYTES,
            "gauge",
            "Bytes of shared pieces kept in memory, charged to the memory budget.",
        );
        let _ = writeln!(out, "{SHARE_CACHE_BYTES} {}", g.share_cache);
        for (name, help, v) in [
            (
                RECOVERED_SHARDS_TOTAL,
                "Shards pulled back from peers at start.",
                &self.recovered_shards,
            ),
            (
                RECOVERED_BYTES_TOTAL,
                "Bytes pulled back from peers at start.",
                &self.recovered_bytes,
            ),
            (
                GPU_UPLOAD_BYTES_TOTAL,
                "Bytes the sidecar copied into processes' device tensors.",
                &self.upload_bytes,
            ),
            (
                GPU_UPLOAD_HANDLES_TOTAL,
                "Processes' device allocations opened from IPC handles for those copies.",
                &self.upload_handles,
            ),
        ] {
            head(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        }
        head(
            &mut out,
            GPU_UPLOADS_TOTAL,
            "counter",
            "Restores into device tensors the sidecar was asked to copy, by result.",
        );
        for (i, result) in ["copied", "refused"].iter().enumerate() {
            let n = self.uploads[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{GPU_UPLOADS_TOTAL}{{result=\"{result}\"}} {n}");
        }
        head(
            &mut out,
            GPU_UPLOAD_SECONDS_TOTAL,
            "counter",
            "Seconds of the copies into device tensors, by phase (open, copy, close).",
        );
        for (i, phase) in ["open", "copy", "close"].iter().enumerate() {
            let s = self.upload_micros[i].load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(out, "{GPU_UPLOAD_SECONDS_TOTAL}{{phase=\"{phase}\"}} {s}");
        }
        let p = &g.pins;
        head(
            &mut out,
            GPU_PINS_TOTAL,
            "counter",
            "Steps in memory registered as pinned memory for the GPU, by result.",
        );
        for (result, n) in [("pinned", p.pinned), ("failed", p.failed)] {
            let _ = writeln!(out, "{GPU_PINS_TOTAL}{{result=\"{result}\"}} {n}");
        }
        for (name, kind, help, v) in [
            (
                GPU_PIN_SECONDS_TOTAL,
                "counter",
                "Seconds spent registering steps as pinned memory for the GPU.",
                p.seconds,
            ),
            (
                GPU_PINNED_BYTES,
                "gauge",
                "Bytes of steps in memory pinned for the GPU now.",
                p.held_bytes as f64,
            ),
            (
                GPU_PIN_WAITING_STEPS,
                "gauge",
                "Committed steps waiting to be pinned for the GPU.",
                p.waiting as f64,
            ),
        ] {
            head(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {v}");
        }
        head(
            &mut out,
            PEERS,
            "gauge",
            "Peers by the answer to the last probe.",
        );
        let _ = writeln!(out, "{PEERS}{{state=\"up\"}} {}", g.peers_up);
        let _ = writeln!(out, "{PEERS}{{state=\"down\"}} {}", g.peers_down);
        head(&mut out, FAILURES_TOTAL, "counter", "Failures by kind.");
        for k in Failure::ALL {
            let _ = writeln!(
                out,
                "{FAILURES_TOTAL}{{kind=\"{}\"}} {}",
                k.as_str(),
                self.failures(k)
            );
        }
        if let Some(c) = store {
            head(
                &mut out,
                STORE_REQUESTS_TOTAL,
                "counter",
                "Requests to the object store, by kind.",
            );
            for op in Op::ALL {
                let _ = writeln!(
                    out,
                    "{STORE_REQUESTS_TOTAL}{{op=\"{}\"}} {}",
                    op_name(op),
                    c.get(op).requests
                );
            }
            head(
                &mut out,
                STORE_BYTES_TOTAL,
                "counter",
                "Payload bytes to and from the object store, by kind.",
            );
            for op in Op::ALL {
                let _ = writeln!(
                    out,
                    "{STORE_BYTES_TOTAL}{{op=\"{}\"}} {}",
                    op_name(op),
                    c.get(op).bytes
                );
            }
        }
        self.render_share(&mut out);
        out
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Get => "get",
        Op::Head => "head",
        Op::Put => "put",
        Op::MultipartStart => "multipart_start",
        Op::PutPart => "put_part",
        Op::MultipartComplete => "multipart_complete",
        Op::MultipartAbort => "multipart_abort",
        Op::List => "list",
        Op::Delete => "delete",
        Op::Copy => "copy",
    }
}

/// The value of the sample `name` (with its labels exactly as rendered, e.g.
/// `hotstart_restores_total{source="memory"}`) in a rendered page.
pub fn sample(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_help_and_type() {
        let m = Metrics::default();
        m.restored(TierKind::Memory, Duration::from_millis(30));
        m.restored(TierKind::Memory, Duration::from_millis(700));
        m.failed(Failure::Checksum);
        m.saved(TierKind::Store, 1000, Duration::from_secs(2));
        m.shared("env", "peer", 300);
        m.shared("env", "peer", 200);
        m.served("image", 70);
        m.share_peer_failed("node-b", "corrupt");
        m.range_kept("on_arrival");
        let copied = SharedCopy {
            bytes: 1 << 20,
            handles: 3,
            open: Duration::from_micros(1500),
            copy: Duration::from_millis(20),
            close: Duration::from_micros(700),
        };
        m.uploaded(Some(&copied));
        m.uploaded(Some(&copied));
        m.uploaded(None);
        let g = Gauges {
            state: Some(State::Ready),
            memory: MemoryStats {
                budget: 100,
                used: 40,
                peak: 60,
                ..MemoryStats::default()
            },
            share_cache: 24,
            pins: PinCounts {
                pinned: 3,
                seconds: 0.5,
                held_bytes: 4096,
                ..PinCounts::default()
            },
            ..Gauges::default()
        };
        let page = m.render(&g, Some(&Counter::default()));
        let v = |name: &str| sample(&page, name).unwrap_or_else(|| panic!("{name} in\n{page}"));
        assert_eq!(v("hotstart_restores_total{source=\"memory\"}"), 2.0);
        assert_eq!(v("hotstart_restores_total{source=\"store\"}"), 0.0);
        assert_eq!(
            v("hotstart_share_bytes_total{artifact=\"env\",source=\"peer\"}"),
            500.0
        );
        assert_eq!(
            v("hotstart_share_served_bytes_total{artifact=\"image\"}"),
            70.0
        );
        assert_eq!(
            v("hotstart_share_peer_failures_total{peer=\"node-b\",kind=\"corrupt\"}"),
            1.0
        );
        assert_eq!(
            v("hotstart_share_ranges_kept_total{when=\"on_arrival\"}"),
            1.0
        );
        assert_eq!(
            v("hotstart_restore_duration_seconds_bucket{source=\"memory\",le=\"0.05\"}"),
            1.0
        );
        assert_eq!(
            v("hotstart_restore_duration_seconds_bucket{source=\"memory\",le=\"+Inf\"}"),
            2.0
        );
        assert_eq!(
            v("hotstart_restore_duration_seconds_count{source=\"memory\"}"),
            2.0
        );
        assert!(
            (v("hotstart_restore_duration_seconds_sum{source=\"memory\"}") - 0.73).abs() < 1e-9
        );
        assert_eq!(v("hotstart_failures_total{kind=\"checksum\"}"), 1.0);
        assert_eq!(v("hotstart_sidecar_state{state=\"ready\"}"), 1.0);
        assert_eq!(v("hotstart_sidecar_state{state=\"draining\"}"), 0.0);
        assert_eq!(v("hotstart_memory_peak_bytes"), 60.0);
        assert_eq!(v("hotstart_share_cache_bytes"), 24.0);
        assert_eq!(v("hotstart_gpu_pins_total{result=\"pinned\"}"), 3.0);
        assert_eq!(v("hotstart_gpu_pins_total{result=\"failed\"}"), 0.0);
        assert_eq!(v("hotstart_gpu_pin_seconds_total"), 0.5);
        assert_eq!(v("hotstart_gpu_pinned_bytes"), 4096.0);
        assert_eq!(v("hotstart_gpu_pin_waiting_steps"), 0.0);
        assert_eq!(v("hotstart_gpu_uploads_total{result=\"copied\"}"), 2.0);
        assert_eq!(v("hotstart_gpu_uploads_total{result=\"refused\"}"), 1.0);
        assert_eq!(v("hotstart_gpu_upload_bytes_total"), 2.0 * (1 << 20) as f64);
        assert_eq!(v("hotstart_gpu_upload_handles_total"), 6.0);
        assert_eq!(
            v("hotstart_gpu_upload_seconds_total{phase=\"open\"}"),
            0.003
        );
        assert_eq!(v("hotstart_gpu_upload_seconds_total{phase=\"copy\"}"), 0.04);
        assert_eq!(
            v("hotstart_gpu_upload_seconds_total{phase=\"close\"}"),
            0.0014
        );
        assert_eq!(v("hotstart_persisted_bytes_total{tier=\"store\"}"), 1000.0);
        assert_eq!(v("hotstart_store_requests_total{op=\"get\"}"), 0.0);
        // Every sample belongs to a family with HELP and TYPE.
        for line in page.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|f| page.contains(&format!("# TYPE {f} histogram")))
                .unwrap_or(name);
            assert!(page.contains(&format!("# TYPE {family} ")), "{line}");
            assert!(page.contains(&format!("# HELP {family} ")), "{line}");
        }
        // Every family is documented for users.
        let doc = include_str!("../../docs/METRICS.md");
        for family in page.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
            let name = family.split(' ').next().unwrap();
            assert!(
                doc.contains(&format!("`{name}`")),
                "{name} in docs/METRICS.md"
            );
        }
    }
}
