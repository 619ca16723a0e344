//! Multi-turn chat: `sessions` conversations of `turns` turns each. Turn `t`'s prompt is the
//! whole history (every earlier turn's input and output) followed by a new input of `input_len`
//! tokens; the model's answer (`output_len` tokens, synthesized here) joins the history of the
//! next turn. So each prompt extends the previous turn's prompt by that turn's output and a new
//! input.
//!
//! Order: round by round (every session's turn 0, then every session's turn 1, …), the sessions
//! shuffled with the seed within each round, as when many clients chat at once. Arrival times
//! are 0 (a closed loop: a turn is sent when the previous answer is back).
//!
//! Each session starts with a distinct token while the vocabulary allows, so sessions share
//! nothing and turns of one session share exactly their history.

use crate::error::{EngineError, Result};
use crate::workload::{Request, TokenSource, Workload};

/// Parameters of the multi-turn chat workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultiTurnConfig {
    /// Concurrent conversations (`--mt-sessions`, default 64).
    pub sessions: usize,
    /// Turns per conversation (`--mt-turns`, default 8).
    pub turns: usize,
    /// New input tokens per turn (`--mt-input-len`, default 256).
    pub input_len: usize,
    /// Output tokens per turn (`--mt-output-len`, default 128).
    pub output_len: usize,
    /// Seed of the token ids and the order (`--seed`, default 1).
    pub seed: u64,
    /// Token ids are drawn from `0..vocab_size` (`--vocab-size`, default 32,000).
    pub vocab_size: u32,
}

impl Default for MultiTurnConfig {
    fn default() -> Self {
        MultiTurnConfig {
            sessions: 64,
            turns: 8,
            input_len: 256,
            output_len: 128,
            seed: 1,
            vocab_size: 32_000,
        }
    }
}

impl MultiTurnConfig {
    pub fn generate(&self) -> Result<Workload> {
        if self.vocab_size == 0 {
            return Err(EngineError::arg("--vocab-size", "must be at least 1"));
        }
        if self.sessions == 0 || self.turns == 0 {
            return Err(EngineError::EmptyWorkload {
                what: format!(
                    "--mt-sessions {} × --mt-turns {}",
                    self.sessions, self.turns
                ),
            });
        }
        let mut src = TokenSource::new(self.seed, self.vocab_size, self.sessions);
        let mut history: Vec<Vec<u32>> = vec![Vec::new(); self.sessions];
        let mut order: Vec<usize> = (0..self.sessions).collect();
        let mut requests = Vec::with_capacity(self.sessions * self.turns);
        for _ in 0..self.turns {
            src.rng().shuffle(&mut order);
            for &s in &order {
                let h = &mut history[s];
                src.sequence(self.input_len, h);
                requests.push(Request {
                    tokens: h.clone(),
                    output_len: self.output_len,
                    arrival_s: 0.0,
                });
                src.sequence(self.output_len, h);
            }
        }
        Ok(Workload {
            name: format!(
                "multiturn sessions={} turns={} input={} output={} seed={}",
                self.sessions, self.turns, self.input_len, self.output_len, self.seed
            ),
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_extend_the_history() {
        let cfg = MultiTurnConfig {
            sessions: 3,
            turns: 4,
            input_len: 5,
            output_len: 2,
            ..MultiTurnConfig::default()
        };
        let w = cfg.generate().unwrap();
        assert_eq!(w.requests.len(), 12);
        for round in 0..4 {
            for r in &w.requests[round * 3..round * 3 + 3] {
                assert_eq!(r.tokens.len(), round * 7 + 5);
            }
        }
        // Each round-1 prompt extends exactly one round-0 prompt (its session's).
        for r in &w.requests[3..6] {
            let parents = w.requests[..3]
                .iter()
                .filter(|p| r.tokens.starts_with(&p.tokens))
                .count();
            assert_eq!(parents, 1);
        }
        assert_eq!(w, cfg.generate().unwrap());
        assert!(MultiTurnConfig { turns: 0, ..cfg }.generate().is_err());
    }
}
