//! The `kvserve` command line (clap derive). Subcommands:
//!
//! - `cache-sim`: replay a workload through the prefix cache for every eviction policy and
//!   capacity asked for; print a table or JSON lines, optionally plot hit rate against capacity.
//!
//! Errors in the values of flags are reported naming the flag; the binary exits with code 2.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cache_sim::{page_align_capacity, parse_policies, run_sweep, SweepConfig};
use crate::error::{EngineError, Result};
use crate::plot::plot_hit_rates;
use crate::report::{render_json_lines, render_table, TableOptions};
use crate::workload::{load_mooncake, GspConfig, MultiTurnConfig, RandomConfig, Workload};

/// kvserve: a KV-cache-centric LLM serving stack.
#[derive(Debug, Parser)]
#[command(name = "kvserve", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
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
    /// List what this build has: features, backends (and the device each finds), allocators,
    /// prefix caches, policies, KV dtypes and model architectures.
    Info(InfoArgs),
}

/// Flags of `kvserve info`.
#[derive(Debug, Args)]
pub struct InfoArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `kvserve info`.
pub fn info(args: &InfoArgs, out: &mut dyn Write) -> Result<()> {
    let inventory = crate::components::Inventory::of_this_build().probe();
    let text = if args.json {
        serde_json::to_string_pretty(&inventory)
            .map_err(|e| EngineError::arg("--json", e.to_string()))?
    } else {
        inventory.to_string()
    };
    writeln!(out, "{text}").map_err(|source| EngineError::Io {
        path: "standard output".into(),
        source,
    })
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
    /// The workload.
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
    /// cost-aware, belady (an oracle that knows the future: evicts what is used farthest ahead),
    /// or all (SGLang's seven).
    #[arg(long, value_name = "P1,P2,...", default_value = "lru")]
    pub policy: String,

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Also draw hit rate against capacity into this PNG file.
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

/// Runs a parsed command line, writing results to `out` and notes and progress to stderr.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<()> {
    match cli.command {
        Command::CacheSim(args) => cache_sim(&args, out),
        Command::Sim(args) => sim(&args, out),
        Command::Bench(args) => bench(&args, out),
        Command::Serve(args) => serve(&args),
        Command::Info(args) => info(&args, out),
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
    /// Compute backend: cpu, wgpu, cuda (among those compiled into this build; see `kvserve
    /// info`).
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
}

impl EngineArgs {
    /// The engine set-up these flags describe, with `default_context_len` unless
    /// `--context-length` is given.
    pub fn setup(&self, default_context_len: usize) -> Result<crate::bench::EngineSetup> {
        use crate::bench::{default_setup, parse_policy, ModelSource};
        let mut setup = default_setup(self.context_length.unwrap_or(default_context_len));
        setup.backend = crate::components::BackendKind::parse(&self.backend)?;
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
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Refuse new requests (503) while this many wait.
    #[arg(long)]
    pub max_queued_requests: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
}

/// `kvserve serve`: builds the engine, listens, serves until Ctrl-C, then shuts down cleanly.
pub fn serve(args: &ServeArgs) -> Result<()> {
    let state = build_server_state(args)?;
    crate::async_runtime()?.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|source| EngineError::Io {
                path: addr.clone(),
                source,
            })?;
        let local = listener.local_addr().map_err(|source| EngineError::Io {
            path: addr.clone(),
            source,
        })?;
        eprintln!("kvserve: serving {} on http://{local}", state.model_name);
        // On Ctrl-C, stop taking connections and end every in-flight request (aborted, its
        // stream closed) so the graceful shutdown does not wait on long generations.
        let engine = state.clone();
        let shutdown = async move {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("kvserve: shutting down; in-flight requests are aborted");
            engine.engine.begin_shutdown();
        };
        crate::server::serve(listener, state, shutdown)
            .await
            .map_err(|source| EngineError::Io {
                path: local.to_string(),
                source,
            })
    })
}

/// The server's shared state for `args`: engine thread started, tokenizer loaded.
pub fn build_server_state(args: &ServeArgs) -> Result<std::sync::Arc<crate::server::AppState>> {
    let source = args.engine.model_path.clone().map_or(
        crate::bench::ModelSource::Tiny,
        crate::bench::ModelSource::Path,
    );
    let config = source.config()?;
    let name = source.name();
    let (tokenizer, chat_template) = match &source {
        crate::bench::ModelSource::Tiny => (model::tiny::tiny_tokenizer(), None),
        crate::bench::ModelSource::Path(dir) => {
            model::load_tokenizer_dir(dir).map_err(|e| EngineError::Model(e.to_string()))?
        }
    };
    let chat = crate::server::chat::ChatPrompt::new(chat_template)
        .map_err(|e| EngineError::Model(e.to_string()))?;
    let mut setup = args.engine.setup(config.max_position_embeddings)?;
    setup.scheduler.max_queued_requests = args.max_queued_requests;
    let context_len = setup.scheduler.context_len;
    let radix = !args.engine.disable_radix_cache;
    let (sched, exec) = crate::bench::build(&setup, radix)?;
    // The effective settings, under SGLang's server-argument names, for /get_server_info.
    let cfg = sched.config();
    let server_args = serde_json::json!({
        "model_path": name,
        "backend": setup.backend,
        "kv_cache_dtype": setup.kv_dtype.name(),
        "page_size": cfg.page_size,
        "max_total_num_tokens": sched.allocator().size(),
        "max_running_requests": cfg.max_running_requests,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "schedule_policy": cfg.schedule_policy.as_str(),
        "schedule_conservativeness": cfg.schedule_conservativeness,
        "enable_mixed_chunk": cfg.enable_mixed_chunk,
        "disable_radix_cache": !radix,
        "radix_eviction_policy": setup.eviction_policy,
        "max_queued_requests": cfg.max_queued_requests,
        "api_key_required": args.api_key.is_some(),
    });
    Ok(std::sync::Arc::new(crate::server::AppState {
        server_args,
        engine: crate::engine_loop::EngineHandle::start(sched, exec),
        vocab_size: config.vocab_size,
        eos_token_ids: config.eos_token_ids.clone(),
        tokenizer,
        chat,
        model_name: name,
        context_len,
        api_key: args.api_key.clone(),
        metrics: Default::default(),
    }))
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

    /// The engine.
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

/// `kvserve bench`.
pub fn bench(args: &BenchArgs, out: &mut dyn Write) -> Result<()> {
    use crate::bench::{plot, render, run_bench, timed, BenchOutcome};
    use crate::sim::sim_requests;

    let workload = args.source.load(WorkloadDefaults::BENCH)?;
    let arrivals = args.arrivals.arrivals(&args.source, Some(16.0))?;
    let requests = sim_requests(&workload, arrivals)?;
    let stats = workload.stats(args.engine.page_size);
    let longest = workload
        .requests
        .iter()
        .map(|r| r.tokens.len() + r.output_len.max(1))
        .max()
        .unwrap_or(1);
    let mut setup = args.engine.setup(longest + 1)?;
    setup.seed = args.source.seed;
    let max_concurrency = args.arrivals.max_concurrency.map(|n| n as usize);
    // Each run: the in-process engine with the radix cache or without, or a remote server.
    let runs: Vec<(&str, Option<bool>)> = match (
        &args.url,
        args.compare_no_cache,
        args.engine.disable_radix_cache,
    ) {
        (Some(_), true, _) => {
            return Err(EngineError::arg(
                "--compare-no-cache",
                "needs the in-process engine; run the remote server twice instead of --url",
            ))
        }
        (None, true, true) => {
            return Err(EngineError::arg(
                "--compare-no-cache",
                "runs with and without the radix cache; drop --disable-radix-cache",
            ))
        }
        (Some(_), false, _) => vec![("remote", None)],
        (None, true, false) => vec![("radix", Some(true)), ("no-cache", Some(false))],
        (None, false, true) => vec![("no-cache", Some(false))],
        (None, false, false) => vec![("radix", Some(true))],
    };
    if !args.quiet {
        let target = match &args.url {
            Some(url) => format!("server {url}"),
            None => format!(
                "model {} on {} with {} threads",
                setup.model.name(),
                setup.backend,
                setup.threads
            ),
        };
        eprintln!(
            "note: {} ({} requests, {} prompt tokens, ideal hit rate {:.2}%), {target}",
            workload.name,
            requests.len(),
            stats.prompt_tokens,
            100.0 * stats.ideal_hit_rate(),
        );
    }
    let (outcomes, wall) = timed(|| -> Result<Vec<_>> {
        let mut outcomes = Vec::new();
        for &(label, radix) in &runs {
            let bar = if args.quiet || !std::io::stderr().is_terminal() {
                ProgressBar::hidden()
            } else {
                let bar = ProgressBar::new(requests.len() as u64);
                if let Ok(style) = ProgressStyle::with_template(&format!(
                    "{label:<8} {{elapsed_precise}} [{{bar:40}}] {{human_pos}}/{{human_len}} requests"
                )) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar
            };
            let ideal = stats.ideal_hit_rate();
            let r = match (radix, &args.url) {
                (Some(radix), _) => run_bench(
                    &requests,
                    &setup,
                    radix,
                    ideal,
                    max_concurrency,
                    &mut |done, _| bar.set_position(done as u64),
                ),
                (None, url) => {
                    let target = crate::bench_client::RemoteTarget {
                        url: url.clone().unwrap_or_default(),
                        model: args.model.clone(),
                        api_key: args.api_key.clone(),
                    };
                    crate::bench_client::run_remote(
                        &requests,
                        &target,
                        max_concurrency,
                        &|done, _| bar.set_position(done as u64),
                    )
                    .map(|report| BenchOutcome::new(label, report, ideal))
                }
            };
            bar.finish_and_clear();
            outcomes.push(r?);
        }
        Ok(outcomes)
    });
    let outcomes = outcomes?;
    let text = render(&outcomes, wall);
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| EngineError::Io {
            path: "standard output".into(),
            source,
        })?;
    let json = serde_json::to_string_pretty(&outcomes)
        .map_err(|e| EngineError::arg("--json", e.to_string()))?;
    std::fs::write(&args.json, json + "\n").map_err(|source| EngineError::Io {
        path: args.json.display().to_string(),
        source,
    })?;
    plot(&outcomes, &workload.name, &args.plot)?;
    if !args.quiet {
        eprintln!(
            "note: wrote {} and {}",
            args.json.display(),
            args.plot.display()
        );
    }
    Ok(())
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
    pub fn arrivals(
        &self,
        source: &WorkloadArgs,
        default_rate: Option<f64>,
    ) -> Result<crate::sim::Arrivals> {
        use crate::sim::Arrivals;
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
    /// The workload.
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

    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Also draw output throughput against pool size into this PNG file.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
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

/// `kvserve sim`.
pub fn sim(args: &SimArgs, out: &mut dyn Write) -> Result<()> {
    use crate::sim::{
        default_max_running_requests, parse_schedule_policies, run_sweep, sim_requests, SimConfig,
    };
    use scheduler::{Accelerator, CostModel, ModelShape, SchedulerConfig};

    let bad =
        |flag: &'static str, e: scheduler::SchedulerError| EngineError::arg(flag, e.to_string());
    let model = ModelShape::preset(&args.model).map_err(|e| bad("--model", e))?;
    let accel = Accelerator::preset(&args.accelerator).map_err(|e| bad("--accelerator", e))?;
    let cost = CostModel::new(model, accel, args.tp);
    if !(args.mem_fraction_static > 0.0 && args.mem_fraction_static <= 1.0) {
        return Err(EngineError::arg(
            "--mem-fraction-static",
            format!("{} is not in (0, 1]", args.mem_fraction_static),
        ));
    }
    let schedule_policies = parse_schedule_policies(&args.schedule_policy)?;
    let eviction_policies: Vec<String> = if args.disable_radix_cache {
        vec!["disabled".into()]
    } else {
        parse_policies(&args.radix_eviction_policy)?
            .into_iter()
            .map(|p| p.to_string())
            .collect()
    };
    let workload = args.source.load(WorkloadDefaults::SGLANG)?;
    let arrivals = args.arrivals.arrivals(&args.source, None)?;
    let requests = sim_requests(&workload, arrivals)?;
    let longest = workload
        .requests
        .iter()
        .map(|r| r.tokens.len() + r.output_len.max(1))
        .max()
        .unwrap_or(1);
    let context_len = args.context_length.unwrap_or(longest + 1);
    let capacities: Vec<usize> = if args.max_total_tokens.is_empty() {
        let tokens = cost.kv_pool_tokens(args.mem_fraction_static);
        if tokens < args.page_size as usize {
            return Err(EngineError::arg(
                "--mem-fraction-static",
                format!(
                    "{} of {} × {} leaves no room for the KV cache after {:.1} GB of weights; raise it, raise --tp, or give --max-total-tokens",
                    args.mem_fraction_static,
                    args.tp,
                    cost.accel.name,
                    cost.model.params * cost.model.weight_bytes / 1e9
                ),
            ));
        }
        vec![tokens]
    } else {
        args.max_total_tokens.clone()
    };
    let chunk = (args.chunked_prefill_size > 0).then_some(args.chunked_prefill_size as usize);
    let mut configs = Vec::new();
    for &policy in &schedule_policies {
        for eviction in &eviction_policies {
            for &capacity in &capacities {
                let max_running = args
                    .max_running_requests
                    .unwrap_or_else(|| default_max_running_requests(capacity, context_len));
                configs.push(SimConfig {
                    scheduler: SchedulerConfig {
                        page_size: args.page_size,
                        context_len,
                        max_running_requests: max_running,
                        max_prefill_tokens: args.max_prefill_tokens,
                        chunked_prefill_size: chunk,
                        schedule_policy: policy,
                        lpm_fallback_threshold: args.lpm_fallback_threshold,
                        schedule_conservativeness: args.schedule_conservativeness,
                        enable_mixed_chunk: args.enable_mixed_chunk,
                        strict: args.check,
                        seed: args.source.seed,
                        ..SchedulerConfig::default()
                    },
                    eviction_policy: if args.disable_radix_cache {
                        "lru".into()
                    } else {
                        eviction.clone()
                    },
                    radix: !args.disable_radix_cache,
                    capacity_tokens: capacity,
                    cost: cost.clone(),
                    max_concurrency: args.arrivals.max_concurrency.map(|n| n as usize),
                });
            }
        }
    }
    if !args.quiet {
        eprintln!(
            "note: {} requests ({}), {} configurations, {} on {} × {}, context {context_len}",
            requests.len(),
            workload.name,
            configs.len(),
            cost.model.name,
            args.tp,
            cost.accel.name
        );
    }
    let jobs = args.jobs.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |j| j as usize,
    );
    let bar = if args.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new((requests.len() * configs.len()) as u64);
        if let Ok(style) = ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {human_pos}/{human_len} requests, eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    };
    let start = Instant::now();
    let outcomes = run_sweep(&requests, &configs, jobs, &|n| bar.inc(n as u64));
    bar.finish_and_clear();
    let outcomes = outcomes?;
    let wall = start.elapsed().as_secs_f64();
    let text = match args.format {
        OutputFormat::Table => {
            let mut t = format!(
                "workload: {}\n{} requests, {} on {} × {} (tp {}), page size {}\n",
                workload.name,
                requests.len(),
                cost.model.name,
                args.tp,
                cost.accel.name,
                args.tp,
                args.page_size
            );
            t.push_str(&crate::sim::render_table(&outcomes, !args.no_timings));
            if !args.no_timings {
                t.push_str(&format!(
                    "total wall time {wall:.2} s for {} configurations\n",
                    outcomes.len()
                ));
            }
            t
        }
        OutputFormat::Json => outcomes
            .iter()
            .map(|o| serde_json::to_string(o).map(|l| l + "\n"))
            .collect::<std::result::Result<String, _>>()
            .map_err(|e| EngineError::arg("--format", e.to_string()))?,
    };
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| EngineError::Io {
            path: "standard output".into(),
            source,
        })?;
    if let Some(path) = &args.plot {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for o in &outcomes {
            let label = format!("{} / {}", o.schedule_policy, o.eviction_policy);
            let point = (o.capacity_tokens as f64, o.output_tokens_per_s);
            match series.iter_mut().find(|(l, _)| *l == label) {
                Some((_, points)) => points.push(point),
                None => series.push((label, vec![point])),
            }
        }
        crate::plot::plot_lines(
            &crate::plot::LinePlot {
                title: format!(
                    "Simulated output throughput ({} on {} × {})",
                    cost.model.name, args.tp, cost.accel.name
                ),
                subtitle: workload.name.clone(),
                x_desc: format!("KV pool (tokens, page size {})", args.page_size),
                y_desc: "output tokens/s".into(),
                y_percent: false,
                x_log: true,
                series,
            },
            path,
        )?;
        if !args.quiet {
            eprintln!("note: plot written to {}", path.display());
        }
    }
    Ok(())
}

fn note(args: &CacheSimArgs, msg: &str) {
    if !args.quiet {
        eprintln!("note: {msg}");
    }
}

/// `kvserve cache-sim`.
pub fn cache_sim(args: &CacheSimArgs, out: &mut dyn Write) -> Result<()> {
    let policies = parse_policies(&args.policy)?;
    let p = args.page_size;
    let load_start = Instant::now();
    let workload = args.source.load(WorkloadDefaults::SGLANG)?;
    let stats = workload.stats(p);
    note(
        args,
        &format!(
            "{} requests, {} prompt tokens, {} unique tokens at page size {p} ({:.2} s to prepare)",
            stats.requests,
            stats.prompt_tokens,
            stats.unique_tokens,
            load_start.elapsed().as_secs_f64()
        ),
    );

    // Capacities: as given (rounded up to pages, with a note), then fractions of the unique
    // tokens, or by default a sweep relative to them (never below the longest prompt).
    let p_tokens = p as usize;
    let unique = stats.unique_tokens.max(1) as f64;
    let longest = stats.max_prompt_tokens.div_ceil(p_tokens).max(1) * p_tokens;
    let mut capacities = Vec::new();
    let mut add = |tokens: usize| {
        if !capacities.contains(&tokens) {
            capacities.push(tokens);
        }
    };
    for c in &args.capacity_tokens {
        match *c {
            Capacity::Tokens(n) => {
                let aligned = page_align_capacity(n, p)?;
                if aligned != n {
                    note(
                        args,
                        &format!(
                            "capacity {n} rounded up to {aligned} (whole pages of {p} tokens)"
                        ),
                    );
                }
                add(aligned);
            }
            Capacity::Infinite => add(page_align_capacity(stats.never_evicting_capacity(), p)?),
        }
    }
    for f in &args.capacity_fraction {
        add(page_align_capacity(
            ((f * unique).ceil() as usize).max(1),
            p,
        )?);
    }
    if args.capacity_tokens.is_empty() && args.capacity_fraction.is_empty() {
        for d in [16.0, 8.0, 4.0, 2.0] {
            let tokens = ((unique / d).ceil() as usize).max(longest);
            add(page_align_capacity(tokens, p)?);
        }
        add(page_align_capacity(stats.never_evicting_capacity(), p)?);
    }

    let jobs = args.jobs.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |j| j as usize,
    );
    let cfg = SweepConfig {
        policies,
        capacities,
        page_size: p,
        check: args.check,
        jobs,
    };
    let total = (cfg.policies.len() * cfg.capacities.len() * workload.requests.len()) as u64;
    let bar = if args.quiet || !std::io::stderr().is_terminal() {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {human_pos}/{human_len} requests, eta {eta}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    };
    let start = Instant::now();
    let results = run_sweep(&workload.requests, &cfg, &|n| bar.inc(n));
    bar.finish_and_clear();
    let results = results?;
    let wall = start.elapsed().as_secs_f64();
    for r in results.iter().filter(|r| r.skipped_requests > 0) {
        note(
            args,
            &format!(
                "{} at capacity {}: skipped {} of {} requests whose prompt needs more pages \
                 than the whole pool",
                r.policy, r.capacity_tokens, r.skipped_requests, r.requests
            ),
        );
    }

    let text = match args.format {
        OutputFormat::Table => {
            let mut t = render_table(
                &results,
                TableOptions {
                    workload: Some((&workload.name, &stats)),
                    timings: !args.no_timings,
                },
            );
            if !args.no_timings {
                t.push_str(&format!(
                    "total wall time {wall:.2} s for {} replays on {} threads\n",
                    results.len(),
                    cfg.jobs.min(results.len())
                ));
            }
            t
        }
        OutputFormat::Json => render_json_lines(&results),
    };
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| EngineError::Io {
            path: "standard output".into(),
            source,
        })?;
    if args.format == OutputFormat::Json {
        note(
            args,
            &format!("total wall time {wall:.2} s for {} replays", results.len()),
        );
    }
    if let Some(path) = &args.plot {
        plot_hit_rates(&results, &workload.name, path)?;
        note(args, &format!("plot written to {}", path.display()));
    }
    Ok(())
}
