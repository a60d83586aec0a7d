//! A stored chunk, as a store, a disk cache or a peer returns it: a zstd frame that must
//! declare its size within the bound and hash to its id.
#![no_main]

use hotstart_fuzz::set_bound;
use hotstart_store::ChunkId;
use hotstart_store::chunk::decode_frame;
use libfuzzer_sys::fuzz_target;

const MAX_CHUNK: usize = 4 << 20;

fuzz_target!(init: set_bound(2 * MAX_CHUNK), |data: &[u8]| {
    let id = ChunkId::of(b"a chunk");
    if let Ok(plain) = decode_frame(&id, data, MAX_CHUNK) {
        assert_eq!(ChunkId::of(&plain), id);
    }
});
