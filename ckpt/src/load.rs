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
use crate::inner::{Inner, another_world};
use crate::proto::shm::Sealed;
use crate::tensor::{DevicePtr, Extras, LoadedTensor};
use crate::tier::disk::HandedFile;
use crate::tier::{Source, Tier, TierKind, TierReader};

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
    /// The tier each chunk was read from.
    pub chunk_sources: Vec<TierKind>,
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
        if let Some(sidecar) = &inner.sidecar {
            match sidecar.connect() {
                Ok(conn) => {
                    let want = match which {
                        StepSel::Latest => None,
                        StepSel::Step(s) => Some(s),
                    };
                    let started = Instant::now();
                    let restored = sidecar.restore(conn, want, true)?;
                    return inner.load_restored(sidecar, restored, dest, started);
                }
                Err(e) if inner.tiers.is_empty() => return Err(e),
                Err(e) => {
                    warn!(error = %e, "sidecar unreachable; loading from this engine's own tiers")
                }
            }
        }
        let step = match which {
            StepSel::Step(s) => s,
            StepSel::Latest => match inner.latest_in_own_tiers_below(None)? {
                Some(step) => step,
                None => {
                    return Err(match inner.latest_checkpoint_in_own_tiers(None)? {
                        Some((step, saved)) => {
                            another_world(&inner.job, step, saved, inner.rank, inner.world_size)
                        }
                        None => Error::NotFound {
                            job: inner.job.clone(),
                            step: None,
                            rank: inner.rank,
                        },
                    });
                }
            },
        };
        inner.load_step(step, dest).map_err(|e| match e {
            Error::NotFound { .. } | Error::Format { .. } => {
                inner.saved_by_another_world(step).unwrap_or(e)
            }
            e => e,
        })
    }

    /// `Engine::manifest`.
    pub(crate) fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
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

/// Where a load puts each byte: the destinations, checked against the manifest.
pub(crate) struct Targets<'a> {
    /// Per chunk: the caller and device buffers it covers (offset in the chunk, destination),
    /// sorted.
    pub(crate) direct: Vec<Vec<(usize, Out<'a>)>>,
    /// Tensors not returned owned (they went to caller or device buffers).
    taken: HashSet<String>,
    /// The caller buffer that takes the whole file ([`Destination::File`]), and whether it
    /// already holds the nearest tier's bytes ([`Destination::Held`]).
    file: Option<(&'a mut [u8], bool)>,
}

/// Where a piece of a chunk goes: caller memory, or device memory (copied from a pinned
/// [`Bounce`] buffer).
pub(crate) enum Out<'a> {
    Host(&'a mut [u8]),
    Device(DevicePtr),
}

impl<'a> Out<'a> {
    fn len(&self) -> usize {
        match self {
            Out::Host(b) => b.len(),
            Out::Device(d) => d.len,
        }
    }

    /// The first `n` bytes, and the rest.
    fn split_at(self, n: usize) -> (Out<'a>, Out<'a>) {
        match self {
            Out::Host(b) => {
                let (head, tail) = b.split_at_mut(n);
                (Out::Host(head), Out::Host(tail))
            }
            Out::Device(d) => (
                Out::Device(DevicePtr { len: n, ..d }),
                Out::Device(DevicePtr {
                    ptr: d.ptr + n as u64,
                    len: d.len - n,
                    ..d
                }),
            ),
        }
    }
}

/// The device whose pinned buffers a load with these pieces copies through, if any piece goes
/// to device memory.
fn device_of<'p, 'a: 'p>(pieces: impl IntoIterator<Item = &'p Out<'a>>) -> Option<usize> {
    pieces.into_iter().find_map(|o| match o {
        Out::Device(d) => Some(d.ordinal),
        Out::Host(_) => None,
    })
}

/// One worker's two bounce buffers, one filled while the other is copied out: pinned ones of
/// [`DEVICE_BOUNCE`] when device memory is written, else halves of [`BOUNCE`].
fn bounces(gpu: &Gpu, device: Option<usize>) -> Vec<Bounce> {
    (0..2)
        .map(|_| match device {
            Some(ordinal) => Bounce::pinned(gpu, ordinal, DEVICE_BOUNCE),
            None => Bounce::host(BOUNCE / 2),
        })
        .collect()
}

/// Waits for the copies from every bounce buffer; the first error, if any.
fn drain(bounces: &mut [Bounce]) -> Result<()> {
    bounces
        .iter_mut()
        .map(Bounce::wait)
        .fold(Ok(()), Result::and)
}

/// The file range of a tensor's bytes.
fn range_of(m: &Manifest, t: &format::TensorEntry) -> Range<usize> {
    let r = m.tensor_range(t);
    r.start as usize..r.end as usize
}

/// The file length of `m` as a buffer length.
pub(crate) fn file_len(m: &Manifest) -> Result<usize> {
    usize::try_from(m.file_len).map_err(|_| {
        Error::format(
            "manifest",
            format!("step {}", m.step),
            "file larger than the address space",
        )
    })
}

/// The targets of a load of the whole file into `file` ([`Destination::File`], or
/// [`Destination::Held`] when `held`), which must have the file's length.
fn whole_file<'a>(
    step: u64,
    reference: &Manifest,
    file: &'a mut [u8],
    held: bool,
) -> Result<Targets<'a>> {
    let want = file_len(reference)?;
    if file.len() != want {
        return Err(Error::Destination {
            step,
            name: "(the whole file)".into(),
            reason: format!("buffer of {} bytes for {want} bytes", file.len()),
        });
    }
    Ok(Targets {
        direct: (0..reference.chunks.len()).map(|_| Vec::new()).collect(),
        taken: reference.tensors.iter().map(|t| t.name.clone()).collect(),
        file: Some((file, held)),
    })
}

/// Checks every destination against `reference` before anything is read: each must name a
/// tensor of the manifest and have its exact length. A plan is given `near()`, the step's file
/// on this machine if any.
pub(crate) fn targets<'a>(
    step: u64,
    reference: &Manifest,
    dest: Destination<'a>,
    near: &dyn Fn() -> Option<std::fs::File>,
) -> Result<Targets<'a>> {
    let chunk_size = reference.chunk_size as usize;
    let (buffers, device) = match dest {
        Destination::Owned => (HashMap::new(), HashMap::new()),
        Destination::Buffers(b) => (b, HashMap::new()),
        Destination::File(file) => return whole_file(step, reference, file, false),
        Destination::Held(file) => return whole_file(step, reference, file, true),
        Destination::Device(d) => {
            let devices: BTreeSet<usize> = d.values().map(DeviceBuffer::ordinal).collect();
            if !devices.is_empty() {
                cuda::check_devices(&devices)?;
            }
            (HashMap::new(), d)
        }
        Destination::Planned(plan) => match plan(reference, near().as_ref())? {
            Destination::Planned(_) => {
                return Err(Error::Task {
                    what: "load",
                    message: "a load plan answered with another plan".into(),
                });
            }
            dest => return targets(step, reference, dest, &|| None),
        },
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
        let want = range_of(reference, t).len();
        if have != want {
            return Err(Error::Destination {
                step,
                name: name.clone(),
                reason: format!("{what} of {have} bytes for {want} bytes"),
            });
        }
        Ok(range_of(reference, t))
    };
    // Caller and device buffers are filled straight from the chunks that cover them.
    let mut direct: Vec<Vec<(usize, Out<'a>)>> =
        (0..reference.chunks.len()).map(|_| Vec::new()).collect();
    let mut taken = HashSet::new();
    let outs = buffers
        .into_iter()
        .map(|(name, b)| (name, Out::Host(b), "buffer"))
        .chain(
            device
                .into_iter()
                .map(|(name, d)| (name, Out::Device(d.0), "device buffer")),
        );
    for (name, out, what) in outs {
        let mut at = entry(&name, out.len(), what)?.start;
        taken.insert(name);
        let mut rest = out;
        while rest.len() > 0 {
            let chunk = at / chunk_size;
            let n = ((chunk + 1) * chunk_size - at).min(rest.len());
            let (head, tail) = rest.split_at(n);
            direct[chunk].push((at - chunk * chunk_size, head));
            (at, rest) = (at + n, tail);
        }
    }
    for pieces in &mut direct {
        pieces.sort_unstable_by_key(|(at, _)| *at);
    }
    Ok(Targets {
        direct,
        taken,
        file: None,
    })
}

impl Inner {
    /// `Engine::read_into`.
    pub(crate) fn read_into<B: AsMut<[u8]>, E: From<Error>>(
        &self,
        step: u64,
        alloc: impl FnOnce(usize, TierKind) -> std::result::Result<B, E>,
    ) -> std::result::Result<(Manifest, B, Vec<TierKind>), E> {
        let inner = self;
        let (manifest, tiers) = inner.sources(step)?;
        let tiers = as_sources(&tiers);
        let len = file_len(&manifest)?;
        let mut buf = alloc(len, tiers[0].kind())?;
        let direct = (0..manifest.chunks.len()).map(|_| Vec::new()).collect();
        let sources = inner.read_chunks(
            step,
            &manifest,
            &tiers,
            &mut buf.as_mut()[..len],
            direct,
            false,
        )?;
        Ok((manifest, buf, sources))
    }
}

impl Inner {
    /// Hands out a step the sidecar restored: from its segment ([`Inner::load_segment`]), or
    /// from a file of its disk, loaded as from a tier and verified chunk by chunk; a chunk of
    /// the file that does not match is taken from a segment the sidecar makes of the step after
    /// all ([`SidecarCopy`]), from its disk and store.
    fn load_restored(
        &self,
        sidecar: &Client,
        restored: Restored,
        dest: Destination<'_>,
        started: Instant,
    ) -> Result<Loaded> {
        let Restored {
            manifest: m,
            handed,
            chunk_sources,
            source,
            seconds,
        } = restored;
        let step = m.step;
        let (loaded, handed) = match handed {
            Handed::Segment(segment) => (
                self.load_segment(sidecar, m, segment, dest, chunk_sources)?,
                "segment",
            ),
            Handed::File(file) => {
                let key = format::data_key(&self.job, step, self.rank);
                let label = format!("{key} (the sidecar's {source} tier)");
                let file = HandedFile::new(file, label.into(), source, self.uring.clone());
                let copy = SidecarCopy {
                    sidecar,
                    step,
                    got: OnceLock::new(),
                };
                (self.load_from(step, m, &[&file, &copy], dest)?, "file")
            }
        };
        info!(
            step,
            %source,
            handed,
            sidecar_seconds = seconds,
            seconds = started.elapsed().as_secs_f64(),
            "restored through the sidecar"
        );
        Ok(loaded)
    }

    /// Hands out a step from the sidecar's sealed segment: caller buffers are filled with one
    /// parallel copy straight from the segment's pages (`pread`, so the mapping's pages are
    /// never faulted in for them); tensors returned owned are views of the mapping itself,
    /// valid however long they are kept. The bytes are not hashed again (see [`Handed`]).
    fn load_segment(
        &self,
        sidecar: &Client,
        m: Manifest,
        segment: Arc<Sealed>,
        dest: Destination<'_>,
        chunk_sources: Vec<TierKind>,
    ) -> Result<Loaded> {
        let (step, len) = (m.step, file_len(&m)?);
        let mut targets = targets(step, &m, dest, &|| None)?;
        let mut direct = std::mem::take(&mut targets.direct);
        if let Some((file, _)) = targets.file.take() {
            // The whole file goes to the caller: every chunk is one piece.
            direct = file
                .chunks_mut((m.chunk_size as usize).max(1))
                .map(|c| vec![(0, Out::Host(c))])
                .collect();
        }
        let read = |at, dst: &mut [u8]| {
            segment.read_at(at, dst).map_err(|e| Error::Sidecar {
                socket: sidecar.socket().display().to_string(),
                reason: format!("read the restored segment: {e}"),
            })
        };
        copy_out(
            &read,
            direct,
            m.chunk_size as usize,
            self.threads,
            &self.gpu,
        )?;
        let all = Bytes::from_owner(SealedBytes(segment, len));
        self.finish(step, m, &all, Some(&all), targets, chunk_sources)
    }
}

struct SealedBytes(Arc<Sealed>, usize);

impl AsRef<[u8]> for SealedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes()[..self.1]
    }
}

/// The source a load of a file the sidecar handed over falls back to, chunk by chunk: the
/// step as a segment the sidecar makes when first asked (from its disk and store, verified).
struct SidecarCopy<'a> {
    sidecar: &'a Client,
    step: u64,
    /// The segment and the tier the sidecar took it from, or why there is none.
    got: OnceLock<std::result::Result<(Arc<Sealed>, TierKind), String>>,
}

impl SidecarCopy<'_> {
    fn error(&self, reason: String) -> Error {
        Error::Sidecar {
            socket: self.sidecar.socket().display().to_string(),
            reason,
        }
    }

    fn segment(&self) -> Result<&Sealed> {
        let fetch = || -> Result<(Arc<Sealed>, TierKind)> {
            let conn = self.sidecar.connect()?;
            let restored = self.sidecar.restore(conn, Some(self.step), false)?;
            match restored.handed {
                Handed::Segment(s) => Ok((s, restored.source)),
                Handed::File(_) => Err(self.error("handed a file when asked for a segment".into())),
            }
        };
        match self.got.get_or_init(|| fetch().map_err(|e| e.to_string())) {
            Ok((segment, _)) => Ok(segment),
            Err(reason) => Err(self.error(format!("step {} from its memory: {reason}", self.step))),
        }
    }
}

impl Source for SidecarCopy<'_> {
    fn kind(&self) -> TierKind {
        match self.got.get() {
            Some(Ok((_, kind))) => *kind,
            _ => TierKind::Memory,
        }
    }

    fn reader(&self, _key: &str, len: u64) -> Result<Box<dyn TierReader + '_>> {
        let segment = self.segment()?;
        if (segment.bytes().len() as u64) < len {
            let have = segment.bytes().len();
            return Err(self.error(format!("a segment of {have} bytes for a {len}-byte step")));
        }
        Ok(Box::new(SegmentReader(segment, self)))
    }
}

/// Reads the sealed segment of a [`SidecarCopy`].
struct SegmentReader<'a>(&'a Sealed, &'a SidecarCopy<'a>);

impl TierReader for SegmentReader<'_> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.0
            .read_at(offset, buf)
            .map_err(|e| self.1.error(format!("read the restored segment: {e}")))
    }
}

/// Tiers as the sources a load reads from.
fn as_sources<'a>(tiers: &[&'a dyn Tier]) -> Vec<&'a dyn Source> {
    tiers.iter().map(|&t| t as &dyn Source).collect()
}

impl Inner {
    /// The manifest, file and tier of `step` where the tier a load would take as its reference
    /// keeps local files and the file has the manifest's length.
    fn local_step(&self, step: u64) -> Option<(Manifest, std::path::PathBuf, TierKind)> {
        let key = format::data_key(&self.job, step, self.rank);
        for tier in &self.tiers {
            // A tier that is not local ends the search before its manifest is read (a round
            // trip to a remote store): it would be the reference if it holds the step.
            let path = tier.local_path(&key)?;
            if let Ok(Some(m)) = self.read_manifest(tier.as_ref(), step) {
                let len = std::fs::metadata(&path).ok()?.len();
                return (len == m.file_len).then_some((m, path, tier.kind()));
            }
        }
        None
    }

    /// `Engine::open_local_file`.
    pub(crate) fn open_local_file(
        &self,
        step: u64,
    ) -> Result<Option<(Manifest, std::fs::File, TierKind)>> {
        let Some((m, path, kind)) = self.local_step(step) else {
            return Ok(None);
        };
        let file = hotstart_store::uring::open_for_reading(&path, &self.uring)
            .map_err(|e| Error::store("open", path.display().to_string(), e))?;
        Ok(Some((m, file, kind)))
    }

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

    fn load_step(&self, step: u64, dest: Destination<'_>) -> Result<Loaded> {
        let (reference, tiers) = self.sources(step)?;
        self.load_from(step, reference, &as_sources(&tiers), dest)
    }

    /// Loads `step`, described by `reference`, from `tiers` in order, chunk by chunk.
    fn load_from(
        &self,
        step: u64,
        reference: Manifest,
        tiers: &[&dyn Source],
        dest: Destination<'_>,
    ) -> Result<Loaded> {
        let len = file_len(&reference)?;
        let key = format::data_key(&self.job, step, self.rank);
        let near = || tiers.first()?.local_file(&key, reference.file_len);
        let mut targets = targets(step, &reference, dest, &near)?;
        let direct = std::mem::take(&mut targets.direct);
        if let Some((file, held)) = targets.file.take() {
            let chunk_sources = self.read_chunks(step, &reference, tiers, file, direct, held)?;
            return self.finish(step, reference, file, None, targets, chunk_sources);
        }
        let mut buf = AlignedBuf::zeroed(len);
        let chunk_sources =
            self.read_chunks(step, &reference, tiers, &mut buf[..len], direct, false)?;
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
        let location = format::data_key(&self.job, step, self.rank);
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
            rank: self.rank,
            world_size: self.world_size,
            tensors,
            extras,
            metadata: header.metadata,
            chunk_sources,
        })
    }

    /// Fills `buf` with the verified file, chunk by chunk, except the bytes that `direct` sends
    /// to caller or device buffers instead (per chunk: offset in the chunk and destination, in
    /// order); the tier each chunk came from. Returns once every copy to a device is done.
    pub(crate) fn read_chunks(
        &self,
        step: u64,
        m: &Manifest,
        tiers: &[&dyn Source],
        buf: &mut [u8],
        direct: Vec<Vec<(usize, Out<'_>)>>,
        held: bool,
    ) -> Result<Vec<TierKind>> {
        let key = format::data_key(&self.job, step, self.rank);
        let hashes = m.chunk_hashes();
        let chunk_size = m.chunk_size as usize;
        let n = hashes.len();
        let device = device_of(direct.iter().flatten().map(|(_, o)| o));
        let cursor = Mutex::new(buf.chunks_mut(chunk_size.max(1)).zip(direct).enumerate());
        let results: Mutex<Vec<Option<TierKind>>> = Mutex::new(vec![None; n]);
        let failure: Mutex<Option<Error>> = Mutex::new(None);
        // More workers than threads: each one hashes a window while its next one is read, and
        // with many of them the disk always has reads queued while the others hash. Eight per
        // thread for reads into host memory (a cold 4 GiB load into caller tensors on two cores
        // went from 0.90× to 0.94× fio's read with four); four where each worker pins its two
        // buffers afresh (device loads), or where the kernel's read-ahead does the reading (a
        // held file: eight ran slower there).
        let per_thread = if device.is_some() || held { 4 } else { 8 };
        let workers = (per_thread * self.threads).clamp(1, 32).min(n.max(1));
        let fail = |e: Error| {
            let mut f = failure.lock().unwrap_or_else(PoisonError::into_inner);
            if f.is_none() {
                *f = Some(e);
            }
        };
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    let mut readers: Vec<Option<Box<dyn TierReader + '_>>> =
                        tiers.iter().map(|_| None).collect();
                    let mut bounce: Vec<Bounce> = Vec::new();
                    loop {
                        if failure.lock().unwrap_or_else(PoisonError::into_inner).is_some() {
                            break;
                        }
                        let next = cursor.lock().unwrap_or_else(PoisonError::into_inner).next();
                        let Some((i, (slice, mut pieces))) = next else { break };
                        let offset = m.chunk_range(i).start;
                        let mut last = String::from("no tier has a valid manifest");
                        let mut got = None;
                        if held && pieces.is_empty() {
                            // The caller's buffer holds the nearest tier's bytes already.
                            read_ahead(slice);
                            if blake3::hash(slice) == hashes[i] {
                                got = tiers.first().map(|t| t.kind());
                            } else {
                                warn!(step, chunk = i, "chunk held in memory unusable (checksum mismatch); reading it again");
                            }
                        }
                        let to_try = if got.is_some() { &tiers[..0] } else { tiers };
                        for (t, tier) in to_try.iter().enumerate() {
                            let reader = match &mut readers[t] {
                                Some(r) => Ok(r),
                                slot @ None => tier.reader(&key, m.file_len).map(|r| slot.insert(r)),
                            };
                            let res = reader.and_then(|r| {
                                if pieces.is_empty() {
                                    read_chunk(r.as_mut(), offset, slice)
                                } else {
                                    if bounce.is_empty() {
                                        bounce = bounces(&self.gpu, device);
                                    }
                                    scatter_chunk(
                                        r.as_mut(),
                                        offset,
                                        slice,
                                        &mut pieces,
                                        &mut bounce,
                                        &self.gpu,
                                    )
                                }
                            });
                            let why = match res {
                                Ok(hash) if hash == hashes[i] => {
                                    got = Some(tier.kind());
                                    break;
                                }
                                // The device, not the tier, failed: no other tier helps.
                                Err(e @ Error::Cuda { .. }) => {
                                    fail(e);
                                    return;
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
                                fail(Error::Corrupt {
                                    step,
                                    rank: self.rank,
                                    chunk: i,
                                    reason: last,
                                });
                                break;
                            }
                        }
                    }
                    if let Err(e) = drain(&mut bounce) {
                        fail(e);
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

/// Starts reading in the pages of `buf`, part of a file mapping, ahead of their first touch
/// (advice only; errors are ignored).
fn read_ahead(buf: &[u8]) {
    let addr = buf.as_ptr() as usize;
    let (start, end) = (addr.next_multiple_of(4096), addr + buf.len());
    if end > start {
        // SAFETY: MADV_WILLNEED only schedules reads into the page cache for whole pages inside
        // `buf`; it changes no contents and no mapping.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_WILLNEED) };
    }
}

/// Fills the caller and device buffer pieces of a verified file (per chunk: offset in the chunk
/// and destination, as [`Targets::direct`]) with `read` (file offset, destination), over
/// `threads` threads, in pieces of at most [`BOUNCE`] bytes ([`DEVICE_BOUNCE`] for device
/// memory) so one huge tensor is spread over every thread. Device pieces are read into a
/// thread's pinned bounce buffers and copied from there; returns once those copies are done.
pub(crate) fn copy_out(
    read: &(dyn Fn(u64, &mut [u8]) -> Result<()> + Sync),
    direct: Vec<Vec<(usize, Out<'_>)>>,
    chunk_size: usize,
    threads: usize,
    gpu: &Gpu,
) -> Result<()> {
    let device = device_of(direct.iter().flatten().map(|(_, o)| o));
    let mut jobs: Vec<(usize, Out<'_>)> = Vec::new();
    for (chunk, pieces) in direct.into_iter().enumerate() {
        for (at, mut rest) in pieces {
            let mut start = chunk * chunk_size + at;
            let most = match rest {
                Out::Host(_) => BOUNCE,
                Out::Device(_) => DEVICE_BOUNCE,
            };
            while rest.len() > 0 {
                let n = rest.len().min(most);
                let (part, tail) = rest.split_at(n);
                jobs.push((start, part));
                (start, rest) = (start + n, tail);
            }
        }
    }
    let bytes: usize = jobs.iter().map(|(_, d)| d.len()).sum();
    let threads = if bytes < (1 << 20) {
        1
    } else {
        threads.clamp(1, jobs.len().max(1))
    };
    let jobs = Mutex::new(jobs.into_iter());
    let failed: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|scope| {
        let work = || {
            let mut bounce: Vec<Bounce> = Vec::new();
            let mut turn = 0;
            let mut run = || -> Result<()> {
                loop {
                    if failed
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_some()
                    {
                        return Ok(());
                    }
                    let next = jobs.lock().unwrap_or_else(PoisonError::into_inner).next();
                    match next {
                        None => return Ok(()),
                        Some((start, Out::Host(dst))) => read(start as u64, dst)?,
                        Some((start, Out::Device(d))) => {
                            if bounce.is_empty() {
                                bounce = bounces(gpu, device);
                            }
                            turn = (turn + 1) % bounce.len();
                            let b = &mut bounce[turn];
                            read(start as u64, &mut b.get()?[..d.len])?;
                            b.upload(gpu, &[(0..d.len, d)])?;
                        }
                    }
                }
            };
            let res = run().and(drain(&mut bounce));
            if let Err(e) = res {
                failed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(e);
            }
        };
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    match failed.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Bytes of a chunk read at once into a worker's bounce buffer when parts of the chunk go to
/// caller buffers.
const BOUNCE: usize = 8 << 20;
/// Bytes of each of a worker's two pinned bounce buffers for device memory: one huge page. Every
/// load pins its buffers afresh, so a restarted process's first load pays for faulting them in
/// and registering them. Two of 2 MiB per worker keep the copy engine busy at a quarter of what
/// two of 8 MiB cost (a restore from the sidecar's memory on an H200, 16 threads: 0.115 s
/// against 0.20 s). Smaller ones lose: 1 MiB buffers, below a huge page, ran the same restore in
/// 0.24 s and a disk-tier load 1.6x slower.
const DEVICE_BOUNCE: usize = 2 << 20;
/// Bytes hashed and then copied out while they are still in the CPU's cache.
const HASH_STEP: usize = 256 << 10;
/// Bytes of a chunk read as one window when the chunk goes straight into its buffer: the first
/// window is hashed while the next ones are read.
const WINDOW: usize = 4 << 20;

/// Reads the chunk at `offset` straight into `slice`, hashing each window as soon as it is in
/// while the next ones are read. Returns the chunk's blake3.
fn read_chunk(r: &mut dyn TierReader, offset: u64, slice: &mut [u8]) -> Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    let len = slice.len();
    let mut windows: Vec<&mut [u8]> = slice.chunks_mut(WINDOW).collect();
    r.read_windows(offset, len, &mut windows, &mut |w| {
        hasher.update(w);
        Ok(())
    })?;
    Ok(hasher.finalize())
}

/// One chunk on its way out: hashed in file order, each byte sent to the caller or device piece
/// that covers it (`pieces`: offset in the chunk and destination, sorted, disjoint), else to the
/// chunk's `slice`.
struct Scatter<'s, 'p, 'o> {
    slice: &'s mut [u8],
    pieces: &'p mut [(usize, Out<'o>)],
    /// The first piece that may cover `at`.
    piece: usize,
    /// Bytes of the chunk sent out so far.
    at: usize,
    hasher: blake3::Hasher,
    /// Per copy to a device: the range of the current window, the device memory, and the piece
    /// it belongs to; started by the caller once the window is taken.
    uploads: Vec<(Range<usize>, DevicePtr, usize)>,
}

impl Scatter<'_, '_, '_> {
    /// Takes the chunk's next bytes: hashes `window` a step at a time and copies each step out
    /// while it is still in cache, so the bytes cross memory once on their way to the caller.
    /// Device pieces are queued in `uploads` instead.
    fn take(&mut self, window: &[u8]) {
        let start = self.at;
        for step in window.chunks(HASH_STEP) {
            self.hasher.update(step);
            let end = self.at + step.len();
            while self.at < end {
                let at = self.at;
                let pieces = &mut *self.pieces;
                while self.piece < pieces.len()
                    && pieces[self.piece].0 + pieces[self.piece].1.len() <= at
                {
                    self.piece += 1;
                }
                let src = &step[step.len() - (end - at)..];
                match pieces.get_mut(self.piece) {
                    Some((first, dst)) if *first <= at => {
                        let k = (*first + dst.len()).min(end) - at;
                        match dst {
                            Out::Host(dst) => crate::memcopy::copy_cold(
                                &mut dst[at - *first..at - *first + k],
                                &src[..k],
                            ),
                            Out::Device(d) => {
                                let from = at - start..at - start + k;
                                let to = DevicePtr {
                                    ptr: d.ptr + (at - *first) as u64,
                                    len: k,
                                    ..*d
                                };
                                match self.uploads.last_mut() {
                                    // The same piece, contiguous: one copy. Never across
                                    // pieces: adjacent addresses may be two allocations, and
                                    // one copy may not span them.
                                    Some((r, p, of))
                                        if *of == self.piece && r.end == from.start =>
                                    {
                                        r.end = from.end;
                                        p.len += k;
                                    }
                                    _ => self.uploads.push((from, to, self.piece)),
                                }
                            }
                        }
                        self.at += k;
                    }
                    next => {
                        let to = next.map_or(end, |(first, _)| (*first).min(end));
                        self.slice[at..to].copy_from_slice(&src[..to - at]);
                        self.at = to;
                    }
                }
            }
        }
    }
}

/// Reads the chunk at `offset` (as long as `slice`) a window at a time through the bounce
/// buffers and sends it out through a [`Scatter`]. Host memory only: two windows, one read while
/// the other is hashed and copied out. With device pieces: two pinned bounce buffers taking
/// turns, one filled while the device's copy engine copies from the other. Returns the chunk's
/// blake3.
fn scatter_chunk(
    r: &mut dyn TierReader,
    offset: u64,
    slice: &mut [u8],
    pieces: &mut [(usize, Out<'_>)],
    bounces: &mut [Bounce],
    gpu: &Gpu,
) -> Result<blake3::Hash> {
    let len = slice.len();
    let device = pieces.iter().any(|(_, o)| matches!(o, Out::Device(_)));
    let mut out = Scatter {
        slice,
        pieces,
        piece: 0,
        at: 0,
        hasher: blake3::Hasher::new(),
        uploads: Vec::new(),
    };
    if !device {
        let mut windows = bounces
            .iter_mut()
            .map(Bounce::get)
            .collect::<Result<Vec<&mut [u8]>>>()?;
        r.read_windows(offset, len, &mut windows, &mut |w| {
            out.take(w);
            Ok(())
        })?;
        return Ok(out.hasher.finalize());
    }
    let mut turn = 0;
    while out.at < len {
        turn = (turn + 1) % bounces.len();
        let b = &mut bounces[turn];
        let bounce = b.get()?;
        let n = bounce.len().min(len - out.at);
        r.read_at(offset + out.at as u64, &mut bounce[..n])?;
        out.take(&bounce[..n]);
        if !out.uploads.is_empty() {
            let copies: Vec<_> = out.uploads.drain(..).map(|(r, p, _)| (r, p)).collect();
            b.upload(gpu, &copies)?;
        }
    }
    Ok(out.hasher.finalize())
}
