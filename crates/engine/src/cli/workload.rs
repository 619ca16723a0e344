//! Flags that choose a workload (generated or a Mooncake trace) and `kvserve cache-sim`'s flags.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::HiCacheArgs;
use crate::error::Result;
use crate::workload::{load_mooncake, GspConfig, MultiTurnConfig, RandomConfig, Workload};

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

    /// Output format, threads, timings, progress.
    #[command(flatten)]
    pub output: RunOutputArgs,
    /// Also draw hit rate against capacity into this PNG file; with lru and belady in
    /// --policy, also the share of the LRU → Belady gap each other policy closes, into
    /// FILE-gap.png beside it.
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
    /// Check after every request that nothing leaked (accounting identity), and after each
    /// replay the kv-pool ownership partition.
    #[arg(long)]
    pub check: bool,
}

/// How `cache-sim` and `sim` print and how many of their runs go at once.
#[derive(Debug, Clone, Args)]
pub struct RunOutputArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Replays or simulated configurations run at once on threads (default: the available
    /// cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
    /// Omit wall times from the table, so the output is reproducible byte for byte.
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
