//! The `kvserve` command line (clap derive): the subcommands' flags (SGLang's names where SGLang
//! has them), their per-command defaults, and their conversion into validated values — the
//! workload, the arrival process, the [`EngineSetup`](crate::setup::EngineSetup). The bodies of the subcommands are in
//! `src/commands/`.
//!
//! Errors in the values of flags are reported naming the flag; the binary exits with code 2.

use clap::{Args, Parser, Subcommand};

/// kvserve: a KV-cache-centric LLM serving stack.
#[derive(Debug, Parser)]
#[command(name = "kvserve", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once per process: the size of the largest variant (serve's flags) costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay a workload through the radix prefix cache and report hit rates per eviction
    /// policy and capacity (no model, no GPU).
    CacheSim(CacheSimArgs),
    /// Simulate serving a workload: the real scheduler, prefix cache and allocator, with a
    /// cost model of the model and accelerator instead of a GPU; reports hit rate, throughput,
    /// TTFT and inter-token latency per schedule policy, eviction policy and pool size.
    Sim(SimArgs),
    /// Benchmark serving a workload in process: the real scheduler, prefix cache and a real
    /// model (the built-in tiny preset, or a Hugging Face checkpoint) on a compiled backend; or,
    /// with --url, drive any OpenAI-compatible server with the same workload.
    Bench(BenchArgs),
    /// Serve a model over HTTP: SGLang's native API (/generate, /health, /get_model_info,
    /// /get_server_info, /flush_cache), OpenAI's (/v1/completions, /v1/chat/completions,
    /// /v1/models) and Prometheus /metrics.
    Serve(ServeArgs),
    /// Route requests over prefill and decode servers (SGLang's PD router): each request goes
    /// to a prefill and a decode server at once, answered from decode.
    Router(crate::router::RouterArgs),
    /// List what this build has: features, backends (and the device each finds), allocators,
    /// prefix caches, policies, KV dtypes and model architectures.
    Info(InfoArgs),
    /// KV-transfer throughput of a backend (tcp or shm, over loopback in this process) against
    /// a baseline measured in the same run: raw loopback sockets (tcp) or memcpy (shm).
    TransferBench(TransferBenchArgs),
}

/// Flags of `kvserve transfer-bench` (Mooncake's `transfer_engine_bench`).
#[derive(Debug, Args)]
pub struct TransferBenchArgs {
    /// The backend: tcp or shm.
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Bytes per block.
    #[arg(long, value_name = "BYTES", default_value_t = 65536, value_parser = clap::value_parser!(u64).range(1..))]
    pub block_size: u64,
    /// Blocks per batch.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Concurrent submitters (also tcp streams / shm copy threads, and baseline connections).
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub threads: u64,
    /// Seconds of measuring, engine and baseline together.
    #[arg(long, value_name = "SECONDS", default_value_t = 6.0)]
    pub duration: f64,
    /// Output format (json: one object with `gbps` and `baseline_gbps`).
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
}

/// Flags of `kvserve info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Report the GEMM path the cuda/rocm backends take with this `serve`/`bench` flag.
    #[arg(long)]
    pub enable_deterministic_inference: bool,
    /// Report the CUDA graphs a `serve`/`bench` with this flag captures (none).
    #[arg(long)]
    pub disable_cuda_graph: bool,
    /// Report the CUDA graphs a `serve`/`bench` with this flag captures.
    #[arg(long, value_name = "N")]
    pub cuda_graph_max_bs: Option<usize>,
    /// The `serve`/`bench` `--max-running-requests` the reported CUDA graphs are for.
    #[arg(long, default_value_t = 256)]
    pub max_running_requests: usize,
    // The cuda backend's forms a `serve`/`bench` with these flags takes.
    #[command(flatten)]
    pub tensor_cores: CudaTensorCoreArgs,
}

mod engine;
mod runs;
mod workload;

pub use engine::*;
pub use runs::*;
pub use workload::*;
