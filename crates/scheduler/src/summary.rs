//! The figures every serving run reports, computed in one place: cache hit rate, request and
//! token rates, and latency percentiles (TTFT, inter-token latency). [`simulate`] and
//! [`replay`] report through it, and so can any other driver (an HTTP benchmark client, a
//! trace replay) from its own measurements.
//!
//! ```
//! use scheduler::summary::{RunSummary, RunTotals};
//! let totals = RunTotals {
//!     requests: 2,
//!     aborted: 0,
//!     prompt_tokens: 100,
//!     cached_tokens: 40,
//!     output_tokens: 6,
//!     duration_s: 2.0,
//! };
//! let s = RunSummary::new(totals, vec![0.3, 0.1], vec![0.02, 0.01, 0.03]);
//! assert_eq!(s.hit_rate, 0.4);
//! assert_eq!(s.output_tokens_per_s, 3.0);
//! assert_eq!((s.ttft_p50_s, s.ttft_p99_s), (0.1, 0.3));
//! assert_eq!(s.ttft_s, [0.1, 0.3]);
//! ```
//!
//! [`simulate`]: crate::simulate
//! [`replay`]: crate::replay

/// The `q`-quantile (0..=1) of `v` (sorted in place), by nearest rank: the smallest sample
/// with at least a fraction `q` of the samples at or below it. 0 if `v` is empty.
pub fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// `part / whole`, or 0 when `whole` is not positive (a hit rate with no prompt tokens).
pub fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        part / whole
    } else {
        0.0
    }
}

/// `count / duration_s`, or 0 for an empty run.
pub fn per_second(count: usize, duration_s: f64) -> f64 {
    if duration_s > 0.0 {
        count as f64 / duration_s
    } else {
        0.0
    }
}

/// A run's totals, as its driver counted them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RunTotals {
    /// Requests that finished normally.
    pub requests: usize,
    /// Requests aborted or failed.
    pub aborted: usize,
    /// Prompt tokens of the requests counted.
    pub prompt_tokens: usize,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Wall (or simulated) seconds from the first arrival to the last token.
    pub duration_s: f64,
}

/// A run's figures: its [`RunTotals`], the rates derived from them and the latency
/// percentiles (nearest rank, [`percentile`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunSummary {
    /// What the figures are computed from.
    pub totals: RunTotals,
    /// `cached_tokens / prompt_tokens` (0 without prompt tokens).
    pub hit_rate: f64,
    /// Finished requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens per second.
    pub input_tokens_per_s: f64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, median, in seconds.
    pub ttft_p50_s: f64,
    /// Time to first token, 99th percentile, in seconds.
    pub ttft_p99_s: f64,
    /// Inter-token latency, median, in seconds.
    pub itl_p50_s: f64,
    /// Inter-token latency, 99th percentile, in seconds.
    pub itl_p99_s: f64,
    /// Every request's time to first token, sorted ascending (for distribution plots).
    pub ttft_s: Vec<f64>,
}

impl RunSummary {
    /// The figures of a run from its totals, one time to first token per request and every
    /// gap between consecutive tokens of a request (in any order).
    pub fn new(totals: RunTotals, mut ttft_s: Vec<f64>, mut itl_s: Vec<f64>) -> Self {
        let d = totals.duration_s;
        RunSummary {
            hit_rate: ratio(totals.cached_tokens as f64, totals.prompt_tokens as f64),
            requests_per_s: per_second(totals.requests, d),
            input_tokens_per_s: per_second(totals.prompt_tokens, d),
            output_tokens_per_s: per_second(totals.output_tokens, d),
            ttft_p50_s: percentile(&mut ttft_s, 0.5),
            ttft_p99_s: percentile(&mut ttft_s, 0.99),
            itl_p50_s: percentile(&mut itl_s, 0.5),
            itl_p99_s: percentile(&mut itl_s, 0.99),
            ttft_s,
            totals,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.5), 50.0);
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(percentile(&mut [], 0.5), 0.0);
    }

    #[test]
    fn empty_runs_report_zeros() {
        let s = RunSummary::new(RunTotals::default(), vec![], vec![]);
        assert_eq!(s, RunSummary::default());
        assert_eq!(ratio(3.0, 0.0), 0.0);
        assert_eq!(per_second(3, 0.0), 0.0);
    }
}
