//! The conformance suite on the CPU backend.

use attention::conformance::{self, SuiteSize};
use attention::{CpuBackend, CpuConfig};

#[test]
fn cpu_attention_conformance_quick() {
    let backend = CpuBackend::default();
    let outcomes = conformance::run_attention_suite(&backend, SuiteSize::Quick);
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

#[test]
fn cpu_attention_conformance_threaded() {
    let backend = CpuBackend::new(CpuConfig {
        threads: 3,
        ..CpuConfig::default()
    })
    .unwrap();
    let cases = conformance::attention_cases(SuiteSize::Quick);
    // Every fourth case is enough to cover the threaded split.
    let outcomes: Vec<_> = cases
        .iter()
        .step_by(4)
        .map(|c| conformance::run_attention_case(&backend, c).unwrap())
        .collect();
    conformance::assert_all_passed(&outcomes);
}

/// The full suite: longer sequences, every dtype for every shape. Slow in debug builds; run
/// with `cargo test --release -p attention -- --ignored`.
#[test]
#[ignore]
fn cpu_attention_conformance_full() {
    let backend = CpuBackend::default();
    let outcomes = conformance::run_attention_suite(&backend, SuiteSize::Full);
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

#[test]
fn cpu_dense_conformance() {
    let backend = CpuBackend::default();
    let outcomes = conformance::run_dense_suite(&backend).unwrap();
    for o in &outcomes {
        println!("{o}");
    }
    conformance::assert_all_passed(&outcomes);
}

/// A NaN key comes out as NaN in exactly the rows that attend it, over every store dtype
/// (`conformance::run_nan_key_case`), single-threaded and threaded.
#[test]
fn cpu_nan_keys_come_out_as_nan() {
    for threads in [1, 3] {
        let backend = CpuBackend::new(CpuConfig {
            threads,
            ..CpuConfig::default()
        })
        .unwrap();
        let outcomes = conformance::run_nan_key_suite(&backend).unwrap();
        for o in &outcomes {
            println!("{o}");
        }
        conformance::assert_all_passed(&outcomes);
    }
}
