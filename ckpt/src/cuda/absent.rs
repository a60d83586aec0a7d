//! The GPU path in a build without the `cuda` feature: every device operation is refused with
//! the same [`Error::Cuda`], and the types the engine carries around are empty.

use std::marker::PhantomData;
use std::ops::Range;

use super::{DeviceCopy, DeviceUuid, Exported, IpcHandle, SharedCopy};
use crate::error::{Error, Result};
use crate::tensor::DevicePtr;

const NOT_BUILT: &str = "hotstart-ckpt was built without GPU support \
     (rebuild with `--features cuda` to save or load CUDA device tensors)";

fn not_built() -> Error {
    Error::Cuda {
        reason: NOT_BUILT.into(),
    }
}

pub(super) fn device_count() -> std::result::Result<usize, String> {
    Err(NOT_BUILT.into())
}

pub(super) fn compute_mode(_ordinal: usize) -> Result<i32> {
    Err(not_built())
}

/// No devices, no streams.
#[derive(Debug, Default)]
pub(crate) struct Gpu;

/// A pinned-memory registration; none can exist in this build.
#[derive(Debug)]
pub(crate) enum Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        match *self {}
    }
}

/// Copies in flight; none can exist in this build.
#[derive(Debug)]
pub(crate) struct PendingCopies<'d>(PhantomData<&'d mut [u8]>);

impl Gpu {
    pub(crate) fn new() -> Gpu {
        Gpu
    }

    pub(crate) fn pin(&self, _ordinal: usize, _ptr: *const u8, _len: usize) -> Result<Pinned> {
        Err(not_built())
    }

    pub(crate) fn pin_read_only(
        &self,
        _ordinal: usize,
        _ptr: *const u8,
        _len: usize,
    ) -> Result<Pinned> {
        Err(not_built())
    }

    pub(crate) fn export(&self, _d: DevicePtr) -> Result<Exported> {
        Err(not_built())
    }

    pub(crate) fn copy_to_shared(
        &self,
        _src: &[u8],
        _copies: &[(Range<usize>, DeviceUuid, IpcHandle, u64)],
    ) -> Result<SharedCopy> {
        Err(not_built())
    }

    pub(crate) fn start_d2h<'d>(&self, _copies: Vec<DeviceCopy<'d>>) -> Result<PendingCopies<'d>> {
        Err(not_built())
    }

    /// # Safety
    /// As the `cuda` build's: nothing is read here.
    pub(crate) unsafe fn start_h2d(
        &self,
        _src: *const u8,
        _copies: &[(Range<usize>, DevicePtr)],
    ) -> Result<PendingCopies<'static>> {
        Err(not_built())
    }
}

impl PendingCopies<'_> {
    pub(crate) fn wait(self) -> Result<()> {
        Ok(())
    }
}
