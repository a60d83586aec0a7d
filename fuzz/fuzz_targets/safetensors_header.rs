//! A checkpoint file's safetensors header, as a tier returns it: a header that parses
//! describes tensors that tile the file's data exactly.
#![no_main]

use hotstart_ckpt::format;
use hotstart_fuzz::{set_bound, split};
use libfuzzer_sys::fuzz_target;

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    // The file is longer than the bytes read by up to 255 (a header whose data follows).
    let (more, prefix) = split(data);
    let file_len = prefix.len() as u64 + u64::from(more);
    if let Ok(h) = format::parse_header(prefix, file_len, "fuzz") {
        let mut at = 0;
        for t in &h.tensors {
            assert_eq!(t.data_offsets[0], at);
            at = t.data_offsets[1];
        }
        assert_eq!(h.data_offset + at, file_len);
    }
});
