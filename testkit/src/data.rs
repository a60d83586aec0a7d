//! Test data.

/// `len` deterministic, incompressible bytes from a xorshift64* generator; different seeds give
/// different bytes. Tests and benchmarks use it so that content comparisons mean something
/// (never zeros, which hide unwritten buffers).
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn pattern_is_deterministic_and_seeded() {
        assert_eq!(super::pattern(1000, 1), super::pattern(1000, 1));
        assert_ne!(super::pattern(1000, 1), super::pattern(1000, 2));
        assert_eq!(super::pattern(13, 5).len(), 13);
        assert!(super::pattern(4096, 0).iter().any(|b| *b != 0));
    }
}
