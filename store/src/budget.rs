//! A byte budget shared by every striped reader and writer of a process.
//!
//! Each stripe acquires as many bytes as it will hold before its request is sent and gives them
//! back when its bytes leave the reader (handed to the caller) or the writer (the part is
//! uploaded). The budget is a fair (FIFO) semaphore counted in bytes, so the oldest stripe of a
//! reader is always served before younger ones and the total held never exceeds the capacity.
//!
//! **Memory that can be taken back.** Some holders keep bytes only because they may be wanted
//! soon: a FUSE read handle's read-ahead while no request is using the handle. Such a holder gives
//! nothing back until its owner acts again, and its owner may be waiting, through the kernel, for
//! the very request that is waiting for memory here (readers of one file share its page cache,
//! so the next read may never come to the handle that holds the bytes). A budget can therefore
//! have a [`Reclaim`] registered: an [`acquire`](ByteBudget::acquire) that cannot be served at
//! once first joins the queue, then asks the reclaimer to free memory, and asks again each time
//! [`ByteBudget::reclaimable`] announces that a holder became idle, until its bytes arrive.
//! [`ByteBudget::try_acquire`] never reclaims and never waits: speculative users (read-ahead)
//! take only memory that is free, so they cannot push out each other's buffers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::Poll;

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

/// A holder of budget memory that can give some of it back on request.
pub trait Reclaim: Send + Sync {
    /// Frees memory held from the budget by holders that are idle now, stopping once about
    /// `wanted` bytes are freed; returns the bytes freed. Must not block or wait.
    fn reclaim(&self, wanted: usize) -> usize;
}

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
    reclaim: Mutex<Option<Weak<dyn Reclaim>>>,
    /// Acquires waiting with a reclaimer registered; `reclaimable` notifies only when non-zero.
    waiting: AtomicUsize,
    idle: Notify,
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
                reclaim: Mutex::new(None),
                waiting: AtomicUsize::new(0),
                idle: Notify::new(),
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
    /// When the bytes are not free at once and a [`Reclaim`] is registered, idle holders are
    /// asked to give memory back while this waits.
    pub async fn acquire(&self, bytes: usize) -> BudgetPermit {
        let n = self.clamp(bytes).min(u32::MAX as usize);
        let permit = match self.inner.sem.clone().try_acquire_many_owned(n as u32) {
            Ok(p) => p,
            Err(_) => self.wait(n).await,
        };
        self.held(n, permit)
    }

    /// Takes `bytes` only if they are free now (never waits, never reclaims).
    pub fn try_acquire(&self, bytes: usize) -> Option<BudgetPermit> {
        let n = self.clamp(bytes).min(u32::MAX as usize);
        let permit = self
            .inner
            .sem
            .clone()
            .try_acquire_many_owned(n as u32)
            .ok()?;
        Some(self.held(n, permit))
    }

    fn held(&self, n: usize, permit: OwnedSemaphorePermit) -> BudgetPermit {
        let now = self.inner.in_use.fetch_add(n, Ordering::Relaxed) + n;
        self.inner.peak.fetch_max(now, Ordering::Relaxed);
        BudgetPermit {
            inner: self.inner.clone(),
            bytes: n,
            _permit: permit,
        }
    }

    async fn wait(&self, n: usize) -> OwnedSemaphorePermit {
        let acquire = self.inner.sem.clone().acquire_many_owned(n as u32);
        tokio::pin!(acquire);
        self.inner.waiting.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.inner);
        loop {
            // Listen before reclaiming, so a holder that goes idle during the pass is not missed.
            let idle = self.inner.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            // Queue first: the bytes freed below then come to the waiters in FIFO order.
            if let Poll::Ready(p) = futures::poll!(acquire.as_mut()) {
                return p.expect("the budget semaphore is never closed");
            }
            let reclaimer = self.inner.reclaim.lock().as_ref().and_then(Weak::upgrade);
            let Some(reclaimer) = reclaimer else {
                return acquire.await.expect("the budget semaphore is never closed");
            };
            reclaimer.reclaim(n);
            drop(reclaimer);
            tokio::select! {
                biased;
                p = acquire.as_mut() => return p.expect("the budget semaphore is never closed"),
                () = idle => {}
            }
        }
    }

    /// Registers the holder of memory that can be taken back (replacing any earlier one).
    pub fn set_reclaim(&self, reclaim: Weak<dyn Reclaim>) {
        *self.inner.reclaim.lock() = Some(reclaim);
    }

    /// Tells waiting acquires that a holder became idle, so reclaiming may now free more.
    pub fn reclaimable(&self) {
        if self.inner.waiting.load(Ordering::SeqCst) > 0 {
            self.inner.idle.notify_waiters();
        }
    }

    /// `bytes`, or the capacity if that is smaller: the largest single stripe this budget admits.
    pub fn clamp(&self, bytes: usize) -> usize {
        bytes.clamp(1, self.inner.capacity)
    }
}

/// Counts one waiting acquire while it lives (also when the acquire is cancelled).
struct Waiting<'a>(&'a Inner);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
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

    /// Moves `bytes` of this permit into a new one (`None` if it holds fewer), so the parts of
    /// what one permit covered can be given back separately.
    pub fn split(&mut self, bytes: usize) -> Option<BudgetPermit> {
        let permit = self._permit.split(bytes)?;
        self.bytes -= bytes;
        Some(BudgetPermit {
            inner: self.inner.clone(),
            bytes,
            _permit: permit,
        })
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

    /// Holds permits until asked to give them back, like read-ahead nobody is reading.
    struct Idle(Mutex<Vec<BudgetPermit>>);

    impl Reclaim for Idle {
        fn reclaim(&self, wanted: usize) -> usize {
            let mut held = self.0.lock();
            let mut freed = 0;
            while freed < wanted {
                let Some(p) = held.pop() else { break };
                freed += p.bytes();
            }
            freed
        }
    }

    #[tokio::test]
    async fn a_waiter_takes_memory_back_from_idle_holders() {
        let budget = ByteBudget::new(100);
        let idle = Arc::new(Idle(Mutex::new(Vec::new())));
        let as_reclaim: Arc<dyn Reclaim> = idle.clone();
        budget.set_reclaim(Arc::downgrade(&as_reclaim));
        for _ in 0..4 {
            let p = budget.try_acquire(25).expect("free");
            idle.0.lock().push(p);
        }
        assert!(
            budget.try_acquire(1).is_none(),
            "try_acquire never reclaims"
        );
        assert_eq!(idle.0.lock().len(), 4);
        // Nothing else would ever free these bytes: acquire must take them back.
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), budget.acquire(40))
            .await
            .expect("acquire reclaimed instead of waiting forever");
        assert_eq!(got.bytes(), 40);
        assert_eq!(
            idle.0.lock().len(),
            2,
            "only what was wanted was taken back"
        );

        drop(got);

        // A holder that is busy during the pass becomes idle later: the waiter is told and
        // reclaims again.
        let busy = budget.try_acquire(50).expect("free");
        let b2 = budget.clone();
        let waiter = tokio::spawn(async move { b2.acquire(60).await.bytes() });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "50 bytes are busy and not yet reclaimable"
        );
        assert!(idle.0.lock().is_empty(), "the idle ones were taken back");
        idle.0.lock().push(busy);
        budget.reclaimable();
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("woken by reclaimable()")
            .unwrap();
        assert_eq!(got, 60);
        assert!(budget.peak() <= budget.capacity());
    }

    #[tokio::test]
    async fn split_parts_are_given_back_separately() {
        let budget = ByteBudget::new(100);
        let mut whole = budget.acquire(60).await;
        let part = whole.split(25).expect("60 bytes held");
        assert_eq!((whole.bytes(), part.bytes()), (35, 25));
        assert!(
            whole.split(36).is_none(),
            "cannot split off more than is held"
        );
        assert_eq!(budget.in_use(), 60);
        drop(part);
        assert_eq!(budget.in_use(), 35);
        assert!(
            budget.try_acquire(65).is_some(),
            "the split bytes are free again"
        );
        drop(whole);
        assert_eq!(budget.in_use(), 0);
    }
}
