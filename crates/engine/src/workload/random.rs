//! SGLang bench_serving's random workload (`--dataset-name random`): `num_prompts` independent
//! prompts whose input and output lengths are drawn uniformly from
//! `[max(⌊len × range_ratio⌋, 1), len]`, as `np.random.randint` does there. Prompts share no
//! prefix (each starts with its own token while the vocabulary allows), so the ideal hit rate is
//! zero: the workload measures raw prefill and decode, not the cache.

use crate::error::{EngineError, Result};
use crate::workload::{Request, TokenSource, Workload};

/// Parameters of the random workload (SGLang's names).
#[derive(Debug, Clone, PartialEq)]
pub struct RandomConfig {
    /// Requests (`--num-prompts`, SGLang's default 1000).
    pub num_prompts: usize,
    /// The longest prompt in tokens (`--random-input-len`, default 1024).
    pub input_len: usize,
    /// The longest output in tokens (`--random-output-len`, default 1024).
    pub output_len: usize,
    /// The shortest length as a fraction of the longest (`--random-range-ratio`, default 0:
    /// lengths from 1 up; 1: every request exactly `input_len` / `output_len`).
    pub range_ratio: f64,
    /// Seed of the lengths and token ids (`--seed`).
    pub seed: u64,
    /// Token ids are drawn from `0..vocab_size`.
    pub vocab_size: u32,
}

impl RandomConfig {
    pub fn generate(&self) -> Result<Workload> {
        if self.vocab_size == 0 {
            return Err(EngineError::arg("--vocab-size", "must be at least 1"));
        }
        if !(self.range_ratio.is_finite() && (0.0..=1.0).contains(&self.range_ratio)) {
            return Err(EngineError::arg(
                "--random-range-ratio",
                format!("{} must be in [0, 1]", self.range_ratio),
            ));
        }
        for (flag, len) in [
            ("--random-input-len", self.input_len),
            ("--random-output-len", self.output_len),
        ] {
            if len == 0 {
                return Err(EngineError::arg(flag, "must be at least 1"));
            }
        }
        if self.num_prompts == 0 {
            return Err(EngineError::EmptyWorkload {
                what: "--num-prompts 0".into(),
            });
        }
        let mut src = TokenSource::new(self.seed, self.vocab_size, self.num_prompts);
        let draw = |src: &mut TokenSource, max: usize| {
            let min = ((max as f64 * self.range_ratio) as usize).clamp(1, max);
            min + src.rng().below(max - min + 1)
        };
        let mut requests = Vec::with_capacity(self.num_prompts);
        for _ in 0..self.num_prompts {
            let input = draw(&mut src, self.input_len);
            let output = draw(&mut src, self.output_len);
            let mut tokens = Vec::with_capacity(input);
            src.sequence(input, &mut tokens);
            requests.push(Request {
                tokens,
                output_len: output,
                arrival_s: 0.0,
            });
        }
        Ok(Workload {
            name: format!(
                "random prompts={} input<={} output<={} range-ratio={} seed={}",
                self.num_prompts, self.input_len, self.output_len, self.range_ratio, self.seed
            ),
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(range_ratio: f64) -> RandomConfig {
        RandomConfig {
            num_prompts: 200,
            input_len: 64,
            output_len: 16,
            range_ratio,
            seed: 3,
            vocab_size: 32_000,
        }
    }

    #[test]
    fn lengths_stay_in_range_and_prompts_share_nothing() {
        let w = cfg(0.5).generate().unwrap();
        assert_eq!(w.requests.len(), 200);
        for r in &w.requests {
            assert!((32..=64).contains(&r.tokens.len()), "{}", r.tokens.len());
            assert!((8..=16).contains(&r.output_len), "{}", r.output_len);
        }
        let lens: std::collections::HashSet<usize> =
            w.requests.iter().map(|r| r.tokens.len()).collect();
        assert!(lens.len() > 10, "lengths vary: {lens:?}");
        assert_eq!(w.stats(1).ideal_cached_tokens, 0);
        assert_eq!(w, cfg(0.5).generate().unwrap(), "deterministic");
    }

    #[test]
    fn ratio_one_is_fixed_and_zero_reaches_one() {
        let w = cfg(1.0).generate().unwrap();
        assert!(w
            .requests
            .iter()
            .all(|r| r.tokens.len() == 64 && r.output_len == 16));
        let w = cfg(0.0).generate().unwrap();
        assert!(w.requests.iter().any(|r| r.tokens.len() < 8));
    }

    #[test]
    fn bad_parameters_name_their_flag() {
        let mut c = cfg(1.5);
        assert!(c
            .generate()
            .unwrap_err()
            .to_string()
            .contains("--random-range-ratio"));
        c.range_ratio = 0.0;
        c.input_len = 0;
        assert!(c
            .generate()
            .unwrap_err()
            .to_string()
            .contains("--random-input-len"));
        c.input_len = 4;
        c.num_prompts = 0;
        assert!(c.generate().is_err());
    }
}
