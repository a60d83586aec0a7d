//! The `hotstart` binary: argument parsing that turns into the library crates' config structs.

mod ckpt_cmd;
mod demo_cmd;
mod env_cmd;
mod image_cmd;
mod mount_cmd;
mod serve_cmd;
mod snapshotter_cmd;
mod store_cmd;
mod tls_cmd;

use clap::{Parser, Subcommand};

/// hotstart makes large-model training jobs restart in seconds: asynchronous checkpoints kept in
/// memory, on peers, on local disk and in object storage; striped object-store I/O; lazy images.
///
/// Stores are named by URL: a directory path or file:///path (the embedded default),
/// s3://bucket/prefix (endpoint, region and credentials from the AWS_* variables, e.g.
/// AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP=true for
/// plain-HTTP servers), gs:// and az:// where built in.
///
/// Logging: HOTSTART_LOG=debug (or any tracing EnvFilter, e.g. hotstart_store=trace); the
/// default is warn, and info for `serve`.
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
    /// Run the node's sidecar: the memory tier of checkpoints, backed up to peers and
    /// persisted to disk and store, restores from the nearest tier, /livez /readyz /metrics.
    Serve(Box<serve_cmd::ServeArgs>),
    /// The main job: 3 sidecars and 3 trainers on this machine, faults injected (kill -9 of a
    /// trainer, of a node, a corrupt chunk) and recovered, the state proved bit-exact.
    Demo(Box<demo_cmd::DemoArgs>),
    /// Lazy images: build from a directory, tarball or OCI layout; mount read-only with
    /// hot-chunk record and prefetch; pull; list, inspect and report.
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
    /// Dependency snapshots: restore an installed environment instead of reinstalling it.
    #[command(subcommand)]
    Env(env_cmd::EnvCommand),
    /// Serve container snapshots to containerd (a proxy snapshotter on a unix socket).
    Snapshotter(snapshotter_cmd::SnapshotterArgs),
    /// Certificates for encrypted peer links: a cluster CA and one certificate per node.
    #[command(subcommand)]
    Tls(tls_cmd::TlsCommand),
}

fn main() -> std::process::ExitCode {
    quiet_on_closed_stdout();
    let cli = Cli::parse();
    // The daemon logs what it does (state changes, restores and where they came from).
    let default_filter = match cli.command {
        Command::Serve(_) | Command::Snapshotter(_) => "info",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("HOTSTART_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // The demo drives blocking engines and child processes: no async runtime around it.
    let command = match cli.command {
        Command::Demo(args) => return exit(demo_cmd::run(*args)),
        other => other,
    };
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
        match command {
            Command::Store(cmd) => store_cmd::run(cmd).await,
            Command::Ckpt(cmd) => ckpt_cmd::run(cmd).await,
            Command::Mount(args) => mount_cmd::run(args).await,
            Command::Serve(args) => serve_cmd::run(*args).await,
            // Handled above, before the runtime started.
            Command::Demo(_) => Err(anyhow::anyhow!("the demo runs without an async runtime")),
            Command::Image(cmd) => image_cmd::run(cmd).await,
            Command::Env(cmd) => env_cmd::run(cmd).await,
            Command::Snapshotter(args) => snapshotter_cmd::run(args).await,
            Command::Tls(cmd) => tls_cmd::run(cmd),
        }
    });
    exit(result)
}

/// An error and its causes, joined by ": ", each cause once: many errors already end with their
/// source's message, which `{:#}` would print twice ("entity not found: entity not found").
fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn exit(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hotstart: {}", chain(&e));
            match env_cmd::exit_code(&e) {
                Some(code) => std::process::ExitCode::from(code),
                None => std::process::ExitCode::FAILURE,
            }
        }
    }
}

/// Output piped into a reader that stops early (`hotstart env ls | head -1`) ends the program
/// quietly and successfully, as `hotstart ckpt` does (a filter whose reader went away is done),
/// instead of a panic and its backtrace. SIGPIPE itself stays ignored: a peer that closes a
/// socket must not kill a sidecar or a mount.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if message.starts_with("failed printing to stdout")
            && message.ends_with(&std::io::Error::from_raw_os_error(libc::EPIPE).to_string())
        {
            std::process::exit(0);
        }
        default(info)
    }));
}
