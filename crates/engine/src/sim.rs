//! `kvserve sim`: a workload through the real scheduler, prefix cache and allocator, with the
//! scheduler's cost-model executor on a simulated clock (see `scheduler::sim`). Sweeps schedule
//! policies × eviction policies × pool sizes; each configuration is one [`SimOutcome`].
//!
//! With a host tier ([`SimConfig::tier`], `--enable-hierarchical-cache`) the radix tree gets a
//! simulated host tier and L3 store (`crate::sim_tier`): the scheduler loads host hits back at
//! admission and prefetches from L3 at arrival as it does when serving, and the cost model
//! charges each pass its load-back bytes at the accelerator's host link (overlapped with the
//! pass) and its L3 bytes at the storage bandwidth (added); see `scheduler::sim`. The outcome
//! then reports the hit tokens per tier.

use std::time::Instant;

use kv_pool::rng::SplitMix64;
use scheduler::{
    replay_observed, Clock, CostModel, ReplayConfig, SchedulePolicy, SchedulerConfig, SimExecutor,
    SimReport, SimRequest,
};
use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::setup::components::build_scheduler_with;
use crate::setup::components::TreeTier;
use crate::setup::pool::whole_pages;
use crate::sim_contiguity::{AllocatorChoice, ContiguityOutcome};
use crate::sim_tier::{SimController, SimTier};
use crate::workload::Workload;

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// The workload's own times (a trace's timestamps), divided by a speed factor.
    Trace {
        /// Speed factor (2 = twice as fast).
        speed: f64,
    },
    /// A Poisson process at `rate` requests per second (seeded), in workload order.
    Poisson {
        /// Requests per second.
        rate: f64,
        /// Seed of the inter-arrival times.
        seed: u64,
    },
    /// Everything at time 0.
    Burst,
}

/// Turns a workload into timed simulator requests.
pub fn sim_requests(workload: &Workload, arrivals: Arrivals) -> Result<Vec<SimRequest>> {
    let mut rng = match arrivals {
        Arrivals::Poisson { rate, seed } => {
            if !(rate.is_finite() && rate > 0.0) {
                return Err(EngineError::arg(
                    "--request-rate",
                    format!("{rate} is not a positive rate"),
                ));
            }
            Some(SplitMix64::new(seed))
        }
        Arrivals::Trace { speed } if !(speed.is_finite() && speed > 0.0) => {
            return Err(EngineError::arg(
                "--speed",
                format!("{speed} is not a positive factor"),
            ));
        }
        _ => None,
    };
    let mut t = 0.0;
    Ok(workload
        .requests
        .iter()
        .map(|r| {
            let arrival_s = match arrivals {
                Arrivals::Trace { speed } => r.arrival_s / speed,
                Arrivals::Poisson { rate, .. } => {
                    let rng = rng.as_mut().expect("seeded");
                    // Exponential inter-arrival: −ln(1 − U) / rate with U in [0, 1).
                    let u = rng.next_f64();
                    t += -(1.0 - u).ln() / rate;
                    t
                }
                Arrivals::Burst => 0.0,
            };
            SimRequest {
                prompt: r.tokens.clone(),
                output_len: r.output_len.max(1),
                arrival_s,
            }
        })
        .collect())
}

/// One configuration of a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Scheduler settings (policy, page size, budgets…).
    pub scheduler: SchedulerConfig,
    /// Eviction policy of the radix cache (ignored with `radix = false`).
    pub eviction_policy: String,
    /// Whether the radix cache is on (`--disable-radix-cache` turns it off).
    pub radix: bool,
    /// KV pool size in tokens.
    pub capacity_tokens: usize,
    pub cost: CostModel,
    /// `--max-concurrency`: requests in flight at most (`None`: no limit).
    pub max_concurrency: Option<usize>,
    /// A simulated host tier (and L3 store) behind the radix tree.
    pub tier: Option<SimTier>,
    /// `--allocator`: this policy, with its contiguity measured (`None`: SGLang's choice by
    /// page size, unmeasured).
    pub allocator: Option<AllocatorChoice>,
}

/// The figures of one configuration (the JSON line of `--format json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimOutcome {
    /// `--schedule-policy`.
    pub schedule_policy: String,
    /// `--radix-eviction-policy` (or `disabled`).
    pub eviction_policy: String,
    /// KV pool size in tokens.
    pub capacity_tokens: usize,
    pub page_size: u32,
    /// Requests that finished.
    pub requests: usize,
    pub aborted: usize,
    /// Cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache.
    pub cached_tokens: usize,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    pub output_tokens: usize,
    /// Generated tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// Time to first token, median.
    pub ttft_p50_s: f64,
    /// Time to first token, 99th percentile.
    pub ttft_p99_s: f64,
    /// Inter-token latency, median.
    pub itl_p50_s: f64,
    /// Inter-token latency, 99th percentile.
    pub itl_p99_s: f64,
    pub retractions: usize,
    /// Highest pool use in tokens.
    pub peak_used_tokens: usize,
    pub simulated_s: f64,
    pub steps: u64,
    /// Wall time of the simulation.
    pub seconds: f64,
    /// With a host tier: the hits per tier (their fields join the JSON line; absent without).
    #[serde(flatten)]
    pub tiers: Option<SimTierHits>,
    /// With `--allocator`: the allocator and its contiguity figures (joined to the JSON line).
    #[serde(flatten)]
    pub contiguity: Option<ContiguityOutcome>,
}

/// A simulation's prompt tokens served per tier (`cached_tokens` = device + host + storage).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimTierHits {
    /// Host tier size in tokens.
    pub host_capacity_tokens: usize,
    /// Served from the device pool (matched there).
    pub device_hit_tokens: usize,
    /// Loaded back from the host tier (not counting storage hits).
    pub host_hit_tokens: usize,
    /// Prefetched from L3 storage (then loaded back).
    pub storage_hit_tokens: usize,
}

impl SimOutcome {
    fn new(
        cfg: &SimConfig,
        r: &SimReport,
        seconds: f64,
        host_slots: Option<usize>,
        contiguity: Option<ContiguityOutcome>,
    ) -> Self {
        SimOutcome {
            schedule_policy: cfg.scheduler.schedule_policy.to_string(),
            eviction_policy: if cfg.radix {
                cfg.eviction_policy.clone()
            } else {
                "disabled".into()
            },
            capacity_tokens: cfg.capacity_tokens,
            page_size: cfg.scheduler.page_size,
            requests: r.requests,
            aborted: r.aborted,
            hit_rate: r.hit_rate,
            prompt_tokens: r.prompt_tokens,
            cached_tokens: r.cached_tokens,
            prefill_tokens: r.prefill_tokens,
            output_tokens: r.output_tokens,
            output_tokens_per_s: r.output_tokens_per_s,
            ttft_p50_s: r.ttft_p50_s,
            ttft_p99_s: r.ttft_p99_s,
            itl_p50_s: r.itl_p50_s,
            itl_p99_s: r.itl_p99_s,
            retractions: r.retractions,
            peak_used_tokens: r.peak_used_tokens,
            simulated_s: r.duration_s,
            steps: r.steps,
            seconds,
            tiers: host_slots.map(|host| {
                let storage = r.storage_hit_tokens.min(r.host_hit_tokens);
                SimTierHits {
                    host_capacity_tokens: host,
                    // A load-back counts when it runs; a request rejected after it counts the
                    // same tokens as a device hit when admitted, so keep the split in range.
                    device_hit_tokens: r.cached_tokens.saturating_sub(r.host_hit_tokens),
                    host_hit_tokens: r.host_hit_tokens - storage,
                    storage_hit_tokens: storage,
                }
            }),
            contiguity,
        }
    }
}

/// Runs one configuration.
pub fn run_one(
    requests: &[SimRequest],
    cfg: &SimConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimOutcome> {
    let p = cfg.scheduler.page_size;
    let capacity = whole_pages(cfg.capacity_tokens, p)?;
    let (tier, host_slots) = match &cfg.tier {
        None => (None, None),
        Some(_) if !cfg.radix => {
            return Err(EngineError::arg(
                "--enable-hierarchical-cache",
                "the host tier keeps radix-tree nodes: it cannot be used with \
                 --disable-radix-cache",
            ))
        }
        Some(t) => {
            // SGLang sizes each rank's host pool with the rank's share of a token's KV.
            let per_rank = (cfg.cost.model.kv_bytes_per_token / cfg.cost.tp as usize).max(1);
            let host = t.host_slots(capacity, p, Some(per_rank))?;
            let tier = TreeTier {
                config: t.setup.tree_config(host),
                controller: Box::new(SimController::new(t.has_storage())),
            };
            (Some(tier), Some(host))
        }
    };
    let mut sched_cfg = cfg.scheduler.clone();
    let alloc = match cfg.allocator {
        None => kv_pool::AnyAllocator::for_page_size(capacity, p)?,
        Some(choice) => {
            let (alloc, need_sort) = choice.build(capacity, p)?;
            sched_cfg.need_sort |= need_sort;
            alloc
        }
    };
    let mut sched = build_scheduler_with(
        sched_cfg,
        cfg.radix,
        &cfg.eviction_policy,
        alloc,
        tier,
        false,
    )?;
    let mut sim = SimExecutor {
        cost: cfg.cost.clone(),
    };
    let start = Instant::now();
    let replay_cfg = ReplayConfig {
        clock: Clock::Charged,
        max_concurrency: cfg.max_concurrency,
    };
    let probe = crate::sim_contiguity::probe(p);
    let report = if cfg.allocator.is_some() {
        let mut exec = probe.executor(&mut sim);
        replay_observed(
            requests,
            &mut sched,
            &mut exec,
            replay_cfg,
            progress,
            &mut |s, step, now| probe.observe(s, step, now),
        )
    } else {
        replay_observed(
            requests,
            &mut sched,
            &mut sim,
            replay_cfg,
            progress,
            &mut |_, _, _| {},
        )
    }
    .map_err(sched_err)?;
    let contiguity = cfg
        .allocator
        .map(|choice| ContiguityOutcome::new(choice.name(), &probe.report()));
    let cfg = SimConfig {
        capacity_tokens: capacity,
        ..cfg.clone()
    };
    Ok(SimOutcome::new(
        &cfg,
        &report,
        start.elapsed().as_secs_f64(),
        host_slots,
        contiguity,
    ))
}

fn sched_err(e: scheduler::SchedulerError) -> EngineError {
    match e {
        scheduler::SchedulerError::InvalidConfig { field, reason } => {
            EngineError::arg(field, reason)
        }
        other => EngineError::Simulation(other.to_string()),
    }
}

/// Runs every configuration, `jobs` at a time on threads; results in configuration order.
pub fn run_sweep(
    requests: &[SimRequest],
    configs: &[SimConfig],
    jobs: usize,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Vec<SimOutcome>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<SimOutcome>>>> =
        configs.iter().map(|_| Default::default()).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, configs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(cfg) = configs.get(i) else { break };
                let mut last = 0;
                let r = run_one(requests, cfg, &mut |done, _| {
                    progress(done - last);
                    last = done;
                });
                *results[i].lock().expect("no panics hold the lock") = Some(r);
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .expect("no panics hold the lock")
                .expect("every configuration ran")
        })
        .collect()
}

/// An aligned table of outcomes.
pub fn render_table(outcomes: &[SimOutcome], timings: bool) -> String {
    let mut rows = vec![vec![
        "schedule".to_string(),
        "eviction".into(),
        "capacity".into(),
        "hit_rate".into(),
        "prefill_tok".into(),
        "out_tok/s".into(),
        "ttft_p50".into(),
        "ttft_p99".into(),
        "itl_p50".into(),
        "itl_p99".into(),
        "retract".into(),
        "aborted".into(),
        "peak_pool".into(),
    ]];
    // With a host tier, the prompt tokens served per tier (the columns appear only then).
    let tiered = outcomes.iter().any(|o| o.tiers.is_some());
    if tiered {
        rows[0].extend(["host_pool", "device_hit", "host_hit", "storage_hit"].map(String::from));
    }
    // With --allocator, which one (the contiguity table has its figures).
    let measured = outcomes.iter().any(|o| o.contiguity.is_some());
    if measured {
        rows[0].push("allocator".into());
    }
    if timings {
        rows[0].push("wall_s".into());
    }
    for o in outcomes {
        let mut row = vec![
            o.schedule_policy.clone(),
            o.eviction_policy.clone(),
            o.capacity_tokens.to_string(),
            format!("{:.2}%", 100.0 * o.hit_rate),
            o.prefill_tokens.to_string(),
            format!("{:.0}", o.output_tokens_per_s),
            format!("{:.3}s", o.ttft_p50_s),
            format!("{:.3}s", o.ttft_p99_s),
            format!("{:.4}s", o.itl_p50_s),
            format!("{:.4}s", o.itl_p99_s),
            o.retractions.to_string(),
            o.aborted.to_string(),
            o.peak_used_tokens.to_string(),
        ];
        if tiered {
            match &o.tiers {
                Some(t) => row.extend([
                    t.host_capacity_tokens.to_string(),
                    t.device_hit_tokens.to_string(),
                    t.host_hit_tokens.to_string(),
                    t.storage_hit_tokens.to_string(),
                ]),
                None => row.extend(["-"; 4].map(String::from)),
            }
        }
        if measured {
            let name = o.contiguity.as_ref().map(|c| c.allocator.as_str());
            row.push(name.unwrap_or("-").to_string());
        }
        if timings {
            row.push(format!("{:.2}", o.seconds));
        }
        rows.push(row);
    }
    crate::report::align_rows(&rows, &[0, 1])
}

/// Parses a comma-separated list of schedule policies.
pub fn parse_schedule_policies(s: &str) -> Result<Vec<SchedulePolicy>> {
    s.split(',')
        .map(|p| {
            p.trim()
                .parse::<SchedulePolicy>()
                .map_err(|e| EngineError::arg("--schedule-policy", e.to_string()))
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::workload::{GspConfig, Request};
    use scheduler::{Accelerator, ModelShape};

    fn gsp() -> Workload {
        GspConfig {
            num_groups: 4,
            prompts_per_group: 4,
            system_prompt_len: 256,
            question_len: 32,
            output_len: 16,
            seed: 1,
            vocab_size: 32_000,
        }
        .generate()
        .unwrap()
    }

    /// One instance's settings for the tests (also `sim_dp`'s clusters).
    pub(crate) fn config(policy: SchedulePolicy, capacity: usize) -> SimConfig {
        SimConfig {
            scheduler: SchedulerConfig {
                page_size: 16,
                context_len: 4096,
                max_running_requests: 64,
                schedule_policy: policy,
                strict: true,
                ..SchedulerConfig::default()
            },
            eviction_policy: "lru".into(),
            radix: true,
            capacity_tokens: capacity,
            cost: CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1),
            max_concurrency: None,
            tier: None,
            allocator: None,
        }
    }

    #[test]
    fn arrivals() {
        let mut w = gsp();
        w.requests.truncate(3);
        w.requests[1].arrival_s = 4.0;
        let t = sim_requests(&w, Arrivals::Trace { speed: 2.0 }).unwrap();
        assert_eq!(t[1].arrival_s, 2.0);
        let p = sim_requests(
            &w,
            Arrivals::Poisson {
                rate: 10.0,
                seed: 3,
            },
        )
        .unwrap();
        assert!(
            p[0].arrival_s > 0.0
                && p[0].arrival_s < p[1].arrival_s
                && p[1].arrival_s < p[2].arrival_s
        );
        assert_eq!(
            p,
            sim_requests(
                &w,
                Arrivals::Poisson {
                    rate: 10.0,
                    seed: 3
                }
            )
            .unwrap(),
            "seeded"
        );
        assert!(sim_requests(&w, Arrivals::Burst)
            .unwrap()
            .iter()
            .all(|r| r.arrival_s == 0.0));
        assert!(sim_requests(&w, Arrivals::Poisson { rate: 0.0, seed: 3 }).is_err());
        assert!(sim_requests(&w, Arrivals::Trace { speed: -1.0 }).is_err());
    }

    #[test]
    fn sweep_reports_the_workloads_reuse() {
        let w = gsp();
        // Spaced arrivals: each request comes after the previous one's prefill (in a burst
        // they would all share one prefill batch, before anything is cached).
        let reqs = sim_requests(&w, Arrivals::Poisson { rate: 2.0, seed: 1 }).unwrap();
        let configs = vec![
            config(SchedulePolicy::Fcfs, 1 << 16),
            config(SchedulePolicy::Lpm, 1 << 16),
        ];
        let out = run_sweep(&reqs, &configs, 2, &|_| {}).unwrap();
        for o in &out {
            assert_eq!((o.requests, o.aborted), (16, 0));
            assert_eq!(o.output_tokens, 16 * 16);
            // With room for everything, 12 of 16 requests reuse a 256-token system prompt.
            assert_eq!(o.cached_tokens, 12 * 256, "{o:?}");
            assert!(o.ttft_p99_s >= o.ttft_p50_s && o.itl_p50_s > 0.0);
        }
        let table = render_table(&out, false);
        assert!(
            table.starts_with("schedule  eviction  capacity  hit_rate"),
            "{table}"
        );
        assert_eq!(table.lines().count(), 3);
    }

    /// A pool that holds about one group's prefix: with a host tier the evicted system prompts
    /// come back from host instead of being recomputed, and the cost model charges the
    /// load-backs (the run is not free: its passes are at least as long as the compute).
    #[test]
    fn a_host_tier_serves_what_the_pool_cannot_hold() {
        use radix_cache::tiers::WritePolicy;
        let w = gsp();
        let reqs = sim_requests(&w, Arrivals::Poisson { rate: 2.0, seed: 1 }).unwrap();
        let plain = run_one(&reqs, &config(SchedulePolicy::Fcfs, 512), &mut |_, _| {}).unwrap();
        assert_eq!(plain.tiers, None);
        let json = serde_json::to_value(&plain).unwrap();
        assert!(
            json.get("host_hit_tokens").is_none(),
            "no tier fields without a tier"
        );
        for policy in WritePolicy::ALL {
            let cfg = SimConfig {
                tier: Some(SimTier::with_policy(policy, 4.0, None)),
                ..config(SchedulePolicy::Fcfs, 512)
            };
            let o = run_one(&reqs, &cfg, &mut |_, _| {}).unwrap();
            let t = o.tiers.clone().expect("tiered");
            assert_eq!((o.requests, o.aborted), (16, 0), "{policy}");
            assert_eq!(t.host_capacity_tokens, 2064);
            assert_eq!(
                o.cached_tokens,
                t.device_hit_tokens + t.host_hit_tokens + t.storage_hit_tokens
            );
            assert!(t.host_hit_tokens > 0, "{policy}: {o:?}");
            assert!(o.cached_tokens > plain.cached_tokens, "{policy}: {o:?}");
            assert_eq!(o.prefill_tokens, o.prompt_tokens - o.cached_tokens);
            let json = serde_json::to_value(&o).unwrap();
            assert_eq!(json["host_hit_tokens"], t.host_hit_tokens);
        }
        // Every loaded-back and prefetched token reaches the executor on some pass, so the cost
        // model charges each once.
        struct Tally(SimExecutor, usize, usize);
        impl scheduler::Executor for Tally {
            fn forward(
                &mut self,
                batch: &scheduler::ForwardBatch,
                rows: &kv_pool::ReqToTokenPool,
            ) -> std::result::Result<scheduler::BatchResult, String> {
                self.1 += batch.load_back_tokens;
                self.2 += batch.prefetch_tokens;
                self.0.forward(batch, rows)
            }
        }
        let base = config(SchedulePolicy::Fcfs, 512);
        let tier = SimTier::with_policy(
            WritePolicy::WriteThrough,
            2.0,
            Some(hicache::storage::StorageKind::File),
        );
        let host = tier.host_slots(512, 16, None).unwrap();
        let tree_tier = TreeTier {
            config: tier.setup.tree_config(host),
            controller: Box::new(SimController::new(true)),
        };
        let mut sched = crate::setup::build_scheduler(
            base.scheduler.clone(),
            true,
            "lru",
            512,
            Some(tree_tier),
            false,
        )
        .unwrap();
        let mut exec = Tally(SimExecutor { cost: base.cost }, 0, 0);
        let r = scheduler::simulate(&reqs, &mut sched, &mut exec, &mut |_, _| {}).unwrap();
        assert!(
            r.tiered && r.host_hit_tokens > 0 && r.storage_hit_tokens > 0,
            "{r}"
        );
        assert_eq!((exec.1, exec.2), (r.host_hit_tokens, r.storage_hit_tokens));

        // The chunk cache has no nodes to keep in host.
        let cfg = SimConfig {
            radix: false,
            tier: Some(SimTier::with_policy(WritePolicy::WriteBack, 2.0, None)),
            ..config(SchedulePolicy::Fcfs, 512)
        };
        assert!(run_one(&reqs, &cfg, &mut |_, _| {}).is_err());
    }

    /// Under load a load-back must leave room for what this pass already admitted: its quota
    /// is the prefill budget's `rem_total_tokens` (which counts the requests admitted before
    /// it) minus the request's own need. With `available + evictable − need` the load-back
    /// evicted the slots they were promised and `prepare_for_extend` failed with "out of KV
    /// memory: requested 544 tokens, 512 available".
    #[test]
    fn a_load_back_leaves_room_for_the_requests_admitted_before_it() {
        use radix_cache::tiers::WritePolicy;
        let w = GspConfig {
            num_groups: 4,
            prompts_per_group: 4,
            system_prompt_len: 512,
            question_len: 32,
            output_len: 32,
            seed: 1,
            vocab_size: 32_000,
        }
        .generate()
        .unwrap();
        let reqs = sim_requests(&w, Arrivals::Poisson { rate: 8.0, seed: 1 }).unwrap();
        let cfg = SimConfig {
            tier: Some(SimTier::with_policy(WritePolicy::WriteThrough, 2.0, None)),
            ..config(SchedulePolicy::Fcfs, 1024)
        };
        let o = run_one(&reqs, &cfg, &mut |_, _| {});
        assert!(o.is_ok(), "{o:?}");
    }

    #[test]
    fn a_tiny_pool_is_an_error_and_oversized_requests_abort() {
        let w = Workload {
            name: "t".into(),
            requests: vec![Request {
                tokens: (0..200).collect(),
                output_len: 4,
                arrival_s: 0.0,
            }],
        };
        let reqs = sim_requests(&w, Arrivals::Burst).unwrap();
        assert!(matches!(
            run_one(&reqs, &config(SchedulePolicy::Fcfs, 8), &mut |_, _| {}),
            Err(EngineError::InvalidArgument { .. })
        ));
        let o = run_one(&reqs, &config(SchedulePolicy::Fcfs, 128), &mut |_, _| {}).unwrap();
        assert_eq!((o.requests, o.aborted), (0, 1));
    }
}
