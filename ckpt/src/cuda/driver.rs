//! The GPU path with the `cuda` feature: cudarc's driver API (`result` and `sys`), loaded at run
//! time. See the parent module for how saves and loads use it.
//!
//! Every driver call goes through [`Device::run`], which makes the device's primary context
//! current (push), runs the calls, restores the caller's context (pop), and turns a panic from
//! inside cudarc into an [`Error::Cuda`]. Raw handles (contexts, streams, events) live only in
//! this file.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use cudarc::driver::{result, sys};
use tracing::warn;

use super::failed;
use super::{DeviceCopy, DeviceUuid, Exported, IpcHandle, SharedCopy};
use crate::error::{Error, Result};
use crate::tensor::DevicePtr;

const NO_DRIVER: &str = "no CUDA driver: libcuda.so could not be loaded \
     (this needs a machine with an NVIDIA GPU and its driver installed)";

/// The device count, or why there is none; checked once per process, before any other call
/// into cudarc.
pub(super) fn device_count() -> std::result::Result<usize, String> {
    static COUNT: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    COUNT
        .get_or_init(|| {
            catch_unwind(probe).unwrap_or_else(|_| {
                Err("the CUDA driver library failed while loading (see the panic above)".into())
            })
        })
        .clone()
}

fn probe() -> std::result::Result<usize, String> {
    // SAFETY: only tries to `dlopen` the driver library under its usual names (and closes it
    // again); it calls nothing in it.
    if !unsafe { sys::is_culib_present() } {
        return Err(NO_DRIVER.into());
    }
    result::init().map_err(|e| format!("the CUDA driver failed to initialise (cuInit): {e}"))?;
    match result::device::get_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) => Err("the CUDA driver reports no devices".into()),
        Err(e) => Err(format!("cuDeviceGetCount: {e}")),
    }
}

/// One device as the engine uses it: its primary context (retained) and a non-blocking stream
/// for checkpoint copies only.
struct Device {
    ordinal: usize,
    cu: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
}

// SAFETY: the handles are driver objects, not memory: the driver API may be called with them from
// any thread (a context is made current on the calling thread by `run` before use), and the
// struct has no interior state of its own.
unsafe impl Send for Device {}
// SAFETY: as for `Send`; shared use only passes the handles to thread-safe driver calls.
unsafe impl Sync for Device {}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

/// Pops the context pushed by [`Device::run`], even when the calls in between panic.
struct PopOnDrop;

impl Drop for PopOnDrop {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: paired with the successful push in `Device::run` on this thread; `popped` is a
        // valid place for the driver to write the popped handle.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

impl Device {
    /// Retains device `ordinal`'s primary context and creates the copy stream.
    fn open(ordinal: usize) -> Result<Device> {
        let index = c_int::try_from(ordinal).map_err(|_| Error::Cuda {
            reason: format!("no CUDA device {ordinal}"),
        })?;
        let cu = result::device::get(index).map_err(|e| failed("cuDeviceGet", ordinal, e))?;
        // SAFETY: `cu` was just returned by `cuDeviceGet`; the retain is released in `drop` (or
        // below when the stream cannot be created).
        let ctx = unsafe { result::primary_ctx::retain(cu) }
            .map_err(|e| failed("cuDevicePrimaryCtxRetain", ordinal, e))?;
        let mut dev = Device {
            ordinal,
            cu,
            ctx,
            stream: std::ptr::null_mut(),
        };
        let stream = dev.run("cuStreamCreate", || {
            result::stream::create(result::stream::StreamKind::NonBlocking)
        });
        match stream {
            Ok(s) => dev.stream = s,
            Err(e) => {
                drop(dev); // releases the context
                return Err(e);
            }
        }
        Ok(dev)
    }

    /// Runs driver calls with this device's primary context current on the calling thread, and
    /// the caller's own context current again afterwards.
    fn run<T>(
        &self,
        what: &str,
        calls: impl FnOnce() -> std::result::Result<T, result::DriverError>,
    ) -> Result<T> {
        let res = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `ctx` is this device's primary context, retained for as long as `self`
            // lives; pushing it only changes this thread's context stack, and `PopOnDrop`
            // restores it.
            unsafe { sys::cuCtxPushCurrent_v2(self.ctx) }.result()?;
            let _pop = PopOnDrop;
            calls()
        }));
        match res {
            Ok(r) => r.map_err(|e| failed(what, self.ordinal, e)),
            Err(_) => Err(failed(what, self.ordinal, "panicked inside cudarc")),
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        if !self.stream.is_null() {
            let stream = self.stream;
            // SAFETY: the stream was created by `open` in this context, and nothing uses it any
            // more: every `Pending` and `Pinned` holds an `Arc<Device>`, so none is left.
            let res = self.run("cuStreamDestroy", || unsafe {
                result::stream::destroy(stream)
            });
            if let Err(e) = res {
                warn!(error = %e, "cannot destroy the checkpoint copy stream");
            }
        }
        // SAFETY: `cu` came from `cuDeviceGet`, and this releases the retain made in `open`.
        if let Err(e) = unsafe { result::primary_ctx::release(self.cu) } {
            warn!(device = self.ordinal, error = %e, "cannot release the primary context");
        }
    }
}

/// The devices an engine has used, opened on first use.
#[derive(Debug, Default)]
pub(crate) struct Gpu {
    devices: Mutex<BTreeMap<usize, Arc<Device>>>,
}

/// A host memory range registered as pinned (page-locked) memory, unregistered on drop.
pub(crate) struct Pinned {
    ptr: usize,
    len: usize,
    dev: Arc<Device>,
}

impl fmt::Debug for Pinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pinned")
            .field("len", &self.len)
            .field("device", &self.dev.ordinal)
            .finish()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let ptr = self.ptr as *mut c_void;
        // SAFETY: `ptr` is the start of a range registered by `Gpu::pin`, whose owner drops this
        // registration before it frees the memory, and after every copy into it has finished.
        let res = self.dev.run("cuMemHostUnregister", || unsafe {
            sys::cuMemHostUnregister(ptr).result()
        });
        if let Err(e) = res {
            warn!(error = %e, bytes = self.len, "cannot unregister pinned staging memory");
        }
    }
}

/// Device `ordinal`'s compute mode (`CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`); asks no context.
pub(super) fn compute_mode(ordinal: usize) -> Result<i32> {
    super::check_devices(&[ordinal].into())?;
    let asked = catch_unwind(|| {
        // Below the driver's device count, a `c_int`.
        let cu = result::device::get(ordinal as c_int)?;
        // SAFETY: `cu` was just returned by `cuDeviceGet`; the attribute is only read.
        unsafe {
            result::device::get_attribute(
                cu,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE,
            )
        }
    });
    match asked {
        Ok(r) => r.map_err(|e| failed("cuDeviceGetAttribute", ordinal, e)),
        Err(_) => Err(failed(
            "cuDeviceGetAttribute",
            ordinal,
            "panicked inside cudarc",
        )),
    }
}

/// This process's ordinal of the device with `uuid`.
fn ordinal_of(uuid: &DeviceUuid) -> Result<usize> {
    let count = device_count().map_err(|reason| Error::Cuda { reason })?;
    for ordinal in 0..count {
        let found = catch_unwind(|| {
            let cu = result::device::get(ordinal as c_int)?;
            result::device::get_uuid(cu)
        });
        if let Ok(Ok(id)) = found
            && id.bytes.map(|c| c as u8) == *uuid
        {
            return Ok(ordinal);
        }
    }
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    Err(Error::Cuda {
        reason: format!(
            "no device with UUID {hex} here (of {count}): is it visible to this process?"
        ),
    })
}

/// Another process's device allocation, opened from its IPC handle; closed on drop.
struct Opened {
    dev: Arc<Device>,
    base: sys::CUdeviceptr,
    size: usize,
}

impl Opened {
    fn open(dev: Arc<Device>, handle: &IpcHandle) -> Result<Opened> {
        let mut raw = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `CUipcMemHandle` is 64 bytes of plain data; every one is written here.
        unsafe { (*raw.as_mut_ptr()).reserved = handle.map(|b| b as c_char) };
        // SAFETY: initialised just above.
        let raw = unsafe { raw.assume_init() };
        let (base, size) = dev.run("cuIpcOpenMemHandle", || {
            let mut base: sys::CUdeviceptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: `base` is a valid place for the address; the handle is only read.
            unsafe { sys::cuIpcOpenMemHandle_v2(&mut base, raw, flags) }.result()?;
            let (mut start, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: valid places to write; `base` was just mapped into this context.
            let looked = unsafe { sys::cuMemGetAddressRange_v2(&mut start, &mut size, base) };
            if let Err(e) = looked.result() {
                // SAFETY: opened above and not used again.
                let _ = unsafe { sys::cuIpcCloseMemHandle(base) };
                return Err(e);
            }
            Ok((base, size - (base - start) as usize))
        })?;
        Ok(Opened { dev, base, size })
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        let base = self.base;
        // SAFETY: opened by `Opened::open`, closed once, here, after every copy into it is done.
        let res = self.dev.run("cuIpcCloseMemHandle", || unsafe {
            sys::cuIpcCloseMemHandle(base).result()
        });
        if let Err(e) = res {
            warn!(error = %e, "cannot close another process's shared device memory");
        }
    }
}

/// One copy between host memory and device memory.
struct Transfer {
    host: *mut u8,
    dev: DevicePtr,
}

#[derive(Debug, Clone, Copy)]
enum Direction {
    DeviceToHost,
    HostToDevice,
}

/// Copies issued on the devices' streams, one event recorded after each device's copies. The
/// host memory they use is borrowed for `'d`; waiting (or dropping, which also waits) ends the
/// borrow.
pub(crate) struct PendingCopies<'d> {
    events: Vec<(Arc<Device>, sys::CUevent)>,
    _host: PhantomData<&'d mut [u8]>,
}

impl fmt::Debug for PendingCopies<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCopies")
            .field("devices", &self.events.len())
            .finish()
    }
}

impl Gpu {
    pub(crate) fn new() -> Gpu {
        Gpu::default()
    }

    fn device(&self, ordinal: usize) -> Result<Arc<Device>> {
        super::check_devices(&[ordinal].into())?;
        let devices = || self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(d) = devices().get(&ordinal) {
            return Ok(d.clone());
        }
        // Opened without the lock (a context can take a tenth of a second to create), so the
        // copies of devices already open, and other devices' openings, do not wait for it; of
        // two threads opening one device, the first to finish is kept.
        let opened = Arc::new(Device::open(ordinal)?);
        Ok(devices().entry(ordinal).or_insert(opened).clone())
    }

    /// Registers `len` bytes at `ptr` as pinned memory usable by every context (portable).
    ///
    /// The caller keeps the memory alive until the returned registration is dropped.
    pub(crate) fn pin(&self, ordinal: usize, ptr: *const u8, len: usize) -> Result<Pinned> {
        self.register(ordinal, ptr, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
    }

    /// [`Gpu::pin`] for memory mapped read-only (the device only reads it).
    pub(crate) fn pin_read_only(
        &self,
        ordinal: usize,
        ptr: *const u8,
        len: usize,
    ) -> Result<Pinned> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY;
        self.register(ordinal, ptr, len, flags)
    }

    fn register(&self, ordinal: usize, ptr: *const u8, len: usize, flags: u32) -> Result<Pinned> {
        let dev = self.device(ordinal)?;
        let p = ptr as *mut c_void;
        // SAFETY: the caller owns `len` bytes at `ptr` and keeps them alive while registered (it
        // drops the `Pinned` first); registering pins the pages and writes nothing.
        dev.run("cuMemHostRegister", || unsafe {
            sys::cuMemHostRegister_v2(p, len, flags).result()
        })?;
        Ok(Pinned {
            ptr: ptr as usize,
            len,
            dev,
        })
    }

    /// Starts copying each device range into its host slice; the slices stay borrowed until the
    /// returned copies are waited for (or dropped).
    pub(crate) fn start_d2h<'d>(&self, copies: Vec<DeviceCopy<'d>>) -> Result<PendingCopies<'d>> {
        let copies = copies
            .into_iter()
            .map(|(dst, dev)| Transfer {
                host: dst.as_mut_ptr(),
                dev,
            })
            .collect();
        self.issue(Direction::DeviceToHost, copies)
    }

    /// Starts copying each range of the host memory at `src` into its device memory.
    ///
    /// # Safety
    /// Every range of `src` must stay valid, and unwritten, until the returned copies are
    /// waited for (or dropped).
    pub(crate) unsafe fn start_h2d(
        &self,
        src: *const u8,
        copies: &[(Range<usize>, DevicePtr)],
    ) -> Result<PendingCopies<'static>> {
        let raw = copies
            .iter()
            .map(|(range, dev)| Transfer {
                // Only read from: host-to-device copies never write host memory.
                // SAFETY: `range` lies inside the memory at `src` (the caller's contract).
                host: unsafe { src.add(range.start) }.cast_mut(),
                dev: *dev,
            })
            .collect();
        self.issue(Direction::HostToDevice, raw)
    }

    /// The allocation that holds `d`, exported for another process (`cuIpcGetMemHandle`): what
    /// it opens to copy into `d`. Fails for memory that cannot be shared this way (not allocated
    /// with `cuMemAlloc`/`cudaMalloc`: PyTorch's expandable segments, say).
    pub(crate) fn export(&self, d: DevicePtr) -> Result<Exported> {
        let dev = self.device(d.ordinal)?;
        let cu = dev.cu;
        dev.run("cuIpcGetMemHandle", || {
            let uuid = result::device::get_uuid(cu)?.bytes.map(|c| c as u8);
            let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
            // SAFETY: both are valid places for the driver to write; `d.ptr` is only looked up.
            unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, d.ptr) }.result()?;
            let mut handle = MaybeUninit::<sys::CUipcMemHandle>::zeroed();
            // SAFETY: `handle` is a valid place for the 64-byte handle; `base` is the start of
            // an allocation of this device (just looked up).
            unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), base) }.result()?;
            // SAFETY: zeroed, then written by the driver: every byte is initialised.
            let handle = unsafe { handle.assume_init() }.reserved.map(|c| c as u8);
            Ok(Exported {
                uuid,
                handle,
                base,
                size,
            })
        })
    }

    /// Copies ranges of `src` into device allocations that another process shares: each of
    /// `copies` is `(range of src, device UUID, IPC handle, offset in the allocation)`; the
    /// device is found by its UUID, since the two processes may number their devices
    /// differently (`CUDA_VISIBLE_DEVICES`). Every range is checked to lie in `src` before
    /// anything is opened. Then, in the order of `copies`, each handle is opened once
    /// (`cuIpcOpenMemHandle`), its copies are checked to lie inside its allocation and issued at
    /// once, so the copies already issued run while the next handle opens; each handle is
    /// closed as soon as the copies into it are done, while the later ones still run. A handle
    /// that does not open, or a copy outside its allocation, stops the call there: the copies
    /// issued before it are waited for, and may have been made. `src` should be pinned (see
    /// [`Gpu::pin_read_only`]), or the copies run at pageable speed.
    pub(crate) fn copy_to_shared(
        &self,
        src: &[u8],
        copies: &[(Range<usize>, DeviceUuid, IpcHandle, u64)],
    ) -> Result<SharedCopy> {
        let bad = |what: String| Error::Cuda {
            reason: format!("a copy into shared device memory {what}"),
        };
        // Checked before any handle is opened: every range lies in `src`, every device is here
        // and may be shared.
        let mut ordinals: BTreeMap<DeviceUuid, usize> = BTreeMap::new();
        for (range, uuid, ..) in copies {
            if range.end > src.len() || range.start > range.end {
                return Err(bad(format!("of {range:?}, outside {} bytes", src.len())));
            }
            if !ordinals.contains_key(uuid) {
                ordinals.insert(*uuid, super::for_sharing(ordinal_of(uuid)?)?);
            }
        }
        let keys: Vec<(DeviceUuid, IpcHandle)> = copies.iter().map(|c| (c.1, c.2)).collect();
        let runs = super::runs(&keys);
        let mut done = SharedCopy {
            bytes: copies.iter().map(|(r, ..)| r.len() as u64).sum(),
            handles: runs.iter().filter(|(_, last)| *last).count() as u64,
            ..SharedCopy::default()
        };
        // Declared before `issued`, so that on an error every issued copy is waited for (as
        // `issued` drops) before the handles still open here are closed.
        let mut opened: BTreeMap<(DeviceUuid, IpcHandle), Opened> = BTreeMap::new();
        // Runs of consecutive copies into one allocation, in the order issued; with a run's
        // copies, the handle to close once they are done (after its allocation's last run).
        let mut issued: Vec<(PendingCopies<'_>, Option<Opened>)> = Vec::new();
        for (run, last) in runs {
            let key = keys[run.start];
            let opening = Instant::now();
            let at = match opened.entry(key) {
                std::collections::btree_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert(Opened::open(self.device(ordinals[&key.0])?, &key.1)?)
                }
            };
            let mut transfers = Vec::with_capacity(run.len());
            for (range, _, _, offset) in &copies[run] {
                let len = range.len();
                if offset
                    .checked_add(len as u64)
                    .is_none_or(|end| end > at.size as u64)
                {
                    let size = at.size;
                    return Err(bad(format!(
                        "of {len} bytes at {offset}, outside its {size}"
                    )));
                }
                transfers.push(Transfer {
                    // Only read from: host-to-device copies never write host memory.
                    host: src[range.clone()].as_ptr().cast_mut(),
                    dev: DevicePtr {
                        ordinal: at.dev.ordinal,
                        ptr: at.base + offset,
                        len,
                    },
                });
            }
            done.open += opening.elapsed();
            let copying = Instant::now();
            // `src` is borrowed for the whole call, and every copy is waited for before it
            // returns (on an error too: `issued` waits as it drops).
            let pending = self.issue(Direction::HostToDevice, transfers)?;
            done.copy += copying.elapsed();
            issued.push((pending, last.then(|| opened.remove(&key)).flatten()));
        }
        // The copies run on the devices while later handles open; each handle closes as soon as
        // its copies are done, while the later ones still run.
        let mut first = Ok(());
        for (pending, close) in issued {
            let waiting = Instant::now();
            let waited = pending.wait();
            done.copy += waiting.elapsed();
            let closing = Instant::now();
            drop(close);
            done.close += closing.elapsed();
            if first.is_ok() {
                first = waited;
            }
        }
        first.map(|()| done)
    }

    /// Issues every copy on its device's stream and records one event per device. On an error
    /// the copies already issued are waited for before it is returned. The caller ties `'d` to
    /// the borrow of the host memory (`start_d2h`) or leaves it to its caller (`start_h2d`).
    fn issue<'d>(&self, dir: Direction, copies: Vec<Transfer>) -> Result<PendingCopies<'d>> {
        let mut by_device: BTreeMap<usize, Vec<Transfer>> = BTreeMap::new();
        for c in copies {
            by_device.entry(c.dev.ordinal).or_default().push(c);
        }
        let mut pending = PendingCopies {
            events: Vec::with_capacity(by_device.len()),
            _host: PhantomData,
        };
        for (ordinal, group) in by_device {
            let dev = self.device(ordinal)?;
            let stream = dev.stream;
            let what = match dir {
                Direction::DeviceToHost => "cuMemcpyDtoHAsync",
                Direction::HostToDevice => "cuMemcpyHtoDAsync",
            };
            let event = dev.run(what, || {
                let issued = group.iter().filter(|c| c.dev.len > 0).try_for_each(|c| {
                    let (host, ptr, len) = (c.host.cast::<c_void>(), c.dev.ptr, c.dev.len);
                    // SAFETY: `host` is `len` bytes of host memory borrowed for `'d` (a slice
                    // of the staging or load buffer), writable for device-to-host copies; `ptr`
                    // is `len` bytes of device memory under the `Tensor::from_device` or
                    // `DeviceBuffer::new` contract. The memory stays valid until the event
                    // recorded below has completed: `PendingCopies` waits for it before the
                    // borrow ends, and the stream is synchronized below on any error.
                    unsafe {
                        match dir {
                            Direction::DeviceToHost => {
                                sys::cuMemcpyDtoHAsync_v2(host, ptr, len, stream)
                            }
                            Direction::HostToDevice => {
                                sys::cuMemcpyHtoDAsync_v2(ptr, host, len, stream)
                            }
                        }
                    }
                    .result()
                });
                let recorded = issued.and_then(|()| {
                    let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
                    // SAFETY: `ev` was just created and `stream` is this device's live stream.
                    match unsafe { result::event::record(ev, stream) } {
                        Ok(()) => Ok(ev),
                        Err(e) => {
                            // SAFETY: `ev` was created above and is not used again.
                            let _ = unsafe { result::event::destroy(ev) };
                            Err(e)
                        }
                    }
                });
                if recorded.is_err() {
                    // SAFETY: `stream` is live; waiting makes sure no copy issued above still
                    // uses the host memory after the error is returned.
                    let _ = unsafe { result::stream::synchronize(stream) };
                }
                recorded
            })?;
            pending.events.push((dev, event));
        }
        Ok(pending)
    }
}

impl PendingCopies<'_> {
    /// Waits for every device's copies; the first error, if any.
    pub(crate) fn wait(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        let mut first = Ok(());
        for (dev, ev) in self.events.drain(..) {
            // SAFETY: `ev` was created and recorded by `issue` and is destroyed only here, once.
            let res = dev.run("cuEventSynchronize", || unsafe {
                let waited = result::event::synchronize(ev);
                let _ = result::event::destroy(ev);
                waited
            });
            if let Err(e) = res
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

impl Drop for PendingCopies<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            warn!(error = %e, "checkpoint copies failed");
        }
    }
}
