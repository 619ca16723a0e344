//! # engine — the kvserve engine and the `kvserve` binary
//!
//! The top crate of kvserve. It composes the component crates (kv-pool, radix-cache,
//! scheduler, attention backends, model, transfer) and is the **only** crate that knows about
//! command-line flags, files, threads, sockets and output formats: every crate below it is plain
//! synchronous logic with no I/O.
//!
//! What it holds, in the one direction data flows (`cli` → `commands` → `setup` → the
//! component crates; no module imports one that imports it back):
//! - [`cli`] and [`config_file`]: the clap flags (SGLang's names), their per-command defaults
//!   and validation, and `--config FILE.toml`. `src/main.rs` only parses, runs and maps errors
//!   to exit code 2.
//! - [`commands`]: one module per subcommand holding its body (`serve`, `bench`, `cache-sim`,
//!   `sim`, `info`, `router`, `transfer-bench`).
//! - [`setup`]: building an engine — [`setup::EngineSetup`], the model source, the component
//!   kinds as enums over the compiled implementations (a backend whose feature is off answers
//!   a typed `NotCompiled` error), pool sizing through `kv_pool::MemoryPlan` only, and the
//!   model executor.
//! - [`engine_loop`] and [`server`]: the scheduler and model on their own thread, token streams
//!   through channels, and the HTTP API on top (`kvserve serve`); [`engine_metrics`] for
//!   `/metrics`; [`kv_events`] publishes the prefix cache's KV events (`--kv-events-config`,
//!   vLLM's ZMQ wire format) from the loop.
//! - [`disagg`]: PD disaggregation's roles (`serve --disaggregation-mode`), the bootstrap
//!   fields a request carries and the PD options; [`engine_loop::pd`] is the loop's PD half
//!   (the bootstrap and inflight queues around the scheduler on prefill, handshake →
//!   preallocation → transfer → running on decode, over `transfer`'s KV manager).
//! - [`bench_client`]: `kvserve bench --url` against any OpenAI-compatible server.
//! - [`router`]: `kvserve router`, sgl-router in front of kvserve servers: regular mode
//!   (`--worker-urls`, its load-balancing policies, `kv_events` from the workers' KV events,
//!   health checks, workers added and removed at run time) or PD (`--pd-disaggregation`).
//! - [`workload`]: request lists shared by the replayer, the simulator and the benchmarks —
//!   Mooncake JSONL traces, generated shared prefix, multi-turn chat, random lengths; generated
//!   workloads are deterministic functions of a seed (`kv_pool::rng::SplitMix64`).
//! - [`cache_sim`] (trace replay through the radix cache for every eviction policy and capacity
//!   of a sweep) and [`sim`] (the real scheduler over a cost model): the libraries of
//!   `kvserve cache-sim` and `kvserve sim`.
//! - [`sim_dp`]: `kvserve sim --dp N --router-policy …`, a cluster of simulated instances
//!   behind the router's real load-balancing policies (`router::policies`).
//! - [`sim_tier`]: the simulated host tier and L3 store both simulators put behind the tree
//!   with `--enable-hierarchical-cache` (a bookkeeping cache controller; no bytes move).
//! - [`report`] (aligned table, JSON lines) and [`plot`] (PNG, fonts embedded); [`runtime`]
//!   (the tokio runtime of `serve` and `bench --url`).
//!
//! ## Where it sits
//! ```text
//! engine ─┬─> scheduler ──> radix-cache ──> kv-pool
//!         ├─> model ──> attention ──> kv-pool
//!         ├─> attention backends (cpu; wgpu, cuda, rocm by feature)
//!         └─> transfer ──> kv-pool
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
//!     tier: None,
//! };
//! let results = run_sweep(&workload.requests, &cfg, &|_| {})?;
//! // Each group's later two requests reuse its 2,048-token system prompt.
//! assert_eq!(results[0].cached_tokens, 4 * 2 * 2048);
//! # Ok::<(), engine::EngineError>(())
//! ```

pub mod bench_client;
pub mod cache_sim;
pub mod cli;
pub mod commands;
pub mod config_file;
pub mod disagg;
pub mod engine_loop;
pub mod engine_metrics;
pub mod error;
pub mod kv_events;
pub mod plot;
pub mod report;
pub mod router;
pub mod runtime;
pub mod server;
pub mod setup;
pub mod sim;
pub mod sim_contiguity;
pub mod sim_dp;
pub mod sim_tier;
pub mod workload;

pub use cache_sim::{replay_through_cache, run_sweep, ReplayOptions, ReplayResult, SweepConfig};
pub use error::{EngineError, Result};
pub use workload::{Request, Workload, WorkloadStats};
