//! The serving simulator: [`SimExecutor`] charges each batch a time from a roofline cost model
//! instead of computing, and [`simulate`] replays timed requests through the real scheduler,
//! prefix cache and allocator on a simulated clock, measuring TTFT, inter-token latency and
//! throughput. A policy is judged on a real trace at the scale of a real deployment, on a laptop.
//!
//! ## Cost model
//! Per pass, time = `max(FLOPs / (peak × flops_efficiency), bytes / (bandwidth ×
//! bw_efficiency)) + step_overhead`, with the work split over `tp` accelerators:
//! - FLOPs: `2 × params` per new token (weights), plus attention `4 × layers × q_heads ×
//!   head_dim` per (new token, earlier position) pair — QKᵀ and PV — i.e. `extend × prefix +
//!   extend² / 2` pairs per request in an extend, `seq_len` per request in a decode;
//! - bytes: the weights once per pass (`params × weight_bytes`), plus the KV read (every
//!   request's context × `kv_bytes_per_token`) and written (new tokens × `kv_bytes_per_token`).
//!
//! - HiCache (a tree with a host tier): the pass's load-back bytes
//!   ([`ForwardBatch::load_back_tokens`] × `kv_bytes_per_token`) cross the host link at
//!   [`Accelerator::host_link_bw`]; as SGLang loads layer by layer while the forward pass
//!   computes the layers already loaded, that time *overlaps* the pass: the pass takes
//!   `max(compute, memory, load)`, not their sum. Bytes prefetched from L3 storage
//!   ([`ForwardBatch::prefetch_tokens`]) are *added* at [`CostModel::storage_bw`]: the requests
//!   that waited for them are admitted in this pass (a bound from above: SGLang prefetches
//!   while the request waits, overlapped with other requests' passes). Both are split over the
//!   `tp` ranks (each loads its share of the KV heads).
//!
//! Prefill is compute-bound for long extends and decode is bandwidth-bound, as on real
//! hardware. Presets (public figures): Llama-3-8B (8.03 B params, 32 layers, 32 query / 8 KV
//! heads of 128, bf16: 128 KiB of KV per token) and Llama-3-70B (70.6 B, 80 layers, 64 / 8
//! heads of 128: 320 KiB per token); H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s, 80 GB) and
//! A100 SXM 80 GB (312 TFLOP/s, 2.039 TB/s, 80 GB), with a host link of PCIe 5 × 16 (64 GB/s)
//! and PCIe 4 × 16 (32 GB/s). Efficiencies default to 60 % of peak FLOP/s
//! and 80 % of peak bandwidth, and a 2 ms per-pass overhead for the CPU side and launches.

use std::collections::HashMap;
use std::fmt;

use kv_pool::{Allocator, ReqToTokenPool};
use radix_cache::PrefixCache;

use crate::batch::{BatchResult, Executor, ForwardBatch};
use crate::error::{Result, SchedulerError};
use crate::report::StepReport;
use crate::req::{FinishReason, ReqId, SamplingLimits};
use crate::scheduler::Scheduler;
use crate::summary::{RunSummary, RunTotals};

/// Kept here for callers of `scheduler::sim::percentile`; it lives in [`crate::summary`].
pub use crate::summary::percentile;

/// The shape of a decoder model, as far as cost goes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelShape {
    /// Preset name, as `--model` spells it (matched case-insensitively).
    pub name: &'static str,
    /// Parameter count (each costs 2 FLOPs per new token and is read once per pass).
    pub params: f64,
    /// Bytes per weight (2 for bf16).
    pub weight_bytes: f64,
    /// Decoder layers (attention cost is per layer).
    pub layers: u32,
    /// Query heads (attention FLOPs scale with them).
    pub q_heads: u32,
    /// KV heads (with `head_dim` and `layers`, the KV bytes per token).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
    /// KV bytes per token over all layers (SGLang's `cell_size`).
    pub kv_bytes_per_token: usize,
}

impl ModelShape {
    /// Llama-3-8B in bf16.
    pub const LLAMA3_8B: ModelShape = ModelShape {
        name: "llama-3-8b",
        params: 8.03e9,
        weight_bytes: 2.0,
        layers: 32,
        q_heads: 32,
        kv_heads: 8,
        head_dim: 128,
        kv_bytes_per_token: 8 * 128 * 2 * 32 * 2,
    };
    /// Llama-3-70B in bf16.
    pub const LLAMA3_70B: ModelShape = ModelShape {
        name: "llama-3-70b",
        params: 70.6e9,
        weight_bytes: 2.0,
        layers: 80,
        q_heads: 64,
        kv_heads: 8,
        head_dim: 128,
        kv_bytes_per_token: 8 * 128 * 2 * 80 * 2,
    };
    /// Every preset.
    pub const PRESETS: [ModelShape; 2] = [Self::LLAMA3_8B, Self::LLAMA3_70B];

    /// A preset by name (case-insensitive); unknown names are an `InvalidConfig` error listing
    /// the presets.
    pub fn preset(name: &str) -> Result<ModelShape> {
        Self::PRESETS
            .into_iter()
            .find(|m| m.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| SchedulerError::InvalidConfig {
                field: "--model",
                reason: format!(
                    "unknown model preset {name:?}; expected one of {}",
                    Self::PRESETS.map(|m| m.name).join(", ")
                ),
            })
    }
}

/// An accelerator, as far as cost goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Accelerator {
    /// Preset name, as `--accelerator` spells it (matched case-insensitively).
    pub name: &'static str,
    /// Dense bf16 FLOP/s.
    pub peak_flops: f64,
    /// Memory bandwidth in bytes/s.
    pub mem_bw: f64,
    /// Memory in bytes.
    pub mem_bytes: f64,
    /// Host ↔ device bandwidth in bytes/s (the PCIe link HiCache's load-back crosses).
    pub host_link_bw: f64,
}

impl Accelerator {
    /// NVIDIA H100 SXM.
    pub const H100: Accelerator = Accelerator {
        name: "h100",
        peak_flops: 989e12,
        mem_bw: 3.35e12,
        mem_bytes: 80e9,
        host_link_bw: 64e9,
    };
    /// NVIDIA A100 SXM 80 GB.
    pub const A100: Accelerator = Accelerator {
        name: "a100",
        peak_flops: 312e12,
        mem_bw: 2.039e12,
        mem_bytes: 80e9,
        host_link_bw: 32e9,
    };
    /// Every preset.
    pub const PRESETS: [Accelerator; 2] = [Self::H100, Self::A100];

    /// A preset by name (case-insensitive); unknown names are an `InvalidConfig` error listing
    /// the presets.
    pub fn preset(name: &str) -> Result<Accelerator> {
        Self::PRESETS
            .into_iter()
            .find(|a| a.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| SchedulerError::InvalidConfig {
                field: "--accelerator",
                reason: format!(
                    "unknown accelerator {name:?}; expected one of {}",
                    Self::PRESETS.map(|a| a.name).join(", ")
                ),
            })
    }
}

/// The roofline cost model (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// The model whose passes are charged.
    pub model: ModelShape,
    /// One accelerator; `tp` of them share the work.
    pub accel: Accelerator,
    /// Tensor-parallel degree: work and memory are split over this many accelerators.
    pub tp: u32,
    /// Fraction of peak FLOP/s reached (default 0.6).
    pub flops_efficiency: f64,
    /// Fraction of peak bandwidth reached (default 0.8).
    pub bw_efficiency: f64,
    /// Fixed time per pass (scheduling, launches).
    pub step_overhead_s: f64,
    /// HiCache: L3 storage → host bandwidth in bytes/s, per rank (default
    /// [`CostModel::FILE_STORAGE_BW`]).
    pub storage_bw: f64,
}

impl CostModel {
    /// L3 bandwidth of a local file store (an NVMe array), bytes/s: 10 GB/s.
    pub const FILE_STORAGE_BW: f64 = 10e9;
    /// L3 bandwidth of a networked key-value store (Redis over a 25 GbE link), bytes/s: 2 GB/s.
    pub const REMOTE_STORAGE_BW: f64 = 2e9;

    /// A cost model with the default efficiencies (60 % FLOP/s, 80 % bandwidth, 2 ms per pass)
    /// and a file store's L3 bandwidth.
    pub fn new(model: ModelShape, accel: Accelerator, tp: u32) -> Self {
        CostModel {
            model,
            accel,
            tp: tp.max(1),
            flops_efficiency: 0.6,
            bw_efficiency: 0.8,
            step_overhead_s: 0.002,
            storage_bw: Self::FILE_STORAGE_BW,
        }
    }

    /// The time of one pass in seconds: the roofline maximum of compute, memory and host
    /// load-back time, plus the L3 prefetch time and the per-pass overhead.
    pub fn batch_time(&self, batch: &ForwardBatch) -> f64 {
        let m = &self.model;
        let attn_per_pair = 4.0 * m.layers as f64 * m.q_heads as f64 * m.head_dim as f64;
        let kv = m.kv_bytes_per_token as f64;
        let mut flops = 2.0 * m.params * batch.num_tokens() as f64;
        let mut bytes = m.params * m.weight_bytes;
        for k in 0..batch.len() {
            let (prefix, extend) = (batch.prefix_lens[k] as f64, batch.extend_lens[k] as f64);
            flops += attn_per_pair * (extend * prefix + extend * (extend + 1.0) / 2.0);
            bytes += kv * (prefix + 2.0 * extend);
        }
        let tp = self.tp as f64;
        let compute = flops / (self.accel.peak_flops * self.flops_efficiency * tp);
        let memory = bytes / (self.accel.mem_bw * self.bw_efficiency * tp);
        let load = kv * batch.load_back_tokens as f64 / (self.accel.host_link_bw * tp);
        let prefetch = kv * batch.prefetch_tokens as f64 / (self.storage_bw * tp);
        compute.max(memory).max(load) + prefetch + self.step_overhead_s
    }
}

/// An executor that computes nothing: it charges the cost model's time and returns token 0
/// (simulated requests stop by length).
#[derive(Debug, Clone)]
pub struct SimExecutor {
    /// The cost model charging each pass.
    pub cost: CostModel,
}

impl Executor for SimExecutor {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        _rows: &ReqToTokenPool,
    ) -> std::result::Result<BatchResult, String> {
        Ok(BatchResult {
            next_tokens: vec![0; batch.len()],
            elapsed_s: self.cost.batch_time(batch),
            failed: Vec::new(),
        })
    }
}

/// A request to simulate: a prompt, how many tokens it generates, when it arrives.
#[derive(Debug, Clone, PartialEq)]
pub struct SimRequest {
    /// Prompt tokens.
    pub prompt: Vec<u32>,
    /// Tokens it generates (exactly: it ignores stop tokens).
    pub output_len: usize,
    /// Arrival time in seconds.
    pub arrival_s: f64,
}

/// The figures of one simulated run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SimReport {
    /// Requests that finished normally.
    pub requests: usize,
    /// Requests aborted (did not fit, or rejected at admission).
    pub aborted: usize,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: usize,
    /// Of those, served from the prefix cache (every tier).
    pub cached_tokens: usize,
    /// HiCache: whether the cache had a host tier (the tier figures below are 0 without).
    pub tiered: bool,
    /// Of `cached_tokens`, loaded back from the host tier (also those L3 prefetched first).
    pub host_hit_tokens: usize,
    /// Tokens prefetched from L3 storage into the host tier.
    pub storage_hit_tokens: usize,
    /// `cached_tokens / prompt_tokens`.
    pub hit_rate: f64,
    /// Tokens computed by prefill passes.
    pub prefill_tokens: usize,
    /// Tokens generated.
    pub output_tokens: usize,
    /// Simulated time from the first arrival to the last token.
    pub duration_s: f64,
    /// `output_tokens / duration_s`.
    pub output_tokens_per_s: f64,
    /// Time to first token, median and 99th percentile.
    pub ttft_p50_s: f64,
    /// See `ttft_p50_s`.
    pub ttft_p99_s: f64,
    /// Inter-token latency, median and 99th percentile.
    pub itl_p50_s: f64,
    /// See `itl_p50_s`.
    pub itl_p99_s: f64,
    /// Retractions and priority preemptions.
    pub retractions: usize,
    /// Highest KV pool use, in tokens.
    pub peak_used_tokens: usize,
    /// KV pool capacity, in tokens.
    pub capacity_tokens: usize,
    /// Scheduler steps run, idle ones included.
    pub steps: u64,
    /// Every request's time to first token, sorted ascending.
    pub ttft_s: Vec<f64>,
}

impl SimReport {
    /// Copies a [`RunSummary`]'s figures into the report (the fields both have).
    pub fn set_summary(&mut self, s: RunSummary) {
        let t = s.totals;
        self.requests = t.requests;
        self.aborted = t.aborted;
        self.prompt_tokens = t.prompt_tokens;
        self.cached_tokens = t.cached_tokens;
        self.output_tokens = t.output_tokens;
        self.duration_s = t.duration_s;
        self.hit_rate = s.hit_rate;
        self.output_tokens_per_s = s.output_tokens_per_s;
        self.ttft_p50_s = s.ttft_p50_s;
        self.ttft_p99_s = s.ttft_p99_s;
        self.itl_p50_s = s.itl_p50_s;
        self.itl_p99_s = s.itl_p99_s;
        self.ttft_s = s.ttft_s;
    }
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "requests {} (aborted {}) | hit rate {:.3} | prefill tokens {} | output {:.0} tok/s | TTFT p50 {:.3}s p99 {:.3}s | ITL p50 {:.4}s p99 {:.4}s | retractions {} | peak pool {}/{} | {:.1}s simulated",
            self.requests,
            self.aborted,
            self.hit_rate,
            self.prefill_tokens,
            self.output_tokens_per_s,
            self.ttft_p50_s,
            self.ttft_p99_s,
            self.itl_p50_s,
            self.itl_p99_s,
            self.retractions,
            self.peak_used_tokens,
            self.capacity_tokens,
            self.duration_s
        )?;
        if self.tiered {
            write!(
                f,
                " | host hit {} tokens, storage hit {} tokens",
                self.host_hit_tokens, self.storage_hit_tokens
            )?;
        }
        Ok(())
    }
}

/// How the replay's clock advances per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// By the time the executor reports for the pass (a cost model's charge): a simulation.
    Charged,
    /// By the measured wall time of the whole step (scheduling and the real forward pass): a
    /// benchmark of a real executor. Idle gaps before the next arrival are skipped, not slept.
    Wall,
}

/// How [`replay`] feeds requests in and keeps time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayConfig {
    /// How the clock advances per step.
    pub clock: Clock,
    /// bench_serving's `--max-concurrency`: at most this many requests in flight; a request
    /// that arrives while the limit is reached waits (as a client would) and its TTFT counts
    /// from when it is sent. `None`: no limit.
    pub max_concurrency: Option<usize>,
}

impl ReplayConfig {
    /// A simulation ([`Clock::Charged`]) with no concurrency limit.
    pub const SIMULATION: ReplayConfig = ReplayConfig {
        clock: Clock::Charged,
        max_concurrency: None,
    };
}

/// Replays `requests` (in arrival order) through `scheduler` on a simulated clock driven by
/// `exec`'s pass times. `progress` is called with (requests done, total) after every step.
pub fn simulate<C: PrefixCache, A: Allocator>(
    requests: &[SimRequest],
    scheduler: &mut Scheduler<C, A>,
    exec: &mut dyn Executor,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimReport> {
    replay(
        requests,
        scheduler,
        exec,
        ReplayConfig::SIMULATION,
        progress,
    )
}

/// [`simulate`] with a choice of [`Clock`] and a concurrency limit.
pub fn replay<C: PrefixCache, A: Allocator>(
    requests: &[SimRequest],
    scheduler: &mut Scheduler<C, A>,
    exec: &mut dyn Executor,
    config: ReplayConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<SimReport> {
    replay_observed(
        requests,
        scheduler,
        exec,
        config,
        progress,
        &mut |_, _, _| {},
    )
}

/// What [`replay_observed`] calls after every step: the scheduler, the step's report and the
/// clock after the step (e.g. `sim_contiguity::ContiguityProbe::observe`).
pub type StepObserver<'a, C, A> = dyn FnMut(&Scheduler<C, A>, &StepReport, f64) + 'a;

/// [`replay`], calling `observe` after every step.
pub fn replay_observed<C: PrefixCache, A: Allocator>(
    requests: &[SimRequest],
    scheduler: &mut Scheduler<C, A>,
    exec: &mut dyn Executor,
    config: ReplayConfig,
    progress: &mut dyn FnMut(usize, usize),
    observe: &mut StepObserver<'_, C, A>,
) -> Result<SimReport> {
    if config.max_concurrency == Some(0) {
        return Err(SchedulerError::InvalidConfig {
            field: "max_concurrency",
            reason: "must be at least 1".into(),
        });
    }
    let limit = config.max_concurrency.unwrap_or(usize::MAX);
    // Requests admitted so far, and when each admitted request finished, in finishing order.
    let (mut admitted, mut finish_times) = (0usize, Vec::new());
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| requests[a].arrival_s.total_cmp(&requests[b].arrival_s));
    let start = order.first().map_or(0.0, |&i| requests[i].arrival_s);
    let mut now = start;
    let mut next = 0;
    let mut timing: HashMap<ReqId, (f64, Option<f64>)> = HashMap::new();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let mut report = SimReport {
        capacity_tokens: scheduler.allocator().size(),
        ..SimReport::default()
    };
    let mut done = 0;
    let mut stalled = 0;
    loop {
        while next < order.len() && requests[order[next]].arrival_s <= now && timing.len() < limit {
            let r = &requests[order[next]];
            let limits = SamplingLimits {
                max_new_tokens: r.output_len.max(1),
                ignore_eos: true,
                stop_token_ids: Vec::new(),
            };
            match scheduler.add_request(r.prompt.clone(), limits, 0, None) {
                Ok(id) => {
                    // Under a concurrency limit the k-th request is sent (and its TTFT starts)
                    // when it arrives or when the (k − limit)-th in flight finished, whichever
                    // is later.
                    let slot_free = admitted
                        .checked_sub(limit)
                        .map_or(f64::NEG_INFINITY, |k| finish_times[k]);
                    timing.insert(id, (r.arrival_s.max(slot_free), None));
                    admitted += 1;
                }
                Err(_) => {
                    report.aborted += 1;
                    done += 1;
                }
            }
            next += 1;
        }
        if scheduler.is_idle() {
            if next == order.len() {
                break;
            }
            now = now.max(requests[order[next]].arrival_s);
            continue;
        }
        let started = std::time::Instant::now();
        scheduler.set_time(now);
        let step = scheduler.step(exec)?;
        now += match config.clock {
            Clock::Charged => step.elapsed_s,
            Clock::Wall => started.elapsed().as_secs_f64(),
        };
        observe(scheduler, &step, now);
        stalled = if step.mode.is_none() && step.finished.is_empty() {
            stalled + 1
        } else {
            0
        };
        // HiCache copies in flight (a prefetch the admission waits for): progress comes from
        // the controller's threads, not from steps; give them time.
        if stalled > 0 && scheduler.has_cache_io() {
            stalled = 0;
            if config.clock == Clock::Wall {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        }
        // Stalled with nothing left to admit (all arrived, or the concurrency limit holds the
        // rest back): no step will ever change anything.
        if stalled > 2 && (next == order.len() || timing.len() >= limit) {
            return Err(SchedulerError::Invariant {
                step: scheduler.steps(),
                message: format!(
                    "the simulation stalled with {} requests waiting",
                    scheduler.num_waiting()
                ),
            });
        }
        if step.mode.is_some() {
            for e in &step.entries {
                if e.middle_chunk {
                    continue;
                }
                if let Some((arrival, last)) = timing.get_mut(&e.id) {
                    match last {
                        None => ttft.push(now - *arrival),
                        Some(t) => itl.push(now - *t),
                    }
                    *last = Some(now);
                }
            }
        }
        for f in scheduler.take_finished() {
            if timing.remove(&f.id).is_some() {
                finish_times.push(now);
            }
            done += 1;
            match f.reason {
                FinishReason::Abort { .. } => report.aborted += 1,
                _ => report.requests += 1,
            }
        }
        progress(done, requests.len());
        // Between arrivals while idle the clock jumps; while busy it advances by the passes.
        if step.mode.is_none() && next < order.len() {
            now = now.max(requests[order[next]].arrival_s);
        }
    }
    let stats = &scheduler.stats;
    let totals = RunTotals {
        requests: report.requests,
        aborted: report.aborted,
        prompt_tokens: stats.prompt_tokens,
        cached_tokens: stats.cached_tokens,
        output_tokens: stats.output_tokens,
        duration_s: now - start,
    };
    report.prefill_tokens = stats.prefill_tokens;
    report.retractions = stats.retractions;
    report.peak_used_tokens = stats.peak_used_tokens;
    report.host_hit_tokens = stats.host_hit_tokens;
    if let Some(t) = scheduler.cache().tier_stats() {
        report.tiered = true;
        report.storage_hit_tokens = t.storage_hit_tokens as usize;
    }
    report.set_summary(RunSummary::new(totals, ttft, itl));
    report.steps = scheduler.steps();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::ForwardMode;

    fn batch(mode: ForwardMode, reqs: &[(usize, usize)]) -> ForwardBatch {
        let mut b = ForwardBatch::new(mode);
        for (i, &(prefix, extend)) in reqs.iter().enumerate() {
            let toks = vec![1; extend];
            let slots = vec![kv_pool::Slot(1); extend];
            b.push(
                ReqId(i as u64),
                kv_pool::ReqRow(1),
                prefix,
                &toks,
                &slots,
                true,
            );
        }
        b
    }

    #[test]
    fn prefill_is_compute_bound_and_decode_memory_bound() {
        let c = CostModel {
            step_overhead_s: 0.0,
            ..CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1)
        };
        // 4096-token prefill: 2 × 8.03e9 × 4096 FLOPs ≈ 6.6e13 (+ attention) at 593 TFLOP/s.
        let p = c.batch_time(&batch(ForwardMode::Extend, &[(0, 4096)]));
        let weights_flops = 2.0 * 8.03e9 * 4096.0;
        let attn = 4.0 * 32.0 * 32.0 * 128.0 * (4096.0 * 4097.0 / 2.0);
        assert!(
            (p - (weights_flops + attn) / (989e12 * 0.6)).abs() < 1e-9,
            "{p}"
        );
        // One decode token of a 1000-token context: weights + KV read at 2.68 TB/s.
        let d = c.batch_time(&batch(ForwardMode::Decode, &[(1000, 1)]));
        let bytes = 8.03e9 * 2.0 + 131072.0 * 1002.0;
        assert!((d - bytes / (3.35e12 * 0.8)).abs() < 1e-9, "{d}");
        // Batching decodes amortises the weights: 64 requests cost far less than 64 × one.
        let d64 = c.batch_time(&batch(ForwardMode::Decode, &[(1000, 1); 64]));
        assert!(d64 < 8.0 * d);
        // Two accelerators halve both terms.
        let c2 = CostModel { tp: 2, ..c.clone() };
        assert!((c2.batch_time(&batch(ForwardMode::Decode, &[(1000, 1)])) - d / 2.0).abs() < 1e-12);
    }

    /// A load-back overlaps the pass (the longer of the two counts); an L3 prefetch adds.
    #[test]
    fn load_back_overlaps_and_prefetch_adds() {
        let c = CostModel {
            step_overhead_s: 0.0,
            ..CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1)
        };
        let plain = batch(ForwardMode::Extend, &[(4096, 16)]);
        let t = c.batch_time(&plain);
        let kv = 131072.0;
        // A short load hides under the pass.
        let mut b = plain.clone();
        b.load_back_tokens = 16;
        assert_eq!(c.batch_time(&b), t);
        // A long one is the pass: 4096 tokens × 128 KiB over 64 GB/s.
        b.load_back_tokens = 4096;
        let load = 4096.0 * kv / 64e9;
        assert!(load > t && (c.batch_time(&b) - load).abs() < 1e-12);
        // A prefetch is added, at 10 GB/s by default.
        b.prefetch_tokens = 1024;
        let fetch = 1024.0 * kv / 10e9;
        assert!((c.batch_time(&b) - load - fetch).abs() < 1e-12);
    }

    #[test]
    fn presets_parse() {
        assert_eq!(ModelShape::preset("Llama-3-70B").unwrap().layers, 80);
        assert_eq!(Accelerator::preset("a100").unwrap().mem_bw, 2.039e12);
        assert!(ModelShape::preset("gpt-5").is_err());
        assert!(Accelerator::preset("tpu").is_err());
    }

    #[test]
    fn simulation_of_shared_prefix_requests() {
        use crate::config::SchedulerConfig;
        use kv_pool::PagedAllocator;
        use radix_cache::{BuiltinPolicy, RadixCache};
        let cfg = SchedulerConfig {
            page_size: 16,
            context_len: 4096,
            strict: true,
            ..SchedulerConfig::default()
        };
        let cache = RadixCache::new(16, BuiltinPolicy::Lru);
        let mut s = Scheduler::new(cfg, cache, PagedAllocator::new(1 << 16, 16).unwrap()).unwrap();
        // 8 requests, one every 100 ms, sharing a 1024-token prefix, 32 output tokens each.
        let reqs: Vec<SimRequest> = (0..8u32)
            .map(|i| {
                let mut prompt: Vec<u32> = (0..1024).collect();
                prompt.extend((0..64).map(|j| 10_000 + i * 64 + j));
                SimRequest {
                    prompt,
                    output_len: 32,
                    arrival_s: 0.1 * i as f64,
                }
            })
            .collect();
        let mut exec = SimExecutor {
            cost: CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1),
        };
        let mut calls = 0;
        let r = simulate(&reqs, &mut s, &mut exec, &mut |_, _| calls += 1).unwrap();
        assert_eq!((r.requests, r.aborted, r.output_tokens), (8, 0, 8 * 32));
        // Every request after the first reuses the 1024-token prefix.
        assert_eq!(r.cached_tokens, 7 * 1024);
        assert_eq!(r.prefill_tokens, 1088 + 7 * 64);
        assert!(r.ttft_p50_s > 0.0 && r.ttft_p99_s >= r.ttft_p50_s);
        assert!(r.itl_p50_s > 0.0 && r.itl_p99_s >= r.itl_p50_s);
        // The last request arrives at 0.7 s and needs 32 decode steps of > 6 ms.
        assert!(r.duration_s > 0.7 + 32.0 * 0.006, "{}", r.duration_s);
        assert!(calls > 0);
        s.check_invariants().unwrap();
    }

    /// With `max_concurrency`, no more than that many requests are ever in the scheduler, and a
    /// burst then runs in waves: one request at a time takes the sum of the solo times.
    #[test]
    fn max_concurrency_limits_requests_in_flight() {
        use crate::config::SchedulerConfig;
        use kv_pool::PagedAllocator;
        use radix_cache::ChunkCache;
        let run = |limit: Option<usize>| {
            let cfg = SchedulerConfig {
                page_size: 16,
                context_len: 4096,
                strict: true,
                ..SchedulerConfig::default()
            };
            let mut s = Scheduler::new(
                cfg,
                ChunkCache::new(16),
                PagedAllocator::new(1 << 16, 16).unwrap(),
            )
            .unwrap();
            let reqs: Vec<SimRequest> = (0..6u32)
                .map(|i| SimRequest {
                    prompt: (0..256).map(|j| i * 1000 + j).collect(),
                    output_len: 8,
                    arrival_s: 0.0,
                })
                .collect();
            /// Records the largest batch it is given.
            struct Widest(SimExecutor, usize);
            impl Executor for Widest {
                fn forward(
                    &mut self,
                    batch: &ForwardBatch,
                    rows: &kv_pool::ReqToTokenPool,
                ) -> std::result::Result<crate::batch::BatchResult, String> {
                    self.1 = self.1.max(batch.len());
                    self.0.forward(batch, rows)
                }
            }
            let mut exec = Widest(
                SimExecutor {
                    cost: CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1),
                },
                0,
            );
            let config = ReplayConfig {
                clock: Clock::Charged,
                max_concurrency: limit,
            };
            let r = replay(&reqs, &mut s, &mut exec, config, &mut |_, _| {}).unwrap();
            (r, exec.1)
        };
        let (free, free_peak) = run(None);
        assert_eq!(free_peak, 6);
        let (one, peak) = run(Some(1));
        assert_eq!((one.requests, one.output_tokens), (6, 48));
        assert_eq!(peak, 1, "one request in flight at a time");
        // Serialized, the burst takes longer but no request waits inside the engine: its TTFT
        // (from when it is sent) is a solo prefill.
        assert!(one.duration_s > free.duration_s);
        assert!(one.ttft_p99_s < free.ttft_p99_s);
        let mut s = Scheduler::new(
            SchedulerConfig::default(),
            radix_cache::ChunkCache::new(1),
            PagedAllocator::new(64, 1).unwrap(),
        )
        .unwrap();
        let zero = ReplayConfig {
            clock: Clock::Charged,
            max_concurrency: Some(0),
        };
        let mut exec = SimExecutor {
            cost: CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1),
        };
        assert!(replay(&[], &mut s, &mut exec, zero, &mut |_, _| {}).is_err());
    }
}
