//! A seeded splitmix64 generator for test and benchmark inputs (no `rand` dependency), so every
//! backend's conformance run sees the same values.

/// splitmix64.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n ≥ 1`; `0` for `n == 0`).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.next_u64() % n as u64) as usize
    }

    /// A value never zero: magnitude uniform in `[0.05, 1)`, random sign.
    pub fn nonzero(&mut self) -> f32 {
        let mag = 0.05 + 0.95 * self.unit();
        (if self.next_u64() & 1 == 0 { mag } else { -mag }) as f32
    }

    /// `n` values from [`nonzero`](Self::nonzero).
    pub fn nonzero_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.nonzero()).collect()
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}
