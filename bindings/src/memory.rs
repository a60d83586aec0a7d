//! Tensors to save and buffers to load into, described by address and length.
//!
//! The Python layer hands over each tensor as `(name, dtype, shape, address, length, device)`:
//! the address of a contiguous torch tensor (`data_ptr()`) or numpy array
//! (`__array_interface__`), `device` -1 for host memory or the CUDA ordinal. Nothing here can
//! check that an address is real; what can be checked is, before the engine sees anything:
//! lengths against dtype and shape (the engine), null addresses, duplicate names, and overlaps
//! between load destinations (two `&mut` slices over the same bytes would be unsound, and tied
//! weights share memory). The Python layer is the only caller and keeps every object whose memory
//! is described alive for as long as the engine may touch it.

use std::collections::HashMap;
use std::str::FromStr;

use hotstart_ckpt::{DeviceBuffer, Dtype, Tensor};
use pyo3::prelude::*;

use crate::errors::{state_dict, to_py};

/// A tensor to save: name, safetensors dtype, shape, address, byte length, device (-1: host).
#[derive(Debug, FromPyObject)]
pub struct TensorSpec(String, String, Vec<u64>, usize, usize, i64);

/// A buffer to load a tensor into: name, address, byte length, device (-1: host), and the
/// offset in the tensor's bytes of the range it takes (None: the whole tensor; host only).
#[derive(Debug, FromPyObject)]
pub struct DestSpec(pub String, usize, usize, i64, Option<u64>);

impl DestSpec {
    /// Host memory, not a device's.
    pub fn on_host(&self) -> bool {
        self.3 < 0
    }
}

/// The engine dtype named `s` (safetensors spelling).
pub fn dtype(name: &str, s: &str) -> PyResult<Dtype> {
    Dtype::from_str(s).map_err(|e| state_dict(format!("tensor {name:?}: {e}")))
}

fn ordinal(name: &str, device: i64) -> PyResult<Option<usize>> {
    match device {
        -1 => Ok(None),
        d => usize::try_from(d)
            .map(Some)
            .map_err(|_| state_dict(format!("tensor {name:?}: bad device {d}"))),
    }
}

impl TensorSpec {
    /// The engine tensor that borrows this memory.
    ///
    /// # Safety
    /// The address must be valid for reads of `length` bytes (host memory, or device memory of
    /// that CUDA device), and the memory must stay alive and unchanged until the save's staging
    /// is over: the contract of [`Tensor::from_raw`] and [`Tensor::from_device`].
    pub unsafe fn to_tensor(&self) -> PyResult<Tensor> {
        let TensorSpec(name, dt, shape, ptr, len, device) = self;
        let dt = dtype(name, dt)?;
        if *ptr == 0 && *len > 0 {
            return Err(state_dict(format!("tensor {name:?}: null address")));
        }
        let t = match ordinal(name, *device)? {
            // SAFETY: the caller's contract (this function's), as `from_raw` states it.
            None => unsafe { Tensor::from_raw(name, dt, shape.clone(), *ptr as *const u8, *len) },
            // SAFETY: the caller's contract (this function's), as `from_device` states it.
            Some(d) => unsafe {
                Tensor::from_device(name, dt, shape.clone(), d, *ptr as u64, *len)
            },
        };
        t.map_err(to_py)
    }
}

/// What a load plan answers: a buffer per tensor, or one host buffer `(address, length, held)`
/// that takes the whole file (see [`hotstart_ckpt::Destination::File`]; `held`: it is a private
/// mapping of the file a plan is handed, [`hotstart_ckpt::Destination::Held`]).
#[derive(Debug, FromPyObject)]
pub enum Answer {
    Tensors(Vec<DestSpec>),
    File(usize, usize, bool),
}

/// Load destinations by name, split into host slices (each with the offset of the range of
/// its tensor it takes, or None for the whole tensor) and device buffers, or the one buffer for
/// the whole file (and whether it holds the file already).
pub struct Borrowed<'a> {
    pub host: Vec<(String, Option<u64>, &'a mut [u8])>,
    pub device: HashMap<String, DeviceBuffer>,
    pub file: Option<(&'a mut [u8], bool)>,
}

/// Load destinations as Python described them, checked.
pub struct Dests(Answer);

impl Dests {
    /// Checks names, null addresses and overlaps.
    pub fn check(answer: Answer) -> PyResult<Dests> {
        let dests = match answer {
            Answer::File(ptr, len, _) => {
                if ptr == 0 && len > 0 {
                    return Err(state_dict(
                        "the buffer for the whole file has a null address",
                    ));
                }
                return Ok(Dests(answer));
            }
            Answer::Tensors(dests) => dests,
        };
        let mut names = std::collections::HashSet::new();
        let mut ranges: Vec<(i64, usize, usize, &str)> = Vec::new();
        for DestSpec(name, ptr, len, device, offset) in &dests {
            if offset.is_none() && !names.insert(name.as_str()) {
                return Err(state_dict(format!("two destinations for tensor {name:?}")));
            }
            if offset.is_some() && *device >= 0 {
                return Err(state_dict(format!(
                    "destination of {name:?}: a range of a tensor loads into host memory only"
                )));
            }
            if *ptr == 0 && *len > 0 {
                return Err(state_dict(format!("destination of {name:?}: null address")));
            }
            ordinal(name, *device)?;
            if *len > 0 {
                ranges.push((*device, *ptr, *len, name));
            }
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            let ((da, pa, la, na), (db, pb, _, nb)) = (w[0], w[1]);
            if da == db && pa.checked_add(la).is_none_or(|end| end > pb) {
                return Err(state_dict(format!(
                    "destinations of {na:?} and {nb:?} share memory; load into one and copy"
                )));
            }
        }
        Ok(Dests(Answer::Tensors(dests)))
    }

    /// The destinations as the engine takes them.
    ///
    /// # Safety
    /// Every host address must be valid for writes of its length and nothing else may read or
    /// write that memory while the returned slices live; every device address must satisfy
    /// [`DeviceBuffer::new`]. (`check` made sure no two destinations overlap.)
    pub unsafe fn borrow(&mut self) -> Borrowed<'_> {
        let mut host = Vec::new();
        let mut device = HashMap::new();
        let dests = match &self.0 {
            Answer::File(ptr, len, held) => {
                let file: &mut [u8] = if *len == 0 {
                    &mut []
                } else {
                    // SAFETY: the caller's contract: valid for writes of `len` bytes and used by
                    // nobody else.
                    unsafe { std::slice::from_raw_parts_mut(*ptr as *mut u8, *len) }
                };
                return Borrowed {
                    host,
                    device,
                    file: Some((file, *held)),
                };
            }
            Answer::Tensors(dests) => dests,
        };
        for DestSpec(name, ptr, len, dev, offset) in dests {
            if *dev >= 0 {
                // SAFETY: the caller's contract; `check` made sure the ordinal is not negative.
                let b = unsafe { DeviceBuffer::new(*dev as usize, *ptr as u64, *len) };
                device.insert(name.clone(), b);
            } else if *len == 0 {
                host.push((name.clone(), *offset, &mut [][..]));
            } else {
                // SAFETY: the caller's contract: valid for writes of `len` bytes, used by nobody
                // else, and disjoint from every other destination (checked in `check`).
                let s = unsafe { std::slice::from_raw_parts_mut(*ptr as *mut u8, *len) };
                host.push((name.clone(), *offset, s));
            }
        }
        Borrowed {
            host,
            device,
            file: None,
        }
    }
}
