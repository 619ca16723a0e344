//! Helpers the scheduler's test files share: the deterministic fake model, prompts with shared
//! prefixes, and the fake model's output computed directly (no scheduling) to compare with.
// Each test file uses its own subset.
#![allow(dead_code)]

use scheduler::{FakeExecutor, FinishReason, SamplingLimits};

/// The fake model's vocabulary size.
pub const VOCAB: u32 = 1000;
/// The stop token the tests use.
pub const EOS: u32 = 7;

/// The fake model every test runs (vocabulary [`VOCAB`], seed 42).
pub fn exec() -> FakeExecutor {
    FakeExecutor {
        vocab: VOCAB,
        seed: 42,
    }
}

/// A prompt of `len` tokens; prompts of one `base` share their prefixes.
pub fn prompt(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 100 + base * 37 + i % 29).collect()
}

/// What the fake model generates for `prompt`, computed directly (no scheduling).
pub fn expected_output(prompt: &[u32], limits: &SamplingLimits) -> (Vec<u32>, FinishReason) {
    let e = exec();
    let mut tokens = prompt.to_vec();
    loop {
        let t = e.next_token(*tokens.last().unwrap(), tokens.len() as u32 - 1);
        tokens.push(t);
        let out = &tokens[prompt.len()..];
        if !limits.ignore_eos && limits.stop_token_ids.contains(&t) {
            return (out.to_vec(), FinishReason::Stop { token: t });
        }
        if out.len() >= limits.max_new_tokens {
            return (
                out.to_vec(),
                FinishReason::Length {
                    length: limits.max_new_tokens,
                },
            );
        }
    }
}
