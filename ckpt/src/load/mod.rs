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
//!    devices are checked before anything is read; each worker reads the device tensors' bytes
//!    into its two pinned bounce buffers ([`DEVICE_BOUNCE`]) and copies them host-to-device on
//!    the device's copy stream while it reads the next window, and the load waits for the last
//!    copies (see `crate::cuda`).
//!
//! Files: this one (what a load is asked for; steps 1, 2 and 5), `targets` (step 3, and the
//! copy into caller buffers), `chunks` (steps 4 and 6: the verified chunk reader, which the
//! sidecar's read-back uses too), `sidecar` (loads through the node's sidecar), `daemon` (what
//! only the sidecar calls).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use hotstart_store::uring::AlignedBuf;
use tracing::{info, warn};

use crate::client::{Client, Handed, Restored};
use crate::cuda::{self, Bounce, Gpu};
use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::inner::Inner;
use crate::persistence::Persistence;
use crate::tensor::{DevicePtr, Extras, LoadedTensor};
use crate::tier::disk::HandedFile;
use crate::tier::{Source, Tier, TierKind, TierReader};
use hotstart_proto::shm::Sealed;

mod chunks;
mod daemon;
mod sidecar;
mod targets;

use chunks::*;
pub(crate) use chunks::{each_parallel, read_chunk};
pub(crate) use targets::*;

/// Which step to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSel {
    /// The newest step complete in any tier.
    Latest,
    /// This step.
    Step(u64),
}

/// Decides where a load's tensors go once the step's manifest is known (see
/// [`Destination::Planned`]). The file is the step's file on this machine, opened for reading,
/// when the load's nearest source keeps one (its disk tier or a local-directory store, or the
/// file a sidecar handed over): a private mapping of it is the buffer for
/// [`Destination::Held`]. It is open only for the call; a mapping keeps the file itself.
pub type Plan<'a> =
    Box<dyn FnOnce(&Manifest, Option<&std::fs::File>) -> Result<Destination<'a>> + Send + 'a>;

/// Where loaded tensors go.
#[derive(Default)]
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
    /// Copied into these caller buffers by byte range: `(tensor, offset, buffer)` takes the
    /// `buffer.len()` bytes of the tensor's bytes from `offset` on (`None`: the whole tensor, of
    /// its exact length, as [`Destination::Buffers`]); a range must lie within its tensor, and a
    /// tensor may have several. For a reader that needs parts of stored tensors (a load that
    /// reshards): each byte is copied once, straight from the verified chunks into place.
    /// Only the chunks that hold the ranges and the file's header are read (through a sidecar,
    /// only those cross the network from a peer), and no tensor is returned in
    /// [`Loaded::tensors`]; [`Loaded::chunk_sources`] lists the chunks read.
    Regions(Vec<(String, Option<u64>, &'a mut [u8])>),
    /// The whole verified file, header included, read into this caller buffer of the file's
    /// exact length ([`Manifest::file_len`]); each tensor's bytes are then at its
    /// [`Manifest::tensor_range`], and [`Loaded::tensors`] is empty. A buffer aligned to 4096
    /// bytes is read into straight from disk (direct I/O, no bounce copy): the fastest way into
    /// new memory that the caller owns, such as the new tensors of a Python state dict.
    File(&'a mut [u8]),
    /// Like [`Destination::File`], for a caller buffer that already holds the file as the
    /// nearest tier keeps it: a private (copy-on-write) mapping of the file a [`Plan`] is
    /// given, as `safetensors` maps its files. Each chunk is verified where it lies, and one
    /// that does not match is read again, from the sources in order, into the buffer; from a
    /// sidecar's memory, the whole file is copied in as for `File`.
    Held(&'a mut [u8]),
    /// Decided by the caller once the step's manifest is known, before any tensor byte is read:
    /// for loading the newest step into buffers shaped after what it holds (new tensors of the
    /// saved shapes and dtypes, say), in one request, however the step is found (through a
    /// sidecar, it is fetched once). The plan may not answer `Planned` again.
    Planned(Plan<'a>),
}

impl std::fmt::Debug for Destination<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Destination::Owned => f.write_str("Owned"),
            Destination::Buffers(b) => f.debug_tuple("Buffers").field(&b.keys()).finish(),
            Destination::Device(d) => f.debug_tuple("Device").field(d).finish(),
            Destination::Regions(r) => f.debug_tuple("Regions").field(&r.len()).finish(),
            Destination::File(b) => f.debug_tuple("File").field(&b.len()).finish(),
            Destination::Held(b) => f.debug_tuple("Held").field(&b.len()).finish(),
            Destination::Planned(_) => f.write_str("Planned"),
        }
    }
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
    /// nothing may read, write or free it from the call to [`Engine::load`](crate::Engine::load)(crate::Engine::load) until it returns.
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
    /// The tier each chunk was read from, in order (of a [`Destination::Regions`] load: each
    /// chunk it read).
    pub chunk_sources: Vec<TierKind>,
    /// How the bytes of device destinations got there; `None` without any.
    pub device_route: Option<DeviceRoute>,
}

/// Who copied a load's bytes into its device buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceRoute {
    /// The node's sidecar, from its own memory, pinned for the device since the step was
    /// committed: no host copy and no pinning in the loading process.
    Sidecar,
    /// This process, through its pinned bounce buffers; `instead_of`: why the sidecar did not,
    /// when the step came from its memory.
    Process { instead_of: Option<String> },
}

impl std::fmt::Display for DeviceRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceRoute::Sidecar => f.write_str("sidecar"),
            DeviceRoute::Process { instead_of: None } => f.write_str("process"),
            DeviceRoute::Process {
                instead_of: Some(why),
            } => write!(f, "process (not the sidecar: {why})"),
        }
    }
}

struct AlignedOwner(AlignedBuf, usize);

impl AsRef<[u8]> for AlignedOwner {
    fn as_ref(&self) -> &[u8] {
        &self.0[..self.1]
    }
}

impl Inner {
    /// `Engine::load`: from the sidecar when there is one (this engine's own tiers only if it
    /// cannot be reached), else from the newest complete step of the own tiers.
    pub(crate) fn load(&self, which: StepSel, dest: Destination<'_>) -> Result<Loaded> {
        let inner = self;
        if let Destination::Device(bufs) = &dest {
            let devices: BTreeSet<usize> = bufs.values().map(DeviceBuffer::ordinal).collect();
            if !devices.is_empty() {
                cuda::check_devices(&devices)?;
            }
        }
        if let Some((sidecar, conn)) = inner.reach_sidecar()? {
            let want = match which {
                StepSel::Latest => None,
                StepSel::Step(s) => Some(s),
            };
            let started = Instant::now();
            let regions = match &dest {
                Destination::Regions(r) => Some(region_list(r)),
                _ => None,
            };
            let restored = sidecar
                .restore(conn, want, true, regions.clone())
                .map_err(|e| inner.saved_by_another_world_says(sidecar, want, e))?;
            return inner.load_restored(sidecar, restored, dest, regions, started);
        }
        let step = match which {
            StepSel::Step(s) => s,
            StepSel::Latest => match inner.core.latest_in_own_tiers_below(None)? {
                Some(step) => step,
                None => {
                    return Err(match inner.core.latest_checkpoint_in_own_tiers(None)? {
                        Some((step, saved)) => inner.core.another_world(step, saved),
                        None => Error::NotFound {
                            job: inner.core.job.clone(),
                            step: None,
                            rank: inner.core.rank,
                        },
                    });
                }
            },
        };
        // A step asked for by number is loaded only if complete, as the newest is: a step
        // some rank never finished is never loaded, whatever this rank wrote.
        let loaded = match which {
            StepSel::Step(_) if !inner.core.complete_in_own_tiers(step)? => Err(Error::NotFound {
                job: inner.core.job.clone(),
                step: Some(step),
                rank: inner.core.rank,
            }),
            _ => inner.load_step(step, dest),
        };
        loaded.map_err(|e| match e {
            Error::NotFound { .. } | Error::Format { .. } => {
                inner.core.saved_by_another_world(step).unwrap_or(e)
            }
            e => e,
        })
    }

    /// `e`, a restore the sidecar refused or found nothing for; or, where the step asked for
    /// (the newest one, for `None`) was saved by another world size, the configuration error
    /// that says so and how to load it, as a load from this engine's own tiers says.
    fn saved_by_another_world_says(&self, sidecar: &Client, want: Option<u64>, e: Error) -> Error {
        if !(e.is_not_found() || matches!(e, Error::Sidecar { .. })) {
            return e;
        }
        let Ok(mut conn) = sidecar.connect() else {
            return e;
        };
        let saved = match want {
            Some(step) => sidecar
                .manifest(&mut conn, step, 0)
                .ok()
                .map(|m| (step, m.world_size)),
            None => sidecar.latest_checkpoint(&mut conn, None).ok().flatten(),
        };
        match saved {
            Some((step, world)) if world != self.core.world_size => {
                self.core.another_world(step, world)
            }
            _ => e,
        }
    }
}

impl Persistence {
    /// `rank`'s manifest of `step` from the first of these tiers that holds a valid one, whatever
    /// world size wrote it (`Engine::manifest`); [`Error::NotFound`] when none does, and
    /// [`Error::Unavailable`] when none does and a tier could not be read.
    pub fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        let inner = self;
        let key = format::manifest_key(&inner.job, step, rank);
        let mut unreadable = None;
        for tier in &inner.tiers {
            let bytes = match tier.get_manifest(&key) {
                Ok(Some(bytes)) => bytes,
                Ok(None) => continue,
                Err(e) => {
                    warn!(step, rank, tier = %tier.kind(), error = %e, "cannot read manifest");
                    if e.is_unreadable() {
                        unreadable.get_or_insert((tier.kind(), e));
                    }
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
        if let Some((tier, e)) = unreadable {
            return Err(Error::unavailable(tier, &inner.job, e));
        }
        Err(Error::NotFound {
            job: inner.job.clone(),
            step: Some(step),
            rank,
        })
    }
}

/// Tiers as the sources a load reads from.
pub(super) fn as_sources<'a>(tiers: &[&'a dyn Tier]) -> Vec<&'a dyn Source> {
    tiers.iter().map(|&t| t as &dyn Source).collect()
}

impl Persistence {
    /// The tiers that hold this rank's `step`, and the reference manifest: every tier whose
    /// manifest parses and matches is a source, the first one is the reference, and another is
    /// kept only when its manifest describes the same bytes.
    pub(crate) fn sources(&self, step: u64) -> Result<(Manifest, Vec<&dyn Tier>)> {
        let mut sources: Vec<(&dyn Tier, Manifest)> = Vec::new();
        let mut unreadable = None;
        for tier in &self.tiers {
            match self.read_manifest(tier.as_ref(), step) {
                Ok(Some(m)) => sources.push((tier.as_ref(), m)),
                Ok(None) => {}
                Err(e) if e.is_unreadable() => {
                    warn!(step, tier = %tier.kind(), error = %e, "cannot read manifest");
                    unreadable.get_or_insert((tier.kind(), e));
                }
                Err(e) => warn!(step, tier = %tier.kind(), error = %e, "unusable manifest"),
            }
        }
        let Some(reference) = sources.first().map(|(_, m)| m.clone()) else {
            // Not found where it could be looked for is not "not found".
            if let Some((tier, e)) = unreadable {
                return Err(Error::unavailable(tier, &self.job, e));
            }
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
        Ok((reference, sources.into_iter().map(|(t, _)| t).collect()))
    }
}

impl Inner {
    pub(super) fn load_step(&self, step: u64, dest: Destination<'_>) -> Result<Loaded> {
        let (reference, tiers) = self.core.sources(step)?;
        self.load_from(step, reference, &as_sources(&tiers), dest)
    }

    /// Loads `step`, described by `reference`, from `tiers` in order, chunk by chunk.
    pub(super) fn load_from(
        &self,
        step: u64,
        reference: Manifest,
        tiers: &[&dyn Source],
        dest: Destination<'_>,
    ) -> Result<Loaded> {
        let len = file_len(&reference)?;
        let key = format::data_key(&self.core.job, step, self.core.rank);
        let near = || tiers.first()?.local_file(&key, reference.file_len);
        let mut targets = targets(step, &reference, dest, &near)?;
        let direct = std::mem::take(&mut targets.direct);
        let only = targets.only.as_deref();
        if let Some((file, held)) = targets.file.take() {
            let chunk_sources = self
                .core
                .read_chunks(&self.gpu, step, &reference, tiers, file, direct, held, only)?;
            return self.finish(step, reference, file, None, targets, chunk_sources);
        }
        let mut buf = AlignedBuf::zeroed(len);
        let chunk_sources = self.core.read_chunks(
            &self.gpu,
            step,
            &reference,
            tiers,
            &mut buf[..len],
            direct,
            false,
            only,
        )?;
        let all = Bytes::from_owner(AlignedOwner(buf, len));
        self.finish(step, reference, &all, Some(&all), targets, chunk_sources)
    }

    /// Decodes a verified `file`: checks its header against the manifest, and hands out the
    /// tensors not loaded into caller or device buffers as slices of `owned` (the same bytes;
    /// None when the caller holds them, and then every tensor is theirs).
    pub(crate) fn finish(
        &self,
        step: u64,
        reference: Manifest,
        file: &[u8],
        owned: Option<&Bytes>,
        targets: Targets<'_>,
        chunk_sources: Vec<TierKind>,
    ) -> Result<Loaded> {
        let location = format::data_key(&self.core.job, step, self.core.rank);
        let header = format::parse_header(file, reference.file_len, &location)?;
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
        let tensors = reference
            .tensors
            .iter()
            .filter(|t| !targets.taken.contains(&t.name))
            .filter_map(|t| {
                Some(LoadedTensor {
                    data: owned?.slice(range_of(&reference, t)),
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                })
            })
            .collect();
        Ok(Loaded {
            step,
            rank: self.core.rank,
            world_size: self.core.world_size,
            tensors,
            extras,
            metadata: header.metadata,
            chunk_sources,
            device_route: targets
                .device
                .then_some(DeviceRoute::Process { instead_of: None }),
        })
    }
}
