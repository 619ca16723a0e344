//! Rotary position embedding: the pairing of rotated elements, the frequency scalings of HF
//! configs (linear, Llama 3, YaRN) and the inverse frequencies every backend derives its
//! tables from, so that all backends agree on the scaling rules.

use crate::error::{AttentionError, Result};

/// Rotary layout: which elements form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GPT-NeoX / Llama (HF `rotate_half`): element `i` pairs with `i + rotary_dim / 2`.
    Neox,
    /// GPT-J (interleaved): element `2i` pairs with `2i + 1`.
    GptJ,
}

/// Frequency scaling applied to the rotary inverse frequencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Linear position interpolation: every inverse frequency divided by `factor`.
    Linear {
        /// Divisor (`≥ 1` in practice; must be finite and `> 0`).
        factor: f64,
    },
    /// Llama 3 (`rope_type = "llama3"` in HF configs): long wavelengths are divided by `factor`,
    /// short ones kept, and the band in between interpolated smoothly.
    Llama3 {
        /// Scale for low frequencies (e.g. 8.0).
        factor: f64,
        /// e.g. 1.0.
        low_freq_factor: f64,
        /// e.g. 4.0.
        high_freq_factor: f64,
        /// The pre-training context (e.g. 8192).
        original_max_position_embeddings: f64,
    },
    /// YaRN (`rope_type` / `type = "yarn"`) inverse frequencies, as DeepSeek-V2 and HF
    /// compute them: with `d = rotary_dim`, the correction dims
    /// `c(r) = d · ln(original / (2π r)) / (2 ln θ)`, `low = max(⌊c(beta_fast)⌋, 0)` and
    /// `high = min(⌈c(beta_slow)⌉, d − 1)`, the ramp `γ_i = clamp((i − low) / (high − low), 0,
    /// 1)` (`high` nudged by 0.001 when equal to `low`), each frequency is
    /// `f_i / factor · γ_i + f_i · (1 − γ_i)`. Only the frequencies: YaRN's magnitude scale
    /// (`mscale` on cos/sin and on the softmax scale) is the model's to apply.
    Yarn {
        /// Context extension factor (e.g. 40).
        factor: f64,
        /// The pre-training context (e.g. 4096).
        original_max_position_embeddings: f64,
        /// Rotations above which dims are kept (extrapolated), e.g. 32.
        beta_fast: f64,
        /// Rotations below which dims are interpolated, e.g. 1.
        beta_slow: f64,
    },
}

/// Rotary position embedding of one tensor of heads.
#[doc(alias = "RotaryEmbedding")]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// Dimension of each head (the last dimension of the tensor).
    pub head_dim: usize,
    /// Leading dims of each head that are rotated (`≤ head_dim`, even); the rest pass through.
    pub rotary_dim: usize,
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// Pairing of rotated elements.
    pub style: RopeStyle,
    /// How the inverse frequencies are rescaled for a context longer than pre-training.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Full-head NeoX rotary with no scaling.
    pub fn neox(head_dim: usize, theta: f64) -> Self {
        RopeConfig {
            head_dim,
            rotary_dim: head_dim,
            theta,
            style: RopeStyle::Neox,
            scaling: RopeScaling::None,
        }
    }

    /// Validates the configuration and returns the `rotary_dim / 2` inverse frequencies, in f64
    /// (every backend derives its tables from these, so they agree on the scaling rules).
    pub fn inv_freqs(&self) -> Result<Vec<f64>> {
        let bad = |field, reason: String| Err(AttentionError::InvalidConfig { field, reason });
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return bad(
                "rotary_dim",
                format!(
                    "{} must be even, positive and at most head_dim {}",
                    self.rotary_dim, self.head_dim
                ),
            );
        }
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return bad("theta", format!("{} must be finite and > 1", self.theta));
        }
        let half = self.rotary_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| self.theta.powf(-(2.0 * i as f64) / self.rotary_dim as f64))
            .collect();
        match self.scaling {
            RopeScaling::None => Ok(base),
            RopeScaling::Linear { factor } => {
                if !(factor.is_finite() && factor > 0.0) {
                    return bad("factor", format!("{factor} must be finite and > 0"));
                }
                Ok(base.into_iter().map(|f| f / factor).collect())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let ok = |x: f64| x.is_finite() && x > 0.0;
                let valid = ok(factor)
                    && ok(low_freq_factor)
                    && ok(old)
                    && high_freq_factor.is_finite()
                    && high_freq_factor > low_freq_factor;
                if !valid {
                    return bad(
                        "llama3 rope scaling",
                        format!(
                            "factor {factor}, low_freq_factor {low_freq_factor}, \
                             high_freq_factor {high_freq_factor}, original {old}: all must be \
                             finite and > 0 with high > low"
                        ),
                    );
                }
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                Ok(base
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
            } => {
                let ok = |x: f64| x.is_finite() && x > 0.0;
                if !(ok(factor) && ok(old) && ok(beta_fast) && ok(beta_slow)) {
                    return bad(
                        "yarn rope scaling",
                        format!(
                            "factor {factor}, original {old}, beta_fast {beta_fast}, \
                             beta_slow {beta_slow}: all must be finite and > 0"
                        ),
                    );
                }
                let d = self.rotary_dim as f64;
                let corr = |rot: f64| {
                    d * (old / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * self.theta.ln())
                };
                let low = corr(beta_fast).floor().max(0.0);
                let mut high = corr(beta_slow).ceil().min(d - 1.0);
                if high == low {
                    high += 0.001;
                }
                Ok(base
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect())
            }
        }
    }
}
