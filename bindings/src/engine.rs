//! `Engine`: one rank's checkpoint engine, as the Python layer drives it.
//!
//! The Python `Checkpointer` resolves its defaults (environment, torch.distributed), flattens
//! state dicts into tensors and extras, and calls this class. Loads land in memory Python owns:
//! `restore(step, plan)` finds the step (through the sidecar when there is one) and calls
//! `plan(manifest)` with its tensor index and extras, Python allocates (or picks the caller's
//! tensors) and answers with their addresses, or with one page-aligned buffer for the whole
//! file (new tensors are then views of it), and the engine reads and verifies straight into
//! them; `load(step, destinations)` does the same for destinations known beforehand.
//! `reader(rank, world_size)` opens the same tiers as another rank of another world size, to
//! read checkpoints written by a job of a different size (torch.distributed resharding).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use hotstart_ckpt::format::Manifest;
use hotstart_ckpt::{Destination, EngineConfig, Extras, LoadedTensor, StepSel, TierKind, WhenFull};
use hotstart_store::Store;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::{ConfigError, to_py};
use crate::handle::SaveHandle;
use crate::memory::{Answer, DestSpec, Dests, TensorSpec};

#[pyclass(frozen, module = "hotstart._core")]
pub struct Engine {
    engine: hotstart_ckpt::Engine,
    cfg: EngineConfig,
}

fn when_full(s: &str) -> PyResult<WhenFull> {
    match s {
        "block" => Ok(WhenFull::Block),
        "skip" => Ok(WhenFull::Skip),
        other => Err(PyValueError::new_err(format!(
            "when_full={other:?}: expected \"block\" or \"skip\""
        ))),
    }
}

fn open(py: Python<'_>, cfg: EngineConfig) -> PyResult<Engine> {
    let engine = py
        .detach(|| hotstart_ckpt::Engine::new(cfg.clone()))
        .map_err(to_py)?;
    Ok(Engine { engine, cfg })
}

#[pymethods]
impl Engine {
    /// Opens the engine of `rank` of `world_size` in `job`: through the node's sidecar at the
    /// Unix socket `sidecar` (`hotstart serve`), and/or with a store tier at `store` (a store
    /// URL) and/or a disk tier at `local_dir` (with a sidecar, those are read only when it
    /// cannot be reached).
    #[new]
    #[pyo3(signature = (
        job, rank, world_size, *, store=None, local_dir=None, sidecar=None, keep=3,
        max_inflight=2, when_full="block", chunk_size=None, threads=0, sidecar_wait=60.0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: String,
        rank: u32,
        world_size: u32,
        store: Option<String>,
        local_dir: Option<PathBuf>,
        sidecar: Option<PathBuf>,
        keep: usize,
        max_inflight: usize,
        when_full: &str,
        chunk_size: Option<usize>,
        threads: usize,
        sidecar_wait: f64,
    ) -> PyResult<Engine> {
        let mut cfg = EngineConfig::new(job, rank, world_size);
        if let Some(url) = store {
            let store = py
                .detach(|| Store::open(&url))
                .map_err(|e| ConfigError::new_err(format!("store {url:?}: {e}")))?;
            cfg = cfg.store(store);
        }
        if let Some(dir) = local_dir {
            cfg = cfg.disk(dir);
        }
        if let Some(socket) = sidecar {
            cfg = cfg.sidecar(socket);
        }
        cfg.keep = keep;
        cfg.max_inflight = max_inflight;
        cfg.when_full = self::when_full(when_full)?;
        if let Some(n) = chunk_size {
            cfg.chunk_size = n;
        }
        cfg.threads = threads;
        cfg.sidecar_wait = std::time::Duration::try_from_secs_f64(sidecar_wait).map_err(|_| {
            ConfigError::new_err(format!(
                "sidecar_wait={sidecar_wait}: expected seconds, 0 or more"
            ))
        })?;
        open(py, cfg)
    }

    /// The same tiers, opened as `rank` of `world_size` (for reading another rank's files).
    fn reader(&self, py: Python<'_>, rank: u32, world_size: u32) -> PyResult<Engine> {
        let mut cfg = self.cfg.clone();
        cfg.rank = rank;
        cfg.world_size = world_size;
        open(py, cfg)
    }

    #[getter]
    fn job(&self) -> &str {
        &self.cfg.job
    }

    #[getter]
    fn rank(&self) -> u32 {
        self.cfg.rank
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.cfg.world_size
    }

    /// The configured tiers, nearest first ("memory", "peer", "disk", "store").
    #[getter]
    fn tiers(&self) -> Vec<String> {
        self.engine
            .tiers()
            .iter()
            .map(TierKind::to_string)
            .collect()
    }

    /// Saves skipped so far because the staging pool was full (when_full="skip").
    #[getter]
    fn skipped(&self) -> u64 {
        self.engine.skipped()
    }

    /// Starts saving `step`. The memory each spec describes must belong to an object in `keep`
    /// and stay unchanged until the returned handle says staging is over.
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: Vec<TensorSpec>,
        extras: BTreeMap<String, Vec<u8>>,
        keep: Vec<Py<PyAny>>,
    ) -> PyResult<SaveHandle> {
        let tensors = tensors
            .iter()
            // SAFETY: the Python layer only describes memory of objects it passes in `keep`,
            // which the returned handle owns until staging is over (see `handle`), and it tells
            // the caller not to change them before `wait_staged`.
            .map(|t| unsafe { t.to_tensor() })
            .collect::<PyResult<Vec<_>>>()?;
        let extras: Extras = extras;
        let handle = py
            .detach(move || self.engine.save(step, tensors, extras))
            .map_err(to_py)?;
        Ok(SaveHandle::new(handle, keep))
    }

    /// `rank`'s manifest of `step` (this engine's rank by default), whatever world size wrote
    /// it: {"step", "rank", "world_size", "tensors": [(name, dtype, shape)], "extras": {name:
    /// bytes}}.
    #[pyo3(signature = (step, rank=None))]
    fn manifest<'py>(
        &self,
        py: Python<'py>,
        step: u64,
        rank: Option<u32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rank = rank.unwrap_or(self.cfg.rank);
        let m = py
            .detach(|| self.engine.manifest(step, rank))
            .map_err(to_py)?;
        manifest_dict(py, &m)
    }

    /// Reads `step` of this rank, verifying every chunk, straight into `destinations` (one per
    /// tensor or range of a tensor to load). Into host memory only the chunks that hold them
    /// are read (through a sidecar, only those cross the network from a peer); with device
    /// destinations every chunk is. Returns the tier each chunk read came from. The memory must
    /// stay alive and untouched by anyone else during the call.
    fn load(
        &self,
        py: Python<'_>,
        step: u64,
        destinations: Vec<DestSpec>,
    ) -> PyResult<Vec<String>> {
        if destinations.iter().all(DestSpec::on_host) {
            let mut dests = Dests::check(Answer::Tensors(destinations))?;
            // SAFETY: the Python layer describes only memory of objects its caller holds for
            // the whole call and does not touch meanwhile; `check` refused overlaps.
            let host = unsafe { dests.borrow() }.host;
            let loaded = py
                .detach(|| {
                    self.engine
                        .load(StepSel::Step(step), Destination::Regions(host))
                })
                .map_err(to_py)?;
            return Ok(loaded
                .chunk_sources
                .iter()
                .map(TierKind::to_string)
                .collect());
        }
        let (_, sources, _) = self.load_planned(py, StepSel::Step(step), move |_, _| {
            Ok(Answer::Tensors(destinations))
        })?;
        Ok(sources)
    }

    /// Reads `step` (the newest complete one when None) of this rank in one request, verifying
    /// every chunk: once the step's manifest is known, and before any tensor byte is read,
    /// `plan(manifest, fd)` (a dict as `manifest` returns, and a descriptor of the step's file
    /// on this machine or None, open only for the call) gives the destinations, as for `load`,
    /// or `(address, length, held)` of one host buffer of `manifest["file_len"]` bytes that
    /// takes the whole file (each tensor at its `manifest["ranges"]`): new memory (read with
    /// direct I/O when aligned to 4096 bytes), or with `held` a private mapping of `fd`,
    /// verified where it lies. The file is the nearest source's: this engine's disk tier or
    /// local-directory store, or the one a sidecar hands over from its disk.
    /// Through a sidecar, this is how a restore finds the step and fetches it once.
    /// Returns the step, the tier each chunk came from, and who copied the bytes of device
    /// destinations (None without any): "sidecar" (from its memory pinned for the device),
    /// "process", or "process (not the sidecar: why)".
    fn restore(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        plan: Py<PyAny>,
    ) -> PyResult<(u64, Vec<String>, Option<String>)> {
        let which = step.map_or(StepSel::Latest, StepSel::Step);
        self.load_planned(py, which, move |m, file| {
            let fd = file.map(AsRawFd::as_raw_fd);
            Python::attach(|py| plan.call1(py, (manifest_dict(py, m)?, fd))?.extract(py))
        })
    }

    /// The newest step complete in any tier, or None.
    fn latest_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| self.engine.latest_complete_step())
            .map_err(to_py)
    }

    /// The newest step complete in any tier that is older than `step`, or None.
    fn latest_step_below(&self, py: Python<'_>, step: u64) -> PyResult<Option<u64>> {
        py.detach(|| self.engine.latest_complete_step_below(step))
            .map_err(to_py)
    }

    /// The newest checkpoint of the job whatever world size saved it, as (step, world size), or
    /// None.
    fn latest_checkpoint(&self, py: Python<'_>) -> PyResult<Option<(u64, u32)>> {
        py.detach(|| self.engine.latest_checkpoint()).map_err(to_py)
    }

    /// The newest checkpoint as `latest_checkpoint` finds them that is older than `step`, as
    /// (step, world size), or None.
    fn latest_checkpoint_below(&self, py: Python<'_>, step: u64) -> PyResult<Option<(u64, u32)>> {
        py.detach(|| self.engine.latest_checkpoint_below(step))
            .map_err(to_py)
    }

    /// Every step complete for this world size in some tier, ascending (through the sidecar
    /// when there is one).
    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| self.engine.steps()).map_err(to_py)
    }

    /// Waits until every save started so far has finished persisting.
    fn wait(&self, py: Python<'_>) {
        py.detach(|| self.engine.wait_idle());
    }

    /// Applies retention to every tier now; {tier: [steps removed]}.
    fn gc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let removed = py.detach(|| self.engine.gc()).map_err(to_py)?;
        let d = PyDict::new(py);
        for (tier, steps) in removed {
            d.set_item(tier.to_string(), steps)?;
        }
        Ok(d)
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(job={:?}, rank={}, world_size={}, tiers={:?})",
            self.cfg.job,
            self.cfg.rank,
            self.cfg.world_size,
            self.tiers()
        )
    }
}

impl Engine {
    /// A load whose destinations `plan` gives once the manifest is known (with the GIL
    /// released meanwhile). Host destinations are read into directly; when there are device
    /// destinations too, the device ones take the engine's one destination and the host ones
    /// are copied out of the verified tensors the load returns.
    fn load_planned(
        &self,
        py: Python<'_>,
        which: StepSel,
        plan: impl FnOnce(&Manifest, Option<&File>) -> PyResult<Answer> + Send,
    ) -> PyResult<(u64, Vec<String>, Option<String>)> {
        let mut dests: Option<Dests> = None;
        let mut refused: Option<PyErr> = None;
        let res = py.detach(|| {
            let (dests_at, refused_at) = (&mut dests, &mut refused);
            let planned = Destination::Planned(Box::new(move |m, file| {
                let checked = plan(m, file).and_then(Dests::check).map_err(|e| {
                    let message = e.to_string();
                    *refused_at = Some(e);
                    hotstart_ckpt::Error::Task {
                        what: "load plan",
                        message,
                    }
                })?;
                // SAFETY: the Python layer describes only memory of objects its caller holds
                // for the whole call and does not touch meanwhile; `check` refused overlaps.
                let b = unsafe { dests_at.insert(checked).borrow() };
                Ok(if let Some((file, held)) = b.file {
                    if held {
                        Destination::Held(file)
                    } else {
                        Destination::File(file)
                    }
                } else if b.device.is_empty() {
                    Destination::Regions(b.host)
                } else {
                    Destination::Device(b.device)
                })
            }));
            let loaded = self.engine.load(which, planned)?;
            let step = loaded.step;
            // The plan's borrows ended with the load: borrow the host destinations again to
            // copy those a device load returned instead of writing.
            if let Some(d) = dests.as_mut() {
                // SAFETY: as above; nothing else borrows these destinations any more.
                let b = unsafe { d.borrow() };
                if !b.device.is_empty() {
                    copy_host(step, b.host, loaded.tensors)?;
                }
            }
            let route = loaded.device_route.as_ref().map(ToString::to_string);
            Ok((step, loaded.chunk_sources, route))
        });
        match (res, refused) {
            (Ok((step, sources, route)), _) => Ok((
                step,
                sources.iter().map(TierKind::to_string).collect(),
                route,
            )),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(to_py(e)),
        }
    }
}

/// Copies the tensors a load returned into the host buffers meant for them (each the whole
/// tensor, or the range of it from its offset); every buffer must get its bytes.
fn copy_host(
    step: u64,
    host: Vec<(String, Option<u64>, &mut [u8])>,
    tensors: Vec<LoadedTensor>,
) -> hotstart_ckpt::Result<()> {
    let loaded: HashMap<&str, &[u8]> = tensors
        .iter()
        .map(|t| (t.name.as_str(), &t.data[..]))
        .collect();
    for (name, offset, out) in host {
        let bad = |reason: String| hotstart_ckpt::Error::Destination {
            step,
            name: name.clone(),
            reason,
        };
        let data = loaded
            .get(name.as_str())
            .ok_or_else(|| bad("no such tensor in the checkpoint".into()))?;
        let start = offset.map_or(0, |o| usize::try_from(o).unwrap_or(usize::MAX));
        let src = start
            .checked_add(out.len())
            .and_then(|end| data.get(start..end))
            .filter(|src| offset.is_some() || src.len() == data.len())
            .ok_or_else(|| {
                bad(format!(
                    "buffer of {} bytes at offset {start} for {}",
                    out.len(),
                    data.len()
                ))
            })?;
        out.copy_from_slice(src);
    }
    Ok(())
}

/// A manifest as the Python layer reads it (see `Engine.manifest`).
fn manifest_dict<'py>(py: Python<'py>, m: &Manifest) -> PyResult<Bound<'py, PyDict>> {
    let extras = m
        .decode_extras()
        .map_err(|r| to_py(corrupt_manifest(m.step, m.rank, r)))?;
    let d = PyDict::new(py);
    d.set_item("step", m.step)?;
    d.set_item("rank", m.rank)?;
    d.set_item("world_size", m.world_size)?;
    let tensors = PyList::empty(py);
    for t in &m.tensors {
        tensors.append((t.name.as_str(), t.dtype.as_str(), t.shape.clone()))?;
    }
    d.set_item("tensors", tensors)?;
    let ranges = PyList::empty(py);
    for t in &m.tensors {
        let r = m.tensor_range(t);
        ranges.append((r.start, r.end))?;
    }
    d.set_item("ranges", ranges)?;
    d.set_item("file_len", m.file_len)?;
    let x = PyDict::new(py);
    for (k, v) in extras {
        x.set_item(k, PyBytes::new(py, &v))?;
    }
    d.set_item("extras", x)?;
    Ok(d)
}

fn corrupt_manifest(step: u64, rank: u32, reason: String) -> hotstart_ckpt::Error {
    hotstart_ckpt::Error::Format {
        what: "manifest",
        location: format!("step {step} rank {rank}"),
        reason,
    }
}
