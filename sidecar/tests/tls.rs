//! Encrypted peer links between sidecars run in this process: peers with certificates from the
//! cluster's CA replicate and serve each other, a certificate from another CA (or none) is
//! refused, files that are not usable are refused at start with the file named, and rotated
//! certificates are taken for new links while a link that is open goes on.

#[path = "../../ckpt/tests/common/mod.rs"]
mod common;
mod support;

use std::path::Path;
use std::time::Duration;

use common::*;
use hotstart_ckpt::format::Manifest;
use hotstart_ckpt::{Destination, Engine, EngineConfig, StepSel, TierKind};
use hotstart_sidecar::memory::ShardKey;
use hotstart_sidecar::tls::{self, Tls};
use hotstart_sidecar::{ClusterKey, Held, Identity, PeerClient, Settings, ShardInfo, Token};
use support::Running;

const TOKEN: &str = "t0ken";

fn settings(node: &str, dir: &Path, tls_dir: Option<&Path>) -> Settings {
    Settings {
        node_id: Some(node.into()),
        listen: Some("127.0.0.1:0".into()),
        http: Some("127.0.0.1:0".into()),
        socket: Some(dir.join(format!("{node}.sock"))),
        memory_budget: Some("256MiB".parse().unwrap()),
        token: Some(Token::new(TOKEN).unwrap()),
        probe_interval: Some("200ms".parse().unwrap()),
        recovery_timeout: Some("2s".parse().unwrap()),
        tls_dir: tls_dir.map(Path::to_path_buf),
        ..Settings::default()
    }
}

fn tester() -> Identity {
    Identity {
        node: "tester".into(),
        domain: String::new(),
    }
}

/// Connects to `peer` as the tester, over TLS with `tls` when given.
fn connect(peer: std::net::SocketAddr, tls: Option<&Tls>) -> hotstart_sidecar::Result<PeerClient> {
    let key = ClusterKey::new(TOKEN.as_bytes());
    PeerClient::connect(peer, tls, &key, &tester(), None, Duration::from_secs(5))
}

#[test]
fn peers_with_the_cluster_ca_replicate_over_tls_and_others_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("tls");
    let names = ["node-a", "node-b", "tester"].map(String::from);
    tls::init(&certs, &names, 1).unwrap();
    let other = dir.path().join("other");
    tls::init(&other, &["intruder".to_string()], 1).unwrap();

    let b = Running::start(
        settings("node-b", dir.path(), Some(&certs.join("node-b")))
            .resolve()
            .unwrap(),
    );
    let mut a = settings("node-a", dir.path(), Some(&certs.join("node-a")));
    a.peers = Some(vec![format!("node-b={}", b.peer)]);
    let a = Running::start(a.resolve().unwrap());

    // A save on node-a is replicated to node-b over TLS, bit for bit.
    let mut cfg = EngineConfig::new("tls", 0, 1).sidecar(dir.path().join("node-a.sock"));
    cfg.chunk_size = 256 << 10;
    let engine = Engine::new(cfg).unwrap();
    let set = sample_tensors(1, 3 << 20);
    let h = engine.save(1, to_tensors(&set), extras(1)).unwrap();
    h.wait_persisted(TierKind::Peer).unwrap();
    let ours = Tls::open(&certs.join("tester")).unwrap();
    let mut client = connect(b.peer, Some(&ours)).unwrap();
    let held = client.inventory(Some("tls")).unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        (held[0].origin.as_str(), held[0].held),
        ("node-a", Held::Memory)
    );
    let (_, manifest, bytes) = fetch_step_1(&mut client, "tls");
    let l = engine.load(StepSel::Step(1), Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(1));
    assert_eq!(
        bytes_hashes(&bytes, &manifest),
        manifest.chunk_hashes(),
        "the replica's bytes"
    );

    // A certificate from another CA, and no TLS at all, are refused before anything is read.
    let intruder = Tls::open(&other.join("intruder")).unwrap();
    let refused = connect(b.peer, Some(&intruder)).unwrap_err().to_string();
    assert!(
        refused.contains("TLS") && refused.contains("invalid peer certificate"),
        "{refused}"
    );
    let plain = connect(b.peer, None).unwrap_err().to_string();
    assert!(plain.contains("peer"), "{plain}");
    // And a sidecar of another CA finds node-b unreachable, never a member.
    let err = connect(a.peer, Some(&intruder)).unwrap_err().to_string();
    assert!(err.contains("TLS"), "{err}");
    drop(engine);
}

#[test]
fn rotated_certificates_serve_new_links_while_an_open_link_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("old"), dir.path().join("new"));
    let names = ["node-a", "tester"].map(String::from);
    tls::init(&old, &names, 1).unwrap();
    tls::init(&new, &names, 1).unwrap();
    // node-a's files live in a directory of their own, rewritten in place on rotation.
    let live = dir.path().join("live");
    copy_dir(&old.join("node-a"), &live);
    let a = Running::start(
        settings("node-a", dir.path(), Some(&live))
            .resolve()
            .unwrap(),
    );

    let mut cfg = EngineConfig::new("rot", 0, 1).sidecar(dir.path().join("node-a.sock"));
    cfg.chunk_size = 256 << 10;
    let engine = Engine::new(cfg).unwrap();
    let set = sample_tensors(2, 4 << 20);
    engine
        .save(1, to_tensors(&set), extras(1))
        .unwrap()
        .wait()
        .unwrap();

    let old_tester = Tls::open(&old.join("tester")).unwrap();
    let new_tester = Tls::open(&new.join("tester")).unwrap();
    let mut open = connect(a.peer, Some(&old_tester)).unwrap();
    // Rotation: node-a's files now come from the new CA.
    copy_dir(&new.join("node-a"), &live);
    // The link made before goes on, over its session.
    let (info, manifest, bytes) = fetch_step_1(&mut open, "rot");
    assert_eq!(bytes.len() as u64, info.len);
    assert_eq!(bytes_hashes(&bytes, &manifest), manifest.chunk_hashes());
    // New links use the new files: the old CA's client is refused, the new one's accepted.
    let refused = connect(a.peer, Some(&old_tester)).unwrap_err().to_string();
    assert!(refused.contains("TLS"), "{refused}");
    let held = connect(a.peer, Some(&new_tester))
        .unwrap()
        .inventory(Some("rot"))
        .unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    // Files that do not load (a key cut short) leave the last good ones in use.
    std::fs::write(live.join(tls::KEY_FILE), "-----BEGIN PRIVATE KEY-----\n").unwrap();
    assert_eq!(
        connect(a.peer, Some(&new_tester))
            .unwrap()
            .inventory(Some("rot"))
            .unwrap()
            .len(),
        1
    );
    drop(engine);
}

#[test]
fn files_that_cannot_serve_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    tls::init(&one, &["node-a".to_string()], 1).unwrap();
    tls::init(&two, &["node-a".to_string()], 1).unwrap();
    let mixed = dir.path().join("mixed");
    copy_dir(&one.join("node-a"), &mixed);
    // A certificate of another CA than the one beside it.
    std::fs::copy(two.join("node-a/tls.crt"), mixed.join("tls.crt")).unwrap();
    let err = Tls::open(&mixed).unwrap_err().to_string();
    assert!(
        err.contains("tls.crt") && err.contains("hotstart tls init"),
        "{err}"
    );
    // A key that is not the certificate's.
    copy_dir(&one.join("node-a"), &mixed);
    std::fs::copy(two.join("node-a/tls.key"), mixed.join("tls.key")).unwrap();
    let err = Tls::open(&mixed).unwrap_err().to_string();
    assert!(err.contains("tls.key"), "{err}");
    // A missing file.
    std::fs::remove_file(mixed.join("ca.crt")).unwrap();
    let err = Tls::open(&mixed).unwrap_err().to_string();
    assert!(err.contains("ca.crt"), "{err}");
    // `init` does not replace a CA whose nodes hold certificates.
    let again = tls::init(&one, &["node-b".to_string()], 1)
        .unwrap_err()
        .to_string();
    assert!(again.contains("ca.key"), "{again}");

    // Without TLS, only loopback peer addresses; the error says what to set.
    let mut s = settings("node-a", dir.path(), None);
    s.listen = Some("0.0.0.0:0".into());
    let err = s.clone().resolve().unwrap_err().to_string();
    assert!(
        err.contains("clear text") && err.contains("tls_dir") && err.contains("listen"),
        "{err}"
    );
    s.tls_dir = Some(one.join("node-a"));
    s.resolve().unwrap();
}

/// Step 1 of rank 0 of `job`, fetched whole from the peer: its info, manifest and bytes.
fn fetch_step_1(client: &mut PeerClient, job: &str) -> (ShardInfo, Manifest, Vec<u8>) {
    let key = ShardKey {
        job: job.into(),
        rank: 0,
        step: 1,
    };
    let got = client
        .fetch(&key, 2, None, |info, _, _| Ok(vec![0u8; info.len as usize]))
        .unwrap()
        .expect("the peer holds the step");
    (got.info, got.manifest, got.mem)
}

fn bytes_hashes(bytes: &[u8], m: &Manifest) -> Vec<blake3::Hash> {
    bytes
        .chunks(m.chunk_size as usize)
        .map(blake3::hash)
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in [tls::CA_FILE, tls::CERT_FILE, tls::KEY_FILE] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

/// `tls init` checks its input before it writes anything: every node name is a node id (no
/// path that would put files outside the output directory), none twice, and certificates
/// valid for at least a day.
#[test]
fn tls_init_refuses_bad_input_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tls");
    for (nodes, days, says) in [
        (vec![".."], 1, "node id \"..\""),
        (vec!["a/b"], 1, "node id \"a/b\""),
        (vec!["n1", "n1"], 1, "named twice"),
        (vec!["n1"], 0, "--days 0"),
    ] {
        let nodes: Vec<String> = nodes.into_iter().map(String::from).collect();
        let e = tls::init(&out, &nodes, days).unwrap_err().to_string();
        assert!(e.contains(says), "{nodes:?} {days}: {e}");
        assert!(!out.exists(), "{nodes:?}: nothing is written");
        assert!(!dir.path().join("tls.crt").exists());
    }
}
