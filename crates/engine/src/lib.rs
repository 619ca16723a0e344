//! # engine — the kvserve engine and the `kvserve` binary
//!
//! The top crate of kvserve. It composes the component crates (today kv-pool and radix-cache)
//! and is the **only** crate that knows about command-line flags, files, threads and output
//! formats: every crate below it is plain synchronous logic with no I/O.
//!
//! What it holds now:
//! - [`workload`]: request lists shared by the replayer and (later) the simulator and the
//!   benchmark client — Mooncake JSONL traces with tokens synthesized from block hash ids,
//!   SGLang's generated-shared-prefix workload, and multi-turn chat; generated workloads are
//!   deterministic functions of a seed ([`rng`]).
//! - [`cache_sim`]: trace replay (`kvserve cache-sim`): each request is matched, allocated,
//!   inserted and unlocked through a [`radix_cache::RadixCache`] over a real
//!   [`kv_pool::Allocator`] whose size is the capacity, for every eviction policy and capacity
//!   of a sweep, on scoped threads; optionally with the accounting and ownership checks.
//! - [`report`] (aligned table, JSON lines) and [`plot`] (PNG, fonts embedded).
//! - [`engine_loop`] (the scheduler and model on their own thread, request event streams) and
//!   [`server`] (`kvserve serve`: SGLang's native API, OpenAI's completions and chat,
//!   `/metrics`, `--api-key`).
//! - [`cli`]: the clap command line; `src/main.rs` only parses it, runs it and maps errors to
//!   exit code 2.
//!
//! ## Where it sits
//! ```text
//! engine ─┬─> radix-cache ──> kv-pool
//!         └─> kv-pool
//! ```
//! Later: the scheduler, model and attention backends, transfer, the HTTP server.
//!
//! ## Example: replay a generated workload
//! ```
//! use engine::cache_sim::{run_sweep, SweepConfig};
//! use engine::workload::GspConfig;
//!
//! let workload = GspConfig { num_groups: 4, prompts_per_group: 3, ..GspConfig::default() }
//!     .generate()?;
//! let cfg = SweepConfig {
//!     policies: vec!["lru".into()],
//!     capacities: vec![1 << 20],
//!     page_size: 16,
//!     check: true,
//!     jobs: 1,
//! };
//! let results = run_sweep(&workload.requests, &cfg, &|_| {})?;
//! // Each group's later two requests reuse its 2,048-token system prompt.
//! assert_eq!(results[0].cached_tokens, 4 * 2 * 2048);
//! # Ok::<(), engine::EngineError>(())
//! ```

pub mod bench;
pub mod cache_sim;
pub mod cli;
pub mod engine_loop;
pub mod engine_metrics;
pub mod error;
pub mod model_exec;
pub mod plot;
pub mod report;
pub mod rng;
pub mod server;
pub mod sim;
pub mod workload;

pub use cache_sim::{replay, run_sweep, ReplayOptions, ReplayResult, SweepConfig};
pub use error::{EngineError, Result};
pub use workload::{Request, Workload, WorkloadStats};
