//! The engine's side of the sidecar: saves that stage into the sidecar's shared memory, and
//! restores that map what the sidecar serves. Used by [`Engine`] when
//! [`EngineConfig::sidecar`](crate::EngineConfig::sidecar) is set.
//!
//! **Save.** A save stages into a segment prepared for it ([`Next`]): right after each commit,
//! a background thread of low priority asks the sidecar for the next save's segment
//! (`Stage{ahead}`; in the steady state the segment of an older step, recycled), maps it and
//! maps every page of it now (`MADV_POPULATE_WRITE`: the pages exist, only the page tables are
//! filled), registered as pinned memory for the GPU when the last save had device tensors. So
//! `save` itself only takes the prepared segment and copies: no round trip, no page faults, no
//! memory new to either process. The first save of an engine (and one whose size changed)
//! asks for its segment itself and maps it as it copies. The save's thread stages into the
//! mapping exactly as the in-process engine stages into its pool (device tensors by the GPU,
//! host tensors over the engine's threads), marks the handle staged, hashes the chunks,
//! **unmaps** the segment and commits it with the manifest. The sidecar checks the hashes and
//! holds it, reachable by no other process: the `Memory` phase is done, and the step survives a
//! crash of this process. The sidecar then reports the other tiers (peers, disk, store) on the
//! same connection as they finish. At most `max_inflight` saves stage at once.
//!
//! **Load.** `load` asks for a step (or the newest complete for every rank) and receives the
//! sealed segment; it checks the seals and maps it read-only. Caller buffers are filled with one
//! parallel copy straight from the segment's pages (`pread`, so the mapping's pages are never
//! faulted in for them); tensors returned owned are views of the mapping itself (no copy at
//! all), which stay valid however long they are kept. The bytes were checked against
//! their hashes when the sidecar took them and cannot have changed since, so they are not
//! hashed again.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use tracing::{debug, error, info, warn};

use crate::cuda::Pinned;
use crate::engine::{self, Engine, Inner, WhenFull};
use crate::error::{Error, Result};
use crate::format::{Layout, Manifest};
use crate::handle::{Phase, SaveHandle, Shared};
use crate::load::{self, Destination, Loaded, StepSel};
use crate::proto::shm::{self, Mapping, Sealed, Segment};
use crate::proto::wire::{Conn, FdStream, LocalMsg, Side};
use crate::proto::{PROTOCOL_VERSION, background_priority};
use crate::staging::{FailUnlessComplete, Region, Staging};
use crate::tensor::{Extras, Source, Tensor};
use crate::tier::TierKind;

/// A bound on saves staging at once.
#[derive(Debug)]
struct Tickets {
    max: usize,
    taken: Mutex<usize>,
    freed: Condvar,
}

struct Ticket(Arc<Tickets>);

impl Tickets {
    fn take(self: &Arc<Self>, block: bool) -> Option<Ticket> {
        let mut t = self.taken.lock().unwrap_or_else(PoisonError::into_inner);
        while *t >= self.max {
            if !block {
                return None;
            }
            t = self.freed.wait(t).unwrap_or_else(PoisonError::into_inner);
        }
        *t += 1;
        Some(Ticket(self.clone()))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        *self.0.taken.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
        self.0.freed.notify_one();
    }
}

/// How to reach the sidecar as one rank of one job.
#[derive(Debug)]
struct Dial {
    socket: PathBuf,
    job: String,
    rank: u32,
    world_size: u32,
}

/// A segment staged into: its connection (which commits it) and this process's mapping of it.
struct Slot {
    // Field order: the pinned registration goes before the mapping, the mapping before the
    // commit on the connection.
    pin: Option<Pinned>,
    map: Arc<Mapping>,
    conn: Conn<FdStream>,
}

/// The next save's segment, prepared after a commit.
#[derive(Default)]
struct Next {
    state: Mutex<Prep>,
    changed: Condvar,
}

#[derive(Default)]
enum Prep {
    #[default]
    None,
    Preparing,
    Ready(Slot),
}

impl Next {
    fn lock(&self) -> std::sync::MutexGuard<'_, Prep> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The prepared segment when it holds `len` bytes; waits for one being prepared when
    /// `block`. A prepared segment of another size is let go.
    fn take(&self, len: usize, block: bool) -> Option<Slot> {
        let mut st = self.lock();
        while block && matches!(*st, Prep::Preparing) {
            st = self
                .changed
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
        match std::mem::take(&mut *st) {
            Prep::Ready(slot) if shm::fits(slot.map.len(), len) => Some(slot),
            Prep::Preparing => {
                *st = Prep::Preparing;
                None
            }
            _ => None,
        }
    }

    /// Starts preparing unless a segment is prepared or being prepared already.
    fn start(&self) -> bool {
        let mut st = self.lock();
        if !matches!(*st, Prep::None) {
            return false;
        }
        *st = Prep::Preparing;
        true
    }

    fn finish(&self, slot: Option<Slot>) {
        *self.lock() = slot.map_or(Prep::None, Prep::Ready);
        self.changed.notify_all();
    }
}

/// The sidecar of one engine.
pub(crate) struct Client {
    dial: Arc<Dial>,
    tiers: Vec<TierKind>,
    tickets: Arc<Tickets>,
    next: Arc<Next>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("dial", &self.dial)
            .field("tiers", &self.tiers)
            .finish_non_exhaustive()
    }
}

struct SealedBytes(Arc<Sealed>, usize);

impl AsRef<[u8]> for SealedBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes()[..self.1]
    }
}

impl Dial {
    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Sidecar {
            socket: self.socket.display().to_string(),
            reason: reason.into(),
        }
    }

    fn open(&self) -> Result<(Conn<FdStream>, Vec<TierKind>)> {
        let sock =
            UnixStream::connect(&self.socket).map_err(|e| self.error(format!("connect: {e}")))?;
        let mut conn = Conn::new(
            FdStream::new(sock),
            self.socket.display().to_string(),
            Side::Local,
        );
        conn.send(&LocalMsg::Attach {
            version: PROTOCOL_VERSION,
            job: self.job.clone(),
            rank: self.rank,
            world_size: self.world_size,
        })?;
        match conn.recv()? {
            LocalMsg::Attached { tiers, .. } => Ok((conn, tiers)),
            LocalMsg::Failed { reason } => Err(self.error(reason)),
            other => Err(conn
                .violation(format!("expected attached, got {other:?}"))
                .into()),
        }
    }

    /// A segment of at least `len` bytes from the sidecar on a new connection, mapped here.
    fn stage(&self, step: u64, len: usize, wait: bool, ahead: bool) -> Result<Slot> {
        let (mut conn, _) = self.open()?;
        conn.send(&LocalMsg::Stage {
            step,
            len: shm::slot_len(len) as u64,
            wait,
            ahead,
        })?;
        let fd: OwnedFd = match conn.recv()? {
            LocalMsg::Segment { .. } => conn.take_fd()?,
            LocalMsg::Failed { reason } => return Err(self.error(reason)),
            other => {
                return Err(conn
                    .violation(format!("expected a segment, got {other:?}"))
                    .into());
            }
        };
        let seg = Segment::from_fd(fd).map_err(|e| self.error(format!("shared memory: {e}")))?;
        if seg.len() < len {
            return Err(self.error(format!(
                "a {}-byte segment for a {len}-byte file",
                seg.len()
            )));
        }
        let map = seg
            .map_writable()
            .map_err(|e| self.error(format!("map shared memory: {e}")))?;
        // The descriptor is closed here: once unmapped, this process has no way left to write
        // the segment.
        drop(seg);
        Ok(Slot {
            pin: None,
            map: Arc::new(map),
            conn,
        })
    }
}

/// A promise that the next save's segment is being prepared: a save that comes meanwhile waits
/// for it. Kept by [`prepare`]; dropped unkept (the save before failed), it says there is none.
struct Promise(Option<Arc<Next>>);

impl Promise {
    /// A promise, unless one is being kept already (or a segment is ready).
    fn make(next: &Arc<Next>) -> Promise {
        Promise(next.start().then(|| next.clone()))
    }
}

impl Drop for Promise {
    fn drop(&mut self) {
        if let Some(next) = self.0.take() {
            next.finish(None);
        }
    }
}

/// Keeps `promise`: prepares the next save's segment in the background, at a lower priority;
/// see the module docs. `ordinal`: the GPU the last save copied from, to register the segment
/// with.
fn prepare(
    mut promise: Promise,
    inner: Arc<Inner>,
    dial: Arc<Dial>,
    step: u64,
    len: usize,
    ordinal: Option<usize>,
) {
    let Some(next) = promise.0.take() else {
        return;
    };
    let done = next.clone();
    let work = move || {
        background_priority();
        let slot = dial.stage(step, len, false, true).and_then(|mut slot| {
            slot.map
                .prepare_for_writes()
                .map_err(|e| dial.error(format!("map the next segment: {e}")))?;
            if let Some(ordinal) = ordinal {
                match inner
                    .gpu
                    .pin(ordinal, slot.map.ptr().cast_const(), slot.map.len())
                {
                    Ok(p) => slot.pin = Some(p),
                    Err(e) => warn!(error = %e, "cannot pin the next segment; its save will try"),
                }
            }
            Ok(slot)
        });
        match slot {
            Ok(slot) => next.finish(Some(slot)),
            Err(e) => {
                debug!(error = %e, "no segment prepared for the next save");
                next.finish(None);
            }
        }
    };
    let spawned = std::thread::Builder::new()
        .name("hotstart-ckpt-prepare".into())
        .spawn(work);
    if let Err(e) = spawned {
        debug!(error = %e, "cannot start preparing the next segment");
        // The closure never ran: nothing else will say it is done.
        done.finish(None);
    }
}

impl Client {
    /// Connects once to check that the sidecar at `socket` serves this rank.
    pub(crate) fn attach(
        socket: &Path,
        job: &str,
        rank: u32,
        world_size: u32,
        max_inflight: usize,
    ) -> Result<Client> {
        let dial = Arc::new(Dial {
            socket: socket.to_path_buf(),
            job: job.to_string(),
            rank,
            world_size,
        });
        let (_, tiers) = dial.open()?;
        Ok(Client {
            dial,
            tiers,
            tickets: Arc::new(Tickets {
                max: max_inflight.max(1),
                taken: Mutex::new(0),
                freed: Condvar::new(),
            }),
            next: Arc::default(),
        })
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        self.dial.error(reason)
    }

    /// A new attached connection.
    pub(crate) fn connect(&self) -> Result<Conn<FdStream>> {
        self.dial.open().map(|(c, _)| c)
    }

    /// The socket.
    pub(crate) fn socket(&self) -> &Path {
        &self.dial.socket
    }

    /// The tiers a save goes to, nearest first.
    pub(crate) fn tiers(&self) -> Vec<TierKind> {
        self.tiers.clone()
    }

    /// The newest step complete for every rank, as the sidecar sees it.
    pub(crate) fn latest(&self) -> Result<Option<u64>> {
        let mut conn = self.connect()?;
        conn.send(&LocalMsg::Latest)?;
        match conn.recv()? {
            LocalMsg::LatestIs { step } => Ok(step),
            LocalMsg::Failed { reason } => Err(self.error(reason)),
            other => Err(conn
                .violation(format!("expected latest, got {other:?}"))
                .into()),
        }
    }

    /// Saves through the sidecar; see the module docs.
    pub(crate) fn save(
        &self,
        engine: &Engine,
        step: u64,
        layout: Layout,
        tensors: Vec<Tensor>,
        extras: Extras,
    ) -> Result<SaveHandle> {
        let inner = engine.inner.clone();
        let handle = |shared| SaveHandle {
            shared,
            step,
            rank: self.dial.rank,
            inflight: self.tickets.max,
        };
        let block = engine.when_full() == WhenFull::Block;
        let Some(ticket) = self.tickets.take(block) else {
            engine.count_skip(step);
            return Ok(handle(Shared::skipped(step)));
        };
        let len = layout.file_len as usize;
        let ordinal = tensors.iter().find_map(|t| match t.source() {
            Source::Device(d) => Some(d.ordinal),
            Source::Host(_) => None,
        });
        let asked = Instant::now();
        let (slot, promise) = match self.next.take(len, block) {
            Some(slot) => {
                debug!(
                    step,
                    waited = asked.elapsed().as_secs_f64(),
                    "prepared segment"
                );
                // The next one is prepared once this save is committed (its segment is then
                // the newest step's, and an older one can be recycled); a save that comes
                // before that waits for it.
                (slot, Promise::make(&self.next))
            }
            None => {
                debug!(step, "no prepared segment; asking for one");
                let slot = self.dial.stage(step, len, block, false)?;
                // The next save's segment is new memory too: start on it now, so that it is
                // ready by the next save even when saves come soon after one another.
                prepare(
                    Promise::make(&self.next),
                    engine.inner.clone(),
                    self.dial.clone(),
                    step,
                    len,
                    ordinal,
                );
                (slot, Promise(None))
            }
        };
        let shared = Shared::new(step, &self.tiers);
        let job = SidecarSave {
            inner,
            shared: shared.clone(),
            step,
            layout,
            tensors,
            extras,
            ticket,
            dial: self.dial.clone(),
            promise,
            ordinal,
        };
        engine.spawn_tracked(format!("hotstart-ckpt-save-{step}"), &shared, move || {
            job.run(slot)
        })?;
        Ok(handle(shared))
    }

    /// Loads through the sidecar on `conn`; see the module docs.
    pub(crate) fn load(
        &self,
        inner: &Inner,
        mut conn: Conn<FdStream>,
        which: StepSel,
        dest: Destination<'_>,
    ) -> Result<Loaded> {
        let started = Instant::now();
        let want = match which {
            StepSel::Latest => None,
            StepSel::Step(s) => Some(s),
        };
        conn.send(&LocalMsg::Restore { step: want })?;
        let (step, source, json, chunk_sources, seconds) = match conn.recv()? {
            LocalMsg::Restored {
                step,
                source,
                manifest,
                chunk_sources,
                seconds,
            } => (step, source, manifest, chunk_sources, seconds),
            LocalMsg::NotFound { step } => {
                return Err(Error::NotFound {
                    job: self.dial.job.clone(),
                    step,
                    rank: self.dial.rank,
                });
            }
            LocalMsg::Failed { reason } => return Err(self.error(reason)),
            other => {
                return Err(conn
                    .violation(format!("expected a restore, got {other:?}"))
                    .into());
            }
        };
        let fd = conn.take_fd()?;
        let location = format!("step {step} rank {} from the sidecar", self.dial.rank);
        if want.is_some_and(|s| s != step) {
            return Err(self.error(format!("asked for step {want:?}, got step {step}")));
        }
        let m = Manifest::parse_for(
            json.as_bytes(),
            &location,
            &self.dial.job,
            step,
            self.dial.rank,
            self.dial.world_size,
        )?;
        let len = load::file_len(&m)?;
        let sealed = Arc::new(
            Sealed::open(fd, len).map_err(|e| self.error(format!("restored segment: {e}")))?,
        );
        let mut targets = load::targets(step, &m, dest)?;
        let direct = std::mem::take(&mut targets.direct);
        // Straight from the segment's pages into the caller's: one copy, and no page faults
        // on a mapping of the segment (only the header and owned tensors are read through it).
        load::copy_out(
            &|at, dst| sealed.read_at(at, dst),
            direct,
            m.chunk_size as usize,
            inner.threads,
        )
        .map_err(|e| self.error(format!("read the restored segment: {e}")))?;
        let all = Bytes::from_owner(SealedBytes(sealed, len));
        let loaded = inner.finish(step, m, all, targets, chunk_sources)?;
        info!(
            step,
            %source,
            sidecar_seconds = seconds,
            seconds = started.elapsed().as_secs_f64(),
            "restored through the sidecar"
        );
        Ok(loaded)
    }
}

/// One save through the sidecar: its background work.
struct SidecarSave {
    inner: Arc<Inner>,
    shared: Arc<Shared>,
    step: u64,
    layout: Layout,
    tensors: Vec<Tensor>,
    extras: Extras,
    ticket: Ticket,
    /// To prepare the next save's segment after the commit.
    dial: Arc<Dial>,
    promise: Promise,
    /// The GPU the save copies from, to register the next segment with.
    ordinal: Option<usize>,
}

impl SidecarSave {
    fn run(self, slot: Slot) {
        let shared = self.shared.clone();
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.work(slot)));
        if res.is_err() {
            error!("sidecar save thread panicked");
            shared.fail_pending(Arc::new(Error::Task {
                what: "save thread",
                message: "panic".into(),
            }));
        }
    }

    fn work(self, slot: Slot) {
        let SidecarSave {
            inner,
            shared,
            step,
            layout,
            tensors,
            extras,
            ticket,
            dial,
            promise,
            ordinal,
        } = self;
        let Slot {
            mut pin,
            map,
            mut conn,
        } = slot;
        let len = layout.file_len as usize;
        let region: Arc<dyn Region> = map.clone();
        let image = Staging::new(region, len);
        let abandon = FailUnlessComplete(&image);
        let res = engine::stage(
            &inner,
            Some((map.ptr().cast_const(), map.len())),
            &mut pin,
            &image,
            &layout,
            &tensors,
        );
        drop(tensors);
        let staged = match res.and_then(|()| image.complete()) {
            Ok(s) => s,
            Err(e) => {
                error!(step, error = %e, "checkpoint staging failed");
                shared.fail_pending(Arc::new(e));
                return;
            }
        };
        shared.set_staged(Phase::Done);
        let manifest = engine::manifest_for(&inner, step, &layout, staged.as_ref(), &extras);
        // Unmap before committing: once committed, the segment is the sidecar's alone. The
        // pinned registration goes first.
        drop(staged);
        drop(abandon);
        drop(image);
        drop(pin);
        drop(map);
        let manifest = String::from_utf8(manifest).unwrap_or_default();
        let committed = conn
            .send(&LocalMsg::Commit { manifest })
            .and_then(|()| conn.recv());
        match committed {
            Ok(LocalMsg::Committed) => {
                // Preparing before the handle says so: a save that follows at once waits for
                // the prepared segment rather than asking for another.
                prepare(promise, inner, dial, step, len, ordinal);
                shared.set_tier(TierKind::Memory, Phase::Done);
            }
            Ok(LocalMsg::Failed { reason }) => {
                let e = Error::Sidecar {
                    socket: conn.label().to_string(),
                    reason: format!("commit refused: {reason}"),
                };
                error!(step, error = %e, "checkpoint not committed");
                shared.fail_pending(Arc::new(e));
                return;
            }
            Ok(other) => {
                shared.fail_pending(Arc::new(
                    conn.violation(format!("expected committed, got {other:?}"))
                        .into(),
                ));
                return;
            }
            Err(e) => {
                error!(step, error = %e, "checkpoint not committed");
                shared.fail_pending(Arc::new(e.into()));
                return;
            }
        }
        drop(ticket);
        // Every other tier reports when it is done.
        while !shared.status().all_finished() {
            match conn.recv::<LocalMsg>() {
                Ok(LocalMsg::Persisted { tier, error: None }) => shared.set_tier(tier, Phase::Done),
                Ok(LocalMsg::Persisted {
                    tier,
                    error: Some(reason),
                }) => {
                    let e = Error::Sidecar {
                        socket: conn.label().to_string(),
                        reason,
                    };
                    warn!(step, %tier, error = %e, "checkpoint not persisted by the sidecar");
                    shared.set_tier(tier, Phase::Failed(Arc::new(e)));
                }
                Ok(other) => {
                    shared.fail_pending(Arc::new(
                        conn.violation(format!("expected progress, got {other:?}"))
                            .into(),
                    ));
                    return;
                }
                Err(e) => {
                    let e = Error::Sidecar {
                        socket: conn.label().to_string(),
                        reason: format!("lost before every tier reported: {e}"),
                    };
                    shared.fail_pending(Arc::new(e));
                    return;
                }
            }
        }
    }
}
