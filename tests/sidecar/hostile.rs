//! Hostile and broken peers: a wrong or missing token, garbage, truncated and oversized frames,
//! a shard that does not match its checksums. Each costs only its own connection; the daemon
//! keeps serving, logs the refusal and counts it.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use hotstart_ckpt::format::{Layout, Manifest, Region};
use hotstart_ckpt::{Dtype, Tensor};
use hotstart_proto::wire::{self, Conn, Side};
use hotstart_sidecar::PeerMsg;
use hotstart_sidecar::{ClusterKey, Held, Identity, PeerClient, ShardInfo, auth};
use hotstart_testkit::pattern;

use crate::cluster::{Cluster, Node, PEER_PORT, TOKEN};

const TIMEOUT: Duration = Duration::from_secs(10);

fn tester() -> Identity {
    Identity {
        node: "tester".into(),
        domain: String::new(),
    }
}

/// Sends `bytes`, half-closes, and reads until the daemon closes the connection: it must do so
/// within the timeout, having sent back at most a refusal.
fn dropped_after(n: &Node, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(n.peer).expect("connect");
    s.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    s.write_all(bytes).expect("write");
    let _ = s.shutdown(Shutdown::Write);
    let mut back = Vec::new();
    match s.read_to_end(&mut back) {
        Ok(_) => {}
        // Closed with our bytes unread: a reset, which is a close too.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the daemon did not close the connection: {e}"),
    }
    back
}

fn header(kind: u8, len: u32) -> Vec<u8> {
    let mut h = wire::MAGIC.to_vec();
    h.extend_from_slice(&[wire::VERSION, kind, 0, 0]);
    h.extend_from_slice(&len.to_le_bytes());
    h
}

/// A shard of job `evil`: its file, and the manifest that describes it.
fn shard() -> (ShardInfo, String, Vec<u8>) {
    shard_of(1, 64 << 10)
}

/// Step `step` of job `evil`: one tensor of 300 KiB in chunks of `chunk` bytes.
fn shard_of(step: u64, chunk: usize) -> (ShardInfo, String, Vec<u8>) {
    let bytes = pattern(300 << 10, 9);
    let t = Tensor::new("w", Dtype::U8, vec![bytes.len() as u64], bytes.clone()).expect("tensor");
    let layout = Layout::new("evil", 1, 1, &[t]).expect("layout");
    let mut file = layout.header.clone();
    file.extend_from_slice(&bytes);
    let hashes: Vec<blake3::Hash> = file.chunks(chunk).map(blake3::hash).collect();
    let m = Manifest::new(
        "evil",
        step,
        0,
        1,
        &layout,
        chunk as u64,
        &hashes,
        &Default::default(),
    );
    let info = ShardInfo {
        job: "evil".into(),
        rank: 0,
        step,
        world_size: 1,
        len: file.len() as u64,
        origin: "tester".into(),
        held: Held::Memory,
    };
    (info, String::from_utf8(m.to_json()).expect("json"), file)
}

pub fn tokens_frames_and_checksums_are_enforced() {
    let cluster = Cluster::new(2);
    let nodes = cluster.start_all();
    let n = &nodes[0];
    let good = || {
        PeerClient::connect(
            n.peer,
            None,
            &ClusterKey::new(TOKEN.as_bytes()),
            &tester(),
            Some("node-0"),
            TIMEOUT,
        )
        .expect("a client with the token")
    };

    // 1. Another token: the client finds the daemon's proof wrong and hangs up; the daemon
    //    logs the refusal.
    let err = PeerClient::connect(
        n.peer,
        None,
        &ClusterKey::new(b"another"),
        &tester(),
        None,
        TIMEOUT,
    )
    .expect_err("another token")
    .to_string();
    assert!(err.contains("does not know the cluster token"), "{err}");
    n.wait_for_log("peer connection refused");
    // A client that answers the challenge with a made-up proof is told so.
    let mut c = Conn::new(
        TcpStream::connect(n.peer).expect("connect"),
        "raw",
        Side::Peer,
    );
    c.send(&PeerMsg::Hello {
        version: auth::PROTOCOL_VERSION,
        node: "intruder".into(),
        domain: String::new(),
        nonce: "11".repeat(32),
    })
    .expect("hello");
    assert!(matches!(
        c.recv::<PeerMsg>().expect("challenge"),
        PeerMsg::Challenge { .. }
    ));
    c.send(&PeerMsg::Proof {
        proof: "00".repeat(32),
    })
    .expect("proof");
    match c.recv::<PeerMsg>().expect("an answer") {
        PeerMsg::Refused { reason } => assert!(reason.contains("token"), "{reason}"),
        other => panic!("{other:?}"),
    }
    n.wait_for_log("\"intruder\" does not know the cluster token");
    // No token at all: a request without the handshake.
    let mut c = Conn::new(
        TcpStream::connect(n.peer).expect("connect"),
        "raw",
        Side::Peer,
    );
    c.send(&PeerMsg::Inventory { job: None }).expect("send");
    assert!(matches!(
        c.recv::<PeerMsg>().expect("answer"),
        PeerMsg::Refused { .. }
    ));
    assert!(c.recv::<PeerMsg>().is_err(), "closed after the refusal");
    assert!(n.metric("hotstart_failures_total{kind=\"auth\"}") >= 3.0);

    // 2. Garbage, a truncated frame, an oversized length prefix: dropped, nothing allocated.
    dropped_after(n, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let mut truncated = header(1, 100);
    truncated.extend_from_slice(b"{\"op\":\"hel");
    dropped_after(n, &truncated);
    dropped_after(n, &header(1, u32::MAX));
    dropped_after(n, &header(9, 4));
    // After authentication too: a message frame above the bound.
    let mut c = Conn::new(
        TcpStream::connect(n.peer).expect("connect"),
        n.peer.to_string(),
        Side::Peer,
    );
    auth::client(&mut c, &ClusterKey::new(TOKEN.as_bytes()), &tester(), None).expect("auth");
    let mut sock = c.get_ref().try_clone().expect("clone");
    sock.write_all(&header(1, (wire::MAX_MESSAGE + 1) as u32))
        .expect("write");
    let mut rest = Vec::new();
    sock.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    if let Err(e) = sock.read_to_end(&mut rest) {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "not closed: {e}"
        );
    }
    assert!(
        n.metric("hotstart_failures_total{kind=\"frame\"}") >= 4.0,
        "{}",
        n.log()
    );
    // The daemon still serves everyone else; a job name that walks out of the disk tier lists
    // nothing.
    assert!(good().inventory(None).expect("inventory").is_empty());
    assert!(
        good()
            .inventory(Some("../.."))
            .expect("inventory")
            .is_empty()
    );
    assert_eq!(
        hotstart_testkit::get(n.http, "/livez", TIMEOUT)
            .expect("livez")
            .status,
        200
    );

    // 3. A shard whose bytes do not match its checksums is rejected and never held.
    let (info, manifest, file) = shard();
    let mut corrupt = file.clone();
    corrupt[200_000] ^= 0x20;
    let err = good()
        .push(&info, &manifest, &corrupt)
        .expect_err("corrupt shard")
        .to_string();
    assert!(err.contains("chunk 3 does not match its checksum"), "{err}");
    assert_eq!(n.metric("hotstart_failures_total{kind=\"checksum\"}"), 1.0);
    assert!(
        good()
            .inventory(Some("evil"))
            .expect("inventory")
            .is_empty()
    );
    n.wait_for_log("replica rejected");
    // A manifest that does not describe the shard announced: a protocol violation.
    let mut lying = info.clone();
    lying.len += 1;
    assert!(good().push(&lying, &manifest, &file).is_err());
    assert!(
        good()
            .inventory(Some("evil"))
            .expect("inventory")
            .is_empty()
    );
    // The same shard intact is held, and fetched back whole.
    good().push(&info, &manifest, &file).expect("intact shard");
    let held = good().inventory(Some("evil")).expect("inventory");
    assert_eq!(held, vec![info.clone()]);
    let key = hotstart_sidecar::memory::ShardKey {
        job: "evil".into(),
        rank: 0,
        step: 1,
    };
    let whole = good()
        .fetch(&key, 2, None, |i, _, _| Ok(vec![0u8; i.len as usize]))
        .expect("fetch")
        .expect("held");
    assert!(whole.mem == file && whole.chunks.is_none());
    // A reader of a byte range gets the chunks that hold it and the header's, and no others.
    let m = &whole.manifest;
    let wanted = [Region {
        tensor: "w".into(),
        offset: 150_000,
        len: 1000,
    }];
    let part = good()
        .fetch(&key, 2, Some(&wanted), |i, _, _| {
            Ok(vec![0u8; i.len as usize])
        })
        .expect("fetch")
        .expect("held");
    assert_eq!(part.chunks, Some(vec![0, 2]));
    for i in 0..m.chunks.len() {
        let r = m.chunk_range(i);
        let (got, sent) = (
            &part.mem[r.start as usize..r.end as usize],
            &file[r.start as usize..r.end as usize],
        );
        assert!(
            if i == 0 || i == 2 {
                got == sent
            } else {
                got.iter().all(|b| *b == 0)
            },
            "chunk {i}"
        );
    }
    // A range the shard does not have: the whole shard, for the reader's own checks to name.
    let past = [Region {
        tensor: "w".into(),
        offset: 300 << 10,
        len: 1,
    }];
    let all = good()
        .fetch(&key, 2, Some(&past), |i, _, _| {
            Ok(vec![0u8; i.len as usize])
        })
        .expect("fetch")
        .expect("held");
    assert!(all.mem == file && all.chunks.is_none());
    // In chunks of four parts, only the parts that hold the range and the header come, each
    // checked against the chunk's id through the parts' values the peer sends first.
    let (info, manifest, file) = shard_of(2, 256 << 10);
    good()
        .push(&info, &manifest, &file)
        .expect("shard in parts");
    let key = hotstart_sidecar::memory::ShardKey { step: 2, ..key };
    let got = good()
        .fetch(&key, 2, Some(&wanted), |i, _, _| {
            Ok(vec![0u8; i.len as usize])
        })
        .expect("fetch")
        .expect("held");
    let m = &got.manifest;
    let start = (m.data_offset + 150_000) as usize;
    let sent = |p: usize| p == 0 || p == start >> 16;
    assert_eq!(got.chunks, Some(vec![0]));
    assert!(got.needs.as_ref().is_some_and(|n| n[0].parts.is_some()));
    for p in 0..file.len().div_ceil(64 << 10) {
        let r = p << 16..((p + 1) << 16).min(file.len());
        let bytes = &got.mem[r.clone()];
        if sent(p) {
            assert!(bytes == &file[r], "part {p}");
        } else {
            assert!(bytes.iter().all(|b| *b == 0), "part {p}");
        }
    }
    assert_eq!(
        cluster.ip(0).to_string() + ":" + &PEER_PORT.to_string(),
        n.peer.to_string()
    );
}

pub fn no_token_refuses_to_start() {
    let cluster = Cluster::new(1);
    let ip = cluster.ip(0);
    let sock = cluster.socket(0).display().to_string();
    let base = |listen: String| -> Vec<String> {
        [
            "serve",
            "--node-id",
            "solo",
            "--listen",
            &listen,
            "--http",
            &format!("{ip}:7071"),
            "--socket",
            &sock,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // No token, no --insecure.
    let mut n = cluster.spawn(0, &base(format!("{ip}:7070")), false, 0);
    assert!(!n.wait_exit().success());
    assert!(n.log().contains("HOTSTART_CLUSTER_TOKEN"), "{}", n.log());
    // --insecure, but listening on every interface.
    let mut args = base("0.0.0.0:7070".into());
    args.push("--insecure".into());
    let mut n = cluster.spawn(0, &args, false, 1);
    assert!(!n.wait_exit().success());
    assert!(n.log().contains("only allowed on loopback"), "{}", n.log());
    // --insecure on loopback: serves, and drains on SIGTERM.
    let mut args = base(format!("{ip}:7070"));
    args.push("--insecure".into());
    let mut n = cluster.spawn(0, &args, false, 2);
    n.wait_ready();
    let status = n.sigterm();
    assert!(status.success(), "{}", n.log());
}
