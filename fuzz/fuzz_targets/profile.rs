//! A lazy image's access profile and a run's trace, as a store returns them: decoded within
//! their bound; what decodes encodes to what decodes the same.
#![no_main]

use hotstart_fuzz::{set_bound, split};
use hotstart_image::{Profile, Trace};
use libfuzzer_sys::fuzz_target;

// The decoded JSON may reach 256 MiB; reading it doubles its buffer once past that.
fuzz_target!(init: set_bound(512 << 20), |data: &[u8]| {
    let (which, data) = split(data);
    if which & 1 == 0 {
        if let Ok(p) = Profile::decode("fuzz", data) {
            let again = Profile::decode("fuzz", &p.encode().expect("encodes")).expect("decodes");
            assert_eq!(again.encode().ok(), p.encode().ok());
        }
    } else if let Ok(t) = Trace::decode("fuzz", data) {
        let again = Trace::decode("fuzz", &t.encode().expect("encodes")).expect("decodes");
        assert_eq!(again.encode().ok(), t.encode().ok());
    }
});
