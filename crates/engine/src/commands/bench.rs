//! `kvserve bench`. In process: a workload through the real scheduler, prefix cache and
//! allocator and a real model ([`ModelExecutor`](crate::setup::ModelExecutor) on the chosen backend), timed
//! by the wall clock of every step. Reports throughput (requests/s, input and output tokens/s),
//! TTFT and inter-token latency percentiles, and the cache hit rate against the workload's
//! ideal; `--compare-no-cache` runs the same workload with the radix cache disabled. With
//! `--url`, the same workload against any OpenAI-compatible server (`crate::bench_client`).
//!
//! Before each timed run, `--warmup-requests` (SGLang's `bench_serving`: 1 by default) copies
//! of the workload's first request, with at most [`WARMUP_MAX_OUTPUT`] output tokens, run
//! untimed, so first-use costs (kernel compilation and loading, a device's lazy set-up) stay
//! out of the figures. In process they run on the engine's executor through a scheduler of
//! their own (no prefix cache, no host tier), so the timed run starts from a cold cache; a
//! remote server keeps whatever its cache made of them, as with SGLang's `bench_serving`.

use std::io::Write;
use std::time::Instant;

use scheduler::summary::per_second;
use scheduler::{replay, replay_observed, Clock, ReplayConfig, SimReport, SimRequest};
use serde::Serialize;

use super::{progress_bar, write_out};
use crate::bench_client::{run_remote, RemoteTarget};
use crate::cli::{BenchArgs, WorkloadDefaults};
use crate::engine_metrics::HiCacheMetrics;
use crate::error::{EngineError, Result};
use crate::setup::{build, build_scheduler, EngineSetup};
use crate::sim::sim_requests;
use crate::sim_contiguity::ContiguityOutcome;

/// The figures of one run (a JSON object of `--json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchOutcome {
    /// `radix`, `no-cache`, or `remote` (`--url`).
    pub cache: String,
    /// Requests that finished.
    pub requests: usize,
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
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    pub output_tokens: usize,
    pub retractions: usize,
    pub steps: u64,
    /// With HiCache: the cached tokens per tier (device, host, storage); `None` without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier_hit_tokens: Option<TierHits>,
    /// In process: the allocator's page contiguity (`crate::sim_contiguity`); `None` with
    /// `--url`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub contiguity: Option<ContiguityOutcome>,
    /// Every request's TTFT, sorted.
    #[serde(skip)]
    pub ttft_s: Vec<f64>,
}

/// Cached prompt tokens by the tier they came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierHits {
    /// Matched on device.
    pub device: u64,
    /// Loaded back from the host tier.
    pub host: u64,
    /// Loaded back after an L3 prefetch brought them to the host tier.
    pub storage: u64,
}

impl BenchOutcome {
    /// The figures of a run from its report; `cache` labels it (`radix`, `no-cache`, `remote`).
    pub fn new(cache: &str, r: SimReport, ideal_hit_rate: f64) -> Self {
        BenchOutcome {
            cache: cache.into(),
            requests: r.requests,
            aborted: r.aborted,
            duration_s: r.duration_s,
            requests_per_s: per_second(r.requests, r.duration_s),
            input_tokens_per_s: per_second(r.prompt_tokens, r.duration_s),
            output_tokens_per_s: per_second(r.output_tokens, r.duration_s),
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
            tier_hit_tokens: None,
            contiguity: None,
            ttft_s: r.ttft_s,
        }
    }
}

/// Output tokens a warmup request generates at most.
pub const WARMUP_MAX_OUTPUT: usize = 16;

/// `n` warmup requests: the first request to arrive (its prompt), generating at most
/// [`WARMUP_MAX_OUTPUT`] tokens, all arriving at once. None for an empty workload.
pub fn warmup_requests(requests: &[SimRequest], n: usize) -> Vec<SimRequest> {
    let first = requests
        .iter()
        .min_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    first.map_or_else(Vec::new, |r| {
        vec![
            SimRequest {
                prompt: r.prompt.clone(),
                output_len: r.output_len.clamp(1, WARMUP_MAX_OUTPUT),
                arrival_s: 0.0,
            };
            n
        ]
    })
}

/// Runs the workload once, with the radix cache (`radix`) or without, after `warmup` untimed
/// requests ([`warmup_requests`]) through a scheduler of their own over the same executor.
pub fn run_bench(
    requests: &[SimRequest],
    setup: &EngineSetup,
    radix: bool,
    ideal_hit_rate: f64,
    max_concurrency: Option<usize>,
    warmup: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<BenchOutcome> {
    let (mut sched, mut exec) = build(setup, radix)?;
    let warm = warmup_requests(requests, warmup);
    if !warm.is_empty() {
        // Its own allocator over the same pool size: the slots it writes are free in the
        // bench's scheduler, whose requests write them before reading them.
        let mut warm_sched = build_scheduler(
            setup.scheduler.clone(),
            false,
            &setup.eviction_policy,
            sched.allocator().size(),
            None,
            false,
        )?;
        let config = ReplayConfig {
            clock: Clock::Wall,
            max_concurrency: None,
        };
        let report = replay(&warm, &mut warm_sched, &mut exec, config, &mut |_, _| {})
            .map_err(|e| EngineError::Simulation(format!("warmup: {e}")))?;
        if report.requests != warm.len() {
            return Err(EngineError::Simulation(format!(
                "warmup: {} of {} requests finished ({} aborted)",
                report.requests,
                warm.len(),
                report.aborted
            )));
        }
    }
    let config = ReplayConfig {
        clock: Clock::Wall,
        max_concurrency,
    };
    let probe = crate::sim_contiguity::probe(setup.scheduler.page_size);
    let report = replay_observed(
        requests,
        &mut sched,
        &mut probe.executor(&mut exec),
        config,
        progress,
        &mut |s, step, now| probe.observe(s, step, now),
    )
    .map_err(|e| EngineError::Simulation(e.to_string()))?;
    sched
        .check_invariants()
        .map_err(|message| EngineError::CheckFailed {
            after: "the bench".into(),
            message,
        })?;
    let mut outcome = BenchOutcome::new(
        if radix { "radix" } else { "no-cache" },
        report,
        ideal_hit_rate,
    );
    outcome.contiguity = Some(ContiguityOutcome::new(
        kv_pool::AnyAllocator::name_for_page_size(setup.scheduler.page_size),
        &probe.report(),
    ));
    outcome.tier_hit_tokens = HiCacheMetrics::of(&sched).map(|h| TierHits {
        device: h.device_hit_tokens,
        host: h.host_hit_tokens,
        storage: h.storage_hit_tokens,
    });
    Ok(outcome)
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
        if let Some(c) = &o.contiguity {
            out += &format!("[{}] {c}\n", o.cache);
        }
        if let Some(t) = o.tier_hit_tokens {
            out += &format!(
                "[{}] cached tokens by tier: device {} | host {} | storage {}\n",
                o.cache, t.device, t.host, t.storage
            );
        }
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

/// Measures the wall time of `f`.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let t = f();
    (t, start.elapsed().as_secs_f64())
}

/// `kvserve bench`.
pub fn bench(args: &BenchArgs, out: &mut dyn Write) -> Result<()> {
    let workload = args.source.load(WorkloadDefaults::BENCH)?;
    let arrivals = args.arrivals.arrivals(&args.source, Some(16.0))?;
    let requests = sim_requests(&workload, arrivals)?;
    let stats = workload.stats(args.engine.page_size);
    let longest = workload.longest_request();
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
            let bar = progress_bar(
                args.quiet,
                requests.len() as u64,
                &format!(
                    "{label:<8} {{elapsed_precise}} [{{bar:40}}] {{human_pos}}/{{human_len}} requests"
                ),
            );
            let ideal = stats.ideal_hit_rate();
            let r = match (radix, &args.url) {
                (Some(radix), _) => run_bench(
                    &requests,
                    &setup,
                    radix,
                    ideal,
                    max_concurrency,
                    args.warmup_requests,
                    &mut |done, _| bar.set_position(done as u64),
                ),
                (None, url) => {
                    let target = RemoteTarget {
                        url: url.clone().unwrap_or_default(),
                        model: args.model.clone(),
                        api_key: args.api_key.clone(),
                    };
                    let warm = warmup_requests(&requests, args.warmup_requests);
                    run_remote(&requests, &warm, &target, max_concurrency, &|done, _| {
                        bar.set_position(done as u64)
                    })
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
    write_out(out, &text)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::default_setup;
    use crate::sim::Arrivals;
    use crate::workload::GspConfig;

    #[test]
    fn warmup_requests_copy_the_first_arrival_with_a_short_output() {
        let req = |p: u32, out: usize, at: f64| SimRequest {
            prompt: vec![p; 4],
            output_len: out,
            arrival_s: at,
        };
        let reqs = [req(1, 100, 0.5), req(2, 3, 0.1), req(3, 0, 0.9)];
        let warm = warmup_requests(&reqs, 2);
        assert_eq!(warm, vec![req(2, 3, 0.0), req(2, 3, 0.0)]);
        assert_eq!(
            warmup_requests(&reqs[..1], 1),
            vec![req(1, WARMUP_MAX_OUTPUT, 0.0)]
        );
        assert_eq!(warmup_requests(&reqs[2..], 1), vec![req(3, 1, 0.0)]);
        assert!(warmup_requests(&reqs, 0).is_empty());
        assert!(warmup_requests(&[], 3).is_empty());
    }

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
        let with = run_bench(&reqs, &setup, true, ideal, None, 1, &mut |_, _| {}).unwrap();
        let without = run_bench(&reqs, &setup, false, ideal, None, 0, &mut |_, _| {}).unwrap();
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
        // Every finished request's pages were measured, in at least one run each.
        let c = with.contiguity.as_ref().expect("in process");
        assert_eq!(c.measured_requests, 8);
        assert!(c.runs_per_request >= 1.0 && c.page_table_runs <= c.page_table_pages);
        let text = render(&[with, without], 1.0);
        assert!(text.contains("radix cache vs none"), "{text}");
        assert!(text.contains("[radix] allocator paged:"), "{text}");
    }
}
