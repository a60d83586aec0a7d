//! `hotstart mount` against the same bytes moved without FUSE, and against the FUSE mounts a user
//! would pick instead: `weed mount` (SeaweedFS's own), s3fs and `rclone mount`.
//!
//! **Setup.** One private SeaweedFS server (testkit: master, volume server, filer and S3 gateway
//! in one `weed server`), one bucket, and in it one object of `--gib` GiB (64 MiB blocks of
//! incompressible test data) that every reader reads. Each measurement mounts its peer afresh
//! before the clock starts and unmounts it after it stops, so nothing is served from what an
//! earlier run left in a mount's memory or in the kernel's page cache of that mount; the page
//! cache is also dropped before each measurement (unless `--keep-page-cache`), so the server
//! reads its volume files from disk every time. Medians of `--runs` runs are reported.
//!
//! - **Sequential read**: open, `read(2)` 1 MiB at a time to the end, close. Floor: a
//!   [`StripedReader`] streaming the object with the mount's stripe settings, no FUSE (target:
//!   the mount ≥ 0.8 of it). Peers: `weed mount` (target: faster), s3fs and `rclone mount`
//!   (targets ≥ 2×).
//! - **Sequential write** of `--write-gib` GiB: create, `write(2)` 1 MiB at a time, close, then
//!   ask the S3 API until the object is there at its full size. The clock stops then, so every
//!   write figure includes its upload finishing, whether `close()` waited for it or not; a note
//!   says for each peer whether the object was already visible when `close()` returned. Floor: a
//!   [`StripedWriter`] uploading the same bytes (target ≥ 0.7); peers with a target: `weed mount`
//!   (≥ 1×) and s3fs (≥ 1.3×).
//!   Two more floors show what the server takes, with no client library at all: the same bytes
//!   as plain HTTP PUTs of one stripe each, [`RAW_STREAMS`] at once, to the S3 gateway (which
//!   every S3 client goes through: it hands the bytes to the filer, which hands them to the
//!   volume server) and straight to the volume server (the path `weed mount` takes: a file id
//!   from the master, then the bytes to the volume server). Each stored part is read back and
//!   compared, untimed.
//!   `rclone mount` runs with `--vfs-cache-mode off` (its default: writes stream to the store and
//!   close waits for the upload; the write cache modes would defer it).
//! - `--tee-cost`: also writes through a mount that keeps no local copy of streamed files
//!   (`--max-spill-mib 0`), to show what the copy that makes a later seek-back work costs.
//!
//! **Bytes are checked**, so that no peer is fast by being wrong: on the first run each mount's
//! file is read once more, untimed, and its BLAKE3 hash compared with the source's; every written
//! object is read back through the S3 API and hashed.
//!
//! Peers run with their defaults, only told where the server is: `weed mount -filer=...
//! -filer.path=/buckets/BUCKET` (with a fresh `-cacheDir` per mount), `s3fs BUCKET DIR -o
//! url=...,use_path_request_style,passwd_file=...` (its temp files in `--dir`), and `rclone mount
//! :s3:BUCKET DIR` with the S3 remote given as flags (`--config ""`: no configuration file). The
//! hotstart mount runs in this process with `hotstart mount`'s defaults (the CLI only builds the
//! same `MountConfig`), its spill files in `--dir`.
//!
//! `--remote` puts the server behind the emulated remote link of the store benchmark
//! (`benches/netem.sh`: network namespaces, 10 ms RTT, 100 MB/s per TCP connection, like S3)
//! and every mount, and the direct reader and writer, reach it over that link (the raw PUT floors
//! are left out there: one new connection per PUT would measure TCP slow start).
//!
//! Full run (the issue's targets; on an otherwise idle machine, as root for FUSE and dropping
//! caches; `scripts/setup.sh` installs s3fs, rclone and weed):
//!
//! ```text
//! cargo run --profile bench -p hotstart-benches -- fuse --gib 2 --write-gib 0.5 --runs 3 \
//!     --tee-cost --markdown target/bench-fuse.md
//! ```

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::IntoRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use bytes::Bytes;
use futures::StreamExt;
use hotstart_fuse::FsConfig;
use hotstart_store::object_store::ObjectStoreExt;
use hotstart_store::{ByteBudget, Store, StripeConfig, StripedReader, StripedWriter};
use hotstart_testkit::SeaweedFs;
use tempfile::TempDir;

pub(crate) mod mounts;

use mounts::{Mounted, Peer, Raw, Server, Target};

use crate::report::{Report, Row, median};
use crate::store_uring::drop_page_cache;

/// Bytes per `read(2)` and `write(2)` call.
const IO: usize = 1 << 20;
/// Blocks of the source object, each from its own seed.
const BLOCK: usize = 64 << 20;
/// The object every reader reads.
const READ_KEY: &str = "bench/read.bin";
/// Raw PUTs in flight at once (the striped writer's starting point).
pub const RAW_STREAMS: usize = 4;
/// How long a written object may take to appear.
const VISIBLE_TIMEOUT: Duration = Duration::from_secs(300);

/// Options of `hotstart-benches fuse`.
#[derive(Debug, clap::Args)]
pub struct FuseArgs {
    /// Size of the file read, in GiB.
    #[arg(long, default_value_t = 2.0)]
    gib: f64,
    /// Size of the file written, in GiB.
    #[arg(long, default_value_t = 0.5)]
    write_gib: f64,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Stripe size in MiB (the mount's and the direct reader's and writer's).
    #[arg(long, default_value_t = 8)]
    stripe_mib: usize,
    /// Stripes in flight per read window or upload.
    #[arg(long, default_value_t = 16)]
    in_flight: usize,
    /// The mounts to compare with.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Peer::Weed, Peer::S3fs, Peer::Rclone])]
    peers: Vec<Peer>,
    /// Also write through a mount that keeps no local copy of streamed files.
    #[arg(long)]
    tee_cost: bool,
    /// Do not drop the page cache before each measurement (on a machine shared with other
    /// measurements; the mounts are still fresh each time).
    #[arg(long)]
    keep_page_cache: bool,
    /// Directory for mount points, spill files and the peers' temporary files (on disk).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Serve the store from behind an emulated remote link (benches/netem.sh).
    #[arg(long)]
    remote: bool,
    /// Send hotstart's request bodies unsigned (`aws_unsigned_payload`, the default over
    /// https), for the direct striped I/O and the hotstart mount alike.
    #[arg(long)]
    unsigned_payload: bool,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// Everything a measurement needs: the server, the bucket, the source's hash.
struct Bench<'a> {
    args: &'a FuseArgs,
    weed: SeaweedFs,
    bucket: String,
    store: Store,
    rt: &'a tokio::runtime::Runtime,
    scratch: TempDir,
    stripes: StripeConfig,
    read_size: u64,
    read_hash: blake3::Hash,
    mounts: usize,
}

impl Bench<'_> {
    fn fs_config(&self, tee: bool) -> FsConfig {
        FsConfig {
            stripe_size: self.stripes.stripe_size,
            max_in_flight: self.stripes.max_in_flight,
            spill_dir: Some(self.scratch.path().to_path_buf()),
            max_spill: if tee {
                FsConfig::default().max_spill
            } else {
                0
            },
            ..FsConfig::default()
        }
    }

    fn mount(&mut self, target: Target) -> anyhow::Result<Mounted> {
        self.mounts += 1;
        let server = Server {
            weed: &self.weed,
            bucket: &self.bucket,
            store: &self.store,
            rt: self.rt.handle(),
            scratch: self.scratch.path(),
        };
        let tee = target != Target::Hotstart { tee: false };
        mounts::mount(target, &server, self.fs_config(tee), self.mounts)
    }

    fn cold(&self) -> anyhow::Result<()> {
        if !self.args.keep_page_cache {
            drop_page_cache().context("drop the page cache (needs root)")?;
        }
        Ok(())
    }

    /// The hash of what the S3 API returns for `key`, and its length.
    fn stored_hash(&self, key: &str) -> anyhow::Result<(blake3::Hash, u64)> {
        self.rt.block_on(async {
            let r = StripedReader::open(&self.store, key, self.stripes.clone()).await?;
            let mut stripes = r.stream(0..r.size());
            let mut h = blake3::Hasher::new();
            while let Some(s) = stripes.next().await {
                h.update(&s?);
            }
            Ok((h.finalize(), r.size()))
        })
    }

    /// One timed sequential read; on `verify`, the bytes are read again untimed and hashed.
    fn read(&mut self, target: Target, verify: bool) -> anyhow::Result<Duration> {
        if target == Target::Direct {
            self.cold()?;
            let start = Instant::now();
            let n = self.rt.block_on(async {
                let r = StripedReader::open(&self.store, READ_KEY, self.stripes.clone()).await?;
                let mut stripes = r.stream(0..r.size());
                let mut n = 0u64;
                while let Some(s) = stripes.next().await {
                    n += s?.len() as u64;
                }
                anyhow::Ok(n)
            })?;
            let took = start.elapsed();
            ensure!(n == self.read_size, "direct read returned {n} bytes");
            if verify {
                let (hash, _) = self.stored_hash(READ_KEY)?;
                ensure!(hash == self.read_hash, "direct read: wrong bytes");
            }
            return Ok(took);
        }
        let m = self.mount(target)?;
        let path = m.path().join(READ_KEY);
        self.cold()?;
        let start = Instant::now();
        let n = read_file(&path, None)?;
        let took = start.elapsed();
        ensure!(
            n == self.read_size,
            "{}: read {n} of {} bytes",
            target.name(),
            self.read_size
        );
        if verify {
            let mut h = blake3::Hasher::new();
            read_file(&path, Some(&mut h))?;
            ensure!(
                h.finalize() == self.read_hash,
                "{}: the bytes read differ from the object's",
                target.name()
            );
        }
        Ok(took)
    }

    /// One timed sequential write of `data` as `key`, until the object is visible; returns the
    /// time and whether it was visible as soon as `close()` returned. The object is checked and
    /// deleted afterwards.
    fn write(
        &mut self,
        target: Target,
        data: &Bytes,
        key: &str,
    ) -> anyhow::Result<(Duration, bool)> {
        let len = data.len() as u64;
        if let Target::Raw(to) = target {
            self.cold()?;
            let start = Instant::now();
            let stored = self.raw_puts(to, data, key)?;
            let took = start.elapsed();
            self.check_raw(&stored, data)?;
            return Ok((took, true));
        }
        let (took, at_close) = if target == Target::Direct {
            self.cold()?;
            let start = Instant::now();
            self.rt.block_on(async {
                let mut w = StripedWriter::new(&self.store, key, self.stripes.clone())?;
                w.write_bytes(data.clone()).await?;
                w.finish().await
            })?;
            (start.elapsed(), true)
        } else {
            let m = self.mount(target)?;
            let path = m.path().join(key);
            self.cold()?;
            let start = Instant::now();
            write_file(&path, data).with_context(|| format!("{}: write", target.name()))?;
            let at_close = self.visible_size(key)? == Some(len);
            while self.visible_size(key)? != Some(len) {
                ensure!(
                    start.elapsed() < VISIBLE_TIMEOUT,
                    "{}: {key} not visible at {len} bytes after {VISIBLE_TIMEOUT:?}",
                    target.name()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let took = start.elapsed();
            drop(m);
            (took, at_close)
        };
        let (hash, size) = self.stored_hash(key)?;
        ensure!(
            size == len && hash == blake3::hash(data),
            "{}: the stored object differs from what was written",
            target.name()
        );
        self.rt.block_on(self.store.delete(key))?;
        Ok((took, at_close))
    }

    /// `data` as plain HTTP PUTs of one stripe each, [`RAW_STREAMS`] at once, each checked for
    /// its status; returns where each stripe went, in order.
    fn raw_puts(&self, to: Raw, data: &[u8], key: &str) -> anyhow::Result<Vec<Stored>> {
        let parts: Vec<&[u8]> = data.chunks(self.stripes.stripe_size).collect();
        let next = AtomicUsize::new(0);
        let put = |i: usize| -> anyhow::Result<Stored> {
            Ok(match to {
                Raw::Gateway => {
                    let path = format!("/{}/{key}.{i:05}", self.bucket);
                    let r = self.weed.request("PUT", &path, &[], parts[i])?;
                    ensure!(
                        r.status == 200,
                        "PUT {path}: HTTP {}: {}",
                        r.status,
                        r.text()
                    );
                    Stored::Object(path)
                }
                Raw::Volume => Stored::Blob(self.weed.put_blob(&self.bucket, parts[i])?),
            })
        };
        let mut stored = std::thread::scope(|s| {
            let streams: Vec<_> = (0..RAW_STREAMS)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = vec![];
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= parts.len() {
                                return anyhow::Ok(mine);
                            }
                            mine.push((i, put(i)?));
                        }
                    })
                })
                .collect();
            let mut all = vec![];
            for stream in streams {
                all.extend(stream.join().expect("raw PUT thread panicked")?);
            }
            anyhow::Ok(all)
        })?;
        stored.sort_by_key(|(i, _)| *i);
        Ok(stored.into_iter().map(|(_, at)| at).collect())
    }

    /// Reads back what [`Bench::raw_puts`] stored and compares it with `data`; removes the
    /// gateway's objects (volume blobs go with the server).
    fn check_raw(&self, stored: &[Stored], data: &[u8]) -> anyhow::Result<()> {
        let parts = data.chunks(self.stripes.stripe_size);
        ensure!(stored.len() == parts.len(), "raw PUTs: parts missing");
        for (at, part) in stored.iter().zip(parts) {
            let back = match at {
                Stored::Object(path) => {
                    let r = self.weed.request("GET", path, &[], &[])?;
                    ensure!(r.status == 200, "GET {path}: HTTP {}", r.status);
                    self.weed.request("DELETE", path, &[], &[])?;
                    r.body
                }
                Stored::Blob(blob) => self.weed.get_blob(blob)?,
            };
            ensure!(
                back == part,
                "raw PUTs: the stored bytes differ from the part's"
            );
        }
        Ok(())
    }

    fn visible_size(&self, key: &str) -> anyhow::Result<Option<u64>> {
        let path = Store::path(key)?;
        match self.rt.block_on(self.store.object_store().head(&path)) {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

/// Where one raw PUT's bytes are.
enum Stored {
    /// An object's path on the S3 gateway.
    Object(String),
    /// A blob on the volume server.
    Blob(hotstart_testkit::Blob),
}

/// Reads `path` to the end, 1 MiB per call; returns the bytes read.
fn read_file(path: &Path, mut hasher: Option<&mut blake3::Hasher>) -> anyhow::Result<u64> {
    let mut f = File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut buf = vec![0u8; IO];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            return Ok(n);
        }
        if let Some(h) = hasher.as_deref_mut() {
            h.update(&buf[..k]);
        }
        n += k as u64;
    }
}

/// Creates `path` and writes `data` 1 MiB per call, then closes it, reporting close's error.
fn write_file(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    for chunk in data.chunks(IO) {
        f.write_all(chunk)?;
    }
    let fd = f.into_raw_fd();
    // SAFETY: `fd` was just released by the File, so it is open and owned here alone, and it is
    // closed exactly once.
    if unsafe { libc::close(fd) } != 0 {
        return Err(std::io::Error::last_os_error()).context("close");
    }
    Ok(())
}

fn gib_bytes(gib: f64) -> anyhow::Result<u64> {
    ensure!(gib > 0.0, "sizes must be positive");
    Ok(((gib * (1u64 << 30) as f64) as u64).next_multiple_of(1 << 20))
}

fn label(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.3} GiB").replace(".000", "")
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// Uploads the object every reader reads, block by block; returns its hash.
fn upload_source(
    rt: &tokio::runtime::Runtime,
    store: &Store,
    cfg: &StripeConfig,
    size: u64,
) -> anyhow::Result<blake3::Hash> {
    rt.block_on(async {
        let mut w = StripedWriter::new(store, READ_KEY, cfg.clone())?;
        let mut h = blake3::Hasher::new();
        let mut off = 0u64;
        let mut seed = 1000;
        while off < size {
            let n = (size - off).min(BLOCK as u64) as usize;
            let block = Bytes::from(hotstart_testkit::pattern(n, seed));
            h.update(&block);
            w.write_bytes(block).await?;
            off += n as u64;
            seed += 1;
        }
        w.finish().await?;
        Ok(h.finalize())
    })
}

/// Runs the benchmark and prints (and optionally writes) the table.
pub fn run(args: &FuseArgs) -> anyhow::Result<()> {
    ensure!(args.runs > 0, "--runs must be at least 1");
    let read_size = gib_bytes(args.gib)?;
    let write_size = gib_bytes(args.write_gib)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // Declared before `bench`, so the link goes down only after the server has stopped.
    let (_link, weed) = if args.remote {
        let (link, weed) = crate::store_striped::RemoteLink::up()?;
        (Some(link), weed)
    } else {
        let weed =
            SeaweedFs::start().context("start SeaweedFS (run scripts/setup.sh to install weed)")?;
        (None, weed)
    };
    let url = weed.fresh_bucket("bench-fuse");
    let bucket = url.trim_start_matches("s3://").to_string();
    let mut options = weed.client_options();
    if args.unsigned_payload {
        options.push(("aws_unsigned_payload".into(), "true".into()));
    }
    let store = Store::open_with(&url, &options)?;
    let stripes = StripeConfig {
        stripe_size: args.stripe_mib.max(1) << 20,
        max_in_flight: args.in_flight.max(1),
        budget: ByteBudget::new(FsConfig::default().memory_budget),
    };
    eprintln!("fuse: uploading the {} source object", label(read_size));
    let read_hash = upload_source(&rt, &store, &stripes, read_size)?;
    let scratch = tempfile::Builder::new()
        .prefix("hotstart-bench-fuse-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("scratch directory in {}", args.dir.display()))?;
    let mut bench = Bench {
        args,
        weed,
        bucket,
        store,
        rt: &rt,
        scratch,
        stripes,
        read_size,
        read_hash,
        mounts: 0,
    };
    let mut report = Report::new("hotstart mount against direct striped I/O and other FUSE mounts");
    let mut peers: Vec<Target> = args.peers.iter().map(|&p| Target::Peer(p)).collect();
    peers.dedup();

    // Reads.
    let mut readers = vec![Target::Direct, Target::Hotstart { tee: true }];
    readers.extend(peers.iter().copied());
    let mut reads: Vec<(Target, Vec<Duration>)> = readers.iter().map(|&t| (t, vec![])).collect();
    for run in 0..args.runs {
        for (target, times) in reads.iter_mut() {
            if run > 0 && times.is_empty() {
                continue; // failed on the first run
            }
            match bench.read(*target, run == 0) {
                Ok(d) => {
                    eprintln!(
                        "  read  run {run}: {:<32} {:>6.2} s",
                        target.name(),
                        d.as_secs_f64()
                    );
                    times.push(d);
                }
                Err(e) if matches!(target, Target::Peer(_)) => {
                    report.note(format!("{} read not measured: {e:#}", target.name()));
                    times.clear();
                }
                Err(e) => return Err(e),
            }
        }
    }

    // Writes.
    let data = Bytes::from(hotstart_testkit::pattern(write_size as usize, 77));
    let mut writers = vec![Target::Direct, Target::Hotstart { tee: true }];
    if args.tee_cost {
        writers.push(Target::Hotstart { tee: false });
    }
    writers.extend(peers.iter().copied());
    if !args.remote {
        // Behind the link, one new connection per PUT measures TCP slow start, not a floor.
        writers.extend([Target::Raw(Raw::Gateway), Target::Raw(Raw::Volume)]);
    }
    let mut writes: Vec<(Target, Vec<Duration>, usize)> =
        writers.iter().map(|&t| (t, vec![], 0)).collect();
    for run in 0..args.runs {
        for (i, (target, times, at_close)) in writes.iter_mut().enumerate() {
            if run > 0 && times.is_empty() {
                continue;
            }
            match bench.write(*target, &data, &format!("bench/write-{i}-{run}.bin")) {
                Ok((d, visible)) => {
                    eprintln!(
                        "  write run {run}: {:<32} {:>6.2} s{}",
                        target.name(),
                        d.as_secs_f64(),
                        if visible {
                            ""
                        } else {
                            " (visible after close)"
                        }
                    );
                    times.push(d);
                    *at_close += usize::from(visible);
                }
                Err(e) if matches!(target, Target::Peer(_)) => {
                    report.note(format!("{} write not measured: {e:#}", target.name()));
                    times.clear();
                }
                Err(e) => return Err(e),
            }
        }
    }

    add_rows(&mut report, &reads, &writes, read_size, write_size, args);
    report.finish(args.markdown.as_deref())
}

fn add_rows(
    report: &mut Report,
    reads: &[(Target, Vec<Duration>)],
    writes: &[(Target, Vec<Duration>, usize)],
    read_size: u64,
    write_size: u64,
    args: &FuseArgs,
) {
    let med = |times: &Vec<Duration>| (!times.is_empty()).then(|| median(times.clone()));
    let ours = Target::Hotstart { tee: true };
    let of = |t: Target| {
        reads
            .iter()
            .find(|(x, _)| *x == t)
            .and_then(|(_, v)| med(v))
    };
    let link = if args.remote { ", remote link" } else { "" };
    let read_what = format!("sequential read, {}{link}", label(read_size));
    if let Some(mine) = of(ours) {
        for (t, _) in reads.iter().filter(|(t, _)| *t != ours) {
            let (peer, target) = match t {
                Target::Direct => ("StripedReader, no FUSE".to_string(), Some(0.8)),
                Target::Peer(Peer::Weed) => (t.name(), Some(1.0)),
                Target::Peer(_) => (t.name(), Some(2.0)),
                Target::Hotstart { .. } | Target::Raw(_) => continue,
            };
            if let Some(theirs) = of(*t) {
                report.add(Row::rate(
                    read_what.clone(),
                    read_size,
                    mine,
                    peer,
                    theirs,
                    target,
                ));
            }
        }
    }
    let of = |t: Target| {
        writes
            .iter()
            .find(|(x, ..)| *x == t)
            .and_then(|(_, v, _)| med(v))
    };
    let write_what = format!(
        "sequential write, {}{link}, until visible",
        label(write_size)
    );
    if let Some(mine) = of(ours) {
        for (t, ..) in writes.iter().filter(|(t, ..)| *t != ours) {
            let (peer, target) = match t {
                Target::Direct => ("StripedWriter, no FUSE".to_string(), Some(0.7)),
                Target::Raw(Raw::Gateway) => (
                    format!("raw PUTs to the S3 gateway, {RAW_STREAMS} at once (its floor)"),
                    None,
                ),
                Target::Raw(Raw::Volume) => (
                    format!(
                        "raw PUTs to the volume server, {RAW_STREAMS} at once (weed mount's path)"
                    ),
                    None,
                ),
                Target::Peer(Peer::S3fs) => (t.name(), Some(1.3)),
                Target::Peer(Peer::Rclone) => ("rclone mount (--vfs-cache-mode off)".into(), None),
                Target::Peer(Peer::Weed) => (t.name(), Some(1.0)),
                Target::Hotstart { .. } => (
                    "hotstart mount, no local copy (--max-spill-mib 0)".into(),
                    None,
                ),
            };
            if let Some(theirs) = of(*t) {
                report.add(Row::rate(
                    write_what.clone(),
                    write_size,
                    mine,
                    peer,
                    theirs,
                    target,
                ));
            }
        }
    }
    for (t, times, at_close) in writes {
        if !times.is_empty() && matches!(t, Target::Hotstart { .. } | Target::Peer(_)) {
            let waited = if *at_close == times.len() {
                "close() returned only after the upload finished".to_string()
            } else {
                format!(
                    "the object was visible at close() in {at_close} of {} runs; its figure \
                     runs until it was",
                    times.len()
                )
            };
            report.note(format!("{} write: {waited}", t.name()));
        }
    }
    report.note(format!(
        "one SeaweedFS server {}, {} runs (medians), a fresh mount for every \
         measurement, page cache {} before each; reads 1 MiB per read(2), writes 1 MiB per \
         write(2); every peer's bytes checked by BLAKE3",
        if args.remote {
            "behind an emulated remote link (benches/netem.sh: 10 ms RTT, 100 MB/s per TCP \
             connection)"
        } else {
            "on loopback"
        },
        args.runs,
        if args.keep_page_cache {
            "kept"
        } else {
            "dropped"
        }
    ));
    if args.unsigned_payload {
        report.note(
            "hotstart's request bodies unsigned (aws_unsigned_payload=true, its default over \
             https; this server is plain http)",
        );
    }
}
