//! Verified loads with per-chunk fallback between tiers.
//!
//! 1. **Pick the step.** `Latest` is the newest step complete in any tier (every rank's manifest
//!    present there, this rank's valid); `Step(n)` is `n`.
//! 2. **Collect sources.** Every tier whose manifest of this rank and step parses and matches
//!    job, step and rank is a source; the first one (disk before store) is the reference, and
//!    another tier is only used for chunks when its manifest lists the same file length, chunk
//!    size and chunk hashes (the same bytes).
//! 3. **Check destinations.** Caller and device buffers must name tensors of the manifest and
//!    have their exact lengths; a mismatch fails the load before anything is read.
//! 4. **Read chunks in parallel.** Worker threads (four per configured thread, so reads stay in
//!    flight while others hash) take chunk indices from a shared cursor; for each chunk they try
//!    the sources in order and check its blake3 against the manifest. A chunk that only holds
//!    bytes for the loader's own page-aligned buffer (header, tensors returned owned) is read
//!    straight into its slice of it (io_uring on disk, striped ranged GETs from a store). A
//!    chunk that covers caller buffers goes through a small per-worker bounce buffer: each
//!    256 KiB step is hashed, then copied to its destination while still in cache, so those
//!    bytes are written once, into the caller's memory. A read error or a mismatch is logged
//!    and the next source tried (the chunk is rewritten whole); when none is left the load
//!    fails with [`Error::Corrupt`] naming step, rank and chunk.
//! 5. **Decode.** The verified header is parsed (the same hostile-input parser as everywhere)
//!    and must list exactly the manifest's tensors; the tensors not loaded into caller or device
//!    buffers are handed out as slices of the one buffer.
//! 6. **Device destinations** (feature `cuda`). For [`Destination::Device`] the driver and the
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

    /// `rank`'s manifest of `step`, from the first tier (in load order) that holds a valid one
    /// for this job, step and rank, whatever world size it was written with. This is how a job
    /// reads checkpoints saved by a job of another size: the manifest names the saved world size
    /// and the tensor index, and an engine configured as that rank of that world size loads the
    /// data. Bytes are not verified here; [`Engine::load`] verifies every chunk.
    pub fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        let inner = &self.inner;
        let key = format::manifest_key(&inner.job, step, rank);
        for tier in &inner.tiers {
            let bytes = match tier.get_manifest(&key) {
                Ok(Some(bytes)) => bytes,
                Ok(None) => continue,
                Err(e) => {
                    warn!(step, rank, tier = %tier.kind(), error = %e, "cannot read manifest");
                    continue;
                }
            };
            let location = format!("{key} ({} tier)", tier.kind());
            match Manifest::parse(&bytes, &location) {
                Ok(m) if m.job == inner.job && m.step == step && m.rank == rank => return Ok(m),
                Ok(m) => warn!(
                    step, rank, tier = %tier.kind(),
                    "manifest written for job {:?} step {} rank {}", m.job, m.step, m.rank
                ),
                Err(e) => warn!(step, rank, tier = %tier.kind(), error = %e, "unusable manifest"),
            }
        }
        Err(Error::NotFound {
            job: inner.job.clone(),
            step: Some(step),
            rank,
        })
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
        let data_offset = reference.data_offset as usize;
        let chunk_size = reference.chunk_size as usize;
        let (mut buffers, device) = match dest {
            Destination::Owned => (HashMap::new(), HashMap::new()),
            Destination::Buffers(b) => (b, HashMap::new()),
            Destination::Device(d) => (HashMap::new(), d),
        };
        // Every destination is checked against the manifest before anything is read.
        let range_of = |t: &format::TensorEntry| {
            data_offset + t.data_offsets[0] as usize..data_offset + t.data_offsets[1] as usize
        };
        let entry = |name: &String, have: usize, what: &str| {
            let t = reference
                .tensors
                .iter()
                .find(|t| &t.name == name)
                .ok_or_else(|| Error::Destination {
                    step,
                    name: name.clone(),
                    reason: "no such tensor in the checkpoint".into(),
                })?;
            let want = range_of(t).len();
            if have != want {
                return Err(Error::Destination {
                    step,
                    name: name.clone(),
                    reason: format!("{what} of {have} bytes for {want} bytes"),
                });
            }
            Ok(range_of(t))
        };
        let mut copies = Vec::with_capacity(device.len());
        for (name, out) in &device {
            copies.push((entry(name, out.len(), "device buffer")?, out.0));
        }
        // Caller buffers are filled straight from the chunks that cover them.
        let mut direct: Vec<Vec<(usize, &mut [u8])>> =
            (0..reference.chunks.len()).map(|_| Vec::new()).collect();
        for (name, out) in buffers.iter_mut() {
            let mut at = entry(name, out.len(), "buffer")?.start;
            let mut rest: &mut [u8] = out;
            while !rest.is_empty() {
                let chunk = at / chunk_size;
                let n = ((chunk + 1) * chunk_size - at).min(rest.len());
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                direct[chunk].push((at - chunk * chunk_size, head));
                (at, rest) = (at + n, tail);
            }
        }
        for pieces in &mut direct {
            pieces.sort_unstable_by_key(|(at, _)| *at);
        }
        let mut buf = AlignedBuf::zeroed(len);
        let chunk_sources = self.read_chunks(step, &reference, &tiers, &mut buf[..len], direct)?;
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
        if !copies.is_empty() {
            self.gpu.h2d(&buf, &copies)?;
        }
        let all = Bytes::from_owner(AlignedOwner(buf, len));
        let tensors = reference
            .tensors
            .into_iter()
            .filter(|t| !device.contains_key(&t.name) && !buffers.contains_key(&t.name))
            .map(|t| LoadedTensor {
                data: all.slice(range_of(&t)),
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
            })
            .collect();
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

    /// Fills `buf` with the verified file, chunk by chunk, except the bytes that `direct` sends
    /// to caller buffers instead (per chunk: offset in the chunk and destination, in order);
    /// the tier each chunk came from.
    fn read_chunks(
        &self,
        step: u64,
        m: &Manifest,
        tiers: &[&dyn Tier],
        buf: &mut [u8],
        direct: Vec<Vec<(usize, &mut [u8])>>,
    ) -> Result<Vec<TierKind>> {
        let key = format::data_key(&self.job, step, self.rank);
        let hashes = m.chunk_hashes();
        let chunk_size = m.chunk_size as usize;
        let n = hashes.len();
        let cursor = Mutex::new(buf.chunks_mut(chunk_size.max(1)).zip(direct).enumerate());
        let results: Mutex<Vec<Option<TierKind>>> = Mutex::new(vec![None; n]);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        // More workers than threads: each one waits for its reads, then hashes; with four per
        // thread, enough reads stay in flight while the others hash that reading and verifying
        // overlap instead of taking turns.
        let workers = (4 * self.threads).clamp(1, 32).min(n.max(1));
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    let mut readers: Vec<Option<Box<dyn TierReader + '_>>> =
                        tiers.iter().map(|_| None).collect();
                    let mut bounce = None;
                    loop {
                        if failure.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                            return;
                        }
                        let next = cursor.lock().unwrap_or_else(PoisonError::into_inner).next();
                        let Some((i, (slice, mut pieces))) = next else { return };
                        let offset = m.chunk_range(i).start;
                        let mut last = String::from("no tier has a valid manifest");
                        let mut got = None;
                        for (t, tier) in tiers.iter().enumerate() {
                            let reader = match &mut readers[t] {
                                Some(r) => Ok(r),
                                slot @ None => tier.reader(&key, m.file_len).map(|r| slot.insert(r)),
                            };
                            let res = reader.and_then(|r| {
                                if pieces.is_empty() {
                                    r.read_at(offset, slice).map(|()| blake3::hash(slice))
                                } else {
                                    let bounce = bounce
                                        .get_or_insert_with(|| AlignedBuf::zeroed(BOUNCE));
                                    scatter_chunk(r.as_mut(), offset, slice, &mut pieces, bounce)
                                }
                            });
                            let why = match res {
                                Ok(hash) if hash == hashes[i] => {
                                    got = Some(tier.kind());
                                    break;
                                }
                                Ok(_) => format!("{} tier: checksum mismatch", tier.kind()),
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

/// Bytes of a chunk read at once into a worker's bounce buffer when parts of the chunk go to
/// caller buffers.
const BOUNCE: usize = 8 << 20;
/// Bytes hashed and then copied out while they are still in the CPU's cache.
const HASH_STEP: usize = 256 << 10;

/// Reads the chunk at `offset` (as long as `slice`) through `bounce`, hashing it in file order
/// and copying each byte to its destination: the caller piece that covers it (`pieces`: offset
/// in the chunk and destination, sorted, disjoint), else `slice`. Each step is hashed, then
/// copied while it is still in cache, so the bytes cross memory once on their way to the
/// caller. Returns the chunk's blake3.
fn scatter_chunk(
    r: &mut dyn TierReader,
    offset: u64,
    slice: &mut [u8],
    pieces: &mut [(usize, &mut [u8])],
    bounce: &mut [u8],
) -> Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    let mut piece = 0;
    let mut at = 0;
    while at < slice.len() {
        let n = bounce.len().min(slice.len() - at);
        r.read_at(offset + at as u64, &mut bounce[..n])?;
        for step in bounce[..n].chunks(HASH_STEP) {
            hasher.update(step);
            // Copy `step` (chunk bytes `at..at + step.len()`) out, piece by piece.
            let end = at + step.len();
            while at < end {
                while piece < pieces.len() && pieces[piece].0 + pieces[piece].1.len() <= at {
                    piece += 1;
                }
                let src = &step[step.len() - (end - at)..];
                match pieces.get_mut(piece) {
                    Some((start, dst)) if *start <= at => {
                        let k = (*start + dst.len()).min(end) - at;
                        dst[at - *start..at - *start + k].copy_from_slice(&src[..k]);
                        at += k;
                    }
                    next => {
                        let to = next.map_or(end, |(start, _)| (*start).min(end));
                        slice[at..to].copy_from_slice(&src[..to - at]);
                        at = to;
                    }
                }
            }
        }
    }
    Ok(hasher.finalize())
}
