//! # kvserve-tests — cross-crate end-to-end tests
//!
//! This crate holds the tests that span several kvserve crates, so no component crate needs a
//! dev-dependency on a crate above it: the model on every compiled backend, the server
//! scenarios, and components written outside the component crates (a toy allocator, prefix
//! cache and eviction policy) checked by the suites those crates export (`kv_pool::testing`,
//! `radix_cache::testing`). The tests live in `tests/`; this library holds only what several
//! of them share.
//!
//! ## Backends
//! [`on_every_backend!`] writes one test body once and runs it on every compiled
//! [`attention::Backend`]: the CPU backend always, the wgpu backend when an adapter exists
//! (skipped with a printed reason otherwise, a failure with `KVSERVE_REQUIRE_WGPU=1`, as in
//! attention-wgpu's own tests).

pub use attention;
pub use attention_wgpu;

/// Defines a module `$name` with one `#[test]` per compiled backend (`cpu`, `wgpu`), each
/// calling the body with that backend bound to `$backend` (a generic `B: Backend`):
///
/// ```text
/// kvserve_tests::on_every_backend! {
///     fn greedy_matches(backend) {
///         let name = backend.name();
///         // ...
///     }
/// }
/// ```
///
/// The body sees the items of the enclosing module (`use super::*`).
#[macro_export]
macro_rules! on_every_backend {
    ($(#[$meta:meta])* fn $name:ident($backend:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body<B: $crate::attention::Backend>($backend: B) $body

            #[test]
            fn cpu() {
                body($crate::attention::CpuBackend::default());
            }

            #[test]
            fn wgpu() {
                let test = concat!(stringify!($name), " on wgpu");
                if let Some(backend) = $crate::attention_wgpu::test_support::backend_or_skip(test) {
                    body(backend);
                }
            }
        }
    };
}
