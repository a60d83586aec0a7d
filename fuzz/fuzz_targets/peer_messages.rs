//! What an authenticated peer sends: frames of peer messages (up to the largest message), each
//! decoded and, for a shard pushed or fetched, checked as the sidecar checks it before it
//! takes any byte of the shard.
#![no_main]

use hotstart_fuzz::{Replay, set_bound};
use hotstart_proto::wire::{Conn, MAX_MESSAGE, Side};
use hotstart_sidecar::PeerMsg;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(2 * MAX_MESSAGE), |data: &[u8]| {
    // A local connection's frames have the peer link's bounds after authentication, without
    // the tags a fuzzer cannot forge.
    let mut conn = Conn::new(Replay(data), "fuzz", Side::Local);
    while let Ok(msg) = conn.recv::<PeerMsg>() {
        hotstart_sidecar::fuzzing::peer_message(&msg);
    }
});
