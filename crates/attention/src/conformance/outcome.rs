//! What a conformance check reports: the error bound per store dtype, the relative error
//! measure, [`Outcome`] and the assertion tests end with.

use std::fmt;

use kv_pool::KvDtype;

/// The bound on `‖out − ref‖ / ‖ref‖` for attention over a store of `dtype`.
///
/// The reference uses the unquantized K/V, so the error is dominated by storage rounding: each
/// stored element is off by at most `u` relative (f16 `2⁻¹¹`, bf16 `2⁻⁸`, e4m3 `2⁻⁴`, e5m2
/// `2⁻³`, [`kv_pool::dtype::max_relative_error`]). The value error carries into the output at
/// most `u` relative, and the key error moves each score by at most `u · scale · Σ|q_i k_i|`,
/// which for our inputs (`|x| < 1`, scale `2/√d`) changes softmax weights by well under `2u`
/// relative. So `4u` bounds the total with margin; f32 stores are exact and only f32
/// accumulation over at most a few thousand terms remains, bounded by `1e-5`.
pub fn attention_bound(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 => 1e-5,
        d => 4.0 * kv_pool::dtype::max_relative_error(d) as f64,
    }
}

/// The bound on `‖out − ref‖ / ‖ref‖` for attention against the reference over the values the
/// store holds (what the kernels read, scales applied): no storage rounding is left, only the
/// kernel's own arithmetic (f32 accumulation; the CUDA tensor-core kernel's query and softmax
/// weights enter as a rounded part plus its remainder, about 16 bits for bf16 and 22 for f16).
/// Tight enough to catch a misplaced element or a wrong scale that the storage bound hides
/// (fp8's is 25 %).
pub const STORED_BOUND: f64 = 1e-4;

/// The result of one check.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The backend's name and the case (its `Display`), as printed in the report.
    pub name: String,
    /// `‖out − ref‖₂ / ‖ref‖₂` over the whole output ([`relative_error`]); infinite when the
    /// backend returned an error.
    pub error: f64,
    /// The largest `error` that passes ([`attention_bound`] for attention cases).
    pub bound: f64,
    /// `Some(reason)` when the backend does not support the case
    /// ([`Backend::kv_support`]): it was not run, and counts as passed.
    pub skipped: Option<String>,
    /// Attention cases: the error against the reference over the values the store holds,
    /// which must be within [`STORED_BOUND`].
    pub stored_error: Option<f64>,
}

impl Outcome {
    /// The outcome of a case that ran: passed iff `error <= bound`.
    pub fn measured(name: String, error: f64, bound: f64) -> Self {
        Outcome {
            name,
            error,
            bound,
            skipped: None,
            stored_error: None,
        }
    }

    /// The outcome of a case the backend does not support, with its reason: not run, passed.
    pub fn skipped(name: String, bound: f64, reason: String) -> Self {
        Outcome {
            name,
            error: 0.0,
            bound,
            skipped: Some(reason),
            stored_error: None,
        }
    }

    /// With the error against the reference over the stored values ([`STORED_BOUND`]).
    pub fn with_stored(self, stored_error: f64) -> Self {
        Outcome {
            stored_error: Some(stored_error),
            ..self
        }
    }

    /// Whether the errors are within their bounds (NaN fails), or the case was skipped.
    pub fn passed(&self) -> bool {
        self.skipped.is_some()
            || (self.error <= self.bound && self.stored_error.is_none_or(|e| e <= STORED_BOUND))
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(reason) = &self.skipped {
            return write!(f, "skip {:<60} {reason}", self.name);
        }
        write!(
            f,
            "{} {:<60} err {:.3e} bound {:.1e}",
            if self.passed() { "ok  " } else { "FAIL" },
            self.name,
            self.error,
            self.bound
        )?;
        match self.stored_error {
            Some(e) => write!(f, "; vs stored {e:.3e} bound {STORED_BOUND:.0e}"),
            None => Ok(()),
        }
    }
}

/// `‖got − want‖ / ‖want‖`.
pub fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        return if num == 0.0 { 0.0 } else { f64::INFINITY };
    }
    (num / den).sqrt()
}

/// Panics with the full report if any outcome failed (for tests). Skipped outcomes pass; each
/// is printed with its reason, so a skip is never silent.
pub fn assert_all_passed(outcomes: &[Outcome]) {
    for o in outcomes.iter().filter(|o| o.skipped.is_some()) {
        println!("{o}");
    }
    let report: String = outcomes.iter().map(|o| format!("{o}\n")).collect();
    assert!(
        outcomes.iter().all(Outcome::passed),
        "conformance failures:\n{report}"
    );
}
