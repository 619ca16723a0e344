//! Page contiguity in the simulator: what an allocator policy does to the pages requests get,
//! and what that costs the consumers of those pages ([`ContiguityProbe`]).
//!
//! The probe wraps the simulation's executor ([`ContiguityProbe::executor`]), so it sees every
//! pass exactly as an attention backend would — each request's row of the request-to-token
//! table — and observes the scheduler after every step ([`ContiguityProbe::observe`], the
//! observer of [`replay_observed`](crate::sim::replay_observed)). It measures, with
//! `kv_pool::contiguity`:
//! - per finished request: its pages at its last pass, and the runs of consecutive page ids
//!   they form (runs per request, mean run length);
//! - page-table reads: per pass, every request's pages (one page-table entry each) against
//!   their runs (one entry each for a kernel that reads runs);
//! - PD transfer: a prefill sends a request's complete pages as each chunk commits them and
//!   the last partial page with the last chunk (SGLang's prefill side); each send is
//!   coalesced into blocks by the caller's function (the engine hands in `transfer`'s
//!   `page_runs`, SGLang's `group_concurrent_contiguous`, with the simulated server standing
//!   in for both sides, so the destination pages are the source pages);
//! - free-page fragmentation, sampled every `sample_every` steps over simulated time.
//!
//! A request retracted and admitted again is measured from its new admission.

use std::cell::RefCell;
use std::collections::HashMap;

use kv_pool::contiguity::{page_runs, FreeFragmentation, RunStats};
use kv_pool::{Allocator, Page, ReqToTokenPool};
use radix_cache::PrefixCache;

use crate::batch::{BatchResult, Executor, ForwardBatch, ForwardMode};
use crate::report::StepReport;
use crate::req::ReqId;
use crate::scheduler::Scheduler;

/// Counts the transfer blocks of one send of `pages` (per registered region).
pub type BlockCounter = fn(&[Page]) -> usize;

/// One live request, as the probe last saw it.
#[derive(Debug, Default)]
struct LiveReq {
    /// Its pages in position order (one per page index).
    pages: Vec<Page>,
    /// Runs among `pages`.
    runs: usize,
    /// Length of its last pass.
    seq_len: usize,
    /// Page indices already sent to a PD decode side.
    sent: usize,
    /// Whether its prefill finished (nothing more to send).
    prefilled: bool,
}

/// Free-page fragmentation at one point of the simulation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FragmentationSample {
    /// Simulated time of the sample, in seconds from the first arrival.
    pub time_s: f64,
    /// The free pages' fragmentation then.
    pub fragmentation: FreeFragmentation,
}

/// What [`ContiguityProbe`] measured over one run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ContiguityReport {
    /// Page size the figures are in.
    pub page_size: u32,
    /// Requests measured (finished while observed).
    pub requests: usize,
    /// Their pages and runs, summed.
    pub request_runs: RunStats,
    /// Σ over requests of each request's mean run length (pages / runs).
    pub sum_mean_run_len: f64,
    /// Pages sent to a PD decode side, all requests.
    pub transfer_pages: usize,
    /// Transfer blocks of those sends (per region), all requests.
    pub transfer_blocks: usize,
    /// Page-table entries the passes read with one entry per page.
    pub page_table_pages: usize,
    /// The same reads with one entry per run of consecutive pages.
    pub page_table_runs: usize,
    /// The `k` of [`FreeFragmentation::pages_in_long_runs`] in the samples.
    pub min_run_pages: usize,
    /// Free-page fragmentation over time.
    pub samples: Vec<FragmentationSample>,
}

impl ContiguityReport {
    /// Mean runs of consecutive pages per request (0 without requests).
    pub fn runs_per_request(&self) -> f64 {
        ratio(self.request_runs.runs, self.requests)
    }

    /// Mean pages per request.
    pub fn pages_per_request(&self) -> f64 {
        ratio(self.request_runs.pages, self.requests)
    }

    /// Mean over requests of each request's mean run length, in pages.
    pub fn mean_run_len(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.sum_mean_run_len / self.requests as f64
        }
    }

    /// Transfer blocks per request (per region: multiply by layers × buffers for the batch).
    pub fn transfer_blocks_per_request(&self) -> f64 {
        ratio(self.transfer_blocks, self.requests)
    }

    /// Page-table entries read per run entry (≥ 1: how many times fewer reads by runs).
    pub fn page_table_reduction(&self) -> f64 {
        ratio(self.page_table_pages, self.page_table_runs)
    }

    /// The mean of `f` over the fragmentation samples (0 without samples).
    pub fn mean_sample(&self, f: impl Fn(&FreeFragmentation) -> f64) -> f64 {
        if self.samples.is_empty() {
            return 0.0;
        }
        let sum: f64 = self.samples.iter().map(|s| f(&s.fragmentation)).sum();
        sum / self.samples.len() as f64
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The probe's state, shared by its executor and its observer.
#[derive(Debug)]
struct ProbeState {
    live: HashMap<ReqId, LiveReq>,
    report: ContiguityReport,
    sample_every: u64,
    start_s: Option<f64>,
}

/// Measures page contiguity during a simulation (see the module documentation).
#[derive(Debug)]
pub struct ContiguityProbe {
    state: RefCell<ProbeState>,
    blocks: BlockCounter,
}

/// The executor a [`ContiguityProbe`] wraps: forwards every pass, recording its pages first.
pub struct ProbedExecutor<'a> {
    probe: &'a ContiguityProbe,
    inner: &'a mut dyn Executor,
}

impl ContiguityProbe {
    /// A probe for pages of `page_size` tokens: fragmentation counts runs of at least
    /// `min_run_pages` pages as long and is sampled every `sample_every` steps (≥ 1); `blocks`
    /// counts the transfer blocks of one send.
    pub fn new(
        page_size: u32,
        min_run_pages: usize,
        sample_every: u64,
        blocks: BlockCounter,
    ) -> Self {
        ContiguityProbe {
            state: RefCell::new(ProbeState {
                live: HashMap::new(),
                report: ContiguityReport {
                    page_size: page_size.max(1),
                    min_run_pages: min_run_pages.max(1),
                    ..ContiguityReport::default()
                },
                sample_every: sample_every.max(1),
                start_s: None,
            }),
            blocks,
        }
    }

    /// Wraps `inner`: the simulation runs this executor instead.
    pub fn executor<'a>(&'a self, inner: &'a mut dyn Executor) -> ProbedExecutor<'a> {
        ProbedExecutor { probe: self, inner }
    }

    /// After a step at simulated time `now_s`: finishes the measurement of the requests that
    /// left, and samples the free pages' fragmentation every `sample_every` steps.
    pub fn observe<C: PrefixCache, A: Allocator>(
        &self,
        scheduler: &Scheduler<C, A>,
        step: &StepReport,
        now_s: f64,
    ) {
        let mut st = self.state.borrow_mut();
        let start = *st.start_s.get_or_insert(now_s);
        for f in &step.finished {
            if let Some(r) = st.live.remove(&f.id) {
                if r.pages.is_empty() {
                    continue;
                }
                let stats = RunStats {
                    pages: r.pages.len(),
                    runs: r.runs,
                };
                st.report.requests += 1;
                st.report.request_runs.add(stats);
                st.report.sum_mean_run_len += stats.mean_run_len();
            }
        }
        if step.step % st.sample_every == 0 {
            let free = scheduler.allocator().unallocated_pages();
            let fragmentation = FreeFragmentation::of(&free, st.report.min_run_pages);
            st.report.samples.push(FragmentationSample {
                time_s: now_s - start,
                fragmentation,
            });
        }
    }

    /// The figures measured so far.
    pub fn report(&self) -> ContiguityReport {
        self.state.borrow().report.clone()
    }

    /// Records one pass's pages (called by [`ProbedExecutor`] before the pass runs).
    fn record(&self, batch: &ForwardBatch, rows: &ReqToTokenPool) -> Result<(), String> {
        let mut st = self.state.borrow_mut();
        let p = st.report.page_size as usize;
        for k in 0..batch.len() {
            let (id, seq) = (batch.reqs[k], batch.seq_lens[k]);
            let slots = rows
                .read(batch.rows[k], seq)
                .map_err(|e| format!("contiguity probe: {e}"))?;
            let r = st.live.entry(id).or_default();
            let want = seq.div_ceil(p);
            if batch.mode == ForwardMode::Decode && r.seq_len > 0 && r.seq_len + 1 == seq {
                // One new position: a new page when it starts one.
                if r.pages.len() < want {
                    let page = Page(slots[seq - 1].0 / p as u32);
                    if r.pages.last().and_then(|l| l.0.checked_add(1)) != Some(page.0) {
                        r.runs += 1;
                    }
                    r.pages.push(page);
                }
            } else {
                if batch.prefix_lens[k] < r.seq_len || r.seq_len == 0 {
                    // A (new) admission: measured from here.
                    r.sent = 0;
                    r.prefilled = false;
                }
                r.pages = kv_pool::contiguity::pages_of_slots(slots, p as u32);
                r.runs = page_runs(&r.pages).runs;
            }
            r.seq_len = seq;
            let (pages, runs) = (r.pages.len(), r.runs);
            // PD: complete pages as chunks commit them, the partial last page with the last.
            let mut send = None;
            if batch.mode != ForwardMode::Decode && !r.prefilled {
                let upto = if batch.sample[k] {
                    r.prefilled = true;
                    pages
                } else {
                    seq / p
                };
                if upto > r.sent {
                    send = Some((r.sent, upto));
                    r.sent = upto;
                }
            }
            if let Some((from, to)) = send {
                let blocks = (self.blocks)(&st.live[&id].pages[from..to]);
                st.report.transfer_pages += to - from;
                st.report.transfer_blocks += blocks;
            }
            st.report.page_table_pages += pages;
            st.report.page_table_runs += runs;
        }
        Ok(())
    }
}

impl Executor for ProbedExecutor<'_> {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        rows: &ReqToTokenPool,
    ) -> Result<BatchResult, String> {
        self.probe.record(batch, rows)?;
        self.inner.forward(batch, rows)
    }
}

/// Runs of `pages`, each one transfer block: the block count when both sides hold the pages
/// at the same ids (a stand-in for transfer's coalescing where that crate is not linked).
pub fn runs_as_blocks(pages: &[Page]) -> usize {
    page_runs(pages).runs
}

#[cfg(test)]
mod tests;
