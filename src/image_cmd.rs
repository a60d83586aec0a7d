//! `hotstart image ...`: build, list, inspect, mount, pull and report on lazy images.
//!
//! Each subcommand turns its arguments into `hotstart-image` config structs and calls the
//! library; nothing here knows how images are stored.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use hotstart_fuse::MountOptions;
use hotstart_image::{
    BuildConfig, ImageRecord, ImageRef, Images, LazyConfig, MountReport, PrefetchConfig,
    artifact_stats, container_image,
};
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

use crate::mount_cmd::Signals;

/// `hotstart image` subcommands.
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Build an image from a directory, a layer tarball (.tar, .tar.gz, .tar.zst) or an OCI
    /// image layout directory, and store it under NAME[:TAG].
    Build(BuildArgs),
    /// List the images in a store.
    Ls(LsArgs),
    /// Show an image's files, bytes, chunks and how much it shares with other images.
    Inspect(InspectArgs),
    /// Mount an image read-only and lazily: chunks are fetched at first read into a local cache,
    /// the chunks this run reads are recorded into the image's profile, and the profile of
    /// earlier runs is prefetched ahead of the job. Runs until SIGINT or SIGTERM.
    Mount(MountArgs),
    /// Extract a whole image into a new directory, fetching chunks in parallel.
    Pull(PullArgs),
    /// Show an image's profile and the reports of its past mounts (hit rate, stall, waste).
    Stats(StatsArgs),
    /// Convert an OCI image layout for `hotstart snapshotter`: each layer is stored as an image
    /// in the store, and the new layout DEST is the same image with each layer annotated with
    /// the image that serves it lazily. Push DEST to a registry (e.g. `ctr images import` then
    /// `ctr images push`, or `skopeo copy oci:DEST docker://...`); nodes without the
    /// snapshotter pull and unpack it as usual.
    Convert(ConvertArgs),
}

/// Where the images are.
#[derive(Debug, Args)]
pub struct StoreArg {
    /// The store holding images and chunks: a directory, file://, or s3://bucket/prefix URL.
    #[arg(long, env = "HOTSTART_STORE")]
    store: String,
    /// Chunks fetched or stored at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
}

impl StoreArg {
    fn images(&self, cache_dir: Option<PathBuf>, cache_mib: u64) -> anyhow::Result<Images> {
        images_at(&self.store, self.concurrency, cache_dir, cache_mib)
    }
}

/// The images in the store at `url`, through a local chunk cache in `cache_dir`.
pub(crate) fn images_at(
    url: &str,
    concurrency: usize,
    cache_dir: Option<PathBuf>,
    cache_mib: u64,
) -> anyhow::Result<Images> {
    let store = Store::open(url).with_context(|| format!("open store {url}"))?;
    let cfg = ChunkStoreConfig {
        concurrency: concurrency.max(1),
        cache_dir,
        cache_capacity: cache_mib << 20,
        artifact: "image",
        ..ChunkStoreConfig::default()
    };
    Ok(Images::new(ChunkStore::new(store, cfg)?))
}

/// Options of `hotstart image build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// A directory, a layer tarball (plain, gzip or zstd) or an OCI image layout directory.
    source: PathBuf,
    #[command(flatten)]
    store: StoreArg,
    /// The image name and tag, e.g. ml/python:3.11 (the tag defaults to latest).
    #[arg(long)]
    name: ImageRef,
    /// Bytes per chunk, in KiB: 4 to 65536 (64 MiB, the most a reader accepts).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(4..=65536))]
    chunk_kib: u64,
    /// The platform to take from a multi-platform OCI index, e.g. linux/arm64 (default: this
    /// machine's).
    #[arg(long)]
    platform: Option<String>,
}

/// Options of `hotstart image ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON records instead of a table.
    #[arg(long)]
    json: bool,
}

/// Options of `hotstart image inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The image, NAME[:TAG].
    name: ImageRef,
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Options of `hotstart image convert`.
#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// The OCI image layout directory to convert.
    source: PathBuf,
    /// The new OCI image layout directory to write (must not exist, or be empty).
    dest: PathBuf,
    #[command(flatten)]
    store: StoreArg,
    /// Bytes per chunk, in KiB: 4 to 65536 (64 MiB, the most a reader accepts).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(4..=65536))]
    chunk_kib: u64,
    /// The platform to take from a multi-platform index, e.g. linux/arm64 (default: this
    /// machine's).
    #[arg(long)]
    platform: Option<String>,
}

/// The local chunk cache of mounts and pulls.
#[derive(Debug, Args)]
pub struct CacheArgs {
    /// Directory of the local chunk cache (verified chunks, shared by every image and mount on
    /// this machine).
    #[arg(
        long,
        env = "HOTSTART_CHUNK_CACHE",
        default_value = "/var/tmp/hotstart/chunks"
    )]
    pub(crate) cache_dir: PathBuf,
    /// Disk the chunk cache may use, in MiB (least recently used chunks are evicted).
    #[arg(long, default_value_t = 10240)]
    pub(crate) cache_mib: u64,
}

/// Options of `hotstart image mount`.
#[derive(Debug, Args)]
pub struct MountArgs {
    /// The image, NAME[:TAG].
    name: ImageRef,
    /// An existing directory to mount on.
    mountpoint: PathBuf,
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    cache: CacheArgs,
    /// Do not prefetch the image's profile.
    #[arg(long)]
    no_prefetch: bool,
    /// Do not store prefetched pages in the kernel's page cache ahead of the job (reads then
    /// each take a request to this process, served from its memory).
    #[arg(long)]
    no_warm: bool,
    /// Do not record this run's reads into the profile.
    #[arg(long)]
    no_record: bool,
    /// Memory for verified chunks, in MiB (prefetched chunks wait here to be read).
    #[arg(long, default_value_t = 1024)]
    memory_mib: u64,
    /// Prefetch fetches in flight at the start (the window then adapts to the link).
    #[arg(long, default_value_t = 32)]
    window: usize,
    /// The most prefetch fetches in flight.
    #[arg(long, default_value_t = 128)]
    max_window: usize,
    /// Runs a chunk may go unread before it leaves the profile.
    #[arg(long, default_value_t = 5)]
    decay_runs: u32,
    /// Seconds between writes of this run's trace to the store.
    #[arg(long, default_value_t = 30.0)]
    flush_secs: f64,
    /// Seconds the kernel may cache names, attributes and negative lookups (the image cannot
    /// change while mounted).
    #[arg(long, default_value_t = 3600.0)]
    ttl_secs: f64,
    /// Let other users access the mount (needs user_allow_other in /etc/fuse.conf unless root).
    #[arg(long)]
    allow_other: bool,
    /// The kernel's own read-ahead for the mount, in KiB: how far ahead of a sequential reader
    /// (or around a page fault in a mapped file) the kernel asks for pages. Setting it needs
    /// root; 0 keeps the kernel's default (128 KiB).
    #[arg(long, default_value_t = hotstart_image::mount::KERNEL_READ_AHEAD >> 10)]
    kernel_read_ahead_kib: u64,
    /// Write this run's report (JSON) to this file at unmount.
    #[arg(long)]
    report: Option<PathBuf>,
}

/// Options of `hotstart image pull`.
#[derive(Debug, Args)]
pub struct PullArgs {
    /// The image, NAME[:TAG].
    name: ImageRef,
    /// The directory to create (it must not exist, or be empty).
    dest: PathBuf,
    #[command(flatten)]
    store: StoreArg,
    #[command(flatten)]
    cache: CacheArgs,
    /// Fetch through no local chunk cache.
    #[arg(long)]
    no_cache: bool,
}

/// Options of `hotstart image stats`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["name", "container"])))]
pub struct StatsArgs {
    /// The image, NAME[:TAG].
    name: Option<ImageRef>,
    /// Instead of an image in the store: a container image served by `hotstart snapshotter`,
    /// as containerd pulled it (e.g. `registry.example:5000/team/train:v3`). Shows its one
    /// profile and a report per container start.
    #[arg(long, value_name = "REF")]
    container: Option<String>,
    #[command(flatten)]
    store: StoreArg,
    /// Print JSON (the profile summary and every run report) instead of text.
    #[arg(long, conflicts_with = "prometheus")]
    json: bool,
    /// Print the latest run's report as Prometheus metrics.
    #[arg(long)]
    prometheus: bool,
}

/// Runs one `hotstart image` subcommand.
pub async fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Build(a) => build(a).await,
        ImageCommand::Ls(a) => ls(a).await,
        ImageCommand::Inspect(a) => inspect(a).await,
        ImageCommand::Mount(a) => mount(a).await,
        ImageCommand::Pull(a) => pull(a).await,
        ImageCommand::Stats(a) => stats(a).await,
        ImageCommand::Convert(a) => convert(a).await,
    }
}

fn build_config(chunk_kib: u64, platform: &Option<String>) -> BuildConfig {
    BuildConfig {
        chunk_size: (chunk_kib as usize) << 10,
        platform: platform.clone(),
        ..BuildConfig::default()
    }
}

async fn convert(a: ConvertArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let cfg = build_config(a.chunk_kib, &a.platform);
    let c = hotstart_image::convert(&images, &a.source, &a.dest, &cfg)
        .await
        .with_context(|| format!("convert {} into {}", a.source.display(), a.dest.display()))?;
    for l in &c.layers {
        println!(
            "{} {}: {} files, {}{}",
            l.digest,
            l.image,
            l.counts.files,
            human(l.counts.bytes),
            if l.built {
                ""
            } else {
                " (already in the store)"
            }
        );
    }
    println!("converted {} (manifest {})", a.dest.display(), c.manifest);
    Ok(())
}

fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).with_context(|| format!("--{flag} {v}"))
}

async fn mount(a: MountArgs) -> anyhow::Result<()> {
    let images = a
        .store
        .images(Some(a.cache.cache_dir.clone()), a.cache.cache_mib)?;
    let defaults = LazyConfig::default();
    let cfg = LazyConfig {
        memory_cache: a.memory_mib << 20,
        prefetch: !a.no_prefetch,
        warm_page_cache: !a.no_warm,
        record: !a.no_record,
        replay: PrefetchConfig {
            initial_window: a.window.max(1),
            max_window: a.max_window.max(1),
            ..PrefetchConfig::default()
        },
        decay_runs: a.decay_runs.max(1),
        flush_every: seconds("flush-secs", a.flush_secs)?,
        ttl: seconds("ttl-secs", a.ttl_secs)?,
        mount: MountOptions {
            allow_other: a.allow_other,
            fs_name: format!("hotstart-image:{}", a.name),
            kernel_read_ahead: (a.kernel_read_ahead_kib > 0)
                .then_some(a.kernel_read_ahead_kib << 10),
            ..defaults.mount.clone()
        },
        ..defaults
    };
    let mut signals = Signals::install()?;
    let mounted = images
        .mount(&a.name, &a.mountpoint, cfg)
        .await
        .with_context(|| format!("mount {} at {}", a.name, a.mountpoint.display()))?;
    eprintln!(
        "hotstart: serving image {} at {} (run {}; Ctrl-C or SIGTERM unmounts)",
        a.name,
        a.mountpoint.display(),
        mounted.run()
    );
    signals
        .wait_or(|| mounted.is_finished(), &a.mountpoint)
        .await?;
    let report = mounted.unmount().await?;
    eprintln!("hotstart: {}: {}", a.name, report.summary());
    if let Some(path) = &a.report {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("write {}", path.display()))?;
    }
    Ok(())
}

async fn pull(a: PullArgs) -> anyhow::Result<()> {
    let cache = (!a.no_cache).then(|| a.cache.cache_dir.clone());
    let images = a.store.images(cache, a.cache.cache_mib)?;
    let r = images
        .pull(&a.name, &a.dest)
        .await
        .with_context(|| format!("pull {} into {}", a.name, a.dest.display()))?;
    println!(
        "pulled {} into {}: {} files, {} in {:.2} s; {} chunks fetched ({} compressed)",
        a.name,
        a.dest.display(),
        r.counts.files,
        human(r.counts.bytes),
        r.seconds,
        r.fetched_chunks,
        human(r.fetched_bytes)
    );
    Ok(())
}

async fn stats(a: StatsArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let (name, (profile, runs)) = match (&a.name, &a.container) {
        (Some(name), _) => (name.to_string(), images.stats(name).await?),
        (None, Some(r)) => {
            let dir = container_image(r).artifacts();
            (r.clone(), artifact_stats(images.store(), &dir).await?)
        }
        (None, None) => unreachable!("clap requires one"),
    };
    if a.prometheus {
        match runs.last() {
            Some(r) => print!("{}", r.prometheus()),
            None => anyhow::bail!("{name} has no recorded mounts or container starts"),
        }
        return Ok(());
    }
    if a.json {
        let out = serde_json::json!({
            "image": name,
            "profile": {"runs": profile.runs, "chunks": profile.entries.len(), "bytes": profile.bytes()},
            "mounts": runs,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "profile: {} runs merged, {} hot chunks ({})",
        profile.runs,
        profile.entries.len(),
        human(profile.bytes())
    );
    println!(
        "{:<30} {:>8} {:>10} {:>7} {:>9} {:>8} {:>10} {:>7}",
        "RUN", "CHUNKS", "READ", "HIT%", "STALL s", "FETCHED", "WASTED", "WASTE%"
    );
    for r in &runs {
        print_run(r);
    }
    Ok(())
}

fn print_run(r: &MountReport) {
    println!(
        "{:<30} {:>8} {:>10} {:>6.1}% {:>9.3} {:>8} {:>10} {:>6.1}%",
        r.run,
        r.chunks_read,
        human(r.chunk_bytes_read),
        r.hit_rate * 100.0,
        r.stall_seconds,
        r.demand_fetches,
        human(r.wasted_bytes),
        r.waste_ratio() * 100.0
    );
}

async fn build(a: BuildArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let cfg = build_config(a.chunk_kib, &a.platform);
    let r = images
        .build(&a.source, &a.name, &cfg)
        .await
        .with_context(|| format!("build {} from {}", a.name, a.source.display()))?;
    println!(
        "built {}: {} files, {} in {} chunks; {} new chunks ({} stored)",
        r.image,
        r.counts.files,
        human(r.counts.bytes),
        r.counts.chunks,
        r.new_chunks,
        human(r.new_bytes)
    );
    Ok(())
}

async fn ls(a: LsArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let list = images.list().await?;
    if a.json {
        for r in &list {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    println!(
        "{:<40} {:>8} {:>10} {:>8}  SOURCE",
        "IMAGE", "FILES", "BYTES", "CHUNKS"
    );
    for r in &list {
        println!(
            "{:<40} {:>8} {:>10} {:>8}  {}",
            r.image,
            r.counts.files,
            human(r.counts.bytes),
            r.counts.chunks,
            r.source
        );
    }
    Ok(())
}

async fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let i = images.inspect(&a.name).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&i)?);
        return Ok(());
    }
    let r: &ImageRecord = &i.record;
    let c = &r.counts;
    println!("image:        {}", r.image);
    println!("source:       {}", r.source);
    println!("created:      {}", utc(r.created_ms));
    println!(
        "entries:      {} files, {} directories, {} symlinks, {} hard links",
        c.files, c.dirs, c.symlinks, c.hardlinks
    );
    println!("bytes:        {} ({} bytes)", human(c.bytes), c.bytes);
    println!(
        "chunks:       {} distinct, {} of content, chunk size {}",
        c.chunks,
        human(c.chunk_bytes),
        human(r.chunk_size)
    );
    println!(
        "dedup ratio:  {:.2} (file bytes / distinct chunk bytes)",
        c.dedup_ratio()
    );
    println!(
        "shared:       {} chunks ({}) also used by the {} other images in the store",
        i.shared_chunks,
        human(i.shared_bytes),
        i.other_images
    );
    println!("tree blake3:  {}", r.tree_blake3);
    Ok(())
}

fn human(bytes: u64) -> String {
    humansize::format_size(bytes, humansize::BINARY)
}

/// `YYYY-MM-DD HH:MM:SS UTC` of milliseconds since the Unix epoch.
fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}
