//! The GPU path: device tensors, pinned staging memory, and copies on a dedicated stream per
//! device.
//!
//! GPU support is the cargo feature `cuda`: cudarc's driver API, loaded with `dlopen` at run
//! time, so the build needs no CUDA toolkit and the binary runs on machines without a driver.
//!
//! **Finding the driver.** cudarc's dynamically loaded functions panic when `libcuda.so` is
//! missing, so nothing calls into cudarc before [`available`] has checked that the driver
//! library loads (`is_culib_present`), initialised it (`cuInit`) and counted the devices; the
//! answer is computed once per process, and a panic inside cudarc during that check is caught
//! and reported too. A save with device tensors, or a load into device buffers, asks first and
//! fails with [`Error::Cuda`] when the driver, or the device named, is missing. Host tensors
//! never touch the driver, so everything else works on any machine. Without the `cuda` feature
//! the same calls fail with the same error, saying how to rebuild.
//!
//! **Save (device → host).** Per engine and device, the first device save retains the device's
//! primary context and creates one non-blocking stream used only for checkpoint copies, so they
//! do not queue behind training kernels. The staging buffer is registered as pinned host memory
//! (`cuMemHostRegister`, portable to every context) the first time it receives device bytes, and
//! stays registered while the pool reuses it; it is unregistered before it is freed. The save
//! thread issues one `cuMemcpyDtoHAsync` per device tensor, straight into the tensor's place in
//! the file image, and records an event on each device's stream after its last copy; host
//! tensors are copied by CPU threads meanwhile. The thread then waits on the events and only
//! then marks the save staged, so `SaveHandle::wait_staged` returns once the copy engines are
//! done with the caller's memory. If the buffer cannot be pinned, the copies go to pageable
//! memory (slower, still correct).
//!
//! **Load (host → device).** After the file is read and verified, its buffer is registered as
//! pinned memory, each tensor is copied with `cuMemcpyHtoDAsync` on its device's stream, an
//! event is recorded per device and waited on, and the buffer is unregistered.
//!
//! **The caller's current context** is left alone: the driver calls need a current context,
//! and the calling thread may have its own (PyTorch's), so each batch of calls runs with the
//! device's primary context made current and the previous one restored afterwards.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::tensor::DevicePtr;

#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
pub(crate) use driver::{Gpu, Pinned};

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(not(feature = "cuda"))]
pub(crate) use absent::{Gpu, Pinned};

/// One device-to-host copy: where the bytes land, and the device memory they come from.
pub(crate) type DeviceCopy<'d> = (&'d mut [u8], DevicePtr);

/// Whether this build has GPU support (the `cuda` feature).
pub const ENABLED: bool = cfg!(feature = "cuda");

/// The number of CUDA devices this process can use, or [`Error::Cuda`] saying why none: the
/// build lacks the `cuda` feature, the driver library is missing, or the driver fails to
/// initialise. Never panics; computed once per process.
pub fn available() -> Result<usize> {
    #[cfg(feature = "cuda")]
    let count = driver::device_count();
    #[cfg(not(feature = "cuda"))]
    let count = absent::device_count();
    count.map_err(|reason| Error::Cuda { reason })
}

/// Checks that the driver is usable and that every device in `ordinals` exists.
pub(crate) fn check_devices(ordinals: &BTreeSet<usize>) -> Result<()> {
    let count = available()?;
    match ordinals.iter().find(|&&o| o >= count) {
        Some(o) => Err(Error::Cuda {
            reason: format!("no CUDA device {o}: this machine has {count}"),
        }),
        None => Ok(()),
    }
}

/// The error for a driver call that failed.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn failed(what: &str, ordinal: usize, e: impl std::fmt::Display) -> Error {
    Error::Cuda {
        reason: format!("device {ordinal}: {what}: {e}"),
    }
}
