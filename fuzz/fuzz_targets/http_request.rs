//! The sidecar's HTTP port (`/livez`, `/readyz`, `/metrics`): a request head as a client sends
//! it, answered 200, 400, 404 or 405.
#![no_main]

use hotstart_fuzz::set_bound;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(1 << 20), |data: &[u8]| {
    hotstart_sidecar::fuzzing::http_request(data);
});
