//! Reading one open file: sequential detection and a growing read-ahead window.
//!
//! A read handle keeps, in offset order, the **segments** it has fetched (bytes already in
//! memory) and up to two **windows** in flight (each one task streaming [`StripedReader::stream`], so
//! a window larger than a stripe is fetched as parallel ranged GETs). A read is *sequential* when
//! it starts where the previous read ended or anywhere inside what is buffered or in flight; the
//! kernel's own read-ahead can deliver requests slightly out of order, and small seeks back or
//! forward inside the buffer are served from memory.
//!
//! - Sequential: bytes come from the segments, awaiting the oldest window's next stripe when
//!   they run out. A window hands over each stripe as it arrives (in order), and each stripe
//!   becomes a segment as it is, so a read waits only for the stripe holding its bytes and no
//!   byte is copied between the HTTP body and the reply to the kernel. After each read, windows
//!   are started back to back after the buffered range until two are in flight; each new window
//!   is twice the previous one, from `initial_read_ahead` up to `max_read_ahead`, and one at
//!   least a stripe long ends on a multiple of the stripe, so the windows after it, and their
//!   ranged GETs, line up with the parts the object was written in. Segments wholly behind the
//!   read position are dropped, except the latest, which serves short backward seeks.
//! - Random (anything else): the windows are cancelled, the window size goes back to its
//!   initial value and the read is one exact ranged GET of the bytes asked for.
//!
//! **Memory.** Every window holds a permit of its length from the mount's [`ByteBudget`] from
//! before its request is sent; each stripe takes its share of the permit along when it becomes
//! a segment, and gives it back when the segment is dropped, so the total buffered by all
//! handles never exceeds the budget. A read-ahead window is only started when its permit is available at
//! once ([`ByteBudget::try_acquire`]): read-ahead never waits and never pushes out other handles'
//! buffers. The one wait is a demand read (the bytes asked for are neither buffered nor in
//! flight). It first tries for a whole window; if that is not free, it gives back all its handle
//! holds, falls back to the bytes asked for (no read-ahead; the window starts growing again from
//! its initial size) and waits for those. While it waits, the budget takes back the read-ahead of
//! handles that no request is using ([`ReadHandle::reclaim`], driven by the filesystem's
//! handle table): a handle may hold read-ahead for a reader that will never read through it
//! again (readers of one file share the kernel's page cache, so another handle's request may
//! serve it), and waiting for it to let go could wait forever. A window's stripes
//! ([`StripedReader::stream`]) are part of the bytes the window already holds, so the striped
//! reader itself runs under a separate, unlimited transport budget.
//!
//! **Local cache.** With a stripe cache (`--cache-dir`), windows are widened to whole stripes;
//! each stripe comes from the cache when it holds it for this object version, otherwise it is one
//! ranged GET whose bytes are then kept (see `cache.rs`). A random read inside a cached stripe is
//! served from it too.
//!
//! Responses are length-checked by the striped reader: a short body is an error (EIO), never
//! zeros or wrong bytes.

use std::collections::VecDeque;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use futures::{FutureExt, StreamExt, TryStreamExt, stream};
use hotstart_store::budget::BudgetPermit;
use hotstart_store::{ByteBudget, StripedReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::cache::StripeCache;
use crate::error::{FsError, FsResult};

/// A handle's view of the local stripe cache: the object version it reads and how it is cut.
#[derive(Debug, Clone)]
pub struct Cached {
    pub cache: StripeCache,
    pub version: String,
    pub stripe: u64,
    pub in_flight: usize,
}

impl Cached {
    /// One whole stripe: from the cache, or one ranged GET whose bytes are then kept.
    async fn stripe(self, reader: StripedReader, r: Range<u64>) -> hotstart_store::Result<Bytes> {
        let len = r.end - r.start;
        if let Some(b) = self.cache.get(&self.version, r.start, len).await {
            return Ok(b);
        }
        // One ranged GET when `r` is at most the reader's stripe; `stream` length-checks it.
        let pieces: Vec<Bytes> = reader.stream(r.clone()).try_collect().await?;
        let b = match <[Bytes; 1]>::try_from(pieces) {
            Ok([one]) => one,
            Err(pieces) => pieces.concat().into(),
        };
        self.cache.insert(&self.version, r.start, b.clone()).await;
        Ok(b)
    }

    /// Sends the bytes of `range` (whole stripes) to `out` in order, each stripe from the cache
    /// or fetched and kept.
    async fn fetch(self, reader: StripedReader, range: Range<u64>, out: PieceSender) {
        let s = self.stripe.max(1);
        let stripes = (range.start..range.end)
            .step_by(s as usize)
            .map(move |a| a..(a + s).min(range.end));
        let fetches: Vec<_> = stripes
            .map(|r| self.clone().stripe(reader.clone(), r).boxed())
            .collect();
        send_all(stream::iter(fetches).buffered(self.in_flight.max(1)), out).await;
    }
}

/// Where a window's task sends its stripes, in order; an error ends the window.
type PieceSender = mpsc::UnboundedSender<hotstart_store::Result<Bytes>>;

/// Forwards `pieces` to `out` until the first error, or until nobody listens any more.
async fn send_all(
    mut pieces: impl futures::Stream<Item = hotstart_store::Result<Bytes>> + Unpin,
    out: PieceSender,
) {
    while let Some(piece) = pieces.next().await {
        let failed = piece.is_err();
        if out.send(piece).is_err() || failed {
            return;
        }
    }
}

/// Read-ahead limits of one handle.
#[derive(Debug, Clone, Copy)]
pub struct ReadAhead {
    pub initial: usize,
    pub max: usize,
}

struct Segment {
    start: u64,
    data: Bytes,
    permit: Option<BudgetPermit>,
}

impl Segment {
    fn end(&self) -> u64 {
        self.start + self.data.len() as u64
    }
}

/// Read-ahead in flight: one task fetching `range` stripe by stripe and sending each stripe as it
/// arrives, so a read waits only for the stripe it needs, and a stripe's bytes are never copied
/// again on their way to the kernel.
struct Window {
    range: Range<u64>,
    pieces: mpsc::UnboundedReceiver<hotstart_store::Result<Bytes>>,
    /// Where the next piece starts.
    next: u64,
    task: JoinHandle<()>,
    /// The budget of the bytes not yet received; each piece takes its share along.
    permit: Option<BudgetPermit>,
}

impl Drop for Window {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The read state of one open file.
pub struct ReadHandle {
    path: String,
    reader: StripedReader,
    size: u64,
    budget: ByteBudget,
    limits: ReadAhead,
    segments: VecDeque<Segment>,
    windows: VecDeque<Window>,
    window: usize,
    last_end: u64,
    cache: Option<Cached>,
}

/// Windows in flight per handle.
const WINDOWS_AHEAD: usize = 2;

impl ReadHandle {
    pub fn new(
        path: String,
        reader: StripedReader,
        budget: ByteBudget,
        limits: ReadAhead,
        cache: Option<Cached>,
    ) -> ReadHandle {
        let initial = limits.initial.max(4096);
        ReadHandle {
            path,
            size: reader.size(),
            reader,
            budget,
            limits: ReadAhead {
                initial,
                max: limits.max.max(initial),
            },
            segments: VecDeque::new(),
            windows: VecDeque::new(),
            window: initial,
            last_end: 0,
            cache,
        }
    }

    /// Bytes buffered or in flight (for tests of the budget).
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.segments.iter().map(|s| s.data.len()).sum::<usize>()
            + self
                .windows
                .iter()
                .map(|w| w.permit.as_ref().map_or(0, |p| p.bytes()))
                .sum::<usize>()
    }

    fn buffered_span(&self) -> Option<Range<u64>> {
        let start = self.segments.front().map(|s| s.start);
        let start = start.or_else(|| self.windows.front().map(|w| w.range.start))?;
        let end = self
            .windows
            .back()
            .map(|w| w.range.end)
            .or_else(|| self.segments.back().map(|s| s.end()))?;
        Some(start..end)
    }

    fn is_sequential(&self, offset: u64) -> bool {
        offset == self.last_end || self.buffered_span().is_some_and(|r| r.contains(&offset))
    }

    /// Up to `len` bytes at `offset` (fewer only at the end of the file).
    pub async fn read(&mut self, offset: u64, len: usize) -> FsResult<Bytes> {
        if offset >= self.size || len == 0 {
            return Ok(Bytes::new());
        }
        let len = (len as u64).min(self.size - offset) as usize;
        let res = if self.is_sequential(offset) {
            self.read_sequential(offset, len).await
        } else {
            self.read_random(offset, len).await
        };
        match res {
            Ok(bytes) => {
                self.last_end = offset + bytes.len() as u64;
                Ok(bytes)
            }
            Err(e) => {
                // Nothing half-fetched is trusted after an error.
                self.segments.clear();
                self.windows.clear();
                self.window = self.limits.initial;
                Err(e)
            }
        }
    }

    async fn read_random(&mut self, offset: u64, len: usize) -> FsResult<Bytes> {
        self.windows.clear();
        self.segments.clear();
        self.window = self.limits.initial;
        if let Some(c) = &self.cache {
            let a = offset / c.stripe * c.stripe;
            let e = (a + c.stripe).min(self.size);
            if offset + len as u64 <= e
                && let Some(b) = c.cache.get(&c.version, a, e - a).await
            {
                let from = (offset - a) as usize;
                return Ok(b.slice(from..from + len));
            }
        }
        let _permit = self.budget.acquire(len).await;
        // One ranged GET of exactly these bytes when `len` fits a stripe (it does for FUSE's
        // 1 MiB requests), wherever it starts.
        self.reader
            .read_at(offset, len)
            .await
            .map_err(|e| FsError::store(&self.path, e))
    }

    async fn read_sequential(&mut self, offset: u64, len: usize) -> FsResult<Bytes> {
        let end = offset + len as u64;
        let mut out: Option<BytesMut> = None;
        let mut single: Option<Bytes> = None;
        let mut pos = offset;
        while pos < end {
            if let Some(seg) = self
                .segments
                .iter()
                .find(|s| s.start <= pos && pos < s.end())
            {
                let from = (pos - seg.start) as usize;
                let to = (end.min(seg.end()) - seg.start) as usize;
                let piece = seg.data.slice(from..to);
                pos += piece.len() as u64;
                // The common case, a read inside one segment, is a zero-copy slice.
                if out.is_none() && single.is_none() && pos == end {
                    single = Some(piece);
                } else {
                    let buf = out.get_or_insert_with(|| BytesMut::with_capacity(len));
                    if let Some(first) = single.take() {
                        buf.extend_from_slice(&first);
                    }
                    buf.extend_from_slice(&piece);
                }
                continue;
            }
            // Not buffered: the oldest window must be about to receive it, or windows are
            // useless.
            if self
                .windows
                .front()
                .is_some_and(|w| !(w.next..w.range.end).contains(&pos))
            {
                self.windows.clear();
            }
            if self.windows.is_empty() {
                self.start_window(pos, Some((end - pos) as usize)).await;
            }
            self.land_next().await?;
        }
        self.trim(end);
        self.fill_ahead().await;
        Ok(single.unwrap_or_else(|| out.map(BytesMut::freeze).unwrap_or_default()))
    }

    /// Awaits the next stripe of the oldest window and keeps it as a segment; the window is done
    /// once its last stripe is in.
    async fn land_next(&mut self) -> FsResult<()> {
        let path = &self.path;
        let Some(w) = self.windows.front_mut() else {
            return Err(FsError::Invalid {
                path: path.clone(),
                reason: "read-ahead window could not start".into(),
            });
        };
        let data = match w.pieces.recv().await {
            Some(Ok(data)) if !data.is_empty() => data,
            Some(Err(e)) => return Err(FsError::store(path, e)),
            Some(Ok(_)) | None => {
                return Err(FsError::Invalid {
                    path: path.clone(),
                    reason: "read-ahead ended before its range".into(),
                });
            }
        };
        let start = w.next;
        w.next += data.len() as u64;
        // The piece's share of the permit moves to the segment: the bytes stay counted.
        let permit = match &mut w.permit {
            Some(p) if p.bytes() > data.len() => p.split(data.len()),
            whole => whole.take(),
        };
        if w.next >= w.range.end {
            self.windows.pop_front();
        }
        self.segments.push_back(Segment {
            start,
            data,
            permit,
        });
        Ok(())
    }

    /// Drops segments wholly behind `pos`, except the newest of them (for short seeks back).
    fn trim(&mut self, pos: u64) {
        let behind = self.segments.iter().take_while(|s| s.end() <= pos).count();
        for _ in 1..behind {
            self.segments.pop_front();
        }
    }

    /// Starts windows after the buffered range until two are in flight.
    async fn fill_ahead(&mut self) {
        while self.windows.len() < WINDOWS_AHEAD {
            let next = self
                .windows
                .back()
                .map(|w| w.range.end)
                .or_else(|| self.segments.back().map(|s| s.end()))
                .unwrap_or(self.last_end);
            if next >= self.size || !self.start_window(next, None).await {
                return;
            }
        }
    }

    /// Gives back everything the handle holds (buffered segments and windows in flight) and
    /// starts the read-ahead window over from its initial size; returns the bytes freed from the
    /// budget. Called on a handle no request is using when another needs memory.
    pub fn reclaim(&mut self) -> usize {
        let held = |p: &Option<BudgetPermit>| p.as_ref().map_or(0, BudgetPermit::bytes);
        let freed = self.segments.iter().map(|s| held(&s.permit)).sum::<usize>()
            + self.windows.iter().map(|w| held(&w.permit)).sum::<usize>();
        self.segments.clear();
        self.windows.clear();
        self.window = self.limits.initial;
        freed
    }

    /// `len` bytes from `start`, widened to whole stripes when a stripe cache is in use, and
    /// otherwise, once at least a stripe long, to end where a stripe does (so the next window
    /// starts on the stripe grid and its GETs each read one part of the object); unless that
    /// no longer fits the budget.
    fn span(&self, start: u64, len: usize) -> (u64, usize, Option<Cached>) {
        let cap = self.budget.capacity() as u64;
        let len = (len as u64).min(self.size - start).min(cap) as usize;
        let end = start + len as u64;
        // The end of the stripe (of size `s`) that holds the last byte, within the file.
        let grid_end = |s: u64| (end.div_ceil(s) * s).min(self.size);
        if let Some(c) = &self.cache {
            let (a, e) = (start / c.stripe * c.stripe, grid_end(c.stripe));
            if e - a <= cap {
                return (a, (e - a) as usize, Some(c.clone()));
            }
        }
        let stripe = self.reader.stripe();
        let e = grid_end(stripe);
        if len as u64 >= stripe && e - start <= cap {
            return (start, (e - start) as usize, None);
        }
        (start, len, None)
    }

    /// Starts one window at `start`. Read-ahead (`demand` is `None`) starts only if its budget is
    /// free now. A demand read of `demand` bytes takes a whole window if it is free now, else
    /// gives back what the handle holds and waits for just the bytes asked for. Returns whether
    /// a window started.
    async fn start_window(&mut self, at: u64, demand: Option<usize>) -> bool {
        let (mut start, mut len, mut cached) = self.span(at, self.window);
        if len == 0 {
            return false;
        }
        let permit = match (self.budget.try_acquire(len), demand) {
            (Some(p), _) => p,
            (None, None) => return false,
            (None, Some(need)) => {
                // Wait holding nothing, for no more than needed: every handle that waits for
                // memory has given back what it held, and idle handles' read-ahead is reclaimed
                // by the budget, so the memory always drains to the waiters.
                self.reclaim();
                (start, len, cached) = self.span(at, need.max(self.limits.initial));
                self.budget.acquire(len).await
            }
        };
        let reader = self.reader.clone();
        let range = start..start + len as u64;
        let (out, pieces) = mpsc::unbounded_channel();
        let task = match cached {
            Some(c) => tokio::spawn(c.fetch(reader, range.clone(), out)),
            None => tokio::spawn(send_all(reader.stream(range.clone()), out)),
        };
        self.windows.push_back(Window {
            next: range.start,
            range,
            pieces,
            task,
            permit: Some(permit),
        });
        self.window = (self.window * 2).min(self.limits.max);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hotstart_store::{Store, StripeConfig};

    async fn handle(size: usize, budget: &ByteBudget) -> (ReadHandle, Vec<u8>) {
        let store = Store::open("memory://").unwrap();
        let data: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
        store.put("f", Bytes::from(data.clone())).await.unwrap();
        let cfg = StripeConfig {
            stripe_size: 64 << 10,
            max_in_flight: 4,
            budget: ByteBudget::new(usize::MAX >> 2),
        };
        let reader = StripedReader::open(&store, "f", cfg).await.unwrap();
        let limits = ReadAhead {
            initial: 16 << 10,
            max: 256 << 10,
        };
        (
            ReadHandle::new("f".into(), reader, budget.clone(), limits, None),
            data,
        )
    }

    #[tokio::test]
    async fn sequential_reads_grow_the_window_and_return_exact_bytes() {
        let budget = ByteBudget::new(1 << 20);
        let (mut h, data) = handle(1_000_003, &budget).await;
        let mut got = Vec::new();
        let mut off = 0u64;
        loop {
            let b = h.read(off, 10_000).await.unwrap();
            if b.is_empty() {
                break;
            }
            off += b.len() as u64;
            got.extend_from_slice(&b);
            assert!(h.held() <= budget.capacity());
        }
        assert_eq!(got, data);
        assert_eq!(h.window, 256 << 10, "the window doubled up to its maximum");
        assert!(budget.peak() <= budget.capacity());
    }

    #[tokio::test]
    async fn windows_a_stripe_long_end_on_the_stripe_grid() {
        let budget = ByteBudget::new(1 << 20);
        let (h, _) = handle(1_000_003, &budget).await;
        let span = |start, len| {
            let (s, l, _) = h.span(start, len);
            (s, l)
        };
        // Shorter than a stripe (64 KiB here): as asked, so the window still ramps up.
        assert_eq!(span(16 << 10, 32 << 10), (16 << 10, 32 << 10));
        // A stripe or longer, starting off the grid: it ends on the grid, and so the next
        // window starts there.
        assert_eq!(span(112 << 10, 64 << 10), (112 << 10, 80 << 10));
        assert_eq!(span(192 << 10, 128 << 10), (192 << 10, 128 << 10));
        // Never past the end of the file.
        assert_eq!(span(900_000, 96 << 10), (900_000, 100_003));
    }

    #[tokio::test]
    async fn small_seeks_and_random_reads_are_exact() {
        let budget = ByteBudget::new(1 << 20);
        let (mut h, data) = handle(500_000, &budget).await;
        for (off, len) in [
            (0u64, 5000usize),
            (5000, 5000),
            (2000, 100),
            (9000, 30_000),
            (400_000, 7),
            (3, 3),
            (499_990, 100),
            (600_000, 10),
        ] {
            let b = h.read(off, len).await.unwrap();
            let s = (off as usize).min(data.len());
            let e = (s + len).min(data.len());
            assert_eq!(&b[..], &data[s..e], "read {off}+{len}");
        }
        drop(h);
        assert_eq!(budget.in_use(), 0, "every permit is given back");
    }

    #[tokio::test]
    async fn no_read_ahead_when_the_budget_is_taken() {
        let budget = ByteBudget::new(64 << 10);
        let hog = budget.acquire(60 << 10).await;
        let (mut h, data) = handle(100_000, &budget).await;
        let b = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            drop(hog);
            h.read(0, 1000).await
        })
        .await
        .unwrap()
        .unwrap();
        assert_eq!(&b[..], &data[..1000]);
    }
}
