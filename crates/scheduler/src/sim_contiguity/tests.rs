use super::*;
use crate::config::SchedulerConfig;
use crate::sim::{replay_observed, Accelerator, CostModel, ModelShape, ReplayConfig};
use crate::sim::{SimExecutor, SimRequest};
use kv_pool::{AnyAllocator, BestFitAllocator, PagedAllocator};
use radix_cache::{BuiltinPolicy, RadixCache};

const P: u32 = 4;

/// `n` requests, one every 10 ms, each a 64-token shared prefix plus a private tail of 5 to 40
/// tokens, generating 3 to 30 tokens.
fn requests(n: u32) -> Vec<SimRequest> {
    let mut rng = kv_pool::SplitMix64::new(5);
    (0..n)
        .map(|i| {
            let mut prompt: Vec<u32> = (0..64).collect();
            let tail = 5 + rng.below(36) as u32;
            prompt.extend((0..tail).map(|j| 1000 + i * 100 + j));
            SimRequest {
                prompt,
                output_len: 3 + rng.below(28),
                arrival_s: 0.01 * i as f64,
            }
        })
        .collect()
}

fn run<A: Allocator>(alloc: A, reqs: &[SimRequest], chunk: Option<usize>) -> ContiguityReport {
    let cfg = SchedulerConfig {
        page_size: P,
        context_len: 512,
        chunked_prefill_size: chunk,
        strict: true,
        ..SchedulerConfig::default()
    };
    let cache = RadixCache::new(P, BuiltinPolicy::Lru);
    let mut s = Scheduler::new(cfg, cache, alloc).unwrap();
    let mut sim = SimExecutor {
        cost: CostModel::new(ModelShape::LLAMA3_8B, Accelerator::H100, 1),
    };
    let probe = ContiguityProbe::new(P, 4, 1, runs_as_blocks);
    let mut exec = probe.executor(&mut sim);
    let r = replay_observed(
        reqs,
        &mut s,
        &mut exec,
        ReplayConfig::SIMULATION,
        &mut |_, _| {},
        &mut |s, step, now| probe.observe(s, step, now),
    )
    .unwrap();
    assert_eq!(r.aborted, 0);
    probe.report()
}

/// Every request is measured once; each sends every page of its prompt exactly once (cached
/// prefix pages included, chunked or not); runs never exceed pages; a fresh pool hands one
/// lone request a single run.
#[test]
fn the_probe_accounts_for_every_page() {
    let reqs = requests(24);
    let prompt_pages: usize = reqs.iter().map(|r| r.prompt.len().div_ceil(4)).sum();
    for chunk in [None, Some(16)] {
        for report in [
            run(PagedAllocator::new(4096, P).unwrap(), &reqs, chunk),
            run(BestFitAllocator::new(4096, P).unwrap(), &reqs, chunk),
        ] {
            assert_eq!(report.requests, 24);
            assert_eq!(report.transfer_pages, prompt_pages, "{chunk:?}");
            assert!(report.transfer_blocks >= report.requests);
            assert!(report.request_runs.runs >= report.requests);
            assert!(report.request_runs.runs <= report.request_runs.pages);
            assert!(report.page_table_runs <= report.page_table_pages);
            assert!(report.page_table_reduction() >= 1.0);
            assert!(!report.samples.is_empty());
            let last = report.samples.last().unwrap();
            assert!(last.time_s > 0.0);
        }
    }
    let one = run(PagedAllocator::new(4096, P).unwrap(), &reqs[..1], None);
    assert_eq!((one.requests, one.request_runs.runs), (1, 1));
    assert_eq!(one.mean_run_len(), one.request_runs.pages as f64);
    // A lone request's transfer: one block for its prompt's pages.
    assert_eq!(one.transfer_blocks, 1);
}

/// On a pool that the workload keeps busy, best fit with growth in place gives requests fewer
/// runs than SGLang's LIFO order (whose decode pages come from wherever the last free was).
#[test]
fn best_fit_gives_fewer_runs_than_lifo_on_a_busy_pool() {
    let reqs = requests(48);
    let lifo = run(AnyAllocator::by_name("paged", 512, P).unwrap(), &reqs, None);
    let best = run(
        AnyAllocator::by_name("best_fit", 512, P).unwrap(),
        &reqs,
        None,
    );
    assert!(
        best.runs_per_request() < lifo.runs_per_request(),
        "best fit {} runs/request, lifo {}",
        best.runs_per_request(),
        lifo.runs_per_request()
    );
}
