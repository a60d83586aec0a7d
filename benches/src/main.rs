//! `hotstart-bench`: benchmarks that run hotstart and the tool a user would pick instead, in the
//! same run on the same data, and print the ratio.
//!
//! ```text
//! cargo run --profile bench -p hotstart-benches -- store            # every store benchmark
//! cargo run --profile bench -p hotstart-benches -- store --only uring
//! cargo run --profile bench -p hotstart-benches -- ckpt --gib 4     # checkpoint engine
//! cargo run --profile bench -p hotstart-benches -- fuse --gib 2     # hotstart mount vs FUSE peers
//! cargo run --profile bench -p hotstart-benches -- sidecar --gib 4  # sidecar restores
//! cargo run --profile bench -p hotstart-benches -- restart --gib 2  # a torchrun job restarting
//! cargo run --profile bench -p hotstart-benches -- image            # lazy images vs local copy and pull
//! cargo run --profile bench -p hotstart-benches -- env              # snapshot restore vs pip, uv
//! cargo run --profile bench -p hotstart-benches -- all              # everything, results page
//! ```
//!
//! Each benchmark repeats its measurements (`--runs`, default 3) and reports medians.

mod all;
mod chart;
mod ckpt;
mod container;
mod elastic;
mod env;
mod fuse;
mod image;
mod report;
mod restart;
mod sidecar;
mod store_striped;
mod store_uring;
mod swarm;
mod swarm_model;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "hotstart-bench",
    about = "hotstart benchmarks against the alternatives"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Storage substrate: striped object I/O and io_uring local files.
    Store(StoreArgs),
    /// Checkpoint engine: training stall, durable persist and cold load.
    Ckpt(ckpt::CkptArgs),
    /// `hotstart mount` against direct striped I/O, weed mount, s3fs and rclone mount.
    Fuse(fuse::FuseArgs),
    /// The sidecar: restores from local memory, from a peer, and a restarted process.
    Sidecar(sidecar::SidecarArgs),
    /// A PyTorch job under torchrun restarting after a kill -9, phase by phase, against the
    /// floor of starting, importing torch, building the model and copying its state.
    Restart(restart::RestartArgs),
    /// (internal) The restarted training process of the sidecar benchmark.
    #[command(hide = true)]
    SidecarRestore(sidecar::RestoreChild),

    /// Starting Python with numpy from a lazy image, against a local copy and a full pull.
    Image(image::ImageArgs),

    /// Starting a container with containerd: hotstart's snapshotter against containerd's own
    /// pull and unpack, and against the image already unpacked.
    Container(container::ContainerArgs),

    /// Environment snapshots: restore against pip, uv (cold and warm cache) and tar.
    Env(env::EnvArgs),

    /// Every benchmark above (and the Python package's), then benches/results/BENCHMARKS.md,
    /// charts, and the full table in docs/PERFORMANCE.md.
    All(all::AllArgs),

    /// N nodes (network namespaces) starting the same environment and checkpoint at once,
    /// sharing chunks through their sidecars, against each node reading the store.
    Swarm(swarm::SwarmArgs),
    /// The chunk-sharing design at 1,000 and 10,000 nodes: a piece-level simulation fed with
    /// the rates the swarm benchmark measures.
    SwarmModel(swarm_model::ModelArgs),
    /// (internal) A rank of the swarm benchmark's data-parallel job.
    #[command(hide = true)]
    SwarmRank(swarm::SwarmRank),
}

#[derive(Debug, clap::Args)]
pub struct StoreArgs {
    /// Run only one part.
    #[arg(long, value_enum)]
    only: Option<StorePart>,
    /// Object size in MiB for the striped benchmarks.
    #[arg(long, default_value_t = 1024)]
    object_mib: usize,
    /// Stripe size in MiB for striped reads and writes.
    #[arg(long, default_value_t = 8)]
    stripe_mib: usize,
    /// Stripes in flight per reader or writer.
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
    /// File size in MiB for the uring benchmark.
    #[arg(long, default_value_t = 2048)]
    file_mib: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Directory on the disk to measure (uring vs fio).
    #[arg(long, default_value = "/var/tmp")]
    dir: std::path::PathBuf,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StorePart {
    /// StripedReader/StripedWriter vs one GET/PUT on loopback SeaweedFS and a local directory.
    Striped,
    /// The same over an emulated remote link.
    Remote,
    /// io_uring files vs fio.
    Uring,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Store(args) => {
            let mut report = report::Report::new("hotstart store benchmarks");
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let want = |p: StorePart| args.only.is_none_or(|o| o == p);
            if want(StorePart::Striped) {
                runtime.block_on(store_striped::loopback(&args, &mut report))?;
            }
            if want(StorePart::Remote) {
                runtime.block_on(store_striped::remote(&args, &mut report))?;
            }
            if want(StorePart::Uring) {
                store_uring::run(&args, &mut report)?;
            }
            report.finish(args.markdown.as_deref())?;
        }
        Command::Ckpt(args) => ckpt::run(&args)?,
        Command::Fuse(args) => fuse::run(&args)?,
        Command::Sidecar(args) => sidecar::run(&args)?,
        Command::SidecarRestore(args) => sidecar::restore_child(&args)?,
        Command::Restart(args) => restart::run(&args)?,
        Command::Image(args) => image::run(&args)?,
        Command::Container(args) => container::run(&args)?,
        Command::Env(args) => env::run(&args)?,
        Command::All(args) => all::all(&args)?,
        Command::Swarm(args) => swarm::run(&args)?,
        Command::SwarmRank(args) => swarm::rank(&args)?,
        Command::SwarmModel(args) => swarm_model::run(&args)?,
    }
    Ok(())
}
