//! Copies into memory the CPU will not read again soon: restored tensors.
//!
//! A plain `memcpy` of a large piece first reads every destination cache line it writes (to own
//! it) and then leaves the piece in the cache, evicting what was there; a restore of gigabytes
//! gains nothing from either. Non-temporal (streaming) stores write whole lines straight to
//! memory, so a copy moves each byte across the memory bus twice instead of three times. glibc
//! switches to them by itself only for single copies larger than a threshold it derives from
//! the cache size (often hundreds of MiB), which the pieces of a parallel restore never are.

/// Pieces smaller than this are copied with `copy_from_slice`: their lines may well be read
/// soon, and the fence would cost more than it saves.
const STREAM_MIN: usize = 64 << 10;

/// Copies `src` into `dst` (same length), with streaming stores when the piece is large and
/// the CPU has them. The bytes are visible to other threads once this returns, like any store
/// followed by the usual synchronisation (the stores are fenced).
pub fn copy_cold(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_cold of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_MIN {
        // Whole 64-byte lines from the first aligned one; the ragged ends as usual.
        let head = dst.as_ptr().align_offset(64).min(dst.len());
        let body = (dst.len() - head) / 64 * 64;
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = rest.split_at_mut(body);
        let (s_head, rest) = src.split_at(head);
        let (s_body, s_tail) = rest.split_at(body);
        d_head.copy_from_slice(s_head);
        // SAFETY: `d_body` is 64-byte aligned and a multiple of 64 bytes long, `s_body` is as
        // long, and the two borrows cannot overlap.
        unsafe { stream_lines(d_body, s_body) };
        d_tail.copy_from_slice(s_tail);
        return;
    }
    dst.copy_from_slice(src);
}

/// Streams `src` into `dst` a cache line at a time (SSE2, which every x86-64 CPU has), then
/// fences the stores.
///
/// # Safety
/// `dst` must be 64-byte aligned, both slices as long, and that length a multiple of 64.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_lines(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    debug_assert!(dst.len() == src.len() && dst.len().is_multiple_of(64));
    debug_assert!(dst.as_ptr().align_offset(64) == 0);
    let (d, s) = (
        dst.as_mut_ptr().cast::<__m128i>(),
        src.as_ptr().cast::<__m128i>(),
    );
    for i in (0..dst.len() / 16).step_by(4) {
        // SAFETY: `i + 3 < len / 16`, so every access is inside the slices; loads are
        // unaligned, stores 16-byte aligned (the caller's promise).
        unsafe {
            let a = _mm_loadu_si128(s.add(i));
            let b = _mm_loadu_si128(s.add(i + 1));
            let c = _mm_loadu_si128(s.add(i + 2));
            let e = _mm_loadu_si128(s.add(i + 3));
            _mm_stream_si128(d.add(i), a);
            _mm_stream_si128(d.add(i + 1), b);
            _mm_stream_si128(d.add(i + 2), c);
            _mm_stream_si128(d.add(i + 3), e);
        }
    }
    // SAFETY: a store fence has no preconditions; it orders the streaming stores above before
    // any later store, as other threads expect of memory handed to them.
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_alignment_and_length_copies_exactly() {
        let src: Vec<u8> = (0..(STREAM_MIN * 3))
            .map(|i| (i * 7 + i / 251) as u8)
            .collect();
        let mut dst = vec![0u8; src.len() + 128];
        for (off, len) in [
            (0, 0),
            (3, 100),
            (0, STREAM_MIN),
            (1, STREAM_MIN + 1),
            (17, STREAM_MIN * 2 + 63),
            (64, STREAM_MIN * 3 - 64),
            (5, STREAM_MIN * 3),
        ] {
            dst.fill(0xAA);
            copy_cold(&mut dst[off..off + len], &src[src.len() - len..]);
            assert!(dst[off..off + len] == src[src.len() - len..], "{off}+{len}");
            assert!(dst[..off].iter().all(|&b| b == 0xAA), "{off}+{len}: before");
            assert!(
                dst[off + len..].iter().all(|&b| b == 0xAA),
                "{off}+{len}: after"
            );
        }
    }
}
