//! The verified chunk reader: chunks read in parallel from the first source that holds them,
//! each checked against the manifest's blake3 before it counts, and scattered into caller and
//! device buffers through bounce buffers.

use super::*;

/// The device whose pinned buffers a load with these pieces copies through, if any piece goes
/// to device memory.
pub(super) fn device_of<'p, 'a: 'p>(
    pieces: impl IntoIterator<Item = &'p Out<'a>>,
) -> Option<usize> {
    pieces.into_iter().find_map(|o| match o {
        Out::Device(d) => Some(d.ordinal),
        Out::Host(_) => None,
    })
}

/// One worker's two bounce buffers, one filled while the other is copied out: pinned ones of
/// [`DEVICE_BOUNCE`] when device memory is written, else halves of [`BOUNCE`].
pub(super) fn bounces(gpu: &Gpu, device: Option<usize>) -> Vec<Bounce> {
    (0..2)
        .map(|_| match device {
            Some(ordinal) => Bounce::pinned(gpu, ordinal, DEVICE_BOUNCE),
            None => Bounce::host(BOUNCE / 2),
        })
        .collect()
}

/// Waits for the copies from every bounce buffer; the first error, if any.
pub(super) fn drain(bounces: &mut [Bounce]) -> Result<()> {
    bounces
        .iter_mut()
        .map(Bounce::wait)
        .fold(Ok(()), Result::and)
}

/// A worker's readers of the tiers, opened on first use.
type Readers<'t> = Vec<Option<Box<dyn TierReader + 't>>>;

/// A chunk to read: its index, its slice of the loader's buffer, and the caller and device
/// buffers it covers.
type Piece<'a> = (usize, (&'a mut [u8], Vec<(usize, Out<'a>)>));

impl Persistence {
    /// The verified reader: fills `buf` with the file, chunk by chunk, each from the first of
    /// `tiers` whose bytes match the chunk's hash, except the bytes that `direct` sends to
    /// caller or device buffers (through `gpu`) instead (per chunk: offset in the chunk and
    /// destination, in order); the tier each chunk came from. With `only` (ascending), just
    /// those chunks are read, and their tiers returned. Returns once every copy to a device is
    /// done.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read_chunks<'t>(
        &self,
        gpu: &Gpu,
        step: u64,
        m: &Manifest,
        tiers: &[&'t dyn Source],
        buf: &mut [u8],
        direct: Vec<Vec<(usize, Out<'_>)>>,
        held: bool,
        only: Option<&[usize]>,
    ) -> Result<Vec<TierKind>> {
        let key = format::data_key(&self.job, step, self.rank);
        let hashes = m.chunk_hashes();
        let chunk_size = m.chunk_size as usize;
        let n = hashes.len();
        let device = device_of(direct.iter().flatten().map(|(_, o)| o));
        let wanted = |i: &usize| only.is_none_or(|o| o.binary_search(i).is_ok());
        let items = buf
            .chunks_mut(chunk_size.max(1))
            .zip(direct)
            .enumerate()
            .filter(|(i, _)| wanted(i));
        let results: Mutex<Vec<Option<TierKind>>> = Mutex::new(vec![None; n]);
        // More workers than threads: each one hashes a window while its next one is read, and
        // with many of them the disk always has reads queued while the others hash. Eight per
        // thread for reads into host memory (a cold 4 GiB load into caller tensors on two cores
        // went from 0.90× to 0.94× fio's read with four); four where each worker pins its two
        // buffers afresh (device loads), or where the kernel's read-ahead does the reading (a
        // held file: eight ran slower there).
        let per_thread = if device.is_some() || held { 4 } else { 8 };
        let workers = (per_thread * self.threads)
            .clamp(1, 32)
            .min(only.map_or(n, <[usize]>::len).max(1));
        // Each worker's readers of the tiers, opened on first use, and its bounce buffers.
        let init = || {
            let readers: Readers<'t> = tiers.iter().map(|_| None).collect();
            (readers, Vec::<Bounce>::new())
        };
        let work = |(readers, bounce): &mut (Readers<'t>, Vec<Bounce>),
                    (i, (slice, mut pieces)): Piece<'_>| {
            let offset = m.chunk_range(i).start;
            let mut last = String::from("no tier has a valid manifest");
            let mut got = None;
            if held && pieces.is_empty() {
                // The caller's buffer holds the nearest tier's bytes already.
                read_ahead(slice);
                if blake3::hash(slice) == hashes[i] {
                    got = tiers.first().map(|t| t.kind());
                } else {
                    warn!(
                        step,
                        chunk = i,
                        "chunk held in memory unusable (checksum mismatch); reading it again"
                    );
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
                            *bounce = bounces(gpu, device);
                        }
                        scatter_chunk(r.as_mut(), offset, slice, &mut pieces, bounce, gpu)
                    }
                });
                let why = match res {
                    Ok(hash) if hash == hashes[i] => {
                        got = Some(tier.kind());
                        break;
                    }
                    // The device, not the tier, failed: no other tier helps.
                    Err(e @ Error::Cuda { .. }) => return Err(e),
                    Ok(_) => format!("{} tier: checksum mismatch", tier.kind()),
                    Err(e) => format!("{} tier: {e}", tier.kind()),
                };
                warn!(step, chunk = i, reason = %why, "chunk unusable; trying the next tier");
                last = why;
            }
            let kind = got.ok_or_else(|| Error::Corrupt {
                step,
                rank: self.rank,
                chunk: i,
                reason: last,
            })?;
            results.lock().unwrap_or_else(PoisonError::into_inner)[i] = Some(kind);
            Ok(())
        };
        let done = |(_, mut bounce): (_, Vec<Bounce>)| drain(&mut bounce);
        each_parallel(items, workers, init, work, done)?;
        let results = results.into_inner().unwrap_or_else(PoisonError::into_inner);
        results
            .into_iter()
            .enumerate()
            .filter(|(i, _)| wanted(i))
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

/// Runs `work` on every item of `items` over `workers` threads, each with state of its own
/// made by `init` and handed to `done` when the worker stops. Once an item fails no more are
/// handed out; the first failure is returned. The pool under every parallel chunk read: loads,
/// and `hotstart ckpt verify` (`crate::inspect`).
pub(crate) fn each_parallel<T: Send, S>(
    items: impl Iterator<Item = T> + Send,
    workers: usize,
    init: impl Fn() -> S + Sync,
    work: impl Fn(&mut S, T) -> Result<()> + Sync,
    done: impl Fn(S) -> Result<()> + Sync,
) -> Result<()> {
    let items = Mutex::new(items);
    let failure: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error| {
        failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(e);
    };
    std::thread::scope(|scope| {
        for _ in 0..workers.max(1) {
            scope.spawn(|| {
                let mut state = init();
                loop {
                    if failure
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .is_some()
                    {
                        break;
                    }
                    let next = items.lock().unwrap_or_else(PoisonError::into_inner).next();
                    let Some(item) = next else { break };
                    if let Err(e) = work(&mut state, item) {
                        fail(e);
                        break;
                    }
                }
                if let Err(e) = done(state) {
                    fail(e);
                }
            });
        }
    });
    match failure.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Starts reading in the pages of `buf`, part of a file mapping, ahead of their first touch
/// (advice only; errors are ignored).
pub(super) fn read_ahead(buf: &[u8]) {
    let addr = buf.as_ptr() as usize;
    let (start, end) = (addr.next_multiple_of(4096), addr + buf.len());
    if end > start {
        // SAFETY: MADV_WILLNEED only schedules reads into the page cache for whole pages inside
        // `buf`; it changes no contents and no mapping.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_WILLNEED) };
    }
}

/// Bytes of a chunk read at once into a worker's bounce buffer when parts of the chunk go to
/// caller buffers.
pub(super) const BOUNCE: usize = 8 << 20;
/// Bytes of each of a worker's two pinned bounce buffers for device memory: one huge page. Every
/// load pins its buffers afresh, so a restarted process's first load pays for faulting them in
/// and registering them. Two of 2 MiB per worker keep the copy engine busy at a quarter of what
/// two of 8 MiB cost (a restore from the sidecar's memory on an H200, 16 threads: 0.115 s
/// against 0.20 s). Smaller ones lose: 1 MiB buffers, below a huge page, ran the same restore in
/// 0.24 s and a disk-tier load 1.6x slower.
pub(super) const DEVICE_BOUNCE: usize = 2 << 20;
/// Bytes hashed and then copied out while they are still in the CPU's cache.
pub(super) const HASH_STEP: usize = 256 << 10;
/// Bytes of a chunk read as one window when the chunk goes straight into its buffer: the first
/// window is hashed while the next ones are read.
pub(super) const WINDOW: usize = 4 << 20;

/// Reads the chunk at `offset` straight into `slice`, hashing each window as soon as it is in
/// while the next ones are read. Returns the chunk's blake3.
pub(crate) fn read_chunk(
    r: &mut dyn TierReader,
    offset: u64,
    slice: &mut [u8],
) -> Result<blake3::Hash> {
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
pub(super) struct Scatter<'s, 'p, 'o> {
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
                            Out::Host(dst) => hotstart_proto::memcopy::copy_cold(
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
pub(super) fn scatter_chunk(
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
