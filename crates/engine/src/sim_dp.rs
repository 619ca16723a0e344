//! `kvserve sim --dp N --router-policy …`: a cluster of N simulated instances (data-parallel
//! replicas, each with its own scheduler, radix cache, allocator and cost-model executor)
//! behind the router's real load-balancing policies (`router::policies`, the same trait
//! objects `kvserve router` runs). Per policy and N: hit rate, TTFT, inter-token latency and
//! output throughput of the whole cluster.
//!
//! The replay is a discrete-event loop over one simulated clock per instance:
//! - the busy instance whose clock is earliest steps first (one scheduler step, its clock
//!   advanced by the cost model's charge), as long as its clock is before the next arrival;
//! - otherwise the next request arrives: the policy picks an instance from the prompt's
//!   tokens and every instance's load (the requests routed to it and not finished, as the
//!   router counts in flight), and the request joins that instance's waiting queue (an idle
//!   instance's clock jumps to the arrival).
//!
//! With `kv_events` the instances' radix caches record their KV events and each step's
//! events are applied at once to the policy's [`KvIndex`] under the instance's id (the wire
//! and its delay are left out: a real router sees them a few milliseconds later).
//! `cache_aware`'s periodic trim runs every `--eviction-interval` simulated seconds.
//!
//! An instance that cannot make progress (a step that runs nothing, three times, with no
//! request left to arrive) is a [`EngineError::Simulation`] error, never a hang.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use clap::Args;
use scheduler::summary::{RunSummary, RunTotals};
use scheduler::{ReqId, SamplingLimits, SimExecutor, SimRequest};
use serde::Serialize;

use crate::error::{EngineError, Result};
use crate::router::policies::{self, Candidate, KvIndex, LoadBalancingPolicy, Prompt, WorkerId};
use crate::router::{CacheAwareConfig, PolicyKind};
use crate::setup::build_scheduler;
use crate::setup::pool::whole_pages;
use crate::sim::SimConfig;

/// The flags of `kvserve sim` that put a router in front of N instances.
#[derive(Debug, Clone, Args)]
pub struct DpArgs {
    /// Simulate a cluster of N instances (data-parallel replicas, each with the pool and
    /// scheduler settings above) behind the router; comma-separated to compare sizes.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "N,M,...",
        value_parser = clap::value_parser!(u32).range(1..=1024),
        help_heading = "Router (--dp)"
    )]
    pub dp: Vec<u32>,
    /// The router's policies to compare (comma-separated): random, round_robin,
    /// power_of_two, cache_aware, kv_events (default: all five).
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "P1,P2,...",
        help_heading = "Router (--dp)"
    )]
    pub router_policy: Vec<PolicyKind>,
    /// Seed of the policies' random choices.
    #[arg(long, default_value_t = 0, help_heading = "Router (--dp)")]
    pub router_seed: u64,
    /// `cache_aware`: the matched share of the prompt above which the match decides.
    #[arg(long, default_value_t = 0.3, help_heading = "Router (--dp)")]
    pub cache_threshold: f32,
    /// `cache_aware`, `kv_events`: imbalanced only if max − min load exceeds this.
    #[arg(long, default_value_t = 64, help_heading = "Router (--dp)")]
    pub balance_abs_threshold: usize,
    /// `cache_aware`, `kv_events`: imbalanced only if max load exceeds this × min load.
    #[arg(long, default_value_t = 1.5, help_heading = "Router (--dp)")]
    pub balance_rel_threshold: f32,
    /// `cache_aware`: simulated seconds between trims of the tree.
    #[arg(long, default_value_t = 120, help_heading = "Router (--dp)")]
    pub eviction_interval: u64,
    /// `cache_aware`: symbols kept per worker after a trim.
    #[arg(long, default_value_t = 1 << 26, help_heading = "Router (--dp)")]
    pub max_tree_size: usize,
}

impl DpArgs {
    /// The policies to compare (all five when none is given).
    pub fn policies(&self) -> Vec<PolicyKind> {
        if self.router_policy.is_empty() {
            vec![
                PolicyKind::Random,
                PolicyKind::RoundRobin,
                PolicyKind::PowerOfTwo,
                PolicyKind::CacheAware,
                PolicyKind::KvEvents,
            ]
        } else {
            self.router_policy.clone()
        }
    }

    /// `cache_aware`'s settings, checked ([`CacheAwareConfig::checked`]).
    pub fn cache_aware(&self) -> Result<CacheAwareConfig> {
        CacheAwareConfig {
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            eviction_interval_secs: self.eviction_interval,
            max_tree_size: self.max_tree_size,
        }
        .checked()
    }
}

/// One cluster to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct DpConfig {
    /// Every instance's settings (pool size per instance); no host tier.
    pub instance: SimConfig,
    /// Instances.
    pub dp: usize,
    /// The router's policy.
    pub policy: PolicyKind,
    /// `cache_aware`'s settings (`kv_events` takes its balance thresholds).
    pub cache_aware: CacheAwareConfig,
    /// Seed of the policy's random choices.
    pub seed: u64,
}

/// The figures of one cluster (the JSON line of `--format json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DpOutcome {
    /// `--router-policy`.
    pub router_policy: String,
    /// Instances.
    pub dp: usize,
    /// `--schedule-policy`.
    pub schedule_policy: String,
    /// `--radix-eviction-policy`.
    pub eviction_policy: String,
    /// KV pool size of each instance in tokens.
    pub capacity_tokens: usize,
    /// Requests that finished.
    pub requests: usize,
    pub aborted: usize,
    /// Cached prompt tokens / prompt tokens, over all instances.
    pub hit_rate: f64,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Generated tokens per simulated second, the whole cluster.
    pub output_tokens_per_s: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    /// Requests routed to each instance.
    pub routed: Vec<usize>,
    /// Simulated seconds from the first arrival to the last token.
    pub simulated_s: f64,
    /// Wall time of the simulation.
    pub seconds: f64,
}

/// One simulated instance and its request timings.
struct Instance {
    sched: scheduler::Scheduler<radix_cache::AnyPrefixCache, kv_pool::AnyAllocator>,
    exec: SimExecutor,
    now: f64,
    /// Each request in flight: when it arrived and when it last produced a token.
    timing: HashMap<ReqId, (f64, Option<f64>)>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    requests: usize,
    aborted: usize,
    routed: usize,
    stalled: u32,
}

impl Instance {
    /// Runs one step; the KV events it produced.
    fn step(&mut self, next_arrival: Option<f64>) -> Result<Vec<radix_cache::KvEvent>> {
        self.sched.set_time(self.now);
        let step = self
            .sched
            .step(&mut self.exec)
            .map_err(|e| EngineError::Simulation(e.to_string()))?;
        self.now += step.elapsed_s;
        if step.mode.is_some() {
            for e in step.entries.iter().filter(|e| !e.middle_chunk) {
                if let Some((arrival, last)) = self.timing.get_mut(&e.id) {
                    match last {
                        None => self.ttft.push(self.now - *arrival),
                        Some(t) => self.itl.push(self.now - *t),
                    }
                    *last = Some(self.now);
                }
            }
        }
        self.stalled = if step.mode.is_none() && step.finished.is_empty() {
            self.stalled + 1
        } else {
            0
        };
        for f in self.sched.take_finished() {
            self.timing.remove(&f.id);
            match f.reason {
                scheduler::FinishReason::Abort { .. } => self.aborted += 1,
                _ => self.requests += 1,
            }
        }
        if step.mode.is_none() {
            match next_arrival {
                // Nothing ran: nothing changes before the next arrival.
                Some(t) => self.now = self.now.max(t),
                None if self.stalled > 2 => {
                    return Err(EngineError::Simulation(format!(
                        "an instance stalled with {} requests waiting",
                        self.sched.num_waiting()
                    )))
                }
                None => {}
            }
        }
        Ok(self.sched.take_cache_events())
    }
}

/// Simulates one cluster.
pub fn run_dp(requests: &[SimRequest], cfg: &DpConfig) -> Result<DpOutcome> {
    if cfg.dp == 0 {
        return Err(EngineError::arg("--dp", "at least one instance"));
    }
    if cfg.instance.tier.is_some() {
        return Err(EngineError::arg(
            "--enable-hierarchical-cache",
            "the cluster simulation (--dp) has no host tier",
        ));
    }
    if cfg.instance.allocator.is_some() {
        return Err(EngineError::arg(
            "--allocator",
            "the cluster simulation (--dp) measures no allocator contiguity; run it without --dp",
        ));
    }
    let sc = &cfg.instance;
    let capacity = whole_pages(sc.capacity_tokens, sc.scheduler.page_size)?;
    let events = cfg.policy == PolicyKind::KvEvents;
    let mut nodes = (0..cfg.dp)
        .map(|_| {
            let sched = build_scheduler(
                sc.scheduler.clone(),
                sc.radix,
                &sc.eviction_policy,
                capacity,
                None,
                events,
            )?;
            Ok(Instance {
                sched,
                exec: SimExecutor {
                    cost: sc.cost.clone(),
                },
                now: f64::NEG_INFINITY,
                timing: HashMap::new(),
                ttft: Vec::new(),
                itl: Vec::new(),
                requests: 0,
                aborted: 0,
                routed: 0,
                stalled: 0,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let index = Arc::new(Mutex::new(KvIndex::default()));
    let policy = policies::build(cfg.policy, cfg.cache_aware, Some(cfg.seed), index.clone());
    let start_wall = Instant::now();
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| requests[a].arrival_s.total_cmp(&requests[b].arrival_s));
    let start = order.first().map_or(0.0, |&i| requests[i].arrival_s);
    for n in &mut nodes {
        n.now = start;
    }
    let trim_every = cfg.cache_aware.eviction_interval_secs as f64;
    let mut next_trim = start + trim_every;
    let mut next = 0;
    loop {
        let arrival = order.get(next).map(|&i| requests[i].arrival_s);
        let busy = (0..nodes.len())
            .filter(|&i| !nodes[i].sched.is_idle())
            .min_by(|&a, &b| nodes[a].now.total_cmp(&nodes[b].now));
        // The earliest busy instance steps while it is before the next arrival.
        if let Some(i) = busy.filter(|&i| arrival.is_none_or(|t| nodes[i].now < t)) {
            let ev = nodes[i].step(arrival)?;
            if !ev.is_empty() {
                let mut ix = index.lock().unwrap_or_else(|e| e.into_inner());
                ix.apply(WorkerId(i as u32), &ev)
                    .map_err(|e| EngineError::Simulation(e.to_string()))?;
            }
        } else if let Some(t) = arrival {
            while t >= next_trim {
                policy.maintain();
                next_trim += trim_every;
            }
            route(&mut nodes, policy.as_ref(), &requests[order[next]], t)?;
            next += 1;
        } else {
            break;
        }
    }
    let mut totals = RunTotals {
        requests: 0,
        aborted: 0,
        prompt_tokens: 0,
        cached_tokens: 0,
        output_tokens: 0,
        duration_s: 0.0,
    };
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for n in &mut nodes {
        totals.requests += n.requests;
        totals.aborted += n.aborted;
        totals.prompt_tokens += n.sched.stats.prompt_tokens;
        totals.cached_tokens += n.sched.stats.cached_tokens;
        totals.output_tokens += n.sched.stats.output_tokens;
        totals.duration_s = totals.duration_s.max(n.now - start);
        ttft.append(&mut n.ttft);
        itl.append(&mut n.itl);
    }
    let s = RunSummary::new(totals, ttft, itl);
    Ok(DpOutcome {
        router_policy: cfg.policy.as_str().into(),
        dp: cfg.dp,
        schedule_policy: sc.scheduler.schedule_policy.to_string(),
        eviction_policy: if sc.radix {
            sc.eviction_policy.clone()
        } else {
            "disabled".into()
        },
        capacity_tokens: capacity,
        requests: s.totals.requests,
        aborted: s.totals.aborted,
        hit_rate: s.hit_rate,
        prompt_tokens: s.totals.prompt_tokens,
        cached_tokens: s.totals.cached_tokens,
        output_tokens_per_s: s.output_tokens_per_s,
        ttft_p50_s: s.ttft_p50_s,
        ttft_p99_s: s.ttft_p99_s,
        itl_p50_s: s.itl_p50_s,
        itl_p99_s: s.itl_p99_s,
        routed: nodes.iter().map(|n| n.routed).collect(),
        simulated_s: s.totals.duration_s,
        seconds: start_wall.elapsed().as_secs_f64(),
    })
}

/// Sends `r`, arriving at `t`, to the instance the policy picks.
fn route(
    nodes: &mut [Instance],
    policy: &dyn LoadBalancingPolicy,
    r: &SimRequest,
    t: f64,
) -> Result<()> {
    let candidates: Vec<Candidate> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| Candidate {
            id: WorkerId(i as u32),
            load: n.timing.len(),
        })
        .collect();
    let pick = policy
        .select(&candidates, &Prompt::Tokens(r.prompt.clone()))
        .ok_or_else(|| EngineError::Simulation("the policy picked no instance".into()))?;
    let n = nodes
        .get_mut(pick)
        .ok_or_else(|| EngineError::Simulation(format!("the policy picked {pick}")))?;
    n.routed += 1;
    if n.sched.is_idle() {
        n.now = n.now.max(t);
    }
    let limits = SamplingLimits {
        max_new_tokens: r.output_len.max(1),
        ignore_eos: true,
        stop_token_ids: Vec::new(),
    };
    match n.sched.add_request(r.prompt.clone(), limits, 0, None) {
        Ok(id) => {
            n.timing.insert(id, (t, None));
        }
        Err(_) => n.aborted += 1,
    }
    Ok(())
}

/// Runs every cluster, `jobs` at a time on threads; results in the order given.
pub fn run_dp_sweep(
    requests: &[SimRequest],
    configs: &[DpConfig],
    jobs: usize,
    progress: &(dyn Fn() + Sync),
) -> Result<Vec<DpOutcome>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<DpOutcome>>>> =
        configs.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, configs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(cfg) = configs.get(i) else { break };
                let r = run_dp(requests, cfg);
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                progress();
            });
        }
    });
    results
        .into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(EngineError::Simulation("a cluster did not run".into())))
        })
        .collect()
}

/// An aligned table of clusters.
pub fn render_dp_table(outcomes: &[DpOutcome], timings: bool) -> String {
    let mut rows = vec![[
        "policy",
        "dp",
        "schedule",
        "eviction",
        "capacity",
        "hit_rate",
        "out_tok/s",
        "ttft_p50",
        "ttft_p99",
        "itl_p50",
        "itl_p99",
        "aborted",
        "routed",
    ]
    .map(String::from)
    .to_vec()];
    if timings {
        rows[0].push("wall_s".into());
    }
    for o in outcomes {
        let mut row = vec![
            o.router_policy.clone(),
            o.dp.to_string(),
            o.schedule_policy.clone(),
            o.eviction_policy.clone(),
            o.capacity_tokens.to_string(),
            format!("{:.2}%", 100.0 * o.hit_rate),
            format!("{:.0}", o.output_tokens_per_s),
            format!("{:.3}s", o.ttft_p50_s),
            format!("{:.3}s", o.ttft_p99_s),
            format!("{:.4}s", o.itl_p50_s),
            format!("{:.4}s", o.itl_p99_s),
            o.aborted.to_string(),
            o.routed
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join("/"),
        ];
        if timings {
            row.push(format!("{:.2}", o.seconds));
        }
        rows.push(row);
    }
    crate::report::align_rows(&rows, &[0, 2, 3, 12])
}

/// Hit rate (and, into `FILE-ttft.png`, TTFT p50) against the number of instances, one line
/// per policy (and schedule / eviction / pool, when several were swept).
pub fn plot_dp(outcomes: &[DpOutcome], subtitle: &str, path: &std::path::Path) -> Result<()> {
    let several = outcomes.iter().any(|o| {
        (&o.schedule_policy, &o.eviction_policy, o.capacity_tokens)
            != (
                &outcomes[0].schedule_policy,
                &outcomes[0].eviction_policy,
                outcomes[0].capacity_tokens,
            )
    });
    let series = |y: &dyn Fn(&DpOutcome) -> f64| {
        let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for o in outcomes {
            let label = if several {
                format!(
                    "{} ({} / {} / {})",
                    o.router_policy, o.schedule_policy, o.eviction_policy, o.capacity_tokens
                )
            } else {
                o.router_policy.clone()
            };
            let point = (o.dp as f64, y(o));
            match series.iter_mut().find(|(l, _)| *l == label) {
                Some((_, points)) => points.push(point),
                None => series.push((label, vec![point])),
            }
        }
        series
    };
    crate::plot::plot_lines(
        &crate::plot::LinePlot {
            title: "Simulated cluster: prefix-cache hit rate per router policy".into(),
            subtitle: subtitle.into(),
            x_desc: "instances (--dp)".into(),
            y_desc: "hit rate".into(),
            y_percent: true,
            x_log: false,
            series: series(&|o| 100.0 * o.hit_rate),
        },
        path,
    )?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("sim");
    crate::plot::plot_lines(
        &crate::plot::LinePlot {
            title: "Simulated cluster: TTFT p50 per router policy".into(),
            subtitle: subtitle.into(),
            x_desc: "instances (--dp)".into(),
            y_desc: "TTFT p50 (ms)".into(),
            y_percent: false,
            x_log: false,
            series: series(&|o| 1e3 * o.ttft_p50_s),
        },
        &path.with_file_name(format!("{stem}-ttft.png")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{sim_requests, Arrivals};
    use crate::workload::GspConfig;
    use proptest::prelude::*;
    use scheduler::SchedulePolicy;

    const ALL: [PolicyKind; 5] = [
        PolicyKind::Random,
        PolicyKind::RoundRobin,
        PolicyKind::PowerOfTwo,
        PolicyKind::CacheAware,
        PolicyKind::KvEvents,
    ];

    fn gsp(groups: usize, per_group: usize, system: usize, rate: f64) -> Vec<SimRequest> {
        let w = GspConfig {
            num_groups: groups,
            prompts_per_group: per_group,
            system_prompt_len: system,
            question_len: 32,
            output_len: 8,
            seed: 1,
            vocab_size: 32_000,
        }
        .generate()
        .unwrap();
        sim_requests(&w, Arrivals::Poisson { rate, seed: 1 }).unwrap()
    }

    fn cluster(policy: PolicyKind, dp: usize, capacity: usize) -> DpConfig {
        DpConfig {
            instance: crate::sim::tests::config(SchedulePolicy::Fcfs, capacity),
            dp,
            policy,
            cache_aware: CacheAwareConfig::default(),
            seed: 7,
        }
    }

    /// More groups than one instance caches: the prefix-aware policies keep each group on one
    /// instance and reach the hit rate of one instance with the cluster's whole pool.
    #[test]
    fn table_of_a_small_cluster() {
        let reqs = gsp(6, 4, 256, 4.0);
        let mut configs = vec![cluster(PolicyKind::RoundRobin, 1, 3 * 768)];
        for dp in [1, 3] {
            configs.extend(ALL.map(|p| cluster(p, dp, 768)));
        }
        let out = run_dp_sweep(&reqs, &configs, 2, &|| {}).unwrap();
        let ideal = out[0].hit_rate;
        for o in &out {
            assert_eq!(o.requests + o.aborted, 24, "{o:?}");
            assert_eq!(o.routed.iter().sum::<usize>(), 24);
            if o.dp == 3 && matches!(o.router_policy.as_str(), "cache_aware" | "kv_events") {
                assert!(o.hit_rate >= ideal - 0.02, "{o:?} vs ideal {ideal}");
            }
        }
        insta::assert_snapshot!(render_dp_table(&out, false));
    }

    #[test]
    fn bad_clusters_are_errors() {
        let reqs = gsp(2, 2, 64, 4.0);
        assert!(run_dp(&reqs, &cluster(PolicyKind::Random, 0, 512)).is_err());
        let mut c = cluster(PolicyKind::Random, 2, 512);
        c.instance.tier = Some(crate::sim_tier::SimTier::with_policy(
            radix_cache::tiers::WritePolicy::WriteThrough,
            2.0,
            None,
        ));
        assert!(matches!(
            run_dp(&reqs, &c),
            Err(EngineError::InvalidArgument { .. })
        ));
        let mut c = cluster(PolicyKind::Random, 2, 512);
        c.instance.allocator = Some(crate::sim_contiguity::AllocatorChoice::BestFit);
        assert!(matches!(
            run_dp(&reqs, &c),
            Err(EngineError::InvalidArgument { .. })
        ));
        // A pool smaller than a page.
        assert!(run_dp(&reqs, &cluster(PolicyKind::Random, 2, 8)).is_err());
        // Requests that do not fit abort; nothing hangs.
        let big = vec![SimRequest {
            prompt: (0..600).collect(),
            output_len: 4,
            arrival_s: 0.0,
        }];
        let o = run_dp(&big, &cluster(PolicyKind::KvEvents, 2, 512)).unwrap();
        assert_eq!((o.requests, o.aborted), (0, 1));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]
        /// Whatever the policy, cluster size and load: every request is routed once and ends
        /// (finished or aborted), cached tokens never exceed prompt tokens, and the run is a
        /// function of its seed.
        #[test]
        fn every_request_is_routed_once_and_ends(
            policy in 0usize..5,
            dp in 1usize..5,
            groups in 1usize..6,
            rate in 1.0f64..50.0,
        ) {
            let reqs = gsp(groups, 3, 128, rate);
            let c = cluster(ALL[policy], dp, 640);
            let o = run_dp(&reqs, &c).unwrap();
            prop_assert_eq!(o.requests + o.aborted, reqs.len());
            prop_assert_eq!(o.routed.iter().sum::<usize>(), reqs.len());
            prop_assert_eq!(o.routed.len(), dp);
            prop_assert!(o.cached_tokens <= o.prompt_tokens);
            let again = run_dp(&reqs, &c).unwrap();
            prop_assert_eq!((again.routed, again.cached_tokens), (o.routed, o.cached_tokens));
        }
    }
}
