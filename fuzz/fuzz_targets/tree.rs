//! A tree (an image's or an environment's files), as a store returns it: zstd-compressed
//! JSON, decoded within its bound and validated; a tree that decodes encodes to one that
//! decodes the same.
#![no_main]

use hotstart_fuzz::set_bound;
use hotstart_store::Tree;
use libfuzzer_sys::fuzz_target;

// The decoded JSON may reach 512 MiB; reading it doubles its buffer once past that.
fuzz_target!(init: set_bound(1 << 30), |data: &[u8]| {
    if let Ok(t) = Tree::decode(data) {
        let again = Tree::decode(&t.encode().expect("a tree encodes")).expect("decodes");
        assert_eq!(again, t);
    }
});
