//! The sidecar's wire protocol: length-prefixed, versioned frames, shared by the Unix socket
//! (training process ↔ sidecar) and TCP (sidecar ↔ peer). `docs/PROTOCOL.md` is the reference.
//!
//! ```text
//! frame   = magic "HSWP" | version u8 (1) | kind u8 | reserved u16 (0) | len u32 LE | payload
//!           [| tag, 32 bytes: message frames of an authenticated peer connection]
//! kind 1  = message: `len` bytes of JSON (one `Msg` or `LocalMsg`)
//! kind 2  = data: `len` raw bytes of a shard, in order
//! ```
//!
//! **Bounds.** A message is at most [`MAX_HANDSHAKE`] bytes until the connection is
//! authenticated and [`MAX_MESSAGE`] after; a data frame at most [`MAX_DATA`]. A length over the
//! bound, a bad magic, an unknown version or kind, a reserved field that is not 0, JSON that
//! does not decode, data where a message was expected (or the reverse) and a wrong tag are
//! protocol violations: the connection is dropped (and only that connection). Nothing is
//! allocated before the length is checked. Shard bytes are never trusted either: the receiver
//! checks them against the manifest's blake3 chunk hashes.
//!
//! **Integrity after authentication.** Once the handshake (the sidecar's `auth`) has given both ends a
//! session key, every message frame carries a keyed blake3 tag over the direction, a sequence
//! number, the header and the payload, so a message cannot be forged, replayed, reordered or
//! moved to the other direction. Data frames are not tagged: they are covered by the chunk
//! hashes of the manifest, which arrived in a tagged message.

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::TierKind;
use crate::shm;

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"HSWP";
/// The frame format this build speaks.
pub const VERSION: u8 = 1;
/// Bytes of a frame header.
pub const HEADER_LEN: usize = 12;
/// Largest message before authentication.
pub const MAX_HANDSHAKE: usize = 4 << 10;
/// Largest message.
pub const MAX_MESSAGE: usize = 16 << 20;
/// Largest data frame; shards are sent as many.
pub const MAX_DATA: usize = 8 << 20;
/// Bytes of a message tag.
pub const TAG_LEN: usize = 32;

const KIND_MESSAGE: u8 = 1;
const KIND_DATA: u8 = 2;

/// Messages on the Unix socket between a training process and its sidecar.
/// `len` bytes of a stored tensor's bytes from byte `offset` on: what a reader that reshards
/// needs of a rank's file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    pub tensor: String,
    pub offset: u64,
    pub len: u64,
}

/// One copy of an `Upload`: `len` bytes of the restored step's file from byte `from` on, into
/// the device allocation that `handle` shares (a CUDA IPC memory handle, 64 bytes as 128 hex
/// digits), `offset` bytes into it, on the device whose UUID is `device` (16 bytes as 32 hex
/// digits: two processes may number the same devices differently).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceCopy {
    pub from: u64,
    pub len: u64,
    pub device: String,
    pub handle: String,
    pub offset: u64,
}

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_LEN: usize = 64;
/// Bytes of a CUDA device UUID.
pub const DEVICE_UUID_LEN: usize = 16;

impl DeviceCopy {
    /// The copy of `len` bytes from `from` into `handle`'s allocation at `offset`, on the device
    /// with UUID `device`.
    pub fn new(
        from: u64,
        len: u64,
        device: &[u8; DEVICE_UUID_LEN],
        handle: &[u8; IPC_HANDLE_LEN],
        offset: u64,
    ) -> Self {
        DeviceCopy {
            from,
            len,
            device: to_hex(device),
            handle: to_hex(handle),
            offset,
        }
    }

    /// The device UUID's bytes, or `None` when it is not 32 hex digits.
    pub fn device_bytes(&self) -> Option<[u8; DEVICE_UUID_LEN]> {
        from_hex(&self.device)
    }

    /// The handle's bytes, or `None` when it is not 128 hex digits.
    pub fn handle_bytes(&self) -> Option<[u8; IPC_HANDLE_LEN]> {
        from_hex(&self.handle)
    }
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `N` bytes from `2 × N` hex digits.
fn from_hex<const N: usize>(hex: &str) -> Option<[u8; N]> {
    let hex = hex.as_bytes();
    if hex.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (o, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        *o = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LocalMsg {
    /// Engine → sidecar, first: which rank of which job this connection is for.
    Attach {
        version: u32,
        job: String,
        rank: u32,
        world_size: u32,
    },
    /// The sidecar's node id and the tiers a save goes to.
    Attached { node: String, tiers: Vec<TierKind> },
    /// A segment of `len` bytes to stage `step` into (`wait`: wait for memory to be freed).
    /// `ahead`: for the next save, whose step is not known yet (`step` is the last one saved):
    /// prepared in the background, and the commit's manifest names the step.
    Stage {
        step: u64,
        len: u64,
        wait: bool,
        #[serde(default)]
        ahead: bool,
    },
    /// The segment (its descriptor travels with this frame).
    Segment { len: u64 },
    /// Every byte of the step is in the segment, laid out as this manifest says (its chunk
    /// hashes all zero: the sidecar computes them); the training process writes the segment no
    /// more. From here the step is the sidecar's to finish, even if the connection closes
    /// before `Commit`. No answer.
    Filled { manifest: String },
    /// The segment is unmapped and its descriptor closed: the sidecar seals it, hashes it into
    /// the manifest that came with `Filled`, and holds it.
    Commit,
    /// Sealed, verified and held in memory.
    Committed,
    /// A tier the sidecar persists to (peers, disk, store) finished the step.
    Persisted {
        tier: TierKind,
        error: Option<String>,
    },
    /// Send me a step (`None`: the newest complete for every rank). `file`: the process can
    /// take a file of the sidecar's disk tier instead of a segment, and verify it itself.
    /// `regions`: the process reads only these byte ranges of the step's tensors (a load that
    /// reshards), so a shard fetched from a peer for it may carry only the chunks that hold
    /// them and the file's header; the other bytes of the segment are then zero.
    Restore {
        step: Option<u64>,
        #[serde(default)]
        file: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        regions: Option<Vec<Region>>,
    },
    /// The step, from where it came and how long the sidecar took; the sealed segment's
    /// descriptor travels with this frame. With `file`, the descriptor is the step's file on
    /// the sidecar's disk instead, opened read-only and not yet verified: the process reads it
    /// and checks every chunk against the manifest, and asks again without `file` for a
    /// segment when a chunk does not match.
    Restored {
        step: u64,
        source: TierKind,
        manifest: String,
        chunk_sources: Vec<TierKind>,
        seconds: f64,
        #[serde(default)]
        file: bool,
    },
    /// After `Restored` with a segment, on the same connection: copy these ranges of it into
    /// the process's device memory, from the sidecar's own mapping of the segment, pinned for
    /// the device when the step was committed (a restarted process has no pinned copy of its
    /// own). Answered with `Uploaded` once every copy is done, or `Failed` (the sidecar has no
    /// GPU, the segment is not pinned yet, a handle does not open): the process then copies
    /// the bytes itself.
    Upload { copies: Vec<DeviceCopy> },
    /// Every copy of `Upload` is done: `bytes` in all, in `seconds`.
    Uploaded { bytes: u64, seconds: f64 },
    /// Which step is the newest complete for every rank?
    Latest,
    /// Which step is the newest complete for every rank, older than `step`? (What a job goes
    /// back to when a rank cannot restore the step it chose: corrupt or gone in every tier.)
    LatestBelow { step: u64 },
    /// The answer to `Latest`.
    LatestIs { step: Option<u64> },
    /// Which step is the newest complete for every rank of the world size that saved it,
    /// whatever that world size (older than `below`, if given)? What a job that comes back
    /// with another number of ranks reshards.
    LatestCheckpoint { below: Option<u64> },
    /// The answer to `LatestCheckpoint`: the step and the world size that saved it.
    CheckpointIs { found: Option<(u64, u32)> },
    /// `rank`'s manifest of `step`, whatever world size saved it (a resharding reader learns
    /// the saved layout from it before asking for bytes).
    Manifest { step: u64, rank: u32 },
    /// The answer to `Manifest`: the manifest JSON (its chunks are verified by the restore
    /// that reads them).
    ManifestIs { manifest: String },
    /// No such step anywhere.
    NotFound { step: Option<u64> },
    /// The step's shard has a chunk whose copies are damaged or gone in every tier.
    Corrupt {
        step: u64,
        chunk: usize,
        reason: String,
    },
    /// The request failed.
    Failed { reason: String },
    /// The sidecar is shutting down and takes no new saves: a save waits for its next life
    /// (a sidecar restarting) rather than failing.
    Draining,
    /// A tier the answer depends on cannot be read (the store is down, say), so the sidecar
    /// cannot tell which steps exist: never answered as "none".
    Unavailable { tier: TierKind, reason: String },
    /// Process → sidecar, first (instead of `Attach`): this connection asks for pieces of
    /// store objects shared between the job's nodes ([`crate::share`]). Answered with
    /// `Sharing`, or `Failed` when this sidecar does not share.
    Share { version: u32 },
    /// Sharing is on; requests may follow.
    Sharing { node: String },
    /// Send me this piece: from the sidecar's cache, a peer that holds or fetches it, or the
    /// store. Answered with `PieceIs` and its data frames, or `Failed`.
    Piece { piece: crate::share::Piece },
    /// This node has no peers to share with, and the piece is not in its cache: read the
    /// store.
    NotShared,
    /// The piece (`len` bytes in data frames follow), every frame checked against its id, and
    /// where it came from (`peer`: which one).
    PieceIs {
        len: u64,
        source: crate::share::PieceSource,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer: Option<String>,
    },
}

/// Which side of which protocol a connection is, for its errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A connection between two sidecars.
    Peer,
    /// The Unix socket between a training process and its sidecar.
    Local,
}

/// A connection that failed, timed out, or whose other end broke the protocol. The engine
/// reports it as its `Error::Sidecar`; the sidecar reports a peer link's as its own peer
/// error.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}{label}: {reason}", match side { Side::Peer => "peer ", Side::Local => "sidecar at " })]
pub struct LinkError {
    /// Which protocol.
    pub side: Side,
    /// The other end: a peer's address or id, or the socket path.
    pub label: String,
    /// What went wrong.
    pub reason: String,
}

/// `Result` of a framed connection.
pub type LinkResult<T> = std::result::Result<T, LinkError>;

/// Tags message frames once a session key is agreed.
struct Mac {
    key: [u8; 32],
    out_label: u8,
    in_label: u8,
    sent: u64,
    received: u64,
}

fn tag(key: &[u8; 32], label: u8, seq: u64, header: &[u8], payload: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(&[label]);
    h.update(&seq.to_le_bytes());
    h.update(header);
    h.update(payload);
    h.finalize()
}

/// A framed connection.
pub struct Conn<S> {
    io: S,
    label: String,
    side: Side,
    mac: Option<Mac>,
    max_message: usize,
    violated: bool,
}

impl<S> std::fmt::Debug for Conn<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("label", &self.label)
            .field("side", &self.side)
            .field("tagged", &self.mac.is_some())
            .finish_non_exhaustive()
    }
}

fn header(kind: u8, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h[8..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

impl<S: Read + Write> Conn<S> {
    /// A connection to `label` (a peer's address or id, or the socket path).
    pub fn new(io: S, label: impl Into<String>, side: Side) -> Conn<S> {
        Conn {
            io,
            label: label.into(),
            side,
            mac: None,
            max_message: match side {
                Side::Peer => MAX_HANDSHAKE,
                Side::Local => MAX_MESSAGE,
            },
            violated: false,
        }
    }

    /// What the connection is to.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &S {
        &self.io
    }

    /// Whether the last error was the other end breaking the protocol (not an I/O error).
    pub fn violated(&self) -> bool {
        self.violated
    }

    /// Names the other end after authentication.
    pub fn relabel(&mut self, label: impl Into<String>) {
        self.label = label.into();
    }

    /// Turns on message tags with `key` (this end's label first) and lifts the message bound.
    pub fn authenticated(&mut self, key: [u8; 32], out_label: u8, in_label: u8) {
        self.mac = Some(Mac {
            key,
            out_label,
            in_label,
            sent: 0,
            received: 0,
        });
        self.max_message = MAX_MESSAGE;
    }

    /// An error of this connection.
    pub fn error(&self, reason: impl Into<String>) -> LinkError {
        LinkError {
            side: self.side,
            label: self.label.clone(),
            reason: reason.into(),
        }
    }

    fn io_error(&self, op: &str, e: io::Error) -> LinkError {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => self.error(format!("{op}: connection closed")),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                self.error(format!("{op}: timed out"))
            }
            _ => self.error(format!("{op}: {e}")),
        }
    }

    /// A protocol violation: remembered, so the caller can count it, and returned.
    pub fn violation(&mut self, reason: impl Into<String>) -> LinkError {
        self.violated = true;
        self.error(format!("protocol violation: {}", reason.into()))
    }

    /// Encodes a message frame (with its tag, if any).
    fn encode<T: Serialize>(&mut self, msg: &T) -> LinkResult<Vec<u8>> {
        let payload = serde_json::to_vec(msg).map_err(|e| self.error(format!("encode: {e}")))?;
        if payload.len() > MAX_MESSAGE {
            return Err(self.error(format!(
                "message of {} bytes exceeds {MAX_MESSAGE}",
                payload.len()
            )));
        }
        let h = header(KIND_MESSAGE, payload.len());
        let mut frame = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
        frame.extend_from_slice(&h);
        frame.extend_from_slice(&payload);
        if let Some(m) = &mut self.mac {
            frame.extend_from_slice(tag(&m.key, m.out_label, m.sent, &h, &payload).as_bytes());
            m.sent += 1;
        }
        Ok(frame)
    }

    /// Sends one message.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> LinkResult<()> {
        let frame = self.encode(msg)?;
        self.io
            .write_all(&frame)
            .and_then(|()| self.io.flush())
            .map_err(|e| self.io_error("send", e))
    }

    fn read_header(&mut self) -> LinkResult<(u8, usize, [u8; HEADER_LEN])> {
        let mut h = [0u8; HEADER_LEN];
        self.io
            .read_exact(&mut h)
            .map_err(|e| self.io_error("receive", e))?;
        if h[..4] != MAGIC {
            return Err(self.violation("bad magic (not a hotstart sidecar frame)"));
        }
        if h[4] != VERSION {
            return Err(self.violation(format!(
                "frame version {}, this build speaks {VERSION}",
                h[4]
            )));
        }
        if h[6] != 0 || h[7] != 0 {
            return Err(self.violation("reserved header bytes are not 0"));
        }
        let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
        let max = match h[5] {
            KIND_MESSAGE => self.max_message,
            KIND_DATA => MAX_DATA,
            k => return Err(self.violation(format!("unknown frame kind {k}"))),
        };
        if len > max {
            return Err(self.violation(format!("frame of {len} bytes exceeds {max}")));
        }
        Ok((h[5], len, h))
    }

    /// Receives one message; anything else is a protocol violation.
    pub fn recv<T: DeserializeOwned>(&mut self) -> LinkResult<T> {
        let (kind, len, h) = self.read_header()?;
        if kind != KIND_MESSAGE {
            return Err(self.violation("data frame where a message was expected"));
        }
        let mut payload = vec![0u8; len];
        self.io
            .read_exact(&mut payload)
            .map_err(|e| self.io_error("receive", e))?;
        if self.mac.is_some() {
            let mut got = [0u8; TAG_LEN];
            self.io
                .read_exact(&mut got)
                .map_err(|e| self.io_error("receive", e))?;
            let ok = self.mac.as_mut().is_some_and(|m| {
                let want = tag(&m.key, m.in_label, m.received, &h, &payload);
                m.received += 1;
                // Constant-time comparison (blake3's `Hash` equality).
                want == blake3::Hash::from_bytes(got)
            });
            if !ok {
                return Err(self.violation("message tag does not match"));
            }
        }
        serde_json::from_slice(&payload).map_err(|e| self.violation(format!("message: {e}")))
    }

    /// Sends `data` as data frames.
    pub fn send_data(&mut self, data: &[u8]) -> LinkResult<()> {
        for piece in data.chunks(MAX_DATA) {
            let h = header(KIND_DATA, piece.len());
            self.io
                .write_all(&h)
                .and_then(|()| self.io.write_all(piece))
                .map_err(|e| self.io_error("send data", e))?;
        }
        self.io.flush().map_err(|e| self.io_error("send data", e))
    }

    /// Reads the header of a data frame of at most `room` bytes (and at least one); its length.
    /// The payload is then read with [`Conn::read_payload`].
    pub fn recv_data_len(&mut self, room: usize) -> LinkResult<usize> {
        let (kind, len, _) = self.read_header()?;
        if kind != KIND_DATA {
            return Err(self.violation("message frame where data was expected"));
        }
        if len > room {
            return Err(self.violation(format!("data frame of {len} bytes where {room} remain")));
        }
        if len == 0 {
            return Err(self.violation("empty data frame"));
        }
        Ok(len)
    }

    /// Reads `buf.len()` bytes of the current data frame's payload.
    pub fn read_payload(&mut self, buf: &mut [u8]) -> LinkResult<()> {
        self.io
            .read_exact(buf)
            .map_err(|e| self.io_error("receive data", e))
    }

    /// Receives one data frame into the start of `out`, which must have room for it; its
    /// length.
    pub fn recv_data(&mut self, out: &mut [u8]) -> LinkResult<usize> {
        let len = self.recv_data_len(out.len())?;
        self.read_payload(&mut out[..len])?;
        Ok(len)
    }

    /// Fills `out` with data frames.
    pub fn recv_data_exact(&mut self, out: &mut [u8]) -> LinkResult<()> {
        let mut at = 0;
        while at < out.len() {
            at += self.recv_data(&mut out[at..])?;
        }
        Ok(())
    }
}

/// A Unix stream that receives file descriptors along with bytes, and keeps them until asked.
#[derive(Debug)]
pub struct FdStream {
    sock: UnixStream,
    fds: Vec<OwnedFd>,
}

impl FdStream {
    pub fn new(sock: UnixStream) -> FdStream {
        FdStream {
            sock,
            fds: Vec::new(),
        }
    }

    pub fn socket(&self) -> &UnixStream {
        &self.sock
    }
}

impl Read for FdStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        shm::recv(&self.sock, buf, &mut self.fds)
    }
}

impl Write for FdStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        shm::send(&self.sock, buf, None).map(|()| buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A stream that may have a file's bytes sent to it by the kernel (`sendfile`): a plain socket,
/// whose descriptor it names. A stream that transforms what it sends (one that encrypts)
/// names none.
pub trait RawSink {
    /// The descriptor the bytes of a file may be written to as they are.
    fn raw_fd(&self) -> Option<std::os::fd::RawFd>;
}

impl RawSink for std::net::TcpStream {
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.as_raw_fd())
    }
}

impl<S: Read + Write + RawSink> Conn<S> {
    /// Sends `len` bytes of the file `src` from `offset` as data frames, as [`Conn::send_data`]
    /// sends a slice. To a plain socket with `sendfile`: the file's pages go to the socket
    /// without being copied through this process; to any other stream, read and written in
    /// pieces.
    pub fn send_data_from(
        &mut self,
        src: BorrowedFd<'_>,
        offset: u64,
        len: usize,
    ) -> LinkResult<()> {
        let Some(out) = self.io.raw_fd() else {
            return self.send_data_read(src, offset, len);
        };
        let end = offset + len as u64;
        let mut at = offset;
        while at < end {
            let stop = at + (end - at).min(MAX_DATA as u64);
            self.io
                .write_all(&header(KIND_DATA, (stop - at) as usize))
                .map_err(|e| self.io_error("send data", e))?;
            while at < stop {
                let mut off = libc::off_t::try_from(at)
                    .map_err(|_| self.error("offset larger than off_t"))?;
                // SAFETY: sendfile reads the file at `off` and writes the socket; it touches
                // no memory of this process but `off`, which it advances.
                let n =
                    unsafe { libc::sendfile(out, src.as_raw_fd(), &mut off, (stop - at) as usize) };
                match n {
                    n if n > 0 => at += n as u64,
                    0 => {
                        return Err(self.io_error("send data", io::ErrorKind::UnexpectedEof.into()));
                    }
                    _ => {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::Interrupted {
                            return Err(self.io_error("send data", e));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// [`Conn::send_data_from`] through this process: the file read in frame-sized pieces.
    fn send_data_read(&mut self, src: BorrowedFd<'_>, offset: u64, len: usize) -> LinkResult<()> {
        let mut buf = vec![0u8; len.min(MAX_DATA)];
        let mut at = 0;
        while at < len {
            let piece = &mut buf[..(len - at).min(MAX_DATA)];
            let mut got = 0;
            while got < piece.len() {
                let off = libc::off_t::try_from(offset + (at + got) as u64)
                    .map_err(|_| self.error("offset larger than off_t"))?;
                let rest = &mut piece[got..];
                // SAFETY: pread writes at most `rest.len()` bytes into `rest`, which is ours.
                let n = unsafe {
                    libc::pread(src.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), off)
                };
                match n {
                    n if n > 0 => got += n as usize,
                    0 => {
                        return Err(self.io_error("read data", io::ErrorKind::UnexpectedEof.into()));
                    }
                    _ => {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::Interrupted {
                            return Err(self.io_error("read data", e));
                        }
                    }
                }
            }
            self.send_data(piece)?;
            at += piece.len();
        }
        Ok(())
    }
}

impl Conn<FdStream> {
    /// Sends a message with a file descriptor attached to it.
    pub fn send_fd<T: Serialize>(&mut self, msg: &T, fd: BorrowedFd<'_>) -> LinkResult<()> {
        let frame = self.encode(msg)?;
        shm::send(&self.io.sock, &frame, Some(fd)).map_err(|e| self.io_error("send", e))
    }

    /// The descriptor that came with the last message, if exactly one did; others are closed.
    pub fn take_fd(&mut self) -> LinkResult<OwnedFd> {
        let mut fds = std::mem::take(&mut self.io.fds);
        match (fds.pop(), fds.is_empty()) {
            (Some(fd), true) => Ok(fd),
            (None, _) => Err(self.violation("expected a file descriptor with the message")),
            (Some(_), false) => Err(self.violation("more than one file descriptor")),
        }
    }

    /// Closes any descriptors received that nobody asked for.
    pub fn drop_fds(&mut self) {
        self.io.fds.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An in-memory duplex: what is written is read back.
    struct Loop(io::Cursor<Vec<u8>>);

    impl Read for Loop {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl Write for Loop {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let pos = self.0.position();
            self.0.get_mut().extend_from_slice(buf);
            self.0.set_position(pos);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Messages of the shape the peer links send.
    #[derive(Debug, Serialize, Deserialize)]
    #[serde(tag = "op", rename_all = "snake_case")]
    enum Msg {
        Inventory { job: Option<String> },
        Welcome,
        NotFound,
        Refused { reason: String },
    }

    #[test]
    fn a_device_copy_carries_its_handle_as_hex_and_refuses_a_bad_one() {
        let mut handle = [0u8; IPC_HANDLE_LEN];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let uuid = [0xa5; DEVICE_UUID_LEN];
        let c = DeviceCopy::new(4096, 1 << 20, &uuid, &handle, 512);
        assert_eq!((c.handle.len(), c.device.len()), (128, 32));
        let back: DeviceCopy = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back.handle_bytes(), Some(handle));
        assert_eq!(back.device_bytes(), Some(uuid));
        for bad in ["ab", &"zz".repeat(64), &"0".repeat(127)] {
            let c = DeviceCopy {
                handle: bad.to_string(),
                ..c.clone()
            };
            assert_eq!(c.handle_bytes(), None, "{bad:?}");
        }
    }

    fn conn(bytes: Vec<u8>) -> Conn<Loop> {
        Conn::new(Loop(io::Cursor::new(bytes)), "test", Side::Peer)
    }

    #[test]
    fn restore_frames_without_the_file_field_ask_for_and_carry_a_segment() {
        // What engines and sidecars that predate handing files over send.
        let asked: LocalMsg = serde_json::from_str(r#"{"op":"restore","step":3}"#).unwrap();
        assert!(matches!(
            asked,
            LocalMsg::Restore {
                step: Some(3),
                file: false,
                regions: None
            }
        ));
        let answer = r#"{"op":"restored","step":3,"source":"disk","manifest":"{}","chunk_sources":["disk"],"seconds":0.5}"#;
        match serde_json::from_str::<LocalMsg>(answer).unwrap() {
            LocalMsg::Restored { step, file, .. } => assert_eq!((step, file), (3, false)),
            other => panic!("{other:?}"),
        }
        // And the new field, both ways.
        let json = serde_json::to_string(&LocalMsg::Restore {
            step: None,
            file: true,
            regions: None,
        })
        .unwrap();
        assert_eq!(json, r#"{"op":"restore","step":null,"file":true}"#);
    }

    #[test]
    fn messages_and_data_round_trip() {
        let mut c = conn(Vec::new());
        c.send(&Msg::Inventory {
            job: Some("j".into()),
        })
        .unwrap();
        let data: Vec<u8> = (0..MAX_DATA + 10).map(|i| i as u8).collect();
        c.send_data(&data).unwrap();
        match c.recv::<Msg>().unwrap() {
            Msg::Inventory { job } => assert_eq!(job.as_deref(), Some("j")),
            m => panic!("{m:?}"),
        }
        let mut out = vec![0u8; data.len()];
        c.recv_data_exact(&mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn hostile_frames_are_violations() {
        let good = {
            let mut c = conn(Vec::new());
            c.send(&Msg::Welcome).unwrap();
            c.io.0.into_inner()
        };
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        cases.push((bad_magic, "magic"));
        let mut bad_version = good.clone();
        bad_version[4] = 9;
        cases.push((bad_version, "version"));
        let mut bad_kind = good.clone();
        bad_kind[5] = 7;
        cases.push((bad_kind, "kind"));
        let mut reserved = good.clone();
        reserved[7] = 1;
        cases.push((reserved, "reserved"));
        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push((huge, "exceeds"));
        let mut garbage_json = header(KIND_MESSAGE, 4).to_vec();
        garbage_json.extend_from_slice(b"{{{{");
        cases.push((garbage_json, "message"));
        let data_first = header(KIND_DATA, 3).to_vec();
        cases.push((data_first, "data frame"));
        for (bytes, want) in cases {
            let mut c = conn(bytes);
            let err = c.recv::<Msg>().unwrap_err().to_string();
            assert!(c.violated(), "{want}: {err}");
            assert!(err.contains(want), "{want}: {err}");
        }
        // Truncated: an I/O error, not a violation.
        let mut c = conn(good[..good.len() - 2].to_vec());
        let err = c.recv::<Msg>().unwrap_err().to_string();
        assert!(!c.violated() && err.contains("closed"), "{err}");
        // A data frame larger than the room left.
        let mut c = conn(Vec::new());
        c.send_data(&[1, 2, 3, 4]).unwrap();
        let mut small = [0u8; 3];
        assert!(c.recv_data(&mut small).is_err() && c.violated());
    }

    #[test]
    fn tags_catch_forgery_replay_and_reflection() {
        let key = [7u8; 32];
        let mut a = conn(Vec::new());
        a.authenticated(key, b'c', b's');
        a.send(&Msg::Welcome).unwrap();
        a.send(&Msg::NotFound).unwrap();
        let frames = a.io.0.into_inner();
        let first_len = HEADER_LEN + br#"{"op":"welcome"}"#.len() + TAG_LEN;

        let mut b = conn(frames.clone());
        b.authenticated(key, b's', b'c');
        assert!(matches!(b.recv::<Msg>().unwrap(), Msg::Welcome));
        assert!(matches!(b.recv::<Msg>().unwrap(), Msg::NotFound));

        // Reflected back to the sender: the direction label differs.
        let mut reflect = conn(frames.clone());
        reflect.authenticated(key, b'c', b's');
        assert!(reflect.recv::<Msg>().is_err() && reflect.violated());
        // Replayed out of order: the second frame first.
        let mut replay = conn(frames[first_len..].to_vec());
        replay.authenticated(key, b's', b'c');
        assert!(replay.recv::<Msg>().is_err() && replay.violated());
        // A flipped payload bit.
        let mut forged = frames.clone();
        forged[HEADER_LEN + 3] ^= 1;
        let mut f = conn(forged);
        f.authenticated(key, b's', b'c');
        assert!(f.recv::<Msg>().is_err() && f.violated());
        // Another key.
        let mut other = conn(frames);
        other.authenticated([8u8; 32], b's', b'c');
        assert!(other.recv::<Msg>().is_err());
    }

    #[test]
    fn handshake_messages_are_small_until_authenticated() {
        let big = Msg::Refused {
            reason: "x".repeat(MAX_HANDSHAKE),
        };
        let mut c = conn(Vec::new());
        c.send(&big).unwrap();
        let frames = c.io.0.into_inner();
        let mut before = conn(frames.clone());
        assert!(before.recv::<Msg>().is_err() && before.violated());
        let mut local = Conn::new(Loop(io::Cursor::new(frames)), "sock", Side::Local);
        assert!(local.recv::<Msg>().is_ok());
    }
}
