//! Chunks shared between the nodes of a job, through the node's sidecar.
//!
//! When a job starts, every node reads the same image layers and environment from the same
//! store. A chunk store given the socket of its node's sidecar ([`ChunkStoreConfig::share`],
//! the `HOTSTART_SHARE` variable) asks the sidecar for what it would have fetched from a
//! remote store: a chunk's frame, or a range of an environment's pack, named together with the
//! ids of the frames it holds (a [`Piece`]). The sidecar answers from its cache, from the peer
//! that fetches that piece for the whole job, or from the store itself, and checks every frame
//! against its id before it answers; this process checks every frame again when it decodes it.
//!
//! Sharing is only ever a shortcut. A sidecar that is not running, refuses to share or fails
//! a request costs this process a log line and the store read it would have made anyway; after
//! a failure to reach the sidecar, the store is read directly for [`RETRY_AFTER`] before the
//! sidecar is tried again.
//!
//! [`ChunkStoreConfig::share`]: super::ChunkStoreConfig::share

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hotstart_proto::PROTOCOL_VERSION;
use hotstart_proto::share::{Piece, PieceSource};
use hotstart_proto::wire::{Conn, LocalMsg, Side};
use parking_lot::Mutex;

/// The variable that names the node's sidecar socket to share chunks through.
pub const SHARE_ENV: &str = "HOTSTART_SHARE";

/// How long the store is read directly after the sidecar could not be reached.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

/// How long a request may wait for the sidecar's answer (which may wait for a peer or the
/// store) before this process reads the store itself.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// A piece as the sidecar sent it.
#[derive(Debug, Clone)]
pub struct SharedPiece {
    pub bytes: Bytes,
    pub source: PieceSource,
    /// The peer it came from, when it came from one.
    pub peer: Option<String>,
}

/// The client of a node's sidecar for shared pieces: blocking, a connection per request in
/// flight, kept for the next one.
#[derive(Debug)]
pub struct Share {
    socket: PathBuf,
    idle: Mutex<Vec<Conn<UnixStream>>>,
    /// Until when the sidecar is not asked (it could not be reached).
    resting: Mutex<Option<Instant>>,
}

impl Share {
    /// Shares through the sidecar listening on `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Share {
        Share {
            socket: socket.into(),
            idle: Mutex::new(Vec::new()),
            resting: Mutex::new(None),
        }
    }

    /// The sidecar's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The socket `HOTSTART_SHARE` names, if it names one.
    pub fn socket_from_env() -> Option<PathBuf> {
        std::env::var_os(SHARE_ENV)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    }

    /// Asks the sidecar for `piece`, on the calling thread. `Ok(None)` while the sidecar is
    /// resting after it could not be reached, or when it has no peers to share with (and not
    /// the piece); `Err` says why it did not answer with the piece (the caller reads the
    /// store either way).
    pub fn piece(&self, piece: &Piece) -> Result<Option<SharedPiece>, String> {
        if self
            .resting
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            return Ok(None);
        }
        let mut conn = match self.idle.lock().pop() {
            Some(c) => c,
            None => match self.connect() {
                Ok(c) => c,
                Err(e) => {
                    *self.resting.lock() = Some(Instant::now() + RETRY_AFTER);
                    return Err(e);
                }
            },
        };
        let got = ask(&mut conn, piece)?;
        self.idle.lock().push(conn);
        Ok(got)
    }

    fn connect(&self) -> Result<Conn<UnixStream>, String> {
        let at = self.socket.display();
        let sock = UnixStream::connect(&self.socket)
            .map_err(|e| format!("cannot reach the sidecar at {at}: {e}"))?;
        sock.set_read_timeout(Some(ANSWER_TIMEOUT))
            .and_then(|()| sock.set_write_timeout(Some(ANSWER_TIMEOUT)))
            .map_err(|e| format!("sidecar socket {at}: {e}"))?;
        let mut conn = Conn::new(sock, at.to_string(), Side::Local);
        conn.send(&LocalMsg::Share {
            version: PROTOCOL_VERSION,
        })
        .map_err(|e| e.to_string())?;
        match conn.recv::<LocalMsg>().map_err(|e| e.to_string())? {
            LocalMsg::Sharing { .. } => Ok(conn),
            LocalMsg::Failed { reason } => {
                Err(format!("the sidecar at {at} does not share: {reason}"))
            }
            other => Err(format!("the sidecar at {at} answered {other:?} to Share")),
        }
    }
}

/// `Ok(None)`: the sidecar has no peers and not the piece.
fn ask(conn: &mut Conn<UnixStream>, piece: &Piece) -> Result<Option<SharedPiece>, String> {
    conn.send(&LocalMsg::Piece {
        piece: piece.clone(),
    })
    .map_err(|e| e.to_string())?;
    match conn.recv::<LocalMsg>().map_err(|e| e.to_string())? {
        LocalMsg::PieceIs { len, source, peer } => {
            let fits =
                piece.len.is_none_or(|l| l == len) && len <= hotstart_proto::share::MAX_PIECE_LEN;
            if !fits {
                return Err(format!(
                    "the sidecar announced {len} bytes for {}",
                    piece.key
                ));
            }
            let mut buf = vec![0u8; len as usize];
            conn.recv_data_exact(&mut buf).map_err(|e| e.to_string())?;
            Ok(Some(SharedPiece {
                bytes: Bytes::from(buf),
                source,
                peer,
            }))
        }
        LocalMsg::NotShared => Ok(None),
        LocalMsg::Failed { reason } => Err(reason),
        other => Err(format!("the sidecar answered {other:?} to Piece")),
    }
}
