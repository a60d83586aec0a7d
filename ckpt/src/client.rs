//! The engine's client of the sidecar: the segments saves stage into, their commit, and the
//! steps the sidecar restores. Used when [`EngineConfig::sidecar`](crate::EngineConfig::sidecar)
//! is set; the save itself runs the one pipeline of `crate::save` with a [`Lease`] as its
//! target and sink.
//!
//! **Save.** A save stages into a segment prepared for it ([`Next`]): right after each commit,
//! a background thread asks the sidecar for the next save's segment
//! (`Stage{ahead}`; in the steady state the segment of an older step, recycled), maps it and
//! maps every page of it now (`MADV_POPULATE_WRITE`: the pages exist, only the page tables are
//! filled), registered as pinned memory for the GPU when the last save had device tensors. So
//! `save` itself only takes the prepared segment and copies: no round trip, no page faults, no
//! memory new to either process. The first save of an engine (and one whose size changed)
//! asks for its segment itself and maps it as it copies. Once staged and hashed, the lease
//! **unmaps** the segment and commits it with the manifest ([`Lease::commit`]). The sidecar
//! checks the hashes and holds it, reachable by no other process: the `Memory` phase is done,
//! and the step survives a crash of this process. The sidecar then reports the other tiers
//! (peers, disk, store) on the same connection as they finish.
//!
//! **Restore** ([`Client::restore`]) asks for a step (or the newest complete for every rank)
//! and receives the sealed segment; it checks the seals and maps it read-only. `crate::load`
//! hands its tensors out ([`Restored`]). A step that is in no memory but on the sidecar's disk
//! comes as that file instead, opened read-only ([`Handed::File`]): `crate::load` reads it
//! straight into the caller's buffers and verifies every chunk, as from a disk tier of its
//! own, so a restore on a node that kept its disk runs at the disk's speed without the
//! sidecar first copying the step into memory new to it.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

use crate::cuda::{Gpu, Pinned};
use crate::error::{Error, Result};
use crate::format::Manifest;
use crate::handle::{Phase, Shared};
use crate::staging::Region;
use crate::tier::TierKind;
use hotstart_proto::PROTOCOL_VERSION;
use hotstart_proto::shm::{self, Mapping, Sealed, Segment};
use hotstart_proto::wire::{Conn, DeviceCopy, FdStream, LinkError, LocalMsg, Side};

/// How to reach the sidecar as one rank of one job.
#[derive(Debug)]
struct Dial {
    socket: PathBuf,
    job: String,
    rank: u32,
    world_size: u32,
    /// How long the engine's construction, a save and a read with nowhere else to go wait for
    /// a sidecar that is gone (`EngineConfig::sidecar_wait`).
    wait: Duration,
}

/// A segment staged into: its connection (which commits it) and this process's mapping of it.
struct Slot {
    // Field order: the pinned registration goes before the mapping, the mapping before the
    // commit on the connection.
    pin: Option<Pinned>,
    map: Arc<Mapping>,
    /// The segment through a descriptor that cannot write it, kept until the sidecar has
    /// acknowledged the commit: the bytes to hand to its next life should it go away before.
    kept: Segment,
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
    next: Arc<Next>,
    /// The engine's GPU contexts, to register prepared segments with.
    gpu: Arc<Gpu>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("dial", &self.dial)
            .field("tiers", &self.tiers)
            .finish_non_exhaustive()
    }
}

impl Dial {
    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Sidecar {
            socket: self.socket.display().to_string(),
            reason: reason.into(),
        }
    }

    /// Connects: at once, or, with `wait`, retrying while the socket is missing or refuses
    /// (a sidecar restarting) until `wait` has passed.
    fn connect(&self, wait: Duration) -> Result<UnixStream> {
        let deadline = Instant::now() + wait;
        let mut told = false;
        loop {
            match UnixStream::connect(&self.socket) {
                Ok(sock) => return Ok(sock),
                Err(e) if Instant::now() < deadline && restarting(&e) => {
                    if !told {
                        warn!(socket = %self.socket.display(), error = %e, "sidecar unreachable; waiting for it to come back");
                        told = true;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => {
                    let hint = if restarting(&e) {
                        ". Is `hotstart serve` running on this node with --socket at this path? \
                         Start it (or fix HOTSTART_SOCKET / sidecar=)"
                    } else {
                        ""
                    };
                    return Err(self.error(format!("connect: {e}{hint}")));
                }
            }
        }
    }

    fn open(&self) -> Result<(Conn<FdStream>, Vec<TierKind>)> {
        self.open_within(Duration::ZERO)
    }

    /// A new attached connection, waiting up to `wait` for a sidecar that is restarting. A
    /// sidecar that accepts the connection and does not answer within [`ATTACH_ANSWER`] (one
    /// stopped, or hung) is waited for in the same way, never forever.
    fn open_within(&self, wait: Duration) -> Result<(Conn<FdStream>, Vec<TierKind>)> {
        let deadline = Instant::now() + wait;
        loop {
            let sock = self.connect(deadline.saturating_duration_since(Instant::now()))?;
            sock.set_read_timeout(Some(ATTACH_ANSWER))
                .map_err(|e| self.error(format!("set a read timeout: {e}")))?;
            let mut conn = Conn::new(
                FdStream::new(sock),
                self.socket.display().to_string(),
                Side::Local,
            );
            let asked = Instant::now();
            let answer = conn
                .send(&LocalMsg::Attach {
                    version: PROTOCOL_VERSION,
                    job: self.job.clone(),
                    rank: self.rank,
                    world_size: self.world_size,
                })
                .and_then(|()| conn.recv());
            match answer {
                Ok(LocalMsg::Attached { tiers, .. }) => {
                    // Later answers may take long (a save waiting for memory, a restore).
                    conn.get_ref()
                        .socket()
                        .set_read_timeout(None)
                        .map_err(|e| self.error(format!("clear the read timeout: {e}")))?;
                    return Ok((conn, tiers));
                }
                Ok(LocalMsg::Failed { reason }) => return Err(self.error(reason)),
                Ok(other) => {
                    return Err(conn
                        .violation(format!("expected attached, got {other:?}"))
                        .into());
                }
                Err(_) if asked.elapsed() >= ATTACH_ANSWER && Instant::now() >= deadline => {
                    return Err(self.error(format!(
                        "the sidecar accepted the connection but did not answer within {} s: is \
                         it stopped (SIGSTOP, a debugger) or hung? Restart it (its log may say \
                         why)",
                        ATTACH_ANSWER.as_secs()
                    )));
                }
                Err(e) if asked.elapsed() >= ATTACH_ANSWER => {
                    warn!(socket = %self.socket.display(), error = %e, "the sidecar does not answer; waiting for it");
                }
                Err(e) => self.gone_while_restarting(&conn, e, deadline)?,
            }
        }
    }

    /// A connection that broke before its answer: a sidecar killed as it accepted it (one that
    /// is restarting) is waited for as one whose socket refuses, until `deadline`; anything
    /// else, or past the deadline, is the error.
    fn gone_while_restarting(
        &self,
        conn: &Conn<FdStream>,
        e: LinkError,
        deadline: Instant,
    ) -> Result<()> {
        if conn.violated() || Instant::now() >= deadline {
            return Err(e.into());
        }
        warn!(socket = %self.socket.display(), error = %e, "the sidecar went away; waiting for it to come back");
        std::thread::sleep(Duration::from_millis(100));
        Ok(())
    }

    /// A segment of at least `len` bytes from the sidecar on a new connection, mapped here.
    /// A save waits up to `self.wait` for a sidecar that is restarting: one whose socket is
    /// gone or refuses, or one that is draining before it stops.
    fn stage(&self, step: u64, len: usize, wait: bool, ahead: bool) -> Result<Slot> {
        let patience = if ahead { Duration::ZERO } else { self.wait };
        let deadline = Instant::now() + patience;
        let (fd, conn) = loop {
            let (mut conn, _) =
                self.open_within(deadline.saturating_duration_since(Instant::now()))?;
            let answer = conn
                .send(&LocalMsg::Stage {
                    step,
                    len: shm::slot_len(len) as u64,
                    wait,
                    ahead,
                })
                .and_then(|()| conn.recv());
            let answer = match answer {
                Ok(a) => a,
                Err(e) => {
                    self.gone_while_restarting(&conn, e, deadline)?;
                    continue;
                }
            };
            match answer {
                LocalMsg::Segment { .. } => break (conn.take_fd()?, conn),
                LocalMsg::Draining if Instant::now() < deadline => {
                    debug!(step, "the sidecar is draining; waiting for its next life");
                    std::thread::sleep(Duration::from_millis(100));
                }
                LocalMsg::Draining => {
                    return Err(self.error(
                        "the sidecar is shutting down and takes no new saves; none came back \
                         in time",
                    ));
                }
                LocalMsg::Failed { reason } => return Err(self.error(reason)),
                other => {
                    return Err(conn
                        .violation(format!("expected a segment, got {other:?}"))
                        .into());
                }
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
        // The writable descriptor is closed here: once unmapped, this process has no way left
        // to write the segment.
        let kept = seg
            .read_only()
            .map_err(|e| self.error(format!("reopen shared memory read-only: {e}")))?;
        drop(seg);
        Ok(Slot {
            pin: None,
            map: Arc::new(map),
            kept,
            conn,
        })
    }

    /// A segment of the sidecar that answers now (waiting for it as [`Dial::stage`] does),
    /// with the `len` bytes of `from` copied in and told filled with `manifest`: a step handed
    /// again after the sidecar that held it went away (`why`).
    fn restage(&self, step: u64, from: &[u8], manifest: Option<&str>, why: &Error) -> Result<Slot> {
        warn!(step, error = %why, "sidecar connection lost before the commit; handing the step to the sidecar again");
        let mut fresh = self.stage(step, from.len(), true, false)?;
        // SAFETY: `stage` checked that the new mapping holds at least `from.len()` bytes; it was
        // just made, so nothing else touches it, and `from` is another segment's memory.
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), fresh.map.ptr(), from.len()) };
        if let Some(manifest) = manifest {
            fresh.conn.send(&LocalMsg::Filled {
                manifest: manifest.to_string(),
            })?;
        }
        Ok(fresh)
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

/// Keeps `promise`: prepares the next save's segment in the background, at training's own
/// priority (the next save waits for it; on cores that training keeps busy a lower one only
/// postpones the work until that save blocks on it); see the module docs. `ordinal`: the GPU
/// the last save copied from, to register the segment with.
fn prepare(
    mut promise: Promise,
    gpu: Arc<Gpu>,
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
        let slot = dial.stage(step, len, false, true).and_then(|mut slot| {
            slot.map
                .prepare_for_writes()
                .map_err(|e| dial.error(format!("map the next segment: {e}")))?;
            if let Some(ordinal) = ordinal {
                match gpu.pin(ordinal, slot.map.ptr().cast_const(), slot.map.len()) {
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
    /// Connects once to check that the sidecar at `socket` serves this rank, waiting up to
    /// `wait` for one that is gone: restarting, or started with the job and not listening yet.
    pub(crate) fn attach(
        socket: &Path,
        job: &str,
        rank: u32,
        world_size: u32,
        wait: Duration,
        gpu: Arc<Gpu>,
    ) -> Result<Client> {
        let dial = Arc::new(Dial {
            socket: socket.to_path_buf(),
            job: job.to_string(),
            rank,
            world_size,
            wait,
        });
        let (_, tiers) = dial.open_within(wait)?;
        Ok(Client {
            dial,
            tiers,
            next: Arc::default(),
            gpu,
        })
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        self.dial.error(reason)
    }

    /// The sidecar could not read `tier`.
    fn unavailable(&self, tier: TierKind, reason: String) -> Error {
        Error::unavailable(tier, &self.dial.job, self.error(reason))
    }

    /// Every step complete for every rank as the sidecar finds them, ascending, asked on
    /// `conn` (from [`Client::connect`]).
    pub(crate) fn steps(&self, conn: &mut Conn<FdStream>) -> Result<Vec<u64>> {
        let mut steps = Vec::new();
        let mut next = self.latest(conn)?;
        while let Some(step) = next {
            steps.push(step);
            next = self.latest_below(conn, step)?;
        }
        steps.reverse();
        Ok(steps)
    }

    /// A new attached connection.
    pub(crate) fn connect(&self) -> Result<Conn<FdStream>> {
        self.dial.open().map(|(c, _)| c)
    }

    /// A new attached connection, waiting as a save does for a sidecar that is gone.
    pub(crate) fn connect_waiting(&self) -> Result<Conn<FdStream>> {
        self.dial.open_within(self.dial.wait).map(|(c, _)| c)
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
    pub(crate) fn latest(&self, conn: &mut Conn<FdStream>) -> Result<Option<u64>> {
        self.ask_latest(conn, LocalMsg::Latest)
    }

    /// The newest step complete for every rank that is older than `step`.
    pub(crate) fn latest_below(&self, conn: &mut Conn<FdStream>, step: u64) -> Result<Option<u64>> {
        self.ask_latest(conn, LocalMsg::LatestBelow { step })
    }

    /// The newest checkpoint as the sidecar finds them whatever world size saved it (older
    /// than `below`), and that world size.
    pub(crate) fn latest_checkpoint(
        &self,
        conn: &mut Conn<FdStream>,
        below: Option<u64>,
    ) -> Result<Option<(u64, u32)>> {
        conn.send(&LocalMsg::LatestCheckpoint { below })?;
        match conn.recv()? {
            LocalMsg::CheckpointIs { found } => Ok(found),
            other => Err(self.refused(conn, other, "a checkpoint")),
        }
    }

    /// `rank`'s manifest of `step`, whatever world size saved it, from the nearest holder the
    /// sidecar knows (its memory, its peers', its disk, the store); [`Error::NotFound`] when
    /// none holds it.
    pub(crate) fn manifest(
        &self,
        conn: &mut Conn<FdStream>,
        step: u64,
        rank: u32,
    ) -> Result<Manifest> {
        conn.send(&LocalMsg::Manifest { step, rank })?;
        let json = match conn.recv()? {
            LocalMsg::ManifestIs { manifest } => manifest,
            LocalMsg::NotFound { .. } => {
                return Err(Error::NotFound {
                    job: self.dial.job.clone(),
                    step: Some(step),
                    rank,
                });
            }
            other => return Err(self.refused(conn, other, "a manifest")),
        };
        let location = format!("step {step} rank {rank} from the sidecar");
        let m = Manifest::parse(json.as_bytes(), &location)?;
        if (m.job.as_str(), m.step, m.rank) != (self.dial.job.as_str(), step, rank) {
            return Err(self.error(format!(
                "asked for the manifest of step {step} rank {rank}, got job {:?} step {} rank {}",
                m.job, m.step, m.rank
            )));
        }
        Ok(m)
    }

    /// The error for an answer that is not the `expected` one: a refusal the sidecar gave,
    /// or a protocol violation.
    fn refused(&self, conn: &mut Conn<FdStream>, answer: LocalMsg, expected: &str) -> Error {
        match answer {
            LocalMsg::Unavailable { tier, reason } => self.unavailable(tier, reason),
            LocalMsg::Failed { reason } => self.error(reason),
            other => conn
                .violation(format!("expected {expected}, got {other:?}"))
                .into(),
        }
    }

    fn ask_latest(&self, conn: &mut Conn<FdStream>, ask: LocalMsg) -> Result<Option<u64>> {
        conn.send(&ask)?;
        match conn.recv()? {
            LocalMsg::LatestIs { step } => Ok(step),
            other => Err(self.refused(conn, other, "latest")),
        }
    }

    /// The segment a save of `len` bytes stages into: the one prepared ahead, else a new one
    /// (and the next save's is prepared at once). `ordinal`: the GPU the save copies from.
    pub(crate) fn lease(
        &self,
        step: u64,
        len: usize,
        block: bool,
        ordinal: Option<usize>,
    ) -> Result<Lease> {
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
                    self.gpu.clone(),
                    self.dial.clone(),
                    step,
                    len,
                    ordinal,
                );
                (slot, Promise(None))
            }
        };
        Ok(Lease {
            slot,
            told: None,
            retired: None,
            promise,
            dial: self.dial.clone(),
            gpu: self.gpu.clone(),
            step,
            len,
            ordinal,
        })
    }

    /// Asks the sidecar on `conn` for `want` (the newest step complete for every rank when
    /// `None`) and receives it, as a file of its disk tier where it has one and `file`
    /// allows it; see the module docs. `regions`: the only byte ranges the process reads.
    pub(crate) fn restore(
        &self,
        mut conn: Conn<FdStream>,
        want: Option<u64>,
        file: bool,
        regions: Option<Vec<crate::format::Region>>,
    ) -> Result<Restored> {
        conn.send(&LocalMsg::Restore {
            step: want,
            file,
            regions,
        })?;
        let (step, source, json, chunk_sources, seconds, is_file) = match conn.recv()? {
            LocalMsg::Restored {
                step,
                source,
                manifest,
                chunk_sources,
                seconds,
                file: is_file,
            } if file || !is_file => (step, source, manifest, chunk_sources, seconds, is_file),
            LocalMsg::NotFound { step } => {
                return Err(Error::NotFound {
                    job: self.dial.job.clone(),
                    step,
                    rank: self.dial.rank,
                });
            }
            LocalMsg::Corrupt {
                step,
                chunk,
                reason,
            } => {
                return Err(Error::Corrupt {
                    step,
                    rank: self.dial.rank,
                    chunk,
                    reason,
                });
            }
            LocalMsg::Unavailable { tier, reason } => return Err(self.unavailable(tier, reason)),
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
        let manifest = Manifest::parse_for(
            json.as_bytes(),
            &location,
            &self.dial.job,
            step,
            self.dial.rank,
            self.dial.world_size,
        )?;
        let len = usize::try_from(manifest.file_len)
            .map_err(|_| self.error("a restored file larger than the address space"))?;
        let handed = if is_file {
            Handed::File(std::fs::File::from(fd))
        } else {
            Handed::Segment(Arc::new(
                Sealed::open(fd, len).map_err(|e| self.error(format!("restored segment: {e}")))?,
            ))
        };
        Ok(Restored {
            manifest,
            handed,
            chunk_sources,
            source,
            seconds,
            conn,
        })
    }

    /// Asks the sidecar on `conn`, which just handed over a step's segment, to copy these
    /// ranges of it into this process's device memory itself (`LocalMsg::Upload`); the bytes
    /// copied, once every copy is done. An error names why it did not: the caller copies them.
    pub(crate) fn upload(&self, conn: &mut Conn<FdStream>, copies: Vec<DeviceCopy>) -> Result<u64> {
        conn.send(&LocalMsg::Upload { copies })?;
        match conn.recv()? {
            LocalMsg::Uploaded { bytes, .. } => Ok(bytes),
            LocalMsg::Failed { reason } => Err(self.error(reason)),
            other => Err(conn
                .violation(format!("expected an upload's answer, got {other:?}"))
                .into()),
        }
    }
}

/// What the sidecar handed over with a step.
pub(crate) enum Handed {
    /// Its sealed segment, mapped read-only. The sidecar checked the bytes against the
    /// manifest's hashes when it took them, and they cannot have changed since.
    Segment(Arc<Sealed>),
    /// The step's file on the sidecar's disk, open read-only, not verified yet: the fastest
    /// way to a step that is on this node's disk and in no memory, read straight into the
    /// process's buffers with no copy in between.
    File(std::fs::File),
}

/// A step the sidecar handed over: its manifest (checked against the job, step and rank asked
/// for) and its bytes.
pub(crate) struct Restored {
    pub(crate) manifest: Manifest,
    pub(crate) handed: Handed,
    /// The tier each chunk came from.
    pub(crate) chunk_sources: Vec<TierKind>,
    /// The tier the sidecar served it from, and the seconds it took.
    pub(crate) source: TierKind,
    pub(crate) seconds: f64,
    /// The connection it came on, for an `Upload` of the segment's bytes.
    pub(crate) conn: Conn<FdStream>,
}

/// How long a sidecar that accepted a connection has to answer its first message: it answers
/// at once from its accept loop, so one that takes this long is stopped or hung.
const ATTACH_ANSWER: Duration = Duration::from_secs(10);

/// How many times a filled step is handed to a sidecar again after the one before went away
/// before it acknowledged the commit.
const HAND_AGAIN: u32 = 3;

/// Whether a failed connect looks like a sidecar between two lives: its socket gone or not
/// accepting yet.
fn restarting(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
    )
}

/// A segment of the sidecar's memory lent to one save until it is committed; see
/// `crate::save`.
///
/// **A sidecar that restarts under a save.** If the connection breaks before the sidecar was
/// told the segment is filled (the sidecar was stopped or crashed, and its new life knows
/// nothing of this segment), the lease asks the sidecar for a new segment (waiting for it to
/// come back, up to `EngineConfig::sidecar_wait`), copies the file over from the old segment,
/// which this process still maps, and tells the new one instead: training sees no error. A segment
/// prepared ahead by a sidecar that has since gone is found out the same way, on its first
/// message. A sidecar lost after `Filled` and before it acknowledged the commit (stopped
/// between its drain and its exit, or crashed) is handled alike, from the read-only descriptor
/// this process keeps until the acknowledgement: the training process may have reused its
/// memory by then, but the segment still holds the step.
pub(crate) struct Lease {
    slot: Slot,
    /// The manifest sent with `Filled`, to send again after a reconnection.
    told: Option<String>,
    /// The slot of a sidecar that went away, kept mapped (and registered) until the lease ends.
    retired: Option<Box<Slot>>,
    /// Kept once the save is committed: the next save's segment is then prepared.
    promise: Promise,
    dial: Arc<Dial>,
    gpu: Arc<Gpu>,
    step: u64,
    len: usize,
    /// The GPU the save copies from, to register the next segment with.
    ordinal: Option<usize>,
}

impl Lease {
    /// The mapped segment, to stage into.
    pub(crate) fn region(&self) -> Arc<dyn Region> {
        self.slot.map.clone()
    }

    /// What staging into the segment needs: its address and length, and its pinned-memory
    /// registration (made while the next segment was prepared, or by the save on first use),
    /// lent out until [`Lease::set_pin`].
    pub(crate) fn staging(&mut self) -> (Option<(*const u8, usize)>, Option<Pinned>) {
        let Slot { pin, map, .. } = &mut self.slot;
        (Some((map.ptr().cast_const(), map.len())), pin.take())
    }

    /// Gives back the registration `staging` lent out (`None` if it was never made), to the
    /// mapping it registered.
    pub(crate) fn set_pin(&mut self, pin: Option<Pinned>) {
        if pin.is_some() {
            match self.retired.as_deref_mut() {
                Some(old) => old.pin = pin,
                None => self.slot.pin = pin,
            }
        }
    }

    /// Tells the sidecar that every byte is in place (`Filled`, with the manifest whose hashes
    /// are still to be computed): from then on the step survives this process. A connection
    /// that broke is made again (see the type's docs).
    pub(crate) fn filled(&mut self, manifest: Vec<u8>) -> Result<()> {
        let manifest = String::from_utf8(manifest).unwrap_or_default();
        self.told = Some(manifest.clone());
        match self.slot.conn.send(&LocalMsg::Filled { manifest }) {
            Ok(()) => Ok(()),
            Err(e) if !self.slot.conn.violated() => self.rehome(&e.into()),
            Err(e) => Err(e.into()),
        }
    }

    /// The sidecar's connection broke (`why`) before it took the segment: stages the same
    /// bytes into a segment of the sidecar that answers now, and tells it they are filled.
    fn rehome(&mut self, why: &Error) -> Result<()> {
        // SAFETY: the lease's mapping holds at least `len` bytes (checked when it was made);
        // it is this lease's, and written by no one any more.
        let from =
            unsafe { std::slice::from_raw_parts(self.slot.map.ptr().cast_const(), self.len) };
        let fresh = self
            .dial
            .restage(self.step, from, self.told.as_deref(), why)?;
        // The old mapping stays until the lease ends: its registration, if staging made one,
        // is given back to it (`set_pin`) and must go first.
        self.retired = Some(Box::new(std::mem::replace(&mut self.slot, fresh)));
        Ok(())
    }

    /// Unmaps the filled segment and commits it: the sidecar hashes it (the manifest went with
    /// `Filled`) and holds it, and the memory tier is done. The connection then carries the
    /// sidecar's reports of every other tier ([`Committed::follow`]); `None` after a failure,
    /// which is on the handle.
    pub(crate) fn commit(self, shared: &Shared) -> Option<Committed> {
        let Lease {
            slot,
            promise,
            dial,
            gpu,
            step,
            len,
            ordinal,
            told,
            ..
        } = self;
        // The pinned registration goes first, then the mapping: this process has no way left
        // to write the segment (the sidecar seals it against writes, which a writable mapping
        // anywhere would prevent); it keeps only a descriptor that cannot write.
        let Slot {
            pin,
            map,
            mut kept,
            mut conn,
        } = slot;
        drop(pin);
        drop(map);
        let mut handed = 0;
        let committed = loop {
            let why = match conn.send(&LocalMsg::Commit).and_then(|()| conn.recv()) {
                Err(e) if !conn.violated() && handed < HAND_AGAIN => Error::from(e),
                answer => break answer.map_err(Error::from),
            };
            // The sidecar went away before it acknowledged the commit: its next life gets the
            // step from the segment this process still holds.
            handed += 1;
            let again = kept
                .map_read_only()
                .map_err(|e| dial.error(format!("map the filled segment again: {e}")))
                .and_then(|held| dial.restage(step, &held.bytes()[..len], told.as_deref(), &why));
            match again {
                Ok(Slot {
                    pin,
                    map,
                    kept: k,
                    conn: c,
                }) => {
                    drop(pin);
                    drop(map);
                    (kept, conn) = (k, c);
                }
                Err(e) => break Err(e),
            }
        };
        // Held by the sidecar, or lost: either way no longer this process's to hand over.
        drop(kept);
        match committed {
            Ok(LocalMsg::Committed) => {
                // Preparing before the handle says so: a save that follows at once waits for
                // the prepared segment rather than asking for another.
                prepare(promise, gpu, dial, step, len, ordinal);
                shared.set_tier(TierKind::Memory, Phase::Done);
            }
            Ok(LocalMsg::Failed { reason }) => {
                let e = Error::Sidecar {
                    socket: conn.label().to_string(),
                    reason: format!("commit refused: {reason}"),
                };
                error!(step, error = %e, "checkpoint not committed");
                shared.fail_pending(Arc::new(e));
                return None;
            }
            Ok(other) => {
                shared.fail_pending(Arc::new(
                    conn.violation(format!("expected committed, got {other:?}"))
                        .into(),
                ));
                return None;
            }
            Err(e) => {
                error!(step, error = %e, "checkpoint not committed");
                shared.fail_pending(Arc::new(e));
                return None;
            }
        }
        Some(Committed { conn, step })
    }
}

/// A step committed to the sidecar: its connection, on which the other tiers report.
pub(crate) struct Committed {
    conn: Conn<FdStream>,
    step: u64,
}

impl Committed {
    /// Sets each tier's outcome on the handle as the sidecar reports it, until every tier is
    /// done.
    pub(crate) fn follow(self, shared: &Shared) {
        let Committed { mut conn, step } = self;
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
