//! The `kvserve` command line (clap derive): the subcommands' flags (SGLang's names where SGLang
//! has them), their per-command defaults, and their conversion into validated values — the
//! workload, the arrival process, the [`EngineSetup`]. The bodies of the subcommands are in
//! `src/commands/`.
//!
//! Errors in the values of flags are reported naming the flag; the binary exits with code 2.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::error::{EngineError, Result};
use crate::setup::{
    default_setup, parse_policy, BackendKind, EngineSetup, HiCacheSetup, ModelSource,
};
use crate::sim::Arrivals;
use crate::workload::{load_mooncake, GspConfig, MultiTurnConfig, RandomConfig, Workload};

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
}

/// Generated workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// SGLang bench_serving's generated-shared-prefix (groups of prompts sharing a system prompt).
    Gsp,
    /// Multi-turn chat sessions whose prompts carry the whole history.
    Multiturn,
    /// SGLang bench_serving's random input and output lengths (no shared prefixes).
    Random,
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// An aligned table with a workload header.
    Table,
    /// One JSON object per line per policy and capacity.
    Json,
}

/// A capacity as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// A number of tokens.
    Tokens(usize),
    /// Enough that nothing is ever evicted (`inf`).
    Infinite,
}

fn parse_capacity(s: &str) -> std::result::Result<Capacity, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("inf") {
        return Ok(Capacity::Infinite);
    }
    match t.replace('_', "").parse::<usize>() {
        Ok(0) => Err("a capacity of 0 tokens holds nothing; give a positive number".into()),
        Ok(n) => Ok(Capacity::Tokens(n)),
        Err(e) => Err(format!("{t:?} is not a number of tokens or `inf` ({e})")),
    }
}

fn parse_fraction(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let v = match t.split_once('/') {
        Some((a, b)) => {
            let a: f64 = a.trim().parse().map_err(|e| format!("{t:?}: {e}"))?;
            let b: f64 = b.trim().parse().map_err(|e| format!("{t:?}: {e}"))?;
            a / b
        }
        None => t.parse().map_err(|e| format!("{t:?}: {e}"))?,
    };
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!("{t:?} is not a positive fraction"))
    }
}

/// Where a workload comes from: a Mooncake trace or a generated workload (shared by
/// `cache-sim` and `sim`).
#[derive(Debug, Clone, Args)]
pub struct WorkloadArgs {
    /// Mooncake JSONL trace to replay (instead of a generated workload).
    #[arg(long, value_name = "FILE", conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Generated workload to replay when no trace is given.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Gsp)]
    pub workload: WorkloadKind,

    /// gsp: number of system prompts [default: 64; bench: 16]
    #[arg(long, help_heading = "Generated shared prefix (gsp)")]
    pub gsp_num_groups: Option<usize>,
    /// gsp: requests per system prompt [default: 16; bench: 16]
    #[arg(long, help_heading = "Generated shared prefix (gsp)")]
    pub gsp_prompts_per_group: Option<usize>,
    /// gsp: system prompt length in tokens [default: 2048; bench: 1024]
    #[arg(long, help_heading = "Generated shared prefix (gsp)")]
    pub gsp_system_prompt_len: Option<usize>,
    /// gsp: question length in tokens [default: 128; bench: 128]
    #[arg(long, help_heading = "Generated shared prefix (gsp)")]
    pub gsp_question_len: Option<usize>,
    /// gsp: output length in tokens [default: 256; bench: 128]
    #[arg(long, help_heading = "Generated shared prefix (gsp)")]
    pub gsp_output_len: Option<usize>,

    /// multiturn: concurrent chat sessions [default: 64; bench: 16]
    #[arg(long, help_heading = "Multi-turn chat (multiturn)")]
    pub mt_sessions: Option<usize>,
    /// multiturn: turns per session [default: 8; bench: 4]
    #[arg(long, help_heading = "Multi-turn chat (multiturn)")]
    pub mt_turns: Option<usize>,
    /// multiturn: new input tokens per turn [default: 256; bench: 128]
    #[arg(long, help_heading = "Multi-turn chat (multiturn)")]
    pub mt_input_len: Option<usize>,
    /// multiturn: output tokens per turn (part of the next turn's history) [default: 128; bench: 64]
    #[arg(long, help_heading = "Multi-turn chat (multiturn)")]
    pub mt_output_len: Option<usize>,

    /// random: requests [default: 1000; bench: 64]
    #[arg(long, help_heading = "Random lengths (random)")]
    pub num_prompts: Option<usize>,
    /// random: the longest prompt in tokens [default: 1024; bench: 512]
    #[arg(long, help_heading = "Random lengths (random)")]
    pub random_input_len: Option<usize>,
    /// random: the longest output in tokens [default: 1024; bench: 64]
    #[arg(long, help_heading = "Random lengths (random)")]
    pub random_output_len: Option<usize>,
    /// random: lengths are uniform in [max(len × ratio, 1), len]
    #[arg(long, default_value_t = 0.0, help_heading = "Random lengths (random)")]
    pub random_range_ratio: f64,

    /// Seed of generated workloads.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Token ids of generated workloads are drawn from 0..N.
    #[arg(long, value_name = "N", default_value_t = 32_000)]
    pub vocab_size: u32,
}

/// Flags of `kvserve cache-sim`.
#[derive(Debug, Args)]
pub struct CacheSimArgs {
    #[command(flatten)]
    pub source: WorkloadArgs,

    /// Page size P in tokens: only whole pages are cached.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub page_size: u32,
    /// Pool capacities in tokens (comma-separated; `inf` = never evict). Each is rounded up to
    /// whole pages. Default: 1/16, 1/8, 1/4, 1/2 of the workload's unique tokens (at least the
    /// longest prompt), and inf.
    #[arg(long, value_name = "A,B,...", value_delimiter = ',', value_parser = parse_capacity)]
    pub capacity_tokens: Vec<Capacity>,
    /// Pool capacities as fractions of the workload's unique page-aligned tokens
    /// (comma-separated, e.g. 1/16,0.25), in addition to --capacity-tokens.
    #[arg(long, value_name = "F,G,...", value_delimiter = ',', value_parser = parse_fraction)]
    pub capacity_fraction: Vec<f64>,
    /// Eviction policies (comma-separated): lru, lfu, fifo, mru, filo, priority, slru,
    /// cost-aware, lineage-ttl, belady (an oracle that knows the future: evicts what is used
    /// farthest ahead), or all (SGLang's seven).
    #[arg(long, value_name = "P1,P2,...", default_value = "lru")]
    pub policy: String,
    /// A simulated host tier (and L3 store) behind every replay's cache: hit rate per tier.
    /// The host tier is --hicache-ratio × each capacity (--hicache-size needs a model: refused);
    /// the L3 store is an unbounded in-memory map whatever the backend.
    #[command(flatten)]
    pub hicache: HiCacheArgs,

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Also draw hit rate against capacity into this PNG file; with lru and belady in
    /// --policy, also the share of the LRU → Belady gap each other policy closes, into
    /// FILE-gap.png beside it.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Check after every request that nothing leaked (accounting identity), and after each
    /// replay the kv-pool ownership partition.
    #[arg(long)]
    pub check: bool,
    /// Replays run at once on threads (default: the available cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
    /// Omit timings from the table, so the output is reproducible byte for byte.
    #[arg(long)]
    pub no_timings: bool,
    /// No progress bar and no notes on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// Defaults of the generated workloads, per command (flags override them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkloadDefaults {
    /// gsp: groups, prompts per group, system prompt, question, output lengths.
    pub gsp: [usize; 5],
    /// multiturn: sessions, turns, input and output lengths per turn.
    pub multiturn: [usize; 4],
    /// random: prompts, longest input and output lengths.
    pub random: [usize; 3],
}

impl WorkloadDefaults {
    /// SGLang bench_serving's defaults (cache-sim, sim): gsp 64 × 16 prompts, 2048-token
    /// system prompts, 128-token questions, 256 output tokens; multiturn 64 sessions × 8 turns
    /// of 256 in, 128 out; random 1000 prompts of up to 1024 in and 1024 out.
    pub const SGLANG: WorkloadDefaults = WorkloadDefaults {
        gsp: [64, 16, 2048, 128, 256],
        multiturn: [64, 8, 256, 128],
        random: [1000, 1024, 1024],
    };
    /// `kvserve bench` on the tiny model, sized for about a minute on 2 cores: gsp 16 × 16
    /// prompts, 1024-token system prompts, 128-token questions, 128 output tokens; multiturn
    /// 16 sessions × 4 turns of 128 in, 64 out; random 64 prompts of up to 512 in and 64 out.
    pub const BENCH: WorkloadDefaults = WorkloadDefaults {
        gsp: [16, 16, 1024, 128, 128],
        multiturn: [16, 4, 128, 64],
        random: [64, 512, 64],
    };
}

impl WorkloadArgs {
    /// Loads the trace or generates the workload the flags describe, unset generator flags
    /// taking `defaults`.
    pub fn load(&self, defaults: WorkloadDefaults) -> Result<Workload> {
        if let Some(path) = &self.trace {
            return load_mooncake(path);
        }
        let [groups, per_group, system, question, gsp_out] = defaults.gsp;
        let [sessions, turns, input, mt_out] = defaults.multiturn;
        match self.workload {
            WorkloadKind::Gsp => GspConfig {
                num_groups: self.gsp_num_groups.unwrap_or(groups),
                prompts_per_group: self.gsp_prompts_per_group.unwrap_or(per_group),
                system_prompt_len: self.gsp_system_prompt_len.unwrap_or(system),
                question_len: self.gsp_question_len.unwrap_or(question),
                output_len: self.gsp_output_len.unwrap_or(gsp_out),
                seed: self.seed,
                vocab_size: self.vocab_size,
            }
            .generate(),
            WorkloadKind::Multiturn => MultiTurnConfig {
                sessions: self.mt_sessions.unwrap_or(sessions),
                turns: self.mt_turns.unwrap_or(turns),
                input_len: self.mt_input_len.unwrap_or(input),
                output_len: self.mt_output_len.unwrap_or(mt_out),
                seed: self.seed,
                vocab_size: self.vocab_size,
            }
            .generate(),
            WorkloadKind::Random => RandomConfig {
                num_prompts: self.num_prompts.unwrap_or(defaults.random[0]),
                input_len: self.random_input_len.unwrap_or(defaults.random[1]),
                output_len: self.random_output_len.unwrap_or(defaults.random[2]),
                range_ratio: self.random_range_ratio,
                seed: self.seed,
                vocab_size: self.vocab_size,
            }
            .generate(),
        }
    }
}

/// Engine flags shared by `bench` and `serve`, named after SGLang's server arguments.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Read flags from this TOML file (keys are the long flags: `page-size = 16`); flags given
    /// on the command line win.
    #[arg(long, value_name = "FILE.toml", help_heading = "Engine")]
    pub config: Option<PathBuf>,
    /// A Hugging Face model directory (config.json, *.safetensors, tokenizer.json); default:
    /// the built-in tiny preset, which needs no download.
    #[arg(long, value_name = "DIR", help_heading = "Engine")]
    pub model_path: Option<PathBuf>,
    /// Compute backend: cpu, wgpu, cuda, rocm (among those compiled into this build; see
    /// `kvserve info`).
    #[arg(long, default_value = "cpu", help_heading = "Engine")]
    pub backend: String,
    /// CPU threads (default: the available cores).
    #[arg(long, value_name = "N", help_heading = "Engine")]
    pub threads: Option<usize>,
    /// KV cache element type: auto (float32), float32, float16, bfloat16, fp8_e4m3, fp8_e5m2.
    #[arg(long, default_value = "auto", help_heading = "Engine")]
    pub kv_cache_dtype: String,
    /// Page size in tokens.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..), help_heading = "Engine")]
    pub page_size: u32,
    /// KV pool size in tokens (default 131072, or with --mem-fraction-static the pool that
    /// fraction of host memory holds, capped by this flag when both are given).
    #[arg(long, value_name = "N", help_heading = "Engine")]
    pub max_total_tokens: Option<usize>,
    /// Fraction of memory that weights plus the KV pool may use, in (0, 1] (SGLang's sizing
    /// rule, over host memory for the CPU backend).
    #[arg(long, value_name = "F", help_heading = "Engine")]
    pub mem_fraction_static: Option<f64>,
    /// Request limit.
    #[arg(long, default_value_t = 256, help_heading = "Engine")]
    pub max_running_requests: usize,
    /// Chunk size of chunked prefill (≤ 0 disables chunking).
    #[arg(
        long,
        default_value_t = 8192,
        allow_negative_numbers = true,
        help_heading = "Engine"
    )]
    pub chunked_prefill_size: i64,
    /// Token budget of one prefill batch.
    #[arg(long, default_value_t = 16384, help_heading = "Engine")]
    pub max_prefill_tokens: usize,
    /// Schedule policy: fcfs, lpm, dfs-weight, lof, random.
    #[arg(long, default_value = "fcfs", help_heading = "Engine")]
    pub schedule_policy: String,
    /// Eviction policy of the radix cache.
    #[arg(long, default_value = "lru", help_heading = "Engine")]
    pub radix_eviction_policy: String,
    /// Context length (default: the workload's longest request for bench, the model's maximum
    /// position embeddings for serve).
    #[arg(long, help_heading = "Engine")]
    pub context_length: Option<usize>,
    /// Use the chunk cache (no prefix reuse) instead of the radix cache.
    #[arg(long, help_heading = "Engine")]
    pub disable_radix_cache: bool,
    /// Scales the scheduler's estimate of future decode tokens (higher: fewer retractions,
    /// smaller batches).
    #[arg(long, value_name = "X", default_value_t = 1.0, help_heading = "Engine")]
    pub schedule_conservativeness: f64,
    /// Let running decodes ride along in prefill batches.
    #[arg(long, help_heading = "Engine")]
    pub enable_mixed_chunk: bool,
    /// Batch-invariant ops: on the cuda and rocm backends, GEMMs take kvserve's own tiled
    /// kernel instead of cuBLAS (whose algorithm depends on the batch size), so a request's
    /// output is bitwise the same in any batch.
    #[arg(long, help_heading = "Engine")]
    pub enable_deterministic_inference: bool,
    #[command(flatten)]
    pub hicache: HiCacheArgs,
}

/// SGLang's hierarchical-cache flags (`--enable-hierarchical-cache` and the `--hicache-*`
/// family), with SGLang's defaults.
#[derive(Debug, Clone, Args)]
pub struct HiCacheArgs {
    /// Keep KV evicted from the device pool in a host pool (and, with a storage backend, in an
    /// L3 store) and load it back on a hit.
    #[arg(long, help_heading = "Hierarchical cache")]
    pub enable_hierarchical_cache: bool,
    /// Host pool size as a multiple of the device pool (ignored when --hicache-size is given).
    #[arg(
        long,
        value_name = "X",
        default_value_t = 2.0,
        help_heading = "Hierarchical cache"
    )]
    pub hicache_ratio: f64,
    /// Host pool size in GB (10^9 bytes); 0: use --hicache-ratio.
    #[arg(
        long,
        value_name = "GB",
        default_value_t = 0.0,
        help_heading = "Hierarchical cache"
    )]
    pub hicache_size: f64,
    /// When device KV is copied to the host: write_through (at the first hit),
    /// write_through_selective (at the second), write_back (on eviction).
    #[arg(
        long,
        default_value = "write_through",
        help_heading = "Hierarchical cache"
    )]
    pub hicache_write_policy: String,
    /// Host pool memory layout: layer_first, page_first, page_first_direct.
    #[arg(
        long,
        default_value = "page_first",
        help_heading = "Hierarchical cache"
    )]
    pub hicache_mem_layout: String,
    /// L3 store behind the host pool: file (a directory) or redis.
    #[arg(long, value_name = "BACKEND", help_heading = "Hierarchical cache")]
    pub hicache_storage_backend: Option<String>,
    /// When a prefetch from L3 stops: best_effort, wait_complete, timeout.
    #[arg(long, default_value = "timeout", help_heading = "Hierarchical cache")]
    pub hicache_storage_prefetch_policy: String,
    /// The storage backend's settings as JSON (or @FILE): `file_path` for file, `url` or
    /// `urls` (a cluster) for redis, SGLang's prefetch keys.
    #[arg(long, value_name = "JSON", help_heading = "Hierarchical cache")]
    pub hicache_storage_backend_extra_config: Option<String>,
}

impl HiCacheArgs {
    /// The hierarchical cache these flags describe (`None` without
    /// `--enable-hierarchical-cache`); every value is checked, naming its flag.
    pub fn setup(&self) -> Result<Option<HiCacheSetup>> {
        if !self.enable_hierarchical_cache {
            if self.hicache_storage_backend.is_some() {
                return Err(EngineError::arg(
                    "--hicache-storage-backend",
                    "an L3 store sits behind the host tier: add --enable-hierarchical-cache",
                ));
            }
            return Ok(None);
        }
        let arg = |flag: &'static str| move |e: String| EngineError::arg(flag, e);
        let storage_config = match &self.hicache_storage_backend_extra_config {
            None => hicache::storage::StorageConfig::default(),
            Some(text) => hicache::storage::StorageConfig::from_arg(text).map_err(|e| {
                EngineError::arg("--hicache-storage-backend-extra-config", e.to_string())
            })?,
        };
        Ok(Some(HiCacheSetup {
            write_policy: self
                .hicache_write_policy
                .parse()
                .map_err(|e: radix_cache::RadixCacheError| e.to_string())
                .map_err(arg("--hicache-write-policy"))?,
            mem_layout: self
                .hicache_mem_layout
                .parse()
                .map_err(|e: kv_pool::KvPoolError| e.to_string())
                .map_err(arg("--hicache-mem-layout"))?,
            ratio: self.hicache_ratio,
            size_gb: self.hicache_size,
            storage: self
                .hicache_storage_backend
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: hicache::storage::StorageError| e.to_string())
                .map_err(arg("--hicache-storage-backend"))?,
            storage_config,
            prefetch_policy: self
                .hicache_storage_prefetch_policy
                .parse()
                .map_err(|e: radix_cache::RadixCacheError| e.to_string())
                .map_err(arg("--hicache-storage-prefetch-policy"))?,
        }))
    }
}

impl EngineArgs {
    /// The engine set-up these flags describe, with `default_context_len` unless
    /// `--context-length` is given.
    pub fn setup(&self, default_context_len: usize) -> Result<EngineSetup> {
        let mut setup = default_setup(self.context_length.unwrap_or(default_context_len));
        setup.backend = BackendKind::parse(&self.backend)?;
        setup.kv_dtype = match self.kv_cache_dtype.as_str() {
            "auto" => kv_pool::KvDtype::F32,
            other => other.parse().map_err(|e: kv_pool::KvPoolError| {
                EngineError::arg("--kv-cache-dtype", e.to_string())
            })?,
        };
        setup.model = self
            .model_path
            .clone()
            .map_or(ModelSource::Tiny, ModelSource::Path);
        setup.mem_fraction_static = self.mem_fraction_static;
        setup.capacity_tokens = match (self.max_total_tokens, self.mem_fraction_static) {
            (Some(n), _) => n,
            (None, Some(_)) => usize::MAX,
            (None, None) => 1 << 17,
        };
        setup.scheduler.schedule_conservativeness = self.schedule_conservativeness;
        setup.scheduler.enable_mixed_chunk = self.enable_mixed_chunk;
        setup.enable_deterministic_inference = self.enable_deterministic_inference;
        setup.threads = self
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        setup.eviction_policy = self.radix_eviction_policy.clone();
        setup.scheduler.page_size = self.page_size;
        setup.scheduler.max_running_requests = self.max_running_requests;
        setup.scheduler.chunked_prefill_size =
            (self.chunked_prefill_size > 0).then_some(self.chunked_prefill_size as usize);
        setup.scheduler.max_prefill_tokens = self.max_prefill_tokens;
        setup.scheduler.schedule_policy = parse_policy(&self.schedule_policy)?;
        setup.hicache = self.hicache.setup()?;
        Ok(setup)
    }
}

/// Flags of `kvserve serve`, named after SGLang's server arguments.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Refuse new requests (503) while this many wait.
    #[arg(long)]
    pub max_queued_requests: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Publish the prefix cache's KV events (vLLM's `KVEventsConfig` as JSON): e.g.
    /// '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
    /// "topic": "kv-events"}'; msgpack `KVEventBatch`es on a ZMQ PUB socket.
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    #[command(flatten)]
    pub disaggregation: DisaggregationArgs,
}

/// PD disaggregation flags of `serve` (SGLang's names and defaults; the timeouts also read
/// SGLang's environment variables).
#[derive(Debug, Clone, Args)]
pub struct DisaggregationArgs {
    /// This server's role: null (prefill and decode), prefill, or decode.
    #[arg(long, default_value = "null", help_heading = "PD disaggregation")]
    pub disaggregation_mode: String,
    /// How KV moves from prefill to decode: tcp, shm (both servers on one host), nixl, fake
    /// (moves nothing: warm-up and tests of the protocol). Both servers must agree.
    #[arg(long, default_value = "tcp", help_heading = "PD disaggregation")]
    pub disaggregation_transfer_backend: String,
    /// Prefill: the port of the bootstrap server decode servers handshake with.
    #[arg(long, default_value_t = 8998, help_heading = "PD disaggregation")]
    pub disaggregation_bootstrap_port: u16,
    /// Prefill: seconds a request may wait for its decode server's handshake.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        env = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_bootstrap_timeout: f64,
    /// Decode: seconds a request may wait for its KV.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        env = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_waiting_timeout: f64,
    /// Decode: seconds between health checks of each prefill server.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5.0,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_heartbeat_interval: f64,
    /// Decode: failed health checks in a row after which a prefill server's requests fail.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 2,
        env = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
        help_heading = "PD disaggregation"
    )]
    pub disaggregation_heartbeat_max_failures: u32,
    /// Test hook: the tcp backend corrupts the N-th frame it sends (counting from 0) after
    /// checksumming it, so tests see a corrupted transfer fail cleanly.
    #[arg(long, value_name = "N", hide = true)]
    pub disaggregation_test_corrupt_frame: Option<u64>,
}

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

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
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
    /// Configurations simulated at once on threads (default: the available cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
    /// Omit wall times from the table, so the output is reproducible byte for byte.
    #[arg(long)]
    pub no_timings: bool,
    /// No progress bar and no notes on stderr.
    #[arg(long)]
    pub quiet: bool,
}
