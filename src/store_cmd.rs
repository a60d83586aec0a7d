//! `hotstart store ...`: copy and list objects.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand};
use hotstart_store::transfer::{ObjectUrl, download_file, is_url, upload_file};
use hotstart_store::{ByteBudget, StripeConfig};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Copy one file between a local path and a store URL, in either direction.
    ///
    /// Examples:
    ///   hotstart store cp model.bin s3://bucket/runs/model.bin
    ///   hotstart store cp s3://bucket/runs/model.bin ./model.bin
    ///   hotstart store cp model.bin file:///srv/store/model.bin
    ///
    /// Uploads are parallel multipart uploads and become visible only when complete;
    /// downloads are parallel ranged GETs written to a temporary file and renamed into place.
    #[command(verbatim_doc_comment)]
    Cp {
        /// Source: a local file or an object URL.
        src: String,
        /// Destination: a local file or an object URL (a URL ending in '/' keeps the source's
        /// file name).
        dst: String,
        #[command(flatten)]
        stripes: StripeArgs,
    },
    /// List the objects under a URL with their sizes.
    ///
    /// Example: hotstart store ls s3://bucket/runs/
    Ls {
        /// A store URL or directory; its path part is the prefix to list.
        url: String,
    },
}

#[derive(Debug, Args)]
pub struct StripeArgs {
    /// Bytes per ranged GET or multipart part: at least 4 KiB (AWS S3 needs at least 5 MiB).
    #[arg(long, default_value_t = 8 << 20, value_parser = clap::value_parser!(u64).range(4096..))]
    stripe_size: u64,
    /// Stripes in flight at once (at least 1).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    in_flight: u64,
    /// Most bytes held in stripes at once (at least 4 KiB; a stripe never exceeds it).
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(4096..))]
    memory_budget: u64,
}

impl StripeArgs {
    fn config(&self) -> StripeConfig {
        StripeConfig {
            stripe_size: self.stripe_size as usize,
            max_in_flight: self.in_flight as usize,
            budget: ByteBudget::new(self.memory_budget as usize),
        }
    }
}

pub async fn run(cmd: StoreCommand) -> anyhow::Result<()> {
    match cmd {
        StoreCommand::Cp { src, dst, stripes } => cp(&src, &dst, stripes.config()).await,
        StoreCommand::Ls { url } => ls(&url).await,
    }
}

fn progress_bar(total: Option<u64>) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// The key of `name` inside the folder `key` ("" is the store's root).
fn into_folder(key: &str, name: &str) -> String {
    match key.trim_matches('/') {
        "" => name.to_string(),
        folder => format!("{folder}/{name}"),
    }
}

fn file_name(path: &str) -> &str {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or(path)
}

async fn cp(src: &str, dst: &str, cfg: StripeConfig) -> anyhow::Result<()> {
    let start = Instant::now();
    let bytes = match (is_url(src), is_url(dst)) {
        (false, true) => {
            let mut obj = ObjectUrl::parse(dst)?;
            if obj.key.is_empty() || dst.ends_with('/') {
                // The parsed key of `s3://b/run-42/` has lost its final '/'.
                obj.key = into_folder(&obj.key, file_name(src));
            }
            let len = std::fs::metadata(src)
                .with_context(|| format!("cannot read {src}"))?
                .len();
            let bar = progress_bar(Some(len));
            let n = upload_file(Path::new(src), &obj.store, &obj.key, cfg, &|n| {
                bar.set_position(n)
            })
            .await
            .with_context(|| format!("copy {src} to {dst}"))?;
            bar.finish_and_clear();
            n
        }
        (true, false) => {
            let obj = ObjectUrl::parse(src)?;
            if obj.key.is_empty() {
                bail!("{src} names a store, not an object");
            }
            let mut target = PathBuf::from(dst);
            if target.is_dir() {
                target.push(file_name(&obj.key));
            }
            let bar = progress_bar(None);
            let n = download_file(&obj.store, &obj.key, &target, cfg, &|n| bar.set_position(n))
                .await
                .with_context(|| format!("copy {src} to {}", target.display()))?;
            bar.finish_and_clear();
            n
        }
        (true, true) => {
            bail!("copy between two stores is not supported; copy through a local file")
        }
        (false, false) => {
            bail!(
                "neither {src} nor {dst} is a store URL: for a store in a local directory give \
                 it as file:///absolute/path/, or use cp(1) for a local copy"
            )
        }
    };
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "copied {bytes} bytes in {secs:.2} s ({:.1} MiB/s)",
        bytes as f64 / (1 << 20) as f64 / secs.max(1e-9)
    );
    Ok(())
}

async fn ls(url: &str) -> anyhow::Result<()> {
    let (store, prefix, base) = if is_url(url) {
        let obj = ObjectUrl::parse(url)?;
        (obj.store, obj.key, obj.base)
    } else {
        // Opening a directory store creates it: listing one that is not there is a mistake.
        if !Path::new(url).is_dir() {
            bail!(
                "{url} is not a directory; give a store URL (s3://bucket/prefix/) or a directory"
            );
        }
        (
            hotstart_store::Store::open(url)?,
            String::new(),
            format!("{}/", url.trim_end_matches('/')),
        )
    };
    let objects = store.list(&prefix).await?;
    let mut total = 0u64;
    for o in &objects {
        println!("{:>14}  {base}{}", o.size, o.key);
        total += o.size;
    }
    let plural = if objects.len() == 1 { "" } else { "s" };
    eprintln!("{} object{plural}, {total} bytes", objects.len());
    Ok(())
}
