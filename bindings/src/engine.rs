//! `Engine`: one rank's checkpoint engine, as the Python layer drives it.
//!
//! The Python `Checkpointer` resolves its defaults (environment, torch.distributed), flattens
//! state dicts into tensors and extras, and calls this class. Loads are two-phase so tensors land
//! in memory Python owns: `manifest(step)` gives the tensor index and the extras, Python
//! allocates (or picks the caller's tensors), and `load(step, destinations)` reads and verifies
//! straight into them. `reader(rank, world_size)` opens the same tiers as another rank of another
//! world size, to read checkpoints written by a job of a different size (torch.distributed
//! resharding).

use std::collections::BTreeMap;
use std::path::PathBuf;

use hotstart_ckpt::{Destination, EngineConfig, Extras, StepSel, TierKind, WhenFull};
use hotstart_store::Store;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::errors::{ConfigError, to_py};
use crate::handle::SaveHandle;
use crate::memory::{DestSpec, Dests, TensorSpec};

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
    /// Opens the engine of `rank` of `world_size` in `job`, with a store tier at `store` (a
    /// store URL) and/or a disk tier at `local_dir`.
    #[new]
    #[pyo3(signature = (
        job, rank, world_size, *, store=None, local_dir=None, keep=3, max_inflight=2,
        when_full="block", chunk_size=None, threads=0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        job: String,
        rank: u32,
        world_size: u32,
        store: Option<String>,
        local_dir: Option<PathBuf>,
        keep: usize,
        max_inflight: usize,
        when_full: &str,
        chunk_size: Option<usize>,
        threads: usize,
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
        cfg.keep = keep;
        cfg.max_inflight = max_inflight;
        cfg.when_full = self::when_full(when_full)?;
        if let Some(n) = chunk_size {
            cfg.chunk_size = n;
        }
        cfg.threads = threads;
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

    /// The configured tiers, in load order ("disk", "store").
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
        let extras = m
            .decode_extras()
            .map_err(|r| to_py(corrupt_manifest(step, rank, r)))?;
        let d = PyDict::new(py);
        d.set_item("step", m.step)?;
        d.set_item("rank", m.rank)?;
        d.set_item("world_size", m.world_size)?;
        let tensors = PyList::empty(py);
        for t in &m.tensors {
            tensors.append((t.name.as_str(), t.dtype.as_str(), t.shape.clone()))?;
        }
        d.set_item("tensors", tensors)?;
        let x = PyDict::new(py);
        for (k, v) in extras {
            x.set_item(k, PyBytes::new(py, &v))?;
        }
        d.set_item("extras", x)?;
        Ok(d)
    }

    /// Reads `step` of this rank, verifying every chunk, straight into `destinations` (one per
    /// tensor to load; tensors without one are read and dropped). Returns the tier each chunk
    /// came from. The memory must stay alive and untouched by anyone else during the call.
    fn load(
        &self,
        py: Python<'_>,
        step: u64,
        destinations: Vec<DestSpec>,
    ) -> PyResult<Vec<String>> {
        let mut dests = Dests::check(destinations)?;
        let loaded = py.detach(move || {
            // SAFETY: the Python layer describes only memory of objects its caller holds for
            // the whole call and does not touch meanwhile; `SendDests::new` checked overlaps.
            let dests = unsafe { dests.borrow() };
            if dests.device.is_empty() {
                let loaded = self
                    .engine
                    .load(StepSel::Step(step), Destination::Buffers(dests.host))?;
                return Ok(loaded.chunk_sources);
            }
            // Device destinations take the one `Destination`; host ones are copied out of the
            // verified tensors the load returns.
            let mut host = dests.host;
            let loaded = self
                .engine
                .load(StepSel::Step(step), Destination::Device(dests.device))?;
            for t in loaded.tensors {
                if let Some(out) = host.remove(&t.name) {
                    if out.len() != t.data.len() {
                        return Err(hotstart_ckpt::Error::Destination {
                            step,
                            name: t.name,
                            reason: format!("buffer of {} bytes for {}", out.len(), t.data.len()),
                        });
                    }
                    out.copy_from_slice(&t.data);
                }
            }
            if let Some(name) = host.into_keys().next() {
                return Err(hotstart_ckpt::Error::Destination {
                    step,
                    name,
                    reason: "no such tensor in the checkpoint".into(),
                });
            }
            Ok(loaded.chunk_sources)
        });
        let sources = loaded.map_err(to_py)?;
        Ok(sources.iter().map(TierKind::to_string).collect())
    }

    /// The newest step complete in any tier, or None.
    fn latest_step(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        py.detach(|| self.engine.latest_complete_step())
            .map_err(to_py)
    }

    /// Every step complete in some tier, ascending.
    fn complete_steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let mut steps = py
            .detach(|| {
                let mut all = Vec::new();
                for tier in self.engine.tiers() {
                    all.extend(self.engine.complete_steps(tier)?);
                }
                Ok::<_, hotstart_ckpt::Error>(all)
            })
            .map_err(to_py)?;
        steps.sort_unstable();
        steps.dedup();
        Ok(steps)
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

fn corrupt_manifest(step: u64, rank: u32, reason: String) -> hotstart_ckpt::Error {
    hotstart_ckpt::Error::Format {
        what: "manifest",
        location: format!("step {step} rank {rank}"),
        reason,
    }
}
