//! hotstart-demo: the main job, `hotstart demo`.
//!
//! On one machine it runs what a training job on three nodes looks like with hotstart: a
//! sidecar per node (`hotstart serve`: shared-memory checkpoints, peer replicas, a local disk
//! tier and an object store tier) and a trainer per node, each a real process training a real
//! model ([`model`]: an embedding table under an MLP, about 1 GiB of parameters and Adam
//! moments) and checkpointing through its sidecar ([`trainer`]). It then injects the faults a
//! real job meets and shows the job resume each time, proving the state bit-exact
//! ([`scenario`] tells the story): a trainer killed, a whole node killed, a corrupt chunk on disk
//! found when every node restarts. [`cluster`] runs the processes; [`view`] shows progress (live
//! on a terminal) and checks every restore and every replayed step as events arrive.
//!
//! [`chaos`] runs the same cluster under a random fault campaign drawn from a seed
//! (`hotstart demo --chaos N --seed S`), checking the job's invariants after every fault.

pub mod chaos;
pub mod cluster;
pub mod elastic;
pub mod event;
pub mod link;
pub mod model;
pub mod scenario;
pub mod shard;
pub mod trainer;
pub mod view;

use std::path::PathBuf;

pub use scenario::{Summary, run};
pub use trainer::TrainerConfig;

/// Everything `hotstart demo` can set.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// The `hotstart` binary (sidecars and trainers are this binary too).
    pub exe: PathBuf,
    /// Where sockets, disk tiers, logs (and the store, by default) go.
    pub dir: PathBuf,
    /// The store tier's URL; a directory under `dir` by default.
    pub store: Option<String>,
    /// Nodes (one trainer each).
    pub nodes: usize,
    /// Bytes of training state per trainer.
    pub state_bytes: u64,
    /// Steps between checkpoints.
    pub every: u64,
    pub seed: u64,
    /// Live lines on a terminal.
    pub live: bool,
    /// The trainers' kind.
    pub trainer: TrainerKind,
    /// Tell the elastic story instead ([`elastic`]): a node lost and not replaced, the job
    /// resharded onto fewer ranks, then grown back.
    pub elastic: bool,
}

/// Which trainers the demo runs, one per node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TrainerKind {
    /// This binary (`hotstart demo --run-trainer`): the model of [`model`], in Rust.
    #[default]
    Rust,
    /// A PyTorch trainer under torchrun, `python -m torch.distributed.run --standalone
    /// --nproc-per-node 1 -m hotstart._demo_trainer`, with this Python (which has torch and
    /// the `hotstart` package): an embedding and an MLP trained with Adam, checkpointed
    /// through `hotstart.Checkpointer`, telling the demo the same events.
    Torch { python: PathBuf },
}

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Ckpt(#[from] hotstart_ckpt::Error),
    #[error("timed out waiting for {0}")]
    Timeout(String),
    #[error("{what} exited ({status}); its log: {}", log.display())]
    Exited {
        what: String,
        status: String,
        log: PathBuf,
    },
    #[error("check failed: {0}")]
    Check(String),
    #[error("{0}")]
    Resources(String),
    #[error("unexpected: {0}")]
    Protocol(String),
}

impl Error {
    pub(crate) fn io(what: &'static str, source: std::io::Error) -> Error {
        Error::Io { what, source }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// `bytes` in GiB or MiB, for people.
pub fn bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// The summary as a table, for people.
pub fn table(s: &Summary) -> String {
    let mut out = String::new();
    let line = |out: &mut String, l: String| {
        out.push_str(&l);
        out.push('\n');
    };
    line(
        &mut out,
        format!(
            "hotstart demo: {} nodes, {} trainers, {} of training state per rank, store {}, {:.0} s",
            s.nodes,
            s.trainer,
            bytes(s.state_bytes_per_rank),
            s.store,
            s.seconds
        ),
    );
    line(&mut out, String::new());
    line(
        &mut out,
        format!(
            "training stall per checkpoint (save → wait_staged), steady state: median {:.0} ms, max {:.0} ms, over {} checkpoints; \
             of it the copy median {:.0} ms, and the wait for the segment prepared after the last commit (an older step's, once its persistence lets go, or new memory) median {:.0} ms, max {:.0} ms; \
             copy floor {:.0} ms (the same bytes into memory already mapped, one process alone), {:.0} ms when every trainer copies at once; \
             the first save of each trainer process (it maps memory new to it) median {:.0} ms over {}",
            s.stall_seconds.median * 1e3,
            s.stall_seconds.max * 1e3,
            s.stall_seconds.count,
            s.copy_seconds.median * 1e3,
            s.queued_seconds.median * 1e3,
            s.queued_seconds.max * 1e3,
            s.copy_floor_seconds * 1e3,
            s.copy_floor_together_seconds * 1e3,
            s.first_stall_seconds.median * 1e3,
            s.first_stall_seconds.count
        ),
    );
    line(&mut out, String::new());
    line(
        &mut out,
        format!(
            "{:<8} {:>14} {:>14} {:>16}",
            "tier", "median time", "max time", "throughput"
        ),
    );
    for t in &s.tiers {
        line(
            &mut out,
            format!(
                "{:<8} {:>12.2} s {:>12.2} s {:>11.0} MiB/s",
                t.tier,
                t.seconds.median,
                t.seconds.max,
                t.bytes_per_second / (1u64 << 20) as f64
            ),
        );
    }
    line(&mut out, "(time from a save's start until the tier holds it; throughput: one rank's state over that time)".into());
    line(&mut out, String::new());
    for f in &s.faults {
        line(&mut out, format!("fault: {}", f.fault));
        line(
            &mut out,
            format!(
                "  recovered in {:.2} s from the fault to every rank's state in place; resumed from step {}",
                f.recovery_seconds, f.step
            ),
        );
        for (r, (src, secs)) in f.sources.iter().zip(&f.restore_seconds).enumerate() {
            line(
                &mut out,
                format!("  rank {r}: loaded in {secs:.2} s from {src}"),
            );
        }
        line(
            &mut out,
            format!(
                "  bit-exact: {} (state hash equal to the hash at save{})",
                if f.exact { "yes" } else { "NO" },
                if f.replayed_steps > 0 {
                    format!(
                        "; {} steps trained again, summed over the ranks, every loss equal",
                        f.replayed_steps
                    )
                } else {
                    String::new()
                }
            ),
        );
    }
    if !s.problems.is_empty() {
        line(&mut out, String::new());
        for p in &s.problems {
            line(&mut out, format!("PROBLEM: {p}"));
        }
    }
    out
}
