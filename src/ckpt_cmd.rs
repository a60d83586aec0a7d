//! `hotstart ckpt ...`: list, show, verify and garbage-collect checkpoints.
//!
//! Thin: every command opens a [`Checkpoints`] (a store URL or a local disk-tier directory) and
//! prints what the library returns. The library is blocking, so the commands run on a blocking
//! thread of the CLI's runtime.

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use hotstart_ckpt::Checkpoints;
use hotstart_ckpt::inspect::{ManifestState, StepInfo};

#[derive(Debug, Subcommand)]
pub enum CkptCommand {
    /// List the steps of a job (or of every job): ranks, bytes, complete or not.
    ///
    /// Example: hotstart ckpt ls s3://bucket/ckpts --job run-42
    Ls {
        #[command(flatten)]
        at: Location,
        /// Only this job.
        #[arg(long)]
        job: Option<String>,
    },
    /// Show the tensor index of one rank of one step: name, dtype, shape, bytes.
    Show {
        #[command(flatten)]
        at: Location,
        /// The job: the name its trainers gave (`Checkpointer(job=...)`), a folder under STORE.
        #[arg(long)]
        job: String,
        /// The step (default: the newest complete one).
        #[arg(long)]
        step: Option<u64>,
        #[arg(long, default_value_t = 0)]
        rank: u32,
    },
    /// Re-hash every chunk of every rank; exits non-zero naming each bad chunk.
    Verify {
        #[command(flatten)]
        at: Location,
        /// The job: the name its trainers gave (`Checkpointer(job=...)`), a folder under STORE.
        #[arg(long)]
        job: String,
        /// Only this step (default: every complete step).
        #[arg(long)]
        step: Option<u64>,
    },
    /// Keep the newest N complete steps; remove older ones and torn steps older than them.
    ///
    /// Run it while no trainer of the job writes older steps.
    Gc {
        #[command(flatten)]
        at: Location,
        /// The job: the name its trainers gave (`Checkpointer(job=...)`), a folder under STORE.
        #[arg(long)]
        job: String,
        /// Complete steps to keep (0 keeps them all, as everywhere else).
        #[arg(long)]
        keep: usize,
    },
}

#[derive(Debug, Args)]
pub struct Location {
    /// A store URL (s3://bucket/prefix, file:///path, ...) or a local disk-tier directory: the
    /// `--store` or `--disk-dir` the trainers or their sidecar were given, which holds one folder
    /// per job.
    store: String,
}

impl Location {
    fn open(&self) -> anyhow::Result<Checkpoints> {
        Checkpoints::open(&self.store).with_context(|| format!("opening {}", self.store))
    }
}

/// A line of output. A reader that went away (`hotstart ckpt ls | head`) ends the program
/// quietly, as for every command (`main.rs`).
macro_rules! out {
    ($($arg:tt)*) => {
        println!($($arg)*)
    };
}

pub async fn run(cmd: CkptCommand) -> anyhow::Result<()> {
    tokio::task::spawn_blocking(move || run_blocking(cmd))
        .await
        .context("ckpt command thread")?
}

fn run_blocking(cmd: CkptCommand) -> anyhow::Result<()> {
    match cmd {
        CkptCommand::Ls { at, job } => {
            let ck = at.open()?;
            let jobs = match &job {
                Some(j) => vec![j.clone()],
                None => ck.jobs()?,
            };
            // Listed before the header is printed: a store that cannot be read prints the
            // error alone, not an empty table above it.
            let steps = jobs
                .iter()
                .map(|job| ck.steps(job))
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(job) = job.filter(|_| steps.iter().all(|s| s.is_empty())) {
                return Err(ck.no_steps(&job).into());
            }
            if jobs.is_empty() {
                // An empty table alone would not say whether this is the right place.
                eprintln!(
                    "no checkpoints at {}: no job folder there holds a step (if it is a job's \
                     own folder, give the folder above it, with --job NAME)",
                    ck.location()
                );
            }
            out!(
                "{:<24} {:>12} {:>7} {:>14}  STATE",
                "JOB",
                "STEP",
                "RANKS",
                "BYTES"
            );
            for s in steps.iter().flatten() {
                print_step(s)?;
            }
            Ok(())
        }
        CkptCommand::Show {
            at,
            job,
            step,
            rank,
        } => {
            let ck = at.open()?;
            let step = match step {
                Some(s) => s,
                None => ck
                    .latest_complete(&job)?
                    .with_context(|| format!("job {job:?} has no complete step"))?,
            };
            let m = match ck.manifest(&job, step, rank) {
                Err(e) if e.is_not_found() => {
                    // Say what is there, as a load of a missing step does.
                    let steps: Vec<u64> = ck.steps(&job)?.iter().map(|s| s.step).collect();
                    if steps.is_empty() {
                        return Err(ck.no_steps(&job).into());
                    }
                    bail!(
                        "job {job:?} has no manifest of step {step} rank {rank} at {}; its \
                         steps: {steps:?} (`hotstart ckpt ls` says which are complete)",
                        ck.location()
                    );
                }
                res => res?,
            };
            out!(
                "job {} step {} rank {} of {}: {} tensors, {} bytes, {} chunks of {} bytes",
                m.job,
                m.step,
                m.rank,
                m.world_size,
                m.tensors.len(),
                m.file_len,
                m.chunks.len(),
                m.chunk_size
            );
            let extras = m.decode_extras().unwrap_or_default();
            for (name, bytes) in &extras {
                out!("extra {name}: {} bytes", bytes.len());
            }
            out!(
                "{:<40} {:<8} {:<24} {:>14}",
                "NAME",
                "DTYPE",
                "SHAPE",
                "BYTES"
            );
            for t in &m.tensors {
                out!(
                    "{:<40} {:<8} {:<24} {:>14}",
                    t.name,
                    t.dtype.as_str(),
                    format!("{:?}", t.shape),
                    t.len()
                );
            }
            Ok(())
        }
        CkptCommand::Verify { at, job, step } => {
            let ck = at.open()?;
            let report = ck.verify(&job, step)?;
            for &(step, rank, chunks, bytes) in &report.checked {
                out!("checked step {step} rank {rank}: {chunks} chunks, {bytes} bytes");
            }
            for s in &report.skipped_incomplete {
                out!("skipped step {s}: incomplete");
            }
            if report.checked.is_empty() && report.problems.is_empty() {
                bail!("job {job:?} has no complete step to verify");
            }
            if !report.ok() {
                for p in &report.problems {
                    eprintln!("BAD {p}");
                }
                bail!("verify failed: {} problem(s)", report.problems.len());
            }
            out!("ok: {} rank file(s) verified", report.checked.len());
            Ok(())
        }
        CkptCommand::Gc { at, job, keep } => {
            let ck = at.open()?;
            let report = ck.gc(&job, keep)?;
            for s in &report.removed {
                out!("removed step {s}");
            }
            out!(
                "kept {} complete step(s): {:?}",
                report.kept.len(),
                report.kept
            );
            // Said, so that the listing after gc holds no surprise.
            if !report.pending.is_empty() {
                out!(
                    "left alone {} newer incomplete step(s) (a save may still be writing them): {:?}",
                    report.pending.len(),
                    report.pending
                );
            }
            Ok(())
        }
    }
}

fn print_step(s: &StepInfo) -> anyhow::Result<()> {
    let ranks = match s.world_size {
        Some(ws) => format!("{}/{ws}", s.committed_ranks()),
        None => format!("{}/?", s.committed_ranks()),
    };
    let state = match s.incomplete_reason() {
        None => "complete".to_string(),
        Some(why) => format!("incomplete ({why})"),
    };
    out!(
        "{:<24} {:>12} {:>7} {:>14}  {state}",
        s.job,
        s.step,
        ranks,
        s.bytes
    );
    // With no valid manifest the state line cannot say why each rank is unusable.
    for r in s.ranks.iter().filter(|_| s.world_size.is_none()) {
        if let ManifestState::Invalid(why) = &r.manifest {
            out!("    rank {}: invalid manifest: {why}", r.rank);
        }
    }
    Ok(())
}
