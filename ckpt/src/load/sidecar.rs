//! Loads through the node's sidecar: a restored step's segment mapped as the loaded tensors,
//! or a file of its disk read and verified here, with the sidecar's copy as the fallback.

use super::*;
use crate::cuda::Exported;
use hotstart_proto::wire::{Conn, DeviceCopy, FdStream};

impl Inner {
    /// Hands out a step the sidecar restored: from its segment ([`Inner::load_segment`]), or
    /// from a file of its disk, loaded as from a tier and verified chunk by chunk; a chunk of
    /// the file that does not match is taken from a segment the sidecar makes of the step after
    /// all ([`SidecarCopy`]), from its disk and store. `regions`: what the restore was asked
    /// for of a [`Destination::Regions`] load (the fallback asks for the same).
    pub(super) fn load_restored(
        &self,
        sidecar: &Client,
        restored: Restored,
        dest: Destination<'_>,
        regions: Option<Vec<format::Region>>,
        started: Instant,
    ) -> Result<Loaded> {
        let Restored {
            manifest: m,
            handed,
            chunk_sources,
            source,
            seconds,
            conn,
        } = restored;
        let step = m.step;
        let (loaded, handed) = match handed {
            Handed::Segment(segment) => (
                self.load_segment(sidecar, conn, m, segment, dest, chunk_sources)?,
                "segment",
            ),
            Handed::File(file) => {
                let key = format::data_key(&self.core.job, step, self.core.rank);
                let label = format!("{key} (the sidecar's {source} tier)");
                let file = HandedFile::new(file, label.into(), source, self.core.uring.clone());
                let copy = SidecarCopy {
                    sidecar,
                    step,
                    regions,
                    got: OnceLock::new(),
                };
                (self.load_from(step, m, &[&file, &copy], dest)?, "file")
            }
        };
        let device = loaded.device_route.as_ref().map(ToString::to_string);
        info!(
            step,
            %source,
            handed,
            device,
            sidecar_seconds = seconds,
            seconds = started.elapsed().as_secs_f64(),
            "restored through the sidecar"
        );
        Ok(loaded)
    }

    /// Hands out a step from the sidecar's sealed segment: device buffers are filled by the
    /// sidecar itself when it can ([`upload_device`]: `conn` is the connection the segment came
    /// on); caller buffers, and device buffers it did not fill, with one parallel copy straight
    /// from the segment's pages (`pread`, so the mapping's pages are never faulted in for
    /// them); tensors returned owned are views of the mapping itself, valid however long they
    /// are kept. The bytes are not hashed again (see [`Handed`]). Of a segment restored for
    /// regions only the chunks that hold them and the header are read.
    pub(super) fn load_segment(
        &self,
        sidecar: &Client,
        mut conn: Conn<FdStream>,
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
        // Who fills the device buffers (no one without any): the sidecar if it can.
        let route = targets.device.then(|| {
            let chunk_size = m.chunk_size as usize;
            match upload_device(&self.gpu, sidecar, &mut conn, &mut direct, chunk_size) {
                Ok(()) => DeviceRoute::Sidecar,
                Err(e) => {
                    info!(step, error = %e, "the sidecar did not copy into the device buffers; copying through this process's pinned buffers");
                    DeviceRoute::Process {
                        instead_of: Some(e.to_string()),
                    }
                }
            }
        });
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
            self.core.threads,
            &self.gpu,
        )?;
        // A whole segment's sources, of a load that read some of its chunks: those chunks'.
        let chunk_sources = match &targets.only {
            Some(only) if chunk_sources.len() == m.chunks.len() => {
                only.iter().map(|&i| chunk_sources[i]).collect()
            }
            _ => chunk_sources,
        };
        let all = Bytes::from_owner(SealedBytes(segment, len));
        let mut loaded = self.finish(step, m, &all, Some(&all), targets, chunk_sources)?;
        loaded.device_route = route;
        Ok(loaded)
    }
}

/// Asks the sidecar to copy the device pieces of `direct` (per chunk of `chunk_size` bytes:
/// offset in the chunk and destination) from its own mapping of the segment it just handed
/// over on `conn`, which it keeps pinned for the device (a restarted process has no pinned
/// copy of its own, and pinning one costs more than the copy). Each device buffer is shared
/// with a CUDA IPC handle of its allocation; pieces contiguous in one allocation go as one
/// copy. On success the device pieces leave `direct`; on an error (no GPU in the sidecar, a
/// segment not pinned yet, memory that cannot be shared) they stay, for this process to copy.
fn upload_device(
    gpu: &Gpu,
    sidecar: &Client,
    conn: &mut Conn<FdStream>,
    direct: &mut [Vec<(usize, Out<'_>)>],
    chunk_size: usize,
) -> Result<()> {
    // One export per allocation (PyTorch's allocator puts several tensors in one), found by
    // device and address: allocations do not overlap, so only the last one starting at or
    // before a piece can hold it.
    let mut exported: BTreeMap<(usize, u64), Exported> = BTreeMap::new();
    let mut allocation = |d: &DevicePtr| -> Result<Exported> {
        let held = exported
            .range((d.ordinal, 0)..=(d.ordinal, d.ptr))
            .next_back()
            .map(|(_, e)| *e)
            .filter(|e| d.ptr + d.len as u64 <= e.base + e.size as u64);
        match held {
            Some(e) => Ok(e),
            None => {
                let e = gpu.export(*d)?;
                exported.insert((d.ordinal, e.base), e);
                Ok(e)
            }
        }
    };
    // Pieces contiguous in the file and in one allocation go as one copy (two allocations can
    // lie next to each other in the address space, but each copy must stay inside its own).
    let mut pieces: Vec<(u64, DevicePtr, Exported)> = Vec::new();
    for (chunk, outs) in direct.iter().enumerate() {
        for (at, out) in outs {
            if let Out::Device(d) = out {
                let from = (chunk * chunk_size + at) as u64;
                let e = allocation(d)?;
                match pieces.last_mut() {
                    Some((f, last, held))
                        if *f + last.len as u64 == from
                            && last.ordinal == d.ordinal
                            && last.ptr + last.len as u64 == d.ptr
                            && held.base == e.base =>
                    {
                        last.len += d.len
                    }
                    _ => pieces.push((from, *d, e)),
                }
            }
        }
    }
    let copies = pieces
        .into_iter()
        .map(|(from, d, e)| DeviceCopy::new(from, d.len as u64, &e.uuid, &e.handle, d.ptr - e.base))
        .collect();
    sidecar.upload(conn, copies)?;
    for outs in direct.iter_mut() {
        outs.retain(|(_, o)| matches!(o, Out::Host(_)));
    }
    Ok(())
}

pub(super) struct SealedBytes(Arc<Sealed>, usize);

impl AsRef<[u8]> for SealedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes()[..self.1]
    }
}

/// The source a load of a file the sidecar handed over falls back to, chunk by chunk: the
/// step as a segment the sidecar makes when first asked (from its disk and store, verified).
pub(super) struct SidecarCopy<'a> {
    sidecar: &'a Client,
    step: u64,
    /// The byte ranges the load reads, when not the whole step.
    regions: Option<Vec<format::Region>>,
    /// The segment and the tier the sidecar took it from, or why there is none.
    got: OnceLock<std::result::Result<(Arc<Sealed>, TierKind), String>>,
}

impl SidecarCopy<'_> {
    pub(super) fn error(&self, reason: String) -> Error {
        Error::Sidecar {
            socket: self.sidecar.socket().display().to_string(),
            reason,
        }
    }

    pub(super) fn segment(&self) -> Result<&Sealed> {
        let fetch = || -> Result<(Arc<Sealed>, TierKind)> {
            let conn = self.sidecar.connect()?;
            let restored =
                self.sidecar
                    .restore(conn, Some(self.step), false, self.regions.clone())?;
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
pub(super) struct SegmentReader<'a>(&'a Sealed, &'a SidecarCopy<'a>);

impl TierReader for SegmentReader<'_> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.0
            .read_at(offset, buf)
            .map_err(|e| self.1.error(format!("read the restored segment: {e}")))
    }
}
