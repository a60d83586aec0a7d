//! Peer replication over TCP: the server side of a peer connection, and [`PeerClient`], the
//! client every sidecar uses to push replicas, fetch shards back and list what a peer holds.
//!
//! A connection is authenticated first (`super::auth`), then carries any number of requests,
//! one at a time:
//!
//! ```text
//! Inventory{job}        → Held{shards}                     (memory, and this node's disk)
//! Push{shard,manifest}  → Ready, data frames →  Stored | Failed{reason}
//!                       → Failed{reason}                   (no room: the data is not sent)
//! Fetch{job,rank,step[,regions,parts]}
//!                       → Shard{shard,manifest[,chunks,parts]}, data frames | NotFound
//! Describe{job,rank,step} → Shard{shard,manifest} | NotFound
//! Piece{piece,cached_only,redirect}
//!                       → PieceIs{len}, data frames | Redirect{node} | NotFound | Failed{reason}
//!                                                          (`super::share`)
//! Piece{piece,values_only} → PieceIs{len}, data frames (a range's parts' values) | Failed{reason}
//! ```
//!
//! Shard data is sent chunk by chunk (frames never cross a chunk boundary), and the receiver
//! hashes each chunk on other threads while the next one arrives ([`recv_verified`]); a shard
//! that does not match its manifest's blake3 checksums is rejected whole and never held. A
//! peer that breaks the protocol or fails authentication loses its connection and nothing else:
//! every connection has its own thread, read and write timeouts, and bounded frames.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};

use crate::Core;
use crate::auth::{self, ClusterKey, Identity};
use crate::error::{Error, Result};
use crate::memory::{PartValues, Shard, ShardKey};
use crate::metrics::Failure;
use crate::tls::{Link, Tls};
use crate::wire::{Held, PeerMsg, ShardInfo};
use blake3::hazmat::{ChainingValue, HasherExt};
use hotstart_ckpt::format::{self, Manifest, Need, Region};
use hotstart_ckpt::parts;
use hotstart_proto::shm::Segment;
use hotstart_proto::wire::{Conn, Side};

/// Peer connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a connection may take to authenticate.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A checked manifest of a shard that arrived from a peer: it parses, and says what the shard
/// info says.
pub(crate) fn check_manifest(info: &ShardInfo, json: &str, from: &str) -> Result<Manifest> {
    let location = format!(
        "{} from {from}",
        format::manifest_key(&info.job, info.step, info.rank)
    );
    format::check_job(&info.job)?;
    let m = Manifest::parse_for(
        json.as_bytes(),
        &location,
        &info.job,
        info.step,
        info.rank,
        info.world_size,
    )?;
    if m.file_len != info.len {
        return Err(Error::format(
            "manifest",
            location,
            format!(
                "describes {} bytes, not the {} announced",
                m.file_len, info.len
            ),
        ));
    }
    Ok(m)
}

/// Bytes of shard data read from the socket at once.
const PIECE: usize = 1 << 20;

/// Pieces a receiving worker may have queued before the socket reader waits for it: enough
/// to keep it busy, few enough that it hashes each piece while it is still in cache.
const QUEUED: usize = 4;

/// What one unit of a shard's stream (a whole chunk, or one part of one) is checked against.
#[derive(Clone, Copy)]
enum Check {
    /// A whole chunk of `len` bytes: its id.
    Chunk { id: blake3::Hash, len: u64 },
    /// Part `.0` of a chunk: its chaining value, itself checked against the chunk's id.
    Part(usize, ChainingValue),
}

/// A unit's hashing in progress.
enum Hashing {
    Chunk(parts::ChunkHasher),
    Part(blake3::Hasher),
}

impl Check {
    fn start(self) -> Hashing {
        match self {
            Check::Chunk { len, .. } => Hashing::Chunk(parts::ChunkHasher::new(len)),
            Check::Part(j, _) => Hashing::Part(parts::part_hasher(j)),
        }
    }
}

impl Hashing {
    fn update(&mut self, data: &[u8]) {
        match self {
            Hashing::Chunk(h) => h.update(data),
            Hashing::Part(h) => {
                h.update(data);
            }
        }
    }

    /// Whether the unit matches `check`, and a whole chunk's part values.
    fn finish(self, check: Check) -> (bool, Vec<ChainingValue>) {
        match (self, check) {
            (Hashing::Chunk(h), Check::Chunk { id, .. }) => {
                let (got, values) = h.finish();
                (got == id, values)
            }
            (Hashing::Part(h), Check::Part(_, cv)) => (h.finalize_non_root() == cv, Vec::new()),
            _ => (false, Vec::new()),
        }
    }
}

/// A received piece of a shard, on its way to the worker that hashes its unit.
struct Piece<'a> {
    unit: usize,
    chunk: usize,
    check: Check,
    data: &'a [u8],
    last: bool,
}

/// What [`recv_verified`] found.
#[derive(Debug)]
pub(crate) struct Received {
    /// The first chunk that does not match, if any.
    pub bad: Option<usize>,
    /// The part values of every chunk that came whole and matched (empty for the others).
    pub values: Vec<Vec<ChainingValue>>,
}

/// `needs` with every chunk whole.
fn whole(needs: Vec<Need>) -> Vec<Need> {
    needs
        .into_iter()
        .map(|n| Need { parts: None, ..n })
        .collect()
}

/// Whether a need is of some parts of its chunk.
fn in_parts(n: &Need) -> bool {
    n.parts.is_some()
}

/// Every chunk of a shard, whole: what a stream carries when not told otherwise.
fn every_chunk(m: &Manifest) -> Vec<Need> {
    (0..m.chunks.len())
        .map(|chunk| Need { chunk, parts: None })
        .collect()
}

/// The bytes of the shard file `m` that a stream carrying `needs` fills, ascending.
pub fn need_ranges(m: &Manifest, needs: &[Need]) -> Vec<std::ops::Range<u64>> {
    needs
        .iter()
        .flat_map(|n| {
            let r = m.chunk_range(n.chunk);
            match &n.parts {
                None => vec![r],
                Some(js) => js.iter().map(|&j| part_range(&r, j)).collect(),
            }
        })
        .collect()
}

/// The file range of part `j` of chunk `r`.
fn part_range(r: &std::ops::Range<u64>, j: usize) -> std::ops::Range<u64> {
    let start = r.start + j as u64 * parts::PART;
    start.min(r.end)..(start + parts::PART).min(r.end)
}

/// Receives a shard's data (the file `m` describes) straight into `dst`, checking every chunk
/// against the manifest on the way.
///
/// The calling thread reads the stream in 1 MiB pieces into their place in `dst` and hands
/// each piece to one of up to `threads` workers: all pieces of one unit (a chunk, or a part of
/// one) go to the same worker, in order, which hashes them while they are still in cache, so
/// units are hashed in parallel while the next ones arrive and every byte is copied once, from
/// the socket to its place. [`Received::bad`] names the first chunk that does not match, if
/// any (the whole stream is read either way, so the connection stays in step); a whole chunk
/// is hashed part by part, so its part values come out of the same pass.
///
/// `needs`: what the stream carries (ascending; `None`, every chunk whole). A chunk sent in
/// parts comes as every part's chaining value, which must merge to its id, then the parts
/// named, each checked against its value; the bytes not sent are left as they are in `dst`.
pub(crate) fn recv_verified<S: std::io::Read + std::io::Write>(
    conn: &mut Conn<S>,
    m: &Manifest,
    threads: usize,
    dst: &mut [u8],
    needs: Option<&[Need]>,
) -> Result<Received> {
    let hashes = m.chunk_hashes();
    if (dst.len() as u64) < m.file_len {
        return Err(conn
            .error(format!(
                "{} bytes of room for a shard of {}",
                dst.len(),
                m.file_len
            ))
            .into());
    }
    let all;
    let needs = match needs {
        Some(n) => n,
        None => {
            all = every_chunk(m);
            &all
        }
    };
    let workers = threads.clamp(1, 8);
    let bad = Mutex::new(None::<usize>);
    let mark = |c: usize| {
        let mut b = bad.lock().unwrap_or_else(PoisonError::into_inner);
        *b = Some(b.map_or(c, |j| j.min(c)));
    };
    let values = Mutex::new(vec![Vec::new(); hashes.len()]);
    std::thread::scope(|scope| {
        let mut queues = Vec::with_capacity(workers);
        for _ in 0..workers {
            let (tx, rx) = mpsc::sync_channel::<Piece<'_>>(QUEUED);
            queues.push(tx);
            let (mark, values) = (&mark, &values);
            scope.spawn(move || {
                let mut hashing: Option<(usize, Hashing)> = None;
                for p in rx {
                    if hashing.as_ref().is_none_or(|(u, _)| *u != p.unit) {
                        hashing = Some((p.unit, p.check.start()));
                    }
                    if let Some((_, h)) = &mut hashing {
                        h.update(p.data);
                    }
                    if p.last
                        && let Some((_, h)) = hashing.take()
                    {
                        match h.finish(p.check) {
                            (false, _) => mark(p.chunk),
                            (true, v) => {
                                values.lock().unwrap_or_else(PoisonError::into_inner)[p.chunk] = v;
                            }
                        }
                    }
                }
            });
        }
        let mut rest = dst;
        let mut at = 0;
        let mut unit = 0;
        for need in needs {
            let i = need.chunk;
            let id = *hashes
                .get(i)
                .ok_or_else(|| conn.error(format!("no chunk {i}")))?;
            let r = m.chunk_range(i);
            let units: Vec<(std::ops::Range<u64>, Check)> = match &need.parts {
                None => vec![(
                    r.clone(),
                    Check::Chunk {
                        id,
                        len: r.end - r.start,
                    },
                )],
                Some(js) => {
                    let mut raw = vec![0; parts::count(r.end - r.start) * parts::CV_LEN];
                    recv_exact(conn, &mut raw)?;
                    let cvs = parts::from_bytes(&raw).unwrap_or_default();
                    if parts::root(&cvs, r.end - r.start) != Some(id) {
                        mark(i);
                    }
                    js.iter()
                        .map(|&j| {
                            let cv = cvs.get(j).copied().unwrap_or_default();
                            (part_range(&r, j), Check::Part(j, cv))
                        })
                        .collect()
                }
            };
            for (want, check) in units {
                // To the unit's place: past the bytes the stream does not carry.
                let skip = want
                    .start
                    .checked_sub(at)
                    .ok_or_else(|| conn.error(format!("chunk {i} out of order")))?;
                rest = std::mem::take(&mut rest).split_at_mut(skip as usize).1;
                at = want.end;
                let len = (want.end - want.start) as usize;
                let mut done = 0;
                while done < len {
                    let frame = conn.recv_data_len(len - done)?;
                    let mut got = 0;
                    while got < frame {
                        let n = (frame - got).min(PIECE);
                        let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
                        rest = tail;
                        conn.read_payload(piece)?;
                        got += n;
                        let piece = Piece {
                            unit,
                            chunk: i,
                            check,
                            data: piece,
                            last: done + got == len,
                        };
                        if queues[unit % workers].send(piece).is_err() {
                            return Err(Error::from(conn.error("receive worker stopped")));
                        }
                    }
                    done += frame;
                }
                unit += 1;
            }
        }
        Ok(())
    })?;
    Ok(Received {
        bad: bad.into_inner().unwrap_or_else(PoisonError::into_inner),
        values: values.into_inner().unwrap_or_else(PoisonError::into_inner),
    })
}

/// Reads exactly `buf.len()` bytes of data frames.
fn recv_exact<S: std::io::Read + std::io::Write>(conn: &mut Conn<S>, buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        done += conn.recv_data(&mut buf[done..])?;
    }
    Ok(())
}

/// Sends a shard's bytes, chunk by chunk.
fn send_chunks<S: std::io::Read + std::io::Write>(
    conn: &mut Conn<S>,
    data: &[u8],
    chunk_size: u64,
) -> Result<()> {
    for chunk in data.chunks((chunk_size as usize).max(1)) {
        conn.send_data(chunk)?;
    }
    Ok(())
}

/// Sends a shard's bytes from its segment (with `sendfile` on a plain link), as
/// [`recv_verified`] takes them: every chunk, or what `needs` names.
fn send_segment(
    conn: &mut Conn<Link>,
    shard: &Shard,
    needs: Option<&[Need]>,
    threads: usize,
) -> Result<()> {
    let m = &shard.manifest;
    let fd = shard.seg.as_fd();
    for need in needs.map_or_else(|| every_chunk(m), <[Need]>::to_vec) {
        let r = m.chunk_range(need.chunk);
        let Some(js) = &need.parts else {
            conn.send_data_from(fd, r.start, (r.end - r.start) as usize)?;
            continue;
        };
        conn.send_data(&parts::to_bytes(shard.part_values(need.chunk, threads)))?;
        for &j in js {
            let p = part_range(&r, j);
            conn.send_data_from(fd, p.start, (p.end - p.start) as usize)?;
        }
    }
    Ok(())
}

/// A fresh segment filled from a peer's stream and checked against `m`: the shard, or why not.
fn receive_shard(
    core: &Core,
    conn: &mut Conn<Link>,
    info: &ShardInfo,
    m: Manifest,
    manifest_json: String,
    charge: super::memory::Charge,
) -> Result<std::result::Result<Arc<Shard>, String>> {
    let name = format!("hotstart-{}-{}-{}", info.job, info.step, info.rank);
    let mut seg = Segment::create_to_fill(&name, info.len as usize, Some(Box::new(charge)))
        .map_err(|e| Error::io("create shared memory", &name, e))?;
    let got = recv_verified(conn, &m, core.threads, seg.bytes_mut(), None)?;
    if let Some(i) = got.bad {
        core.metrics.failed(Failure::Checksum);
        return Ok(Err(format!("chunk {i} does not match its checksum")));
    }
    let sealed = seg
        .seal()
        .map_err(|e| Error::io("seal shared memory", &name, e))?;
    Ok(Ok(Arc::new(Shard {
        key: ShardKey {
            job: info.job.clone(),
            rank: info.rank,
            step: info.step,
        },
        world_size: info.world_size,
        origin: info.origin.clone(),
        manifest: m,
        manifest_json,
        seg: Arc::new(sealed.into()),
        committed: Instant::now(),
        parts: PartValues::made(got.values),
    })))
}

/// Serves one peer connection until it closes or misbehaves.
pub(crate) fn serve(core: Arc<Core>, sock: TcpStream, addr: SocketAddr) {
    static OPEN: AtomicUsize = AtomicUsize::new(0);
    if OPEN.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
        OPEN.fetch_sub(1, Ordering::AcqRel);
        warn!(%addr, "too many peer connections; closing this one");
        return;
    }
    struct Open;
    impl Drop for Open {
        fn drop(&mut self) {
            OPEN.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let _open = Open;
    let _ = sock.set_nodelay(true);
    let _ = sock.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let _ = sock.set_write_timeout(Some(core.cfg.peer_timeout));
    let link = match &core.tls {
        Some(tls) => match tls.accept(sock) {
            Ok(link) => link,
            Err(e) => {
                core.metrics.failed(Failure::Auth);
                warn!(%addr, error = %e, "peer connection refused: TLS");
                return;
            }
        },
        None => Link::Plain(sock),
    };
    let mut conn = Conn::new(link, addr.to_string(), Side::Peer);
    let peer = match auth::server(&mut conn, &core.key, &core.me) {
        Ok(p) => p,
        Err(Error::Auth { reason, .. }) if reason == auth::SELF_CONNECTION => return,
        Err(e) => {
            let kind = if conn.violated() {
                Failure::Frame
            } else {
                Failure::Auth
            };
            core.metrics.failed(kind);
            warn!(%addr, error = %e, "peer connection refused");
            return;
        }
    };
    let _ = conn
        .get_ref()
        .tcp()
        .set_read_timeout(Some(core.cfg.peer_timeout));
    debug!(%addr, peer = %peer.node, "peer authenticated");
    loop {
        let msg = match conn.recv::<PeerMsg>() {
            Ok(m) => m,
            Err(e) => {
                if conn.violated() {
                    core.metrics.failed(Failure::Frame);
                    warn!(peer = %conn.label(), error = %e, "peer connection dropped");
                } else {
                    debug!(peer = %conn.label(), error = %e, "peer connection closed");
                }
                return;
            }
        };
        let res: Result<()> = match msg {
            PeerMsg::Inventory { job } => {
                // A peer asks while a restart is deciding its step: the commits of saves whose
                // processes went away after staging count, as they do for this node's own.
                if let Some(job) = job.as_deref() {
                    core.adopting.wait(job, core.cfg.stage_timeout);
                }
                let shards = core.inventory(job.as_deref());
                conn.send(&PeerMsg::Held { shards }).map_err(Error::from)
            }
            PeerMsg::Push { shard, manifest } => {
                serve_push(&core, &mut conn, &peer, shard, manifest)
            }
            PeerMsg::Fetch {
                job,
                rank,
                step,
                regions,
                parts,
            } => {
                let key = ShardKey { job, rank, step };
                match core.memory.get(&key) {
                    Some(s) => {
                        let m = &s.manifest;
                        // Regions this shard does not have get the whole of it: the reader's
                        // own checks name what is wrong.
                        let needs = regions
                            .and_then(|r| m.parts_for(&r).ok())
                            .map(|n| if parts { n } else { whole(n) })
                            .filter(|n| n.len() < m.chunks.len() || n.iter().any(in_parts));
                        conn.send(&PeerMsg::Shard {
                            shard: s.info(),
                            manifest: s.manifest_json.clone(),
                            chunks: needs.as_ref().map(|n| n.iter().map(|n| n.chunk).collect()),
                            parts: needs.iter().flatten().any(in_parts),
                        })
                        .map_err(Error::from)
                        .and_then(|()| send_segment(&mut conn, &s, needs.as_deref(), core.threads))
                    }
                    None => conn.send(&PeerMsg::NotFound).map_err(Error::from),
                }
            }
            PeerMsg::Describe { job, rank, step } => {
                let key = ShardKey { job, rank, step };
                let answer = match core.memory.get(&key) {
                    Some(s) => PeerMsg::Shard {
                        shard: s.info(),
                        manifest: s.manifest_json.clone(),
                        chunks: None,
                        parts: false,
                    },
                    None => PeerMsg::NotFound,
                };
                conn.send(&answer).map_err(Error::from)
            }
            PeerMsg::Piece { .. } if !core.cfg.share => conn
                .send(&PeerMsg::Failed {
                    reason: "this node does not share (--no-share)".into(),
                })
                .map_err(Error::from),
            PeerMsg::Piece {
                piece,
                values_only: true,
                ..
            } => serve_values(&core, &mut conn, &piece),
            PeerMsg::Piece {
                piece,
                cached_only,
                redirect,
                values_only: false,
            } => serve_piece(&core, &mut conn, &peer, &piece, cached_only, redirect),
            other => Err(conn
                .violation(format!("unexpected request {other:?}"))
                .into()),
        };
        if let Err(e) = res {
            if conn.violated() {
                core.metrics.failed(Failure::Frame);
            }
            warn!(peer = %conn.label(), error = %e, "peer connection dropped");
            return;
        }
    }
}

/// Answers a peer's request for a shared piece: its bytes, once an upload slot is free;
/// `Redirect` to a node that has it when the slots are taken (`super::share`).
fn serve_piece(
    core: &Core,
    conn: &mut Conn<Link>,
    peer: &Identity,
    piece: &hotstart_proto::share::Piece,
    cached_only: bool,
    redirect: bool,
) -> Result<()> {
    use crate::share::ToPeer;
    match core.piece_for_peer(piece, &peer.node, cached_only, redirect) {
        ToPeer::Bytes(bytes, slot) => {
            let bytes = core.share.sent(piece, bytes);
            let sent = conn
                .send(&PeerMsg::PieceIs {
                    len: bytes.len() as u64,
                })
                .and_then(|()| conn.send_data(&bytes));
            slot.done(sent.is_ok());
            sent.map_err(Error::from)?;
            core.metrics.served(&piece.artifact, bytes.len() as u64);
            Ok(())
        }
        ToPeer::Redirect(node) => conn.send(&PeerMsg::Redirect { node }).map_err(Error::from),
        ToPeer::NotHeld => conn.send(&PeerMsg::NotFound).map_err(Error::from),
        ToPeer::Failed(reason) => conn.send(&PeerMsg::Failed { reason }).map_err(Error::from),
    }
}

/// Answers a peer's request for the values of a range's parts (`super::share`): small, so sent
/// at once, with no upload slot.
fn serve_values(
    core: &Core,
    conn: &mut Conn<Link>,
    piece: &hotstart_proto::share::Piece,
) -> Result<()> {
    match core.values_for_peer(piece) {
        Ok(values) => {
            conn.send(&PeerMsg::PieceIs {
                len: values.len() as u64,
            })?;
            conn.send_data(&values)?;
            Ok(())
        }
        Err(reason) => conn.send(&PeerMsg::Failed { reason }).map_err(Error::from),
    }
}

fn serve_push(
    core: &Core,
    conn: &mut Conn<Link>,
    peer: &Identity,
    info: ShardInfo,
    manifest: String,
) -> Result<()> {
    let m = match check_manifest(&info, &manifest, &peer.node) {
        Ok(m) => m,
        Err(e) => {
            // The data would follow a `Ready` only: the stream is still in step.
            let _ = conn.send(&PeerMsg::Failed {
                reason: e.to_string(),
            });
            return Err(conn.violation(e.to_string()).into());
        }
    };
    if info.held != Held::Memory || info.len == 0 {
        return Err(conn
            .violation("a pushed shard must be a memory shard with bytes")
            .into());
    }
    let what = format!(
        "replica of {} step {} rank {}",
        info.job, info.step, info.rank
    );
    let charge = match core.memory.reserve(info.len, Duration::ZERO, &what) {
        Ok(c) => c,
        Err(e) => {
            core.metrics.failed(Failure::Budget);
            warn!(peer = %peer.node, error = %e, "replica refused");
            return Ok(conn.send(&PeerMsg::Failed {
                reason: e.to_string(),
            })?);
        }
    };
    conn.send(&PeerMsg::Ready)?;
    match receive_shard(core, conn, &info, m, manifest, charge)? {
        Ok(shard) => {
            info!(peer = %peer.node, shard = %shard.key, bytes = shard.len(), "replica stored");
            core.memory.insert(shard);
            Ok(conn.send(&PeerMsg::Stored)?)
        }
        Err(reason) => {
            warn!(peer = %peer.node, shard = %what, %reason, "replica rejected");
            Ok(conn.send(&PeerMsg::Failed { reason })?)
        }
    }
}

/// An authenticated connection to a peer sidecar.
#[derive(Debug)]
pub struct PeerClient {
    conn: Conn<Link>,
    peer: Identity,
}

impl PeerClient {
    /// Connects to `addr` (over TLS with `tls`'s certificates, when given) and authenticates
    /// with `key` as `me`; refuses a peer whose node id is not `expect`, when given. `timeout`
    /// bounds the connect and every later read or write.
    pub fn connect(
        addr: SocketAddr,
        tls: Option<&Tls>,
        key: &ClusterKey,
        me: &Identity,
        expect: Option<&str>,
        timeout: Duration,
    ) -> Result<PeerClient> {
        let peer_err = |reason: String| Error::Peer {
            peer: addr.to_string(),
            reason,
        };
        let sock = TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(10)))
            .map_err(|e| peer_err(format!("connect: {e}")))?;
        let _ = sock.set_nodelay(true);
        sock.set_read_timeout(Some(timeout))
            .and_then(|()| sock.set_write_timeout(Some(timeout)))
            .map_err(|e| peer_err(format!("set timeouts: {e}")))?;
        let link = match tls {
            Some(tls) => tls
                .connect(sock)
                .map_err(|e| peer_err(format!("TLS: {e}")))?,
            None => Link::Plain(sock),
        };
        let mut conn = Conn::new(link, addr.to_string(), Side::Peer);
        let peer = auth::client(&mut conn, key, me, expect)?;
        Ok(PeerClient { conn, peer })
    }

    /// Resolves `addr` (`host:port`) and connects to the first address that answers.
    pub fn connect_host(
        addr: &str,
        tls: Option<&Tls>,
        key: &ClusterKey,
        me: &Identity,
        expect: Option<&str>,
        timeout: Duration,
    ) -> Result<PeerClient> {
        let resolved = addr.to_socket_addrs().map_err(|e| Error::Peer {
            peer: addr.to_string(),
            reason: format!("resolve: {e}"),
        })?;
        let mut last = Error::Peer {
            peer: addr.to_string(),
            reason: "resolves to no address".into(),
        };
        for a in resolved {
            match PeerClient::connect(a, tls, key, me, expect, timeout) {
                Ok(c) => return Ok(c),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Who answered.
    pub fn peer(&self) -> &Identity {
        &self.peer
    }

    fn unexpected(&mut self, m: PeerMsg) -> Error {
        match m {
            PeerMsg::Failed { reason } | PeerMsg::Refused { reason } => {
                self.conn.error(reason).into()
            }
            other => self
                .conn
                .violation(format!("unexpected answer {other:?}"))
                .into(),
        }
    }

    /// A shared piece from the peer (`super::share`): its bytes, not yet checked against its
    /// frames' ids (the caller does), or the node it redirects to, or `None` (`cached_only`
    /// and not held).
    pub(crate) fn piece(
        &mut self,
        piece: &hotstart_proto::share::Piece,
        cached_only: bool,
        redirect: bool,
    ) -> Result<Option<crate::share::FromPeer>> {
        use crate::share::FromPeer;
        self.conn.send(&PeerMsg::Piece {
            piece: piece.clone(),
            cached_only,
            redirect,
            values_only: false,
        })?;
        let len = match self.conn.recv()? {
            PeerMsg::PieceIs { len } => len,
            PeerMsg::Redirect { node } => return Ok(Some(FromPeer::Redirect(node))),
            PeerMsg::NotFound => return Ok(None),
            other => return Err(self.unexpected(other)),
        };
        // A checked piece's answer is no longer than a piece may be, and its values.
        let fits = match piece.answer_len() {
            Some(want) => want == len,
            None => len <= hotstart_proto::share::MAX_PIECE_LEN,
        };
        if !fits {
            return Err(self
                .conn
                .violation(format!("a piece of {len} bytes for {}", piece.key))
                .into());
        }
        let mut buf = vec![0u8; len as usize];
        self.conn.recv_data_exact(&mut buf)?;
        Ok(Some(FromPeer::Bytes(bytes::Bytes::from(buf))))
    }

    /// The chaining values of the parts of `piece`, a range of a chunk (`super::share`), as
    /// the peer holds them or reads them from the store as the range's owner; not yet checked.
    pub(crate) fn range_values(&mut self, piece: &hotstart_proto::share::Piece) -> Result<Vec<u8>> {
        self.conn.send(&PeerMsg::Piece {
            piece: piece.clone(),
            cached_only: false,
            redirect: false,
            values_only: true,
        })?;
        let len = match self.conn.recv()? {
            PeerMsg::PieceIs { len } => len,
            other => return Err(self.unexpected(other)),
        };
        if Some(len) != piece.values_len() {
            return Err(self
                .conn
                .violation(format!(
                    "{len} bytes of values for a range of {}",
                    piece.key
                ))
                .into());
        }
        let mut buf = vec![0u8; len as usize];
        self.conn.recv_data_exact(&mut buf)?;
        Ok(buf)
    }

    /// The shards the peer holds (of `job`, or all).
    pub fn inventory(&mut self, job: Option<&str>) -> Result<Vec<ShardInfo>> {
        self.conn.send(&PeerMsg::Inventory {
            job: job.map(String::from),
        })?;
        match self.conn.recv()? {
            PeerMsg::Held { shards } => Ok(shards),
            other => Err(self.unexpected(other)),
        }
    }

    /// Pushes a shard (`data` is its whole file): the peer verifies it against the manifest
    /// and holds it, or says why not.
    pub fn push(&mut self, info: &ShardInfo, manifest_json: &str, data: &[u8]) -> Result<()> {
        let chunk_size = Manifest::parse(manifest_json.as_bytes(), "pushed manifest")
            .map(|m| m.chunk_size)
            .unwrap_or(hotstart_ckpt::DEFAULT_CHUNK_SIZE as u64);
        self.conn.send(&PeerMsg::Push {
            shard: info.clone(),
            manifest: manifest_json.to_string(),
        })?;
        match self.conn.recv()? {
            PeerMsg::Ready => {}
            other => return Err(self.unexpected(other)),
        }
        send_chunks(&mut self.conn, data, chunk_size)?;
        match self.conn.recv()? {
            PeerMsg::Stored => Ok(()),
            other => Err(self.unexpected(other)),
        }
    }

    /// The manifest of a shard the peer holds in memory, checked against what the peer says it
    /// describes (its chunks are verified by whoever reads them); `None` when the peer does not
    /// hold it.
    pub fn describe(&mut self, key: &ShardKey) -> Result<Option<String>> {
        let ask = PeerMsg::Describe {
            job: key.job.clone(),
            rank: key.rank,
            step: key.step,
        };
        Ok(self.ask_shard(ask, key, None)?.map(|d| d.json))
    }

    /// Sends `ask` (`Describe` or `Fetch` of `key`) and takes the answer (no data yet): the
    /// shard's info and manifest, checked (a shard of another key, or a manifest that does not
    /// parse or does not describe the announced shard, is a protocol violation), or `None`
    /// when the peer does not hold it; and what its data carries when not every chunk whole,
    /// which must be what `regions` (asked for with `Fetch`) and the header need.
    fn ask_shard(
        &mut self,
        ask: PeerMsg,
        key: &ShardKey,
        regions: Option<&[Region]>,
    ) -> Result<Option<Fetched<()>>> {
        self.conn.send(&ask)?;
        let (info, json, chunks, in_parts) = match self.conn.recv()? {
            PeerMsg::Shard {
                shard,
                manifest,
                chunks,
                parts,
            } => (shard, manifest, chunks, parts),
            PeerMsg::NotFound => return Ok(None),
            other => return Err(self.unexpected(other)),
        };
        if (info.job.as_str(), info.rank, info.step) != (key.job.as_str(), key.rank, key.step) {
            return Err(self
                .conn
                .violation(format!("asked for {key}, got {info:?}"))
                .into());
        }
        let m = check_manifest(&info, &json, &self.peer.node)
            .map_err(|e| self.conn.violation(e.to_string()))?;
        // A reader reads exactly the bytes the regions name, so a stream that carries less
        // would hand it bytes never sent: what comes must be what the reader reckons itself.
        let needs = match &chunks {
            None if in_parts => {
                return Err(self
                    .conn
                    .violation(format!("{key}: parts of no chunks"))
                    .into());
            }
            None => None,
            Some(c) => {
                let need = regions.and_then(|r| m.parts_for(r).ok());
                if need
                    .as_ref()
                    .map(|n| n.iter().map(|n| n.chunk).collect())
                    .as_ref()
                    != Some(c)
                {
                    return Err(self
                        .conn
                        .violation(format!("{key}: sent chunks {c:?} for regions {regions:?}"))
                        .into());
                }
                need.map(|n| if in_parts { n } else { whole(n) })
            }
        };
        Ok(Some(Fetched {
            info,
            manifest: m,
            json,
            mem: (),
            chunks,
            needs,
            values: Vec::new(),
        }))
    }

    /// Fetches a shard from the peer's memory into memory made by `alloc` (given the checked
    /// manifest and what will come, `None` for every chunk whole, as [`need_ranges`] places
    /// it; at least the shard's length), every chunk verified. `None` when the peer
    /// does not hold it. With `regions`, the peer may send only the chunks, or the parts of
    /// chunks, that hold them and the header: those are returned too (`None`: every chunk
    /// came), and the other bytes are left as `alloc` made them.
    pub fn fetch<T: AsMut<[u8]>>(
        &mut self,
        key: &ShardKey,
        threads: usize,
        regions: Option<&[Region]>,
        alloc: impl FnOnce(&ShardInfo, &Manifest, Option<&[Need]>) -> Result<T>,
    ) -> Result<Option<Fetched<T>>> {
        let ask = PeerMsg::Fetch {
            job: key.job.clone(),
            rank: key.rank,
            step: key.step,
            regions: regions.map(<[Region]>::to_vec),
            parts: regions.is_some(),
        };
        let Some(got) = self.ask_shard(ask, key, regions)? else {
            return Ok(None);
        };
        let needs = got.needs.as_deref();
        let mut mem = alloc(&got.info, &got.manifest, needs)?;
        let received = recv_verified(&mut self.conn, &got.manifest, threads, mem.as_mut(), needs)?;
        if let Some(i) = received.bad {
            return Err(self
                .conn
                .error(format!("{key}: chunk {i} does not match its checksum"))
                .into());
        }
        Ok(Some(Fetched {
            info: got.info,
            manifest: got.manifest,
            json: got.json,
            mem,
            chunks: got.chunks,
            needs: got.needs,
            values: received.values,
        }))
    }
}

/// A shard fetched from a peer: what the peer said of it, and its bytes.
pub struct Fetched<T> {
    pub info: ShardInfo,
    pub manifest: Manifest,
    pub json: String,
    pub mem: T,
    /// The chunks that came, when not all (a fetch of regions).
    pub chunks: Option<Vec<usize>>,
    /// What came of those chunks: each whole, or some of its parts only.
    pub needs: Option<Vec<Need>>,
    /// The part values of every chunk that came whole (made while it was checked).
    pub values: Vec<Vec<ChainingValue>>,
}

impl Core {
    /// Copies a committed local shard to up to `replicas` peers in placement order; the peers
    /// that hold it.
    pub(crate) fn replicate(&self, shard: &Shard) -> Result<Vec<String>> {
        let members = self.members.snapshot();
        let ids: Vec<Identity> = members.iter().map(|m| m.id.clone()).collect();
        let order = super::placement::order(&self.me, &ids);
        // Peers that answered the last probe first, keeping placement order within each.
        let up = |id: &Identity| members.iter().any(|m| m.id.node == id.node && m.up);
        let order: Vec<&Identity> = order
            .iter()
            .copied()
            .filter(|i| up(i))
            .chain(order.iter().copied().filter(|i| !up(i)))
            .collect();
        let data = &shard.seg.bytes()[..shard.len() as usize];
        let mut holders = Vec::new();
        let mut refused = Vec::new();
        let mut last = None;
        for id in order {
            if holders.len() >= self.cfg.replicas {
                break;
            }
            let Some(m) = members.iter().find(|m| m.id.node == id.node) else {
                continue;
            };
            let res = self
                .connect(m)
                .and_then(|mut c| c.push(&shard.info(), &shard.manifest_json, data));
            match res {
                Ok(()) => holders.push(id.node.clone()),
                Err(e) => {
                    self.metrics.failed(Failure::Replicate);
                    warn!(shard = %shard.key, peer = %id.node, error = %e, "replication to a peer failed");
                    refused.push(id.node.clone());
                    last = Some(e);
                }
            }
        }
        if holders.len() < self.cfg.replicas {
            let why = last.map_or_else(|| "not enough peers known".to_string(), |e| e.to_string());
            // Named by the peers that failed it (none known: no peer was there to ask).
            return Err(Error::Peer {
                peer: if refused.is_empty() {
                    "(none known)".to_string()
                } else {
                    refused.join(",")
                },
                reason: format!(
                    "{} held by {} of {} peers: {why}",
                    shard.key,
                    holders.len(),
                    self.cfg.replicas
                ),
            });
        }
        Ok(holders)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use hotstart_ckpt::format::Layout;
    use hotstart_ckpt::{Dtype, Tensor};

    const CHUNK: usize = 2 << 20;

    /// A shard file of a little over two chunks and its manifest.
    fn shard() -> (Manifest, Vec<u8>) {
        let bytes: Vec<u8> = (0..2 * CHUNK + 12345)
            .map(|i| (i * 31 + i / 7) as u8)
            .collect();
        let t = Tensor::new("w", Dtype::U8, vec![bytes.len() as u64], bytes.clone()).unwrap();
        let layout = Layout::new("j", 1, 1, &[t]).unwrap();
        let mut file = layout.header.clone();
        file.extend_from_slice(&bytes);
        let hashes: Vec<blake3::Hash> = file.chunks(CHUNK).map(blake3::hash).collect();
        let m = Manifest::new(
            "j",
            1,
            0,
            1,
            &layout,
            CHUNK as u64,
            &hashes,
            &Default::default(),
        );
        (m, file)
    }

    /// The data frames a peer sends for `file`: chunk 1 in frames of 1000 bytes, the others in
    /// frames larger than a piece.
    fn stream(file: &[u8]) -> Cursor<Vec<u8>> {
        let mut tx = Conn::new(Cursor::new(Vec::new()), "t", Side::Peer);
        for (i, chunk) in file.chunks(CHUNK).enumerate() {
            for frame in chunk.chunks(if i == 1 { 1000 } else { PIECE + PIECE / 2 }) {
                tx.send_data(frame).unwrap();
            }
        }
        Cursor::new(tx.get_ref().get_ref().clone())
    }

    #[test]
    fn received_bytes_land_in_place_and_a_bad_chunk_is_named() {
        let (m, file) = shard();
        let mut dst = vec![0u8; file.len() + 7];
        let mut rx = Conn::new(stream(&file), "t", Side::Peer);
        let got = recv_verified(&mut rx, &m, 2, &mut dst, None).unwrap();
        assert_eq!(got.bad, None);
        assert!(dst[..file.len()] == file[..], "bytes differ");
        // The same pass made every chunk's part values (none for the last, of one part).
        for (i, c) in file.chunks(CHUNK).enumerate() {
            let want = if parts::splits(c.len() as u64) {
                parts::cvs(c)
            } else {
                Vec::new()
            };
            assert_eq!(got.values[i], want, "chunk {i}");
        }
        assert_eq!(dst[file.len()..], [0; 7]);

        let mut bad = file.clone();
        bad[CHUNK + 5] ^= 1;
        let mut rx = Conn::new(stream(&bad), "t", Side::Peer);
        assert_eq!(
            recv_verified(&mut rx, &m, 2, &mut dst, None).unwrap().bad,
            Some(1)
        );
        // The whole stream was read: the connection stays in step.
        assert_eq!(
            rx.get_ref().position() as usize,
            rx.get_ref().get_ref().len()
        );

        let mut rx = Conn::new(stream(&file), "t", Side::Peer);
        let err = recv_verified(&mut rx, &m, 2, &mut dst[..file.len() - 1], None).unwrap_err();
        assert!(err.to_string().contains("bytes of room"), "{err}");

        let mut rx = Conn::new(stream(&file[..file.len() - 3]), "t", Side::Peer);
        let err = recv_verified(&mut rx, &m, 2, &mut dst, None).unwrap_err();
        assert!(err.to_string().contains("connection closed"), "{err}");
    }

    /// Changes chunk `.0`'s part values or the file's bytes on their way to a reader.
    type Spoil<'a> = dyn Fn(usize, &mut Vec<ChainingValue>, &mut Vec<u8>) + 'a;

    /// The data frames a peer sends for `needs` of `file`, as `send_segment` does; `spoil`
    /// may change a part's value or bytes on the way.
    fn parts_stream(
        m: &Manifest,
        file: &[u8],
        needs: &[Need],
        spoil: &Spoil<'_>,
    ) -> Cursor<Vec<u8>> {
        let mut tx = Conn::new(Cursor::new(Vec::new()), "t", Side::Peer);
        for n in needs {
            let r = m.chunk_range(n.chunk);
            let chunk = &file[r.start as usize..r.end as usize];
            let Some(js) = &n.parts else {
                tx.send_data(chunk).unwrap();
                continue;
            };
            let mut cvs = parts::cvs(chunk);
            let mut bytes = file.to_vec();
            spoil(n.chunk, &mut cvs, &mut bytes);
            tx.send_data(&parts::to_bytes(&cvs)).unwrap();
            for &j in js {
                let p = part_range(&r, j);
                tx.send_data(&bytes[p.start as usize..p.end as usize])
                    .unwrap();
            }
        }
        Cursor::new(tx.get_ref().get_ref().clone())
    }

    #[test]
    fn parts_land_in_place_and_a_bad_part_or_value_is_named() {
        let (m, file) = shard();
        let at = m.data_offset;
        // Bytes in chunk 0 past its first part, and across the boundary of chunks 1 and 2 (a
        // chunk of one part, sent whole).
        let regions = [
            Region {
                tensor: "w".into(),
                offset: 300_000,
                len: 10,
            },
            Region {
                tensor: "w".into(),
                offset: 2 * CHUNK as u64 - at - 100_000,
                len: 112_000,
            },
        ];
        let needs = m.parts_for(&regions).unwrap();
        let part = parts::PART as usize;
        let span = |a: usize, b: usize| (a / part..=(b - 1) / part).collect::<Vec<_>>();
        let header_and_first: Vec<usize> = span(0, at as usize)
            .into_iter()
            .chain(span(at as usize + 300_000, at as usize + 300_010))
            .collect();
        assert_eq!(
            needs,
            vec![
                Need {
                    chunk: 0,
                    parts: Some(header_and_first)
                },
                Need {
                    chunk: 1,
                    parts: Some(span(CHUNK - 100_000, CHUNK))
                },
                Need {
                    chunk: 2,
                    parts: None
                },
            ]
        );
        let mut dst = vec![0u8; file.len()];
        let mut rx = Conn::new(
            parts_stream(&m, &file, &needs, &|_, _, _| ()),
            "t",
            Side::Peer,
        );
        assert_eq!(
            recv_verified(&mut rx, &m, 2, &mut dst, Some(&needs))
                .unwrap()
                .bad,
            None
        );
        // Exactly the parts named arrived; every other byte is as it was.
        for n in &needs {
            let r = m.chunk_range(n.chunk);
            let Some(js) = n.parts.as_ref() else {
                assert!(
                    dst[r.start as usize..r.end as usize] == file[r.start as usize..r.end as usize]
                );
                continue;
            };
            for j in 0..parts::count(r.end - r.start) {
                let p = part_range(&r, j);
                let (got, sent) = (
                    &dst[p.start as usize..p.end as usize],
                    &file[p.start as usize..p.end as usize],
                );
                if js.contains(&j) {
                    assert!(got == sent, "chunk {} part {j}", n.chunk);
                } else {
                    assert!(got.iter().all(|b| *b == 0), "chunk {} part {j}", n.chunk);
                }
            }
        }
        // A flipped byte in a part sent, a value that is not the chunk's, or a part's value
        // moved to another part's place: the chunk is named, and the stream read to its end.
        let flip = |c: usize, _: &mut Vec<ChainingValue>, b: &mut Vec<u8>| {
            if c == 1 {
                b[CHUNK * 2 - 50_000] ^= 1;
            }
        };
        let lie = |c: usize, v: &mut Vec<ChainingValue>, _: &mut Vec<u8>| {
            if c == 1 {
                v[1][0] ^= 1;
            }
        };
        let swap = |c: usize, v: &mut Vec<ChainingValue>, b: &mut Vec<u8>| {
            if c == 0 {
                let bytes = b[..part].to_vec();
                b.copy_within(part..2 * part, 0);
                b[part..2 * part].copy_from_slice(&bytes);
                v.swap(0, 1);
            }
        };
        let cases: [(&Spoil<'_>, usize); 3] = [(&flip, 1), (&lie, 1), (&swap, 0)];
        for (spoil, chunk) in cases {
            let mut rx = Conn::new(parts_stream(&m, &file, &needs, spoil), "t", Side::Peer);
            assert_eq!(
                recv_verified(&mut rx, &m, 2, &mut dst, Some(&needs))
                    .unwrap()
                    .bad,
                Some(chunk)
            );
            assert_eq!(
                rx.get_ref().position() as usize,
                rx.get_ref().get_ref().len()
            );
        }
    }
}
