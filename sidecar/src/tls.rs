//! TLS 1.3 on peer links, mutual: every sidecar holds a certificate from the cluster's CA and
//! accepts only peers whose certificate chains to that CA (rustls, AES-GCM through aws-lc-rs).
//!
//! **Files.** One directory (`tls_dir`), laid out as a Kubernetes TLS Secret mounts it:
//! `ca.crt` (the cluster's CA, PEM), `tls.crt` (this node's certificate, then any intermediates,
//! PEM) and `tls.key` (its private key, PEM). A node's certificate names `hotstart-sidecar` (a
//! DNS subject alternative name: the name every client checks) and may serve as both server and
//! client. `hotstart tls init` makes a CA and one such certificate per node ([`init`]).
//!
//! **Reload.** The files are looked at again (their length and modification time) before every
//! new connection; when they changed and load and check, new connections use them. Connections
//! already open keep the session they have, so a rotation drops no transfer. Files that do not
//! load (half written, say) are logged and the previous ones stay in use.
//!
//! **What it protects.** Bytes on a peer link can be neither read nor changed by anyone on the
//! path, and a link is made only between holders of the CA's certificates. The cluster token's
//! handshake (`crate::auth`) still runs inside the link and proves each node's id.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use rustls::StreamOwned;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};
use tracing::{error, info};

use crate::error::{Error, Result};
use hotstart_proto::wire::RawSink;

/// The name every sidecar's certificate carries and every client checks.
pub const PEER_NAME: &str = "hotstart-sidecar";
/// The CA's certificate in `tls_dir`.
pub const CA_FILE: &str = "ca.crt";
/// This node's certificate chain in `tls_dir`.
pub const CERT_FILE: &str = "tls.crt";
/// This node's private key in `tls_dir`.
pub const KEY_FILE: &str = "tls.key";

/// What the three files looked like when they were loaded: length and modification time each.
type Stamp = [Option<(u64, SystemTime)>; 3];

/// The configurations made from one set of files.
struct Loaded {
    stamp: Stamp,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

/// A node's TLS files and the configurations made from them, reloaded when they change.
pub struct Tls {
    dir: PathBuf,
    loaded: Mutex<Loaded>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("dir", &self.dir).finish()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn bad(dir: &Path, file: &str, reason: impl std::fmt::Display) -> Error {
    Error::Tls {
        path: dir.join(file),
        reason: reason.to_string(),
    }
}

fn stamp(dir: &Path) -> Stamp {
    [CA_FILE, CERT_FILE, KEY_FILE].map(|f| {
        let m = std::fs::metadata(dir.join(f)).ok()?;
        Some((m.len(), m.modified().ok()?))
    })
}

/// Loads and checks the files in `dir`: the CA parses, the node's certificate chains to it, is
/// valid now, names [`PEER_NAME`] and serves as server and client, and the key is its key.
fn load(dir: &Path) -> Result<Loaded> {
    let stamp = stamp(dir);
    let read_certs = |file: &str| -> Result<Vec<CertificateDer<'static>>> {
        let path = dir.join(file);
        let certs = CertificateDer::pem_file_iter(&path)
            .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| bad(dir, file, format!("cannot read certificates ({e})")))?;
        if certs.is_empty() {
            return Err(bad(dir, file, "holds no PEM certificate"));
        }
        Ok(certs)
    };
    let ca = read_certs(CA_FILE)?;
    let chain = read_certs(CERT_FILE)?;
    let key = PrivateKeyDer::from_pem_file(dir.join(KEY_FILE)).map_err(|e| {
        bad(
            dir,
            KEY_FILE,
            format!("cannot read a PEM private key ({e})"),
        )
    })?;
    let mut roots = RootCertStore::empty();
    for c in ca {
        roots
            .add(c)
            .map_err(|e| bad(dir, CA_FILE, format!("not a usable CA certificate ({e})")))?;
    }
    let roots = Arc::new(roots);
    let provider = provider();
    let what_to_do = format!(
        "make it again from the cluster's CA ({CA_FILE} beside it), for example with `hotstart tls init`"
    );
    // The node's own certificate, checked as each side of a link will check it.
    let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| bad(dir, CA_FILE, e))?;
    let servers = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| bad(dir, CA_FILE, e))?;
    let now = UnixTime::now();
    clients
        .verify_client_cert(&chain[0], &chain[1..], now)
        .map_err(|e| {
            bad(
                dir,
                CERT_FILE,
                format!("not valid as a client ({e}): {what_to_do}"),
            )
        })?;
    let name = ServerName::try_from(PEER_NAME).map_err(|e| bad(dir, CERT_FILE, e))?;
    servers
        .verify_server_cert(&chain[0], &chain[1..], &name, &[], now)
        .map_err(|e| {
            bad(
                dir,
                CERT_FILE,
                format!("not valid as a server named {PEER_NAME} ({e}): {what_to_do}"),
            )
        })?;
    let versions = &[&rustls::version::TLS13];
    let server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| bad(dir, CERT_FILE, e))?
        .with_client_cert_verifier(clients)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| bad(dir, KEY_FILE, format!("does not match {CERT_FILE} ({e})")))?;
    let client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .map_err(|e| bad(dir, CERT_FILE, e))?
        .with_webpki_verifier(servers)
        .with_client_auth_cert(chain, key)
        .map_err(|e| bad(dir, KEY_FILE, format!("does not match {CERT_FILE} ({e})")))?;
    Ok(Loaded {
        stamp,
        server: Arc::new(server),
        client: Arc::new(client),
    })
}

impl Tls {
    /// Loads the files in `dir` (see the module docs); an error names the file and what to do.
    pub fn open(dir: &Path) -> Result<Tls> {
        Ok(Tls {
            dir: dir.to_path_buf(),
            loaded: Mutex::new(load(dir)?),
        })
    }

    /// The configurations to use for a new connection: the files' newest version that loads.
    fn current(&self) -> (Arc<ServerConfig>, Arc<ClientConfig>) {
        let mut loaded = self.loaded.lock().unwrap_or_else(PoisonError::into_inner);
        let now = stamp(&self.dir);
        if now != loaded.stamp {
            match load(&self.dir) {
                Ok(l) => {
                    info!(dir = %self.dir.display(), "TLS certificates changed; new connections use them");
                    *loaded = l;
                }
                Err(e) => {
                    error!(error = %e, "TLS certificates changed but do not load; the previous ones stay in use");
                    // Not again for the same files.
                    loaded.stamp = now;
                }
            }
        }
        (loaded.server.clone(), loaded.client.clone())
    }

    /// The server side of a new link over `sock`, its handshake done.
    pub(crate) fn accept(&self, sock: TcpStream) -> io::Result<Link> {
        let conn = ServerConnection::new(self.current().0).map_err(io::Error::other)?;
        let mut s = StreamOwned::new(conn, sock);
        handshake(&mut s.conn, &mut s.sock)?;
        Ok(Link::Server(Box::new(s)))
    }

    /// The client side of a new link over `sock`, its handshake done.
    pub(crate) fn connect(&self, sock: TcpStream) -> io::Result<Link> {
        let name = ServerName::try_from(PEER_NAME).map_err(io::Error::other)?;
        let conn = ClientConnection::new(self.current().1, name).map_err(io::Error::other)?;
        let mut s = StreamOwned::new(conn, sock);
        handshake(&mut s.conn, &mut s.sock)?;
        Ok(Link::Client(Box::new(s)))
    }
}

/// Runs the handshake to its end, so that a refused certificate is an error here, named, and
/// not a broken read later.
fn handshake<D>(conn: &mut rustls::ConnectionCommon<D>, sock: &mut TcpStream) -> io::Result<()> {
    while conn.is_handshaking() {
        conn.complete_io(sock).map_err(|e| {
            let hint = "both sides need a certificate from the same cluster CA in their tls_dir";
            io::Error::new(e.kind(), format!("{e} ({hint})"))
        })?;
    }
    // The last flight (a client's Finished) is sent before the first message.
    while conn.wants_write() {
        conn.write_tls(sock)?;
    }
    Ok(())
}

/// A peer link: a TCP connection, encrypted or not.
pub(crate) enum Link {
    Plain(TcpStream),
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Link {
    /// The TCP connection under the link (for its timeouts).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Link::Plain(s) => s,
            Link::Server(s) => &s.sock,
            Link::Client(s) => &s.sock,
        }
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.read(buf),
            Link::Server(s) => s.read(buf),
            Link::Client(s) => s.read(buf),
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Plain(s) => s.write(buf),
            Link::Server(s) => s.write(buf),
            Link::Client(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Plain(s) => s.flush(),
            Link::Server(s) => s.flush(),
            Link::Client(s) => s.flush(),
        }
    }
}

impl RawSink for Link {
    fn raw_fd(&self) -> Option<RawFd> {
        match self {
            // Bytes written to the socket itself go out as they are: only on a plain link.
            Link::Plain(s) => Some(s.as_raw_fd()),
            Link::Server(_) | Link::Client(_) => None,
        }
    }
}

/// Makes a cluster's TLS files in `out`: a new CA (`ca.crt`, and `ca.key`: keep it off the
/// nodes) and, for each of `nodes`, a directory `out/<node>` to mount as that node's `tls_dir`
/// (`ca.crt`, `tls.crt`, `tls.key`), valid for `days`. A directory that holds a CA already is
/// refused: its nodes' certificates would no longer chain to the new one.
pub fn init(out: &Path, nodes: &[String], days: u32) -> Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let fail = |file: &str, e: rcgen::Error| bad(out, file, e);
    // Each node gets a directory named after it, checked before anything is written.
    for (i, node) in nodes.iter().enumerate() {
        crate::config::check_node_id(node)?;
        if nodes[..i].contains(node) {
            return Err(bad(out, node, format!("node {node:?} is named twice")));
        }
    }
    if days == 0 {
        return Err(bad(
            out,
            CA_FILE,
            "--days 0 would make certificates that expire at once",
        ));
    }
    let ca_key = out.join("ca.key");
    if ca_key.exists() {
        return Err(bad(
            out,
            "ca.key",
            "a CA is there already; give another directory (every node's certificate must \
             come from the same CA, so make them all in one run)",
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("create", out, e))?;
    let validity = |p: &mut CertificateParams| {
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::hours(1);
        p.not_after = now + time::Duration::days(i64::from(days));
    };
    let key = KeyPair::generate().map_err(|e| fail("ca.key", e))?;
    let mut p = CertificateParams::default();
    p.distinguished_name
        .push(DnType::CommonName, "hotstart cluster CA");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut p);
    let ca_pem = p.self_signed(&key).map_err(|e| fail(CA_FILE, e))?.pem();
    write_file(&ca_key, key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&out.join(CA_FILE), ca_pem.as_bytes(), 0o644)?;
    let issuer = Issuer::new(p, key);
    for node in nodes {
        let dir = out.join(node);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        let key = KeyPair::generate().map_err(|e| fail(KEY_FILE, e))?;
        let mut names = vec![PEER_NAME.to_string()];
        if node != PEER_NAME && ServerName::try_from(node.as_str()).is_ok() {
            names.push(node.clone());
        }
        let mut p = CertificateParams::new(names).map_err(|e| fail(CERT_FILE, e))?;
        p.distinguished_name.push(DnType::CommonName, node.as_str());
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut p);
        let cert = p.signed_by(&key, &issuer).map_err(|e| fail(CERT_FILE, e))?;
        write_file(&dir.join(CA_FILE), ca_pem.as_bytes(), 0o644)?;
        write_file(&dir.join(CERT_FILE), cert.pem().as_bytes(), 0o644)?;
        write_file(&dir.join(KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    }
    Ok(())
}

/// Writes `path` with permission bits `mode` (a private key: its owner only).
fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(|e| Error::io("create", path, e))?;
    f.write_all(bytes).map_err(|e| Error::io("write", path, e))
}
