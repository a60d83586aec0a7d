//! Starting a real program from an image: a Python installation (the interpreter, libpython, the
//! standard library) with numpy (`--packages`, taken from the virtualenv), run as
//! `python -c "import numpy, json, decimal, email, ..."`, four ways over the same store:
//!
//! - **(a) local copy**: the installation on local disk (the floor);
//! - **(b) full pull, then run**: `hotstart image pull` (every chunk, in parallel) into a fresh
//!   directory, then the program from there: what a user does without lazy loading;
//! - **(c) lazy mount, no profile**: `hotstart image mount --no-prefetch`, every chunk fetched at
//!   its first read;
//! - **(d) lazy mount with a profile**: the profile recorded by earlier mounts replayed ahead of
//!   the program;
//! - **(e)**, for reference: the program alone on a mount whose profile was fully prefetched
//!   before it started: what FUSE itself costs over (a).
//!
//! **The link.** The store is a local directory behind hotstart-store's throttled wrapper
//! (`wrap::Throttle`, in this process): every request waits `--latency-ms` (20 ms) before it is
//! sent and all requests together move at most `--mbps` (200 MB/s). The throttle is used rather
//! than `benches/netem.sh` so the benchmark needs no network namespaces or SeaweedFS; the
//! figures are for a store behind that link, whatever the store is.
//!
//! **What is timed.** (a), (e): the program. (b): the pull plus the program. (c), (d): mounting
//! (reading the image record and manifest over the link, building the namespace, the FUSE mount)
//! plus the program; the unmount after it is not timed. Every run starts with a fresh local
//! chunk cache and, unless `--keep-page-cache`, a dropped page cache (so (a) reads its files
//! from disk, and the store's files are read from disk too). Measured (d) runs do not record,
//! so every (d) run replays the same profile, made beforehand by `--record-runs` recording
//! mounts (not timed). Medians of `--runs` runs.
//!
//! **Checked.** Before anything is timed, the program is run once from a mount and must report
//! `sys.prefix`, numpy's path and the loaded libpython all inside the mount: the program really
//! runs from the image, not from the machine's own Python.
//!
//! ```text
//! cargo run --profile bench -p hotstart-benches -- image --runs 3
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hotstart_image::{BuildConfig, ImageRef, Images, LazyConfig, MountReport};
use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};

use crate::report::{Report, Row, median};
use crate::store_uring::drop_page_cache;

/// Options of `hotstart-benches image`.
#[derive(Debug, clap::Args)]
pub struct ImageArgs {
    /// The Python whose installation (and virtualenv site-packages, with numpy) is the image
    /// (default: the workspace's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Packages of the virtualenv's site-packages that go into the image (with the
    /// interpreter and its standard library).
    #[arg(long, default_value = "numpy")]
    packages: String,
    /// Modules the program imports.
    #[arg(
        long,
        default_value = "numpy,json,decimal,email.mime.text,http.client,urllib.request,sqlite3,asyncio,xml.etree.ElementTree,logging,argparse,csv,zipfile,tarfile,hashlib,statistics,fractions,unittest"
    )]
    modules: String,
    #[command(flatten)]
    link: LinkArgs,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Recording mounts that make the profile before (d) is measured.
    #[arg(long, default_value_t = 2)]
    record_runs: usize,
    /// Chunk size of the image, in KiB.
    #[arg(long, default_value_t = 1024)]
    chunk_kib: usize,
    /// The kernel read-ahead of the lazy mounts, in KiB (0: the kernel's default, 128 KiB).
    #[arg(long, default_value_t = hotstart_image::mount::KERNEL_READ_AHEAD >> 10)]
    kernel_read_ahead_kib: u64,
    /// Do not drop the page cache before each run.
    #[arg(long)]
    keep_page_cache: bool,
    /// Do not store prefetched pages in the kernel's page cache ahead of the program.
    #[arg(long)]
    no_warm: bool,
    /// Scratch directory (on disk): the installation copy, the store, caches, mount points.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// The emulated remote link of the image and container benchmarks.
#[derive(Debug, clap::Args)]
pub(crate) struct LinkArgs {
    /// Added delay per request, in milliseconds.
    #[arg(long, default_value_t = 20)]
    pub(crate) latency_ms: u64,
    /// The link's bandwidth, in MB/s (10^6 bytes per second).
    #[arg(long, default_value_t = 200)]
    pub(crate) mbps: u64,
}

impl LinkArgs {
    /// hotstart-store's throttle with this latency and bandwidth (for all requests together).
    pub(crate) fn throttle(&self) -> Arc<Throttle> {
        Arc::new(Throttle::new(ThrottleConfig {
            latency: Duration::from_millis(self.latency_ms),
            per_request_bytes_per_sec: None,
            total_bytes_per_sec: Some(self.mbps * 1_000_000),
        }))
    }
}

/// What `python -c` reports about itself.
const PROBE: &str = "import sys, numpy\n\
maps = open('/proc/self/maps').read()\n\
lib = [l.split()[-1] for l in maps.splitlines() if 'libpython' in l][:1]\n\
print(sys.prefix); print(numpy.__file__); print(lib[0] if lib else '')";

/// The Python installation: where things are, from the interpreter itself.
pub(crate) struct Python {
    pub(crate) version: String,
    pub(crate) base_prefix: PathBuf,
    pub(crate) purelib: PathBuf,
    pub(crate) executable: PathBuf,
    pub(crate) libpython: Option<PathBuf>,
}

pub(crate) fn python_info(python: &Path) -> anyhow::Result<Python> {
    let code = "import sys, sysconfig, os\n\
v = sysconfig.get_config_var('py_version_short')\n\
lib = os.path.join(sysconfig.get_config_var('LIBDIR') or '', sysconfig.get_config_var('INSTSONAME') or '')\n\
print(v); print(sys.base_prefix); print(sysconfig.get_paths()['purelib'])\n\
print(os.path.realpath(sys.executable)); print(lib if os.path.isfile(lib) else '')";
    let out = Command::new(python)
        .args(["-c", code])
        .output()
        .with_context(|| format!("run {}", python.display()))?;
    ensure!(
        out.status.success(),
        "{}: {}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    ensure!(
        lines.len() == 5,
        "unexpected output from {}: {text}",
        python.display()
    );
    Ok(Python {
        version: lines[0].to_string(),
        base_prefix: lines[1].into(),
        purelib: lines[2].into(),
        executable: lines[3].into(),
        libpython: (!lines[4].is_empty()).then(|| lines[4].into()),
    })
}

fn cp(from: &Path, to: &Path) -> anyhow::Result<()> {
    let st = Command::new("cp").arg("-a").arg(from).arg(to).status()?;
    ensure!(st.success(), "cp -a {} {}", from.display(), to.display());
    Ok(())
}

/// A self-contained installation at `root`: the interpreter, libpython, the standard library
/// (without its test suite, static library and the base site-packages) and `packages` from the
/// virtualenv's site-packages (each a package directory or a one-file module, with its `.libs`
/// directory and metadata).
pub(crate) fn install_tree(py: &Python, root: &Path, packages: &[&str]) -> anyhow::Result<()> {
    let ver = format!("python{}", py.version);
    let (bin, lib) = (root.join("bin"), root.join("lib"));
    std::fs::create_dir_all(&bin)?;
    std::fs::create_dir_all(&lib)?;
    cp(&py.executable, &bin.join(&ver))?;
    std::os::unix::fs::symlink(&ver, bin.join("python3"))?;
    if let Some(l) = &py.libpython {
        cp(l, &lib.join(l.file_name().context("libpython name")?))?;
    }
    let stdlib = py.base_prefix.join("lib").join(&ver);
    let dest = lib.join(&ver);
    std::fs::create_dir_all(&dest)?;
    for e in std::fs::read_dir(&stdlib)? {
        let e = e?;
        let name = e.file_name();
        let skip = [
            "test",
            "site-packages",
            "idlelib",
            "tkinter",
            "turtledemo",
            "ensurepip",
        ];
        if skip.iter().any(|s| name == *s) || name.to_string_lossy().starts_with("config-") {
            continue;
        }
        cp(&e.path(), &dest.join(&name))?;
    }
    let site = dest.join("site-packages");
    std::fs::create_dir_all(&site)?;
    for pkg in packages {
        let mut found = false;
        for e in std::fs::read_dir(&py.purelib)? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            let dist = name
                .strip_suffix(".dist-info")
                .and_then(|n| n.split_once('-'))
                .is_some_and(|(n, _)| n.eq_ignore_ascii_case(&pkg.replace('-', "_")));
            let module = name == *pkg || name == format!("{pkg}.py");
            if module || name == format!("{pkg}.libs") || dist {
                cp(&e.path(), &site.join(&name))?;
                found |= module;
            }
        }
        ensure!(found, "no package {pkg} in {}", py.purelib.display());
    }
    Ok(())
}

/// Runs the program from the installation at `root`; returns its wall time and stdout.
fn run_python(root: &Path, version: &str, code: &str) -> anyhow::Result<(Duration, String)> {
    let exe = root.join("bin").join(format!("python{version}"));
    let start = Instant::now();
    let out = Command::new(&exe)
        .args(["-s", "-c", code])
        .env_clear()
        .env("PYTHONHOME", root)
        .env("LD_LIBRARY_PATH", root.join("lib"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("PATH", "/usr/bin:/bin")
        .output()
        .with_context(|| format!("run {}", exe.display()))?;
    let took = start.elapsed();
    ensure!(
        out.status.success(),
        "{} failed: {}",
        exe.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((took, String::from_utf8(out.stdout)?))
}

struct Bench<'a> {
    args: &'a ImageArgs,
    rt: tokio::runtime::Runtime,
    scratch: tempfile::TempDir,
    /// The store behind the emulated link.
    remote: Store,
    image: ImageRef,
    version: String,
    program: String,
}

impl Bench<'_> {
    fn fresh(&self, name: &str) -> anyhow::Result<PathBuf> {
        let p = self.scratch.path().join(name);
        if p.exists() {
            std::fs::remove_dir_all(&p)?;
        }
        std::fs::create_dir_all(&p)?;
        Ok(p)
    }

    /// Images over the link with a fresh local chunk cache.
    fn images(&self) -> anyhow::Result<Images> {
        let cfg = ChunkStoreConfig {
            cache_dir: Some(self.fresh("cache")?),
            concurrency: 64,
            ..ChunkStoreConfig::default()
        };
        Ok(Images::new(ChunkStore::new(self.remote.clone(), cfg)?))
    }

    fn settle(&self) -> anyhow::Result<()> {
        if !self.args.keep_page_cache {
            drop_page_cache().context("drop the page cache (needs root)")?;
        }
        Ok(())
    }

    /// Mounts with `cfg`, runs `code`, unmounts; returns the time to mount and run, stdout and
    /// the mount's report. With `prefetched`, the prefetcher finishes before the program starts
    /// and only the program is timed.
    fn lazy(
        &self,
        cfg: LazyConfig,
        code: &str,
        prefetched: bool,
    ) -> anyhow::Result<(Duration, String, MountReport)> {
        let images = self.images()?;
        let mp = self.fresh("mnt")?;
        self.settle()?;
        let mut start = Instant::now();
        let mut m = self.rt.block_on(images.mount(&self.image, &mp, cfg))?;
        if prefetched {
            self.rt.block_on(m.prefetch_done());
            start = Instant::now();
        }
        let run = run_python(&mp, &self.version, code);
        let took = start.elapsed();
        let report = self.rt.block_on(m.unmount())?;
        let (_, out) = run?;
        Ok((took, out, report))
    }

    fn pull_and_run(&self) -> anyhow::Result<Duration> {
        let images = self.images()?;
        let dest = self.scratch.path().join("pulled");
        if dest.exists() {
            std::fs::remove_dir_all(&dest)?;
        }
        self.settle()?;
        let start = Instant::now();
        self.rt.block_on(images.pull(&self.image, &dest))?;
        run_python(&dest, &self.version, &self.program)?;
        Ok(start.elapsed())
    }
}

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

pub fn run(args: &ImageArgs) -> anyhow::Result<()> {
    let python = match &args.python {
        Some(p) => p.clone(),
        None => hotstart_testkit::workspace_root()
            .context("no workspace root; give --python")?
            .join(".venv/bin/python"),
    };
    ensure!(args.runs >= 1, "--runs must be at least 1");
    let py = python_info(&python)?;
    let scratch = tempfile::Builder::new()
        .prefix("hotstart-bench-image-")
        .tempdir_in(&args.dir)?;
    let local = scratch.path().join("python");
    let packages: Vec<&str> = args.packages.split(',').map(str::trim).collect();
    install_tree(&py, &local, &packages)?;
    let modules: Vec<&str> = args.modules.split(',').map(str::trim).collect();
    let program = format!(
        "import {}\nnumpy.linalg.inv(numpy.eye(4) * 2.0)\nprint('ok')",
        modules.join(", ")
    );
    ensure!(modules.contains(&"numpy"), "--modules must include numpy");

    let store_dir = scratch.path().join("store");
    let store = Store::open(store_dir.to_str().context("scratch path")?)?;
    let link = args.link.throttle();
    let remote = store.wrap(|inner| link.wrap(inner));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()?;
    let image = ImageRef::parse(&format!("bench/python:{}", py.version))?;
    // Built straight into the store (not over the link): building is not what is measured.
    let builder = Images::new(ChunkStore::new(store, ChunkStoreConfig::default())?);
    let built = Instant::now();
    let record = rt.block_on(builder.build(
        &local,
        &image,
        &BuildConfig {
            chunk_size: args.chunk_kib.max(4) << 10,
            ..BuildConfig::default()
        },
    ))?;
    eprintln!(
        "image {}: {} files, {:.0} MiB in {} chunks ({:.0} MiB stored), built in {:.1} s",
        record.image,
        record.counts.files,
        record.counts.bytes as f64 / (1 << 20) as f64,
        record.counts.chunks,
        record.new_bytes as f64 / (1 << 20) as f64,
        built.elapsed().as_secs_f64()
    );
    let bench = Bench {
        args,
        rt,
        scratch,
        remote,
        image,
        version: py.version.clone(),
        program,
    };

    let cfg = |prefetch: bool, record: bool| {
        let d = LazyConfig::default();
        LazyConfig {
            prefetch,
            record,
            warm_page_cache: !args.no_warm,
            mount: hotstart_fuse::MountOptions {
                kernel_read_ahead: (args.kernel_read_ahead_kib > 0)
                    .then_some(args.kernel_read_ahead_kib << 10),
                ..d.mount.clone()
            },
            ..d
        }
    };

    // The program runs from the image, not from this machine's Python.
    let (_, probe, _) = bench.lazy(cfg(false, false), PROBE, false)?;
    let lines: Vec<&str> = probe.lines().collect();
    let mp = bench.scratch.path().join("mnt");
    if lines.len() != 3 || !lines.iter().all(|l| Path::new(l).starts_with(&mp)) {
        bail!(
            "the program did not run from the mount {}: {probe}",
            mp.display()
        );
    }
    run_python(&local, &bench.version, &bench.program)?;

    for i in 0..args.record_runs {
        let (t, _, r) = bench.lazy(cfg(i > 0, true), &bench.program, false)?;
        eprintln!("  recording run {}: {}: {}", i + 1, secs(t), r.summary());
    }

    let (mut a, mut b, mut c, mut d, mut e) = (vec![], vec![], vec![], vec![], vec![]);
    let (mut c_reports, mut d_reports) = (Vec::new(), Vec::new());
    for i in 0..args.runs {
        bench.settle()?;
        let (t, _) = run_python(&local, &bench.version, &bench.program)?;
        a.push(t);
        b.push(bench.pull_and_run()?);
        let (t, _, r) = bench.lazy(cfg(false, false), &bench.program, false)?;
        c.push(t);
        c_reports.push(r);
        let (t, _, r) = bench.lazy(cfg(true, false), &bench.program, false)?;
        d.push(t);
        let (t, _, _) = bench.lazy(cfg(true, false), &bench.program, true)?;
        e.push(t);
        eprintln!(
            "  run {}: (a) {} (b) {} (c) {} (d) {} (e) {}; (d): {}",
            i + 1,
            secs(a[i]),
            secs(b[i]),
            secs(c[i]),
            secs(d[i]),
            secs(e[i]),
            r.summary()
        );
        d_reports.push(r);
    }
    let (a, b, c, d, e) = (median(a), median(b), median(c), median(d), median(e));
    let mid = |rs: &[MountReport], f: fn(&MountReport) -> f64| {
        let mut v: Vec<f64> = rs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let hit = mid(&d_reports, |r| r.hit_rate);
    let waste = mid(&d_reports, |r| r.waste_ratio());
    let read_mib = mid(&d_reports, |r| r.chunk_bytes_read as f64) / (1 << 20) as f64;
    let mut report = Report::new("Lazy images (`hotstart image`)");
    report.note(format!(
        "Python {} with {}: {} files, {:.0} MiB; the program imports {} modules. Store behind \
         an emulated link: {} ms per request, {} MB/s (hotstart-store's throttled wrapper). \
         Kernel read-ahead of the mounts: {}. Medians of {} runs, page cache dropped before \
         each{}.",
        py.version,
        packages.join(", "),
        record.counts.files,
        record.counts.bytes as f64 / (1 << 20) as f64,
        modules.len(),
        args.link.latency_ms,
        args.link.mbps,
        match args.kernel_read_ahead_kib {
            0 => "the kernel's default (128 KiB)".to_string(),
            k => format!("{k} KiB"),
        },
        args.runs,
        if args.keep_page_cache {
            " (not: --keep-page-cache)"
        } else {
            ""
        }
    ));
    let with_profile = "start on a lazy mount with profile";
    // The floor: a local copy may be at most 1.3 times faster.
    report.add(Row::time(
        with_profile,
        d,
        "local copy (floor)",
        a,
        Some(1.0 / 1.3),
    ));
    report.add(Row::time(
        with_profile,
        d,
        "full pull, then run",
        b,
        Some(3.0),
    ));
    report.add(Row::time(
        "start on a lazy mount without profile",
        c,
        "full pull, then run",
        b,
        None,
    ));
    report.add(Row::time(
        "the program alone on a fully prefetched mount (FUSE floor)",
        e,
        "local copy (floor)",
        a,
        None,
    ));
    report.note(format!(
        "Lazy mount with profile: hit rate {:.1}% (target ≥ 90% {}), wasted prefetch {:.1}% of \
         {read_mib:.1} MiB read (target ≤ 15% {}).",
        hit * 100.0,
        if hit >= 0.9 { "✓" } else { "✗" },
        waste * 100.0,
        if waste <= 0.15 { "✓" } else { "✗" },
    ));
    let c_mid = &c_reports[c_reports.len() / 2];
    report.note(format!(
        "Without a profile the mount read {} chunks ({:.1} MiB) with {} demand fetches and \
         {:.2} s of stall; with one it replayed a profile of {} chunks.",
        c_mid.chunks_read,
        c_mid.chunk_bytes_read as f64 / (1 << 20) as f64,
        c_mid.demand_fetches,
        c_mid.stall_seconds,
        d_reports[d_reports.len() / 2].planned_chunks,
    ));
    report.finish(args.markdown.as_deref())?;
    Ok(())
}
