//! The sidecar (`hotstart serve`) against the floors its saves and restores are measured by,
//! same run, same state (`--gib` GiB in `--tensors` tensors), medians of `--runs`:
//!
//! * **Save stall through the sidecar**: `save()` → `wait_staged()` (what training waits for),
//!   saves 2..N of the same state in a row, against the same saves by an engine without a
//!   sidecar (its own staging pool, disk tier) and against a parallel memcpy of the same bytes
//!   into pre-faulted memory (target: within 1.2× of both); the first save reported apart, beside
//!   a memcpy into memory the process has not touched yet. Every save is waited for in full
//!   (persisted to the disk tier) before the next, as training's save interval would, so that
//!   stalls are not measured against persistence competing for the cores.
//! * **Restore from local memory**: a training process's `load(Latest)` into its own tensors
//!   (pre-faulted, as a model's parameters are), served from its sidecar's shared memory,
//!   against a parallel memcpy of the same bytes into the same buffers over as many threads as
//!   the engine copies with (target ≥ 0.8); and against the engine's cold load of the same
//!   checkpoint from the local disk tier (page cache dropped; needs root).
//! * **Restore on a restarted node**: a new sidecar over the first one's disk directory, its
//!   memory empty and no peers (a node that came back with its disk), page cache dropped; the
//!   training process's `load` into its tensors against the engine's own cold load of the same
//!   file with no sidecar (target ≥ 0.9: the sidecar hands the file over, and the process reads
//!   and verifies it itself).
//! * **Restore from a peer over loopback**: a second sidecar that does not hold the step
//!   fetches it from the first (every chunk verified as it arrives) and serves it; the
//!   training process's whole `load` against one raw TCP stream of the same bytes into
//!   pre-faulted memory (target ≥ 0.8), and against the same stream hashed with blake3 on as
//!   many threads as it arrives (what verifying every byte costs on this machine). The fetch
//!   alone (the sidecar's own restore time) is reported beside it, and also against the raw
//!   stream into memory the process has not touched yet, which is what the fetch has to fill.
//!
//! * **Restore from a peer over TLS**: the same restore from a holder whose links are TLS 1.3
//!   (mutual, certificates of a CA made for the run), each by a fresh node, against the
//!   clear-text restores above (target ≥ 0.85), and the cipher's extra time per GiB.
//!
//! Restores are measured once the first sidecar has persisted the step (its disk and store
//! writes would otherwise compete for the CPU), with the node's huge shared-memory pages set
//! by `--shmem-huge-pages` (default `advise`, put back afterwards).
//! * **Restart to state loaded**: a new process (this binary, `sidecar-restore`) from its first
//!   instruction to its tensors loaded from the sidecar's memory (target ≤ 2 s for 4 GiB),
//!   beside the same process loading the step from the object store (SeaweedFS on loopback).
//!
//! The sidecars run in this process (the library's `Sidecar`, on loopback, with a token); the
//! training processes are this process or a child of it.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use hotstart_ckpt::{Destination, Engine, EngineConfig, StepSel, Tensor, TierKind};
use hotstart_proto::shm;
use hotstart_sidecar::{Settings, Sidecar, Token, metrics};
use hotstart_store::Store;
use hotstart_store::uring::AlignedBuf;
use hotstart_testkit::SeaweedFs;

use crate::ckpt::{parallel_memcpy, state, tensor_sizes, tensors_of};
use crate::report::{Report, Row, median, rate_rows};
use crate::store_uring::drop_page_cache;

const TOKEN: &str = "hotstart-bench";
const JOB: &str = "bench";

#[derive(Debug, clap::Args)]
pub struct SidecarArgs {
    /// GiB of host tensors per checkpoint.
    #[arg(long, default_value_t = 4.0)]
    gib: f64,
    /// Number of tensors the state is split into.
    #[arg(long, default_value_t = 16)]
    tensors: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Directory for the disk tier.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// The node's setting for huge shared-memory pages during the run
    /// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `never`, `advise`, ...), put back
    /// afterwards; needs root. `as-is` leaves it alone.
    #[arg(long, default_value = "advise")]
    shmem_huge_pages: String,
}

/// The restarted training process of the restart measurement (run by the benchmark itself).
#[derive(Debug, clap::Args)]
pub struct RestoreChild {
    /// The sidecar's socket; without it, `--store` is read directly.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Store URL to load from when there is no socket.
    #[arg(long)]
    store: Option<String>,
    #[arg(long)]
    tensors: usize,
    /// Bytes per tensor.
    #[arg(long)]
    per: usize,
}

/// A sidecar served on a runtime thread of its own until dropped.
pub(crate) struct Running {
    pub(crate) peer: SocketAddr,
    http: SocketAddr,
    pub(crate) socket: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    pub(crate) fn start(settings: Settings) -> anyhow::Result<Running> {
        let cfg = settings.resolve()?;
        let socket = cfg.socket.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return drop(tx.send(Err(anyhow::anyhow!(e)))),
            };
            rt.block_on(async move {
                match Sidecar::bind(cfg).await {
                    Ok(s) => {
                        let _ = tx.send(Ok((s.peer_addr(), s.http_addr())));
                        if let Err(e) = s.run(async { drop(stopped.await) }).await {
                            eprintln!("sidecar: {e}");
                        }
                    }
                    Err(e) => drop(tx.send(Err(e.into()))),
                }
            });
        });
        let (peer, http) = rx.recv().context("sidecar thread")??;
        let r = Running {
            peer,
            http,
            socket,
            stop: Some(stop),
            thread: Some(thread),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !hotstart_testkit::get(r.http, "/readyz", Duration::from_secs(5))
            .is_ok_and(|x| x.status == 200)
        {
            ensure!(Instant::now() < deadline, "sidecar never ready");
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(r)
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        hotstart_testkit::get(self.http, "/metrics", Duration::from_secs(10))
            .ok()
            .and_then(|r| metrics::sample(&r.text(), name))
            .unwrap_or(0.0)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A sidecar on loopback with a token, memory only, its socket in `dir`.
pub(crate) fn settings(node: &str, dir: &Path, budget: u64) -> anyhow::Result<Settings> {
    Ok(Settings {
        node_id: Some(node.into()),
        listen: Some(format!("127.0.0.1:{}", hotstart_testkit::free_port()?)),
        http: Some("127.0.0.1:0".into()),
        socket: Some(dir.join(format!("{node}.sock"))),
        memory_budget: Some(hotstart_sidecar::config::Size(budget)),
        token: Some(Token::new(TOKEN)?),
        replicas: Some(0),
        recovery_timeout: Some("5s".parse().map_err(anyhow::Error::msg)?),
        ..Settings::default()
    })
}

/// Caller buffers for every tensor, in the order of `bufs`.
fn destination<'a>(bufs: &'a mut [&'a mut [u8]]) -> Destination<'a> {
    Destination::Buffers(
        bufs.iter_mut()
            .enumerate()
            .map(|(i, b)| (format!("layer.{i}"), &mut **b))
            .collect::<HashMap<_, _>>(),
    )
}

/// `dst` cut into one slice per tensor of `per` bytes.
fn slices(dst: &mut [u8], per: usize) -> Vec<&mut [u8]> {
    dst.chunks_mut(per).collect()
}

/// Streams `src` over one loopback TCP connection to `receive`; the time from connect until
/// `receive` returns.
fn raw_stream(
    src: &[Bytes],
    receive: impl FnOnce(TcpStream) -> anyhow::Result<()>,
) -> anyhow::Result<Duration> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    std::thread::scope(|s| -> anyhow::Result<Duration> {
        let sender = s.spawn(move || -> std::io::Result<()> {
            let (mut sock, _) = l.accept()?;
            for b in src {
                sock.write_all(b)?;
            }
            Ok(())
        });
        let t = Instant::now();
        receive(TcpStream::connect(addr)?)?;
        let took = t.elapsed();
        sender
            .join()
            .map_err(|_| anyhow::anyhow!("sender panicked"))??;
        Ok(took)
    })
}

/// The bytes of `src` streamed over loopback TCP straight into `dst`.
fn raw_tcp(src: &[Bytes], dst: &mut [u8]) -> anyhow::Result<Duration> {
    raw_stream(src, |mut sock| Ok(sock.read_exact(dst)?))
}

/// [`raw_tcp`] with every byte hashed with blake3 as it arrives: the stream is read in 8 MiB
/// pieces straight into `dst`, and each piece is hashed by one of `threads` workers while the
/// next one arrives. What any verified transfer has to pay on this machine, beside what the
/// peer restore pays (which also fills memory new to its sidecar and copies out).
fn raw_tcp_hashed(src: &[Bytes], dst: &mut [u8], threads: usize) -> anyhow::Result<Duration> {
    const PIECE: usize = 8 << 20;
    raw_stream(src, |mut sock| {
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    let (tx, rx) = std::sync::mpsc::sync_channel::<&[u8]>(2);
                    (tx, s.spawn(move || rx.iter().map(blake3::hash).last()))
                })
                .collect();
            for (i, piece) in dst.chunks_mut(PIECE).enumerate() {
                sock.read_exact(piece)?;
                workers[i % workers.len()]
                    .0
                    .send(piece)
                    .map_err(|_| anyhow::anyhow!("hashing worker stopped"))?;
            }
            for (tx, worker) in workers {
                drop(tx);
                worker
                    .join()
                    .map_err(|_| anyhow::anyhow!("hashing worker panicked"))?;
            }
            Ok(())
        })
    })
}

fn engine(socket: &Path, threads: usize) -> anyhow::Result<Engine> {
    let mut cfg = EngineConfig::new(JOB, 0, 1).sidecar(socket);
    cfg.threads = threads;
    Ok(Engine::new(cfg)?)
}

/// Runs this binary as a restarted training process; its wall time, from spawn to exit.
fn restart(args: &[String], env: &[(String, String)]) -> anyhow::Result<Duration> {
    let exe = std::env::current_exe()?;
    let t = Instant::now();
    let out = Command::new(exe)
        .arg("sidecar-restore")
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()?;
    let took = t.elapsed();
    if !out.status.success() {
        bail!(
            "restarted process failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

pub fn run(args: &SidecarArgs) -> anyhow::Result<()> {
    let (per, total) = tensor_sizes(args.gib, args.tensors, args.runs)?;
    let label = format!(
        "{:.2} GiB in {} tensors",
        total as f64 / (1u64 << 30) as f64,
        args.tensors
    );
    let _setting = match args.shmem_huge_pages.as_str() {
        "as-is" => None,
        word => Some(
            shm::ShmemEnabled::set(word)
                .with_context(|| format!("set {} to {word} (needs root)", shm::SHMEM_ENABLED))?,
        ),
    };
    let mut report = Report::new(&format!(
        "hotstart sidecar benchmarks ({label}, shmem_enabled={})",
        shm::thp_choice(shm::SHMEM_ENABLED).unwrap_or_else(|| "unknown".into())
    ));
    let work = tempfile::Builder::new()
        .prefix("hotstart-sidecar-bench-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("temp dir in {}", args.dir.display()))?;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get().min(8));
    let weed = SeaweedFs::shared();
    let store_url = weed.map(|w| format!("{}/ckpt", w.fresh_bucket("sidecar-bench")));
    let store_env = weed.map(|w| w.env()).unwrap_or_default();
    for (k, v) in &store_env {
        // SAFETY: set before any other thread of this process reads the environment (the
        // sidecars below open the store from it).
        unsafe { std::env::set_var(k, v) };
    }

    eprintln!("sidecar: preparing {label}");
    let (sources, state) = state(args.tensors, per)?;
    save_stall(
        &mut report,
        work.path(),
        &label,
        &sources,
        &state,
        threads,
        args.runs.max(3) * 3 + 1,
    )?;
    // Node A holds the step (and persists it to its disk and the store); B only fetches it.
    let budget = total as u64 + total as u64 / 4 + (64 << 20);
    let disk = work.path().join("disk-a");
    let mut a_settings = settings("node-a", work.path(), budget)?;
    a_settings.disk_dir = Some(disk.clone());
    a_settings.store = store_url.clone();
    let a = Running::start(a_settings)?;
    let engine_a = engine(&a.socket, threads)?;
    eprintln!("sidecar: saving through node A");
    engine_a.save(1, state, Default::default())?.wait()?;
    // Restores are measured on a quiet node: after A's background persistence.
    let tiers: &[&str] = if store_url.is_some() {
        &["disk", "store"]
    } else {
        &["disk"]
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    for tier in tiers {
        let name = format!("hotstart_persisted_bytes_total{{tier=\"{tier}\"}}");
        while a.metric(&name) < total as f64 {
            ensure!(
                Instant::now() < deadline,
                "node A never persisted to {tier}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    let mut dst = AlignedBuf::zeroed(total);
    dst.fill(1); // pre-fault, as a model's parameters are
    let (mut memcpy, mut memory, mut disk_load, mut peer, mut fetch, mut tcp, mut tcp_fresh) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut tcp_hashed = Vec::new();
    let mut sidecar_disk = Vec::new();
    let (mut memory_new, mut memcpy_new) = (Vec::new(), Vec::new());
    let cold = drop_page_cache().is_ok();
    for run in 0..args.runs {
        memcpy.push(parallel_memcpy(&mut dst, &sources, threads));
        let t = Instant::now();
        let mut bufs = slices(&mut dst, per);
        let l = engine_a.load(StepSel::Latest, destination(&mut bufs))?;
        memory.push(t.elapsed());
        ensure!(l.step == 1 && l.tensors.is_empty(), "unexpected restore");
        ensure!(dst[..per] == sources[0][..], "restored bytes differ");
        // Into tensors the process has just allocated and never touched (a model built after a
        // restart), against a memcpy into such memory. Both get memory the kernel has handed
        // out before (a VM's memory never touched since boot costs the hypervisor's faults too,
        // which would fall on whichever ran first).
        AlignedBuf::zeroed(total).fill(0);
        let mut new = AlignedBuf::zeroed(total);
        let t = Instant::now();
        let mut bufs = slices(&mut new, per);
        engine_a.load(StepSel::Latest, destination(&mut bufs))?;
        memory_new.push(t.elapsed());
        ensure!(new[..per] == sources[0][..], "restored bytes differ");
        drop(new);
        memcpy_new.push(parallel_memcpy(
            &mut AlignedBuf::zeroed(total),
            &sources,
            threads,
        ));

        if cold {
            let mut cfg = EngineConfig::new(JOB, 0, 1).disk(&disk);
            cfg.threads = threads;
            let from_disk = Engine::new(cfg)?;
            drop_page_cache()?;
            let t = Instant::now();
            let mut bufs = slices(&mut dst, per);
            from_disk.load(StepSel::Latest, destination(&mut bufs))?;
            disk_load.push(t.elapsed());
            drop(from_disk);

            // A node that restarted with its disk: a new sidecar over A's disk directory, its
            // memory empty, no peers.
            let mut c_settings = settings(&format!("node-c{run}"), work.path(), budget)?;
            c_settings.disk_dir = Some(disk.clone());
            let c = Running::start(c_settings)?;
            let engine_c = engine(&c.socket, threads)?;
            dst.fill(0);
            drop_page_cache()?;
            let t = Instant::now();
            let mut bufs = slices(&mut dst, per);
            let l = engine_c.load(StepSel::Latest, destination(&mut bufs))?;
            sidecar_disk.push(t.elapsed());
            ensure!(
                l.chunk_sources.iter().all(|s| *s == TierKind::Disk),
                "a restarted node's restore came from {:?}",
                l.chunk_sources
            );
            let last = args.tensors - 1;
            ensure!(
                dst[..per] == sources[0][..] && dst[last * per..] == sources[last][..],
                "restored bytes differ"
            );
        }

        // A fresh node B for every run: it does not hold the step and fetches it from A.
        let mut b_settings = settings(&format!("node-b{run}"), work.path(), budget)?;
        b_settings.peers = Some(vec![format!("node-a={}", a.peer)]);
        let b = Running::start(b_settings)?;
        let engine_b = engine(&b.socket, threads)?;
        let t = Instant::now();
        let mut bufs = slices(&mut dst, per);
        engine_b.load(StepSel::Latest, destination(&mut bufs))?;
        peer.push(t.elapsed());
        let last = args.tensors - 1;
        ensure!(
            dst[..per] == sources[0][..] && dst[last * per..] == sources[last][..],
            "fetched bytes differ"
        );
        fetch.push(Duration::from_secs_f64(
            b.metric("hotstart_restore_duration_seconds_sum{source=\"peer\"}"),
        ));
        drop(engine_b);
        drop(b);
        tcp.push(raw_tcp(&sources, &mut dst)?);
        tcp_fresh.push(raw_tcp(&sources, &mut AlignedBuf::zeroed(total))?);
        tcp_hashed.push(raw_tcp_hashed(&sources, &mut dst, threads)?);
        eprintln!(
            "sidecar: run {run}: memcpy {:?}, memory {:?}, disk {:?}, peer {:?} (fetch {:?}), tcp {:?} \
             (into new memory {:?}, hashed {:?})",
            memcpy[run],
            memory[run],
            disk_load.last(),
            peer[run],
            fetch[run],
            tcp[run],
            tcp_fresh[run],
            tcp_hashed[run]
        );
    }
    let row = rate_rows(&label, total as u64);
    report.add(row(
        "restore from local sidecar memory into the caller's tensors",
        &memory,
        &format!("parallel memcpy ({threads} threads, pre-faulted)"),
        &memcpy,
        Some(0.8),
    ));
    report.add(row(
        "restore from local sidecar memory into new tensors (memory new to the process)",
        &memory_new,
        &format!("parallel memcpy ({threads} threads) into memory new to the process"),
        &memcpy_new,
        None,
    ));
    if cold {
        report.add(row(
            "restore from local sidecar memory into the caller's tensors",
            &memory,
            "cold load (verified) from the local disk tier",
            &disk_load,
            None,
        ));
        report.add(row(
            "restore on a restarted node (sidecar memory empty, disk kept) into the caller's tensors, cold",
            &sidecar_disk,
            "cold load (verified) from the local disk tier, no sidecar",
            &disk_load,
            Some(0.9),
        ));
    } else {
        report.note("not root: the disk comparison (needs the page cache dropped) was skipped");
    }
    report.add(row(
        "restore from a peer over loopback (fetch, verify, copy out)",
        &peer,
        "one raw TCP stream into pre-faulted memory",
        &tcp,
        Some(0.8),
    ));
    report.add(row(
        "restore from a peer over loopback (fetch, verify, copy out)",
        &peer,
        &format!(
            "one raw TCP stream into pre-faulted memory, hashed with blake3 ({threads} threads)"
        ),
        &tcp_hashed,
        None,
    ));
    report.add(row(
        "peer fetch alone (sidecar's restore time)",
        &fetch,
        "one raw TCP stream into pre-faulted memory",
        &tcp,
        None,
    ));
    report.add(row(
        "peer fetch alone (sidecar's restore time)",
        &fetch,
        "one raw TCP stream into memory new to the process",
        &tcp_fresh,
        None,
    ));

    // Restart: a new process, from its first instruction to its state loaded.
    let child = |from: &[String]| {
        let mut a = from.to_vec();
        a.extend([
            "--tensors".into(),
            args.tensors.to_string(),
            "--per".into(),
            per.to_string(),
        ]);
        a
    };
    let via_sidecar = child(&["--socket".into(), a.socket.display().to_string()]);
    let mut restart_memory = Vec::new();
    let mut restart_store = Vec::new();
    for _ in 0..args.runs {
        restart_memory.push(restart(&via_sidecar, &[])?);
        if let Some(url) = &store_url {
            restart_store.push(restart(
                &child(&["--store".into(), url.clone()]),
                &store_env,
            )?);
        }
    }
    let t_mem = median(restart_memory.clone());
    if store_url.is_some() {
        report.add(Row::time(
            format!("restart to state loaded, from sidecar memory, {label}"),
            t_mem,
            "the same restart loading from the store (SeaweedFS, loopback)",
            median(restart_store.clone()),
            None,
        ));
        report.note(format!(
            "restart to state loaded: {:.2} s from the sidecar's memory (target ≤ 2 s for 4 GiB), {:.2} s from the store",
            t_mem.as_secs_f64(),
            median(restart_store).as_secs_f64()
        ));
    } else {
        report.note(format!(
            "restart to state loaded: {:.2} s from the sidecar's memory (target ≤ 2 s for 4 GiB); no SeaweedFS for the store path",
            t_mem.as_secs_f64()
        ));
    }
    drop(engine_a);
    drop(a);
    tls_restores(
        &mut report,
        work.path(),
        &label,
        &sources,
        per,
        budget,
        threads,
        args.runs,
        &peer,
    )?;
    report.note(format!(
        "medians of {} runs; memcpy {:?}, memory restore {:?}, peer restore {:?} (fetch {:?}), raw TCP {:?}{}",
        args.runs,
        median(memcpy),
        median(memory),
        median(peer),
        median(fetch),
        median(tcp),
        if cold {
            format!(", cold disk load {:?}", median(disk_load))
        } else {
            String::new()
        }
    ));
    report.finish(args.markdown.as_deref())
}

/// Restores from a peer whose links are TLS 1.3 (certificates of a CA made for the run), each
/// by a fresh node, against the clear-text restores of the same state measured before
/// (`clear`), and what the cipher costs per GiB on this machine (encrypting on one side,
/// decrypting on the other).
#[allow(clippy::too_many_arguments)]
fn tls_restores(
    report: &mut Report,
    dir: &Path,
    label: &str,
    sources: &[Bytes],
    per: usize,
    budget: u64,
    threads: usize,
    runs: usize,
    clear: &[Duration],
) -> anyhow::Result<()> {
    let certs = dir.join("tls");
    hotstart_sidecar::tls::init(&certs, &["node-t".into(), "fetcher".into()], 1)?;
    let mut t_settings = settings("node-t", dir, budget)?;
    t_settings.tls_dir = Some(certs.join("node-t"));
    let holder = Running::start(t_settings)?;
    let engine_t = engine(&holder.socket, threads)?;
    let state = tensors_of(sources)?;
    engine_t.save(1, state, Default::default())?.wait()?;
    let total: usize = sources.iter().map(Bytes::len).sum();
    let mut dst = AlignedBuf::zeroed(total);
    dst.fill(1);
    let mut tls = Vec::new();
    for run in 0..runs {
        let mut b_settings = settings(&format!("fetcher-{run}"), dir, budget)?;
        b_settings.tls_dir = Some(certs.join("fetcher"));
        b_settings.peers = Some(vec![format!("node-t={}", holder.peer)]);
        let b = Running::start(b_settings)?;
        let engine_b = engine(&b.socket, threads)?;
        let t = Instant::now();
        let mut bufs = slices(&mut dst, per);
        engine_b.load(StepSel::Latest, destination(&mut bufs))?;
        tls.push(t.elapsed());
        let last = sources.len() - 1;
        ensure!(
            dst[..per] == sources[0][..] && dst[last * per..] == sources[last][..],
            "bytes fetched over TLS differ"
        );
        eprintln!("sidecar: run {run}: peer restore over TLS {:?}", tls[run]);
    }
    let row = rate_rows(label, total as u64);
    report.add(row(
        "restore from a peer over loopback, TLS 1.3 (mutual, AES-GCM)",
        &tls,
        "the same restore in clear text, measured above",
        clear,
        Some(0.85),
    ));
    let extra = median(tls.clone()).saturating_sub(median(clear.to_vec()));
    report.note(format!(
        "TLS on peer links: {:.2} s more per GiB than clear text on this machine ({} cores; \
         the holder encrypts and the fetching node decrypts, each while it also hashes and copies)",
        extra.as_secs_f64() / (total as f64 / (1u64 << 30) as f64),
        threads
    ));
    Ok(())
}

/// `save()` → `wait_staged()` of `saves` saves in a row, each then waited for in full and
/// followed by `after` (the floor, measured in the same state of the machine).
fn stalls(
    engine: &Engine,
    state: &[Tensor],
    saves: usize,
    mut after: impl FnMut(),
) -> anyhow::Result<Vec<Duration>> {
    let mut out = Vec::with_capacity(saves);
    for step in 1..=saves as u64 {
        let t = Instant::now();
        let h = engine.save(step, state.to_vec(), Default::default())?;
        h.wait_staged()?;
        out.push(t.elapsed());
        h.wait()?;
        after();
    }
    Ok(out)
}

/// The save stall rows; see the module docs.
fn save_stall(
    report: &mut Report,
    dir: &Path,
    label: &str,
    sources: &[Bytes],
    state: &[Tensor],
    threads: usize,
    saves: usize,
) -> anyhow::Result<()> {
    let total: usize = sources.iter().map(Bytes::len).sum();
    eprintln!("sidecar: {saves} saves through a sidecar and without one");
    // Room for the newest step and the one being staged, and a little more.
    let budget = 2 * total as u64 + total as u64 / 4 + (64 << 20);
    let mut s = settings("node-s", dir, budget)?;
    s.disk_dir = Some(dir.join("disk-s"));
    // What a first save's copy meets: memory the process has not touched.
    let fresh = parallel_memcpy(&mut AlignedBuf::zeroed(total), sources, threads);
    let sidecar = Running::start(s)?;
    let mut floor = Vec::new();
    let mut dst = AlignedBuf::zeroed(total);
    dst.fill(1);
    let mut copies = || floor.push(parallel_memcpy(&mut dst, sources, threads));
    let through = stalls(
        &engine(&sidecar.socket, threads)?,
        state,
        saves,
        &mut copies,
    )?;
    let created = sidecar.metric("hotstart_memory_segments_created_total");
    let recycled = sidecar.metric("hotstart_memory_segments_recycled_total");
    drop(sidecar);
    let mut cfg = EngineConfig::new("bench-alone", 0, 1).disk(dir.join("disk-alone"));
    cfg.threads = threads;
    let alone = stalls(&Engine::new(cfg)?, state, saves, &mut copies)?;
    eprintln!(
        "sidecar: stalls through the sidecar {through:?}, without {alone:?}, memcpy {floor:?}, \
         into new memory {fresh:?}"
    );
    let later = |v: &[Duration]| median(v[1..].to_vec());
    report.add(Row::time(
        format!("save stall through the sidecar, saves 2..{saves}, {label}"),
        later(&through),
        "the same saves without a sidecar (engine's staging pool)",
        later(&alone),
        Some(1.0 / 1.2),
    ));
    report.add(Row::time(
        format!("save stall through the sidecar, saves 2..{saves}, {label}"),
        later(&through),
        format!("parallel memcpy ({threads} threads) into pre-faulted memory"),
        median(floor.clone()),
        Some(1.0 / 1.2),
    ));
    report.add(Row::time(
        format!("first save's stall through the sidecar, {label}"),
        through[0],
        format!("parallel memcpy ({threads} threads) into memory new to the process"),
        fresh,
        None,
    ));
    report.note(format!(
        "save stall (save() to wait_staged(), each save then persisted to disk before the next): \
         through the sidecar {:.3} s for saves 2..{saves} (first {:.3} s, second {:.3} s), without a sidecar {:.3} s \
         (first {:.3} s), memcpy {:.3} s into pre-faulted memory (after each save) and {:.3} s \
         into memory new to the process; the sidecar created {created} segments and recycled \
         {recycled}. The first save waits for the sidecar to allocate its segment (zeroed \
         shared memory) and maps it as it copies; the engine without a sidecar allocates its \
         staging pool (anonymous memory) then too. The second segment is allocated in the \
         background from the first save on; a second save that comes before that is done waits \
         for the rest.",
        later(&through).as_secs_f64(),
        through[0].as_secs_f64(),
        through[1].as_secs_f64(),
        later(&alone).as_secs_f64(),
        alone[0].as_secs_f64(),
        median(floor).as_secs_f64(),
        fresh.as_secs_f64(),
    ));
    Ok(())
}

/// The restarted training process: loads the step into tensors of its own.
pub fn restore_child(args: &RestoreChild) -> anyhow::Result<()> {
    let mut cfg = EngineConfig::new(JOB, 0, 1);
    match (&args.socket, &args.store) {
        (Some(s), _) => cfg = cfg.sidecar(s),
        (None, Some(url)) => cfg = cfg.store(Store::open(url)?),
        (None, None) => bail!("--socket or --store"),
    }
    let engine = Engine::new(cfg)?;
    // The model's parameters: allocated by the new process (on huge pages where the system
    // allows, as large tensors are), not touched before the load.
    let mut dst = AlignedBuf::zeroed(args.per * args.tensors);
    let mut bufs = slices(&mut dst, args.per);
    let l = engine.load(StepSel::Latest, destination(&mut bufs))?;
    ensure!(l.step == 1, "loaded step {}", l.step);
    Ok(())
}
