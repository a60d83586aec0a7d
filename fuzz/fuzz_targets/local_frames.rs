//! The local socket as the sidecar (or the library) reads it: frames of messages and data from
//! the other end, until the stream ends or breaks the protocol. A message that decodes encodes
//! back to JSON that decodes to the same message.
#![no_main]

use hotstart_fuzz::{Replay, set_bound, split};
use hotstart_proto::wire::{Conn, LocalMsg, MAX_MESSAGE, Side};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(2 * MAX_MESSAGE), |data: &[u8]| {
    let (pattern, data) = split(data);
    let mut conn = Conn::new(Replay(data), "fuzz", Side::Local);
    let mut buf = vec![0u8; 4096];
    // The selector's bits say, frame by frame, whether this end expects a message or data.
    for i in 0..64 {
        let ok = if pattern >> (i % 8) & 1 == 0 {
            conn.recv::<LocalMsg>().map(|m| stable(&m)).is_ok()
        } else {
            conn.recv_data(&mut buf).is_ok()
        };
        if !ok {
            break;
        }
    }
});

fn stable(m: &LocalMsg) {
    let json = serde_json::to_string(m).expect("a message serialises");
    let again: LocalMsg = serde_json::from_str(&json).expect("its own JSON decodes");
    assert_eq!(serde_json::to_string(&again).expect("serialises"), json);
}
