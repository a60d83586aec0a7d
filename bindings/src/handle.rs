//! `SaveHandle`: one save in flight, as Python sees it.
//!
//! It owns the Python objects whose memory the engine borrows (the caller's tensors and arrays,
//! or contiguous copies of them) and lets go of them once staging is over: after `wait_staged`
//! (or any wait that implies it). Dropping the handle first waits for staging (without the
//! GIL) and only then releases the objects, so memory is never freed while the engine reads it.

use std::sync::{Mutex, PoisonError};

use hotstart_ckpt::{Phase, SaveStatus, TierKind};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::to_py;

#[pyclass(frozen, module = "hotstart")]
pub struct SaveHandle {
    // Field order matters: `handle` drops first (waiting for staging), then `keep`.
    handle: hotstart_ckpt::SaveHandle,
    keep: Mutex<Vec<Py<PyAny>>>,
}

impl SaveHandle {
    pub fn new(handle: hotstart_ckpt::SaveHandle, keep: Vec<Py<PyAny>>) -> SaveHandle {
        SaveHandle {
            handle,
            keep: Mutex::new(keep),
        }
    }

    /// Lets go of the caller's objects; only once staging is over.
    fn release(&self) {
        let objects =
            std::mem::take(&mut *self.keep.lock().unwrap_or_else(PoisonError::into_inner));
        drop(objects);
    }
}

impl Drop for SaveHandle {
    fn drop(&mut self) {
        // The engine's handle waits for staging when dropped; do that wait here, without the
        // GIL, so other Python threads run meanwhile. Its outcome was or will be reported by
        // the waits the caller made; a handle dropped unwaited has no one left to tell.
        if !self.handle.status().staged.is_finished() {
            Python::attach(|py| py.detach(|| drop(self.handle.wait_staged())));
        }
    }
}

fn tier(name: &str) -> PyResult<TierKind> {
    match name {
        "disk" => Ok(TierKind::Disk),
        "store" => Ok(TierKind::Store),
        other => Err(PyValueError::new_err(format!(
            "unknown tier {other:?}: expected \"disk\" or \"store\""
        ))),
    }
}

fn phase_name(p: &Phase) -> String {
    match p {
        Phase::Pending => "pending".into(),
        Phase::Done => "done".into(),
        Phase::Failed(e) => format!("failed: {e}"),
        Phase::Skipped => "skipped".into(),
        Phase::Off => "off".into(),
    }
}

#[pymethods]
impl SaveHandle {
    /// The step being saved.
    #[getter]
    fn step(&self) -> u64 {
        self.handle.step()
    }

    /// Waits until the state is copied into staging memory; afterwards the caller may change
    /// its tensors. The only wait a training loop needs.
    fn wait_staged(&self, py: Python<'_>) -> PyResult<()> {
        let res = py.detach(|| self.handle.wait_staged());
        self.release();
        res.map_err(to_py)
    }

    /// Waits until `tier` ("disk" or "store") holds the step durably; every configured tier
    /// when `tier` is None.
    #[pyo3(signature = (tier=None))]
    fn wait_persisted(&self, py: Python<'_>, tier: Option<&str>) -> PyResult<()> {
        let res = match tier {
            Some(name) => {
                let t = self::tier(name)?;
                py.detach(|| self.handle.wait_persisted(t))
            }
            None => py.detach(|| self.handle.wait()),
        };
        self.release();
        res.map_err(to_py)
    }

    /// Waits for staging and every configured tier; raises the first failure.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.wait_persisted(py, None)
    }

    /// True once staging and every configured tier have finished (well or not).
    fn done(&self) -> bool {
        let s = self.handle.status();
        [&s.staged, &s.disk, &s.store]
            .iter()
            .all(|p| p.is_finished())
    }

    /// True once staging has finished (well or not).
    fn staged(&self) -> bool {
        self.handle.status().staged.is_finished()
    }

    /// Waits for the save to finish and returns its first failure as an exception object, or
    /// None when every phase succeeded.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        let res = py.detach(|| self.handle.wait_staged().and_then(|()| self.handle.wait()));
        self.release();
        res.err().map(|e| to_py(e).into_value(py).into_any())
    }

    /// Where each phase stands now: {"step", "staged", "disk", "store"}, each phase one of
    /// "pending", "done", "skipped", "off" (tier not configured) or "failed: <message>".
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let SaveStatus {
            step,
            staged,
            disk,
            store,
        } = self.handle.status();
        let d = PyDict::new(py);
        d.set_item("step", step)?;
        d.set_item("staged", phase_name(&staged))?;
        d.set_item("disk", phase_name(&disk))?;
        d.set_item("store", phase_name(&store))?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let s = self.handle.status();
        format!(
            "SaveHandle(step={}, staged={}, disk={}, store={})",
            s.step,
            phase_name(&s.staged),
            phase_name(&s.disk),
            phase_name(&s.store)
        )
    }
}
