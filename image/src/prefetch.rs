//! Prefetch replay: fetch a profile's chunks in order, ahead of the job, without getting in the
//! way of its reads.
//!
//! **Order.** The plan is the profile's chunks (ordered by median first-access time over past
//! runs) that the mounted tree still contains, cut where their total would pass the cache that
//! has to hold them. The prefetcher walks it in order and skips every chunk the loader already
//! has, is fetching, or that a read already asked for: a read of a chunk still queued fetches it
//! at once itself (it jumps the queue), and the prefetcher finds it settled when it gets there.
//!
//! **Concurrency.** A fetch is started only while the fetches in flight, **demand reads included**,
//! are fewer than the window, so reads always have the first slots and prefetch only uses what they
//! leave. The window adapts to the link on latency, as TCP does: each completion's latency (its
//! request to the store alone: decoding is not timed, and a frame served from memory, as from a
//! snapshot's pack, is not counted at all) is compared with the lowest seen (the link's base round
//! trip); while it stays within `slack` times that, requests are not queueing and the window grows,
//! by one per completion at first (**slow start**: it doubles every round trip, so a long-latency
//! link is filled within a few round trips) and, after the first sign of queueing, by one per
//! window's worth of completions; once latency passes the bound, the link is saturated and the
//! window shrinks by a quarter (once per window of completions). A failed fetch halves it. It stays
//! within `[min_window, max_window]`.
//!
//! **Staying ahead, but not too far.** Chunks prefetched but not yet read are held in memory; the
//! prefetcher pauses while they pass `max_ahead` bytes, so it cannot evict its own work before
//! the job reads it, and resumes as reads consume them.

use std::sync::Arc;
use std::time::Duration;

use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use hotstart_store::ChunkId;

use crate::loader::{Loader, PrefetchDone};

/// How the prefetcher replays a profile.
#[derive(Debug, Clone, Copy)]
pub struct PrefetchConfig {
    /// The first window (fetches in flight, demand reads included).
    pub initial_window: usize,
    pub min_window: usize,
    pub max_window: usize,
    /// Latency above `slack` times the lowest seen counts as queueing.
    pub slack: f64,
    /// Bytes prefetched and not yet read above which the prefetcher pauses.
    pub max_ahead: u64,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            initial_window: 32,
            min_window: 2,
            max_window: 128,
            slack: 4.0,
            max_ahead: 768 << 20,
        }
    }
}

/// The adaptive window (see the module documentation).
#[derive(Debug, Clone)]
pub struct Window {
    cur: f64,
    min: f64,
    max: f64,
    slack: f64,
    base: Option<Duration>,
    /// Completions left before another decrease may happen.
    hold: f64,
    peak: f64,
    /// Growing by one per completion until the first sign of queueing.
    slow_start: bool,
}

impl Window {
    pub fn new(cfg: &PrefetchConfig) -> Window {
        let min = cfg.min_window.max(1) as f64;
        let max = (cfg.max_window as f64).max(min);
        let cur = (cfg.initial_window as f64).clamp(min, max);
        Window {
            cur,
            min,
            max,
            slack: cfg.slack.max(1.0),
            base: None,
            hold: 0.0,
            peak: cur,
            slow_start: true,
        }
    }

    /// Fetches allowed in flight now.
    pub fn size(&self) -> usize {
        self.cur as usize
    }

    /// The largest the window has been.
    pub fn peak(&self) -> usize {
        self.peak as usize
    }

    /// One fetch completed after `latency`.
    pub fn on_complete(&mut self, latency: Duration) {
        let base = *self.base.get_or_insert(latency);
        let base = base.min(latency);
        self.base = Some(base);
        self.hold -= 1.0;
        if latency.as_secs_f64() <= base.as_secs_f64() * self.slack {
            let step = if self.slow_start { 1.0 } else { 1.0 / self.cur };
            self.cur = (self.cur + step).min(self.max);
            self.peak = self.peak.max(self.cur);
        } else if self.hold <= 0.0 {
            self.slow_start = false;
            self.cur = (self.cur * 0.75).max(self.min);
            self.hold = self.cur;
        }
    }

    /// One fetch failed.
    pub fn on_error(&mut self) {
        self.slow_start = false;
        self.cur = (self.cur / 2.0).max(self.min);
        self.hold = self.cur;
    }

    /// One prefetch ended. A frame served from memory moves nothing: its near-zero latency
    /// would become the link's base round trip, and every real request would then look queued.
    fn on_done(&mut self, done: PrefetchDone) {
        match (done.ok, done.latency) {
            (false, _) => self.on_error(),
            (true, Some(latency)) => self.on_complete(latency),
            (true, None) => {}
        }
    }
}

/// What a replay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Chunks in the plan.
    pub planned: u64,
    pub planned_bytes: u64,
    /// Prefetches started (the rest were settled when reached).
    pub started: u64,
    pub final_window: usize,
    pub peak_window: usize,
}

/// Replays `plan` (chunk ids and lengths, in order) through `loader` until it is done or
/// `stop` fires.
pub async fn replay(
    loader: Arc<Loader>,
    plan: Vec<(ChunkId, u32)>,
    cfg: PrefetchConfig,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> ReplayStats {
    let mut window = Window::new(&cfg);
    let mut stats = ReplayStats {
        planned: plan.len() as u64,
        planned_bytes: plan.iter().map(|(_, l)| *l as u64).sum(),
        ..ReplayStats::default()
    };
    let mut running = FuturesUnordered::new();
    let mut next = plan.into_iter().peekable();
    loop {
        if *stop.borrow() {
            break;
        }
        // Fold in finished fetches.
        while let Some(Some(done)) = running.next().now_or_never() {
            window.on_done(done);
        }
        let Some(&(id, len)) = next.peek() else {
            if running.is_empty() {
                break;
            }
            // Only completions are left to wait for.
            tokio::select! {
                _ = stop.changed() => {}
                Some(done) = running.next() => window.on_done(done),
            }
            continue;
        };
        if loader.settled(&id) {
            next.next();
            continue;
        }
        let (demand, prefetch) = loader.in_flight();
        let room = demand + prefetch < window.size();
        let ahead_ok = loader.ahead_bytes() + len as u64 <= cfg.max_ahead.max(len as u64);
        if room && ahead_ok {
            next.next();
            if let Some(f) = loader.prefetch(id, len) {
                stats.started += 1;
                running.push(f);
            }
            continue;
        }
        // Wait for a slot: a completion of ours, or any change in the loader (a demand read
        // ending, a read consuming prefetched bytes).
        tokio::select! {
            _ = stop.changed() => {}
            Some(done) = running.next(), if !running.is_empty() => window.on_done(done),
            _ = loader.wait_change(Duration::from_millis(50)) => {}
        }
    }
    stats.final_window = window.size();
    stats.peak_window = window.peak();
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_grows_while_latency_is_flat_and_backs_off_when_it_queues() {
        let cfg = PrefetchConfig {
            initial_window: 4,
            min_window: 2,
            max_window: 32,
            slack: 2.0,
            ..PrefetchConfig::default()
        };
        let mut w = Window::new(&cfg);
        let ms = Duration::from_millis;
        // Slow start: one more per completion, so 4 completions double a window of 4.
        for _ in 0..4 {
            w.on_complete(ms(20));
        }
        assert_eq!(w.size(), 8);
        for _ in 0..200 {
            w.on_complete(ms(20));
        }
        assert_eq!(w.size(), 32, "flat latency grows to the cap");
        // Latency far above the base: shrink, but not below the minimum.
        for _ in 0..200 {
            w.on_complete(ms(200));
        }
        assert_eq!(w.size(), 2);
        assert_eq!(w.peak(), 32);
        // A model link: latency = 20 ms + queueing once more than 8 are in flight.
        let mut w = Window::new(&cfg);
        for _ in 0..2000 {
            let n = w.size() as u64;
            w.on_complete(ms(20 + n.saturating_sub(8) * 10));
        }
        assert!(
            (6..=14).contains(&w.size()),
            "settles near the knee: {}",
            w.size()
        );
        w.on_error();
        assert!(w.size() <= 7);
    }

    /// A plan half made of frames already in memory (a snapshot's pack) and half of chunks
    /// 50 ms away: the frames from memory must not become the link's base round trip, after
    /// which every real request would look queued and the window would shrink to its minimum.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_from_memory_leave_the_window_to_the_link() {
        use bytes::Bytes;
        use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};
        use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

        let memory = Store::open("memory://").unwrap();
        let direct = ChunkStore::new(memory.clone(), ChunkStoreConfig::default()).unwrap();
        let (mut plan, mut frames) = (Vec::new(), Vec::new());
        for i in 0..64u8 {
            let data = Bytes::from(vec![i; 64 << 10]);
            let id = direct.put(data.clone()).await.unwrap();
            if i % 2 == 0 {
                frames.push((id, direct.fetch_frame(&id).await.unwrap()));
            }
            plan.push((id, data.len() as u32));
        }
        let throttle = Arc::new(Throttle::new(ThrottleConfig {
            latency: Duration::from_millis(50),
            per_request_bytes_per_sec: None,
            total_bytes_per_sec: None,
        }));
        let remote = memory.wrap(|inner| throttle.wrap(inner));
        let chunks = ChunkStore::new(remote, ChunkStoreConfig::default()).unwrap();
        chunks.hold(frames);
        let loader = Arc::new(Loader::new(chunks, 1 << 30));
        // Only a request 8× the base (400 ms) would count as queueing: a slow scheduler does
        // not shrink the window, a base taken from memory (microseconds) does.
        let cfg = PrefetchConfig {
            initial_window: 4,
            min_window: 1,
            max_window: 64,
            slack: 8.0,
            ..PrefetchConfig::default()
        };
        let (_stop, stopped) = tokio::sync::watch::channel(false);
        let stats = replay(loader.clone(), plan.clone(), cfg, stopped).await;
        assert_eq!(stats.started, 64);
        assert!(
            stats.final_window == stats.peak_window && stats.final_window > 4,
            "the window shrank on a link whose latency never moved: {stats:?}"
        );
        for (id, _) in &plan {
            assert!(loader.settled(id), "chunk {id} was not prefetched");
        }
    }
}
