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
//! **Load (host → device).** Device bytes never land in the load's file buffer. Each reader
//! thread holds two pinned `Bounce` buffers (2 MiB, one huge page each, registered once per
//! load): it reads a window of a chunk into one, hashes it, and issues `cuMemcpyHtoDAsync` from
//! it on the device's stream, then reads the next window into the other while that copy runs;
//! a buffer is written again only once the event recorded after its copies has completed.
//! Reading, hashing and copying to the device so overlap across threads and within each one,
//! and the load waits for the last copies before it returns.
//!
//! **The caller's current context** is left alone: the driver calls need a current context,
//! and the calling thread may have its own (PyTorch's), so each batch of calls runs with the
//! device's primary context made current and the previous one restored afterwards.

use std::collections::BTreeSet;
use std::ops::Range;
use std::time::Duration;

use hotstart_store::uring::AlignedBuf;
use tracing::warn;

use crate::error::{Error, Result};
use crate::tensor::DevicePtr;

#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
pub(crate) use driver::{Gpu, PendingCopies, Pinned};

#[cfg(not(feature = "cuda"))]
mod absent;
#[cfg(not(feature = "cuda"))]
pub(crate) use absent::{Gpu, PendingCopies, Pinned};

/// The 64 bytes of a CUDA IPC memory handle.
pub(crate) type IpcHandle = [u8; 64];

/// The 16 bytes of a device's UUID: the same device in every process, however each numbers it.
pub(crate) type DeviceUuid = [u8; 16];

/// A device allocation exported for another process (`Gpu::export`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Exported {
    /// Its device's UUID.
    pub(crate) uuid: DeviceUuid,
    pub(crate) handle: IpcHandle,
    /// Its address and length in this process.
    pub(crate) base: u64,
    pub(crate) size: usize,
}

/// One device-to-host copy: where the bytes land, and the device memory they come from.
pub(crate) type DeviceCopy<'d> = (&'d mut [u8], DevicePtr);

/// How [`copy_to_shared`] issues a request's copies, given each copy's allocation (`keys`, in
/// the request's order): runs of consecutive copies into one allocation, each with whether it
/// is its allocation's last (whose handle then closes once the run's copies are done).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn runs<K: Ord>(keys: &[K]) -> Vec<(Range<usize>, bool)> {
    let mut out: Vec<(Range<usize>, bool)> = Vec::new();
    let mut last = std::collections::BTreeMap::new();
    for (i, k) in keys.iter().enumerate() {
        match out.last_mut() {
            Some((run, _)) if keys[run.start] == *k => run.end = i + 1,
            _ => out.push((i..i + 1, false)),
        }
        last.insert(k, out.len() - 1);
    }
    for r in last.into_values() {
        out[r].1 = true;
    }
    out
}

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

/// The GPU path a sidecar uses on behalf of the processes it serves: one per process, its
/// devices opened on first use, and only those [`for_sharing`] allows.
fn shared_gpu() -> &'static Gpu {
    static GPU: std::sync::OnceLock<Gpu> = std::sync::OnceLock::new();
    GPU.get_or_init(Gpu::new)
}

/// Why a process serving others must not open a context on a device in compute mode `mode`
/// (`CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`), if it must not: only the default mode admits a context
/// of every process. An exclusive one admits one process's (the training process's, which a
/// context of the sidecar's would lock out of its own GPU until the sidecar stops); the
/// prohibited mode admits none.
fn refuses_sharing(mode: i32) -> Option<&'static str> {
    match mode {
        0 => None,
        2 => Some("the prohibited compute mode"),
        _ => Some("an exclusive compute mode"),
    }
}

/// `ordinal` when the sidecar may open a context on it (see [`refuses_sharing`]), else why not.
fn for_sharing(ordinal: usize) -> Result<usize> {
    match refuses_sharing(compute_mode(ordinal)?) {
        None => Ok(ordinal),
        Some(mode) => Err(Error::Cuda {
            reason: format!(
                "CUDA device {ordinal} is in {mode}: a context of the sidecar's there would take \
                 the device from the training process, so the sidecar opens none and the process \
                 copies its own restores (`nvidia-smi -c DEFAULT` lets the sidecar copy them)"
            ),
        }),
    }
}

/// The device's compute mode.
fn compute_mode(ordinal: usize) -> Result<i32> {
    #[cfg(feature = "cuda")]
    return driver::compute_mode(ordinal);
    #[cfg(not(feature = "cuda"))]
    return absent::compute_mode(ordinal);
}

/// The first device the sidecar may open a context on (see [`refuses_sharing`]): where it pins
/// the steps it holds, for every device. An error says why there is none.
pub fn sharing_device() -> Result<usize> {
    // Device 0 answers first: with no driver or no device, that is the error; with none in the
    // default mode, device 0's mode is.
    let first = for_sharing(0);
    if first.is_ok() {
        return first;
    }
    (1..available()?)
        .find_map(|o| for_sharing(o).ok())
        .map_or(first, Ok)
}

/// Host memory registered as pinned for every device, read-only, until this is dropped: how a
/// sidecar keeps the steps it holds ready for device copies across a training process's
/// restart. See [`pin_read_only`].
#[derive(Debug)]
pub struct HostPin {
    _pin: Pinned,
}

/// Registers `len` bytes at `ptr`, mapped at least readable, as pinned memory for every device
/// (`cuMemHostRegister`, portable and read-only), in the primary context of the
/// [`sharing_device`].
///
/// # Safety
/// The memory must stay mapped until the returned [`HostPin`] is dropped, and no copy from it
/// may still run then.
pub unsafe fn pin_read_only(ptr: *const u8, len: usize) -> Result<HostPin> {
    let pin = shared_gpu().pin_read_only(sharing_device()?, ptr, len)?;
    Ok(HostPin { _pin: pin })
}

/// What one [`copy_to_shared`] did, and where the calling thread's time went: the three phases
/// add up to the call's time. The device copies while the thread opens later handles and closes
/// finished ones, so `copy` is the part of the copies those did not hide.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SharedCopy {
    /// Bytes copied.
    pub bytes: u64,
    /// Allocations opened from their IPC handles (one per distinct handle).
    pub handles: u64,
    /// Opening the handles (`cuIpcOpenMemHandle`) and checking each copy against its allocation.
    pub open: Duration,
    /// Issuing the copies and waiting for them.
    pub copy: Duration,
    /// Closing the handles (`cuIpcCloseMemHandle`).
    pub close: Duration,
}

/// Copies ranges of `src` (pinned with [`pin_read_only`] for full speed) into another process's
/// device memory, shared with CUDA IPC handles; returns once every copy is done, with where the
/// time went. Each allocation's copies start as soon as its handle is open, so they run while
/// the next one opens. Each copy's range must lie in `src` (checked before anything is copied)
/// and in its allocation (checked as it is opened): otherwise the error says which, once the
/// copies made before it are done. A device the sidecar must not open a context on (see
/// [`refuses_sharing`]) is refused before anything is copied.
pub fn copy_to_shared(
    src: &[u8],
    copies: &[hotstart_proto::wire::DeviceCopy],
) -> Result<SharedCopy> {
    let mut raw = Vec::with_capacity(copies.len());
    for c in copies {
        let bad = |what: &str| Error::Cuda {
            reason: format!("a copy into shared device memory with {what}"),
        };
        let handle = c
            .handle_bytes()
            .ok_or_else(|| bad("an IPC handle that is not 128 hex digits"))?;
        let device = c
            .device_bytes()
            .ok_or_else(|| bad("a device UUID that is not 32 hex digits"))?;
        let range = usize::try_from(c.from)
            .ok()
            .zip(usize::try_from(c.len).ok())
            .and_then(|(from, len)| Some(from..from.checked_add(len)?))
            .ok_or_else(|| Error::Cuda {
                reason: format!("a copy of {} bytes from {} overflows", c.len, c.from),
            })?;
        raw.push((range, device, handle, c.offset));
    }
    shared_gpu().copy_to_shared(src, &raw)
}

/// The error for a driver call that failed.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn failed(what: &str, ordinal: usize, e: impl std::fmt::Display) -> Error {
    Error::Cuda {
        reason: format!("device {ordinal}: {what}: {e}"),
    }
}

/// A host buffer that a load reads into and copies to device memory from: pinned when it can
/// be, and written again only once the copies issued from it are done.
pub(crate) struct Bounce {
    // Drop order matters: `Drop` waits for `pending` first, then `_pin` is unregistered, then
    // `buf` freed.
    pending: Option<PendingCopies<'static>>,
    _pin: Option<Pinned>,
    buf: AlignedBuf,
}

impl Bounce {
    /// `len` bytes of pageable memory, for loads without device destinations.
    pub(crate) fn host(len: usize) -> Bounce {
        Bounce {
            pending: None,
            _pin: None,
            buf: AlignedBuf::zeroed(len),
        }
    }

    /// `len` bytes registered as pinned memory for device `ordinal` (pageable, with a warning,
    /// when registering fails: copies are then slower, still correct).
    pub(crate) fn pinned(gpu: &Gpu, ordinal: usize, len: usize) -> Bounce {
        let buf = AlignedBuf::zeroed(len);
        let pin = match gpu.pin(ordinal, buf.as_ptr(), buf.len()) {
            Ok(p) => Some(p),
            Err(e) => {
                warn!(error = %e, "cannot pin a load buffer; copying from pageable memory");
                None
            }
        };
        Bounce {
            pending: None,
            _pin: pin,
            buf,
        }
    }

    /// The buffer, once every copy issued from it has finished.
    pub(crate) fn get(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        Ok(&mut self.buf[..])
    }

    /// Starts copying each range of the buffer into its device memory; [`Bounce::get`] and
    /// [`Bounce::wait`] wait for these copies.
    pub(crate) fn upload(&mut self, gpu: &Gpu, copies: &[(Range<usize>, DevicePtr)]) -> Result<()> {
        self.wait()?;
        if let Some(bad) = copies.iter().find(|(r, _)| r.end > self.buf.len()) {
            return Err(Error::Task {
                what: "load",
                message: format!(
                    "copy of {:?} outside a {}-byte buffer",
                    bad.0,
                    self.buf.len()
                ),
            });
        }
        // SAFETY: every range lies inside `buf` (checked above), which is neither written
        // (`get` and `upload` wait first) nor unregistered or freed (`Drop` waits first) until
        // these copies are waited for.
        self.pending = Some(unsafe { gpu.start_h2d(self.buf.as_ptr(), copies)? });
        Ok(())
    }

    /// Waits for the copies issued from the buffer; the first error, if any.
    pub(crate) fn wait(&mut self) -> Result<()> {
        match self.pending.take() {
            Some(p) => p.wait(),
            None => Ok(()),
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if let Err(e) = self.wait() {
            warn!(error = %e, "copies to the device failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{available, refuses_sharing, runs, sharing_device};

    #[test]
    fn without_a_driver_no_device_is_shared_and_the_error_says_why() {
        // With a driver (a GPU machine), the CUDA tests pin through the device it picks.
        if let Err(none) = available() {
            let err = sharing_device().unwrap_err();
            assert_eq!(err.to_string(), none.to_string());
        }
    }

    #[test]
    fn only_a_device_in_the_default_compute_mode_is_shared() {
        assert_eq!(refuses_sharing(0), None);
        for exclusive in [1, 3] {
            assert_eq!(
                refuses_sharing(exclusive),
                Some("an exclusive compute mode")
            );
        }
        assert_eq!(refuses_sharing(2), Some("the prohibited compute mode"));
    }

    #[test]
    fn a_request_is_issued_in_runs_and_each_handle_closes_after_its_last() {
        assert_eq!(runs::<u8>(&[]), vec![]);
        assert_eq!(runs(&['a']), vec![(0..1, true)]);
        // A's copies on both sides of B's: A's first run leaves its handle open.
        assert_eq!(
            runs(&['a', 'a', 'b', 'a', 'c', 'c']),
            vec![(0..2, false), (2..3, true), (3..4, true), (4..6, true)]
        );
        assert_eq!(
            runs(&['a', 'b', 'a', 'b']),
            vec![(0..1, false), (1..2, false), (2..3, true), (3..4, true)]
        );
    }
}
