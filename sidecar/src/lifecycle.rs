//! The sidecar's lifecycle, an explicit state machine:
//!
//! ```text
//! starting ──► recovering ──► ready ──► draining ──► (exit)
//!     │             │                      ▲
//!     └─────────────┴──────────────────────┘   (SIGTERM at any point)
//! ```
//!
//! - **starting**: configuration checked, listeners bound; `/livez` answers, `/readyz` does not.
//! - **recovering**: the node asks its peers for the shards they hold for it (a replacement node
//!   with the same id pulls them back) before it serves training processes.
//! - **ready**: `/readyz` answers 200; training processes are served.
//! - **draining**: after SIGTERM: no new saves are accepted, in-flight persistence gets the grace
//!   period, then the process exits. `/readyz` is 503 again.
//!
//! Any other transition is a bug and is refused (and logged); draining is final.

use std::fmt;
use std::sync::{Mutex, PoisonError};

use tracing::{error, info};

/// Where the sidecar is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
    Starting,
    Recovering,
    Ready,
    Draining,
}

impl State {
    /// Every state, in order.
    pub const ALL: [State; 4] = [
        State::Starting,
        State::Recovering,
        State::Ready,
        State::Draining,
    ];

    /// The lower-case name used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Recovering => "recovering",
            State::Ready => "ready",
            State::Draining => "draining",
        }
    }

    fn may_become(self, next: State) -> bool {
        use State::*;
        matches!(
            (self, next),
            (Starting, Recovering)
                | (Recovering, Ready)
                | (Starting | Recovering | Ready, Draining)
        )
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The current state, shared by every part of the daemon.
#[derive(Debug)]
pub struct Lifecycle {
    state: Mutex<State>,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle::new()
    }
}

impl Lifecycle {
    /// A lifecycle in `starting`.
    pub fn new() -> Lifecycle {
        Lifecycle {
            state: Mutex::new(State::Starting),
        }
    }

    /// The state now.
    pub fn get(&self) -> State {
        *self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves to `next` if the machine allows it; false (and an error logged) otherwise.
    pub fn advance(&self, next: State) -> bool {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if !s.may_become(next) {
            if *s != next {
                error!(from = %*s, to = %next, "refused lifecycle transition");
            }
            return false;
        }
        info!(from = %*s, to = %next, "sidecar state");
        *s = next;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_forward_transitions_and_draining_is_final() {
        let l = Lifecycle::new();
        assert!(!l.advance(State::Ready), "starting cannot skip recovery");
        assert!(l.advance(State::Recovering));
        assert!(!l.advance(State::Starting));
        assert!(l.advance(State::Ready));
        assert_eq!(l.get(), State::Ready);
        assert!(l.advance(State::Draining));
        for s in State::ALL {
            assert!(!l.advance(s), "left draining for {s}");
        }
        assert_eq!(l.get(), State::Draining);

        let early = Lifecycle::new();
        assert!(early.advance(State::Draining), "SIGTERM while starting");
    }
}
