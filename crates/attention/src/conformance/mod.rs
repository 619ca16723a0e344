//! The backend conformance suite, written once as functions generic over [`Backend`]: the CPU
//! backend runs it in this crate's tests, and every device backend calls the same functions.
//!
//! Inputs come from a seeded [`SplitMix64`](kv_pool::rng::SplitMix64) through [`nonzero_vec`]
//! (never zeros). Attention cases allocate their slots
//! with kv-pool's allocators after shuffling the free list (so slots are scattered and
//! non-contiguous), write the cached prefix straight into the store, run one batched attention
//! call through the backend (which writes the new tokens' K/V and attends), and compare with the
//! f64 [`reference`](crate::reference) computed from the unquantized inputs. The error measure
//! is `‖out − ref‖₂ / ‖ref‖₂` over the whole batch output, within [`attention_bound`] of the
//! store dtype; and once more against the reference over the values the store holds after the
//! call (scales applied), within [`STORED_BOUND`]: with storage rounding gone, only the
//! kernel's arithmetic is left, so a wrong scale or a misplaced element cannot hide in the
//! storage bound (fp8's is 25 %).
//!
//! [`run_nan_key_suite`] puts a NaN in one new key and requires it to come out as NaN in
//! exactly the rows that attend it: a device that reads a NaN as a number (an fp8 conversion by
//! bit moves) or takes a NaN sum for an empty softmax state gives a finite wrong answer.
//!
//! Modules: [`outcome`] (bounds, the error measure, reporting), [`inputs`] (random values and
//! scattered slots), [`cases`] (the attention cases and their runner), [`dense`] (the dense
//! ops). Everything is re-exported here.

pub mod cases;
pub mod dense;
pub mod inputs;
pub mod outcome;

pub use cases::{
    attention_cases, extend_cases, nan_key_cases, random_extend_cases, run_attention_case,
    run_attention_suite, run_nan_key_case, run_nan_key_suite, AttentionCase, CaseKind, SuiteSize,
};
pub use dense::{
    matmul_bf16_activations_case, moe_bf16_activations_case, run_dense_suite, Bf16MoeOutcome,
    BF16_WEIGHT_BOUND,
};
pub use inputs::{nonzero, nonzero_vec, scattered_slots};
pub use outcome::{assert_all_passed, attention_bound, relative_error, Outcome, STORED_BOUND};
