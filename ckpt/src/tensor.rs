//! What a checkpoint holds: named [`Tensor`]s and [`Extras`].
//!
//! A tensor is a name, a [`Dtype`] (the safetensors element types), a shape and the place its
//! bytes live. On the host the bytes are either owned ([`bytes::Bytes`], kept alive by the save
//! for as long as it needs them) or borrowed: a raw pointer and a length the caller promises to
//! keep valid and unchanged until the save's staging copy is done ([`Tensor::from_raw`]). Borrowed
//! tensors are how training code hands over parameters without a copy of its own: the engine's
//! staging copy is the only one, and [`crate::SaveHandle::wait_staged`] says when it is over.
//!
//! A tensor may also live in CUDA device memory ([`Tensor::from_device`]: device ordinal, device
//! address, length). Saving one needs the `cuda` feature and a CUDA driver at run time; without
//! either, [`Engine::save`](crate::Engine::save) refuses it with [`crate::Error::Cuda`] before
//! anything is read (see `crate::cuda` for the GPU path).
//!
//! Extras are named byte blobs for non-tensor state (optimizer scalars, RNG states, a data-loader
//! position); they travel in the manifest.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use bytes::Bytes;

/// Named byte blobs saved next to the tensors (non-tensor training state).
pub type Extras = BTreeMap<String, Vec<u8>>;

/// Element types, as safetensors names them.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[allow(non_camel_case_types)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    F8_E4M3,
    F8_E5M2,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    BOOL,
}

impl Dtype {
    /// Every dtype, for tests and reports.
    pub const ALL: [Dtype; 15] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U64,
        Dtype::U32,
        Dtype::U16,
        Dtype::U8,
        Dtype::BOOL,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::I8 | Dtype::U8 | Dtype::BOOL => 1,
        }
    }

    /// The name safetensors uses in its header.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::I16 => "I16",
            Dtype::I8 => "I8",
            Dtype::U64 => "U64",
            Dtype::U32 => "U32",
            Dtype::U16 => "U16",
            Dtype::U8 => "U8",
            Dtype::BOOL => "BOOL",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Dtype {
    type Err = String;

    fn from_str(s: &str) -> Result<Dtype, String> {
        Dtype::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| format!("unknown dtype {s:?}"))
    }
}

/// Number of bytes a tensor of this dtype and shape holds, or `None` on overflow.
pub fn byte_len(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
}

/// A range of CUDA device memory: the device's ordinal, a device address (`CUdeviceptr`) and a
/// length in bytes. Only built by the unsafe constructors that state what the caller promises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevicePtr {
    pub(crate) ordinal: usize,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
}

/// Where a tensor's bytes are.
#[derive(Clone)]
pub(crate) enum Data {
    Owned(Bytes),
    Raw { ptr: *const u8, len: usize },
    Device(DevicePtr),
}

// SAFETY: `Raw` is only built by `Tensor::from_raw`, whose caller promises the memory stays valid
// for reads and unchanged, from any thread, until the save's staging is over; the engine only
// reads through the pointer, and only before it reports staging done. `Device` holds a plain
// device address, which is not host memory and is only handed to the CUDA driver.
unsafe impl Send for Data {}
// SAFETY: as for `Send`: shared access only ever reads.
unsafe impl Sync for Data {}

/// A tensor's bytes as the staging copy sees them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Source<'a> {
    /// Host bytes, copied by CPU threads.
    Host(&'a [u8]),
    /// Device bytes, copied by the GPU's copy engine.
    Device(DevicePtr),
}

impl Source<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Source::Host(b) => b.len(),
            Source::Device(d) => d.len,
        }
    }
}

/// One named tensor to save.
#[derive(Clone)]
pub struct Tensor {
    pub(crate) name: String,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) data: Data,
}

impl Tensor {
    /// A tensor whose bytes the save owns (cheaply cloned [`Bytes`]).
    ///
    /// Fails when `data` does not hold exactly `dtype.size() * shape.product()` bytes.
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        data: impl Into<Bytes>,
    ) -> crate::Result<Tensor> {
        let data = data.into();
        let name = name.into();
        check_len(&name, dtype, &shape, data.len())?;
        Ok(Tensor {
            name,
            dtype,
            shape,
            data: Data::Owned(data),
        })
    }

    /// A tensor whose bytes stay where they are, in the caller's memory.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` bytes (it may be dangling when `len` is 0), from any
    /// thread, and the bytes must not be written or freed from the call to
    /// [`Engine::save`](crate::Engine::save) until the save's staging is over: until
    /// [`SaveHandle::wait_staged`](crate::SaveHandle::wait_staged) returns (with success or an
    /// error) or the handle is dropped (dropping waits for staging). If `save` returns an error
    /// the bytes were never read and are free again at once.
    pub unsafe fn from_raw(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        ptr: *const u8,
        len: usize,
    ) -> crate::Result<Tensor> {
        let name = name.into();
        check_len(&name, dtype, &shape, len)?;
        Ok(Tensor {
            name,
            dtype,
            shape,
            data: Data::Raw { ptr, len },
        })
    }

    /// A tensor in CUDA device memory: `len` bytes at device address `ptr` on device `ordinal`
    /// (a `CUdeviceptr`, such as `tensor.data_ptr()` of a CUDA tensor in PyTorch).
    ///
    /// Saving it needs the `cuda` feature and a CUDA driver; otherwise
    /// [`Engine::save`](crate::Engine::save) returns [`crate::Error::Cuda`] and never touches
    /// the address.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of device `ordinal` that the device's primary
    /// context can read (memory allocated by the CUDA runtime, as PyTorch does, qualifies), and
    /// its bytes must be the ones to save when [`Engine::save`](crate::Engine::save) is called
    /// (finish or synchronize the kernels that write them first). They must not be written or
    /// freed until the save's staging is over: until
    /// [`SaveHandle::wait_staged`](crate::SaveHandle::wait_staged) returns (with success or an
    /// error) or the handle is dropped. If `save` returns an error the memory was never read.
    pub unsafe fn from_device(
        name: impl Into<String>,
        dtype: Dtype,
        shape: Vec<u64>,
        ordinal: usize,
        ptr: u64,
        len: usize,
    ) -> crate::Result<Tensor> {
        let name = name.into();
        check_len(&name, dtype, &shape, len)?;
        if ptr == 0 && len > 0 {
            return Err(crate::Error::Tensor {
                name,
                reason: "null device pointer".into(),
            });
        }
        Ok(Tensor {
            name,
            dtype,
            shape,
            data: Data::Device(DevicePtr { ordinal, ptr, len }),
        })
    }

    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The shape (empty for a scalar).
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Size of the data in bytes.
    pub fn byte_len(&self) -> usize {
        match &self.data {
            Data::Owned(b) => b.len(),
            Data::Raw { len, .. } => *len,
            Data::Device(d) => d.len,
        }
    }

    /// The CUDA device ordinal for a device tensor, `None` for host memory.
    pub fn device(&self) -> Option<usize> {
        match &self.data {
            Data::Device(d) => Some(d.ordinal),
            Data::Owned(_) | Data::Raw { .. } => None,
        }
    }

    /// Where the bytes are, read through the raw pointer for borrowed host tensors.
    ///
    /// Only called by the engine while the `from_raw` / `from_device` contract holds.
    pub(crate) fn source(&self) -> Source<'_> {
        match &self.data {
            Data::Owned(b) => Source::Host(b),
            Data::Raw { len: 0, .. } => Source::Host(&[]),
            Data::Raw { ptr, len } => {
                // SAFETY: the `from_raw` contract: valid for reads of `len` bytes and unchanged
                // until staging is over, and the engine calls this only during staging.
                let bytes = unsafe { std::slice::from_raw_parts(*ptr, *len) };
                Source::Host(bytes)
            }
            Data::Device(d) => Source::Device(*d),
        }
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.byte_len())
            .field(
                "data",
                &match &self.data {
                    Data::Owned(_) => "owned".to_string(),
                    Data::Raw { .. } => "borrowed".to_string(),
                    Data::Device(d) => format!("cuda:{}", d.ordinal),
                },
            )
            .finish()
    }
}

fn check_len(name: &str, dtype: Dtype, shape: &[u64], len: usize) -> crate::Result<()> {
    let reason = match byte_len(dtype, shape) {
        Some(n) if n == len as u64 => return Ok(()),
        Some(n) => format!("{dtype} tensor of shape {shape:?} needs {n} bytes, got {len}"),
        None => format!("shape {shape:?} overflows"),
    };
    Err(crate::Error::Tensor {
        name: name.to_string(),
        reason,
    })
}

/// A tensor read back by [`Engine::load`](crate::Engine::load): its bytes are a slice of the
/// verified file buffer, owned and cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct LoadedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Bytes,
}

impl fmt::Debug for LoadedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadedTensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .finish()
    }
}
