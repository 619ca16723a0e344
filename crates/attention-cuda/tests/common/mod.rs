//! Shared by the library tests (NVRTC, hipRTC): skip with a printed reason when the library is
//! missing, or fail when CI requires it; compile every specialisation from several threads;
//! check that a broken source is rejected with the compiler's log.

use attention_cuda::kernels::{self, all_specs};
use attention_cuda::{Source, Spec};

/// `true` when `found` is `Ok`; otherwise prints why `test` skips and returns `false`, or
/// panics when the environment variable `require` is `1`.
pub fn found_or_skip<T>(test: &str, require: &str, found: Result<T, String>) -> bool {
    match found {
        Ok(_) => true,
        Err(reason) => {
            if std::env::var(require).is_ok_and(|v| v == "1") {
                panic!("{test}: {require}=1 but {reason}");
            }
            println!("skipping {test}: {reason}");
            false
        }
    }
}

/// Compiles every specialisation with `compile`, from one thread per core at once (which also
/// checks that `compile` is safe to call concurrently), checks each result with `check`, and
/// fails with every failure listed. Prints the count and the time under `what`.
pub fn compile_every_spec<C>(
    what: &str,
    compile: impl Fn(&Spec) -> Result<C, String> + Sync,
    check: impl Fn(&Spec, &C) -> Result<(), String> + Sync,
) {
    let specs = all_specs();
    let start = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|w| {
                let (specs, compile, check) = (&specs, &compile, &check);
                s.spawn(move || {
                    specs
                        .iter()
                        .skip(w)
                        .step_by(threads)
                        .filter_map(|spec| compile(spec).and_then(|c| check(spec, &c)).err())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a compile thread panicked"))
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!(
        "{} specialisations compiled {what} in {:.1?} ({threads} threads)",
        specs.len(),
        start.elapsed()
    );
}

/// The attention source without its specialisation defines fails on its `#error`, and the
/// compiler's log (which names what is missing) reaches the caller; the real sources compile.
pub fn a_broken_source_is_rejected_with_the_log<C>(compile: impl Fn(&Spec) -> Result<C, String>) {
    let spec = Spec {
        source: Source::Attention,
        defines: vec![("KV_DTYPE", 7)],
    };
    let err = compile(&spec).err().expect("a broken source compiled");
    assert!(err.contains("KV_DTYPE must be"), "{err}");
    assert!(compile(&kernels::dense()).is_ok());
}
