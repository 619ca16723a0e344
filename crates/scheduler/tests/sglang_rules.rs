//! SGLang's exact rules where an earlier version of this crate differed, one test each: the
//! input budget of `add_one_req`, the size of a middle chunk, access times refreshed by
//! cache-aware ranking, in-batch prefix caching's key, and a mixed chunk that never retracts.

use kv_pool::{AnyAllocator, PagedAllocator};
use radix_cache::{policy::policy_from_name, AnyPrefixCache, PrefixCache, RadixCache};
use scheduler::{
    AddResult, Admission, Candidate, FakeExecutor, ForwardMode, PrefillAdder, SamplingLimits,
    SchedulePolicy, Scheduler, SchedulerConfig,
};

fn exec() -> FakeExecutor {
    FakeExecutor {
        vocab: 1000,
        seed: 42,
    }
}

/// A radix (LRU) scheduler with the allocator the engine picks for the page size.
fn sched(cfg: SchedulerConfig, pool: usize) -> Scheduler {
    let p = cfg.page_size;
    let cache = AnyPrefixCache::Radix(RadixCache::new(p, policy_from_name("lru").unwrap()));
    Scheduler::new(cfg, cache, AnyAllocator::for_page_size(pool, p).unwrap()).unwrap()
}

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        strict: true,
        context_len: 256,
        ..SchedulerConfig::default()
    }
}

fn tokens(base: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| base + i).collect()
}

/// Without chunking, a request after the first is refused once its page-rounded input reaches
/// what is left of `--max-prefill-tokens`: SGLang's `input_tokens >= rem_input_tokens`.
#[test]
fn input_budget_refuses_a_request_that_would_use_all_of_it() {
    let mut cache = RadixCache::new(1, policy_from_name("lru").unwrap());
    let alloc = PagedAllocator::new(4096, 1).unwrap();
    let root = cache.root(None);
    let mut a = PrefillAdder::new(1, 4096, 100, None, 1.0, [], 0);
    let req = |extend_input_len| Candidate {
        extend_input_len,
        remaining_new_tokens: 1,
        last_node: root,
    };
    assert!(matches!(
        a.add_one_req(req(40), &mut cache, &alloc),
        Admission::Admitted { extend: 40, .. }
    ));
    assert_eq!(a.rem_input_tokens, 60);
    assert_eq!(
        a.add_one_req(req(60), &mut cache, &alloc),
        Admission::Rejected(AddResult::Other)
    );
    assert!(matches!(
        a.add_one_req(req(59), &mut cache, &alloc),
        Admission::Admitted { extend: 59, .. }
    ));
}

/// The chunked request's next chunk is `min(rem_chunk, rem_total)` floored to whole pages; it
/// is never rounded up past the budget. With less than a page left (mixed decode tokens took
/// the rest) it sits the pass out.
#[test]
fn a_middle_chunk_never_exceeds_its_budget() {
    let cache = RadixCache::new(16, policy_from_name("lru").unwrap());
    let alloc = PagedAllocator::new(4096, 16).unwrap();
    let c = Candidate {
        extend_input_len: 100,
        remaining_new_tokens: 4,
        last_node: radix_cache::NodeId {
            index: 0,
            generation: 0,
        },
    };
    // Chunk 24 − 10 mixed decode tokens = 14 < one page.
    let mut a = PrefillAdder::new(16, 4096, 16384, Some(24), 1.0, [5; 10], 10);
    assert_eq!(
        a.add_chunked_req(c, &cache, &alloc),
        Admission::Rejected(AddResult::Other)
    );
    assert_eq!(a.admitted, 0, "nothing charged");
    // Chunk 50 − 10 = 40: two pages.
    let mut a = PrefillAdder::new(16, 4096, 16384, Some(50), 1.0, [5; 10], 10);
    assert_eq!(
        a.add_chunked_req(c, &cache, &alloc),
        Admission::Admitted {
            extend: 32,
            chunked: true,
            next: AddResult::Continue
        }
    );
    // The last chunk takes the remainder when it fits, page-aligned or not.
    let last = Candidate {
        extend_input_len: 37,
        ..c
    };
    let mut a = PrefillAdder::new(16, 4096, 16384, Some(50), 1.0, [5; 10], 10);
    assert!(matches!(
        a.add_chunked_req(last, &cache, &alloc),
        Admission::Admitted {
            extend: 37,
            chunked: false,
            ..
        }
    ));
}

/// Under LRU, ranking the waiting queue refreshes the prefixes waiting requests will use (as
/// SGLang's `match_prefix` in `calc_priority` does), so an allocation evicts a prefix nobody
/// waits for rather than the one the next request needs.
#[test]
fn ranking_keeps_the_prefixes_of_waiting_requests_recent() {
    let c = SchedulerConfig {
        schedule_policy: SchedulePolicy::Lpm,
        max_running_requests: 1,
        ..cfg()
    };
    let mut s = sched(c, 64);
    let mut e = exec();
    let (a, b, c) = (tokens(100, 16), tokens(200, 16), tokens(300, 16));
    // Cache A, then B, then C (A least recently used).
    for p in [&a, &b, &c] {
        s.add_request(p.clone(), SamplingLimits::max_new(1), 0, None)
            .unwrap();
        s.run_to_idle(&mut e, 10).unwrap();
    }
    assert_eq!(s.cache().total_size(), 48);
    // H extends C by 20 tokens and runs first (one request at a time); W waits for A.
    let h = [c.clone(), tokens(400, 20)].concat();
    let w = [a.clone(), tokens(500, 4)].concat();
    s.add_request(h, SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.add_request(w, SamplingLimits::max_new(1), 0, None)
        .unwrap();
    let r = s.step(&mut e).unwrap();
    assert!(r.evicted > 0, "H's prefill must evict: {r}");
    assert_eq!(
        s.cache().peek_prefix_len(&a, None),
        16,
        "A (W's prefix) kept"
    );
    assert!(
        s.cache().peek_prefix_len(&b, None) < 16,
        "B evicted instead"
    );
}

/// In-batch prefix caching matches `tokens[..len − 1]`, as the real cache does (SGLang's
/// `adjust_max_prefix_ids`): a request whose prompt is the first 32 tokens of an earlier
/// waiting request shares only 31 matchable tokens with it, under the threshold of 32, so it
/// keeps its place in the queue.
#[test]
fn in_batch_prefix_caching_matches_all_but_the_last_token() {
    let c = SchedulerConfig {
        schedule_policy: SchedulePolicy::Lpm,
        ..cfg()
    };
    let mut s = sched(c, 1024);
    let x = tokens(100, 40);
    let y = x[..32].to_vec();
    let z = tokens(600, 10);
    for p in [&x, &y, &z] {
        s.add_request(p.clone(), SamplingLimits::max_new(1), 0, None)
            .unwrap();
    }
    let r = s.step(&mut exec()).unwrap();
    assert_eq!(r.mode, Some(ForwardMode::Extend));
    let order: Vec<u64> = r.entries.iter().map(|e| e.id.0).collect();
    assert_eq!(order, [0, 1, 2], "{r}");
    // A real duplicate (33 shared tokens) is still sent back.
    let c = SchedulerConfig {
        schedule_policy: SchedulePolicy::Lpm,
        ..cfg()
    };
    let mut s = sched(c, 1024);
    for p in [&x, &x[..34].to_vec(), &z] {
        s.add_request(p.clone(), SamplingLimits::max_new(1), 0, None)
            .unwrap();
    }
    let r = s.step(&mut exec()).unwrap();
    let order: Vec<u64> = r.entries.iter().map(|e| e.id.0).collect();
    assert_eq!(order, [0, 2, 1], "{r}");
}

/// SGLang's mixed chunk runs no decode memory check and never retracts. When the pool cannot
/// give every running request its next slot after the prefill's allocation, the pass runs as
/// a plain extend and the running requests decode next step (where the check and retraction
/// belong).
#[test]
fn mixed_chunk_never_retracts() {
    let c = SchedulerConfig {
        page_size: 16,
        max_running_requests: 16,
        enable_mixed_chunk: true,
        chunked_prefill_size: None,
        schedule_conservativeness: 0.05,
        ..cfg()
    };
    let mut s = sched(c, 288);
    let mut e = exec();
    // (prompt length, first token, max_new_tokens), one arriving every other step.
    let reqs: [(usize, u32, usize); 10] = [
        (17, 912, 25),
        (19, 595, 11),
        (38, 207, 18),
        (23, 855, 13),
        (1, 487, 10),
        (15, 990, 11),
        (27, 915, 28),
        (2, 489, 13),
        (34, 597, 4),
        (13, 228, 19),
    ];
    let (mut next, mut plain_extend_beside_running) = (0, 0);
    for step in 0..500 {
        if next < reqs.len() && step % 2 == 0 {
            let (len, first, max_new) = reqs[next];
            let limits = SamplingLimits {
                max_new_tokens: max_new,
                ignore_eos: true,
                stop_token_ids: vec![],
            };
            s.add_request(tokens(first, len), limits, 0, None).unwrap();
            next += 1;
        }
        if next == reqs.len() && s.is_idle() {
            break;
        }
        let running = s.num_running();
        let r = s.step(&mut e).unwrap();
        if matches!(r.mode, Some(ForwardMode::Extend | ForwardMode::Mixed)) {
            assert!(r.retracted.is_empty(), "a prefill step retracted: {r}");
        }
        if running > 0 && r.mode == Some(ForwardMode::Extend) {
            plain_extend_beside_running += 1;
        }
    }
    assert!(s.is_idle());
    assert!(
        plain_extend_beside_running > 0,
        "the scenario must leave the decode tokens out once"
    );
    let done = s.take_finished();
    assert_eq!(done.len(), reqs.len());
    for f in done {
        assert_eq!(f.output_ids.len(), reqs[f.id.0 as usize].2);
    }
}

/// Requests sent back by in-batch prefix caching keep their queue order among themselves
/// (SGLang ranks them all `+inf`), whatever their cache hits.
#[test]
fn deprioritized_requests_keep_queue_order() {
    let c = SchedulerConfig {
        schedule_policy: SchedulePolicy::Lpm,
        ..cfg()
    };
    let mut s = sched(c, 1024);
    let mut e = exec();
    let x = tokens(100, 40);
    let y = tokens(300, 40);
    // Cache x's first 17 tokens: x and its near-duplicate hit 17 (≤ 32, so they are checked).
    s.add_request(x[..17].to_vec(), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.run_to_idle(&mut e, 10).unwrap();
    let near = |p: &[u32]| [&p[..38], &[7]].concat();
    // Queue: y (hit 0), y's near-duplicate (hit 0, sent back), x (hit 17), x's near-duplicate
    // (hit 17, sent back).
    for p in [y.clone(), near(&y), x.clone(), near(&x)] {
        s.add_request(p, SamplingLimits::max_new(1), 0, None)
            .unwrap();
    }
    let r = s.step(&mut e).unwrap();
    let order: Vec<u64> = r.entries.iter().map(|e| e.id.0).collect();
    assert_eq!(order, [3, 1, 2, 4], "{r}");
}
