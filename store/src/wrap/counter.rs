//! [`Counter`]: requests and bytes by kind of request.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use object_store::path::Path;

use super::{Interceptor, Op};

/// Counts requests and payload bytes (sent for writes, received for reads) by [`Op`].
#[derive(Debug, Default)]
pub struct Counter {
    requests: [AtomicU64; Op::ALL.len()],
    bytes: [AtomicU64; Op::ALL.len()],
}

/// Requests and bytes of one kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCount {
    pub requests: u64,
    pub bytes: u64,
}

impl Counter {
    /// Requests and bytes of kind `op` so far.
    pub fn get(&self, op: Op) -> OpCount {
        OpCount {
            requests: self.requests[op.index()].load(Ordering::Relaxed),
            bytes: self.bytes[op.index()].load(Ordering::Relaxed),
        }
    }

    /// Requests of every kind so far.
    pub fn total_requests(&self) -> u64 {
        Op::ALL.iter().map(|op| self.get(*op).requests).sum()
    }

    /// Sets every count back to zero.
    pub fn reset(&self) {
        for op in Op::ALL {
            self.requests[op.index()].store(0, Ordering::Relaxed);
            self.bytes[op.index()].store(0, Ordering::Relaxed);
        }
    }
}

impl Interceptor for Counter {
    fn before(
        self: Arc<Self>,
        op: Op,
        _path: &Path,
        bytes: u64,
    ) -> BoxFuture<'static, object_store::Result<()>> {
        self.requests[op.index()].fetch_add(1, Ordering::Relaxed);
        self.bytes[op.index()].fetch_add(bytes, Ordering::Relaxed);
        async { Ok(()) }.boxed()
    }

    fn get_body(
        self: Arc<Self>,
        _path: &Path,
        _range: Range<u64>,
        body: BoxStream<'static, object_store::Result<Bytes>>,
    ) -> BoxStream<'static, object_store::Result<Bytes>> {
        body.inspect(move |r| {
            if let Ok(b) = r {
                self.bytes[Op::Get.index()].fetch_add(b.len() as u64, Ordering::Relaxed);
            }
        })
        .boxed()
    }
}
