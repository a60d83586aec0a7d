//! An image's record (`image.json`) and a mount's run report, as a store returns them: a
//! record that parses writes back to one that parses the same.
#![no_main]

use hotstart_fuzz::set_bound;
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    hotstart_image::image::fuzz_record(data);
});
