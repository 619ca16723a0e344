//! `kvserve bench` in-process: a workload through the real scheduler, prefix cache and
//! allocator and a real model ([`crate::model_exec::ModelExecutor`] on the chosen backend), timed
//! by the wall clock of every step. Reports throughput (requests/s, input and output tokens/s),
//! TTFT and inter-token latency percentiles, and the cache hit rate against the workload's
//! ideal; `--compare-no-cache` runs the same workload with the radix cache disabled.

use std::time::Instant;

use kv_pool::{floor_to_page, KvDtype};
use scheduler::{
    replay, Clock, ReplayConfig, SchedulePolicy, Scheduler, SchedulerConfig, SimReport, SimRequest,
};
use serde::Serialize;

use crate::components::{build_scheduler, AnyRunner, BackendKind};
use crate::error::{EngineError, Result};
use crate::model_exec::ModelExecutor;

/// Where the model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// The built-in `tiny` preset (seeded random weights, `r50k_base` vocabulary).
    Tiny,
    /// A Hugging Face model directory.
    Path(std::path::PathBuf),
}

impl ModelSource {
    /// The model's configuration (`config.json` of a directory), without loading weights.
    pub fn config(&self) -> Result<model::ModelConfig> {
        match self {
            ModelSource::Tiny => Ok(model::tiny::tiny_config()),
            ModelSource::Path(dir) => model::ModelConfig::from_file(&dir.join("config.json"))
                .map_err(|e| EngineError::Model(e.to_string())),
        }
    }

    /// The name the server reports (`tiny`, or the directory).
    pub fn name(&self) -> String {
        match self {
            ModelSource::Tiny => "tiny".into(),
            ModelSource::Path(dir) => dir.display().to_string(),
        }
    }
}

/// The engine configuration of a bench run or a server.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSetup {
    /// The model.
    pub model: ModelSource,
    /// KV pool size in tokens; with `mem_fraction_static`, its cap (`usize::MAX`: none).
    pub capacity_tokens: usize,
    /// `--mem-fraction-static`: size the pool from host memory ([`crate::memory`]).
    pub mem_fraction_static: Option<f64>,
    /// KV cache dtype.
    pub kv_dtype: KvDtype,
    /// Scheduler settings.
    pub scheduler: SchedulerConfig,
    /// Eviction policy of the radix cache.
    pub eviction_policy: String,
    /// The compute backend.
    pub backend: BackendKind,
    /// CPU threads of the backend.
    pub threads: usize,
    /// Seed of sampling (greedy requests ignore it).
    pub seed: u64,
}

/// The figures of one run (a JSON object of `--json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchOutcome {
    /// `radix`, `no-cache`, or `remote` (`--url`).
    pub cache: String,
    /// Requests that finished.
    pub requests: usize,
    /// Requests aborted.
    pub aborted: usize,
    /// Seconds from the first arrival to the last token (step wall times; idle gaps skipped).
    pub duration_s: f64,
    /// Requests per second.
    pub requests_per_s: f64,
    /// Prompt tokens per second.
    pub input_tokens_per_s: f64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token, median.
    pub ttft_p50_s: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_s: f64,
    /// Inter-token latency, median.
    pub itl_p50_s: f64,
    /// Inter-token latency, 99th percentile.
    pub itl_p99_s: f64,
    /// Cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    /// What a cache that never evicts would reach on this workload.
    pub ideal_hit_rate: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Retractions.
    pub retractions: usize,
    /// Scheduler steps.
    pub steps: u64,
    /// Every request's TTFT, sorted.
    #[serde(skip)]
    pub ttft_s: Vec<f64>,
}

impl BenchOutcome {
    /// The figures of a run from its report; `cache` labels it (`radix`, `no-cache`, `remote`).
    pub fn new(cache: &str, r: SimReport, ideal_hit_rate: f64) -> Self {
        let per_s = |n: f64| {
            if r.duration_s > 0.0 {
                n / r.duration_s
            } else {
                0.0
            }
        };
        BenchOutcome {
            cache: cache.into(),
            requests: r.requests,
            aborted: r.aborted,
            duration_s: r.duration_s,
            requests_per_s: per_s(r.requests as f64),
            input_tokens_per_s: per_s(r.prompt_tokens as f64),
            output_tokens_per_s: per_s(r.output_tokens as f64),
            ttft_p50_s: r.ttft_p50_s,
            ttft_p99_s: r.ttft_p99_s,
            itl_p50_s: r.itl_p50_s,
            itl_p99_s: r.itl_p99_s,
            hit_rate: r.hit_rate,
            ideal_hit_rate,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            prefill_tokens: r.prefill_tokens,
            output_tokens: r.output_tokens,
            retractions: r.retractions,
            steps: r.steps,
            ttft_s: r.ttft_s,
        }
    }
}

/// Builds the scheduler (radix or chunk cache, paged allocator) and the model executor that a
/// bench run or a server uses.
pub fn build(setup: &EngineSetup, radix: bool) -> Result<(Scheduler, ModelExecutor)> {
    let p = setup.scheduler.page_size;
    let tokens = match setup.mem_fraction_static {
        None => setup.capacity_tokens,
        Some(_) if setup.backend != BackendKind::Cpu => {
            return Err(EngineError::arg(
                "--mem-fraction-static",
                format!(
                    "sizes the pool from host memory, which only the cpu backend computes in; \
                     give --max-total-tokens for --backend {}",
                    setup.backend
                ),
            ))
        }
        Some(f) => {
            let shape = setup
                .model
                .config()?
                .kv_shape(setup.kv_dtype)
                .map_err(|e| EngineError::arg("--kv-cache-dtype", e.to_string()))?;
            let cap = (setup.capacity_tokens != usize::MAX).then_some(setup.capacity_tokens);
            crate::memory::pool_tokens(f, &setup.model, shape, p, setup.scheduler.context_len, cap)?
                .max_total_num_tokens()
        }
    };
    let capacity = floor_to_page(tokens, p as usize);
    if capacity == 0 {
        return Err(EngineError::arg(
            "--max-total-tokens",
            format!(
                "{} tokens is less than one page of {p}",
                setup.capacity_tokens
            ),
        ));
    }
    let exec = ModelExecutor::new(AnyRunner::build(setup, capacity)?, setup.seed);
    let sched = build_scheduler(
        setup.scheduler.clone(),
        radix,
        &setup.eviction_policy,
        capacity,
    )?;
    Ok((sched, exec))
}

/// Runs the workload once, with the radix cache (`radix`) or without.
pub fn run_bench(
    requests: &[SimRequest],
    setup: &EngineSetup,
    radix: bool,
    ideal_hit_rate: f64,
    max_concurrency: Option<usize>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BenchOutcome> {
    let (mut sched, mut exec) = build(setup, radix)?;
    let config = ReplayConfig {
        clock: Clock::Wall,
        max_concurrency,
    };
    let report = replay(requests, &mut sched, &mut exec, config, progress)
        .map_err(|e| EngineError::Simulation(e.to_string()))?;
    sched
        .check_invariants()
        .map_err(|message| EngineError::CheckFailed {
            after: "the bench".into(),
            message,
        })?;
    Ok(BenchOutcome::new(
        if radix { "radix" } else { "no-cache" },
        report,
        ideal_hit_rate,
    ))
}

/// A readable report of one or two runs (the second, if any, without the cache).
pub fn render(outcomes: &[BenchOutcome], wall_s: f64) -> String {
    let mut out = String::new();
    for o in outcomes {
        out += &format!(
            "[{}] {} requests ({} aborted) in {:.2} s: {:.2} req/s, {:.0} input tok/s, {:.0} output tok/s\n",
            o.cache, o.requests, o.aborted, o.duration_s, o.requests_per_s, o.input_tokens_per_s, o.output_tokens_per_s
        );
        out += &format!(
            "[{}] TTFT p50 {:.1} ms p99 {:.1} ms | ITL p50 {:.2} ms p99 {:.2} ms | hit rate {:.2}% (ideal {:.2}%) | prefill tokens {} | retractions {}\n",
            o.cache,
            1e3 * o.ttft_p50_s,
            1e3 * o.ttft_p99_s,
            1e3 * o.itl_p50_s,
            1e3 * o.itl_p99_s,
            100.0 * o.hit_rate,
            100.0 * o.ideal_hit_rate,
            o.prefill_tokens,
            o.retractions
        );
    }
    if let [with, without] = outcomes {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        out += &format!(
            "radix cache vs none: output throughput ×{:.2}, TTFT p50 ×{:.2} (lower is better), prefill tokens ×{:.2}\n",
            ratio(with.output_tokens_per_s, without.output_tokens_per_s),
            ratio(with.ttft_p50_s, without.ttft_p50_s),
            ratio(with.prefill_tokens as f64, without.prefill_tokens as f64)
        );
    }
    out += &format!("wall time {wall_s:.1} s\n");
    out
}

/// The TTFT distribution of each run as a line chart (x: percentile, y: milliseconds).
pub fn plot(outcomes: &[BenchOutcome], title: &str, path: &std::path::Path) -> Result<()> {
    let percentiles = [10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0];
    let series = outcomes
        .iter()
        .map(|o| {
            let points = percentiles
                .iter()
                .map(|&q| {
                    let mut v = o.ttft_s.clone();
                    (q, 1e3 * scheduler::sim::percentile(&mut v, q / 100.0))
                })
                .collect();
            (o.cache.clone(), points)
        })
        .collect();
    crate::plot::plot_lines(
        &crate::plot::LinePlot {
            title: "Time to first token".into(),
            subtitle: title.into(),
            x_desc: "percentile of requests".into(),
            y_desc: "TTFT (ms)".into(),
            y_percent: false,
            x_log: false,
            series,
        },
        path,
    )
}

/// Parses `--schedule-policy` for the bench (one policy).
pub fn parse_policy(s: &str) -> Result<SchedulePolicy> {
    s.parse().map_err(|e: scheduler::SchedulerError| {
        EngineError::arg("--schedule-policy", e.to_string())
    })
}

/// The default bench setup: the tiny model, a 128k-token pool in pages of 16, SGLang's
/// scheduler defaults with 8k-token chunks, LRU eviction.
pub fn default_setup(context_len: usize) -> EngineSetup {
    EngineSetup {
        model: ModelSource::Tiny,
        capacity_tokens: 1 << 17,
        mem_fraction_static: None,
        kv_dtype: KvDtype::F32,
        scheduler: SchedulerConfig {
            page_size: 16,
            context_len,
            max_running_requests: 256,
            chunked_prefill_size: Some(8192),
            ..SchedulerConfig::default()
        },
        eviction_policy: "lru".into(),
        backend: BackendKind::Cpu,
        threads: 1,
        seed: 0,
    }
}

/// Measures the wall time of `f`.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let t = f();
    (t, start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{sim_requests, Arrivals};
    use crate::workload::GspConfig;

    #[test]
    fn the_cache_saves_prefill_and_both_runs_finish_everything() {
        let w = GspConfig {
            num_groups: 2,
            prompts_per_group: 4,
            system_prompt_len: 128,
            question_len: 16,
            output_len: 8,
            seed: 1,
            vocab_size: 50_000,
        }
        .generate()
        .unwrap();
        let ideal = w.stats(16).ideal_hit_rate();
        let reqs = sim_requests(
            &w,
            Arrivals::Poisson {
                rate: 50.0,
                seed: 2,
            },
        )
        .unwrap();
        let setup = EngineSetup {
            capacity_tokens: 8192,
            ..default_setup(512)
        };
        let with = run_bench(&reqs, &setup, true, ideal, None, &mut |_, _| {}).unwrap();
        let without = run_bench(&reqs, &setup, false, ideal, None, &mut |_, _| {}).unwrap();
        for o in [&with, &without] {
            assert_eq!((o.requests, o.aborted, o.output_tokens), (8, 0, 64));
            assert!(
                o.duration_s > 0.0 && o.output_tokens_per_s > 0.0 && o.ttft_p99_s >= o.ttft_p50_s
            );
            assert_eq!(o.ttft_s.len(), 8);
        }
        assert_eq!(without.cached_tokens, 0);
        assert!(with.cached_tokens > 0 && with.prefill_tokens < without.prefill_tokens);
        assert!(with.hit_rate <= ideal + 1e-9);
        let text = render(&[with, without], 1.0);
        assert!(text.contains("radix cache vs none"), "{text}");
    }
}
