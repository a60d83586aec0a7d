//! An environment snapshot's record, as a store returns it: validated (format, key, where its
//! tree and packs are); a record that parses writes back to one that parses the same.
#![no_main]

use hotstart_fuzz::set_bound;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    hotstart_env::record::fuzz_record(data);
});
