//! A step's manifest, as a tier or a peer returns it: one that parses and validates writes
//! back to JSON that parses to the same manifest, and its extras decode or are refused.
#![no_main]

use hotstart_ckpt::format::Manifest;
use hotstart_fuzz::set_bound;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    if let Ok(m) = Manifest::parse(data, "fuzz") {
        let again = Manifest::parse(&m.to_json(), "fuzz").expect("its own JSON parses");
        assert_eq!(again, m);
        let _ = m.decode_extras();
    }
});
