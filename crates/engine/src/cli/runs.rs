//! Flags of the commands that run a workload: `kvserve bench` and `kvserve sim`, and the
//! arrival process they share.

use std::path::PathBuf;

use clap::Args;

use super::{EngineArgs, HiCacheArgs, RunOutputArgs, WorkloadArgs};
use crate::error::{EngineError, Result};
use crate::sim::Arrivals;

/// Flags of `kvserve bench`, named after SGLang's server and bench_serving arguments.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// The workload (generated defaults sized for the tiny model on 2 cores; see each flag).
    #[command(flatten)]
    pub source: WorkloadArgs,
    /// When requests arrive (default for a generated workload: 16 per second).
    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    #[command(flatten)]
    pub engine: EngineArgs,

    /// Also run the workload with the radix cache disabled and print the ratios.
    #[arg(long)]
    pub compare_no_cache: bool,

    /// Untimed requests before each run (SGLang's bench_serving `--warmup-requests`): copies
    /// of the first request with at most 16 output tokens, so first-use costs stay out of the
    /// figures; in process they leave the prefix cache cold. 0: none.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub warmup_requests: usize,
    /// Drive this OpenAI-compatible server (`http://host:port`) over HTTP instead of an
    /// in-process engine (the engine flags are then unused).
    #[arg(long, value_name = "URL", help_heading = "Remote server")]
    pub url: Option<String>,
    /// With --url: the `model` of each request (default: the first of /v1/models).
    #[arg(
        long,
        value_name = "NAME",
        requires = "url",
        help_heading = "Remote server"
    )]
    pub model: Option<String>,
    /// With --url: the server's API key (sent as `Authorization: Bearer`).
    #[arg(
        long,
        value_name = "KEY",
        requires = "url",
        help_heading = "Remote server"
    )]
    pub api_key: Option<String>,
    /// Write the results as JSON to this file.
    #[arg(long, value_name = "FILE", default_value = "kvserve-bench.json")]
    pub json: PathBuf,
    /// Draw the TTFT distribution into this PNG file.
    #[arg(long, value_name = "FILE.png", default_value = "kvserve-bench.png")]
    pub plot: PathBuf,
    /// No progress bar and no notes on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Arrival flags shared by `sim` and `bench`.
#[derive(Debug, Clone, Args)]
pub struct ArrivalArgs {
    /// Poisson arrivals at this many requests per second (seeded with --seed), or `inf` for
    /// everything at once. Default: a trace's own timestamps; for a generated workload, the
    /// command's default.
    #[arg(
        long,
        value_name = "R",
        allow_negative_numbers = true,
        help_heading = "Arrivals"
    )]
    pub request_rate: Option<String>,
    /// At most this many requests in flight, as a client with that many connections
    /// (bench_serving's `--max-concurrency`); a request waits for a free one.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Arrivals")]
    pub max_concurrency: Option<u64>,
    /// Replay a trace's timestamps this many times faster.
    #[arg(
        long,
        value_name = "X",
        default_value_t = 1.0,
        help_heading = "Arrivals"
    )]
    pub speed: f64,
}

impl ArrivalArgs {
    /// The arrival process: `--request-rate` if given, else a trace's timestamps, else
    /// Poisson at `default_rate` (`None`: everything at once).
    pub fn arrivals(&self, source: &WorkloadArgs, default_rate: Option<f64>) -> Result<Arrivals> {
        let poisson = |rate| Arrivals::Poisson {
            rate,
            seed: source.seed,
        };
        Ok(
            match (self.request_rate.as_deref().map(str::trim), &source.trace) {
                (None, Some(_)) => Arrivals::Trace { speed: self.speed },
                (None, None) => default_rate.map_or(Arrivals::Burst, poisson),
                (Some(r), _) if r.eq_ignore_ascii_case("inf") => Arrivals::Burst,
                (Some(r), _) => poisson(
                    r.parse()
                        .map_err(|e| EngineError::arg("--request-rate", format!("{r:?}: {e}")))?,
                ),
            },
        )
    }
}

/// Flags of `kvserve sim`, named after SGLang's server arguments where they exist.
#[derive(Debug, Args)]
pub struct SimArgs {
    #[command(flatten)]
    pub source: WorkloadArgs,
    /// When requests arrive (default for a generated workload: all at once).
    #[command(flatten)]
    pub arrivals: ArrivalArgs,

    /// Model preset of the cost model: llama-3-8b, llama-3-70b.
    #[arg(long, default_value = "llama-3-8b", help_heading = "Cost model")]
    pub model: String,
    /// Accelerator preset: h100, a100.
    #[arg(long, default_value = "h100", help_heading = "Cost model")]
    pub accelerator: String,
    /// Tensor-parallel degree (accelerators per replica).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Cost model")]
    pub tp: u32,
    /// L3 storage → host bandwidth per rank in GB/s, with --hicache-storage-backend (default:
    /// 10 for file, 2 for redis).
    #[arg(long, value_name = "GB/S", help_heading = "Cost model")]
    pub storage_bandwidth: Option<f64>,
    /// A simulated host tier (and L3 store) behind the tree: the scheduler loads host hits
    /// back and prefetches from L3, the cost model charges the copies. The L3 store is an
    /// unbounded in-memory map whatever the backend.
    #[command(flatten)]
    pub hicache: HiCacheArgs,

    /// Schedule policies to compare (comma-separated): fcfs, lpm, dfs-weight, lof, random.
    #[arg(
        long,
        default_value = "fcfs",
        value_name = "P1,P2,...",
        help_heading = "Scheduler"
    )]
    pub schedule_policy: String,
    /// Eviction policies to compare (comma-separated; `all` = SGLang's seven).
    #[arg(
        long,
        default_value = "lru",
        value_name = "P1,P2,...",
        help_heading = "Scheduler"
    )]
    pub radix_eviction_policy: String,
    /// Use the chunk cache (no prefix reuse) instead of the radix cache.
    #[arg(long, help_heading = "Scheduler")]
    pub disable_radix_cache: bool,
    /// Page size in tokens.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Scheduler")]
    pub page_size: u32,
    /// KV pool sizes in tokens to compare (comma-separated). Default: what
    /// --mem-fraction-static leaves on the simulated device after the weights.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "A,B,...",
        help_heading = "Scheduler"
    )]
    pub max_total_tokens: Vec<usize>,
    /// Fraction of device memory for weights + KV pool.
    #[arg(long, default_value_t = 0.88, help_heading = "Scheduler")]
    pub mem_fraction_static: f64,
    /// Chunk size of chunked prefill in tokens (≤ 0 disables chunking).
    #[arg(
        long,
        default_value_t = 8192,
        allow_negative_numbers = true,
        help_heading = "Scheduler"
    )]
    pub chunked_prefill_size: i64,
    /// Token budget of one prefill batch.
    #[arg(long, default_value_t = 16384, help_heading = "Scheduler")]
    pub max_prefill_tokens: usize,
    /// Request limit (default: SGLang's rule from the pool size and context length).
    #[arg(long, help_heading = "Scheduler")]
    pub max_running_requests: Option<usize>,
    /// Context length (default: the workload's longest prompt + output).
    #[arg(long, help_heading = "Scheduler")]
    pub context_length: Option<usize>,
    /// Scales how much future output admission reserves (SGLang's new_token_ratio).
    #[arg(long, default_value_t = 1.0, help_heading = "Scheduler")]
    pub schedule_conservativeness: f64,
    /// Let running decodes ride along in prefill batches.
    #[arg(long, help_heading = "Scheduler")]
    pub enable_mixed_chunk: bool,
    /// LPM falls back to FCFS above this many waiting requests.
    #[arg(long, default_value_t = 128, help_heading = "Scheduler")]
    pub lpm_fallback_threshold: usize,
    /// A cluster behind the router: `--dp N --router-policy …`.
    #[command(flatten)]
    pub router: crate::sim_dp::DpArgs,
    /// Allocator policies to compare by page contiguity (comma-separated, or all): token
    /// (FIFO), paged (LIFO), sorted (paged with sorted release, as in PD), best-fit. Adds the
    /// contiguity table: runs per request, PD transfer blocks, page-table reads, free-page
    /// fragmentation. Default: SGLang's choice by page size, unmeasured.
    #[arg(long, value_name = "A1,A2,...", help_heading = "Scheduler")]
    pub allocator: Option<String>,

    /// Output format, threads, timings, progress.
    #[command(flatten)]
    pub output: RunOutputArgs,
    /// Also draw output throughput against pool size into this PNG file (with --dp: hit rate
    /// against instances per router policy, and TTFT p50 into FILE-ttft.png beside it).
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// With --allocator: draw the share of free pages in long runs over simulated time into
    /// this PNG file.
    #[arg(long, value_name = "FILE.png", requires = "allocator")]
    pub contiguity_plot: Option<PathBuf>,
    /// Prove the pool partition after every scheduler step (slow).
    #[arg(long)]
    pub check: bool,
}
