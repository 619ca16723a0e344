//! HiCache in the scheduler: step-trace snapshots of a host-tier hit loaded back at admission,
//! each write policy on a small pool, retraction to host, an L3 prefetch under each stop
//! policy and an abort with a prefetch in flight; a tag-checking executor proving that every
//! row a pass reads holds the KV of the right token prefix (so load-backs and retraction put
//! the right rows at the right slots); and a proptest over random workloads against the fake
//! model's direct computation and the tierless run.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use kv_pool::rng::{mix64, GOLDEN_GAMMA};
use kv_pool::testing::ImmediateController;
use kv_pool::{
    Ack, AnyAllocator, CacheController, OpId, PageKey, ReqToTokenPool, Slot, TierOpKind,
};
use proptest::prelude::*;
use radix_cache::{
    policy::policy_from_name, AnyPrefixCache, HiCacheConfig, PrefetchPolicy, RadixCache,
    WritePolicy,
};
use scheduler::{
    BatchResult, Executor, FakeExecutor, FinishReason, ForwardBatch, ForwardMode, ReqId,
    SamplingLimits, Scheduler, SchedulerConfig, StepReport,
};

mod common;
use common::{exec, expected_output, prompt, EOS};

// ----- the shared controller ----------------------------------------------------------------------

/// The controller's state, shared by the tree (through [`SharedCtl`]) and the test executor.
#[derive(Debug, Default)]
struct Ctl {
    inner: ImmediateController,
    /// Prefetch acks are held back (an L3 copy still in flight) while set.
    hold_prefetch: bool,
    held: Vec<Ack>,
    /// Held acks that were waited for: delivered by the next poll whatever `hold_prefetch`.
    ready: Vec<Ack>,
    /// Loads put their rows at the wrong device slots (to show the tag check catches it).
    misroute_loads: bool,
}

/// The tree owns a `Box<dyn CacheController>`; this one delegates to a shared
/// [`ImmediateController`], so the executor can read and write the device tags it models.
#[derive(Debug, Clone)]
struct SharedCtl(Arc<Mutex<Ctl>>);

impl SharedCtl {
    fn new(
        page: u32,
        pool: usize,
        host: usize,
        storage: Option<HashMap<PageKey, Vec<u64>>>,
    ) -> Self {
        let p = page as usize;
        let mut inner = ImmediateController::with_tags(pool + 2 * p, host + 2 * p, page);
        inner.storage = storage;
        SharedCtl(Arc::new(Mutex::new(Ctl {
            inner,
            ..Ctl::default()
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Ctl> {
        self.0.lock().expect("controller lock")
    }

    fn storage(&self) -> Option<HashMap<PageKey, Vec<u64>>> {
        self.lock().inner.storage.clone()
    }
}

impl CacheController for SharedCtl {
    fn write(&mut self, device: &[Slot], host: &[Slot]) -> OpId {
        self.lock().inner.write(device, host)
    }
    fn load(&mut self, host: &[Slot], device: &[Slot]) -> OpId {
        let mut c = self.lock();
        if c.misroute_loads {
            // A broken controller: every row of the load lands one slot off (rotated).
            let mut wrong = device.to_vec();
            wrong.rotate_right(1);
            return c.inner.load(host, &wrong);
        }
        c.inner.load(host, device)
    }
    fn wait(&mut self, op: OpId) {
        // A held-back prefetch completes when waited for (the contract: acked at the next poll).
        let mut c = self.lock();
        c.inner.wait(op);
        if let Some(i) = c.held.iter().position(|a| a.op == op) {
            let ack = c.held.remove(i);
            c.ready.push(ack);
        }
    }
    fn poll_acks(&mut self) -> Vec<Ack> {
        let mut c = self.lock();
        let mut out = std::mem::take(&mut c.ready);
        let acks = c.inner.poll_acks();
        if c.hold_prefetch {
            let (held, rest): (Vec<Ack>, Vec<Ack>) = acks
                .into_iter()
                .partition(|a| a.kind == TierOpKind::Prefetch);
            c.held.extend(held);
            out.extend(rest);
        } else {
            out.append(&mut c.held);
            out.extend(acks);
        }
        out
    }
    fn storage_enabled(&self) -> bool {
        self.lock().inner.storage_enabled()
    }
    fn backup(&mut self, host: &[Slot], keys: &[PageKey]) -> OpId {
        self.lock().inner.backup(host, keys)
    }
    fn query(&mut self, keys: &[PageKey]) -> OpId {
        self.lock().inner.query(keys)
    }
    fn prefetch(&mut self, keys: &[PageKey], host: &[Slot]) -> OpId {
        self.lock().inner.prefetch(keys, host)
    }
    fn prefetch_progress(&self, op: OpId) -> usize {
        let c = self.lock();
        match c.held.iter().find(|a| a.op == op) {
            Some(Ack {
                outcome: kv_pool::AckOutcome::Fetched(n),
                ..
            }) => *n,
            Some(_) => 0,
            None => c.inner.prefetch_progress(op),
        }
    }
    fn cancel_prefetch(&mut self, op: OpId) {
        // A cancelled prefetch stops at its next batch and is acked promptly, as a slow
        // store's would be: a held-back ack is delivered by the next poll.
        let mut c = self.lock();
        c.inner.cancel_prefetch(op);
        if let Some(i) = c.held.iter().position(|a| a.op == op) {
            let ack = c.held.remove(i);
            c.ready.push(ack);
        }
    }
}

// ----- the tag-checking executor ------------------------------------------------------------------

/// The tag of position `i`: a hash of the tokens `0..=i` (what the KV row at `i` depends on).
fn prefix_tags(tokens: &[u32]) -> Vec<u64> {
    let mut acc = 0x5EED_u64;
    tokens
        .iter()
        .map(|&t| {
            acc = mix64(acc ^ (u64::from(t) + 1).wrapping_mul(GOLDEN_GAMMA));
            acc
        })
        .collect()
}

/// [`FakeExecutor`] plus the KV rows modelled as tags in the shared controller: before a pass
/// it checks every slot the pass reads (each request's row below its prefix length) holds the
/// tag of that request's token prefix, then writes the tags of the positions it computes.
struct TagExec {
    inner: FakeExecutor,
    ctl: SharedCtl,
    /// Every request's tokens as far as known: its prompt, then the inputs of its passes.
    tokens: HashMap<ReqId, Vec<u32>>,
    /// Slots checked so far (so tests can see the check ran).
    checked: usize,
}

impl TagExec {
    fn new(ctl: &SharedCtl) -> Self {
        TagExec {
            inner: exec(),
            ctl: ctl.clone(),
            tokens: HashMap::new(),
            checked: 0,
        }
    }
}

impl Executor for TagExec {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        rows: &ReqToTokenPool,
    ) -> Result<BatchResult, String> {
        let mut start = 0;
        for (i, id) in batch.reqs.iter().enumerate() {
            let (pre, n) = (batch.prefix_lens[i], batch.extend_lens[i]);
            let known = self
                .tokens
                .get_mut(id)
                .unwrap_or_else(|| panic!("{id} was never registered"));
            for (k, &t) in batch.input_ids[start..start + n].iter().enumerate() {
                let pos = pre + k;
                assert_eq!(batch.positions[start + k] as usize, pos);
                match pos.cmp(&known.len()) {
                    std::cmp::Ordering::Less => {
                        assert_eq!(known[pos], t, "{id}: token at {pos} changed")
                    }
                    std::cmp::Ordering::Equal => known.push(t),
                    std::cmp::Ordering::Greater => panic!("{id}: position {pos} skips ahead"),
                }
            }
            let tags = prefix_tags(&known[..pre + n]);
            let read = rows.read(batch.rows[i], pre).map_err(|e| e.to_string())?;
            let mut c = self.ctl.lock();
            for (pos, s) in read.iter().enumerate() {
                let got = c.inner.device.get(s.index()).copied();
                assert_eq!(
                    got,
                    Some(tags[pos]),
                    "{id}: slot {} read at position {pos} of {pre} holds the wrong row",
                    s.index()
                );
            }
            self.checked += pre;
            for (k, &s) in batch.out_cache_loc[start..start + n].iter().enumerate() {
                c.inner.set_device_tag(s, tags[pre + k]);
            }
            start += n;
        }
        self.inner.forward(batch, rows)
    }
}

// ----- building schedulers ------------------------------------------------------------------------

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        strict: true,
        context_len: 256,
        max_running_requests: 8,
        ..SchedulerConfig::default()
    }
}

fn hc(write_policy: WritePolicy, host_slots: usize) -> HiCacheConfig {
    HiCacheConfig {
        write_policy,
        host_slots,
        ..HiCacheConfig::default()
    }
}

/// A scheduler over a radix cache (LRU) with a host tier driven by `ctl`, or none.
fn sched(c: SchedulerConfig, pool: usize, tier: Option<(HiCacheConfig, &SharedCtl)>) -> Scheduler {
    let p = c.page_size;
    let mut tree = RadixCache::new(p, policy_from_name("lru").unwrap());
    if let Some((h, ctl)) = tier {
        tree = tree.with_host_tier(h, Box::new(ctl.clone())).unwrap();
    }
    Scheduler::new(
        c,
        AnyPrefixCache::Radix(tree),
        AnyAllocator::for_page_size(pool, p).unwrap(),
    )
    .unwrap()
}

/// Adds a request and registers its prompt with the executor.
fn add(s: &mut Scheduler, e: &mut TagExec, p: Vec<u32>, limits: SamplingLimits) -> ReqId {
    let id = s.add_request(p.clone(), limits, 0, None).unwrap();
    e.tokens.insert(id, p);
    id
}

/// One step, with the cache's own invariants (both partitions) checked after it.
fn step(s: &mut Scheduler, e: &mut TagExec) -> StepReport {
    let r = s.step(e).unwrap();
    s.cache().check_invariants().unwrap();
    r
}

/// The host tier's figures, one line.
fn tier_line(s: &Scheduler) -> String {
    let t = s.cache().tier_stats().expect("a host tier");
    format!(
        "   host {}/{} (evictable {}) | writes {}/{} loads {}/{} backups {}/{} prefetches {}/{} | demoted {} host-evicted {} dropped {} | hits host {} storage {}",
        t.host_slots_used,
        t.host_slots_total,
        t.host_slots_evictable,
        t.writes_acked,
        t.writes_queued,
        t.loads_acked,
        t.loads_queued,
        t.backups_acked,
        t.backups_queued,
        t.prefetches_acked,
        t.prefetches_queued,
        t.pages_demoted,
        t.pages_host_evicted,
        t.pages_dropped,
        t.host_hit_tokens,
        t.storage_hit_tokens
    )
}

/// Steps until idle, one report line (and the tier line when `tiers`) per step.
fn trace(s: &mut Scheduler, e: &mut TagExec, max_steps: usize, tiers: bool) -> String {
    let mut log = String::new();
    for _ in 0..max_steps {
        if s.is_idle() {
            break;
        }
        log += &format!("{}\n", step(s, e));
        if tiers {
            log += &tier_line(s);
            log += "\n";
        }
    }
    assert!(s.is_idle(), "not idle after {max_steps} steps:\n{log}");
    s.check_invariants().unwrap();
    log
}

/// At idle: nothing protected, no prefetch or copy left, and every host page is free or the
/// tree's (flushing the cache frees both pools entirely).
fn check_idle_and_flush(s: &mut Scheduler) {
    assert!(s.is_idle());
    assert_eq!(s.cache().protected_size(), 0);
    s.check_invariants().unwrap();
    s.cache().check_invariants().unwrap();
    s.flush_cache().unwrap();
    let t = s.cache().tier_stats().unwrap();
    assert_eq!(t.host_slots_used, 0, "host pages outside the tree: {t:?}");
    assert_eq!(s.allocator().available_size(), s.allocator().size());
}

fn check_outputs(s: &mut Scheduler, prompts: &HashMap<ReqId, (Vec<u32>, SamplingLimits)>) {
    for f in s.take_finished() {
        let (p, l) = &prompts[&f.id];
        assert_eq!(
            (&f.output_ids, &f.reason),
            (&expected_output(p, l).0, &expected_output(p, l).1),
            "{}",
            f.id
        );
    }
}

// ----- snapshots ------------------------------------------------------------------------------------

#[test]
fn snapshot_load_back_at_admission() {
    insta::assert_snapshot!(load_back_story(false));
}

#[test]
#[should_panic(expected = "holds the wrong row")]
fn the_tag_check_catches_a_load_back_to_the_wrong_slots() {
    load_back_story(true);
}

/// A's 40 prompt tokens are written through to host; B needs the pool, so A's nodes are
/// demoted to host; C = A + 8 tokens matches 40 host tokens, loads them back at admission and
/// computes only its last 8. Returns the trace.
fn load_back_story(misroute_loads: bool) -> String {
    let c = SchedulerConfig {
        page_size: 4,
        ..cfg()
    };
    let (pool, host) = (64, 128);
    let ctl = SharedCtl::new(4, pool, host, None);
    ctl.lock().misroute_loads = misroute_loads;
    let mut s = sched(c, pool, Some((hc(WritePolicy::WriteThrough, host), &ctl)));
    let mut e = TagExec::new(&ctl);
    let mut log = String::new();
    let a = prompt(1, 40);
    add(&mut s, &mut e, a.clone(), SamplingLimits::max_new(2));
    log += "== A\n";
    log += &trace(&mut s, &mut e, 20, true);
    add(&mut s, &mut e, prompt(2, 48), SamplingLimits::max_new(2));
    log += "== B (A demoted)\n";
    log += &trace(&mut s, &mut e, 20, true);
    let mut cprompt = a.clone();
    cprompt.extend(900..908);
    let cid = add(&mut s, &mut e, cprompt.clone(), SamplingLimits::max_new(2));
    log += "== C = A + 8 tokens (load-back)\n";
    let before = s.cache().tier_stats().unwrap();
    let mut first = None;
    for _ in 0..20 {
        if s.is_idle() {
            break;
        }
        let r = step(&mut s, &mut e);
        if first.is_none() && r.mode.is_some() {
            first = Some(r.clone());
        }
        log += &format!("{r}\n{}\n", tier_line(&s));
    }
    let first = first.unwrap();
    assert_eq!(first.cached_tokens, 40, "{log}");
    assert_eq!(
        (first.entries[0].from, first.entries[0].to),
        (40, 48),
        "{log}"
    );
    let after = s.cache().tier_stats().unwrap();
    assert_eq!(after.host_hit_tokens - before.host_hit_tokens, 40);
    assert!(after.pages_demoted >= 10, "{log}");
    let f = s.take_finished();
    let fc = f.iter().find(|f| f.id == cid).unwrap();
    assert_eq!(fc.cached_tokens, 40);
    assert_eq!(
        fc.output_ids,
        expected_output(&cprompt, &SamplingLimits::max_new(2)).0
    );
    assert!(e.checked >= 40);
    check_idle_and_flush(&mut s);
    log
}

#[test]
fn snapshot_write_policies_on_a_small_pool() {
    // Per policy: A twice (its second run is a hit), B through a pool too small for both, A
    // again. Each request finishes at its prefill, so it inserts once. Write-through backs A
    // up at its first insert, selective at its second (the hit: 2 = its threshold),
    // write-back only when eviction takes it; each way A's third run loads it back.
    let mut out = String::new();
    for policy in WritePolicy::ALL {
        let c = SchedulerConfig {
            page_size: 4,
            ..cfg()
        };
        // The host holds A and B (72 tokens), the device one of them.
        let (pool, host) = (64, 96);
        let ctl = SharedCtl::new(4, pool, host, None);
        let mut s = sched(c, pool, Some((hc(policy, host), &ctl)));
        let mut e = TagExec::new(&ctl);
        let mut prompts = HashMap::new();
        out += &format!("== {policy}\n");
        let a = prompt(1, 24);
        for (what, p) in [
            ("A", a.clone()),
            ("A again", a.clone()),
            ("B", prompt(2, 48)),
            ("A after B", a.clone()),
        ] {
            let l = SamplingLimits::max_new(1);
            let id = add(&mut s, &mut e, p.clone(), l.clone());
            prompts.insert(id, (p, l));
            out += &format!("-- {what}\n");
            out += &trace(&mut s, &mut e, 20, false);
            out += &tier_line(&s);
            out += "\n";
        }
        let t = s.cache().tier_stats().unwrap();
        assert_eq!(
            t.host_hit_tokens, 20,
            "{policy}: A's last run loads it back\n{out}"
        );
        check_outputs(&mut s, &prompts);
        check_idle_and_flush(&mut s);
    }
    insta::assert_snapshot!(out);
}

/// Tokens prefilled by requests after their (first) retraction, and the run's log.
fn retraction_run(tier: bool) -> (usize, usize, String) {
    // scheduler.rs's retraction story: a long chunked request, then one short request per
    // step with long outputs, admitted optimistically, outgrow the pool.
    let c = SchedulerConfig {
        page_size: 4,
        chunked_prefill_size: Some(16),
        max_prefill_tokens: 64,
        schedule_conservativeness: 0.1,
        ..cfg()
    };
    let (pool, host) = (128, 256);
    let ctl = SharedCtl::new(4, pool, host, None);
    let mut s = sched(
        c,
        pool,
        tier.then(|| (hc(WritePolicy::WriteThrough, host), &ctl)),
    );
    let mut e = TagExec::new(&ctl);
    let mut prompts = HashMap::new();
    let mut reports = Vec::new();
    let l = SamplingLimits::max_new(4);
    let id = add(&mut s, &mut e, prompt(5, 40), l.clone());
    prompts.insert(id, (prompt(5, 40), l));
    for _ in 0..3 {
        reports.push(step(&mut s, &mut e));
    }
    for i in 0..3 {
        let l = SamplingLimits::max_new(40);
        let id = add(&mut s, &mut e, prompt(i, 10), l.clone());
        prompts.insert(id, (prompt(i, 10), l));
        reports.push(step(&mut s, &mut e));
    }
    for _ in 0..300 {
        if s.is_idle() {
            break;
        }
        reports.push(step(&mut s, &mut e));
    }
    assert!(s.is_idle());
    s.check_invariants().unwrap();
    let mut retracted = HashSet::new();
    let (mut prefilled, mut cached) = (0, 0);
    let mut log = String::new();
    for r in &reports {
        log += &format!("{r}\n");
        if r.mode != Some(ForwardMode::Decode) {
            for en in r.entries.iter().filter(|en| retracted.contains(&en.id)) {
                prefilled += en.to - en.from;
                if en.from > 0 && !en.middle_chunk {
                    cached += en.from;
                }
            }
        }
        retracted.extend(r.retracted.iter().copied());
    }
    assert!(
        !retracted.is_empty(),
        "the pool is sized to force a retraction:\n{log}"
    );
    check_outputs(&mut s, &prompts);
    if tier {
        log += &tier_line(&s);
        log += "\n";
        check_idle_and_flush(&mut s);
    }
    (prefilled, cached, log)
}

#[test]
fn snapshot_retraction_to_host() {
    // With a host tier the retracted request's committed KV is backed up to host and comes
    // back by load-back, so it prefills fewer tokens than when it is recomputed (SGLang).
    let (with, with_cached, log) = retraction_run(true);
    let (without, _, plain) = retraction_run(false);
    assert!(
        with_cached > 0,
        "the retracted request resumes from cached KV:\n{log}"
    );
    assert!(with < without, "{with} >= {without}\n{log}\n{plain}");
    assert_eq!((with, without), (1, 33), "{log}\n{plain}");
    insta::assert_snapshot!(format!(
        "== host tier: {with} tokens prefilled after retraction\n{log}== none: {without}\n{plain}"
    ));
}

/// Runs `p` to idle on a tiered scheduler with an empty L3 store and returns what the store
/// then holds (write-through: every page written to host is backed up to L3).
fn populate_storage(
    c: &SchedulerConfig,
    pool: usize,
    h: &HiCacheConfig,
    prompts: &[Vec<u32>],
) -> HashMap<PageKey, Vec<u64>> {
    let ctl = SharedCtl::new(c.page_size, pool, h.host_slots, Some(HashMap::new()));
    let mut s = sched(c.clone(), pool, Some((h.clone(), &ctl)));
    let mut e = TagExec::new(&ctl);
    for p in prompts {
        add(&mut s, &mut e, p.clone(), SamplingLimits::max_new(1));
        trace(&mut s, &mut e, 50, false);
    }
    ctl.storage().unwrap()
}

#[test]
fn snapshot_prefetch_from_storage_by_stop_policy() {
    // A first tree writes A's 40 prompt tokens through to host and L3. A fresh tree (a
    // restarted server) gets A + 8 tokens: at arrival it queries L3 for the 44 page-aligned
    // tokens beyond its (empty) match; the query's ack starts the prefetch of the 10 pages
    // found. best_effort stops it at the first admission scan: the copy is cancelled, and
    // what landed by its ack (the next step; the scheduler never waits for storage) is
    // inserted; wait_complete sits out passes until its ack, timeout waits until its ack or
    // its limit (here the ack is held back, so the limit, 2 s + 44 / 1024 × 0.1 s, ends it:
    // the copy is cancelled, and what landed by its ack is used).
    let c = SchedulerConfig {
        page_size: 4,
        ..cfg()
    };
    let (pool, host) = (128, 128);
    let base = HiCacheConfig {
        prefetch_threshold: 16,
        ..hc(WritePolicy::WriteThrough, host)
    };
    let a = prompt(3, 40);
    let stored = populate_storage(&c, pool, &base, std::slice::from_ref(&a));
    assert_eq!(stored.len(), 10);
    let mut out = String::new();
    for policy in PrefetchPolicy::ALL {
        let h = HiCacheConfig {
            prefetch_policy: policy,
            ..base.clone()
        };
        let ctl = SharedCtl::new(4, pool, host, Some(stored.clone()));
        let mut s = sched(c.clone(), pool, Some((h, &ctl)));
        let mut e = TagExec::new(&ctl);
        let mut p = a.clone();
        p.extend(900..908);
        let l = SamplingLimits::max_new(2);
        add(&mut s, &mut e, p.clone(), l.clone());
        out += &format!("== {policy}\n");
        let timeout = policy == PrefetchPolicy::Timeout;
        if timeout {
            ctl.lock().hold_prefetch = true;
        }
        let mut first_pass = None;
        for n in 0..30 {
            if s.is_idle() {
                break;
            }
            if timeout {
                // Wall-clock seconds: the limit passes between the third and fourth step.
                let now = [0.0, 1.0, 2.0, 2.5, 3.0][n.min(4)];
                s.set_time(now);
                out += &format!("t = {now} s\n");
            }
            let r = step(&mut s, &mut e);
            if first_pass.is_none() && r.mode.is_some() {
                first_pass = Some(n);
            }
            out += &format!("{r}\n{}\n", tier_line(&s));
        }
        ctl.lock().hold_prefetch = false;
        let first_pass = first_pass.unwrap();
        let t = s.cache().tier_stats().unwrap();
        let f = s.take_finished();
        assert_eq!(f[0].output_ids, expected_output(&p, &l).0);
        match policy {
            // Cancelled at the first scan; what landed by its ack (the immediate controller's
            // whole copy) is used one pass later.
            PrefetchPolicy::BestEffort => {
                assert_eq!(first_pass, 1, "{out}");
                assert_eq!(f[0].cached_tokens, 40, "{out}");
            }
            // One pass sat out for the prefetch's ack, then its 40 tokens are loaded back.
            PrefetchPolicy::WaitComplete => {
                assert_eq!(first_pass, 1, "{out}");
                assert_eq!(
                    (f[0].cached_tokens, t.storage_hit_tokens),
                    (40, 40),
                    "{out}"
                );
            }
            // The limit passes at the fourth scan (t = 2.5 s): cancelled there, used a pass
            // later.
            PrefetchPolicy::Timeout => {
                assert_eq!(first_pass, 4, "{out}");
                assert_eq!(
                    (f[0].cached_tokens, t.storage_hit_tokens),
                    (40, 40),
                    "{out}"
                );
            }
        }
        check_idle_and_flush(&mut s);
    }
    insta::assert_snapshot!(out);
}

#[test]
fn snapshot_abort_with_a_prefetch_in_flight() {
    // The same stored prefix; the request is aborted (1) while its query is in flight and (2)
    // after the query's ack, while the copy into host pages is in flight. Either way the
    // prefetch's host pages are freed (at the copy's ack) and nothing stays locked.
    let c = SchedulerConfig {
        page_size: 4,
        ..cfg()
    };
    let (pool, host) = (128, 128);
    let h = HiCacheConfig {
        prefetch_threshold: 16,
        prefetch_policy: PrefetchPolicy::WaitComplete,
        ..hc(WritePolicy::WriteThrough, host)
    };
    let a = prompt(3, 40);
    let stored = populate_storage(&c, pool, &h, std::slice::from_ref(&a));
    let mut out = String::new();
    for steps_before in [0, 1] {
        let ctl = SharedCtl::new(4, pool, host, Some(stored.clone()));
        let mut s = sched(c.clone(), pool, Some((h.clone(), &ctl)));
        let mut e = TagExec::new(&ctl);
        let mut p = a.clone();
        p.extend(900..908);
        let id = add(&mut s, &mut e, p, SamplingLimits::max_new(2));
        out += &format!("== abort after {steps_before} steps\n");
        for _ in 0..steps_before {
            out += &format!("{}\n{}\n", step(&mut s, &mut e), tier_line(&s));
        }
        s.abort(id, "client went away").unwrap();
        s.check_invariants().unwrap();
        s.cache().check_invariants().unwrap();
        out += &format!("abort {id}\n{}\n", tier_line(&s));
        out += &trace(&mut s, &mut e, 10, true);
        // The ack may still be queued on an idle scheduler: poll as an idle engine does.
        s.poll_cache_events().unwrap();
        s.cache().check_invariants().unwrap();
        out += &format!("idle\n{}\n", tier_line(&s));
        assert!(matches!(
            &s.take_finished()[0].reason,
            FinishReason::Abort { .. }
        ));
        let c = ctl.lock();
        assert_eq!(c.inner.in_flight() + c.held.len(), 0);
        drop(c);
        check_idle_and_flush(&mut s);
    }
    insta::assert_snapshot!(out);
}

// ----- proptest: random workloads ------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Workload {
    reqs: Vec<(Vec<u32>, SamplingLimits)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    let req = (0u32..4, 1usize..60, 1usize..30, any::<bool>()).prop_map(
        |(family, len, max_new, stop)| {
            // Families share prefixes, so the tiers have something to keep and bring back.
            let mut p = prompt(family, 24);
            p.truncate(len.min(24));
            p.extend(prompt(family * 7 + len as u32, len.saturating_sub(24)));
            let limits = SamplingLimits {
                max_new_tokens: max_new,
                ignore_eos: false,
                stop_token_ids: if stop { vec![EOS, 11, 13] } else { vec![] },
            };
            (p, limits)
        },
    );
    prop::collection::vec(req, 1..24).prop_map(|reqs| Workload { reqs })
}

/// A tiered run's setup: the tier's config, the L3 store it starts with (`None`: no storage),
/// whether the store is unreachable, and whether prefetch acks come late (held back two polls
/// in three).
#[derive(Debug, Clone)]
struct TierRun {
    h: HiCacheConfig,
    storage: Option<HashMap<PageKey, Vec<u64>>>,
    storage_down: bool,
    late_prefetch: bool,
}

type Outputs = Vec<(usize, Vec<u32>, FinishReason)>;

/// Runs `w` to idle (arrivals every `every` steps, 0: all at once) with the tag check in every
/// pass and both partitions checked after every step; returns the outputs by request index
/// and the L3 store afterwards.
fn run_workload(
    w: &Workload,
    c: &SchedulerConfig,
    pool: usize,
    every: usize,
    tier: Option<&TierRun>,
) -> (Outputs, Option<HashMap<PageKey, Vec<u64>>>) {
    let host = tier.map_or(0, |t| t.h.host_slots);
    let ctl = SharedCtl::new(
        c.page_size,
        pool,
        host,
        tier.and_then(|t| t.storage.clone()),
    );
    ctl.lock().inner.storage_down = tier.is_some_and(|t| t.storage_down);
    let mut s = sched(c.clone(), pool, tier.map(|t| (t.h.clone(), &ctl)));
    let mut e = TagExec::new(&ctl);
    let late = tier.is_some_and(|t| t.late_prefetch);
    let mut ids = Vec::new();
    let mut next = 0;
    for n in 0..20_000 {
        while next < w.reqs.len() && (every == 0 || n % every == 0) {
            let (p, l) = &w.reqs[next];
            ids.push(add(&mut s, &mut e, p.clone(), l.clone()));
            next += 1;
            if every != 0 {
                break;
            }
        }
        if next == w.reqs.len() && s.is_idle() {
            break;
        }
        ctl.lock().hold_prefetch = late && n % 3 != 0;
        s.set_time(n as f64 * 0.5);
        step(&mut s, &mut e);
    }
    assert!(s.is_idle(), "did not finish");
    ctl.lock().hold_prefetch = false;
    s.poll_cache_events().unwrap();
    s.check_invariants().unwrap();
    s.cache().check_invariants().unwrap();
    assert_eq!(
        s.allocator().available_size() + s.cache().evictable_size(),
        s.allocator().size()
    );
    let mut out: Outputs = s
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
    if tier.is_some() {
        check_idle_and_flush(&mut s);
    }
    (out, ctl.storage())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_through_the_tiers_match_the_tierless_run(
        w in workload(),
        page in prop::sample::select(vec![1u32, 16]),
        write_policy in prop::sample::select(WritePolicy::ALL.to_vec()),
        prefetch_policy in prop::sample::select(PrefetchPolicy::ALL.to_vec()),
        storage in any::<bool>(),
        storage_down in any::<bool>(),
        late_prefetch in any::<bool>(),
        chunk in prop::sample::select(vec![None, Some(16usize), Some(48)]),
        pool_pages in 4usize..24,
        host_units in 1usize..24,
        every in 0usize..3,
        conservativeness in prop::sample::select(vec![0.05f64, 0.3, 1.0]),
    ) {
        let p = page as usize;
        let c = SchedulerConfig {
            page_size: page,
            chunked_prefill_size: chunk.map(|c| c.max(p)),
            max_prefill_tokens: 96,
            schedule_conservativeness: conservativeness,
            ..cfg()
        };
        // The pool always fits the largest single request (prompt < 60 + output < 30 + a
        // page), and small enough that eviction and retraction happen.
        let pool = (pool_pages * 8).max(96 + 2 * p).div_ceil(p) * p;
        let h = HiCacheConfig {
            write_policy,
            host_slots: (host_units * 8).div_ceil(p) * p,
            prefetch_policy,
            prefetch_threshold: 2 * p,
            ..HiCacheConfig::default()
        };
        let (plain, _) = run_workload(&w, &c, pool, every, None);
        prop_assert_eq!(plain.len(), w.reqs.len());
        for (i, out, why) in &plain {
            let (eo, ew) = expected_output(&w.reqs[*i].0, &w.reqs[*i].1);
            prop_assert_eq!(out, &eo, "request {}", i);
            prop_assert_eq!(why, &ew, "request {}", i);
        }
        let mut t = TierRun {
            h,
            storage: storage.then(HashMap::new),
            storage_down: false,
            late_prefetch,
        };
        let (tiered, stored) = run_workload(&w, &c, pool, every, Some(&t));
        prop_assert_eq!(&tiered, &plain);
        if storage {
            // A fresh tree (a restarted server) over what the first run left in L3.
            t.storage = stored;
            t.storage_down = storage_down;
            let (again, _) = run_workload(&w, &c, pool, every, Some(&t));
            prop_assert_eq!(&again, &plain);
        }
    }
}
