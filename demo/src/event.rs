//! What a demo trainer tells the orchestrator: one JSON object per line on its stdout.

use serde::{Deserialize, Serialize};

/// One thing a trainer did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// Attached to its sidecar, with a state of this many bytes.
    Started { rank: u32, state_bytes: u64 },
    /// No checkpoint to restore: a freshly initialised model.
    Fresh { rank: u32 },
    /// State restored from `step`: the tier each chunk came from, how long the load took (from
    /// the request to the state in place), and the blake3 of the restored state.
    Restored {
        rank: u32,
        step: u64,
        sources: Vec<String>,
        seconds: f64,
        hash: String,
    },
    /// State of step `step` (saved by a job of `from_world` ranks) loaded by a rank of a job of
    /// another size, or of the same (`hotstart demo --elastic`): each row it now holds from the
    /// old rank that held it. As [`Event::Restored`], with `hash` this rank's part of the job's
    /// state digest ([`crate::shard`]).
    Resharded {
        rank: u32,
        step: u64,
        from_world: u32,
        sources: Vec<String>,
        seconds: f64,
        hash: String,
    },
    /// One training step and its loss (the bits of the `f32`, so replays compare exactly);
    /// with `--elastic`, also this rank's part of the job's loss digest of the step.
    Step {
        rank: u32,
        step: u64,
        loss_bits: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        loss_digest: Option<String>,
    },
    /// A checkpoint staged: how long training waited (`save` to `wait_staged`), the part of
    /// that before the copy began (`save` itself: waiting for earlier saves that still persist
    /// to make room, and for a segment of the sidecar), and the blake3 of the state it holds.
    Saved {
        rank: u32,
        step: u64,
        stall_seconds: f64,
        #[serde(default)]
        wait_seconds: f64,
        hash: String,
    },
    /// A tier finished a checkpoint, `seconds` after its save began (`error` if it failed).
    Persisted {
        rank: u32,
        step: u64,
        tier: String,
        seconds: f64,
        error: Option<String>,
    },
}

impl Event {
    /// The rank that sent it.
    pub fn rank(&self) -> u32 {
        match self {
            Event::Started { rank, .. }
            | Event::Fresh { rank }
            | Event::Restored { rank, .. }
            | Event::Resharded { rank, .. }
            | Event::Step { rank, .. }
            | Event::Saved { rank, .. }
            | Event::Persisted { rank, .. } => *rank,
        }
    }
}
