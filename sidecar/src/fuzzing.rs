//! Entry points for the fuzz targets in `fuzz/` that reach checks this crate does not export:
//! what the sidecar checks of a peer's message before it acts on it, and the HTTP request line.
//! Not part of the API.

use crate::http::{self, Response, Routes};
use crate::peer;
use crate::wire::PeerMsg;

/// The checks a message from an authenticated peer passes before the sidecar acts on it: a
/// pushed or fetched shard's manifest must parse and describe the shard it came with; a shared
/// piece asked for must check out before any byte is read for it, and is checked against bytes.
pub fn peer_message(msg: &PeerMsg) {
    if let PeerMsg::Piece { piece, .. } = msg
        && piece.check().is_ok()
    {
        let _ = piece.content_id();
        let junk = vec![0u8; piece.len.unwrap_or(64).min(1 << 16) as usize];
        let _ = crate::share::verify(piece, &junk);
    }
    if let PeerMsg::Push { shard, manifest }
    | PeerMsg::Shard {
        shard, manifest, ..
    } = msg
        && let Ok(m) = peer::check_manifest(shard, manifest, "fuzz")
    {
        assert_eq!(
            (m.job.as_str(), m.step, m.rank, m.world_size, m.file_len),
            (
                shard.job.as_str(),
                shard.step,
                shard.rank,
                shard.world_size,
                shard.len
            )
        );
    }
}

struct Paths;

impl Routes for Paths {
    fn get(&self, path: &str) -> Option<Response> {
        (path == "/livez").then(|| Response::text(200, "ok\n"))
    }
}

/// A request head as the HTTP port receives it (at most [`http::MAX_HEAD`] bytes are read).
pub fn http_request(head: &[u8]) {
    let head = &head[..head.len().min(http::MAX_HEAD)];
    let (response, _) = http::respond(&Paths, head);
    assert!(matches!(response.status, 200 | 400 | 404 | 405));
}
