//! Peer authentication: challenge-response with keyed blake3 in both directions, so each side
//! proves it knows the cluster token without revealing it.
//!
//! ```text
//! K  = blake3::derive_key("hotstart sidecar cluster token v1", token)
//! C → S  Hello     { node_c, domain_c, nonce_c }                        (fresh 32 random bytes)
//! S → C  Challenge { node_s, domain_s, nonce_s, proof_s = MAC_K("server", nonce_c, nonce_s, node_s, node_c) }
//!        C checks proof_s (else: the server does not know the token; C hangs up)
//! C → S  Proof     { proof_c = MAC_K("client", nonce_c, nonce_s, node_c, node_s) }
//!        S checks proof_c (else: Refused, logged, connection closed)
//! S → C  Welcome
//! session key = MAC_K("session", nonce_c, nonce_s); every later message is tagged with it
//! ```
//!
//! Fresh nonces on both sides make every proof single-use; the role label keeps a server's proof
//! from being replayed as a client's (or reflected back); the node ids bind the proof to who is
//! talking to whom. Comparisons are constant-time. A peer that expects a particular node id at
//! an address (a static peer list) refuses another one. Without a token (`--insecure`, loopback
//! only) the same exchange runs with an empty token, which identifies nodes but proves nothing.

use std::io::{Read, Write};

use crate::error::{Error, Result};
use crate::wire::PeerMsg;
use hotstart_proto::wire::Conn;

/// The reason of the error a node gets when it connects to itself (a DNS name that resolves to
/// every node, this one included).
pub const SELF_CONNECTION: &str = "connected to itself";

/// Version of the peer protocol, checked in `Hello`.
pub const PROTOCOL_VERSION: u32 = 1;
const KEY_CONTEXT: &str = "hotstart sidecar cluster token v1";

/// The key every peer derives from the cluster token.
#[derive(Clone)]
pub struct ClusterKey([u8; 32]);

impl std::fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterKey(<redacted>)")
    }
}

impl ClusterKey {
    /// The key of `token` (an empty token for `--insecure`).
    pub fn new(token: &[u8]) -> ClusterKey {
        ClusterKey(blake3::derive_key(KEY_CONTEXT, token))
    }

    fn mac(&self, label: &str, parts: &[&[u8]]) -> blake3::Hash {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(label.as_bytes());
        for p in parts {
            // Length-prefixed, so no two different part lists hash the same input.
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        h.finalize()
    }
}

/// Who this end is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub node: String,
    pub domain: String,
}

/// 32 bytes from the kernel's random source.
fn nonce() -> Result<[u8; 32]> {
    let mut out = [0u8; 32];
    let mut got = 0;
    while got < out.len() {
        // SAFETY: getrandom writes at most the given number of bytes into the buffer.
        let n = unsafe { libc::getrandom(out[got..].as_mut_ptr().cast(), out.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", "", e));
        }
        got += n as usize;
    }
    Ok(out)
}

fn decode32<S>(conn: &mut Conn<S>, what: &str, hex: &str) -> Result<[u8; 32]>
where
    S: Read + Write,
{
    match blake3::Hash::from_hex(hex) {
        Ok(h) => Ok(*h.as_bytes()),
        Err(_) => Err(conn
            .violation(format!("{what} is not 32 bytes of hex"))
            .into()),
    }
}

fn auth_error<S: Read + Write>(conn: &Conn<S>, reason: impl Into<String>) -> Error {
    Error::Auth {
        peer: conn.label().to_string(),
        reason: reason.into(),
    }
}

/// The client's half: authenticates the server (refusing any node id but `expect`, when given)
/// and itself; the server's identity.
pub fn client<S: Read + Write>(
    conn: &mut Conn<S>,
    key: &ClusterKey,
    me: &Identity,
    expect: Option<&str>,
) -> Result<Identity> {
    let nonce_c = nonce()?;
    conn.send(&PeerMsg::Hello {
        version: PROTOCOL_VERSION,
        node: me.node.clone(),
        domain: me.domain.clone(),
        nonce: blake3::Hash::from_bytes(nonce_c).to_hex().to_string(),
    })?;
    let (node, domain, nonce_s, proof) = match conn.recv::<PeerMsg>()? {
        PeerMsg::Challenge {
            node,
            domain,
            nonce,
            proof,
        } => (node, domain, nonce, proof),
        PeerMsg::Refused { reason } if reason == SELF_CONNECTION => {
            return Err(auth_error(conn, SELF_CONNECTION));
        }
        PeerMsg::Refused { reason } => return Err(auth_error(conn, format!("refused: {reason}"))),
        other => {
            return Err(conn
                .violation(format!("expected a challenge, got {other:?}"))
                .into());
        }
    };
    let nonce_s = decode32(conn, "nonce", &nonce_s)?;
    let proof_s = decode32(conn, "proof", &proof)?;
    let want = key.mac(
        "server",
        &[&nonce_c, &nonce_s, node.as_bytes(), me.node.as_bytes()],
    );
    if want != blake3::Hash::from_bytes(proof_s) {
        return Err(auth_error(
            conn,
            format!("node {node:?} does not know the cluster token"),
        ));
    }
    if let Some(e) = expect
        && e != node
    {
        return Err(auth_error(
            conn,
            format!("expected node {e:?}, found {node:?}"),
        ));
    }
    if node == me.node {
        return Err(auth_error(conn, SELF_CONNECTION));
    }
    let proof_c = key.mac(
        "client",
        &[&nonce_c, &nonce_s, me.node.as_bytes(), node.as_bytes()],
    );
    conn.send(&PeerMsg::Proof {
        proof: proof_c.to_hex().to_string(),
    })?;
    match conn.recv::<PeerMsg>()? {
        PeerMsg::Welcome => {}
        PeerMsg::Refused { reason } => return Err(auth_error(conn, format!("refused: {reason}"))),
        other => {
            return Err(conn
                .violation(format!("expected welcome, got {other:?}"))
                .into());
        }
    }
    let session = key.mac("session", &[&nonce_c, &nonce_s]);
    conn.authenticated(*session.as_bytes(), b'c', b's');
    conn.relabel(format!("{node} ({})", conn.label()));
    Ok(Identity { node, domain })
}

/// The server's half: the client's identity once it proved it knows the token. A failure has
/// been answered with `Refused` where the connection still works.
pub fn server<S: Read + Write>(
    conn: &mut Conn<S>,
    key: &ClusterKey,
    me: &Identity,
) -> Result<Identity> {
    let (version, node, domain, nonce_c) = match conn.recv::<PeerMsg>()? {
        PeerMsg::Hello {
            version,
            node,
            domain,
            nonce,
        } => (version, node, domain, nonce),
        other => {
            let reason = format!("expected hello, got {}", op_name(&other));
            let _ = conn.send(&PeerMsg::Refused {
                reason: "authenticate first".into(),
            });
            return Err(auth_error(conn, reason));
        }
    };
    if version != PROTOCOL_VERSION {
        let reason = format!("protocol version {version}, this node speaks {PROTOCOL_VERSION}");
        let _ = conn.send(&PeerMsg::Refused {
            reason: reason.clone(),
        });
        return Err(auth_error(conn, reason));
    }
    if node == me.node {
        let _ = conn.send(&PeerMsg::Refused {
            reason: SELF_CONNECTION.into(),
        });
        return Err(auth_error(conn, SELF_CONNECTION));
    }
    let nonce_c = decode32(conn, "nonce", &nonce_c)?;
    let nonce_s = nonce()?;
    let proof_s = key.mac(
        "server",
        &[&nonce_c, &nonce_s, me.node.as_bytes(), node.as_bytes()],
    );
    conn.send(&PeerMsg::Challenge {
        node: me.node.clone(),
        domain: me.domain.clone(),
        nonce: blake3::Hash::from_bytes(nonce_s).to_hex().to_string(),
        proof: proof_s.to_hex().to_string(),
    })?;
    let proof = match conn.recv::<PeerMsg>() {
        Ok(PeerMsg::Proof { proof }) => proof,
        Ok(other) => {
            return Err(auth_error(
                conn,
                format!("expected a proof from {node:?}, got {}", op_name(&other)),
            ));
        }
        Err(e) if conn.violated() => return Err(e.into()),
        // The client hung up: it found our proof wrong (another token).
        Err(e) => {
            return Err(auth_error(
                conn,
                format!("{node:?} hung up before proving the token (another token?): {e}"),
            ));
        }
    };
    let proof_c = decode32(conn, "proof", &proof)?;
    let want = key.mac(
        "client",
        &[&nonce_c, &nonce_s, node.as_bytes(), me.node.as_bytes()],
    );
    if want != blake3::Hash::from_bytes(proof_c) {
        let _ = conn.send(&PeerMsg::Refused {
            reason: "wrong cluster token".into(),
        });
        return Err(auth_error(
            conn,
            format!("{node:?} does not know the cluster token"),
        ));
    }
    conn.send(&PeerMsg::Welcome)?;
    let session = key.mac("session", &[&nonce_c, &nonce_s]);
    conn.authenticated(*session.as_bytes(), b's', b'c');
    conn.relabel(format!("{node} ({})", conn.label()));
    Ok(Identity { node, domain })
}

/// A message's `op`, for logs (never its contents).
fn op_name(m: &PeerMsg) -> String {
    serde_json::to_value(m)
        .ok()
        .and_then(|v| v.get("op").and_then(|o| o.as_str()).map(String::from))
        .unwrap_or_else(|| "?".into())
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;
    use hotstart_proto::wire::Side;

    fn id(n: &str) -> Identity {
        Identity {
            node: n.into(),
            domain: String::new(),
        }
    }

    fn pair(
        server_key: ClusterKey,
        client_key: ClusterKey,
        expect: Option<&str>,
    ) -> (Result<Identity>, Result<Identity>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let s = std::thread::spawn(move || {
            let (sock, _) = l.accept().unwrap();
            let mut c = Conn::new(sock, "client", Side::Peer);
            let r = server(&mut c, &server_key, &id("s"));
            if r.is_ok() {
                // The session works: a tagged round trip.
                let m: PeerMsg = c.recv().unwrap();
                assert!(matches!(m, PeerMsg::Inventory { .. }));
                c.send(&PeerMsg::Held { shards: vec![] }).unwrap();
            }
            r
        });
        let mut c = Conn::new(TcpStream::connect(addr).unwrap(), "server", Side::Peer);
        let r = client(&mut c, &client_key, &id("c"), expect);
        if r.is_ok() {
            c.send(&PeerMsg::Inventory { job: None }).unwrap();
            assert!(matches!(c.recv::<PeerMsg>().unwrap(), PeerMsg::Held { .. }));
        } else {
            drop(c);
        }
        (s.join().unwrap(), r)
    }

    #[test]
    fn same_token_authenticates_both_ways() {
        let (s, c) = pair(ClusterKey::new(b"t"), ClusterKey::new(b"t"), Some("s"));
        assert_eq!(s.unwrap().node, "c");
        assert_eq!(c.unwrap().node, "s");
    }

    #[test]
    fn another_token_is_refused_on_both_sides() {
        let (s, c) = pair(ClusterKey::new(b"t"), ClusterKey::new(b"u"), None);
        let (s, c) = (s.unwrap_err().to_string(), c.unwrap_err().to_string());
        assert!(s.contains("authentication") && s.contains("token"), "{s}");
        assert!(c.contains("does not know the cluster token"), "{c}");
        // No token at all against a token.
        let (s, c) = pair(ClusterKey::new(b"t"), ClusterKey::new(b""), None);
        assert!(s.is_err() && c.is_err());
    }

    #[test]
    fn an_unexpected_node_id_is_refused() {
        let (_, c) = pair(ClusterKey::new(b"t"), ClusterKey::new(b"t"), Some("x"));
        assert!(c.unwrap_err().to_string().contains("expected node \"x\""));
    }
}
