//! `hotstart env ...`: dependency snapshots (key, ensure, ls, gc).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::{Args, Subcommand};
use hotstart_env::gc::{GcOptions, gc, list};
use hotstart_env::{
    EnsureConfig, EnvStore, Key, KeyInputs, KeySpec, LazyOutcome, Outcome, RestoreOptions,
    default_cache_dir, ensure, ensure_lazy,
};
use hotstart_image::LazyConfig;
use hotstart_store::{ChunkStoreConfig, Store};
use humansize::{BINARY, format_size};

use crate::mount_cmd::Signals;

#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// Print the snapshot key of an environment: blake3 over the lock files' bytes, the
    /// interpreter's version and ABI, the platform (arch, libc), the install command and the
    /// target path.
    ///
    /// Example:
    ///   hotstart env key --lock requirements.txt --target /opt/venv -- \
    ///       sh -c 'python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt'
    ///
    /// Same inputs give the same key on any machine; any change gives another key. Without
    /// --target (or with --relocatable) the target is left out: the key of a relocatable
    /// snapshot.
    #[command(verbatim_doc_comment)]
    Key(KeyArgs),
    /// Make DIR hold the environment: restore its snapshot on a hit; on a miss run the install
    /// command, then capture DIR and publish it for every later ensure on any node.
    ///
    /// Example:
    ///   hotstart env ensure --store s3://bucket/envs --lock requirements.txt --target /opt/venv -- \
    ///       sh -c 'python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt'
    ///
    /// Prints what happened (already present, restored, or installed and published) and how long
    /// it took. A restore goes into a temporary directory renamed into place, so DIR is never half
    /// written. Concurrent ensures of one key on a node do the work once; across nodes the first
    /// complete snapshot is published. A failing install command publishes nothing, removes what
    /// it left in DIR, and hotstart exits with its exit code. DIR must be absent or made by an
    /// earlier ensure on this node (which is replaced when the inputs changed).
    ///
    /// With --lazy, a hit mounts the snapshot read-only at DIR instead of restoring it: files are
    /// fetched as they are first read, the chunks that earlier lazy starts of this snapshot read
    /// (on any node) are prefetched ahead of them in order, and this run's first reads are
    /// recorded into that profile, kept in the store beside the snapshot. ensure then stays in
    /// the foreground serving the mount until SIGINT or SIGTERM, unmounts and merges the
    /// profile. DIR may then also be an empty directory (it is mounted on, and left in place);
    /// an absent DIR is created and removed again at unmount. A snapshot that names its capture
    /// path (a venv does) mounts only at that path: elsewhere --lazy refuses, and an eager
    /// ensure restores and rewrites it. On a miss --lazy installs and publishes as usual and
    /// exits: DIR is then a real directory, as it is when it already holds the environment.
    ///
    ///   hotstart env ensure --lazy --store s3://bucket/envs --lock requirements.txt \
    ///       --target /opt/venv -- sh -c '...' &
    ///   # ... the job runs from /opt/venv; then: kill %1 (unmounts, saves the profile)
    #[command(verbatim_doc_comment)]
    Ensure(EnsureArgs),
    /// List the snapshots in a store: key, age, size, interpreter, target and install command.
    Ls(LsArgs),
    /// Delete snapshots (by key or age), orphaned trees and chunks no snapshot uses.
    ///
    /// Examples:
    ///   hotstart env gc --store s3://bucket/envs                     # only orphans
    ///   hotstart env gc --store s3://bucket/envs --older-than 30d
    ///   hotstart env gc --store s3://bucket/envs --key 3f2a... --dry-run
    ///
    /// Refuses to run (and says who holds it) while a capture is publishing to the store.
    #[command(verbatim_doc_comment)]
    Gc(GcArgs),
}

#[derive(Debug, Args)]
pub struct KeySpecArgs {
    /// A lock or requirements file whose bytes enter the key (repeat for several; order counts).
    #[arg(long = "lock", value_name = "FILE", required = true)]
    locks: Vec<PathBuf>,
    /// The interpreter the environment is for; its version, ABI and installation path enter the
    /// key.
    #[arg(long, default_value = "python3", env = "HOTSTART_ENV_PYTHON")]
    python: String,
    /// Leave the target path out of the key; a restore at another path rewrites pyvenv.cfg, the
    /// scripts' shebangs and other text files that name the old path.
    #[arg(long)]
    relocatable: bool,
}

#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(flatten)]
    spec: KeySpecArgs,
    /// The directory the environment is installed into.
    #[arg(long, value_name = "DIR")]
    target: Option<PathBuf>,
    /// Also print every input of the key, as JSON.
    #[arg(long)]
    explain: bool,
    /// The install command (after `--`).
    #[arg(last = true, value_name = "INSTALL COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct StoreArg {
    /// Where snapshots live (a directory, file://, s3://bucket/prefix); they go under `envs/`.
    #[arg(long, env = "HOTSTART_ENV_STORE", value_name = "URL")]
    store: String,
}

#[derive(Debug, Args)]
pub struct EnsureArgs {
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    spec: KeySpecArgs,
    /// The directory that must hold the environment.
    #[arg(long, value_name = "DIR")]
    target: PathBuf,
    /// Node-local cache of chunks, locks and target state.
    #[arg(long, env = "HOTSTART_CACHE_DIR", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Bytes the chunk cache may hold.
    #[arg(long, default_value_t = 8 << 30, value_name = "BYTES")]
    cache_size: u64,
    /// Write every restored file instead of hard-linking small ones from the chunk cache.
    #[arg(long)]
    no_hardlinks: bool,
    /// Files restored at once.
    #[arg(long, default_value_t = 64)]
    files_in_flight: usize,
    /// Chunks fetched or uploaded at once.
    #[arg(long, default_value_t = 32)]
    chunks_in_flight: usize,
    /// Print the outcome as one JSON object on stdout (with --lazy, after unmounting, with the
    /// mount's report under "mount").
    #[arg(long)]
    json: bool,
    /// On a hit, mount the snapshot read-only and lazily at DIR (with its prefetch profile)
    /// instead of restoring it, and serve it until SIGINT or SIGTERM; see above.
    #[arg(long)]
    lazy: bool,
    /// With --lazy: memory for verified chunks, in MiB (prefetched chunks wait here to be read).
    #[arg(long, default_value_t = 1024, value_name = "MIB")]
    lazy_memory_mib: u64,
    /// With --lazy: do not store prefetched pages in the kernel's page cache ahead of the job
    /// (its reads then each take a request to this process, served from its memory).
    #[arg(long, requires = "lazy")]
    no_warm: bool,
    /// The install command (after `--`), run on a miss. It sees HOTSTART_ENV_TARGET and
    /// HOTSTART_ENV_KEY.
    #[arg(last = true, required = true, value_name = "INSTALL COMMAND")]
    command: Vec<String>,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    #[command(flatten)]
    store: StoreArg,
    /// One JSON record per line instead of a table.
    #[arg(long)]
    json: bool,
}

/// A duration as `--older-than` and `--grace` take it, with an example when it is not one.
fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{e}: give a duration such as 30d, 12h or 90s"))
}

#[derive(Debug, Args)]
pub struct GcArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Delete snapshots created longer ago than this (e.g. 30d, 12h).
    #[arg(long, value_parser = duration, value_name = "DURATION")]
    older_than: Option<Duration>,
    /// Delete this snapshot (repeatable; a full 64-hex key).
    #[arg(long = "key", value_name = "KEY")]
    keys: Vec<String>,
    /// Keep unreferenced trees and chunks younger than this.
    #[arg(long, default_value = "1h", value_parser = duration, value_name = "DURATION")]
    grace: Duration,
    /// Say what would be deleted; delete nothing.
    #[arg(long)]
    dry_run: bool,
}

impl KeySpecArgs {
    fn spec(&self, target: Option<PathBuf>, command: Vec<String>) -> KeySpec {
        KeySpec {
            locks: self.locks.clone(),
            python: self.python.clone(),
            command,
            target: if self.relocatable { None } else { target },
        }
    }
}

impl StoreArg {
    fn env(&self, chunks: ChunkStoreConfig) -> anyhow::Result<EnvStore> {
        let store = Store::open(&self.store)?;
        Ok(EnvStore::new(&store, chunks)?)
    }
}

/// The exit code `hotstart` leaves with for `err`, when it is not the usual failure.
pub fn exit_code(err: &anyhow::Error) -> Option<u8> {
    err.downcast_ref::<hotstart_env::Error>()?
        .install_exit_code()
        .map(|c| c.clamp(1, 255) as u8)
}

pub async fn run(cmd: EnvCommand) -> anyhow::Result<()> {
    match cmd {
        EnvCommand::Key(args) => key(args).await,
        EnvCommand::Ensure(args) => ensure_cmd(args).await,
        EnvCommand::Ls(args) => ls(args).await,
        EnvCommand::Gc(args) => gc_cmd(args).await,
    }
}

async fn key(args: KeyArgs) -> anyhow::Result<()> {
    let spec = args.spec.spec(args.target, args.command);
    let inputs = tokio::task::spawn_blocking(move || KeyInputs::gather(&spec)).await??;
    println!("{}", inputs.key());
    if args.explain {
        println!("{}", serde_json::to_string_pretty(&inputs)?);
    }
    Ok(())
}

fn size(bytes: u64) -> String {
    format_size(bytes, BINARY)
}

async fn ensure_cmd(args: EnsureArgs) -> anyhow::Result<()> {
    let store = Store::open(&args.store.store)?;
    let mut cfg = EnsureConfig::new(args.spec.locks, args.target, args.command);
    cfg.python = args.spec.python;
    cfg.relocatable = args.spec.relocatable;
    cfg.cache_dir = args.cache_dir.unwrap_or_else(default_cache_dir);
    cfg.cache_capacity = args.cache_size;
    cfg.store_concurrency = args.chunks_in_flight;
    cfg.restore = RestoreOptions {
        concurrency: args.files_in_flight,
        link_from_cache: !args.no_hardlinks,
    };
    if args.lazy {
        let lazy = LazyConfig {
            memory_cache: args.lazy_memory_mib << 20,
            warm_page_cache: !args.no_warm,
            ..hotstart_env::lazy_config()
        };
        return ensure_lazy_cmd(&store, &cfg, lazy, args.json).await;
    }
    // Errors (a failing install command included) propagate as the library's own error, so the
    // caller can turn an install failure into its exit code.
    let outcome = ensure(&store, &cfg).await?;
    print_outcome(&outcome, args.json);
    Ok(())
}

fn print_outcome(outcome: &Outcome, json: bool) {
    if json {
        println!("{}", outcome.to_json());
    }
    eprintln!("hotstart env: {outcome}");
}

/// `ensure --lazy`: mount on a hit and serve until SIGINT or SIGTERM (or an unmount from
/// outside); otherwise what an eager ensure did.
async fn ensure_lazy_cmd(
    store: &Store,
    cfg: &EnsureConfig,
    lazy: LazyConfig,
    json: bool,
) -> anyhow::Result<()> {
    // Caught from before the mount, so a signal while mounting is not lost.
    let mut signals = Signals::install()?;
    let mut mounted = match ensure_lazy(store, cfg, lazy).await? {
        LazyOutcome::Eager(outcome) => {
            print_outcome(&outcome, json);
            eprintln!(
                "hotstart env: --lazy: {} is a real directory, nothing is mounted",
                outcome.target.display()
            );
            return Ok(());
        }
        LazyOutcome::Mounted(m) => m,
    };
    let target = mounted.target.clone();
    eprintln!("hotstart env: {mounted}; Ctrl-C or SIGTERM unmounts");
    let mounted_at = Instant::now();
    let replayed = tokio::select! {
        r = mounted.mount_mut().prefetch_done() => Some(r.unwrap_or_default()),
        r = signals.wait_or(|| false, &target) => { r?; None }
    };
    if let Some(r) = replayed {
        if r.planned == 0 {
            eprintln!("hotstart env: no profile yet; this run records one");
        } else {
            eprintln!(
                "hotstart env: prefetched the profile: {} chunks, {}, {:.2} s after mounting",
                r.planned,
                size(r.planned_bytes),
                mounted_at.elapsed().as_secs_f64()
            );
        }
        signals
            .wait_or(|| mounted.mount().is_finished(), &target)
            .await?;
    }
    let done = mounted.unmount().await?;
    if json {
        println!("{}", done.to_json());
    }
    eprintln!("hotstart env: {done}");
    Ok(())
}

fn age(created_unix: u64) -> String {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let secs = now.saturating_sub(created_unix);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

async fn ls(args: LsArgs) -> anyhow::Result<()> {
    let env = args.store.env(ChunkStoreConfig::default())?;
    let listing = list(&env).await?;
    if args.json {
        for rec in &listing.snapshots {
            println!("{}", serde_json::to_string(rec)?);
        }
    } else {
        println!(
            "{:<16}  {:>5}  {:>7}  {:>10}  {:<8}  {:<30}  COMMAND",
            "KEY", "AGE", "FILES", "SIZE", "PYTHON", "TARGET"
        );
        for rec in &listing.snapshots {
            println!(
                "{:<16}  {:>5}  {:>7}  {:>10}  {:<8}  {:<30}  {}",
                &rec.key[..16],
                age(rec.created_unix),
                rec.files,
                size(rec.bytes),
                rec.inputs.python.version,
                rec.inputs.target.as_deref().unwrap_or("(relocatable)"),
                rec.inputs.command.join(" ")
            );
        }
    }
    let logical: u64 = listing.snapshots.iter().map(|r| r.bytes).sum();
    eprintln!(
        "{} snapshots, {} of files, stored as {} chunks ({})",
        listing.snapshots.len(),
        size(logical),
        listing.chunks,
        size(listing.chunk_bytes)
    );
    for (key, why) in &listing.unreadable {
        eprintln!("unreadable: {key}: {why}");
    }
    Ok(())
}

async fn gc_cmd(args: GcArgs) -> anyhow::Result<()> {
    let env = args.store.env(ChunkStoreConfig::default())?;
    let keys = args
        .keys
        .iter()
        .map(|k| k.parse::<Key>())
        .collect::<Result<Vec<_>, _>>()
        .context("--key")?;
    let opts = GcOptions {
        older_than: args.older_than,
        keys,
        grace: args.grace,
        dry_run: args.dry_run,
        ..Default::default()
    };
    let report = gc(&env, &opts).await?;
    let verb = if args.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    for key in &report.snapshots {
        println!("{verb} snapshot {key}");
    }
    println!(
        "{verb} {} snapshots, {} trees, {} packs, {} chunks ({}); kept {} snapshots",
        report.snapshots.len(),
        report.trees,
        report.packs,
        report.chunks,
        size(report.chunk_bytes),
        report.kept
    );
    for key in &report.broken {
        eprintln!("warning: snapshot {key} names a missing tree; delete it with --key {key}");
    }
    // A key that matched nothing is most likely mistyped: say so, rather than succeed.
    let unknown: Vec<String> = opts
        .keys
        .iter()
        .map(|k| k.to_string())
        .filter(|k| !report.snapshots.contains(k))
        .collect();
    if !unknown.is_empty() {
        anyhow::bail!(
            "no snapshot has the key {}: nothing was deleted for it (`hotstart env ls` lists the \
             keys)",
            unknown.join(", ")
        );
    }
    Ok(())
}
