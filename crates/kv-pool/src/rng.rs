//! The workspace's one seeded random generator.
//!
//! Every crate that needs reproducible randomness (the scheduler's `random` policy, generated
//! workloads, conformance inputs, benchmark keys, sampling seeds) uses this one, so the same
//! seed gives the same sequence in every crate, on every machine and every build. It lives in
//! kv-pool only because kv-pool is the crate every other crate already depends on; nothing in
//! the pool uses it.
//!
//! SplitMix64 (Steele, Lea & Flood 2014): a 64-bit state advanced by a Weyl increment and
//! finalised by two multiply-xorshift rounds ([`mix64`]). Fast and statistically good for test
//! data and workload synthesis; not for cryptography.

/// The Weyl increment (the golden ratio in 64 bits).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective 64-bit mixer. Used on its own to derive a value from a
/// key without keeping state (a fake model's next token, a per-request seed).
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seeded SplitMix64 generator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[0, 1)` with 24 random bits.
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `0..n` by the multiply-shift method (bias below 2⁻³² for any `n < 2³²`);
    /// `0` when `n == 0`.
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_values_and_determinism() {
        // First outputs of SplitMix64 seeded with 0 (the reference implementation's).
        let mut r = SplitMix64::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        let a: Vec<usize> = (0..5).map(|_| SplitMix64::new(7).below(10)).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn ranges_and_shuffle() {
        let mut r = SplitMix64::new(1);
        assert!((0..1000).all(|_| r.below(3) < 3));
        assert_eq!(r.below(0), 0);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&r.next_f64())));
        assert!((0..1000).all(|_| (0.0..1.0).contains(&r.next_f32())));
        let mut v: Vec<u32> = (0..100).collect();
        r.shuffle(&mut v);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
