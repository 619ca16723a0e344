//! Shared by the library tests (NVRTC, hipRTC): skip with a printed reason when the library is
//! missing, or fail when CI requires it; compile every specialisation from several processes
//! and threads; check that a broken source is rejected with the compiler's log; check the
//! on-disk compile cache.

use attention_cuda::compile_cache::CompileCache;
use attention_cuda::kernels;
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

/// The environment variable that names a child process's share of the specialisations
/// (`"i/n"`: every n-th, from the i-th), set by [`compile_every_spec`] for the copies of the test
/// binary it starts.
pub const SHARE_VAR: &str = "KVSERVE_COMPILE_SHARE";

/// Compiles every specialisation of `specs` (the same list in every process: a fixed filter of
/// `all_specs()`) with `compile` and checks each result with `check`, failing with every
/// failure listed; prints the count and the time under `what`.
///
/// The work is split over processes, and within each over threads: the test named `test`
/// re-runs its own test binary once per core (at least twice), each child compiling every n-th
/// specialisation (its share, named by [`SHARE_VAR`]) from one thread per core. Processes are
/// independent, so compilers that serialise their compiles within a process (hipRTC's lock,
/// `attention_cuda::hiprtc`) still use every core; the threads check that `compile` is safe to
/// call concurrently. A child that fails (or does not start) fails the test with its output.
pub fn compile_every_spec<C>(
    test: &str,
    what: &str,
    specs: Vec<Spec>,
    compile: impl Fn(&Spec) -> Result<C, String> + Sync,
    check: impl Fn(&Spec, &C) -> Result<(), String> + Sync,
) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Ok(share) = std::env::var(SHARE_VAR) {
        let (first, step) = parse_share(&share);
        let mine: Vec<&Spec> = specs.iter().skip(first).step_by(step).collect();
        let start = std::time::Instant::now();
        compile_on_threads(&mine, cores, &compile, &check);
        println!(
            "share {share}: {} specialisations compiled {what} in {:.1?} ({cores} threads)",
            mine.len(),
            start.elapsed()
        );
        return;
    }
    let start = std::time::Instant::now();
    let children = cores.max(2);
    let exe = std::env::current_exe().expect("the test binary's path");
    let running: Vec<_> = (0..children)
        .map(|i| {
            let share = format!("{i}/{children}");
            let child = std::process::Command::new(&exe)
                .args([test, "--exact", "--nocapture", "--test-threads=1"])
                .env(SHARE_VAR, &share)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn();
            (share, child)
        })
        .collect();
    let mut failures = Vec::new();
    // Every child is started before the first is waited for (their output is a few lines, far
    // below a pipe's buffer, so none blocks on a full pipe meanwhile).
    for (share, child) in running {
        match child.and_then(|c| c.wait_with_output()) {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                if !text.contains(&format!("share {share}: ")) {
                    failures.push(format!("share {share} compiled nothing:\n{text}"));
                }
                // What the checks printed (libtest's own lines left out).
                text.lines()
                    .filter(|l| {
                        !(l.is_empty() || l.starts_with("running ") || l.starts_with("test "))
                    })
                    .for_each(|l| println!("{l}"));
            }
            Ok(out) => failures.push(format!(
                "share {share}: {}\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )),
            Err(e) => failures.push(format!("share {share}: could not start {exe:?}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    println!(
        "{} specialisations compiled {what} in {:.1?} ({children} processes × {cores} threads)",
        specs.len(),
        start.elapsed()
    );
}

/// `"i/n"` as `(i, n)`, with `i < n`; anything else is a bug in the parent (a panic).
fn parse_share(share: &str) -> (usize, usize) {
    let parsed = share
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse().ok()?, n.parse().ok()?)));
    match parsed {
        Some((i, n)) if i < n => (i, n),
        _ => panic!("{SHARE_VAR}={share:?} is not i/n with i < n"),
    }
}

/// Compiles and checks `specs` from `threads` threads at once; panics listing the failures.
fn compile_on_threads<C>(
    specs: &[&Spec],
    threads: usize,
    compile: &(impl Fn(&Spec) -> Result<C, String> + Sync),
    check: &(impl Fn(&Spec, &C) -> Result<(), String> + Sync),
) {
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|w| {
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

/// A compiler's output through a [`CompileCache`] in a fresh directory (named for `test`): the
/// first compile of a store specialisation for `arches[0]` stores it, the second reads it back
/// (the same bytes, and no compile), and `arches[1]` is another entry. `compile` is the
/// compiler's `compile_cached`, its output as bytes.
pub fn a_compile_is_stored_once_and_read_back(
    test: &str,
    arches: [&str; 2],
    compile: impl Fn(&Spec, &str, Option<&CompileCache>) -> Result<(Vec<u8>, bool), String>,
) {
    let dir = std::env::temp_dir().join(format!("kvserve-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = CompileCache::at(&dir);
    let spec = kernels::all_specs()
        .into_iter()
        .find(|s| s.name().starts_with("store"))
        .expect("a store specialisation");
    let (first, hit) = compile(&spec, arches[0], Some(&cache)).unwrap();
    assert!(!hit);
    let (second, hit) = compile(&spec, arches[0], Some(&cache)).unwrap();
    assert!(hit);
    assert_eq!(second, first, "the stored output is the compiled one");
    let (_, hit) = compile(&spec, arches[1], Some(&cache)).unwrap();
    assert!(!hit, "another architecture is another entry");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}
