//! Opening a backend in tests: skip with a printed reason when no adapter exists, or fail when
//! `KVSERVE_REQUIRE_WGPU=1` (`.ci/run`, which installs Mesa's Vulkan and GL software drivers,
//! sets it). A test whose adapter lacks a capability (f16 shaders, say) still runs what the
//! adapter supports and prints each skipped case with its reason.

use crate::{WgpuBackend, WgpuConfig};

/// The environment variable that turns a missing adapter from a skip into a failure.
pub const REQUIRE_ENV: &str = "KVSERVE_REQUIRE_WGPU";

/// Whether [`REQUIRE_ENV`] is set to `1`.
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// A backend with the default configuration, or `None` (after printing why) when none can be
/// opened. Panics instead when [`required`]: a test helper, where a panic is the failure.
pub fn backend_or_skip(test: &str) -> Option<WgpuBackend> {
    backend_or_skip_with(test, WgpuConfig::default())
}

/// [`backend_or_skip`] with a configuration.
pub fn backend_or_skip_with(test: &str, config: WgpuConfig) -> Option<WgpuBackend> {
    match WgpuBackend::new(config) {
        Ok(b) => {
            println!("{test}: wgpu adapter {}", b.report());
            Some(b)
        }
        Err(e) if required() => panic!("{test}: {REQUIRE_ENV}=1 but no wgpu backend: {e}"),
        Err(e) => {
            println!("SKIP {test}: no wgpu backend ({e}); set {REQUIRE_ENV}=1 to fail instead");
            None
        }
    }
}
