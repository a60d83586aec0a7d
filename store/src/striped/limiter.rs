//! How many parts a writer keeps uploading at once: found by hill climbing on throughput.
//!
//! Parallel parts multiply throughput when one connection is the limit (a remote store with a
//! per-connection cap) and only add contention when the server is (a store on the same few
//! cores). The limiter starts at a few parts in flight and measures throughput over rounds of
//! `limit` completed parts, from the parts' own completion times, and remembers the best round.
//! A round at least 10% faster than the best becomes the best and raises the limit by half (up to
//! `max_in_flight`); a round at least 10% slower than the best goes back to the best round's
//! limit (and, if it was already there, takes the slower rate as the new best, since the store
//! itself got slower); anything in between keeps the limit.

use std::time::Instant;

/// Parts in flight to start with, before anything is measured.
const START: usize = 4;
const MIN: usize = 2;

#[derive(Debug)]
pub(super) struct PartLimiter {
    limit: usize,
    max: usize,
    round_start: Instant,
    round_bytes: u64,
    round_parts: usize,
    round_end: Instant,
    best_rate: f64,
    best_limit: usize,
}

impl PartLimiter {
    pub(super) fn new(max: usize) -> PartLimiter {
        let max = max.max(1);
        let now = Instant::now();
        PartLimiter {
            limit: START.min(max),
            max,
            round_start: now,
            round_bytes: 0,
            round_parts: 0,
            round_end: now,
            best_rate: 0.0,
            best_limit: START.min(max),
        }
    }

    /// Parts that may be in flight now.
    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// Records a part of `bytes` that finished uploading at `done`.
    pub(super) fn completed(&mut self, bytes: u64, done: Instant) {
        self.round_bytes += bytes;
        self.round_parts += 1;
        self.round_end = self.round_end.max(done);
        if self.round_parts < self.limit {
            return;
        }
        let secs = self
            .round_end
            .duration_since(self.round_start)
            .as_secs_f64();
        let rate = self.round_bytes as f64 / secs.max(1e-6);
        if rate >= self.best_rate * 1.1 {
            self.best_rate = rate;
            self.best_limit = self.limit;
            self.limit = (self.limit + self.limit.div_ceil(2)).min(self.max);
        } else if rate <= self.best_rate * 0.9 {
            if self.limit == self.best_limit {
                self.best_rate = rate;
            }
            self.limit = self.best_limit.max(MIN.min(self.max));
        }
        self.round_start = self.round_end;
        self.round_bytes = 0;
        self.round_parts = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Feeds rounds whose throughput is `rate(limit)` and returns the limits seen.
    fn climb(max: usize, rate: impl Fn(usize) -> f64, rounds: usize) -> Vec<usize> {
        let mut l = PartLimiter::new(max);
        let mut t = l.round_start;
        let mut seen = vec![l.limit()];
        for _ in 0..rounds {
            let n = l.limit();
            // n parts of 8 MiB at `rate` bytes/s in total.
            let per_part = Duration::from_secs_f64((8 << 20) as f64 / rate(n));
            for _ in 0..n {
                t += per_part;
                l.completed(8 << 20, t);
            }
            seen.push(l.limit());
        }
        seen
    }

    #[test]
    fn grows_while_parallelism_pays() {
        // A per-connection cap: throughput proportional to parts in flight.
        let seen = climb(16, |n| n as f64 * 100e6, 8);
        assert_eq!(*seen.last().unwrap(), 16, "{seen:?}");
    }

    #[test]
    fn stays_low_when_the_server_is_the_limit() {
        // A saturated server: more parts do not help.
        let seen = climb(16, |_| 200e6, 8);
        assert!(seen.iter().all(|l| *l <= 6), "{seen:?}");
    }

    #[test]
    fn backs_off_when_parallelism_hurts() {
        let seen = climb(16, |n| 400e6 / n as f64, 8);
        assert!(*seen.last().unwrap() <= 4, "{seen:?}");
    }
}
