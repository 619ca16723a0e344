//! # engine — the kvserve engine and the `kvserve` binary
//!
//! The top crate of kvserve. It composes the component crates (kv-pool, radix-cache,
//! scheduler, attention backends, model) and is the **only** crate that knows about
//! command-line flags, files, threads, sockets and output formats: every crate below it is plain
//! synchronous logic with no I/O.
//!
//! What it holds:
//! - [`components`]: one value per component kind over the implementations compiled into this
//!   build (allocator, prefix cache, backend); a backend whose feature is off answers a typed
//!   `NotCompiled` error; `kvserve info` lists them.
//! - [`cli`] and [`config_file`]: the clap command line (SGLang's flag names) and `--config
//!   FILE.toml`; `src/main.rs` only parses, runs and maps errors to exit code 2.
//! - [`engine_loop`], [`model_exec`], [`server`]: the scheduler and model on their own thread,
//!   token streams through channels, and the HTTP API on top (`kvserve serve`).
//! - [`bench`](mod@bench) and [`bench_client`]: `kvserve bench`, in process or against any
//!   OpenAI-compatible server (`--url`).
//! - [`workload`]: request lists shared by the replayer, the simulator and the benchmarks —
//!   Mooncake JSONL traces, generated shared prefix, multi-turn chat, random lengths; generated
//!   workloads are deterministic functions of a seed ([`rng`]).
//! - [`cache_sim`] (`kvserve cache-sim`: trace replay through the radix cache for every eviction
//!   policy and capacity of a sweep) and [`sim`] (`kvserve sim`: the real scheduler over a cost
//!   model).
//! - [`report`] (aligned table, JSON lines) and [`plot`] (PNG, fonts embedded).
//!
//! ## Where it sits
//! ```text
//! engine ─┬─> scheduler ──> radix-cache ──> kv-pool
//!         ├─> model ──> attention ──> kv-pool
//!         └─> attention backends (cpu; wgpu, cuda by feature)
//! ```
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
pub mod bench_client;
pub mod cache_sim;
pub mod cli;
pub mod components;
pub mod config_file;
pub mod engine_loop;
pub mod engine_metrics;
pub mod error;
pub mod memory;
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

/// The multi-threaded tokio runtime `serve` and `bench --url` run on.
pub(crate) fn async_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|source| EngineError::Io {
            path: "the async runtime".into(),
            source,
        })
}
