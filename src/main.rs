//! The `hotstart` binary: argument parsing that turns into the library crates' config structs.

mod ckpt_cmd;
mod env_cmd;
mod mount_cmd;
mod store_cmd;

use clap::{Parser, Subcommand};

/// hotstart makes large-model training jobs restart in seconds: asynchronous checkpoints kept in
/// memory, on peers, on local disk and in object storage; striped object-store I/O; lazy images.
///
/// Stores are named by URL: a directory path or file:///path (the embedded default),
/// s3://bucket/prefix (endpoint, region and credentials from the AWS_* variables, e.g.
/// AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP=true for
/// plain-HTTP servers), gs:// and az:// where built in.
///
/// Logging: HOTSTART_LOG=debug (or any tracing EnvFilter, e.g. hotstart_store=trace).
#[derive(Debug, Parser)]
#[command(name = "hotstart", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Copy and list objects with striped, parallel transfers.
    #[command(subcommand)]
    Store(store_cmd::StoreCommand),
    /// List, show, verify and garbage-collect checkpoints in a store or disk-tier directory.
    #[command(subcommand)]
    Ckpt(ckpt_cmd::CkptCommand),
    /// Mount a store as a directory: striped parallel reads and writes of plain objects.
    Mount(mount_cmd::MountArgs),
    /// Dependency snapshots: restore an installed environment instead of reinstalling it.
    #[command(subcommand)]
    Env(env_cmd::EnvCommand),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HOTSTART_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hotstart: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Store(cmd) => store_cmd::run(cmd).await,
            Command::Ckpt(cmd) => ckpt_cmd::run(cmd).await,
            Command::Mount(args) => mount_cmd::run(args).await,
            Command::Env(cmd) => env_cmd::run(cmd).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hotstart: {e:#}");
            match env_cmd::exit_code(&e) {
                Some(code) => std::process::ExitCode::from(code),
                None => std::process::ExitCode::FAILURE,
            }
        }
    }
}
