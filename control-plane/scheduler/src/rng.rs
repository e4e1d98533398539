//! The engine's only source of randomness: a ChaCha8 stream derived from the caller's seed.
//! ChaCha8's output is fixed by its specification, so a seed replays identically on every
//! platform and every version of suanli.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// Deterministic random numbers for tie-breaking, shuffles and sampling.
#[derive(Clone, Debug)]
pub struct DetRng(ChaCha8Rng);

impl DetRng {
    /// A stream fully determined by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(ChaCha8Rng::seed_from_u64(seed))
    }

    /// A uniformly distributed `u64`.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// A uniform integer in `0..n` (Lemire's nearly-divisionless method, unbiased).
    /// Returns 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n <= 1 {
            return 0;
        }
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_below_is_in_range() {
        let (mut a, mut b) = (DetRng::new(7), DetRng::new(7));
        for n in 1..200u64 {
            let x = a.below(n);
            assert_eq!(x, b.below(n));
            assert!(x < n);
        }
        let mut v: Vec<u32> = (0..50).collect();
        DetRng::new(1).shuffle(&mut v);
        let mut w: Vec<u32> = (0..50).collect();
        DetRng::new(1).shuffle(&mut w);
        assert_eq!(v, w);
        v.sort_unstable();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
