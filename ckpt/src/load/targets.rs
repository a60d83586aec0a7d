//! Where a load puts each byte: destinations checked against the manifest, and the copy of
//! a verified file's bytes into caller and device buffers.

use super::*;

/// Where a load puts each byte: the destinations, checked against the manifest.
pub(crate) struct Targets<'a> {
    /// Per chunk: the caller and device buffers it covers (offset in the chunk, destination),
    /// sorted.
    pub(crate) direct: Vec<Vec<(usize, Out<'a>)>>,
    /// Tensors not returned owned (they went to caller or device buffers).
    pub(super) taken: HashSet<String>,
    /// The caller buffer that takes the whole file ([`Destination::File`]), and whether it
    /// already holds the nearest tier's bytes ([`Destination::Held`]).
    pub(super) file: Option<(&'a mut [u8], bool)>,
    /// The only chunks to read, ascending ([`Destination::Regions`]: the header's and the
    /// regions'); `None`: every chunk.
    pub(crate) only: Option<Vec<usize>>,
    /// Whether any destination is device memory.
    pub(super) device: bool,
}

/// Where a piece of a chunk goes: caller memory, or device memory (copied from a pinned
/// [`Bounce`] buffer).
pub(crate) enum Out<'a> {
    Host(&'a mut [u8]),
    Device(DevicePtr),
}

impl<'a> Out<'a> {
    pub(super) fn len(&self) -> usize {
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

/// The file range of a tensor's bytes.
pub(super) fn range_of(m: &Manifest, t: &format::TensorEntry) -> Range<usize> {
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
pub(super) fn whole_file<'a>(
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
        only: None,
        device: false,
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
    let mut only = None;
    let (regions, device) = match dest {
        Destination::Owned => (Vec::new(), HashMap::new()),
        Destination::Buffers(b) => (
            b.into_iter().map(|(n, buf)| (n, None, buf)).collect(),
            HashMap::new(),
        ),
        Destination::Regions(r) => {
            only = Some(region_list(&r));
            (r, HashMap::new())
        }
        Destination::File(file) => return whole_file(step, reference, file, false),
        Destination::Held(file) => return whole_file(step, reference, file, true),
        Destination::Device(d) => {
            let devices: BTreeSet<usize> = d.values().map(DeviceBuffer::ordinal).collect();
            if !devices.is_empty() {
                cuda::check_devices(&devices)?;
            }
            (Vec::new(), d)
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
    // Where `have` bytes for tensor `name` start in the file: the whole tensor (`offset`
    // None), or a range of it.
    let entry = |name: &String, offset: Option<u64>, have: usize, what: &str| {
        let t = reference
            .tensors
            .iter()
            .find(|t| &t.name == name)
            .ok_or_else(|| Error::Destination {
                step,
                name: name.clone(),
                reason: "no such tensor in the checkpoint".into(),
            })?;
        let range = range_of(reference, t);
        let bad = |reason: String| Error::Destination {
            step,
            name: name.clone(),
            reason,
        };
        match offset {
            None if have != range.len() => Err(bad(format!(
                "{what} of {have} bytes for {} bytes",
                range.len()
            ))),
            None => Ok(range.start),
            Some(o) => usize::try_from(o)
                .ok()
                .and_then(|o| {
                    o.checked_add(have)
                        .filter(|end| *end <= range.len())
                        .map(|_| o)
                })
                .map(|o| range.start + o)
                .ok_or_else(|| {
                    bad(format!(
                        "{what} of {have} bytes at offset {o} of a tensor of {} bytes",
                        range.len()
                    ))
                }),
        }
    };
    // Caller and device buffers are filled straight from the chunks that cover them.
    let mut direct: Vec<Vec<(usize, Out<'a>)>> =
        (0..reference.chunks.len()).map(|_| Vec::new()).collect();
    let mut taken = HashSet::new();
    let outs = regions
        .into_iter()
        .map(|(name, offset, b)| (name, offset, Out::Host(b), "buffer"))
        .chain(
            device
                .into_iter()
                .map(|(name, d)| (name, None, Out::Device(d.0), "device buffer")),
        );
    for (name, offset, out, what) in outs {
        let mut at = entry(&name, offset, out.len(), what)?;
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
    for (chunk, pieces) in direct.iter_mut().enumerate() {
        pieces.sort_unstable_by_key(|(at, _)| *at);
        // A chunk sends each of its bytes to one destination (see `Scatter`).
        if let Some(w) = pieces.windows(2).find(|w| w[0].0 + w[0].1.len() > w[1].0) {
            return Err(Error::Destination {
                step,
                name: "(regions)".into(),
                reason: format!(
                    "two destinations take byte {} of the file: load it into one and copy",
                    chunk * chunk_size + w[1].0
                ),
            });
        }
    }
    let only = match only {
        None => None,
        // Only what the regions ask for is read, so no other tensor is handed out.
        Some(regions) => {
            taken.extend(reference.tensors.iter().map(|t| t.name.clone()));
            let chunks = reference
                .chunks_for(&regions)
                .map_err(|reason| Error::Destination {
                    step,
                    name: "(regions)".into(),
                    reason,
                })?;
            Some(chunks)
        }
    };
    let device = direct
        .iter()
        .flatten()
        .any(|(_, o)| matches!(o, Out::Device(_)));
    Ok(Targets {
        direct,
        taken,
        file: None,
        only,
        device,
    })
}

/// The byte ranges a [`Destination::Regions`] asks for, as the sidecar is told them.
pub(crate) fn region_list(regions: &[(String, Option<u64>, &mut [u8])]) -> Vec<format::Region> {
    regions
        .iter()
        .map(|(tensor, offset, buf)| format::Region {
            tensor: tensor.clone(),
            offset: offset.unwrap_or(0),
            len: buf.len() as u64,
        })
        .collect()
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
