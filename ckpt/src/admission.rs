//! Admission: at most `max_inflight` saves of an engine are in flight at once, whatever their
//! target (the staging pool or the sidecar's memory). One more waits (`WhenFull::Block`) or is
//! skipped (`WhenFull::Skip`); see `crate::save` for how long a save holds its ticket.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

/// The bound on saves in flight: one rule for every save of an engine.
#[derive(Debug)]
pub(crate) struct Admission {
    max: usize,
    taken: Mutex<usize>,
    freed: Condvar,
}

/// One admitted save; dropping it admits the next.
#[derive(Debug)]
pub(crate) struct Ticket(Arc<Admission>);

impl Admission {
    pub(crate) fn new(max: usize) -> Arc<Admission> {
        Arc::new(Admission {
            max: max.max(1),
            taken: Mutex::new(0),
            freed: Condvar::new(),
        })
    }

    /// How many saves may be in flight at once.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// A ticket; `None` when `max` saves are in flight and `block` is false.
    pub(crate) fn take(self: &Arc<Self>, block: bool) -> Option<Ticket> {
        let mut t = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        while *t >= self.max {
            if !block {
                return None;
            }
            t = self.freed.wait(t).unwrap_or_else(PoisonError::into_inner);
        }
        *t += 1;
        Some(Ticket(self.clone()))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        *self.0.taken.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
        self.0.freed.notify_one();
    }
}
