//! The scripted request harness: a prefix cache driven the way a scheduler drives it (admit,
//! prefill chunks, finish), with the invariants, the kv-pool ownership partition and the slot
//! accounting checked after every step, and an optional rendering of each step for snapshots.

use std::collections::HashMap;

use kv_pool::{
    Allocator, ExtendRequest, Owner, OwnershipCheck, PagedAllocator, ReqRow, ReqToTokenPool,
};

use crate::request::{PrefixState, ReqView};
use crate::PrefixCache;

/// A request as a scheduler would hold it between the harness's calls.
#[derive(Debug)]
pub struct ScriptedReq {
    /// The name steps are logged under.
    pub name: String,
    /// Prompt (and output) token ids.
    pub tokens: Vec<u32>,
    /// Its row in the harness's request table.
    pub row: ReqRow,
    /// Positions whose KV is computed (SGLang's `kv_committed_len`).
    pub committed: usize,
    /// What the cache keeps on the request.
    pub state: PrefixState,
}

impl ScriptedReq {
    fn view(&mut self) -> ReqView<'_> {
        ReqView {
            tokens: &self.tokens,
            extra_key: None,
            row: self.row,
            committed_len: self.committed,
            priority: 0,
            state: &mut self.state,
        }
    }
}

/// Renders a cache after a step, for the harness's log.
pub type Render<C> = Box<dyn Fn(&C) -> String>;

/// A cache, a paged allocator and a request table, checked after every step.
pub struct RequestHarness<C: PrefixCache> {
    /// The cache under test.
    pub cache: C,
    /// The pool the cache's and the requests' slots come from (page size = the cache's).
    pub alloc: PagedAllocator,
    /// The request-to-token table.
    pub rows: ReqToTokenPool,
    /// Live requests: row → (cache_protected_len, committed_len).
    live: HashMap<ReqRow, (usize, usize)>,
    /// `## step` headings, each followed by the rendering (only with [`Self::with_render`]).
    pub log: String,
    render: Option<Render<C>>,
}

impl<C: PrefixCache> RequestHarness<C> {
    /// A harness over `cache` with a pool of `capacity` tokens (a multiple of the page size)
    /// and 8 request rows of at least 64 tokens.
    pub fn new(cache: C, capacity: usize) -> Self {
        let p = cache.page_size();
        RequestHarness {
            alloc: PagedAllocator::new(capacity, p).expect("harness pool"),
            rows: ReqToTokenPool::new(8, 64.max(16 * p as usize)).expect("harness rows"),
            cache,
            live: HashMap::new(),
            log: String::new(),
            render: None,
        }
    }

    /// Logs `render(&cache)` after each step (for snapshots).
    pub fn with_render(mut self, render: impl Fn(&C) -> String + 'static) -> Self {
        self.render = Some(Box::new(render));
        self
    }

    /// Admits a request: a row, the cached prefix written into it, the prefix locked.
    pub fn admit(&mut self, name: impl Into<String>, tokens: &[u32]) -> ScriptedReq {
        let name = name.into();
        let p = self.cache.page_size() as usize;
        let row = self.rows.alloc_one().expect("a free request row");
        let peeked = self.cache.peek_prefix_len(tokens, None);
        let mut prefix = Vec::new();
        let m = self.cache.match_prefix(tokens, None, &mut prefix);
        assert_eq!(m.len, peeked, "admit {name}: match and peek disagree");
        assert_eq!(prefix.len(), m.len, "admit {name}: slots for every token");
        assert!(m.len % p == 0 && m.len <= tokens.len(), "admit {name}");
        self.cache
            .inc_lock_ref(m.last_node)
            .expect("lock the match");
        self.rows.write(row, 0, &prefix).expect("write the prefix");
        let r = ScriptedReq {
            name,
            tokens: tokens.to_vec(),
            row,
            committed: m.len,
            state: PrefixState {
                cache_protected_len: m.len,
                last_node: m.last_node,
                prefix_slots: prefix,
            },
        };
        self.track(&r);
        self.step(&format!("admit {}: matched {}", r.name, m.len));
        r
    }

    /// Computes KV for positions `committed..upto` (fresh slots) and caches the prefix, as
    /// after a prefill that is not a chunk.
    pub fn prefill(&mut self, r: &mut ScriptedReq, upto: usize) {
        self.prefill_with(r, upto, false);
    }

    /// [`Self::prefill`], as a prefill chunk if `chunked`.
    pub fn prefill_with(&mut self, r: &mut ScriptedReq, upto: usize, chunked: bool) {
        let p = self.cache.page_size() as usize;
        let last_loc = (r.committed > 0)
            .then(|| self.rows.read(r.row, r.committed).expect("row")[r.committed - 1]);
        let mut out = Vec::new();
        let req = ExtendRequest {
            prefix_len: r.committed,
            seq_len: upto,
            last_loc,
        };
        self.alloc
            .alloc_extend(&[req], &mut out)
            .expect("room for the prefill");
        self.rows.write(r.row, r.committed, &out).expect("row");
        r.committed = upto;
        self.cache
            .cache_unfinished_req(r.view(), &mut self.rows, &mut self.alloc, chunked)
            .expect("cache_unfinished_req");
        let protected = r.state.cache_protected_len;
        assert!(
            protected % p == 0 && protected <= upto,
            "prefill {}: protected length {protected} of {upto}",
            r.name
        );
        assert_eq!(
            r.state.prefix_slots,
            self.rows.read(r.row, upto).expect("row"),
            "prefill {}: the prefix slots are the request's row",
            r.name
        );
        let desc = format!(
            "prefill {} to {upto} (new slots {:?})",
            r.name,
            out.iter().map(|s| s.0).collect::<Vec<_>>()
        );
        self.track(r);
        self.step(&desc);
    }

    /// Finishes a request, inserting its KV into the cache.
    pub fn finish(&mut self, r: ScriptedReq) {
        self.finish_with(r, true);
    }

    /// Finishes a request, inserting its KV only if `insert` (an abort does not).
    pub fn finish_with(&mut self, mut r: ScriptedReq, insert: bool) {
        self.cache
            .cache_finished_req(r.view(), &self.rows, &mut self.alloc, insert)
            .expect("cache_finished_req");
        assert_eq!(r.state.cache_protected_len, 0, "finish {}", r.name);
        assert!(r.state.prefix_slots.is_empty(), "finish {}", r.name);
        self.rows.free(r.row).expect("free the row");
        self.live.remove(&r.row);
        self.step(&format!("finish {}", r.name));
    }

    /// Records what `r` owns now (after its state was changed outside the harness).
    pub fn track(&mut self, r: &ScriptedReq) {
        self.live
            .insert(r.row, (r.state.cache_protected_len, r.committed));
    }

    /// Checks the cache's invariants and proves the partition: free pages, the cache's pages
    /// and each live request's private slots `[protected, committed)`; then logs the step.
    pub fn step(&mut self, what: &str) {
        // A cache with a host tier finishes its copies (a scheduler does this every step).
        self.cache
            .check_hicache_events()
            .unwrap_or_else(|e| panic!("after {what}: hicache events: {e}"));
        if let Err(e) = self.cache.check_invariants() {
            panic!("after {what}: {e}");
        }
        let mut check = OwnershipCheck::new(&self.alloc);
        self.cache.claim_ownership(&mut check);
        let p = self.alloc.page_size() as usize;
        let mut private = 0;
        for (&row, &(protected, committed)) in &self.live {
            let slots = self.rows.read(row, committed).expect("row");
            check.claim(Owner::Request(row), &slots[protected..]);
            private += (committed - protected).div_ceil(p) * p;
        }
        check
            .finish()
            .unwrap_or_else(|v| panic!("after {what}: {v}"));
        let used = self.alloc.size() - self.alloc.available_size();
        assert_eq!(used, self.cache.total_size() + private, "after {what}");
        if let Some(render) = &self.render {
            self.log += &format!("## {what}\n{}\n", render(&self.cache));
        }
    }
}

/// Tokens `1 + offset, 2 + offset, …`, `len` of them.
fn seq(offset: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + offset + i).collect()
}

/// Requests sharing prefixes through chunked prefill, concurrent admission, finish and abort,
/// at the cache's page size; see [`super::check_prefix_cache`].
pub(super) fn check_request_flow<C: PrefixCache>(cache: C) {
    let p = cache.page_size() as usize;
    // A cache that says it reuses prefixes matches exactly what was cached; one that does not
    // matches nothing.
    let reuses = cache.reuses_prefixes();
    let mut h = RequestHarness::new(cache, 64 * p);
    let shared = |matched: usize, cached: usize, what: &str| {
        let expected = if reuses { cached } else { 0 };
        assert_eq!(
            matched, expected,
            "{what}: matched {matched}, expected {expected} (reuses_prefixes() is {reuses})"
        );
    };
    let a = seq(0, 4 * p + 1);
    let mut r1 = h.admit("r1", &a);
    assert_eq!(r1.committed, 0, "an empty cache matches nothing");
    h.prefill_with(&mut r1, 2 * p, true);
    h.prefill(&mut r1, a.len());
    // r2 shares 3 pages with r1, which is still running: a split inside r1's cached run.
    let mut b = a[..3 * p].to_vec();
    b.extend(seq(100, 2 * p + 1));
    let mut r2 = h.admit("r2", &b);
    shared(r2.committed, 3 * p, "r2 sharing 3 pages of running r1");
    h.prefill(&mut r2, b.len());
    h.finish(r1);
    h.finish(r2);
    // r3 extends r1's prompt: everything r1 cached (its whole pages) is reusable.
    let mut c = a.clone();
    c.extend(seq(200, 2 * p));
    let mut r3 = h.admit("r3", &c);
    shared(r3.committed, a.len() / p * p, "r3 extending finished r1");
    // r4 computes what r3 is computing, in two chunks, while r3 runs: its duplicates are freed.
    let mut r4 = h.admit("r4", &c);
    h.prefill_with(&mut r3, 5 * p, true);
    h.prefill_with(&mut r4, 5 * p, true);
    h.prefill(&mut r3, c.len());
    h.prefill(&mut r4, c.len());
    h.finish_with(r4, false);
    h.finish(r3);
    assert_eq!(
        h.cache.protected_size(),
        0,
        "nothing locked after all finished"
    );
    let before = h.cache.evictable_size();
    let freed = h
        .cache
        .evict(before, &mut h.alloc)
        .expect("evict everything");
    assert!(freed >= before, "freed {freed} of {before} evictable");
    h.step("evict everything");
    h.cache.reset(&mut h.alloc).expect("reset");
    h.step("reset");
    assert_eq!(h.alloc.available_size(), h.alloc.size(), "reset frees all");
}
