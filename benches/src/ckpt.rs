//! The checkpoint engine against the floors and the tools a user would pick instead, same run,
//! same state (`--gib` GiB in `--tensors` host tensors), medians of `--runs`:
//!
//! * **Training stall**: `save()` → `wait_staged()`, against a parallel memcpy of the same bytes
//!   into pre-faulted memory over as many threads as the engine copies with (target: at most
//!   1.2× its time, i.e. a rate ratio ≥ 0.83), and against the time Python
//!   `safetensors.numpy.save_file` and `numpy.savez` block their caller for the same state
//!   (target: ≥ 3× shorter). Python runs in `.venv/bin/python`, builds arrays of the same sizes
//!   and times only the save call.
//! * **Durable persist**: `save()` → `wait_persisted(Disk)` (staging, checksums, `O_DIRECT`
//!   writes, `fdatasync`, rename, manifest), against `fio` sequential `O_DIRECT` write of the
//!   same size on the same disk (target ≥ 0.85).
//! * **Cold load**: page cache dropped, `load(Latest)` (parallel reads, every chunk verified)
//!   into the caller's tensors, already allocated as a model's parameters are, against `fio`
//!   sequential read into its reused buffers (target ≥ 0.9); and as new tensors (the loader
//!   allocates, so the kernel zero-fills every fresh page first) against
//!   `safetensors.numpy.load_file` of the same file (the checkpoint is a valid safetensors file;
//!   target: no slower).
//! * **torch**, when `--python` can import it: `torch.save` and
//!   `torch.distributed.checkpoint.save` against the stall, `torch.load` against the load as new
//!   tensors, and `torch.distributed.checkpoint.load` (in place) against the load into the
//!   caller's tensors; reported without targets.
//!
//! Needs root (to drop the page cache), `fio`, and numpy and safetensors in `.venv`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use hotstart_ckpt::{Destination, Dtype, Engine, EngineConfig, StepSel, Tensor, TierKind};
use hotstart_store::Store;
use hotstart_store::uring::AlignedBuf;

use crate::report::{Report, median, rate_rows};
use crate::store_uring::{Dir, Fio, HugePages, Memory, drop_page_cache};

const MIB: usize = 1 << 20;

#[derive(Debug, clap::Args)]
pub struct CkptArgs {
    /// GiB of host tensors per checkpoint.
    #[arg(long, default_value_t = 4.0)]
    gib: f64,
    /// Number of tensors the state is split into.
    #[arg(long, default_value_t = 64)]
    tensors: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Directory on the disk to measure.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Python with numpy and safetensors.
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Write the results as Markdown to this file too.
    #[arg(long)]
    markdown: Option<PathBuf>,
}

/// Python peers: build the same state, time only the call, print `name seconds` lines.
const PY_SAVE: &str = r#"
import sys, time, numpy as np
from safetensors.numpy import save_file
n, size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(7)
state = {f"layer.{i}": np.frombuffer(rng.bytes(size), dtype=np.uint8).copy() for i in range(n)}
t = time.perf_counter(); save_file(state, out + "/st.safetensors"); print("safetensors_save", time.perf_counter() - t)
t = time.perf_counter(); np.savez(out + "/np.npz", **state); print("numpy_save", time.perf_counter() - t)
"#;

const PY_LOAD: &str = r#"
import sys, time
from safetensors.numpy import load_file
t = time.perf_counter(); d = load_file(sys.argv[1]); print("safetensors_load", time.perf_counter() - t)
assert sum(a.nbytes for a in d.values()) > 0
"#;

/// torch peers (run only when torch imports): the same state as CPU tensors; times only the
/// calls. `torch.distributed.checkpoint` runs without a process group (one rank).
const PY_TORCH_SAVE: &str = r#"
import sys, time, warnings, numpy as np, torch
import torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
n, size, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(7)
state = {f"layer.{i}": torch.from_numpy(np.frombuffer(rng.bytes(size), dtype=np.uint8).copy()) for i in range(n)}
t = time.perf_counter(); torch.save(state, out + "/state.pt"); print("torch_save", time.perf_counter() - t)
t = time.perf_counter(); dcp.save(state, checkpoint_id=out + "/dcp"); print("dcp_save", time.perf_counter() - t)
"#;

/// Cold loads of what [`PY_TORCH_SAVE`] wrote: `torch.load` (new tensors) and `dcp.load` into
/// tensors allocated and touched before the clock starts (in place, like a model's).
const PY_TORCH_LOAD: &str = r#"
import sys, time, warnings, torch
import torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
n, size, out, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if which == "torch":
    t = time.perf_counter(); d = torch.load(out + "/state.pt"); print("torch_load", time.perf_counter() - t)
else:
    d = {f"layer.{i}": torch.ones(size, dtype=torch.uint8) for i in range(n)}
    t = time.perf_counter(); dcp.load(d, checkpoint_id=out + "/dcp"); print("dcp_load", time.perf_counter() - t)
assert sum(v.numel() for v in d.values()) == n * size
"#;

pub fn run(args: &CkptArgs) -> anyhow::Result<()> {
    let (per, total) = tensor_sizes(args.gib, args.tensors, args.runs)?;
    let mib = total / MIB;
    let label = format!(
        "{:.1} GiB in {} tensors",
        total as f64 / (1u64 << 30) as f64,
        args.tensors
    );
    let fio = Fio::find()?;
    let mut report = Report::new(&format!("hotstart ckpt benchmarks ({label})"));
    let work = tempfile::Builder::new()
        .prefix("hotstart-ckpt-bench-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("temp dir in {}", args.dir.display()))?;

    eprintln!("ckpt: preparing {label}");
    let (sources, state) = state(args.tensors, per)?;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get().min(8));
    let ckpt_dir = work.path().join("disk");
    let mut cfg = EngineConfig::new("bench", 0, 1).disk(&ckpt_dir);
    cfg.keep = 1;
    cfg.max_inflight = 1;
    cfg.threads = threads;
    let engine = Engine::new(cfg.clone())?;

    // Like for like: our staging and read buffers are on huge pages, so fio gets them too when
    // they can be reserved.
    let huge = HugePages::reserve(fio.huge_pages_needed()).ok();
    let (fio_mem, fio_mode) = if huge.is_some() {
        (Memory::Huge, "--mem=shmhuge")
    } else {
        (Memory::Plain, "--mem=malloc")
    };

    let mut stall = Vec::new();
    let mut persist = Vec::new();
    // fio writes the same amount right after each save, so both meet the disk in the same state
    // (this machine's virtual disk speeds up and slows down over minutes).
    let mut fio_write = Vec::new();
    let fio_path = work.path().join("fio.dat");
    let mut memcpy = Vec::new();
    // The same durable save with a local directory as the store (the embedded default), and
    // through the object store's own local writer (what that store used to take; not fsynced).
    let mut cfg_store = EngineConfig::new("bench", 0, 1).store(Store::open(
        work.path().join("store").to_str().context("temp path")?,
    )?);
    cfg_store.keep = 1;
    cfg_store.max_inflight = 1;
    cfg_store.threads = threads;
    let store_engine = Engine::new(cfg_store.clone())?;
    let mut cfg_object = cfg_store.clone();
    cfg_object.store =
        Some(Store::open(work.path().join("object").to_str().context("temp path")?)?.wrap(|s| s));
    let object_engine = Engine::new(cfg_object)?;
    let mut store_persist = Vec::new();
    let mut object_persist = Vec::new();
    for e in [&store_engine, &object_engine] {
        e.save(0, state.clone(), Default::default())?.wait()?;
    }
    let mut dst = AlignedBuf::zeroed(total);
    dst.fill(1); // pre-fault
    // The first save of a size allocates the staging buffer, and the kernel faults in and zeroes
    // every page of it: a one-time cost, shown apart from the steady state that is compared.
    eprintln!("ckpt: first save (staging buffer allocated)");
    let t = Instant::now();
    let h = engine.save(0, state.clone(), Default::default())?;
    h.wait_staged()?;
    let first_stall = t.elapsed();
    h.wait()?;
    // Each durable save starts with no write-back pending from the one before (its retention
    // included), so the three saves of a run meet the disk in the same state.
    let settle = |e: &Engine| {
        e.wait_idle();
        // SAFETY: sync(2) takes no arguments and touches no memory of this process.
        unsafe { libc::sync() };
    };
    for run in 0..args.runs {
        settle(&engine);
        let t = Instant::now();
        let h = engine.save(run as u64 + 1, state.clone(), Default::default())?;
        h.wait_staged()?;
        stall.push(t.elapsed());
        h.wait_persisted(TierKind::Disk)?;
        persist.push(t.elapsed());
        h.wait()?;
        for (e, out) in [
            (&store_engine, &mut store_persist),
            (&object_engine, &mut object_persist),
        ] {
            settle(e);
            let t = Instant::now();
            e.save(run as u64 + 1, state.clone(), Default::default())?
                .wait_persisted(TierKind::Store)?;
            out.push(t.elapsed());
            settle(e);
        }
        memcpy.push(parallel_memcpy(&mut dst, &sources, threads));
        fio_write.push(fio.run(&fio_path, mib, Dir::Write, fio_mem)?);
        std::fs::remove_file(&fio_path)?;
        eprintln!(
            "ckpt: run {run}: stall {:?}, persisted {:?} (store on a local dir {:?}, its object store writer {:?}), memcpy {:?}, fio write {:?}",
            stall[run],
            persist[run],
            store_persist[run],
            object_persist[run],
            memcpy[run],
            fio_write[run]
        );
    }
    engine.wait_idle();
    // Their staging buffers are as large as the state: free them before the peers run.
    drop(store_engine);
    drop(object_engine);
    let last = args.runs as u64;

    eprintln!("ckpt: python peers");
    let mut py_st = Vec::new();
    let mut py_np = Vec::new();
    let py_dir = work.path().join("py");
    std::fs::create_dir_all(&py_dir)?;
    for _ in 0..args.runs {
        let out = python(
            &args.python,
            &[PY_SAVE, &args.tensors.to_string(), &per.to_string()],
            &[&py_dir],
        )?;
        py_st.push(seconds(&out, "safetensors_save")?);
        py_np.push(seconds(&out, "numpy_save")?);
        std::fs::remove_dir_all(&py_dir)?;
        std::fs::create_dir_all(&py_dir)?;
    }
    let has_torch = python(&args.python, &["import torch"], &[]).is_ok();
    let torch_dir = work.path().join("torch");
    let (mut torch_save, mut dcp_save) = (Vec::new(), Vec::new());
    if has_torch {
        eprintln!("ckpt: torch peers");
        for _ in 0..args.runs {
            // The last run's files stay for the loads.
            let _ = std::fs::remove_dir_all(&torch_dir);
            std::fs::create_dir_all(&torch_dir)?;
            let out = python(
                &args.python,
                &[PY_TORCH_SAVE, &args.tensors.to_string(), &per.to_string()],
                &[&torch_dir],
            )?;
            torch_save.push(seconds(&out, "torch_save")?);
            dcp_save.push(seconds(&out, "dcp_save")?);
        }
    }

    eprintln!("ckpt: cold loads");
    let file = ckpt_dir.join(format!("bench/step-{last}/rank-0.safetensors"));
    let loader = Engine::new(cfg)?;
    let mut load = Vec::new();
    let mut load_into = Vec::new();
    // The caller's tensors, already allocated and touched, as a model's parameters are.
    let mut model: Vec<Vec<u8>> = (0..args.tensors).map(|_| vec![1u8; per]).collect();
    let mut fio_read = Vec::new();
    let mut py_load = Vec::new();
    let (mut torch_load, mut dcp_load) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        drop_page_cache().context("drop the page cache (needs root)")?;
        let t = Instant::now();
        let loaded = loader.load(StepSel::Latest, Destination::Owned)?;
        load.push(t.elapsed());
        ensure!(loaded.tensors.len() == state.len(), "loaded tensor count");
        for (a, b) in loaded.tensors.iter().zip(&sources) {
            ensure!(a.data[..] == b[..], "loaded bytes differ in {}", a.name);
        }
        drop(loaded);
        drop_page_cache()?;
        for out in &mut model {
            out.fill(0);
        }
        let bufs = model
            .iter_mut()
            .enumerate()
            .map(|(i, out)| (format!("layer.{i}"), &mut out[..]))
            .collect();
        let t = Instant::now();
        let loaded = loader.load(StepSel::Latest, Destination::Buffers(bufs))?;
        load_into.push(t.elapsed());
        ensure!(loaded.tensors.is_empty(), "every tensor went to its buffer");
        for (i, (a, b)) in model.iter().zip(&sources).enumerate() {
            ensure!(a[..] == b[..], "loaded bytes differ in layer.{i}");
        }
        eprintln!(
            "ckpt: cold load: new tensors {:?}, into the caller's tensors {:?}",
            load.last().unwrap(),
            load_into.last().unwrap()
        );
        drop_page_cache()?;
        fio_read.push(fio.run(&file, mib, Dir::Read, fio_mem)?);
        drop_page_cache()?;
        let out = python(&args.python, &[PY_LOAD], &[&file])?;
        py_load.push(seconds(&out, "safetensors_load")?);
        if has_torch {
            for (which, into) in [("torch", &mut torch_load), ("dcp", &mut dcp_load)] {
                drop_page_cache()?;
                let sizes = [PY_TORCH_LOAD, &args.tensors.to_string(), &per.to_string()];
                let out = python(&args.python, &sizes, &[&torch_dir, Path::new(which)])?;
                into.push(seconds(&out, &format!("{which}_load"))?);
            }
        }
    }

    let row = rate_rows(&label, total as u64);
    let stall_target = (1.0f64 / 1.2 * 100.0).floor() / 100.0;
    report.add(row(
        "stall save→wait_staged",
        &stall,
        &format!("parallel memcpy ({threads} threads, pre-faulted)"),
        &memcpy,
        Some(stall_target),
    ));
    report.add(row(
        "stall save→wait_staged",
        &stall,
        "safetensors.numpy.save_file",
        &py_st,
        Some(3.0),
    ));
    report.add(row(
        "stall save→wait_staged",
        &stall,
        "numpy.savez",
        &py_np,
        Some(3.0),
    ));
    report.add(row(
        "persist save→wait_persisted(disk)",
        &persist,
        &format!("fio write O_DIRECT + fsync {fio_mode}"),
        &fio_write,
        Some(0.85),
    ));
    report.add(row(
        "durable save→wait_persisted(store), store = a local directory",
        &store_persist,
        "the same save to the disk tier (local_dir), durable",
        &persist,
        // At most 1.5x the disk tier's time.
        Some(1.0 / 1.5),
    ));
    report.add(row(
        "durable save→wait_persisted(store), store = a local directory",
        &store_persist,
        "the same store through object_store's local writer (not fsynced)",
        &object_persist,
        None,
    ));
    report.add(row(
        "cold load (verified) into the caller's tensors",
        &load_into,
        &format!("fio read O_DIRECT {fio_mode}"),
        &fio_read,
        Some(0.9),
    ));
    report.add(row(
        "cold load (verified), new tensors",
        &load,
        &format!("fio read O_DIRECT {fio_mode}"),
        &fio_read,
        None,
    ));
    report.add(row(
        "cold load (verified), new tensors",
        &load,
        "safetensors.numpy.load_file",
        &py_load,
        Some(1.0),
    ));
    if has_torch {
        let torch_rows: [(&str, &[Duration], &str, &[Duration]); 4] = [
            ("stall save→wait_staged", &stall, "torch.save", &torch_save),
            (
                "stall save→wait_staged",
                &stall,
                "torch.distributed.checkpoint.save",
                &dcp_save,
            ),
            (
                "cold load (verified) into the caller's tensors",
                &load_into,
                "torch.distributed.checkpoint.load (in place)",
                &dcp_load,
            ),
            (
                "cold load (verified), new tensors",
                &load,
                "torch.load",
                &torch_load,
            ),
        ];
        for (what, ours, peer, theirs) in torch_rows {
            report.add(row(what, ours, peer, theirs, None));
        }
        report.note("torch peers write into the page cache without fsync, as they do by default; their save time is how long they block the caller");
    } else {
        report.note(format!("torch is not importable by {}: torch.save/torch.load and torch.distributed.checkpoint were not measured", args.python.display()));
    }
    report.note(format!(
        "medians of {} runs; stall {:?}, persist {:?}, load into the caller's tensors {:?}, load as new tensors {:?}, memcpy {:?}; fio {} (io_uring, 1 MiB, depth 32); stall target ≤ 1.2× memcpy is a rate ratio ≥ {stall_target}",
        args.runs,
        median(stall),
        median(persist),
        median(load_into),
        median(load),
        median(memcpy),
        fio.version
    ));
    report.note(format!(
        "first save of this size (staging buffer allocated and faulted in, not in the medians): stall {first_stall:?}"
    ));
    drop(huge);
    report.finish(args.markdown.as_deref())
}

/// Checks the sizes asked for and splits `gib` GiB over `tensors` tensors: the bytes of each
/// (rounded up to whole 4 KiB pages) and of all of them.
pub(crate) fn tensor_sizes(
    gib: f64,
    tensors: usize,
    runs: usize,
) -> anyhow::Result<(usize, usize)> {
    ensure!(gib > 0.0 && tensors > 0 && runs > 0, "bad sizes");
    let per = ((gib * (1u64 << 30) as f64) as usize / tensors).next_multiple_of(4096);
    Ok((per, per * tensors))
}

/// `tensors` tensors `layer.<i>` of `per` incompressible bytes each: their bytes, and the
/// tensors a save takes (sharing them).
pub(crate) fn state(tensors: usize, per: usize) -> anyhow::Result<(Vec<Bytes>, Vec<Tensor>)> {
    let sources: Vec<Bytes> = (0..tensors)
        .map(|i| Bytes::from(hotstart_testkit::pattern(per, i as u64)))
        .collect();
    let state = tensors_of(&sources)?;
    Ok((sources, state))
}

/// The tensors `layer.<i>` a save takes, sharing the bytes of `sources`.
pub(crate) fn tensors_of(sources: &[Bytes]) -> anyhow::Result<Vec<Tensor>> {
    let tensor = |(i, b): (usize, &Bytes)| {
        Tensor::new(
            format!("layer.{i}"),
            Dtype::U8,
            vec![b.len() as u64],
            b.clone(),
        )
    };
    Ok(sources
        .iter()
        .enumerate()
        .map(tensor)
        .collect::<Result<_, _>>()?)
}

/// Copies every tensor into `dst` over `threads` threads; the time it took.
pub(crate) fn parallel_memcpy(dst: &mut [u8], state: &[Bytes], threads: usize) -> Duration {
    let mut pieces: Vec<(&mut [u8], &[u8])> = Vec::new();
    let mut rest = dst;
    for t in state {
        let (head, tail) = rest.split_at_mut(t.len());
        pieces.push((head, t));
        rest = tail;
    }
    let per = pieces.len().div_ceil(threads.max(1));
    let t = Instant::now();
    std::thread::scope(|s| {
        for group in pieces.chunks_mut(per.max(1)) {
            s.spawn(move || {
                for (d, src) in group.iter_mut() {
                    d.copy_from_slice(src);
                }
            });
        }
    });
    t.elapsed()
}

/// Runs `python -c script args...`; its stdout.
fn python(py: &Path, script_and_args: &[&str], paths: &[&Path]) -> anyhow::Result<String> {
    let mut cmd = Command::new(py);
    cmd.arg("-c").args(script_and_args).args(paths);
    let out = cmd
        .output()
        .with_context(|| format!("run {} (needs numpy and safetensors)", py.display()))?;
    if !out.status.success() {
        bail!(
            "python failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The seconds on the `name <seconds>` line of `out`.
fn seconds(out: &str, name: &str) -> anyhow::Result<Duration> {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .with_context(|| format!("no {name} in python's output: {out}"))?;
    let s: f64 = line
        .trim()
        .parse()
        .with_context(|| format!("parse {line:?}"))?;
    Ok(Duration::from_secs_f64(s))
}
