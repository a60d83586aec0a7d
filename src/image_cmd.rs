//! `hotstart image ...`: build, list, inspect, mount, pull and report on lazy images.
//!
//! Each subcommand turns its arguments into `hotstart-prefetch` config structs and calls the
//! library; nothing here knows how images are stored.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use hotstart_prefetch::{BuildConfig, ImageRecord, ImageRef, Images};
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

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
        let store =
            Store::open(&self.store).with_context(|| format!("open store {}", self.store))?;
        let cfg = ChunkStoreConfig {
            concurrency: self.concurrency.max(1),
            cache_dir,
            cache_capacity: cache_mib << 20,
            ..ChunkStoreConfig::default()
        };
        Ok(Images::new(ChunkStore::new(store, cfg)?))
    }
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
    /// Bytes per chunk, in KiB.
    #[arg(long, default_value_t = 1024)]
    chunk_kib: usize,
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

/// Runs one `hotstart image` subcommand.
pub async fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Build(a) => build(a).await,
        ImageCommand::Ls(a) => ls(a).await,
        ImageCommand::Inspect(a) => inspect(a).await,
    }
}

async fn build(a: BuildArgs) -> anyhow::Result<()> {
    let images = a.store.images(None, 0)?;
    let cfg = BuildConfig {
        chunk_size: a.chunk_kib.max(1) << 10,
        platform: a.platform.clone(),
        ..BuildConfig::default()
    };
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
