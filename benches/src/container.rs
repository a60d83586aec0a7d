//! Starting a container with containerd and runc: a Python image with numpy and pandas (the
//! interpreter, its standard library and the packages, with every library they load), run as
//! `python -c "import numpy, pandas; print('ready')"`, timed from the pull request to the
//! container's exit after printing `ready`, four ways:
//!
//! - **(a) image already unpacked** on the node, containerd's own overlayfs snapshotter;
//! - **(a') the registry's part of a pull**: a CRI pull, on (a)'s containerd, of the same
//!   layers under another config, so that it fetches a new manifest and config over the link
//!   and finds every layer unpacked. A node that does not hold the image pays it in every start
//!   below, so (a) + (a') is their floor;
//! - **(b) containerd's pull and unpack, then run**: a CRI pull (what a kubelet asks) of the
//!   plain image with the overlayfs snapshotter, every layer downloaded and unpacked;
//! - **(c) hotstart, no profile**: a CRI pull of the image converted by
//!   `hotstart image convert`, with `hotstart snapshotter`: the layers are mounted lazily, never
//!   downloaded, and every chunk is fetched at its first read;
//! - **(d) hotstart with a profile**: the same after one start recorded the chunks it read: the
//!   profile is replayed (and the page cache warmed) before the container's first read.
//!
//! **The link.** The registry (Debian's `docker-registry`) and the chunk store are behind the
//! same emulated remote link: every request waits `--latency-ms` (20 ms) and everything they
//! send moves at most `--mbps` (200 MB/s) together. The registry is reached through a TCP proxy
//! in this process that holds each burst a client sends (a request) for the latency and paces
//! what comes back; the store is a local directory behind hotstart-store's throttle
//! (`wrap::Throttle`), which the snapshotter (run in this process, the same code as
//! `hotstart snapshotter`) reads through.
//!
//! **Fair starts.** Every run drops the page cache first (cold, as on a node that never ran
//! the image), and (b), (c), (d) start from a fresh containerd (nothing pulled) and, for (c)
//! and (d), a fresh snapshotter with an empty local chunk cache. (c) removes the layers'
//! profiles first; (d) has the one (c) just recorded. Medians of `--runs` runs.
//!
//! **The lazy-pull system users would pick instead**, stargz-snapshotter, installed by
//! `scripts/stargz.sh` where it is missing (Debian packages its library and `ctr-remote`;
//! `benches/peers/stargz` serves the library to containerd as a proxy snapshotter), on the same
//! image, registry and link, with its defaults (prefetch and background fetch on):
//!
//! - **(e) stargz, not optimized**: the image converted to eStargz
//!   (`ctr-remote images optimize --no-optimize`), CRI pull and run, fresh snapshotter and cache;
//! - **(f) stargz, optimized**: converted by `ctr-remote images optimize`, which runs the image's
//!   command once and puts the files it read first, marked for prefetch (stargz's counterpart of
//!   (d)'s profile, made from the same command).
//!
//! nydus-snapshotter is not packaged for Debian and is not measured.
//!
//! ```text
//! cargo run --profile bench -p hotstart-benches -- container --runs 3
//! ```

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use hotstart_image::snapshotter::{Lazy, Snapshots};
use hotstart_image::{
    BuildConfig, Images, LazyConfig, MountReport, artifact_stats, container_image,
};
use hotstart_store::wrap::{Counter, Interceptor, Op};
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};
use hotstart_testkit::{Containerd, Registry, oci};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::image::{LinkArgs, install_tree, python_info};
use crate::report::{Report, Row, median};
use crate::store_uring::drop_page_cache;

/// Options of `hotstart-benches container`.
#[derive(Debug, clap::Args)]
pub struct ContainerArgs {
    /// The Python whose installation (and virtualenv site-packages) makes the image (default:
    /// the workspace's .venv).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Packages (or one-file modules) of the virtualenv's site-packages in the image.
    #[arg(long, default_value = "numpy,pandas,dateutil,tzdata")]
    packages: String,
    /// What the program imports before it prints `ready`.
    #[arg(long, default_value = "numpy,pandas")]
    imports: String,
    /// The link in front of the registry and the store.
    #[command(flatten)]
    link: LinkArgs,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Chunk size of the converted layers, in KiB.
    #[arg(long, default_value_t = 1024)]
    chunk_kib: usize,
    /// A diagnosis, not a start a user sees: (d) waits this long between its pull and its run,
    /// not counted in its time, so that the profile's replay has finished before the container
    /// reads (what is left of (d)'s run over (a)'s is then the lazy layers' own cost).
    #[arg(long, default_value_t = 0)]
    settle_ms: u64,
    /// Scratch directory (on disk): the image, the store, containerd's and the snapshotter's
    /// state.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// The emulated link's pacing of what servers send: one budget for all connections.
struct Pace {
    bytes_per_sec: f64,
    next: Mutex<Instant>,
    /// Bytes the servers sent through the link.
    sent: AtomicU64,
}

impl Pace {
    /// When `n` more bytes may have arrived.
    fn reserve(&self, n: usize) -> Instant {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        let start = (*next).max(Instant::now());
        *next = start + Duration::from_secs_f64(n as f64 / self.bytes_per_sec);
        *next
    }
}

/// A TCP proxy from `listen` to `upstream` behind the link: each burst a client sends waits
/// `latency`, and what the server sends is paced by `pace`.
async fn proxy(
    listen: tokio::net::TcpListener,
    upstream: std::net::SocketAddr,
    latency: Duration,
    pace: Arc<Pace>,
) {
    loop {
        let Ok((client, _)) = listen.accept().await else {
            return;
        };
        let pace = pace.clone();
        tokio::spawn(async move {
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                return;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let up = async move {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match cr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    tokio::time::sleep(latency).await;
                    if sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = sw.shutdown().await;
            };
            let down = async move {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = match sr.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    tokio::time::sleep_until(pace.reserve(n).into()).await;
                    if cw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                let _ = cw.shutdown().await;
            };
            tokio::join!(up, down);
        });
    }
}

/// The Python image, before it is written as a layout.
struct PythonImage {
    /// Three layer tarballs: system libraries; the interpreter and its standard library; the
    /// packages.
    layers: Vec<Vec<u8>>,
    env: Vec<String>,
    cmd: Vec<String>,
}

/// The Python image of the installation of `python` with `packages`, built under `scratch`.
fn python_image(
    python: &Path,
    packages: &[&str],
    imports: &[&str],
    scratch: &Path,
) -> anyhow::Result<PythonImage> {
    let py = python_info(python)?;
    let full = scratch.join("full/usr/local");
    install_tree(&py, &full, packages)?;
    let ver = format!("python{}", py.version);
    // The packages go into a layer of their own; the rest of the installation into another.
    let site = full.join("lib").join(&ver).join("site-packages");
    let pkgs = scratch.join("pkgs");
    let pkg_site = pkgs.join("usr/local/lib").join(&ver).join("site-packages");
    std::fs::create_dir_all(pkg_site.parent().context("site-packages path")?)?;
    std::fs::rename(&site, &pkg_site)?;
    std::fs::create_dir_all(&site)?;
    // Every library the interpreter and the packages' extensions load, from this machine.
    let mut objects = vec![full.join("bin").join(&ver)];
    for root in [&full, &pkgs] {
        for e in walk(root)? {
            let name = e.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.ends_with(".so") || name.contains(".so.") {
                objects.push(e);
            }
        }
    }
    let libs = scratch.join("libs");
    for lib in oci::libraries(&objects, Some(scratch)) {
        let to = libs.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().context("library path")?)?;
        std::fs::copy(&lib, &to).with_context(|| format!("copy {lib}"))?;
    }
    let layers = vec![
        oci::dir_tar(&libs),
        oci::dir_tar(&scratch.join("full")),
        oci::dir_tar(&pkgs),
    ];
    let program = format!("import {}; print('ready')", imports.join(", "));
    let env = vec![
        "PATH=/usr/local/bin:/usr/bin:/bin".to_string(),
        "PYTHONHOME=/usr/local".to_string(),
        "PYTHONDONTWRITEBYTECODE=1".to_string(),
        format!("PYTHONPATH=/usr/local/lib/{ver}/site-packages"),
    ];
    let _ = std::fs::remove_dir_all(scratch.join("full"));
    let _ = std::fs::remove_dir_all(&pkgs);
    let _ = std::fs::remove_dir_all(&libs);
    Ok(PythonImage {
        layers,
        env,
        cmd: vec![format!("/usr/local/bin/{ver}"), "-c".into(), program],
    })
}

fn walk(root: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                stack.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    Ok(out)
}

struct Bench {
    scratch: PathBuf,
    rt: tokio::runtime::Runtime,
    /// The chunk store behind the link, and what crossed it.
    remote: Store,
    wire: Arc<Counter>,
    /// containerd's proxy-plugin socket for the snapshotter.
    socket: PathBuf,
    registry_host: String,
}

impl Bench {
    fn fresh(&self, name: &str) -> anyhow::Result<PathBuf> {
        let p = self.scratch.join(name);
        if p.exists() {
            std::fs::remove_dir_all(&p)?;
        }
        std::fs::create_dir_all(&p)?;
        Ok(p)
    }

    fn containerd(&self, cri_snapshotter: &str) -> anyhow::Result<Containerd> {
        Containerd::start_cri(
            "hotstart",
            &self.socket,
            cri_snapshotter,
            &self.registry_host,
        )
        .context("containerd, ctr and runc are needed (apt-get install containerd runc)")
    }

    /// Pulls `image` through CRI and runs it once, `settle` after the pull; the time from the
    /// pull to its exit less `settle`, and the pull's share of it.
    fn pull_and_run(
        &self,
        c: &Containerd,
        image: &str,
        snapshotter: &str,
        id: &str,
        settle: Duration,
    ) -> anyhow::Result<(Duration, Duration)> {
        drop_page_cache().context("drop the page cache (needs root)")?;
        let start = Instant::now();
        hotstart_testkit::cri_pull(&c.socket(), image)
            .map_err(|e| anyhow::anyhow!("pull {image}: {e}"))?;
        let pulled = start.elapsed();
        std::thread::sleep(settle);
        run_container(c, image, snapshotter, id)?;
        Ok((start.elapsed() - settle, pulled))
    }

    /// The snapshotter, serving from a fresh state and an empty chunk cache, until the
    /// returned sender is dropped.
    fn snapshotter(
        &self,
    ) -> anyhow::Result<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )> {
        let state = self.fresh("snapshotter")?;
        let cache = self.fresh("chunk-cache")?;
        let images = Images::new(ChunkStore::new(
            self.remote.clone(),
            ChunkStoreConfig {
                cache_dir: Some(cache),
                concurrency: 64,
                ..ChunkStoreConfig::default()
            },
        )?);
        let d = LazyConfig::default();
        let cfg = LazyConfig {
            memory_cache: 256 << 20,
            fetch_all_without_profile: true,
            mount: hotstart_fuse::MountOptions {
                allow_other: true,
                fs_name: "hotstart-layer".into(),
                ..d.mount.clone()
            },
            ..d
        };
        let snapshots = Snapshots::open(state)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let socket = self.socket.clone();
        let task = self.rt.spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(e) = hotstart_image::snapshotter::serve(
                snapshots,
                Some(Lazy::new(images, cfg)),
                &socket,
                shutdown,
            )
            .await
            {
                eprintln!("snapshotter: {e}");
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            ensure!(Instant::now() < deadline, "the snapshotter did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok((stop, task))
    }

    /// Removes what the starts of `image` recorded (its profile and reports).
    fn forget_profile(&self, image: &str) -> anyhow::Result<()> {
        let dir = container_image(image).artifacts();
        self.rt.block_on(async {
            for o in self.remote.list(&dir.runs_prefix()).await? {
                self.remote.delete(&o.key).await?;
            }
            match self.remote.delete(&dir.profile_key()).await {
                Err(e) if !e.is_not_found() => Err(e.into()),
                _ => Ok(()),
            }
        })
    }

    /// The report of the last container start of `image`.
    fn last_report(&self, store: &Store, image: &str) -> anyhow::Result<MountReport> {
        let dir = container_image(image).artifacts();
        let (_, runs) = self.rt.block_on(artifact_stats(store, &dir))?;
        runs.into_iter()
            .last()
            .with_context(|| format!("no container start of {image} was reported"))
    }
}

/// stargz-snapshotter, installed by `scripts/stargz.sh`: `ctr-remote` (Debian's
/// stargz-snapshotter package) converts images to eStargz, and `stargz-grpc`
/// (`benches/peers/stargz`, built against Debian's packaging of its library) serves them to
/// containerd as a proxy snapshotter.
struct Stargz {
    daemon: PathBuf,
}

impl Stargz {
    /// Installs it where it is missing (`scripts/stargz.sh`, idempotent), or says why it cannot
    /// be used.
    fn install() -> Result<Stargz, String> {
        let root = hotstart_testkit::workspace_root().ok_or("no workspace root")?;
        let out = Command::new("bash")
            .arg(root.join("scripts/stargz.sh"))
            .output()
            .map_err(|e| format!("cannot run scripts/stargz.sh: {e}"))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err.lines().last().unwrap_or_default();
            return Err(format!("scripts/stargz.sh failed: {last}"));
        }
        Ok(Stargz {
            daemon: root.join(".cache/bin/stargz-grpc"),
        })
    }

    /// Converts `from` (in `c`'s content store) into the eStargz image `to` and pushes it to
    /// the registry. `optimize` runs the image's command once in a sample container and puts
    /// the files it read first, marked for prefetch (`ctr-remote images optimize`, stargz's
    /// counterpart of a profile); without it the layers are only converted.
    fn convert(&self, c: &Containerd, from: &str, to: &str, optimize: bool) -> anyhow::Result<()> {
        let mut cmd = Command::new("ctr-remote");
        cmd.arg("--address").arg(c.socket()).args([
            "--namespace",
            c.namespace(),
            "images",
            "optimize",
            "--oci",
        ]);
        if !optimize {
            cmd.arg("--no-optimize");
        }
        let out = cmd.args([from, to]).output()?;
        ensure!(
            out.status.success(),
            "ctr-remote images optimize {from} {to}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c.ctr_ok(&["images", "push", "--plain-http", to]);
        Ok(())
    }

    /// The snapshotter serving at `socket` from the empty directory `root` (no cache, no
    /// state), until dropped.
    fn serve(&self, socket: &Path, root: &Path) -> anyhow::Result<StargzDaemon> {
        let _ = std::fs::remove_file(socket);
        let log = std::fs::File::create(root.with_extension("log"))?;
        let mut cmd = Command::new(&self.daemon);
        cmd.arg("--address")
            .arg(socket)
            .arg("--root")
            .arg(root)
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = hotstart_testkit::spawn_tied(cmd, None)?;
        let daemon = StargzDaemon {
            child,
            root: root.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            ensure!(
                Instant::now() < deadline,
                "stargz-grpc did not listen:\n{}",
                daemon.log_tail()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(daemon)
    }
}

/// A running `stargz-grpc`: stopped on drop, and the layers it mounted unmounted.
struct StargzDaemon {
    child: Child,
    root: PathBuf,
}

impl StargzDaemon {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.root.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for StargzDaemon {
    fn drop(&mut self) {
        hotstart_testkit::terminate(&mut self.child, Duration::from_secs(10));
        // Its layers stay mounted after it exits; the deepest first.
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<&str> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| Path::new(m).starts_with(&self.root))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
    }
}

/// `ctr run --rm` of `image`; it must print `ready`.
fn run_container(c: &Containerd, image: &str, snapshotter: &str, id: &str) -> anyhow::Result<()> {
    let out = c.ctr(&["run", "--rm", "--snapshotter", snapshotter, image, id]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || stdout.trim() != "ready" {
        bail!(
            "container {id} of {image}: {}{}\n{}",
            stdout,
            String::from_utf8_lossy(&out.stderr),
            c.log()
        );
    }
    Ok(())
}

pub fn run(args: &ContainerArgs) -> anyhow::Result<()> {
    ensure!(args.runs >= 1, "--runs must be at least 1");
    let python = match &args.python {
        Some(p) => p.clone(),
        None => hotstart_testkit::workspace_root()
            .context("no workspace root; give --python")?
            .join(".venv/bin/python"),
    };
    let scratch_dir = tempfile::Builder::new()
        .prefix("hotstart-bench-container-")
        .tempdir_in(&args.dir)?;
    let scratch = scratch_dir.path().to_path_buf();
    let packages: Vec<&str> = args.packages.split(',').map(str::trim).collect();
    let imports: Vec<&str> = args.imports.split(',').map(str::trim).collect();
    // One worker per core, as `hotstart snapshotter` runs.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;

    // The registry, behind the link.
    let registry =
        Registry::start().context("docker-registry is needed (apt-get install docker-registry)")?;
    let pace = Arc::new(Pace {
        bytes_per_sec: args.link.mbps as f64 * 1e6,
        next: Mutex::new(Instant::now()),
        sent: AtomicU64::new(0),
    });
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let linked = format!("127.0.0.1:{}", listener.local_addr()?.port());
    let upstream: std::net::SocketAddr = registry.host().parse()?;
    rt.spawn(proxy(
        listener,
        upstream,
        Duration::from_millis(args.link.latency_ms),
        pace.clone(),
    ));

    // The image, plain and converted, pushed to the registry straight (not over the link).
    let image = python_image(&python, &packages, &imports, &scratch)?;
    let cmd: Vec<&str> = image.cmd.iter().map(String::as_str).collect();
    let env: Vec<&str> = image.env.iter().map(String::as_str).collect();
    let (plain, lazy, floor) = (
        "bench/python:plain",
        "bench/python:lazy",
        "bench/python:floor",
    );
    let (estargz, estargz_opt) = ("bench/python:estargz", "bench/python:estargz-opt");
    let stargz = Stargz::install();
    let layout = oci::write_layout(
        &scratch.join("plain"),
        &format!("{}/{plain}", registry.host()),
        &cmd,
        &env,
        &image.layers,
        true,
    );
    // The floor's image: the same layers under another config, so that its pull fetches a new
    // manifest and config over the link and finds every layer already unpacked.
    let floor_env: Vec<&str> = env
        .iter()
        .copied()
        .chain(["HOTSTART_BENCH=floor"])
        .collect();
    let floor_layout = oci::write_layout(
        &scratch.join("floor"),
        &format!("{}/{floor}", registry.host()),
        &cmd,
        &floor_env,
        &image.layers,
        true,
    );
    drop(image);
    let store_dir = scratch.join("store");
    let store = Store::open(store_dir.to_str().context("scratch path")?)?;
    let builder = Images::new(ChunkStore::new(store.clone(), ChunkStoreConfig::default())?);
    let built = Instant::now();
    let converted = rt.block_on(hotstart_image::convert(
        &builder,
        &layout.dir,
        &scratch.join("lazy"),
        &BuildConfig {
            chunk_size: args.chunk_kib.max(4) << 10,
            ..BuildConfig::default()
        },
    ))?;
    // The converted image goes to the same repository under another tag.
    let index_path = scratch.join("lazy/index.json");
    let mut index: serde_json::Value = serde_json::from_slice(&std::fs::read(&index_path)?)?;
    index["manifests"][0]["annotations"] = serde_json::json!({
        "io.containerd.image.name": format!("{}/{lazy}", registry.host()),
        "org.opencontainers.image.ref.name": "lazy",
    });
    std::fs::write(&index_path, serde_json::to_vec(&index)?)?;
    let image_mib = layout.layer_bytes as f64 / (1 << 20) as f64;
    eprintln!(
        "image: {} layers, {image_mib:.0} MiB compressed ({} files); converted in {:.1} s",
        converted.layers.len(),
        converted.layers.iter().map(|l| l.counts.files).sum::<u64>(),
        built.elapsed().as_secs_f64()
    );
    let socket = scratch.join("sn.sock");
    {
        let pusher = Containerd::start("hotstart", &socket).context("containerd is needed")?;
        for (dir, tag) in [
            (&layout.dir, plain),
            (&floor_layout.dir, floor),
            (&scratch.join("lazy"), lazy),
        ] {
            let tarball = oci::archive(dir);
            pusher.ctr_ok(&[
                "images",
                "import",
                "--no-unpack",
                tarball.to_str().context("path")?,
            ]);
            pusher.ctr_ok(&[
                "images",
                "push",
                "--plain-http",
                &format!("{}/{tag}", registry.host()),
            ]);
        }
        if let Ok(sz) = &stargz {
            let from = format!("{}/{plain}", registry.host());
            for (tag, optimize) in [(estargz, false), (estargz_opt, true)] {
                let converted = Instant::now();
                sz.convert(
                    &pusher,
                    &from,
                    &format!("{}/{tag}", registry.host()),
                    optimize,
                )?;
                eprintln!(
                    "image: {tag} made by ctr-remote in {:.1} s",
                    converted.elapsed().as_secs_f64()
                );
            }
        }
    }
    let link = args.link.throttle();
    let wire = Arc::new(Counter::default());
    let bench = Bench {
        scratch: scratch.clone(),
        rt,
        remote: store.wrap(|inner| wire.clone().wrap(link.wrap(inner))),
        wire,
        socket,
        registry_host: linked.clone(),
    };
    let (plain, lazy, floor) = (
        format!("{linked}/{plain}"),
        format!("{linked}/{lazy}"),
        format!("{linked}/{floor}"),
    );
    let (estargz, estargz_opt) = (
        format!("{linked}/{estargz}"),
        format!("{linked}/{estargz_opt}"),
    );
    // (e), (f): stargz-snapshotter, without and with its own optimization, and the bytes each
    // moved over the link.
    let (mut e, mut f, mut e_wire, mut f_wire) = (vec![], vec![], 0u64, 0u64);

    let (mut a, mut b, mut c, mut d) = (vec![], vec![], vec![], vec![]);
    let mut resolve = Vec::new();
    let mut d_reports: Vec<MountReport> = Vec::new();
    let mut d_wire = 0u64;
    let mut d_pulls = Vec::new();
    for i in 0..args.runs {
        // (b) then (a): containerd's own pull and unpack, then the unpacked image again.
        let ctrd = bench.containerd("overlayfs")?;
        b.push(
            bench
                .pull_and_run(&ctrd, &plain, "overlayfs", &format!("b{i}"), Duration::ZERO)?
                .0,
        );
        drop_page_cache()?;
        let start = Instant::now();
        run_container(&ctrd, &plain, "overlayfs", &format!("a{i}"))?;
        a.push(start.elapsed());
        // The registry's part of any pull: a new manifest and config, every layer present.
        let start = Instant::now();
        hotstart_testkit::cri_pull(&ctrd.socket(), &floor)
            .map_err(|e| anyhow::anyhow!("pull {floor}: {e}"))?;
        resolve.push(start.elapsed());
        drop(ctrd);

        // (c): lazily, no profile; its reads become the profile (d) replays.
        bench.forget_profile(&lazy)?;
        for (label, times) in [("c", &mut c), ("d", &mut d)] {
            let (stop, task) = bench.snapshotter()?;
            bench.wire.reset();
            let ctrd = bench.containerd("hotstart")?;
            let settle = match label {
                "d" => Duration::from_millis(args.settle_ms),
                _ => Duration::ZERO,
            };
            let (took, pulled) =
                bench.pull_and_run(&ctrd, &lazy, "hotstart", &format!("{label}{i}"), settle)?;
            times.push(took);
            if label == "d" {
                d_wire += bench.wire.get(Op::Get).bytes;
                d_pulls.push(pulled);
            }
            ctrd.remove_images();
            drop(ctrd);
            drop(stop);
            bench.rt.block_on(task)?;
        }
        d_reports.push(bench.last_report(&store, &lazy)?);
        if let Ok(sz) = &stargz {
            for (label, image, times, wire) in [
                ("e", &estargz, &mut e, &mut e_wire),
                ("f", &estargz_opt, &mut f, &mut f_wire),
            ] {
                let sock = bench.scratch.join("stargz.sock");
                let daemon = sz.serve(&sock, &bench.fresh("stargz")?)?;
                let ctrd = Containerd::start_cri("stargz", &sock, "stargz", &linked)
                    .context("containerd is needed")?;
                let sent = pace.sent.load(Ordering::Relaxed);
                let id = format!("{label}{i}");
                let (took, _) = bench
                    .pull_and_run(&ctrd, image, "stargz", &id, Duration::ZERO)
                    .with_context(|| format!("stargz-grpc's log:\n{}", daemon.log_tail()))?;
                times.push(took);
                *wire += pace.sent.load(Ordering::Relaxed) - sent;
                ctrd.remove_images();
                drop(ctrd);
                drop(daemon);
            }
        }
        let secs = |v: &[Duration]| {
            v.get(i)
                .map_or("-".into(), |t| format!("{:.2} s", t.as_secs_f64()))
        };
        eprintln!(
            "  run {}: (a) {}  (b) {}  (c) {}  (d) {}  (e) {}  (f) {}",
            i + 1,
            secs(&a),
            secs(&b),
            secs(&c),
            secs(&d),
            secs(&e),
            secs(&f)
        );
    }
    let fetched: u64 = d_reports
        .iter()
        .map(|r| r.demand_fetch_bytes + r.prefetched_bytes)
        .sum::<u64>()
        / args.runs as u64;
    let d_wire = d_wire / args.runs as u64;
    let files: u64 = converted.layers.iter().map(|l| l.counts.bytes).sum();
    let (hits, reads): (u64, u64) = d_reports
        .iter()
        .fold((0, 0), |(h, n), r| (h + r.hits, n + r.chunks_read));
    let (a, b, c, d) = (median(a), median(b), median(c), median(d));
    let resolve = median(resolve);
    let d_pull = median(d_pulls);

    let mut report = Report::new("Container start: containerd + runc, hotstart snapshotter");
    let what = format!(
        "start `python -c \"import {}\"` ({image_mib:.0} MiB image)",
        imports.join(", ")
    );
    report.add(Row::time(
        format!("{what}, hotstart with profile (d)"),
        d,
        "image unpacked locally (a)",
        a,
        Some(1.0 / 1.3),
    ));
    report.add(Row::time(
        format!("{what}, hotstart with profile (d)"),
        d,
        "floor: (a) + the registry's part of a pull (a')",
        a + resolve,
        None,
    ));
    report.add(Row::time(
        format!("{what}, hotstart with profile (d)"),
        d,
        "containerd pull + unpack (b)",
        b,
        Some(5.0),
    ));
    report.add(Row::time(
        format!("{what}, hotstart without profile (c)"),
        c,
        "containerd pull + unpack (b)",
        b,
        None,
    ));
    report.note(format!(
        "link: {} ms per request and {} MB/s in all, for the registry (a TCP proxy) and the chunk store (hotstart-store's throttle); page cache dropped before every start; fresh containerd and snapshotter for (b), (c), (d)",
        args.link.latency_ms, args.link.mbps
    ));
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    report.note(format!(
        "(d) moved {:.1} MiB over the link, {:.0}% of the {:.1} MiB of layers (b) downloads \
         (target ≤ 30%); that is {:.1} MiB of file data, {:.0}% of the image's {:.1} MiB of \
         files; chunk hit rate {:.0}% (target ≥ 90%); profile: one recorded start",
        mib(d_wire),
        100.0 * d_wire as f64 / layout.layer_bytes.max(1) as f64,
        mib(layout.layer_bytes),
        mib(fetched),
        100.0 * fetched as f64 / files.max(1) as f64,
        mib(files),
        100.0 * hits as f64 / reads.max(1) as f64
    ));
    report.note(format!(
        "(d) is the CRI pull ({:.3} s: resolving the tag, manifest and config from the registry, \
         then each layer's image opened and mounted, its profile replayed) and the container's \
         run ({:.3} s, of which its reads waited {:.3} s for chunks on the way, and {:.1} MiB \
         reached it through the warmed page cache) against (a)'s run ({:.3} s), which pulls \
         nothing",
        d_pull.as_secs_f64(),
        d.saturating_sub(d_pull).as_secs_f64(),
        median(
            d_reports
                .iter()
                .map(|r| Duration::from_secs_f64(r.stall_seconds))
                .collect()
        )
        .as_secs_f64(),
        mib(d_reports.iter().map(|r| r.warmed_bytes).sum::<u64>() / args.runs as u64),
        a.as_secs_f64()
    ));
    report.note(format!(
        "(a') is a CRI pull, on (a)'s containerd, of the same layers under another config: the \
         tag, manifest and config over the link and nothing else ({:.3} s). Every start of an \
         image the node does not hold pays it; (a) does not, so (a) + (a') is the floor of (d), \
         and of (b), (e) and (f)",
        resolve.as_secs_f64()
    ));
    if args.settle_ms > 0 {
        report.note(format!(
            "diagnosis (--settle-ms {}): (d) waited that long between its pull and its run, not \
             counted above, so its profile's replay had finished before the container read",
            args.settle_ms
        ));
    }
    match &stargz {
        Ok(_) => {
            let (e, f) = (median(e), median(f));
            report.add(Row::time(
                format!("{what}, hotstart with profile (d)"),
                d,
                "stargz-snapshotter, eStargz optimized with the same command (f)",
                f,
                Some(1.0),
            ));
            report.add(Row::time(
                format!("{what}, hotstart without profile (c)"),
                c,
                "stargz-snapshotter, eStargz, not optimized (e)",
                e,
                Some(1.0),
            ));
            report.note(format!(
                "stargz-snapshotter: (e) {:.2} s and (f) {:.2} s; against (b) that is {:.2}× and \
                 {:.2}× as fast, against (a) {:.2}× and {:.2}× as long",
                e.as_secs_f64(),
                f.as_secs_f64(),
                b.as_secs_f64() / e.as_secs_f64(),
                b.as_secs_f64() / f.as_secs_f64(),
                e.as_secs_f64() / a.as_secs_f64(),
                f.as_secs_f64() / a.as_secs_f64(),
            ));
            report.note(format!(
                "stargz-snapshotter 0.12 (Debian's library and ctr-remote; defaults: prefetch and \
                 background fetch on), images converted by `ctr-remote images optimize --oci` \
                 (with `--no-optimize` for (e)); its registry reads cross the same link; fresh \
                 containerd and snapshotter, no cache, for each start; by the container's exit \
                 (background fetch goes on after it) (e) had moved {:.1} MiB over the link and \
                 (f) {:.1} MiB, {:.0}% and {:.0}% of the plain image's layers; nydus-snapshotter: \
                 not packaged for Debian, not measured",
                mib(e_wire / args.runs as u64),
                mib(f_wire / args.runs as u64),
                100.0 * (e_wire / args.runs as u64) as f64 / layout.layer_bytes.max(1) as f64,
                100.0 * (f_wire / args.runs as u64) as f64 / layout.layer_bytes.max(1) as f64,
            ));
        }
        Err(why) => report.note(format!(
            "stargz-snapshotter: not measured, {why}; nydus-snapshotter: not packaged for Debian, not measured"
        )),
    }
    report.finish(args.markdown.as_deref())?;
    drop(registry);
    Ok(())
}
