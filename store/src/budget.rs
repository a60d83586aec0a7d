//! A byte budget shared by every striped reader and writer of a process.
//!
//! Each stripe acquires as many bytes as it will hold before its request is sent and gives them
//! back when its bytes leave the reader (handed to the caller) or the writer (the part is
//! uploaded). The budget is a fair (FIFO) semaphore counted in bytes, so the oldest stripe of a
//! reader is always served before younger ones and the total held never exceeds the capacity.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Default process-wide budget: 1 GiB, or `HOTSTART_IO_BUDGET` bytes.
pub const DEFAULT_BUDGET_BYTES: usize = 1 << 30;

/// A counted pool of bytes; cheap to clone (clones share the pool).
#[derive(Clone, Debug)]
pub struct ByteBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    sem: Arc<Semaphore>,
    capacity: usize,
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl ByteBudget {
    /// A new budget of `capacity` bytes (at least 1).
    pub fn new(capacity: usize) -> ByteBudget {
        let capacity = capacity.clamp(1, Semaphore::MAX_PERMITS);
        ByteBudget {
            inner: Arc::new(Inner {
                sem: Arc::new(Semaphore::new(capacity)),
                capacity,
                in_use: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
            }),
        }
    }

    /// The budget shared by the whole process (`HOTSTART_IO_BUDGET` bytes, default 1 GiB).
    pub fn global() -> ByteBudget {
        static GLOBAL: OnceLock<ByteBudget> = OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let bytes = std::env::var("HOTSTART_IO_BUDGET")
                    .ok()
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(DEFAULT_BUDGET_BYTES);
                ByteBudget::new(bytes)
            })
            .clone()
    }

    /// Total bytes in the pool.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Bytes held right now.
    pub fn in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Relaxed)
    }

    /// The most bytes ever held at once.
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::Relaxed)
    }

    /// Waits until `bytes` are free and takes them; a request larger than the capacity takes the
    /// whole capacity (callers size stripes with [`ByteBudget::clamp`] so this does not happen).
    pub async fn acquire(&self, bytes: usize) -> BudgetPermit {
        let n = self.clamp(bytes).min(u32::MAX as usize);
        let permit = self
            .inner
            .sem
            .clone()
            .acquire_many_owned(n as u32)
            .await
            .expect("the budget semaphore is never closed");
        let now = self.inner.in_use.fetch_add(n, Ordering::Relaxed) + n;
        self.inner.peak.fetch_max(now, Ordering::Relaxed);
        BudgetPermit {
            inner: self.inner.clone(),
            bytes: n,
            _permit: permit,
        }
    }

    /// `bytes`, or the capacity if that is smaller: the largest single stripe this budget admits.
    pub fn clamp(&self, bytes: usize) -> usize {
        bytes.clamp(1, self.inner.capacity)
    }
}

/// Bytes held from a [`ByteBudget`]; given back on drop.
#[derive(Debug)]
pub struct BudgetPermit {
    inner: Arc<Inner>,
    bytes: usize,
    _permit: OwnedSemaphorePermit,
}

impl BudgetPermit {
    /// How many bytes this permit holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for BudgetPermit {
    fn drop(&mut self) {
        self.inner.in_use.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn never_hands_out_more_than_capacity() {
        let budget = ByteBudget::new(100);
        let a = budget.acquire(60).await;
        assert_eq!(budget.in_use(), 60);
        let b2 = budget.clone();
        let waiter = tokio::spawn(async move { b2.acquire(60).await.bytes() });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        assert_eq!(waiter.await.unwrap(), 60);
        assert_eq!(budget.peak(), 60);
        assert_eq!(budget.in_use(), 0);
        // Oversized requests are clamped, not deadlocked.
        assert_eq!(budget.acquire(1000).await.bytes(), 100);
    }
}
