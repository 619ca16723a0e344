//! PD disaggregation's scheduler queues: the prefill side holding KV after its one token
//! (which pages become sendable when, when KV is released), the decode side's preallocation
//! budget, incremental prefix and commit, typed errors, abort in every stage, proptest over
//! random interleavings (invariants after every operation, nothing leaked at the end), and a
//! prefill + decode pair producing a single scheduler's tokens.

use std::collections::HashMap;

use kv_pool::{AnyAllocator, Page};
use proptest::prelude::*;
use radix_cache::{policy::policy_from_name, AnyPrefixCache, RadixCache};
use scheduler::{
    FinishReason, FinishedReq, PreallocStop, Preallocated, ReqId, ReqStage, SamplingLimits,
    Scheduler, SchedulerConfig, SchedulerError,
};

mod common;
use common::{exec, expected_output, prompt, EOS};

/// A scheduler over a radix cache (LRU) and the allocator SGLang picks by page size.
fn sched(cfg: SchedulerConfig, pool: usize) -> Scheduler {
    let p = cfg.page_size;
    let cache = AnyPrefixCache::Radix(RadixCache::new(p, policy_from_name("lru").unwrap()));
    Scheduler::new(cfg, cache, AnyAllocator::for_page_size(pool, p).unwrap()).unwrap()
}

fn cfg(page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        page_size,
        strict: true,
        context_len: 4096,
        max_running_requests: 8,
        ..SchedulerConfig::default()
    }
}

/// The decode server's configuration: sorted release on, as the engine sets it.
fn decode_cfg(page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        need_sort: true,
        ..cfg(page_size)
    }
}

/// A decode scheduler reserving `reserve` tokens per active request (SGLang: 512).
fn decode_sched(page_size: u32, reserve: usize, pool: usize) -> Scheduler {
    let c = SchedulerConfig {
        num_reserved_decode_tokens: reserve,
        ..decode_cfg(page_size)
    };
    sched(c, pool)
}

fn limits(max_new: usize) -> SamplingLimits {
    SamplingLimits {
        max_new_tokens: max_new,
        ignore_eos: true,
        stop_token_ids: vec![],
    }
}

/// The fake model's first token after `prompt` (what a prefill server samples).
fn first_token(prompt: &[u32]) -> u32 {
    exec().next_token(*prompt.last().unwrap(), prompt.len() as u32 - 1)
}

/// The pages of `slots`, one per `P` slots (slots of one request page share a page).
fn pages_of(slots: &[kv_pool::Slot], p: u32) -> Vec<Page> {
    slots
        .iter()
        .step_by(p as usize)
        .map(|s| s.page(p))
        .collect()
}

fn render_pages(pages: &[Page]) -> String {
    let v: Vec<String> = pages.iter().map(|p| p.0.to_string()).collect();
    format!("[{}]", v.join(" "))
}

fn pool_line(s: &Scheduler) -> String {
    format!(
        "available {} evictable {} protected {} rows held {}",
        s.allocator().available_size(),
        s.cache().evictable_size(),
        s.cache().protected_size(),
        s.held_rows().len()
    )
}

// ----- prefill: KV held until transferred ---------------------------------------------------------

/// Prefill with chunked prefill (chunks of 8, pages of 4): after every step, each held-marked
/// request's whole committed pages are sendable (all of them once it holds), and a page once
/// sendable keeps its physical page until release; the KV stays put after the one token until
/// `release_held`, which caches the prompt.
#[test]
fn snapshot_prefill_holds_kv_and_pages_become_sendable() {
    let p = 4;
    let mut s = sched(
        SchedulerConfig {
            chunked_prefill_size: Some(8),
            ..cfg(p)
        },
        128,
    );
    let prompts = [prompt(1, 21), prompt(2, 10)];
    let mut ids = Vec::new();
    for pr in &prompts {
        let id = s.add_request(pr.clone(), limits(1), 0, None).unwrap();
        s.hold_kv_at_finish(id).unwrap();
        ids.push(id);
    }
    let mut e = exec();
    let mut sent: HashMap<ReqId, Vec<Page>> = HashMap::new();
    let mut log = String::new();
    while !s.is_idle() {
        let rep = s.step(&mut e).unwrap();
        log += &format!("{rep}\n");
        for f in s.take_finished() {
            log += &format!(
                "  finished {} output {:?} kv_held {}\n",
                f.id, f.output_ids, f.kv_held
            );
        }
        for &id in &ids {
            let Some(stage) = s.stage(id) else { continue };
            let slots = s.committed_slots(id).unwrap();
            let whole = if stage == ReqStage::Held {
                slots.len().div_ceil(p as usize)
            } else {
                slots.len() / p as usize
            };
            let pages = pages_of(slots, p)[..whole].to_vec();
            let before = sent.entry(id).or_default();
            assert_eq!(
                &pages[..before.len()],
                &before[..],
                "{id}: a sent page moved"
            );
            log += &format!(
                "  {id} {stage}: committed {} sendable {} new {}\n",
                slots.len(),
                render_pages(&pages),
                render_pages(&pages[before.len()..])
            );
            *before = pages;
        }
        log += &format!("  pool: {}\n", pool_line(&s));
    }
    assert_eq!(s.num_held(), 2);
    assert!(s.has_pd_work() && s.is_idle());
    for &id in ids.iter().rev() {
        s.release_held(id).unwrap();
        log += &format!("release {id}: {}\n", pool_line(&s));
    }
    assert!(!s.has_pd_work());
    s.check_invariants().unwrap();
    insta::assert_snapshot!(log);
}

/// Hold marks: idempotent; an aborted marked request holds nothing; a held request's abort
/// releases it without a second report; `release_held` of a request that holds nothing is a
/// typed error.
#[test]
fn hold_marks_aborts_and_typed_errors() {
    let mut s = sched(cfg(4), 256);
    let a = s.add_request(prompt(1, 9), limits(1), 0, None).unwrap();
    let b = s.add_request(prompt(2, 9), limits(1), 0, None).unwrap();
    s.hold_kv_at_finish(a).unwrap();
    s.hold_kv_at_finish(a).unwrap();
    s.hold_kv_at_finish(b).unwrap();
    assert_eq!(
        s.hold_kv_at_finish(ReqId(99)),
        Err(SchedulerError::UnknownRequest(ReqId(99)))
    );
    assert_eq!(
        s.release_held(a),
        Err(SchedulerError::WrongStage {
            id: a,
            expected: ReqStage::Held,
            found: ReqStage::Waiting
        })
    );
    s.abort(b, "client left").unwrap();
    s.run_to_idle(&mut exec(), 10).unwrap();
    let done = s.take_finished();
    assert_eq!(done.len(), 2);
    assert!(!done[0].kv_held && done[1].kv_held, "{done:?}");
    assert_eq!(s.held(), &[a]);
    s.check_invariants().unwrap();
    // Aborting the held request releases it and reports nothing new.
    s.abort(a, "transfer failed").unwrap();
    assert!(s.take_finished().is_empty());
    assert_eq!(s.num_held(), 0);
    assert_eq!(s.release_held(a), Err(SchedulerError::UnknownRequest(a)));
    s.check_invariants().unwrap();
    assert_eq!(s.cache().protected_size(), 0);
}

// ----- decode: prealloc → transfer → running ------------------------------------------------------

fn render_prealloc(s: &Scheduler, got: &[Preallocated]) -> String {
    let mut out = format!("{}", s.last_prealloc_pass());
    for g in got {
        let r = s.request(g.id).unwrap();
        out += &format!(
            "  {} preallocated: prompt {} decode_prefix_len {} pages {} (first {}, last {})\n",
            g.id,
            r.input_len,
            g.prefix_len,
            g.pages.len(),
            g.pages.first().map_or(0, |p| p.0),
            g.pages.last().map_or(0, |p| p.0),
        );
    }
    out
}

fn commit(s: &mut Scheduler, id: ReqId) {
    let pr = s.request(id).unwrap().tokens.clone();
    s.commit_transferred(id, &[first_token(&pr)]).unwrap();
}

/// The decode side with SGLang's constants (512 reserved per request, clip 4096): the budget
/// admits two 1000-token prompts and refuses a third; with the two running it still refuses
/// (their reserve); after they finish the third fits; a fourth request with the first one's
/// prompt preallocates only the delta (decode_prefix_len 992 of 1000, one page); every output
/// equals the fake model's.
#[test]
fn snapshot_decode_prealloc_budget_prefix_and_commit() {
    let mut s = sched(decode_cfg(16), 4096);
    let reqs = [
        (prompt(1, 1000), limits(8)),
        (prompt(2, 1000), limits(8)),
        (prompt(3, 1500), limits(2000)),
        (prompt(1, 1000), limits(5)),
    ];
    let ids: Vec<ReqId> = reqs[..3]
        .iter()
        .map(|(p, l)| {
            s.add_prealloc_request(p.clone(), l.clone(), 0, None)
                .unwrap()
        })
        .collect();
    let mut e = exec();
    let mut log = String::new();
    let got = s.pop_preallocated().unwrap();
    log += &format!("pass 1\n{}", render_prealloc(&s, &got));
    assert_eq!(s.num_transferring(), 2);
    assert_eq!(s.num_prealloc_queued(), 1);
    for g in &got {
        commit(&mut s, g.id);
    }
    let got = s.pop_preallocated().unwrap();
    log += &format!("pass 2 (r0 r1 running)\n{}", render_prealloc(&s, &got));
    for r in s.run_to_idle(&mut e, 100).unwrap() {
        log += &format!("{r}\n");
    }
    log += &format!("  pool: {}\n", pool_line(&s));
    let got = s.pop_preallocated().unwrap();
    log += &format!("pass 3\n{}", render_prealloc(&s, &got));
    let id3 = s
        .add_prealloc_request(reqs[3].0.clone(), reqs[3].1.clone(), 0, None)
        .unwrap();
    let got4 = s.pop_preallocated().unwrap();
    log += &format!(
        "pass 4 (r3 has r0's prompt)\n{}",
        render_prealloc(&s, &got4)
    );
    assert_eq!(got4[0].prefix_len, 992);
    assert_eq!(got4[0].pages.len(), 1);
    for g in got.iter().chain(&got4) {
        commit(&mut s, g.id);
    }
    let reports = s.run_to_idle(&mut e, 5000).unwrap();
    log += &format!("{} decode steps\n", reports.len());
    log += &format!("  pool: {}\n", pool_line(&s));
    assert!(!s.has_pd_work());
    s.check_invariants().unwrap();
    let done = s.take_finished();
    let all: Vec<ReqId> = ids.iter().copied().chain([id3]).collect();
    for f in &done {
        let k = all.iter().position(|&i| i == f.id).unwrap();
        let (p, l) = &reqs[k];
        assert_eq!(
            (f.output_ids.clone(), f.reason.clone()),
            expected_output(p, l)
        );
        log += &format!(
            "{} {}: {} tokens, cached {}\n",
            f.id,
            f.reason,
            f.output_ids.len(),
            f.cached_tokens
        );
    }
    insta::assert_snapshot!(log);
}

/// A first token that finishes the request (max_new_tokens 1, or a stop token) finishes it at
/// commit, its prompt cached; the typed errors of `commit_transferred` change nothing.
#[test]
fn commit_finishes_at_once_and_refuses_bad_input() {
    let mut s = decode_sched(4, 16, 256);
    let pa = prompt(1, 17);
    let stop = first_token(&prompt(2, 13));
    let a = s
        .add_prealloc_request(pa.clone(), limits(1), 0, None)
        .unwrap();
    let b_limits = SamplingLimits {
        max_new_tokens: 50,
        ignore_eos: false,
        stop_token_ids: vec![stop],
    };
    let b = s
        .add_prealloc_request(prompt(2, 13), b_limits, 0, None)
        .unwrap();
    let q = s
        .add_prealloc_request(prompt(3, 9), limits(3), 0, None)
        .unwrap();
    // Not yet preallocated: the wrong stage.
    assert_eq!(
        s.commit_transferred(a, &[1]),
        Err(SchedulerError::WrongStage {
            id: a,
            expected: ReqStage::Transferring,
            found: ReqStage::PreallocQueued
        })
    );
    let got = s.pop_preallocated().unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(
        s.commit_transferred(ReqId(77), &[1]),
        Err(SchedulerError::UnknownRequest(ReqId(77)))
    );
    assert!(matches!(
        s.commit_transferred(a, &[]),
        Err(SchedulerError::InvalidRequest(m)) if m.contains("exactly one")
    ));
    assert!(matches!(
        s.commit_transferred(a, &[1, 2]),
        Err(SchedulerError::InvalidRequest(_))
    ));
    assert_eq!(s.stage(a), Some(ReqStage::Transferring));
    s.check_invariants().unwrap();
    commit(&mut s, a);
    commit(&mut s, b);
    let done = s.take_finished();
    assert_eq!(done.len(), 2);
    assert_eq!(done[0].reason, FinishReason::Length { length: 1 });
    assert_eq!(done[0].output_ids, vec![first_token(&pa)]);
    assert_eq!(done[1].reason, FinishReason::Stop { token: stop });
    // Both prompts are cached (page-aligned parts), nothing is locked but q's prefix.
    assert_eq!(s.cache().evictable_size(), 16 + 12);
    assert_eq!(s.stage(q), Some(ReqStage::Transferring));
    s.abort(q, "prefill died").unwrap();
    assert!(!s.has_pd_work() && s.is_idle());
    s.check_invariants().unwrap();
}

/// Abort in every stage frees what that stage holds: a transferring request's delta pages go
/// back and its decode prefix is unlocked; a prealloc-queued one just leaves.
#[test]
fn abort_in_every_decode_stage_frees_everything() {
    let mut s = decode_sched(4, 8, 128);
    // Cache a prompt first, so the next request locks a decode prefix.
    let pr = prompt(1, 30);
    let a = s
        .add_prealloc_request(pr.clone(), limits(2), 0, None)
        .unwrap();
    s.pop_preallocated().unwrap();
    commit(&mut s, a);
    s.run_to_idle(&mut exec(), 10).unwrap();
    let cached = s.cache().evictable_size();
    assert_eq!(cached, 28);
    let b = s
        .add_prealloc_request(pr.clone(), limits(4), 0, None)
        .unwrap();
    let c = s
        .add_prealloc_request(prompt(2, 90), limits(4), 0, None)
        .unwrap();
    let got = s.pop_preallocated().unwrap();
    assert_eq!(got.len(), 1, "{}", s.last_prealloc_pass());
    assert_eq!(got[0].prefix_len, 28);
    assert!(matches!(
        s.last_prealloc_pass().stopped,
        Some(PreallocStop::Budget { id, .. }) if id == c
    ));
    assert_eq!(s.cache().protected_size(), 28);
    s.abort(b, "client left").unwrap();
    s.abort(c, "client left").unwrap();
    let done = s.take_finished();
    assert!(done
        .iter()
        .all(|f| matches!(f.reason, FinishReason::Abort { .. }) || f.id == a));
    assert!(!s.has_pd_work());
    assert_eq!(s.cache().protected_size(), 0);
    assert_eq!(
        s.allocator().available_size() + s.cache().evictable_size(),
        s.allocator().size()
    );
    s.check_invariants().unwrap();
}

/// A request that can never be preallocated (the reserve alone exceeds the pool) is aborted
/// with a message naming the numbers, not left queued forever.
#[test]
fn an_unfittable_prealloc_request_is_aborted_not_hung() {
    let mut s = sched(decode_cfg(4), 256);
    let id = s
        .add_prealloc_request(prompt(1, 40), limits(4), 0, None)
        .unwrap();
    assert!(s.pop_preallocated().unwrap().is_empty());
    assert_eq!(
        s.last_prealloc_pass().stopped,
        Some(PreallocStop::Unfittable(id))
    );
    let done = s.take_finished();
    assert!(matches!(&done[0].reason,
        FinishReason::Abort { message } if message.contains("required 552")));
    assert!(!s.has_pd_work());
}

/// The same when only the request's own locked prefix makes it not fit: with its prefix (56
/// tokens of a 64-token pool) locked, the delta and the reserve no longer fit, and without
/// it the whole prompt would not either.
#[test]
fn a_request_its_own_prefix_crowds_out_is_aborted_not_hung() {
    let mut s = decode_sched(4, 8, 64);
    let pr = prompt(1, 57);
    s.add_request(pr.clone(), limits(1), 0, None).unwrap();
    s.run_to_idle(&mut exec(), 10).unwrap();
    s.take_finished();
    assert_eq!(s.cache().evictable_size(), 56);
    let id = s.add_prealloc_request(pr, limits(1), 0, None).unwrap();
    assert!(s.pop_preallocated().unwrap().is_empty());
    assert_eq!(
        s.last_prealloc_pass().stopped,
        Some(PreallocStop::Unfittable(id))
    );
    assert!(!s.has_pd_work());
    assert_eq!(s.cache().protected_size(), 0);
    s.check_invariants().unwrap();
}

/// Decode-side retraction (the budget's clip set low so it over-admits): retracted requests
/// are recomputed by `step` before any new preallocation, and their KV counts against the
/// budget; every request still gets the fake model's tokens.
#[test]
fn retracted_requests_resume_before_new_preallocations() {
    let mut s = sched(
        SchedulerConfig {
            num_reserved_decode_tokens: 2,
            clip_max_new_tokens: 2,
            ..decode_cfg(1)
        },
        96,
    );
    let reqs: Vec<(Vec<u32>, SamplingLimits)> =
        (0..6).map(|i| (prompt(i, 10), limits(40))).collect();
    let mut ids = Vec::new();
    for (p, l) in &reqs[..4] {
        ids.push(
            s.add_prealloc_request(p.clone(), l.clone(), 0, None)
                .unwrap(),
        );
    }
    let mut e = exec();
    let mut blocked = false;
    let mut added = 4;
    for _ in 0..2000 {
        for g in s.pop_preallocated().unwrap() {
            commit(&mut s, g.id);
        }
        if let Some(PreallocStop::ResumeFirst(n)) = s.last_prealloc_pass().stopped {
            assert!(n > 0);
            assert!(s.last_prealloc_pass().budget.resuming > 0);
            blocked = true;
        }
        if s.stats.retractions > 0 && added < reqs.len() {
            let (p, l) = &reqs[added];
            ids.push(
                s.add_prealloc_request(p.clone(), l.clone(), 0, None)
                    .unwrap(),
            );
            added += 1;
        }
        if s.is_idle() && !s.has_pd_work() && added == reqs.len() {
            break;
        }
        s.step(&mut e).unwrap();
    }
    assert!(s.stats.retractions > 0, "the setup must retract");
    assert!(blocked, "a retracted request must block preallocation");
    s.check_invariants().unwrap();
    let done = s.take_finished();
    assert_eq!(done.len(), reqs.len());
    for f in done {
        let k = ids.iter().position(|&i| i == f.id).unwrap();
        assert_eq!(
            (f.output_ids, f.reason),
            expected_output(&reqs[k].0, &reqs[k].1)
        );
    }
}

/// A request mid chunked prefill (a retracted request being recomputed, on a decode server)
/// blocks preallocation until its last chunk ran, so a preallocation never takes the memory
/// its next chunk needs (found by the proptest: the chunk's allocation failed).
#[test]
fn a_chunked_resume_blocks_preallocation_until_its_last_chunk() {
    let mut s = sched(
        SchedulerConfig {
            chunked_prefill_size: Some(8),
            num_reserved_decode_tokens: 4,
            ..decode_cfg(4)
        },
        64,
    );
    let a = s.add_request(prompt(1, 40), limits(2), 0, None).unwrap();
    let b = s
        .add_prealloc_request(prompt(2, 12), limits(2), 0, None)
        .unwrap();
    let mut e = exec();
    s.step(&mut e).unwrap();
    assert_eq!(s.stage(a), Some(ReqStage::Chunked));
    assert!(s.pop_preallocated().unwrap().is_empty());
    let pass = s.last_prealloc_pass();
    assert_eq!(pass.stopped, Some(PreallocStop::ResumeFirst(1)));
    // Its 32 tokens without KV, plus the reserve.
    assert_eq!(pass.budget.resuming, 32 + 4);
    while s.stage(a) == Some(ReqStage::Chunked) {
        s.step(&mut e).unwrap();
    }
    assert_eq!(s.pop_preallocated().unwrap()[0].id, b);
    commit(&mut s, b);
    s.run_to_idle(&mut e, 100).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.take_finished().len(), 2);
}

// ----- a prefill + decode pair equals one scheduler -----------------------------------------------

/// Runs `reqs` through a prefill scheduler (hold at finish, max_new_tokens 1, chunked) and a
/// decode scheduler (preallocation, commit with the prefill's first token), as the engine
/// would with the transfer in between; returns each request's output and reason.
fn run_pd(
    reqs: &[(Vec<u32>, SamplingLimits)],
    p: u32,
    chunk: usize,
) -> Vec<(Vec<u32>, FinishReason)> {
    let mut pre = sched(
        SchedulerConfig {
            chunked_prefill_size: Some(chunk),
            ..cfg(p)
        },
        1024,
    );
    let mut dec = decode_sched(p, 16, 1024);
    let mut to_dec = HashMap::new();
    let mut to_pre = HashMap::new();
    let mut sendable: HashMap<ReqId, Vec<Page>> = HashMap::new();
    for (k, (pr, l)) in reqs.iter().enumerate() {
        let a = pre.add_request(pr.clone(), limits(1), 0, None).unwrap();
        pre.hold_kv_at_finish(a).unwrap();
        sendable.insert(a, Vec::new());
        let b = dec
            .add_prealloc_request(pr.clone(), l.clone(), 0, None)
            .unwrap();
        to_dec.insert(a, (b, k));
        to_pre.insert(b, a);
    }
    let mut e = exec();
    let mut first: HashMap<ReqId, u32> = HashMap::new();
    let mut transferring = Vec::new();
    let mut out: Vec<Option<(Vec<u32>, FinishReason)>> = vec![None; reqs.len()];
    for _ in 0..10_000 {
        pre.step(&mut e).unwrap();
        // What the engine would send: whole committed pages; once sent, a page stays put.
        for (&a, pages) in sendable.iter_mut() {
            if let Ok(slots) = pre.committed_slots(a) {
                let now = pages_of(slots, p);
                assert_eq!(
                    &now[..pages.len()],
                    &pages[..],
                    "{a}: a sendable page moved"
                );
                *pages = now[..slots.len() / p as usize].to_vec();
            }
        }
        for f in pre.take_finished() {
            assert!(f.kv_held);
            first.insert(to_dec[&f.id].0, f.output_ids[0]);
        }
        transferring.extend(dec.pop_preallocated().unwrap().into_iter().map(|g| g.id));
        // A transfer completes once both sides are ready: commit on decode, release on prefill.
        transferring.retain(|b| match first.get(b) {
            Some(&t) => {
                dec.commit_transferred(*b, &[t]).unwrap();
                pre.release_held(to_pre[b]).unwrap();
                false
            }
            None => true,
        });
        dec.step(&mut e).unwrap();
        for f in dec.take_finished() {
            let k = to_dec[&to_pre[&f.id]].1;
            out[k] = Some((f.output_ids, f.reason));
        }
        if out.iter().all(Option::is_some) {
            break;
        }
    }
    for s in [&pre, &dec] {
        assert!(s.is_idle() && !s.has_pd_work());
        s.check_invariants().unwrap();
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// What one scheduler produces for `reqs`.
fn run_single(reqs: &[(Vec<u32>, SamplingLimits)], p: u32) -> Vec<(Vec<u32>, FinishReason)> {
    let mut s = sched(cfg(p), 1024);
    let ids: Vec<ReqId> = reqs
        .iter()
        .map(|(pr, l)| s.add_request(pr.clone(), l.clone(), 0, None).unwrap())
        .collect();
    s.run_to_idle(&mut exec(), 10_000).unwrap();
    let done: HashMap<ReqId, FinishedReq> =
        s.take_finished().into_iter().map(|f| (f.id, f)).collect();
    ids.iter()
        .map(|i| (done[i].output_ids.clone(), done[i].reason.clone()))
        .collect()
}

#[test]
fn a_prefill_decode_pair_generates_what_one_scheduler_does() {
    let mut reqs = Vec::new();
    for i in 0..12u32 {
        // Three families of shared prefixes, some repeated whole (decode-side cache hits).
        let mut pr = prompt(i % 3, 20 + (i as usize % 4) * 9);
        pr.extend(prompt(i, (i as usize * 7) % 13));
        let l = SamplingLimits {
            max_new_tokens: 1 + (i as usize * 5) % 17,
            ignore_eos: false,
            stop_token_ids: vec![EOS, 11],
        };
        reqs.push((pr, l));
    }
    for p in [1, 4, 16] {
        let single = run_single(&reqs, p);
        assert_eq!(run_pd(&reqs, p, 16.max(p as usize)), single, "page {p}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// The same over random workloads, page sizes and chunk sizes.
    #[test]
    fn random_workloads_through_a_pd_pair_match_one_scheduler(
        reqs in prop::collection::vec(
            (0u32..3, 1usize..60, 1usize..20, any::<bool>()).prop_map(|(family, len, max_new, stop)| {
                let mut pr = prompt(family, len.min(30));
                pr.extend(prompt(family * 5 + len as u32, len.saturating_sub(30)));
                let l = SamplingLimits {
                    max_new_tokens: max_new,
                    ignore_eos: false,
                    stop_token_ids: if stop { vec![EOS, 11, 13] } else { vec![] },
                };
                (pr, l)
            }),
            1..16,
        ),
        page in prop::sample::select(vec![1u32, 4, 16]),
        chunk in prop::sample::select(vec![8usize, 16, 64]),
    ) {
        let single = run_single(&reqs, page);
        prop_assert_eq!(run_pd(&reqs, page, chunk.max(page as usize)), single);
    }
}

// ----- proptest: random interleavings -------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    /// A prefill-side request (`add_request`), marked to hold its KV or not.
    Add {
        family: u32,
        len: usize,
        max_new: usize,
        hold: bool,
    },
    /// A decode-side request (`add_prealloc_request`).
    AddDecode {
        family: u32,
        len: usize,
        max_new: usize,
    },
    Pop,
    /// Commit the `pick`-th transferring request with `token`.
    Commit {
        pick: usize,
        token: u32,
    },
    /// Abort the `pick`-th live request.
    Abort {
        pick: usize,
    },
    Step,
    /// Release the `pick`-th held request.
    Release {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => (0u32..3, 1usize..40, 1usize..24, any::<bool>()).prop_map(
            |(family, len, max_new, hold)| Op::Add {
                family,
                len,
                max_new,
                hold
            }
        ),
        1 => (0u32..3, 1usize..40, 1usize..24).prop_map(|(family, len, max_new)| Op::AddDecode {
            family,
            len,
            max_new
        }),
        1 => Just(Op::Pop),
        1 => (0usize..8, prop::sample::select(vec![EOS, 3, 500]))
            .prop_map(|(pick, token)| Op::Commit { pick, token }),
        1 => (0usize..16).prop_map(|pick| Op::Abort { pick }),
        4 => Just(Op::Step),
        1 => (0usize..8).prop_map(|pick| Op::Release { pick }),
    ]
}

/// An error the operation may rightly return for a pick that is no longer there.
fn allowed(r: Result<(), SchedulerError>) -> Result<(), TestCaseError> {
    match r {
        Ok(())
        | Err(SchedulerError::UnknownRequest(_))
        | Err(SchedulerError::WrongStage { .. }) => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!("unexpected error {e}"))),
    }
}

fn apply(s: &mut Scheduler, live: &mut Vec<ReqId>, op: &Op) -> Result<(), TestCaseError> {
    let stop = |max_new| SamplingLimits {
        max_new_tokens: max_new,
        ignore_eos: false,
        stop_token_ids: vec![EOS],
    };
    let in_stage = |s: &Scheduler, live: &[ReqId], st: ReqStage| -> Vec<ReqId> {
        live.iter()
            .copied()
            .filter(|&i| s.stage(i) == Some(st))
            .collect()
    };
    match *op {
        Op::Add {
            family,
            len,
            max_new,
            hold,
        } => {
            let id = s
                .add_request(prompt(family, len), stop(max_new), 0, None)
                .unwrap();
            if hold {
                s.hold_kv_at_finish(id).unwrap();
            }
            live.push(id);
        }
        Op::AddDecode {
            family,
            len,
            max_new,
        } => {
            live.push(
                s.add_prealloc_request(prompt(family, len), stop(max_new), 0, None)
                    .unwrap(),
            );
        }
        Op::Pop => {
            s.pop_preallocated().unwrap();
        }
        Op::Commit { pick, token } => {
            let t = in_stage(s, live, ReqStage::Transferring);
            if let Some(&id) = t.get(pick % t.len().max(1)) {
                s.commit_transferred(id, &[token]).unwrap();
            } else {
                allowed(s.commit_transferred(ReqId(pick as u64), &[token]))?;
            }
        }
        Op::Abort { pick } => {
            if let Some(&id) = live.get(pick % live.len().max(1)) {
                allowed(s.abort(id, "random"))?;
            }
        }
        Op::Step => {
            s.step(&mut exec()).unwrap();
        }
        Op::Release { pick } => {
            let h = in_stage(s, live, ReqStage::Held);
            if let Some(&id) = h.get(pick % h.len().max(1)) {
                s.release_held(id).unwrap();
            } else if let Some(&id) = live.get(pick % live.len().max(1)) {
                allowed(s.release_held(id))?;
            }
        }
    }
    live.retain(|&i| s.stage(i).is_some());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random interleavings of both sides' operations keep the pool partition after every
    /// operation, and once everything has ended every page is free or cached, nothing is
    /// locked and every row is free.
    #[test]
    fn random_interleavings_keep_invariants_and_leak_nothing(
        ops in prop::collection::vec(op(), 1..160),
        page in prop::sample::select(vec![1u32, 4]),
        pool_pages in 12usize..48,
    ) {
        let p = page as usize;
        let mut s = sched(
            SchedulerConfig {
                chunked_prefill_size: Some(8.max(p)),
                max_running_requests: 6,
                num_reserved_decode_tokens: 8,
                clip_max_new_tokens: 16,
                need_sort: true,
                ..cfg(page)
            },
            (pool_pages * 4 / p).max(64 / p) * p,
        );
        let mut live = Vec::new();
        for op in &ops {
            apply(&mut s, &mut live, op)?;
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
        // End everything: abort whatever is live (held ones are released), drain.
        for id in live.clone() {
            s.abort(id, "end").unwrap();
        }
        s.run_to_idle(&mut exec(), 1000).unwrap();
        prop_assert!(s.is_idle() && !s.has_pd_work());
        s.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(s.cache().protected_size(), 0);
        prop_assert_eq!(
            s.allocator().available_size() + s.cache().evictable_size(),
            s.allocator().size()
        );
        prop_assert!(s.held_rows().is_empty());
    }
}
