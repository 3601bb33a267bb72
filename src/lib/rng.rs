//! SplitMix64: the one small deterministic generator tandem uses where it needs reproducible
//! random numbers without a dependency (weight init, prompt sampling, synthetic data, test and
//! benchmark inputs). Same numbers on every machine.

/// FNV-1a of the name mixed with the seed: one stream id per tensor.
pub(crate) fn stream_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
    }
    let mut mix = SplitMix64(h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    mix.next_u64()
}

/// SplitMix64: a well-mixed 64-bit generator whose whole state is one u64.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64(pub u64);

impl SplitMix64 {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0), by rejection so that no value is favoured.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller, one of the pair).
    pub(crate) fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// SplitMix64's output function as a pure hash of one word (`mix(z)` is the first number of
/// `SplitMix64(z)`): a bijective mixer with full avalanche, the core of the counter-based
/// streams (`backend::ops::sample::uniform`, sample keys, shuffles).
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A key from several numbers (e.g. seed, step, epoch).
pub(crate) fn mix_key(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(mix(0x006b_6579_5f6d_6978), |h, &p| mix(h ^ p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_the_first_output_of_the_generator() {
        for z in [0u64, 1, 42, u64::MAX, 0x9E37_79B9_7F4A_7C15] {
            assert_eq!(mix(z), SplitMix64(z).next_u64());
        }
        // SplitMix64 from 0: the published first output.
        assert_eq!(mix(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn keys_depend_on_every_part_and_its_order() {
        let k = mix_key(&[1, 2, 3]);
        assert_eq!(k, mix_key(&[1, 2, 3]));
        assert_ne!(k, mix_key(&[1, 2, 4]));
        assert_ne!(k, mix_key(&[2, 1, 3]));
        assert_ne!(k, mix_key(&[1, 2]));
    }
}
