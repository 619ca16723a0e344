//! Shared by the library tests (NVRTC, hipRTC): skip with a printed reason when the library is
//! missing, or fail when CI requires it.

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
