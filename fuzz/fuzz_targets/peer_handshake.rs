//! The peer port before authentication, from both ends: a sidecar answering a caller
//! (`auth::server`) and one calling a peer (`auth::client`), the other end sending the fuzzer's
//! bytes. Without the cluster token, nothing authenticates.
#![no_main]

use hotstart_fuzz::{Replay, set_bound, split};
use hotstart_proto::wire::{Conn, Side};
use hotstart_sidecar::{ClusterKey, Identity, auth};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(1 << 20), |data: &[u8]| {
    let (side, data) = split(data);
    let mut conn = Conn::new(Replay(data), "fuzz", Side::Peer);
    let key = ClusterKey::new(b"the cluster token");
    let me = Identity {
        node: "node-a".into(),
        domain: "cluster.local".into(),
    };
    let got = if side & 1 == 0 {
        auth::server(&mut conn, &key, &me)
    } else {
        auth::client(&mut conn, &key, &me, None)
    };
    assert!(got.is_err(), "authenticated a peer that does not know the token: {got:?}");
});
