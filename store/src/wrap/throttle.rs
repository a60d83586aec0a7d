//! [`Throttle`]: an emulated remote store: latency per request and bandwidth caps.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use object_store::path::Path;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::{Interceptor, Op};

/// Link parameters.
#[derive(Debug, Clone, Copy, Default)]
pub struct ThrottleConfig {
    /// Added before every request (one round trip).
    pub latency: Duration,
    /// Bytes per second one request can move (one TCP flow); `None` for no cap.
    pub per_request_bytes_per_sec: Option<u64>,
    /// Bytes per second all requests together can move; `None` for no cap.
    pub total_bytes_per_sec: Option<u64>,
}

/// Delays requests and paces their bytes as [`ThrottleConfig`] says.
#[derive(Debug)]
pub struct Throttle {
    cfg: ThrottleConfig,
    total: Option<Pacer>,
}

impl Throttle {
    pub fn new(cfg: ThrottleConfig) -> Throttle {
        Throttle {
            cfg,
            total: cfg.total_bytes_per_sec.map(Pacer::new),
        }
    }

    /// Waits until `n` bytes may pass on a flow paced by `flow` (and the shared total).
    async fn pass(&self, flow: Option<&Pacer>, n: u64) {
        let mut until = Instant::now();
        if let Some(p) = flow {
            until = until.max(p.reserve(n));
        }
        if let Some(p) = &self.total {
            until = until.max(p.reserve(n));
        }
        tokio::time::sleep_until(until).await;
    }
}

/// A virtual clock per flow: each transfer of `n` bytes reserves `n / rate` seconds after the
/// previous reservation.
#[derive(Debug)]
struct Pacer {
    bytes_per_sec: u64,
    next: Mutex<Instant>,
}

impl Pacer {
    fn new(bytes_per_sec: u64) -> Pacer {
        Pacer {
            bytes_per_sec: bytes_per_sec.max(1),
            next: Mutex::new(Instant::now()),
        }
    }

    /// Reserves time for `n` bytes; returns when the reservation ends.
    fn reserve(&self, n: u64) -> Instant {
        let mut next = self.next.lock();
        let start = (*next).max(Instant::now());
        *next = start + Duration::from_secs_f64(n as f64 / self.bytes_per_sec as f64);
        *next
    }
}

impl Interceptor for Throttle {
    fn before(
        self: Arc<Self>,
        _op: Op,
        _path: &Path,
        bytes: u64,
    ) -> BoxFuture<'static, object_store::Result<()>> {
        async move {
            tokio::time::sleep(self.cfg.latency).await;
            if bytes > 0 {
                let flow = self.cfg.per_request_bytes_per_sec.map(Pacer::new);
                self.pass(flow.as_ref(), bytes).await;
            }
            Ok(())
        }
        .boxed()
    }

    fn get_body(
        self: Arc<Self>,
        _path: &Path,
        _range: Range<u64>,
        body: BoxStream<'static, object_store::Result<Bytes>>,
    ) -> BoxStream<'static, object_store::Result<Bytes>> {
        let flow = Arc::new(self.cfg.per_request_bytes_per_sec.map(Pacer::new));
        body.then(move |r| {
            let this = self.clone();
            let flow = flow.clone();
            async move {
                if let Ok(b) = &r {
                    this.pass(flow.as_ref().as_ref(), b.len() as u64).await;
                }
                r
            }
        })
        .boxed()
    }
}
