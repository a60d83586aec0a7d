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
//! Fetch{job,rank,step[,regions]}
//!                       → Shard{shard,manifest[,chunks]}, data frames | NotFound
//! Describe{job,rank,step} → Shard{shard,manifest} | NotFound
//! Piece{piece,cached_only,redirect}
//!                       → PieceIs{len}, data frames | Redirect{node} | NotFound | Failed{reason}
//!                                                          (`super::share`)
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
use crate::memory::{Shard, ShardKey};
use crate::metrics::Failure;
use crate::tls::{Link, Tls};
use crate::wire::{Held, PeerMsg, ShardInfo};
use hotstart_ckpt::format::{self, Manifest, Region};
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

/// A received piece of a shard, on its way to the worker that hashes its chunk.
struct Piece<'a> {
    chunk: usize,
    data: &'a [u8],
    last: bool,
}

/// Receives a shard's data (the file `m` describes) straight into `dst`, checking every chunk
/// against the manifest on the way.
///
/// The calling thread reads the stream in 1 MiB pieces into their place in `dst` and hands
/// each piece to one of up to `threads` workers: all pieces of chunk `i` go to worker
/// `i % workers`, in order, which hashes them while they are still in cache, so chunks are
/// hashed in parallel while the next ones arrive and every byte is copied once, from the
/// socket to its place. `Ok(None)` when every chunk matches, `Ok(Some(i))` for the first chunk
/// that does not (the whole stream is read either way, so the connection stays in step).
/// `only`: the stream carries these chunks (ascending) and no others, which are left as they
/// are in `dst`.
pub(crate) fn recv_verified<S: std::io::Read + std::io::Write>(
    conn: &mut Conn<S>,
    m: &Manifest,
    threads: usize,
    dst: &mut [u8],
    only: Option<&[usize]>,
) -> Result<Option<usize>> {
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
    let workers = threads.clamp(1, 8);
    let bad = Mutex::new(None::<usize>);
    std::thread::scope(|scope| {
        let mut queues = Vec::with_capacity(workers);
        for _ in 0..workers {
            let (tx, rx) = mpsc::sync_channel::<Piece<'_>>(QUEUED);
            queues.push(tx);
            let (hashes, bad) = (&hashes, &bad);
            scope.spawn(move || {
                let mut hasher: Option<(usize, blake3::Hasher)> = None;
                for p in rx {
                    if hasher.as_ref().is_none_or(|(c, _)| *c != p.chunk) {
                        hasher = Some((p.chunk, blake3::Hasher::new()));
                    }
                    if let Some((_, h)) = &mut hasher {
                        h.update(p.data);
                    }
                    if p.last
                        && let Some((c, h)) = hasher.take()
                        && hashes.get(c) != Some(&h.finalize())
                    {
                        let mut b = bad.lock().unwrap_or_else(PoisonError::into_inner);
                        *b = Some(b.map_or(c, |j| j.min(c)));
                    }
                }
            });
        }
        let mut rest = dst;
        let mut at = 0;
        for i in chunk_list(only, hashes.len()) {
            let want = m.chunk_range(i);
            // To the chunk's place: past the chunks the stream does not carry.
            let skip = want
                .start
                .checked_sub(at)
                .filter(|_| i < hashes.len())
                .ok_or_else(|| conn.error(format!("chunk {i} out of order")))?;
            rest = std::mem::take(&mut rest).split_at_mut(skip as usize).1;
            at = want.end;
            let chunk_len = (want.end - want.start) as usize;
            let mut done = 0;
            while done < chunk_len {
                let frame = conn.recv_data_len(chunk_len - done)?;
                let mut got = 0;
                while got < frame {
                    let n = (frame - got).min(PIECE);
                    let (piece, tail) = std::mem::take(&mut rest).split_at_mut(n);
                    rest = tail;
                    conn.read_payload(piece)?;
                    got += n;
                    let piece = Piece {
                        chunk: i,
                        data: piece,
                        last: done + got == chunk_len,
                    };
                    if queues[i % workers].send(piece).is_err() {
                        return Err(Error::from(conn.error("receive worker stopped")));
                    }
                }
                done += frame;
            }
        }
        Ok(())
    })?;
    Ok(bad.into_inner().unwrap_or_else(PoisonError::into_inner))
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

/// The chunks `only` names, or all `n`.
fn chunk_list(only: Option<&[usize]>, n: usize) -> Vec<usize> {
    only.map_or_else(|| (0..n).collect(), <[usize]>::to_vec)
}

/// Sends a shard's bytes from its segment, chunk by chunk (with `sendfile` on a plain link):
/// every chunk, or those `only` names.
fn send_segment(conn: &mut Conn<Link>, shard: &Shard, only: Option<&[usize]>) -> Result<()> {
    let m = &shard.manifest;
    for i in chunk_list(only, m.chunks.len()) {
        let r = m.chunk_range(i);
        conn.send_data_from(shard.seg.as_fd(), r.start, (r.end - r.start) as usize)?;
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
    if let Some(i) = recv_verified(conn, &m, core.threads, seg.bytes_mut(), None)? {
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
            } => {
                let key = ShardKey { job, rank, step };
                match core.memory.get(&key) {
                    Some(s) => {
                        // Regions this shard does not have get the whole of it: the reader's
                        // own checks name what is wrong.
                        let chunks = regions
                            .and_then(|r| s.manifest.chunks_for(&r).ok())
                            .filter(|c| c.len() < s.manifest.chunks.len());
                        conn.send(&PeerMsg::Shard {
                            shard: s.info(),
                            manifest: s.manifest_json.clone(),
                            chunks: chunks.clone(),
                        })
                        .map_err(Error::from)
                        .and_then(|()| send_segment(&mut conn, &s, chunks.as_deref()))
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
                    },
                    None => PeerMsg::NotFound,
                };
                conn.send(&answer).map_err(Error::from)
            }
            PeerMsg::Piece {
                piece,
                cached_only,
                redirect,
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
    let answer = if core.cfg.share {
        core.piece_for_peer(piece, &peer.node, cached_only, redirect)
    } else {
        ToPeer::Failed("this node does not share (--no-share)".into())
    };
    match answer {
        ToPeer::Bytes(bytes, slot) => {
            let bytes = if core.share.corrupt_sent {
                let mut v = bytes.to_vec();
                let mid = v.len() / 2;
                v[mid] ^= 0x40;
                v.into()
            } else {
                bytes
            };
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
        })?;
        let len = match self.conn.recv()? {
            PeerMsg::PieceIs { len } => len,
            PeerMsg::Redirect { node } => return Ok(Some(FromPeer::Redirect(node))),
            PeerMsg::NotFound => return Ok(None),
            other => return Err(self.unexpected(other)),
        };
        let fits =
            piece.len.is_none_or(|l| l == len) && len <= hotstart_proto::share::MAX_PIECE_LEN;
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
    /// when the peer does
    /// not hold it; and the chunks its data carries when not all of them, which must be those
    /// that hold `regions` (asked for with `Fetch`) and the header.
    fn ask_shard(
        &mut self,
        ask: PeerMsg,
        key: &ShardKey,
        regions: Option<&[Region]>,
    ) -> Result<Option<Fetched<()>>> {
        self.conn.send(&ask)?;
        let (info, json, chunks) = match self.conn.recv()? {
            PeerMsg::Shard {
                shard,
                manifest,
                chunks,
            } => (shard, manifest, chunks),
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
        if let Some(c) = &chunks {
            // A reader reads exactly these, so fewer would hand it bytes never sent.
            let need = regions.and_then(|r| m.chunks_for(r).ok());
            if need.as_ref() != Some(c) {
                return Err(self
                    .conn
                    .violation(format!("{key}: sent chunks {c:?} for {need:?}"))
                    .into());
            }
        }
        Ok(Some(Fetched {
            info,
            manifest: m,
            json,
            mem: (),
            chunks,
        }))
    }

    /// Fetches a shard from the peer's memory into memory made by `alloc` (given the checked
    /// manifest; at least the shard's length), every chunk verified. `None` when the peer
    /// does not hold it. With `regions`, the peer may send only the chunks that hold them and
    /// the header: those are returned too (`None`: every chunk came), and the others are left
    /// as `alloc` made them.
    pub fn fetch<T: AsMut<[u8]>>(
        &mut self,
        key: &ShardKey,
        threads: usize,
        regions: Option<&[Region]>,
        alloc: impl FnOnce(&ShardInfo, &Manifest) -> Result<T>,
    ) -> Result<Option<Fetched<T>>> {
        let ask = PeerMsg::Fetch {
            job: key.job.clone(),
            rank: key.rank,
            step: key.step,
            regions: regions.map(<[Region]>::to_vec),
        };
        let Some(got) = self.ask_shard(ask, key, regions)? else {
            return Ok(None);
        };
        let mut mem = alloc(&got.info, &got.manifest)?;
        let only = got.chunks.as_deref();
        let bad = recv_verified(&mut self.conn, &got.manifest, threads, mem.as_mut(), only)?;
        if let Some(i) = bad {
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
                    last = Some(e);
                }
            }
        }
        if holders.len() < self.cfg.replicas {
            let why = last.map_or_else(|| "not enough peers known".to_string(), |e| e.to_string());
            return Err(Error::Peer {
                peer: holders.join(","),
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
        assert_eq!(recv_verified(&mut rx, &m, 2, &mut dst, None).unwrap(), None);
        assert!(dst[..file.len()] == file[..], "bytes differ");
        assert_eq!(dst[file.len()..], [0; 7]);

        let mut bad = file.clone();
        bad[CHUNK + 5] ^= 1;
        let mut rx = Conn::new(stream(&bad), "t", Side::Peer);
        assert_eq!(
            recv_verified(&mut rx, &m, 2, &mut dst, None).unwrap(),
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
}
