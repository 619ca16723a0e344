//! SGLang bench_serving's generated-shared-prefix workload (`--dataset-name
//! generated-shared-prefix`): `num_groups` random system prompts, each shared by
//! `prompts_per_group` requests that append their own random question; the requests are
//! shuffled with the seed.
//!
//! As in SGLang, all system prompts are generated first, then all questions, then the requests
//! are assembled group by group and shuffled. SGLang draws random text and re-tokenizes it; here
//! the prompt is the token ids themselves (system prompt followed by question), so prompt
//! lengths are exact. Every system prompt and question starts with a distinct token while the
//! vocabulary allows (see the `TokenSource` notes in [`crate::workload`]), so requests of one
//! group share exactly their system prompt and requests of different groups share nothing.

use crate::error::{EngineError, Result};
use crate::workload::{Request, TokenSource, Workload};

/// Parameters of the generated-shared-prefix workload (SGLang's names and defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GspConfig {
    /// Number of system prompts (`--gsp-num-groups`, default 64).
    pub num_groups: usize,
    /// Requests per system prompt (`--gsp-prompts-per-group`, default 16).
    pub prompts_per_group: usize,
    /// System prompt tokens (`--gsp-system-prompt-len`, default 2048).
    pub system_prompt_len: usize,
    /// Question tokens (`--gsp-question-len`, default 128).
    pub question_len: usize,
    /// Output tokens per request (`--gsp-output-len`, default 256).
    pub output_len: usize,
    /// Seed of the token ids and the shuffle (`--seed`, default 1 as bench_serving).
    pub seed: u64,
    /// Token ids are drawn from `0..vocab_size` (`--vocab-size`, default 32,000).
    pub vocab_size: u32,
}

impl Default for GspConfig {
    fn default() -> Self {
        GspConfig {
            num_groups: 64,
            prompts_per_group: 16,
            system_prompt_len: 2048,
            question_len: 128,
            output_len: 256,
            seed: 1,
            vocab_size: 32_000,
        }
    }
}

impl GspConfig {
    pub fn generate(&self) -> Result<Workload> {
        if self.vocab_size == 0 {
            return Err(EngineError::arg("--vocab-size", "must be at least 1"));
        }
        let n = self.num_groups.checked_mul(self.prompts_per_group);
        let Some(n) = n.filter(|&n| n > 0) else {
            return Err(EngineError::EmptyWorkload {
                what: format!(
                    "--gsp-num-groups {} × --gsp-prompts-per-group {}",
                    self.num_groups, self.prompts_per_group
                ),
            });
        };
        let mut src = TokenSource::new(self.seed, self.vocab_size, self.num_groups + n);
        let mut systems = Vec::with_capacity(self.num_groups);
        for _ in 0..self.num_groups {
            let mut s = Vec::with_capacity(self.system_prompt_len);
            src.sequence(self.system_prompt_len, &mut s);
            systems.push(s);
        }
        let mut questions = Vec::with_capacity(n);
        for _ in 0..n {
            let mut q = Vec::with_capacity(self.question_len);
            src.sequence(self.question_len, &mut q);
            questions.push(q);
        }
        let mut requests = Vec::with_capacity(n);
        for (g, system) in systems.iter().enumerate() {
            for q in &questions[g * self.prompts_per_group..(g + 1) * self.prompts_per_group] {
                let mut tokens = Vec::with_capacity(system.len() + q.len());
                tokens.extend_from_slice(system);
                tokens.extend_from_slice(q);
                requests.push(Request {
                    tokens,
                    output_len: self.output_len,
                    arrival_s: 0.0,
                });
            }
        }
        src.rng().shuffle(&mut requests);
        Ok(Workload {
            name: format!(
                "gsp groups={} prompts/group={} system={} question={} output={} seed={}",
                self.num_groups,
                self.prompts_per_group,
                self.system_prompt_len,
                self.question_len,
                self.output_len,
                self.seed
            ),
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_and_determinism() {
        let cfg = GspConfig {
            num_groups: 3,
            prompts_per_group: 4,
            system_prompt_len: 10,
            question_len: 5,
            output_len: 7,
            ..GspConfig::default()
        };
        let w = cfg.generate().unwrap();
        assert_eq!(w.requests.len(), 12);
        assert!(w
            .requests
            .iter()
            .all(|r| r.tokens.len() == 15 && r.output_len == 7));
        // Exactly three distinct system prompts, four requests each.
        let mut systems: Vec<&[u32]> = w.requests.iter().map(|r| &r.tokens[..10]).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3);
        assert_eq!(w, cfg.generate().unwrap());
        assert_ne!(
            w,
            GspConfig {
                seed: 2,
                ..cfg.clone()
            }
            .generate()
            .unwrap()
        );
        // Shuffled: not group by group.
        let groups: Vec<usize> = w
            .requests
            .iter()
            .map(|r| systems.iter().position(|s| *s == &r.tokens[..10]).unwrap())
            .collect();
        assert!(groups.windows(2).any(|g| g[0] != g[1]) && !groups.is_sorted());
    }

    #[test]
    fn bad_parameters_are_errors() {
        let empty = GspConfig {
            num_groups: 0,
            ..GspConfig::default()
        };
        assert!(empty
            .generate()
            .unwrap_err()
            .to_string()
            .contains("--gsp-num-groups"));
        let vocab = GspConfig {
            vocab_size: 0,
            ..GspConfig::default()
        };
        assert!(vocab
            .generate()
            .unwrap_err()
            .to_string()
            .contains("--vocab-size"));
    }
}
