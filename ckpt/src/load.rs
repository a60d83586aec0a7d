//! Verified loads with per-chunk fallback between tiers.
//!
//! 1. **Pick the step.** `Latest` is the newest step complete in any tier (every rank's manifest
//!    present there, this rank's valid); `Step(n)` is `n`.
//! 2. **Collect sources.** Every tier whose manifest of this rank and step parses and matches
//!    job, step and rank is a source; the first one (disk before store) is the reference, and
//!    another tier is only used for chunks when its manifest lists the same file length, chunk
//!    size and chunk hashes (the same bytes).
//! 3. **Read chunks in parallel.** The file is read into one page-aligned buffer. Worker threads
//!    take chunk indices from a shared cursor; for each chunk they try the sources in order,
//!    reading the chunk's range straight into its slice of the buffer (io_uring on disk, striped
//!    ranged GETs from a store) and checking its blake3 against the manifest. A read error or a
//!    mismatch is logged and the next source tried; when none is left the load fails with
//!    [`Error::Corrupt`] naming step, rank and chunk.
//! 4. **Decode.** The verified header is parsed (the same hostile-input parser as everywhere)
//!    and must list exactly the manifest's tensors; tensors are then handed out as slices of the
//!    one buffer, or copied into the caller's buffers.
//! 5. **Device destinations** (feature `cuda`). For [`Destination::Device`] the driver and the
//!    devices are checked before anything is read; once the file is verified, the buffer is
//!    registered as pinned memory and each tensor is copied host-to-device on the device's copy
//!    stream, then the load waits for the copies (see `crate::cuda`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use hotstart_store::uring::AlignedBuf;
use tracing::{instrument, warn};

use crate::cuda;
use crate::engine::{Engine, Inner};
use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::tensor::{DevicePtr, Extras, LoadedTensor};
use crate::tier::{Tier, TierKind, TierReader};

/// Which step to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSel {
    /// The newest step complete in any tier.
    Latest,
    /// This step.
    Step(u64),
}

/// Where loaded tensors go.
#[derive(Debug, Default)]
pub enum Destination<'a> {
    /// Returned in [`Loaded::tensors`], as slices of one owned buffer.
    #[default]
    Owned,
    /// Copied into these caller buffers (by tensor name; each must have the tensor's exact byte
    /// length). Tensors without a buffer are returned in [`Loaded::tensors`].
    Buffers(HashMap<String, &'a mut [u8]>),
    /// Copied into these CUDA device buffers (by tensor name; each must have the tensor's exact
    /// byte length), from pinned host memory. Needs the `cuda` feature and a driver, else the
    /// load fails with [`Error::Cuda`] before reading anything. Tensors without a buffer are
    /// returned in [`Loaded::tensors`].
    Device(HashMap<String, DeviceBuffer>),
}

/// A CUDA device buffer a load writes a tensor into: device ordinal, device address, length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer(pub(crate) DevicePtr);

impl DeviceBuffer {
    /// `len` bytes at device address `ptr` on device `ordinal` (a `CUdeviceptr`).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of device `ordinal` that the device's primary
    /// context can write (memory allocated by the CUDA runtime, as PyTorch does, qualifies), and
    /// nothing may read, write or free it from the call to [`Engine::load`] until it returns.
    /// Work queued on other streams that uses it must be finished or ordered after the load.
    pub unsafe fn new(ordinal: usize, ptr: u64, len: usize) -> DeviceBuffer {
        DeviceBuffer(DevicePtr { ordinal, ptr, len })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }
}

/// A loaded checkpoint.
#[derive(Debug)]
pub struct Loaded {
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Tensors not copied into caller buffers, in file order.
    pub tensors: Vec<LoadedTensor>,
    pub extras: Extras,
    /// The safetensors `__metadata__`.
    pub metadata: BTreeMap<String, String>,
    /// The tier each chunk was read from.
    pub chunk_sources: Vec<TierKind>,
}

struct AlignedOwner(AlignedBuf, usize);

impl AsRef<[u8]> for AlignedOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0[..self.1]
    }
}

impl Engine {
    /// Loads a step of this rank, verifying every chunk; see the module docs.
    #[instrument(skip_all, fields(rank = self.inner.rank, ?which))]
    pub fn load(&self, which: StepSel, dest: Destination<'_>) -> Result<Loaded> {
        let inner = &self.inner;
        if let Destination::Device(bufs) = &dest {
            let devices: BTreeSet<usize> = bufs.values().map(DeviceBuffer::ordinal).collect();
            if !devices.is_empty() {
                cuda::check_devices(&devices)?;
            }
        }
        let step = match which {
            StepSel::Step(s) => s,
            StepSel::Latest => self
                .latest_complete_step()?
                .ok_or_else(|| Error::NotFound {
                    job: inner.job.clone(),
                    step: None,
                    rank: inner.rank,
                })?,
        };
        inner.load_step(step, dest)
    }
}

impl Inner {
    fn load_step(&self, step: u64, dest: Destination<'_>) -> Result<Loaded> {
        let mut sources: Vec<(&dyn Tier, Manifest)> = Vec::new();
        for tier in &self.tiers {
            match self.read_manifest(tier.as_ref(), step) {
                Ok(Some(m)) => sources.push((tier.as_ref(), m)),
                Ok(None) => {}
                Err(e) => warn!(step, tier = %tier.kind(), error = %e, "unusable manifest"),
            }
        }
        let Some(reference) = sources.first().map(|(_, m)| m.clone()) else {
            return Err(Error::NotFound {
                job: self.job.clone(),
                step: Some(step),
                rank: self.rank,
            });
        };
        sources.retain(|(_, m)| {
            m.file_len == reference.file_len
                && m.chunk_size == reference.chunk_size
                && m.chunks == reference.chunks
        });
        let tiers: Vec<&dyn Tier> = sources.iter().map(|(t, _)| *t).collect();
        let len = usize::try_from(reference.file_len).map_err(|_| {
            Error::format(
                "manifest",
                format!("step {step}"),
                "file larger than the address space",
            )
        })?;
        let mut buf = AlignedBuf::zeroed(len);
        let chunk_sources = self.read_chunks(step, &reference, &tiers, &mut buf[..len])?;
        let location = format::data_key(&self.job, step, self.rank);
        let header = format::parse_header(&buf[..len], reference.file_len, &location)?;
        // Same entries; the header parser orders zero-size tensors that share an offset by
        // name, so compare as sets and keep the manifest's (the writer's) order.
        let mut in_header: HashMap<&str, &format::TensorEntry> = header
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t))
            .collect();
        let same = header.tensors.len() == reference.tensors.len()
            && reference
                .tensors
                .iter()
                .all(|t| in_header.remove(t.name.as_str()) == Some(t));
        if header.data_offset != reference.data_offset || !same {
            return Err(Error::format(
                "safetensors header",
                location,
                "tensor index differs from the manifest's",
            ));
        }
        let extras = reference
            .decode_extras()
            .map_err(|r| Error::format("manifest", format!("step {step}"), r))?;
        let data_offset = header.data_offset as usize;
        let (mut buffers, device) = match dest {
            Destination::Owned => (HashMap::new(), HashMap::new()),
            Destination::Buffers(b) => (b, HashMap::new()),
            Destination::Device(d) => (HashMap::new(), d),
        };
        for name in buffers.keys().chain(device.keys()) {
            if !header.tensors.iter().any(|t| &t.name == name) {
                return Err(Error::Destination {
                    step,
                    name: name.clone(),
                    reason: "no such tensor in the checkpoint".into(),
                });
            }
        }
        let range_of = |t: &format::TensorEntry| {
            data_offset + t.data_offsets[0] as usize..data_offset + t.data_offsets[1] as usize
        };
        if !device.is_empty() {
            let mut copies = Vec::with_capacity(device.len());
            for t in &reference.tensors {
                let Some(out) = device.get(&t.name) else {
                    continue;
                };
                let range = range_of(t);
                if out.len() != range.len() {
                    return Err(Error::Destination {
                        step,
                        name: t.name.clone(),
                        reason: format!(
                            "device buffer of {} bytes for {} bytes",
                            out.len(),
                            range.len()
                        ),
                    });
                }
                copies.push((range, out.0));
            }
            self.gpu.h2d(&buf, &copies)?;
        }
        let all = Bytes::from_owner(AlignedOwner(buf, len));
        let mut tensors = Vec::new();
        for t in reference.tensors {
            let range = range_of(&t);
            if device.contains_key(&t.name) {
                continue;
            }
            if let Some(out) = buffers.get_mut(&t.name) {
                if out.len() != range.len() {
                    return Err(Error::Destination {
                        step,
                        name: t.name,
                        reason: format!("buffer of {} bytes for {} bytes", out.len(), range.len()),
                    });
                }
                out.copy_from_slice(&all[range]);
            } else {
                tensors.push(LoadedTensor {
                    name: t.name,
                    dtype: t.dtype,
                    shape: t.shape,
                    data: all.slice(range),
                });
            }
        }
        Ok(Loaded {
            step,
            rank: self.rank,
            world_size: self.world_size,
            tensors,
            extras,
            metadata: header.metadata,
            chunk_sources,
        })
    }

    /// Fills `buf` with the verified file, chunk by chunk; the tier each chunk came from.
    fn read_chunks(
        &self,
        step: u64,
        m: &Manifest,
        tiers: &[&dyn Tier],
        buf: &mut [u8],
    ) -> Result<Vec<TierKind>> {
        let key = format::data_key(&self.job, step, self.rank);
        let hashes = m.chunk_hashes();
        let chunk_size = m.chunk_size as usize;
        let n = hashes.len();
        let cursor = Mutex::new(buf.chunks_mut(chunk_size.max(1)).enumerate());
        let results: Mutex<Vec<Option<TierKind>>> = Mutex::new(vec![None; n]);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        let workers = self.threads.clamp(1, 8).min(n.max(1));
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    let mut readers: Vec<Option<Box<dyn TierReader + '_>>> =
                        tiers.iter().map(|_| None).collect();
                    loop {
                        if failure.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                            return;
                        }
                        let next = cursor.lock().unwrap_or_else(PoisonError::into_inner).next();
                        let Some((i, slice)) = next else { return };
                        let offset = m.chunk_range(i).start;
                        let mut last = String::from("no tier has a valid manifest");
                        let mut got = None;
                        for (t, tier) in tiers.iter().enumerate() {
                            let res = match &mut readers[t] {
                                Some(r) => r.read_at(offset, slice),
                                slot @ None => tier.reader(&key, m.file_len).and_then(|r| {
                                    slot.insert(r).read_at(offset, slice)
                                }),
                            };
                            let why = match res {
                                Ok(()) if blake3::hash(slice) == hashes[i] => {
                                    got = Some(tier.kind());
                                    break;
                                }
                                Ok(()) => format!("{} tier: checksum mismatch", tier.kind()),
                                Err(e) => format!("{} tier: {e}", tier.kind()),
                            };
                            warn!(step, chunk = i, reason = %why, "chunk unusable; trying the next tier");
                            last = why;
                        }
                        match got {
                            Some(kind) => {
                                results.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(kind)
                            }
                            None => {
                                let mut f = failure.lock().unwrap_or_else(PoisonError::into_inner);
                                if f.is_none() {
                                    *f = Some(Error::Corrupt {
                                        step,
                                        rank: self.rank,
                                        chunk: i,
                                        reason: last,
                                    });
                                }
                                return;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return Err(e);
        }
        let results = results.into_inner().unwrap_or_else(PoisonError::into_inner);
        results
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                k.ok_or_else(|| Error::Corrupt {
                    step,
                    rank: self.rank,
                    chunk: i,
                    reason: "not read".into(),
                })
            })
            .collect()
    }
}
