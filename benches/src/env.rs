//! Dependency snapshots against the installers a user would run on every node, same run, same
//! wheelhouse, medians of `--runs`:
//!
//! * **pip**: `python -m venv T && T/bin/pip install --no-index --find-links WHEELHOUSE -r LOCK`.
//! * **uv, cold cache**: `uv venv T && uv pip install --offline --no-index ...` with an empty
//!   `UV_CACHE_DIR` each run; **uv, warm cache**: the same with a cache filled by an earlier run
//!   (uv then hard-links from its cache); **uv --compile-bytecode, cold cache**: uv making the
//!   `.pyc` files too, as pip does by default.
//! * **tar xzf** of pip's venv (made once with `tar czf`, not timed), and the floor of just
//!   creating its files: **cp -a** of the venv from the page cache.
//! * **hotstart**: `ensure` on a hit, restoring a snapshot eagerly into the same path from a
//!   local-directory store and from SeaweedFS on loopback, with an empty chunk cache each run
//!   (a new node) and with a warm one (a node that restored it before: files hard-linked).
//!
//! pip and uv do not make the same venv from one lock: pip's holds pip itself and the bytecode
//! pip compiles at install (for the full set 502 MB in 10,177 files, 3,844 of them `.pyc`), uv's
//! neither (387 MB in 5,604 files). So there are two snapshots, each the very venv its installer
//! made (captured by the `ensure` that ran the install on its miss), and each restore is compared
//! with the installer that made what it restores: pip's venv with pip (and with uv compiling
//! bytecode, tar and cp), uv's with uv. Everything installs into the same path. The cold-cache
//! runs of uv and of the restores alternate run by run, so the file system (which fills as the
//! benchmark goes on) is alike for all. Installs read the wheelhouse with `--no-index` (uv also
//! `--offline`), so no timing touches the network; the wheels are downloaded once, before any
//! timing, by `scripts/wheelhouse.sh` into `.cache/wheelhouse/`. The page cache is warm for
//! every tool alike (wheelhouse, tarball, store).
//!
//! A second lock adds a package that must be built from source (an sdist with a C extension,
//! `benches/env/sdist.txt`, regex): pip and uv compile it on every install, a restore does
//! not.
//!
//! **`--lazy` with a profile** (the wheels-only lock): `python -c "import numpy, pandas"` (numpy
//! and requests for `--set small`) from a lazy mount of pip's snapshot, on a new node (empty chunk
//! cache) after one earlier lazy start recorded the profile, against the same import from a
//! local venv (restored eagerly, page cache warm), the two alternating run by run, medians of
//! `--lazy-runs` pairs per store (a lazy start takes about a second and moves more from run to
//! run than an install, so it gets more runs than the rest). hotstart's
//! time runs from the `ensure` call (key, record, tree, mount, the profile's prefetch racing
//! the import) to the import's end; the bytes fetched (prefetched plus demand-fetched,
//! plaintext) are reported as a fraction of the environment's file bytes.
//!
//! Targets: restore ≥ 5× faster than pip and no slower than uv with a cold cache; with the
//! sdist, ≥ 10× faster than uv with a cold cache; `--lazy` with a profile within 1.5× of a local
//! venv while fetching ≤ 25% of the environment's bytes.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hotstart_env::{
    Action, EnsureConfig, EnvStore, KeyInputs, LazyOutcome, capture, ensure as hs_ensure,
    ensure_lazy, lazy_config,
};
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

use crate::report::{Report, Row, median};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Set {
    /// numpy, pandas, scipy, pyarrow, requests: about 500 MB installed.
    Full,
    /// numpy and requests: a quick check of the plumbing.
    Small,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Stores {
    Local,
    Seaweedfs,
    Both,
}

#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// Which packages.
    #[arg(long, value_enum, default_value = "full")]
    set: Set,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Stores to restore from.
    #[arg(long, value_enum, default_value = "both")]
    stores: Stores,
    /// Pairs of a lazy start and a local import per store; medians are reported.
    #[arg(long, default_value_t = 9)]
    lazy_runs: usize,
    /// Leave out the lock with a package built from source.
    #[arg(long)]
    no_sdist: bool,
    /// Directory (on the disk to measure) for the venvs, stores and caches; nothing is deleted
    /// until the end, so it needs about 40 GB free for the full set.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// The interpreter the venvs are made from.
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Seconds to let the disk settle (after a sync) between groups of runs (see `Trash`); 0
    /// for a quick check.
    #[arg(long, default_value_t = 10)]
    settle: u64,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// The wheelhouses (downloaded once) and the tools.
struct Setup {
    root: PathBuf,
    python: PathBuf,
    uv: PathBuf,
    find_links: Vec<PathBuf>,
}

impl Setup {
    fn new(args: &EnvArgs) -> anyhow::Result<Setup> {
        let root = hotstart_testkit::workspace_root().context("workspace root")?;
        let python = if args.python.is_absolute() {
            args.python.clone()
        } else {
            root.join(&args.python)
        };
        ensure!(
            python.exists(),
            "{} missing; run scripts/setup.sh",
            python.display()
        );
        let uv = root.join(".venv/bin/uv");
        ensure!(
            uv.exists(),
            "{} missing; run scripts/setup.sh (uv is in scripts/requirements-test.txt)",
            uv.display()
        );
        let set = match args.set {
            Set::Full => "full",
            Set::Small => "small",
        };
        let benv = root.join("benches/env");
        let mut find_links = Vec::new();
        let wheelhouses: [(String, PathBuf, &[&str]); 3] = [
            (
                format!("bench-{set}"),
                benv.join(format!("requirements-{set}.txt")),
                &[],
            ),
            (
                "bench-build".into(),
                benv.join("build-requirements.txt"),
                &[],
            ),
            (
                "bench-sdist".into(),
                benv.join("sdist.txt"),
                &["--no-binary=:all:", "--no-deps"],
            ),
        ];
        for (name, req, extra) in wheelhouses {
            let status = Command::new("bash")
                .arg(root.join("scripts/wheelhouse.sh"))
                .arg(&name)
                .arg(&req)
                .args(extra)
                .env("HOTSTART_WHEELHOUSE_PYTHON", &python)
                .status()?;
            ensure!(status.success(), "scripts/wheelhouse.sh {name} failed");
            find_links.push(root.join(".cache/wheelhouse").join(&name));
        }
        Ok(Setup {
            root,
            python,
            uv,
            find_links,
        })
    }

    fn links(&self) -> String {
        find_links(&self.find_links)
    }

    /// The pip install, as the command `ensure` runs on a miss.
    fn pip(&self, target: &Path, lock: &Path) -> Vec<String> {
        let script = format!(
            "'{py}' -m venv '{t}' && '{t}/bin/pip' install -q --disable-pip-version-check \
             --no-index {links} -r '{lock}'",
            py = self.python.display(),
            t = target.display(),
            links = self.links(),
            lock = lock.display()
        );
        vec!["sh".into(), "-c".into(), script]
    }

    /// uv's install (see [`Uv::install`]).
    fn uv(&self, target: &Path, lock: &Path, cache: &Path, compile: bool) -> Vec<String> {
        let uv = Uv {
            uv: &self.uv,
            python: &self.python,
            find_links: &self.find_links,
        };
        uv.install(target, lock, cache, compile)
    }
}

/// `--find-links 'DIR'` for each wheelhouse.
fn find_links(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|d| format!("--find-links '{}'", d.display()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// uv, making venvs from `python` out of the wheelhouses `find_links` only.
pub(crate) struct Uv<'a> {
    pub(crate) uv: &'a Path,
    pub(crate) python: &'a Path,
    pub(crate) find_links: &'a [PathBuf],
}

impl Uv<'_> {
    /// A new venv at `target` with `lock` installed, uv's cache in `cache`, as a shell command;
    /// `compile` adds `--compile-bytecode`, which makes the `.pyc` files pip makes by default.
    pub(crate) fn install(
        &self,
        target: &Path,
        lock: &Path,
        cache: &Path,
        compile: bool,
    ) -> Vec<String> {
        let script = format!(
            "export UV_CACHE_DIR='{cache}' && '{uv}' venv -q --python '{py}' '{t}' && '{uv}' pip \
             install -q --offline --no-index {compile}{links} --python '{t}/bin/python' -r '{lock}'",
            cache = cache.display(),
            uv = self.uv.display(),
            py = self.python.display(),
            t = target.display(),
            compile = if compile { "--compile-bytecode " } else { "" },
            links = find_links(self.find_links),
            lock = lock.display()
        );
        vec!["sh".into(), "-c".into(), script]
    }
}

/// A command given as argv.
fn shell(argv: &[String]) -> Command {
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]);
    c
}

fn run_ok(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("{cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn timed(cmd: &mut Command) -> anyhow::Result<Duration> {
    let t = Instant::now();
    run_ok(cmd)?;
    Ok(t.elapsed())
}

fn du(path: &Path) -> u64 {
    let out = Command::new("du").args(["-sb"]).arg(path).output();
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// A venv's size.
#[derive(Clone, Copy)]
struct Size {
    bytes: u64,
    files: u64,
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} MB, {} files", self.bytes / 1_000_000, self.files)
    }
}

/// One store's restores (medians).
struct Restores {
    store: String,
    /// Of pip's venv, and of uv's, with an empty chunk cache.
    pip_cold: Duration,
    uv_cold: Duration,
    /// Of uv's venv, with the chunk cache of an earlier restore.
    uv_warm: Duration,
}

/// Medians of one lock's measurements.
struct Measured {
    pip: Duration,
    uv_cold: Duration,
    /// uv with an empty cache and `--compile-bytecode`.
    uv_compiled: Duration,
    uv_warm: Duration,
    tar: Duration,
    cp: Duration,
    restores: Vec<Restores>,
    /// The import from a local venv, and per store: (name, lazy start + import, fraction of
    /// the environment's bytes fetched). Empty when not measured.
    local_import: Duration,
    lazy: Vec<(String, Duration, f64)>,
    pip_venv: Size,
    uv_venv: Size,
}

pub fn run(args: &EnvArgs) -> anyhow::Result<()> {
    ensure!(
        args.runs > 0 && args.lazy_runs > 0,
        "--runs and --lazy-runs must be at least 1"
    );
    let setup = Setup::new(args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let weed = match args.stores {
        Stores::Local => None,
        Stores::Seaweedfs | Stores::Both => Some(
            SeaweedFs::start().context("start SeaweedFS (run scripts/setup.sh to install weed)")?,
        ),
    };
    let mut table = Report::new("hotstart env: restore a snapshot vs reinstall");
    let set_file = match args.set {
        Set::Full => "requirements-full.txt",
        Set::Small => "requirements-small.txt",
    };
    let base = std::fs::read_to_string(setup.root.join("benches/env").join(set_file))?;
    let sdist = std::fs::read_to_string(setup.root.join("benches/env/sdist.txt"))?;
    let mut locks = vec![("wheels", base.clone())];
    if !args.no_sdist {
        locks.push(("wheels + sdist", format!("{base}{sdist}")));
    }
    let imports = match args.set {
        Set::Full => "numpy, pandas",
        Set::Small => "numpy, requests",
    };
    let mut works = Vec::new();
    for (label, lock) in locks {
        eprintln!("== {label} ==");
        let lazy_imports = (label == "wheels").then_some(imports);
        // Kept (with everything each measurement wrote) until the end: see `Trash`.
        let work = tempfile::tempdir_in(&args.dir)?;
        let m = runtime.block_on(measure(
            work.path(),
            args,
            &setup,
            weed.as_ref(),
            &lock,
            lazy_imports,
        ))?;
        works.push(work);
        let with_sdist = label != "wheels";
        for r in &m.restores {
            let store = &r.store;
            let what = format!(
                "restore (pip's venv, {label}; {}), {store}, cold cache",
                m.pip_venv
            );
            table.add(Row::time(
                &what,
                r.pip_cold,
                "pip install",
                m.pip,
                Some(5.0),
            ));
            table.add(Row::time(
                &what,
                r.pip_cold,
                "uv --compile-bytecode, cold cache",
                m.uv_compiled,
                None,
            ));
            if !with_sdist {
                table.add(Row::time(&what, r.pip_cold, "tar xzf", m.tar, None));
                table.add(Row::time(&what, r.pip_cold, "cp -a (floor)", m.cp, None));
            }
            let what = format!(
                "restore (uv's venv, {label}; {}), {store}, cold cache",
                m.uv_venv
            );
            let uv_target = if with_sdist { 10.0 } else { 1.0 };
            table.add(Row::time(
                &what,
                r.uv_cold,
                "uv, cold cache",
                m.uv_cold,
                Some(uv_target),
            ));
            let what = format!("restore (uv's venv, {label}), {store}, warm cache");
            table.add(Row::time(
                &what,
                r.uv_warm,
                "uv, warm cache",
                m.uv_warm,
                None,
            ));
        }
        for (store, took, fetched) in &m.lazy {
            let what = format!(
                "--lazy with a profile: ensure + `import {imports}` (pip's venv; {}), {store}, new node",
                m.pip_venv
            );
            table.add(Row::time(
                &what,
                *took,
                "import from a local venv",
                m.local_import,
                Some(1.0 / 1.5),
            ));
            table.note(format!(
                "--lazy, {store}: fetched {:.1}% of the environment's bytes (target ≤ 25%: {})",
                fetched * 100.0,
                if *fetched <= 0.25 { "met" } else { "NOT met" }
            ));
        }
    }
    table.note(format!(
        "medians of {} runs ({} pairs for --lazy); Python {}; every install from a local \
         wheelhouse with --no-index, no network; page cache warm for every tool",
        args.runs,
        args.lazy_runs,
        setup.python.display()
    ));
    table.note(
        "cold cache: an empty chunk cache (a new node); warm: the chunks are cached, so small \
         files are hard-linked, as uv does from its warm cache",
    );
    table.finish(args.markdown.as_deref())
}

/// Where replaced venvs and caches go: nothing is deleted until the whole benchmark is over.
/// Creating files soon after tens of thousands were deleted on the same ext4 file system is slow
/// (new inodes skip ones freed in the last minute, or the last six while their inode table
/// block is dirty, which creating files makes it), which would charge one tool for another's
/// cleanup. So every tool writes into inodes nobody freed during the run; between groups of runs
/// the file system is synced and left for `--settle` seconds, so the writeback of one group
/// does not run during the next, and it is synced before each timed run that writes a whole
/// venv (hundreds of MB) with a cold cache.
struct Trash {
    dir: PathBuf,
    n: usize,
    settle: Duration,
}

impl Trash {
    fn new(work: &Path, settle: Duration) -> anyhow::Result<Trash> {
        let dir = work.join("trash");
        std::fs::create_dir_all(&dir)?;
        Ok(Trash { dir, n: 0, settle })
    }

    /// Moves `path` (if it exists) out of the way, instantly.
    fn retire(&mut self, path: &Path) -> anyhow::Result<()> {
        self.n += 1;
        match std::fs::rename(path, self.dir.join(self.n.to_string())) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("retire {}", path.display())),
        }
    }

    /// Quiets the disk before the next group of timed runs.
    fn settle(&mut self) -> anyhow::Result<()> {
        self.sync()?;
        std::thread::sleep(self.settle);
        Ok(())
    }

    /// Writes back what earlier runs wrote, so that the next one is not held up by it (the
    /// kernel makes a writer wait once dirty pages pass its limits).
    fn sync(&self) -> anyhow::Result<()> {
        run_ok(&mut Command::new("sync"))
    }
}

/// A venv installed by one installer through an `ensure` miss, which captured it into the
/// local store, then captured into every other store too.
struct Snapshot {
    /// The `ensure` that restores it (its install command is the installer's).
    cfg: EnsureConfig,
    /// The install, as timed by the miss.
    install: Duration,
    size: Size,
}

/// Installs with `install` (the installer `name`) into `base.target` through an `ensure` miss on
/// the first of `stores` (which captures and publishes the venv), publishes the same venv to the
/// other stores, and checks that a restore of it imports `imports`. Leaves the restored venv at
/// the target.
async fn snapshot(
    base: &EnsureConfig,
    name: &str,
    install: Vec<String>,
    stores: &[(String, Store)],
    node: impl Fn(&str) -> PathBuf,
    trash: &mut Trash,
    imports: &str,
) -> anyhow::Result<Snapshot> {
    let mut cfg = base.clone();
    cfg.install = install;
    cfg.cache_dir = node("node-capture");
    let first = hs_ensure(&stores[0].1, &cfg).await?;
    let Action::Installed {
        install_seconds,
        capture: published,
    } = &first.action
    else {
        bail!("the first ensure should install, not {:?}", first.action);
    };
    let published = published
        .as_ref()
        .as_ref()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    eprintln!(
        "  {name} (via ensure's miss): {install_seconds:.2} s; captured in {:.2} s",
        published.seconds
    );
    let size = Size {
        bytes: du(&cfg.target),
        files: published.record.files,
    };
    for (_, store) in &stores[1..] {
        let spec = cfg.key_spec()?;
        let inputs = tokio::task::spawn_blocking(move || KeyInputs::gather(&spec)).await??;
        let env = EnvStore::new(store, cfg.chunk_config())?;
        capture(
            &env,
            &inputs.key(),
            &inputs,
            &cfg.target,
            Default::default(),
        )
        .await?;
    }
    trash.retire(&cfg.cache_dir)?;
    trash.retire(&cfg.target)?;
    let mut check = cfg.clone();
    check.cache_dir = node("node-restore-check");
    let restored = hs_ensure(&stores[0].1, &check).await?;
    ensure!(
        matches!(restored.action, Action::Restored(_)),
        "expected a hit"
    );
    run_ok(Command::new(cfg.target.join("bin/python")).args(["-c", &format!("import {imports}")]))
        .context("the restored venv imports its packages")?;
    trash.retire(&check.cache_dir)?;
    Ok(Snapshot {
        cfg,
        install: Duration::from_secs_f64(*install_seconds),
        size,
    })
}

async fn measure(
    work: &Path,
    args: &EnvArgs,
    setup: &Setup,
    weed: Option<&SeaweedFs>,
    lock_body: &str,
    lazy_imports: Option<&str>,
) -> anyhow::Result<Measured> {
    let mut trash = Trash::new(work, Duration::from_secs(args.settle))?;
    let lock = work.join("requirements.txt");
    std::fs::write(&lock, lock_body)?;
    let target = work.join("venv");
    let runs = args.runs;
    let node = |name: &str| work.join(name);
    let imports = lock_body
        .lines()
        .filter_map(|l| l.split("==").next())
        .map(|n| n.trim())
        .filter(|n| !n.is_empty() && !n.starts_with('#'))
        .collect::<Vec<_>>()
        .join(", ");

    // The local store first: it holds every snapshot, and captures them on the installs' misses.
    let mut stores = vec![(
        "local directory store".to_string(),
        Store::open(&node("store").display().to_string())?,
    )];
    if let Some(weed) = weed {
        let url = weed.fresh_bucket("bench-env");
        stores.push((
            "SeaweedFS loopback".into(),
            Store::open_with(&url, &weed.client_options())?,
        ));
    }
    let mut base = EnsureConfig::new(vec![lock.clone()], target.clone(), Vec::new());
    base.python = setup.python.display().to_string();

    // Two snapshots of the lock: the venv pip makes (with pip in it, and bytecode, which pip
    // compiles by default) and the one uv makes (neither). Each restore is compared with the
    // installer that made what it restores.
    let pip_cmd = setup.pip(&target, &lock);
    let pip_snap = snapshot(
        &base,
        "pip",
        pip_cmd.clone(),
        &stores,
        node,
        &mut trash,
        &imports,
    )
    .await?;
    let mut pip = vec![pip_snap.install];
    for _ in 1..runs {
        trash.retire(&target)?;
        pip.push(timed(&mut shell(&pip_cmd))?);
    }

    // tar xzf and the cp -a floor, of the venv pip made (the one at the target now).
    let tgz = node("venv.tgz");
    run_ok(
        Command::new("tar")
            .arg("czf")
            .arg(&tgz)
            .arg("-C")
            .arg(work)
            .arg("venv"),
    )?;
    let copy_src = node("venv-src");
    run_ok(Command::new("cp").arg("-a").arg(&target).arg(&copy_src))?;
    trash.settle()?;
    let mut tar = Vec::new();
    let mut cp = Vec::new();
    for _ in 0..runs {
        trash.retire(&target)?;
        trash.sync()?;
        tar.push(timed(
            Command::new("tar").arg("xzf").arg(&tgz).arg("-C").arg(work),
        )?);
        trash.retire(&target)?;
        trash.sync()?;
        cp.push(timed(
            Command::new("cp").arg("-a").arg(&copy_src).arg(&target),
        )?);
    }
    trash.retire(&copy_src)?;
    std::fs::remove_file(&tgz)?;

    trash.retire(&target)?;
    let uv_capture = setup.uv(&target, &lock, &node("uv-capture"), false);
    let uv_snap = snapshot(&base, "uv", uv_capture, &stores, node, &mut trash, &imports).await?;
    trash.retire(&node("uv-capture"))?;
    let local = stores[0].1.clone();
    if args.stores == Stores::Seaweedfs {
        stores.remove(0);
    }

    // Cold caches: uv (as it comes, and compiling bytecode) and a restore of each snapshot from
    // each store alternate run by run. Nothing is deleted during the benchmark (see `Trash`),
    // so the file system fills as it goes on; alternating gives every tool the same file
    // system, as it does a machine that drifts.
    trash.settle()?;
    let (mut uv_cold, mut uv_compiled) = (Vec::new(), Vec::new());
    let mut cold = vec![(Vec::new(), Vec::new()); stores.len()];
    for i in 0..runs {
        for (compile, times) in [(false, &mut uv_cold), (true, &mut uv_compiled)] {
            trash.retire(&target)?;
            let cache = node(&format!("uv-cold-{compile}-{i}"));
            trash.sync()?;
            times.push(timed(&mut shell(
                &setup.uv(&target, &lock, &cache, compile),
            ))?);
            trash.retire(&cache)?;
        }
        for (s, (_, store)) in stores.iter().enumerate() {
            let (uv_times, pip_times) = &mut cold[s];
            for (snap, times) in [(&uv_snap, uv_times), (&pip_snap, pip_times)] {
                let mut c = snap.cfg.clone();
                c.cache_dir = node(&format!("hs-cold-{s}-{i}"));
                trash.retire(&target)?;
                trash.sync()?;
                times.push(restore_once(store, &c).await?);
                trash.retire(&c.cache_dir)?;
            }
        }
    }

    // Warm caches: uv hard-links from its cache, a restore of uv's venv from its node's chunk
    // cache.
    let warm_cache = node("uv-warm");
    let uv_warm_cmd = setup.uv(&target, &lock, &warm_cache, false);
    trash.retire(&target)?;
    run_ok(&mut shell(&uv_warm_cmd))?;
    trash.settle()?;
    let mut uv_warm = Vec::new();
    for _ in 0..runs {
        trash.retire(&target)?;
        uv_warm.push(timed(&mut shell(&uv_warm_cmd))?);
    }
    trash.retire(&warm_cache)?;
    let mut restores = Vec::new();
    for ((name, store), (uv_cold, pip_cold)) in stores.iter().zip(cold) {
        let mut warm = uv_snap.cfg.clone();
        warm.cache_dir = node("hs-warm");
        trash.retire(&target)?;
        restore_once(store, &warm).await?;
        trash.settle()?;
        let mut warm_runs = Vec::new();
        for _ in 0..runs {
            trash.retire(&target)?;
            warm_runs.push(restore_once(store, &warm).await?);
        }
        trash.retire(&warm.cache_dir)?;
        restores.push(Restores {
            store: name.clone(),
            pip_cold: median(pip_cold),
            uv_cold: median(uv_cold),
            uv_warm: median(warm_runs),
        });
    }

    // --lazy with a profile, against the same import from the local venv. The two alternate
    // (the local venv moved aside while the snapshot is mounted at its path), so a machine
    // that speeds up or slows down during the run moves both alike.
    let (mut local_import, mut lazy) = (Duration::ZERO, Vec::new());
    if let Some(imports) = lazy_imports {
        let code = format!("import {imports}");
        let mut c = pip_snap.cfg.clone();
        c.cache_dir = node("local-venv");
        trash.retire(&target)?;
        hs_ensure(&local, &c).await?;
        let import = || -> anyhow::Result<Duration> {
            timed(Command::new(target.join("bin/python")).args(["-c", &code]))
        };
        import()?; // the page cache, warm as for every other tool
        let aside = target.with_extension("local");
        let mut local_runs = Vec::new();
        for (s, (name, store)) in stores.iter().enumerate() {
            // One start records the profile; then each run is a new node that replays it.
            let mut c = pip_snap.cfg.clone();
            let mut start = |cache: String| {
                c.cache_dir = node(&cache);
                let c = c.clone();
                let (target, aside, code) = (&target, &aside, &code);
                async move {
                    std::fs::rename(target, aside)?;
                    let started = lazy_start(store, &c, target, code).await;
                    std::fs::rename(aside, target)?;
                    anyhow::Ok((started?, c.cache_dir))
                }
            };
            let (_, cache) = start(format!("lazy-{s}-record")).await?;
            trash.retire(&cache)?;
            let (mut took, mut fetched) = (Vec::new(), Vec::new());
            for i in 0..args.lazy_runs {
                local_runs.push(import()?);
                let ((t, f), cache) = start(format!("lazy-{s}-{i}")).await?;
                took.push(t);
                fetched.push(f);
                trash.retire(&cache)?;
            }
            fetched.sort_by(f64::total_cmp);
            lazy.push((name.clone(), median(took), fetched[fetched.len() / 2]));
        }
        local_import = median(local_runs);
        eprintln!(
            "  import from a local venv: {:.3} s",
            local_import.as_secs_f64()
        );
        trash.retire(&c.cache_dir)?;
    }
    trash.retire(&target)?;
    trash.settle()?;
    Ok(Measured {
        local_import,
        lazy,
        pip: median(pip),
        uv_cold: median(uv_cold),
        uv_compiled: median(uv_compiled),
        uv_warm: median(uv_warm),
        tar: median(tar),
        cp: median(cp),
        restores,
        pip_venv: pip_snap.size,
        uv_venv: uv_snap.size,
    })
}

/// One `ensure` that must be a hit; its wall time.
async fn restore_once(store: &Store, cfg: &EnsureConfig) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let out = hs_ensure(store, cfg).await?;
    let took = t.elapsed();
    let Action::Restored(r) = &out.action else {
        bail!("expected a restore, got {:?}", out.action);
    };
    eprintln!(
        "    restored {} files in {:.2} s ({} linked, {} chunks fetched, {} from the pack in {} \
         requests, {:.2} s)",
        r.files,
        took.as_secs_f64(),
        r.linked,
        r.fetched_chunks,
        r.packed_chunks,
        r.pack_requests,
        r.pack_seconds
    );
    Ok(took)
}

/// One `ensure --lazy` that must mount, then `python -c code` from the mount, then unmount: the
/// time from the call to the import's end, and the fraction of the environment's bytes fetched.
async fn lazy_start(
    store: &Store,
    cfg: &EnsureConfig,
    target: &Path,
    code: &str,
) -> anyhow::Result<(Duration, f64)> {
    let t = Instant::now();
    let LazyOutcome::Mounted(mounted) = ensure_lazy(store, cfg, lazy_config()).await? else {
        bail!("expected a lazy mount of the snapshot");
    };
    let mounted_after = mounted.seconds;
    let py = target.join("bin/python");
    let code = code.to_string();
    let imported =
        tokio::task::spawn_blocking(move || run_ok(Command::new(py).args(["-c", &code]))).await?;
    let took = t.elapsed();
    let done = mounted.unmount().await?;
    imported?;
    let r = &done.report;
    let fetched = (r.prefetched_bytes + r.demand_fetch_bytes) as f64 / done.bytes.max(1) as f64;
    eprintln!(
        "    --lazy: ensure + import in {:.3} s (mounted after {:.3} s); {} chunks planned, hit \
         rate {:.1}%, fetched {:.1}% of {} MB ({} chunks from the pack: {:.1} MB in {} GETs)",
        took.as_secs_f64(),
        mounted_after,
        r.planned_chunks,
        r.hit_rate * 100.0,
        fetched * 100.0,
        done.bytes / 1_000_000,
        done.packed.chunks,
        done.packed.bytes as f64 / 1e6,
        done.packed.requests,
    );
    Ok((took, fetched))
}
