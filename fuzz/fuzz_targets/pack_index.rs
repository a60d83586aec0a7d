//! An environment pack's index, as a store returns it, for the pack a record names: frames
//! that tile the pack exactly, each a length a chunk can have.
#![no_main]

use hotstart_fuzz::set_bound;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    hotstart_env::pack::fuzz_index(data);
});
