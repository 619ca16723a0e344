//! Sampling: penalties, greedy, temperature, top-k, top-p, min-p, a per-request seeded
//! generator, and stop conditions (token ids and strings).
//!
//! Order of operations (SGLang's): penalties on the raw logits (repetition over prompt and
//! output, HF-style: positive logits divided, negative multiplied; frequency and presence over
//! the output: `logit −= frequency · count + presence · [count > 0]`), then greedy if
//! `temperature == 0` or `top_k == 1`, else `softmax(logits / temperature)` in f64, top-k,
//! top-p (the smallest prefix, by descending probability, whose mass reaches `top_p`), min-p
//! (drop tokens below `min_p · max_prob`), renormalise and draw with the request's generator.
//! Ties order by token id, so the result is a pure function of the logits, the history and the
//! generator state.

use std::collections::HashMap;

use crate::error::{ModelError, Result};

/// The sampler's generator: the workspace's one seeded RNG (same seed, same tokens, on every
/// machine).
pub use kv_pool::rng::SplitMix64;

/// Per-request sampling parameters (SGLang's `SamplingParams`, the sampling part).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// `0` is greedy; otherwise logits are divided by it. Must be finite and `≥ 0`.
    pub temperature: f32,
    /// Keep the `k` most likely tokens (`None`: all). `Some(0)` is refused.
    pub top_k: Option<usize>,
    /// Nucleus mass in `(0, 1]` (`1`: off).
    pub top_p: f32,
    /// Minimum probability relative to the most likely token, in `[0, 1]` (`0`: off).
    pub min_p: f32,
    /// HF repetition penalty over prompt and output tokens, `> 0` (`1`: off).
    pub repetition_penalty: f32,
    /// Subtracted once per occurrence in the output, in `[-2, 2]` (`0`: off).
    pub frequency_penalty: f32,
    /// Subtracted once if present in the output, in `[-2, 2]` (`0`: off).
    pub presence_penalty: f32,
    /// Generator seed; `None` uses the seed the engine passes to [`Sampler::new`].
    pub seed: Option<u64>,
    /// Generation stops after any of these tokens (kept in the output, as SGLang).
    pub stop_token_ids: Vec<u32>,
    /// Generation stops when the output text contains any of these (cut before it).
    pub stop_strings: Vec<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: None,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), nothing else.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// Checks every parameter's range ([`ModelError::InvalidSampling`] names the first bad one).
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: String| Err(ModelError::InvalidSampling { field, reason });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(
                "temperature",
                format!("{} must be finite and ≥ 0", self.temperature),
            );
        }
        if self.top_k == Some(0) {
            return bad("top_k", "0 keeps no token; use None for all".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("{} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("{} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                format!("{} must be finite and > 0", self.repetition_penalty),
            );
        }
        for (field, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(field, format!("{v} must be in [-2, 2]"));
            }
        }
        if let Some(i) = self.stop_strings.iter().position(String::is_empty) {
            return bad("stop_strings", format!("entry {i} is empty"));
        }
        Ok(())
    }

    /// Whether sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }
}

/// The index of the largest value (the lowest index among equal maxima; NaN never wins).
/// Returns 0 for an empty slice. To sample, use [`greedy`], which refuses a row that is empty or
/// not finite rather than picking a token from it.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// Refuses a logits row that no token can be sampled from: an empty row
/// ([`ModelError::InvalidSampling`]), or one holding NaN or +∞, or only −∞
/// ([`ModelError::NonFiniteLogits`]; −∞ masks a token and is allowed beside finite values).
///
/// SGLang samples such a row anyway: greedy picks the NaN (torch's argmax), the multinomial
/// raises and the server stops, and `--enable-nan-detection` replaces NaN by −1e5. Here the
/// request fails with this error and the others go on.
pub fn check_logits(logits: &[f32]) -> Result<()> {
    if logits.is_empty() {
        return Err(ModelError::InvalidSampling {
            field: "logits",
            reason: "empty logits row".into(),
        });
    }
    // One pass on the way of every sampled token; the counts only for the error.
    let (mut any_finite, mut any_bad) = (false, false);
    for &v in logits {
        if v.is_finite() {
            any_finite = true;
        } else if v != f32::NEG_INFINITY {
            any_bad = true;
        }
    }
    if any_finite && !any_bad {
        return Ok(());
    }
    let count = |pred: fn(f32) -> bool| logits.iter().filter(|&&v| pred(v)).count();
    Err(ModelError::NonFiniteLogits {
        nan: count(f32::is_nan),
        pos_inf: count(|v| v == f32::INFINITY),
        neg_inf: count(|v| v == f32::NEG_INFINITY),
        len: logits.len(),
    })
}

/// The greedy token of a logits row ([`argmax`]), after [`check_logits`].
pub fn greedy(logits: &[f32]) -> Result<u32> {
    check_logits(logits)?;
    Ok(argmax(logits))
}

/// Applies the repetition, frequency and presence penalties of `params` to `logits` in place.
/// `prompt` and `output` are the request's token ids so far; ids outside the vocabulary are
/// ignored.
pub fn apply_penalties(
    params: &SamplingParams,
    logits: &mut [f32],
    prompt: &[u32],
    output: &[u32],
) {
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        let p = params.repetition_penalty;
        for (l, s) in logits.iter_mut().zip(seen) {
            // A finite logit stays finite (a penalty far from 1 must not make it ±∞); a
            // masked one (−∞) stays masked.
            if s && l.is_finite() {
                let penalised = if *l > 0.0 { *l / p } else { *l * p };
                *l = penalised.clamp(f32::MIN, f32::MAX);
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * c as f32 + params.presence_penalty;
            }
        }
    }
}

/// Samples the next token of one request with its own generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
}

impl Sampler {
    /// A sampler for `params` (validated); the generator is seeded with `params.seed`, or with
    /// `default_seed` when the request gives none.
    pub fn new(params: SamplingParams, default_seed: u64) -> Result<Self> {
        params.validate()?;
        let rng = SplitMix64::new(params.seed.unwrap_or(default_seed));
        Ok(Sampler { params, rng })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (one row, the vocabulary) given the request's
    /// `prompt` and `output` so far. A row [`check_logits`] refuses is an error, and the
    /// generator does not advance.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Result<u32> {
        check_logits(logits)?;
        let mut l = logits.to_vec();
        apply_penalties(&self.params, &mut l, prompt, output);
        if self.params.is_greedy() {
            return Ok(argmax(&l));
        }
        let probs = self.probabilities(&l);
        let u = self.rng.next_f64();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut acc = 0.0;
        for &(t, p) in &probs {
            acc += p / total;
            if u < acc {
                return Ok(t);
            }
        }
        Ok(probs.last().map(|p| p.0).unwrap_or_else(|| argmax(&l)))
    }

    /// The filtered distribution after temperature, top-k, top-p and min-p: `(token, weight)`
    /// by descending weight (ties by token id), weights not yet renormalised.
    pub fn probabilities(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let t = self.params.temperature.max(f32::MIN_POSITIVE) as f64;
        let max = logits
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, ((v as f64 - max) / t).exp()))
            .filter(|p| p.1 > 0.0)
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.params.top_k {
            probs.truncate(k.max(1));
        }
        let sum: f64 = probs.iter().map(|p| p.1).sum();
        if self.params.top_p < 1.0 {
            let target = self.params.top_p as f64 * sum;
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, p) in probs.iter().enumerate() {
                acc += p.1;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
        }
        if self.params.min_p > 0.0 {
            if let Some(&(_, top)) = probs.first() {
                let floor = self.params.min_p as f64 * top;
                probs.retain(|p| p.1 >= floor);
            }
        }
        probs
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token id (or EOS) was generated.
    Token(u32),
    /// The output text contains this stop string; the text is cut at `at` (bytes).
    String {
        /// The stop string.
        matched: String,
        /// Byte offset in the output text where the stop string begins.
        at: usize,
    },
}

/// Checks `token` against the stop ids (`params.stop_token_ids` plus `eos`), then the output
/// text so far against the stop strings (earliest match wins).
pub fn check_stop(
    params: &SamplingParams,
    eos: &[u32],
    token: u32,
    text: &str,
) -> Option<StopReason> {
    if params.stop_token_ids.contains(&token) || eos.contains(&token) {
        return Some(StopReason::Token(token));
    }
    params
        .stop_strings
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s)))
        .min_by_key(|(at, s)| (*at, s.len()))
        .map(|(at, s)| StopReason::String {
            matched: s.clone(),
            at,
        })
}

/// How many trailing bytes of `text` a streamer must hold back because they could be the
/// beginning of a stop string (the longest suffix of `text` that is a proper prefix of one).
pub fn stop_string_holdback(params: &SamplingParams, text: &str) -> usize {
    let mut hold = 0;
    for s in &params.stop_strings {
        for len in (1..s.len()).rev() {
            if len <= hold {
                break;
            }
            if s.is_char_boundary(len) && text.ends_with(&s[..len]) {
                hold = len;
                break;
            }
        }
    }
    hold
}
