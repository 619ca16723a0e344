//! Scheduler tests: scripted runs as step-by-step snapshots, budget arithmetic as SGLang's
//! PrefillAdder tests, and proptest over long random workloads with a deterministic fake model
//! (every request finishes or is aborted, no slot is lost, outputs do not depend on pool size,
//! chunk size or policy).

use kv_pool::{AnyAllocator, PagedAllocator};
use proptest::prelude::*;
use radix_cache::{policy::policy_from_name, AnyPrefixCache, ChunkCache, PrefixCache, RadixCache};
use scheduler::{
    AddResult, Admission, Candidate, FakeExecutor, FinishReason, PrefillAdder, SamplingLimits,
    SchedulePolicy, Scheduler, SchedulerConfig, SchedulerError,
};

mod common;
use common::{exec, expected_output, prompt, EOS};

/// A scheduler composed as the engine composes it: the radix cache (LRU) or the chunk cache,
/// and the allocator SGLang picks by page size (the token allocator at `P = 1`).
fn sched(cfg: SchedulerConfig, pool: usize, radix: bool) -> Scheduler {
    let p = cfg.page_size;
    let cache = if radix {
        AnyPrefixCache::Radix(RadixCache::new(p, policy_from_name("lru").unwrap()))
    } else {
        AnyPrefixCache::Chunk(ChunkCache::new(p))
    };
    Scheduler::new(cfg, cache, AnyAllocator::for_page_size(pool, p).unwrap()).unwrap()
}

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        strict: true,
        context_len: 256,
        max_running_requests: 8,
        ..SchedulerConfig::default()
    }
}

fn trace(s: &mut Scheduler, max_steps: u64) -> String {
    let mut e = exec();
    let reports = s.run_to_idle(&mut e, max_steps).unwrap();
    assert!(s.is_idle(), "not idle after {max_steps} steps");
    s.check_invariants().unwrap();
    reports.iter().map(|r| format!("{r}\n")).collect()
}

#[test]
fn snapshot_chunked_prefill_retraction_and_rows() {
    // The seed's picture: a long prompt chunked into three pieces (5a, 5b, 5c), short requests
    // alongside, and a pool too small for every request to decode to the end: one is retracted,
    // re-queued and recomputed; finished requests release their rows.
    // Optimistic admission (conservativeness 0.2: reserve 14 % of each remaining output) lets
    // more decoders in than the pool can finish.
    let c = SchedulerConfig {
        page_size: 4,
        chunked_prefill_size: Some(16),
        max_prefill_tokens: 64,
        schedule_conservativeness: 0.1,
        ..cfg()
    };
    let mut s = sched(c, 128, true);
    let mut e = exec();
    let mut log = String::new();
    // The long request first (chunked 16 + 16 + 8), then one short request per step: each is
    // admitted next to running requests whose future growth is discounted, so together they
    // outgrow the pool.
    let long = s
        .add_request(prompt(5, 40), SamplingLimits::max_new(4), 0, None)
        .unwrap();
    for _ in 0..3 {
        log += &format!("{}\n", s.step(&mut e).unwrap());
    }
    for i in 0..3 {
        s.add_request(prompt(i, 10), SamplingLimits::max_new(40), 0, None)
            .unwrap();
        log += &format!("{}\n", s.step(&mut e).unwrap());
    }
    log += &trace(&mut s, 300);
    let finished = s.take_finished();
    assert_eq!(finished.len(), 4);
    assert!(
        finished.iter().any(|f| f.retractions > 0),
        "the pool is sized to force a retraction:\n{log}"
    );
    for f in &finished {
        let input = if f.id == long {
            prompt(5, 40)
        } else {
            prompt(f.id.0 as u32 - 1, 10)
        };
        let (out, why) = expected_output(
            &input,
            &SamplingLimits::max_new(if f.id == long { 4 } else { 40 }),
        );
        assert_eq!((&f.output_ids, &f.reason), (&out, &why), "{}", f.id);
    }
    insta::assert_snapshot!(log);
}

#[test]
fn snapshot_lpm_versus_fcfs_order() {
    // Three requests share a 24-token prefix that one earlier request cached; LPM runs them
    // before the cold request that arrived first, FCFS keeps arrival order.
    let mut out = String::new();
    for policy in [SchedulePolicy::Fcfs, SchedulePolicy::Lpm] {
        let c = SchedulerConfig {
            schedule_policy: policy,
            max_running_requests: 2,
            ..cfg()
        };
        let mut s = sched(c, 512, true);
        let shared = prompt(9, 24);
        s.add_request(shared.clone(), SamplingLimits::max_new(1), 0, None)
            .unwrap();
        trace(&mut s, 10);
        s.add_request(prompt(1, 40), SamplingLimits::max_new(2), 0, None)
            .unwrap();
        for k in 0..3 {
            let mut p = shared.clone();
            p.extend([900 + k, 901 + k]);
            s.add_request(p, SamplingLimits::max_new(2), 0, None)
                .unwrap();
        }
        out += &format!("== {policy}\n{}", trace(&mut s, 50));
    }
    insta::assert_snapshot!(out);
}

#[test]
fn snapshot_dfs_weight_order() {
    // Cached tree: A (16 tokens) with children A1, A2 and a separate B. Waiting: two requests
    // under A1, one under A2, one under B, one cold. DFS-weight runs the A1 pair first.
    let c = SchedulerConfig {
        schedule_policy: SchedulePolicy::DfsWeight,
        max_running_requests: 1,
        ..cfg()
    };
    let mut s = sched(c, 1024, true);
    let a = prompt(1, 16);
    let with = |base: &[u32], tail: &[u32]| base.iter().chain(tail).copied().collect::<Vec<u32>>();
    let a1 = with(&a, &[501; 8]);
    let a2 = with(&a, &[502; 8]);
    let b = prompt(2, 16);
    for p in [&a1, &a2, &b] {
        s.add_request(p.clone(), SamplingLimits::max_new(1), 0, None)
            .unwrap();
    }
    trace(&mut s, 20);
    s.add_request(prompt(3, 20), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.add_request(with(&b, &[1, 2]), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.add_request(with(&a2, &[3, 4]), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.add_request(with(&a1, &[5, 6]), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    s.add_request(with(&a1, &[7, 8]), SamplingLimits::max_new(1), 0, None)
        .unwrap();
    insta::assert_snapshot!(trace(&mut s, 30));
}

#[test]
fn snapshot_priority_preemption() {
    // A low-priority request fills the pool; a request 20 priority points higher arrives and
    // preempts it (threshold 10); the low one is recomputed afterwards and still finishes right.
    let c = SchedulerConfig {
        enable_priority_scheduling: true,
        page_size: 4,
        ..cfg()
    };
    let mut s = sched(c, 64, false);
    let low = s
        .add_request(prompt(1, 20), SamplingLimits::max_new(30), 0, None)
        .unwrap();
    let mut e = exec();
    let mut log = String::new();
    for _ in 0..3 {
        log += &format!("{}\n", s.step(&mut e).unwrap());
    }
    let high = s
        .add_request(prompt(2, 24), SamplingLimits::max_new(4), 20, None)
        .unwrap();
    log += &trace(&mut s, 200);
    let f = s.take_finished();
    let order: Vec<_> = f.iter().map(|f| f.id).collect();
    assert_eq!(
        order,
        [high, low],
        "the high-priority request finishes first"
    );
    assert!(f[1].retractions >= 1);
    assert_eq!(
        f[1].output_ids,
        expected_output(&prompt(1, 20), &SamplingLimits::max_new(30)).0
    );
    insta::assert_snapshot!(log);
}

#[test]
fn snapshot_abort_mid_chunk() {
    let c = SchedulerConfig {
        page_size: 4,
        chunked_prefill_size: Some(8),
        ..cfg()
    };
    let mut s = sched(c, 128, true);
    let long = s
        .add_request(prompt(1, 30), SamplingLimits::max_new(3), 0, None)
        .unwrap();
    s.add_request(prompt(2, 6), SamplingLimits::max_new(3), 0, None)
        .unwrap();
    let mut e = exec();
    let mut log = String::new();
    for _ in 0..2 {
        log += &format!("{}\n", s.step(&mut e).unwrap());
    }
    s.abort(long, "client went away").unwrap();
    s.check_invariants().unwrap();
    log += "abort r0\n";
    log += &trace(&mut s, 50);
    let f = s.take_finished();
    assert!(
        matches!(&f[0].reason, FinishReason::Abort { message } if message == "client went away")
    );
    // Its two chunks stay cached for whoever asks next.
    assert_eq!(s.cache().total_size() % 4, 0);
    assert!(s.cache().total_size() >= 16);
    insta::assert_snapshot!(log);
}

#[test]
fn bad_requests_and_config_are_typed_errors() {
    let mut s = sched(
        SchedulerConfig {
            max_queued_requests: Some(1),
            ..cfg()
        },
        64,
        true,
    );
    assert!(matches!(
        s.add_request(vec![], SamplingLimits::max_new(1), 0, None),
        Err(SchedulerError::InvalidRequest(_))
    ));
    assert!(matches!(
        s.add_request(vec![1; 300], SamplingLimits::max_new(1), 0, None),
        Err(SchedulerError::InvalidRequest(_))
    ));
    assert!(matches!(
        s.add_request(vec![1], SamplingLimits::max_new(0), 0, None),
        Err(SchedulerError::InvalidRequest(_))
    ));
    s.add_request(vec![1, 2], SamplingLimits::max_new(1), 0, None)
        .unwrap();
    assert_eq!(
        s.add_request(vec![1, 2], SamplingLimits::max_new(1), 0, None),
        Err(SchedulerError::QueueFull { limit: 1 })
    );
    assert!(matches!(
        s.abort(scheduler::ReqId(99), "x"),
        Err(SchedulerError::UnknownRequest(_))
    ));
    let bad = SchedulerConfig {
        enable_priority_scheduling: true,
        schedule_policy: SchedulePolicy::Lpm,
        ..cfg()
    };
    assert!(Scheduler::new(bad, ChunkCache::new(1), PagedAllocator::new(8, 1).unwrap()).is_err());
    let mismatch = SchedulerConfig {
        page_size: 4,
        ..cfg()
    };
    assert!(Scheduler::new(
        mismatch,
        ChunkCache::new(1),
        PagedAllocator::new(8, 1).unwrap()
    )
    .is_err());
    assert!("lpm2".parse::<SchedulePolicy>().is_err());
}

#[test]
fn a_request_that_can_never_fit_is_aborted_not_hung() {
    let mut s = sched(
        SchedulerConfig {
            page_size: 4,
            ..cfg()
        },
        16,
        true,
    );
    s.add_request(prompt(1, 40), SamplingLimits::max_new(4), 0, None)
        .unwrap();
    trace(&mut s, 10);
    let f = s.take_finished();
    assert!(
        matches!(&f[0].reason, FinishReason::Abort { message } if message.contains("16 slots")),
        "{:?}",
        f[0].reason
    );
}

#[test]
fn stop_tokens_finish_unless_ignore_eos() {
    let e = exec();
    // Find a prompt whose first generated token is EOS-like: use that token as the stop id.
    let p = prompt(3, 5);
    let first = e.next_token(*p.last().unwrap(), 4);
    for ignore in [false, true] {
        let mut s = sched(cfg(), 64, true);
        let limits = SamplingLimits {
            max_new_tokens: 5,
            ignore_eos: ignore,
            stop_token_ids: vec![first, EOS],
        };
        s.add_request(p.clone(), limits, 0, None).unwrap();
        trace(&mut s, 20);
        let f = s.take_finished();
        if ignore {
            assert_eq!(f[0].output_ids.len(), 5);
        } else {
            assert_eq!(
                (f[0].output_ids.clone(), f[0].reason.clone()),
                (vec![first], FinishReason::Stop { token: first })
            );
        }
    }
}

// ----- PrefillAdder budget arithmetic, as SGLang's test_prefill_adder.py ---------------------------

#[test]
fn adder_budgets_with_mixed_chunk() {
    // 8 running requests, each with 50 tokens left, new_token_ratio 1, mixed chunk (8 decode
    // tokens in the pass): input budget 200 − 8 = 192, chunk 64 − 8 = 56, total offset 8 + 8 × 50.
    let a = PrefillAdder::new(1, 4096, 200, Some(64), 1.0, [50; 8], 8);
    assert_eq!(a.rem_input_tokens, 192);
    assert_eq!(a.rem_chunk_tokens, Some(56));
    assert_eq!(a.rem_total_offset, (8 + 8 * 50) as f64);
    assert_eq!(a.cur_rem_offset, 8);
}

#[test]
fn adder_clips_and_charges_pages() {
    let cache = RadixCache::new(16, policy_from_name("lru").unwrap());
    let mut cache: Box<dyn PrefixCache> = Box::new(cache);
    let alloc = PagedAllocator::new(4096, 16).unwrap();
    // A running request with 10,000 tokens left reserves only min(10000, 4096) × 0.5.
    let mut a = PrefillAdder::new(16, 4096, 1000, None, 0.5, [10_000], 0);
    assert_eq!(a.rem_total_offset, 2048.0);
    let root = cache.root(None);
    let c = Candidate {
        extend_input_len: 100,
        remaining_new_tokens: 64,
        last_node: root,
    };
    let r = a.add_one_req(c, &mut *cache, &alloc);
    assert!(matches!(
        r,
        Admission::Admitted {
            extend: 100,
            chunked: false,
            next: AddResult::Continue
        }
    ));
    // Charged: input 112 (rounded to pages), + 64 + one page.
    assert_eq!(a.rem_total_offset, 2048.0 + 112.0 + 64.0 + 16.0);
    assert_eq!(a.cur_rem_offset, 112 + 16);
    assert_eq!(a.rem_input_tokens, 1000 - 112);
    // A request that does not fit the total budget: NO_TOKEN.
    let big = Candidate {
        extend_input_len: 2000,
        remaining_new_tokens: 64,
        last_node: root,
    };
    assert_eq!(
        a.add_one_req(big, &mut *cache, &alloc),
        Admission::Rejected(AddResult::NoToken)
    );
    // Without chunking, a second request larger than the input budget left: OTHER.
    let wide = Candidate {
        extend_input_len: 900,
        remaining_new_tokens: 1,
        last_node: root,
    };
    assert_eq!(
        a.add_one_req(wide, &mut *cache, &alloc),
        Admission::Rejected(AddResult::Other)
    );
}

#[test]
fn adder_chunks_at_page_boundaries() {
    let mut cache: Box<dyn PrefixCache> =
        Box::new(RadixCache::new(16, policy_from_name("lru").unwrap()));
    let alloc = PagedAllocator::new(4096, 16).unwrap();
    let root = cache.root(None);
    let mut a = PrefillAdder::new(16, 4096, 16384, Some(100), 1.0, [], 0);
    let c = Candidate {
        extend_input_len: 300,
        remaining_new_tokens: 10,
        last_node: root,
    };
    // 100 tokens of chunk budget → a 96-token (page-aligned) chunk, no decode reservation.
    assert_eq!(
        a.add_one_req(c, &mut *cache, &alloc),
        Admission::Admitted {
            extend: 96,
            chunked: true,
            next: AddResult::Continue
        }
    );
    assert_eq!(a.rem_total_offset, (96 + 16) as f64);
}

// ----- proptest: random workloads ------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Workload {
    reqs: Vec<(Vec<u32>, SamplingLimits, i64)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    let req = (0u32..4, 1usize..60, 1usize..40, any::<bool>(), -3i64..3).prop_map(
        |(family, len, max_new, stop, prio)| {
            // Families share prefixes, so the cache has something to reuse.
            let mut p = prompt(family, 24);
            p.truncate(len.min(24));
            p.extend(prompt(family * 7 + len as u32, len.saturating_sub(24)));
            let limits = SamplingLimits {
                max_new_tokens: max_new,
                ignore_eos: false,
                stop_token_ids: if stop { vec![EOS, 11, 13] } else { vec![] },
            };
            (p, limits, prio)
        },
    );
    prop::collection::vec(req, 1..32).prop_map(|reqs| Workload { reqs })
}

fn run(
    w: &Workload,
    c: SchedulerConfig,
    pool: usize,
    radix: bool,
    arrivals_every: usize,
) -> Vec<(usize, Vec<u32>, FinishReason)> {
    let mut s = sched(c, pool, radix);
    let mut e = exec();
    let mut ids = Vec::new();
    let mut next = 0;
    for step in 0..20_000 {
        while next < w.reqs.len() && (arrivals_every == 0 || step % arrivals_every == 0) {
            let (p, l, prio) = &w.reqs[next];
            ids.push(s.add_request(p.clone(), l.clone(), *prio, None).unwrap());
            next += 1;
            if arrivals_every != 0 {
                break;
            }
        }
        if next == w.reqs.len() && s.is_idle() {
            break;
        }
        s.step(&mut e).unwrap();
    }
    assert!(s.is_idle(), "did not finish");
    s.check_invariants().unwrap();
    assert_eq!(
        s.allocator().available_size() + s.cache().evictable_size(),
        s.allocator().size()
    );
    let mut out: Vec<_> = s
        .take_finished()
        .into_iter()
        .map(|f| {
            (
                ids.iter().position(|&i| i == f.id).unwrap(),
                f.output_ids,
                f.reason,
            )
        })
        .collect();
    out.sort_by_key(|o| o.0);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_finish_correctly_under_any_configuration(
        w in workload(),
        page in prop::sample::select(vec![1u32, 4, 16]),
        policy in prop::sample::select(SchedulePolicy::ALL.to_vec()),
        chunk in prop::sample::select(vec![None, Some(16usize), Some(48)]),
        pool_pages in 6usize..40,
        radix in any::<bool>(),
        mixed in any::<bool>(),
        arrivals_every in 0usize..3,
        conservativeness in prop::sample::select(vec![0.05f64, 0.3, 1.0]),
    ) {
        let p = page as usize;
        let c = SchedulerConfig {
            page_size: page,
            schedule_policy: policy,
            chunked_prefill_size: chunk.map(|c| c.max(p)),
            max_prefill_tokens: 96,
            enable_mixed_chunk: mixed,
            schedule_conservativeness: conservativeness,
            seed: 3,
            ..cfg()
        };
        // The pool always fits the largest single request (prompt ≤ 60 + output ≤ 40 + a page).
        let pool = (pool_pages * p).max(104 + 2 * p).div_ceil(p) * p;
        let got = run(&w, c, pool, radix, arrivals_every);
        prop_assert_eq!(got.len(), w.reqs.len());
        for (i, out, why) in got {
            let (p, l, _) = &w.reqs[i];
            let (eo, ew) = expected_output(p, l);
            prop_assert_eq!(&out, &eo, "request {}", i);
            prop_assert_eq!(&why, &ew, "request {}", i);
        }
    }
}

/// Pages of 4, chunks of 16, a 512-token pool, the radix cache: the failure tests' scheduler.
fn chunked_sched() -> Scheduler {
    let c = SchedulerConfig {
        page_size: 4,
        chunked_prefill_size: Some(16),
        ..cfg()
    };
    sched(c, 512, true)
}

/// Exactly 4 new tokens (EOS ignored).
fn four_tokens() -> SamplingLimits {
    SamplingLimits {
        max_new_tokens: 4,
        ignore_eos: true,
        stop_token_ids: vec![],
    }
}

/// A request whose pass gives no token (the executor names it in `failed`: its logits were not
/// finite) is aborted alone with the executor's message, at any step of its life: in its first
/// chunk, its last chunk or a decode step, alone or in a mixed batch. Its KV is released, and
/// the requests beside it get the tokens they get without it. A result whose failures name a
/// request twice or one outside the batch fails the whole pass.
#[test]
fn a_request_whose_pass_gives_no_token_is_aborted_alone() {
    /// The fake model, except that request `victim` fails on its `at`-th sampled or unsampled
    /// pass (0-based); with `malformed`, the failure names a request outside the batch.
    struct Picky {
        inner: FakeExecutor,
        victim: scheduler::ReqId,
        at: usize,
        seen: usize,
        malformed: bool,
    }
    impl scheduler::Executor for Picky {
        fn forward(
            &mut self,
            batch: &scheduler::ForwardBatch,
            rows: &kv_pool::ReqToTokenPool,
        ) -> Result<scheduler::BatchResult, String> {
            let mut out = self.inner.forward(batch, rows)?;
            if let Some(k) = batch.reqs.iter().position(|&id| id == self.victim) {
                if self.seen == self.at {
                    out.failed.push(scheduler::RequestFailure {
                        index: if self.malformed { batch.len() } else { k },
                        message: "logits hold NaN".into(),
                    });
                }
                self.seen += 1;
            }
            Ok(out)
        }
    }
    let limits = four_tokens();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(2 + i, 24 + 5 * i as usize)).collect();
    for malformed in [false, true] {
        // Passes of the victim: 2 chunks of 16 for its 24 tokens, then 3 decodes.
        for at in 0..5 {
            let mut s = chunked_sched();
            let ids: Vec<_> = prompts
                .iter()
                .map(|p| s.add_request(p.clone(), limits.clone(), 0, None).unwrap())
                .collect();
            let mut e = Picky {
                inner: exec(),
                victim: ids[0],
                at,
                seen: 0,
                malformed,
            };
            s.run_to_idle(&mut e, 100).unwrap();
            s.check_invariants().unwrap();
            let done = s.take_finished();
            assert_eq!(done.len(), 3);
            let mut aborted = Vec::new();
            for (id, p) in ids.iter().zip(&prompts) {
                let f = done.iter().find(|f| f.id == *id).unwrap();
                match &f.reason {
                    FinishReason::Abort { message } => {
                        let why = if malformed {
                            "a batch of"
                        } else {
                            "logits hold NaN"
                        };
                        assert!(message.contains(why), "at {at}: {message}");
                        aborted.push(*id);
                    }
                    _ => assert_eq!(
                        (f.output_ids.clone(), f.reason.clone()),
                        expected_output(p, &limits),
                        "at {at}, malformed {malformed}"
                    ),
                }
            }
            assert!(aborted.contains(&ids[0]), "at {at}: the victim is aborted");
            if !malformed {
                assert_eq!(aborted, [ids[0]], "at {at}: only the victim");
            }
        }
    }
}

/// A forward pass that fails (a device error) ends only its batch's requests, with the
/// executor's message; their KV is released, the pool partition holds, and later requests
/// are served as if nothing happened.
#[test]
fn a_failed_forward_pass_aborts_its_batch_and_the_scheduler_goes_on() {
    /// Fails its `fail_at`-th call (0-based), otherwise the fake model.
    struct Flaky {
        inner: FakeExecutor,
        calls: usize,
        fail_at: usize,
    }
    impl scheduler::Executor for Flaky {
        fn forward(
            &mut self,
            batch: &scheduler::ForwardBatch,
            rows: &kv_pool::ReqToTokenPool,
        ) -> Result<scheduler::BatchResult, String> {
            self.calls += 1;
            if self.calls - 1 == self.fail_at {
                return Err("device lost".into());
            }
            self.inner.forward(batch, rows)
        }
    }
    for fail_at in 0..6 {
        let mut s = chunked_sched();
        let limits = four_tokens();
        for i in 0..3 {
            s.add_request(prompt(1, 24 + i), limits.clone(), 0, None)
                .unwrap();
        }
        let mut e = Flaky {
            inner: exec(),
            calls: 0,
            fail_at,
        };
        s.run_to_idle(&mut e, 100).unwrap();
        s.check_invariants().unwrap();
        let done = s.take_finished();
        assert_eq!(done.len(), 3);
        let aborted: Vec<_> = done
            .iter()
            .filter(|f| matches!(&f.reason, FinishReason::Abort { message } if message.contains("device lost")))
            .collect();
        assert!(
            !aborted.is_empty(),
            "fail_at {fail_at}: the failed batch is aborted"
        );
        // The scheduler goes on: a new request runs to its length with the right tokens.
        let p = prompt(1, 30);
        let id = s.add_request(p.clone(), limits.clone(), 0, None).unwrap();
        s.run_to_idle(&mut e, 100).unwrap();
        s.check_invariants().unwrap();
        let f = s.take_finished();
        assert_eq!(f[0].id, id);
        assert_eq!(
            (f[0].output_ids.clone(), f[0].reason.clone()),
            expected_output(&p, &limits),
            "fail_at {fail_at}"
        );
    }
}
