//! Allocator tests: snapshots of SGLang's scenarios, `kv_pool::testing`'s conformance suite on
//! every implementation (and on a broken one, to show its failure report), the exact page
//! demand at the edge, proptest against the suite's ownership model, and `free` against a
//! naive reference.

use kv_pool::allocator::{BestFit, Fifo, Lifo, ReuseOrder, SlotAllocator};
use kv_pool::testing::{self, dec, ext, FreePiece, Op};
use kv_pool::{
    Allocator, AnyAllocator, BestFitAllocator, DecodeRequest, ExtendRequest, KvPoolError, Page,
    PagedAllocator, Slot, TokenAllocator,
};
use proptest::prelude::*;

fn slots(s: &[Slot]) -> String {
    s.iter()
        .map(|s| s.0.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A readable log of a scripted allocator session, for snapshots.
struct Script<A: Allocator + std::fmt::Display> {
    alloc: A,
    log: String,
}

impl<A: Allocator + std::fmt::Display> Script<A> {
    fn new(alloc: A) -> Self {
        let log = format!("init: {alloc}\n");
        Script { alloc, log }
    }
    fn step(&mut self, what: &str, result: kv_pool::Result<Vec<Slot>>) -> Vec<Slot> {
        match result {
            Ok(s) => {
                self.log += &format!("{what} -> [{}]\n  {}\n", slots(&s), self.alloc);
                s
            }
            Err(e) => {
                self.log += &format!("{what} -> error: {e}\n  {}\n", self.alloc);
                Vec::new()
            }
        }
    }
    fn alloc(&mut self, n: usize) -> Vec<Slot> {
        let mut out = Vec::new();
        let r = self.alloc.alloc(n, &mut out).map(|_| out);
        self.step(&format!("alloc({n})"), r)
    }
    fn extend(&mut self, batch: &[ExtendRequest]) -> Vec<Slot> {
        let mut out = Vec::new();
        let r = self.alloc.alloc_extend(batch, &mut out).map(|_| out);
        self.step(
            &format!("alloc_extend({})", testing::render_extend_batch(batch)),
            r,
        )
    }
    fn decode(&mut self, batch: &[DecodeRequest]) -> Vec<Slot> {
        let mut out = Vec::new();
        let r = self.alloc.alloc_decode(batch, &mut out).map(|_| out);
        self.step(
            &format!("alloc_decode({})", testing::render_decode_batch(batch)),
            r,
        )
    }
    fn free(&mut self, s: &[Slot]) {
        let r = self.alloc.free(s).map(|_| Vec::new());
        self.step(&format!("free([{}])", slots(s)), r);
    }
    fn note(&mut self, what: &str, r: kv_pool::Result<()>) {
        let r = r.map(|_| Vec::new());
        self.step(what, r);
    }
}

#[test]
fn snapshot_seed_page_size_4_example() {
    // The basic paged example: page size 4, pages 1–4 (slots 4..20); allocate 8 tokens, free them.
    let mut s = Script::new(PagedAllocator::new(16, 4).unwrap());
    let got = s.alloc(8);
    assert_eq!(got, (4..12).map(Slot).collect::<Vec<_>>());
    s.free(&got);
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_grow() {
    // A full pool grows: the new pages join the free list; the old allocation is untouched;
    // shrinking and a size off the page grid are refused and change nothing.
    let mut s = Script::new(PagedAllocator::new(8, 2).unwrap());
    let held = s.alloc(8);
    s.alloc(2);
    let r = s.alloc.grow(12);
    s.note("grow(12)", r);
    let more = s.alloc(4);
    let r = s.alloc.grow(6);
    s.note("grow(6)", r);
    let r = s.alloc.grow(13);
    s.note("grow(13)", r);
    s.free(&held);
    s.free(&more);
    assert_eq!(s.alloc.available_size(), 12);
    insta::assert_snapshot!(s.log);
}

/// Random operations keep the ownership model before and after a pool grows, for every
/// reuse order and page size 1 and 4.
#[test]
fn grown_pools_keep_the_ownership_model() {
    fn check<O: ReuseOrder>(rng: &mut kv_pool::rng::SplitMix64) {
        for p in [1u32, 4] {
            let size = 64 * p as usize;
            for _ in 0..20 {
                let mut a = SlotAllocator::<O>::with_page_size(size, p).unwrap();
                let ops = testing::random_ops(rng, 40);
                testing::run_ops(&mut a, &ops).unwrap_or_else(|e| panic!("{}: {e}", O::NAME));
                a.grow(3 * size).unwrap();
                assert_eq!(a.available_size(), 3 * size, "{}, page size {p}", O::NAME);
                let ops = testing::random_ops(rng, 120);
                testing::run_ops(&mut a, &ops).unwrap_or_else(|e| panic!("{}: {e}", O::NAME));
            }
        }
    }
    let mut rng = kv_pool::rng::SplitMix64::new(11);
    check::<Fifo>(&mut rng);
    check::<Lifo>(&mut rng);
    check::<BestFit>(&mut rng);
}

#[test]
fn snapshot_alloc_extend_prefix_positions() {
    // One batch with prefixes on a page boundary, ending mid-page, and empty (P = 4).
    let mut s = Script::new(PagedAllocator::new(64, 4).unwrap());
    let a = s.alloc(8); // request A holds 8 positions: pages 1, 2 (slots 4..12)
    let b = s.alloc(4); // request B holds page 3 and has used 3 positions of it (slots 12..15)
                        // A: prefix 8 (page boundary), extend to 13. B: prefix 3 (mid-page, last at b[2]), extend to
                        // 10. C: prefix 0, extend to 6.
    let out = s.extend(&[
        ext(8, 13, Some(a[7].0)),
        ext(3, 10, Some(b[2].0)),
        ext(0, 6, None),
    ]);
    assert_eq!(out.len(), 5 + 7 + 6);
    // Errors change nothing: seq < prefix, missing last_loc, wrong offset, two entries continuing
    // the same page, not enough memory.
    s.extend(&[ext(4, 3, Some(a[3].0))]);
    s.extend(&[ext(3, 5, None)]);
    s.extend(&[ext(3, 5, Some(b[1].0))]);
    s.extend(&[ext(3, 4, Some(b[2].0)), ext(3, 4, Some(b[2].0))]);
    s.extend(&[ext(0, 1000, None)]);
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_alloc_decode_crossing_a_page_boundary() {
    let mut s = Script::new(PagedAllocator::new(32, 4).unwrap());
    let a = s.extend(&[ext(0, 3, None), ext(0, 4, None)]);
    // Request 1 has 3 tokens (last at a[2]) → 4th goes to a[2]+1; request 2 has 4 → needs a page.
    let d = s.decode(&[dec(4, Some(a[2].0)), dec(5, Some(a[6].0))]);
    // Now request 1 is full (4) → page; request 2 at 5 → last+1.
    s.decode(&[dec(5, Some(d[0].0)), dec(6, Some(d[1].0))]);
    s.decode(&[dec(6, None)]);
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_sorted_release_mode() {
    let mut s = Script::new(PagedAllocator::new(32, 4).unwrap());
    s.alloc.set_sorted_release(true);
    let a = s.alloc(12);
    let b = s.alloc(8);
    let c = s.alloc(8);
    s.free(&b);
    s.free(&a[4..8]);
    s.free(&c);
    // 3 free pages left ([8]) plus 5 released: asking for 4 pages merges and sorts.
    s.alloc(8);
    s.alloc(16);
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_sorted_release_merges_when_sglang_does() {
    // SGLang's paged allocator merges the release list before a batch allocation whenever its
    // worst-case bound exceeds the free list, even when the pages actually demanded would fit:
    // `alloc_extend` at `extend_tokens / P + batch + 1 > free`, `alloc_decode` at
    // `batch > free`. The merged list is sorted, so released low pages are reused first.
    let mut s = Script::new(PagedAllocator::new(40, 4).unwrap());
    s.alloc.set_sorted_release(true);
    let a = s.alloc(16); // pages 1-4
    let b = s.extend(&[ext(0, 3, None), ext(0, 3, None), ext(0, 3, None)]); // pages 5-7
    s.free(&a[..8]); // pages 1-2 released
                     // Bound 4/4 + 1 + 1 = 3, not above the 3 free pages: no merge, page 8.
    let c = s.extend(&[ext(0, 4, None)]);
    assert_eq!(c[0], Slot(32));
    // Bound 3 > 2 free pages (demand 1 would fit): merge, and the sorted list hands out page 1.
    let d = s.extend(&[ext(0, 4, None)]);
    assert_eq!(d[0], Slot(4), "merged before the extend, as SGLang");
    s.alloc(4); // page 2
    s.free(&a[8..12]); // page 3 released
                       // Four requests, one needing a page: batch 4 > 2 free pages, so merge; page 3 comes first.
    let e = s.decode(&[
        dec(4, Some(b[2].0)),
        dec(4, Some(b[5].0)),
        dec(4, Some(b[8].0)),
        dec(5, Some(c[3].0)),
    ]);
    assert_eq!(e[3], Slot(12), "merged before the decode, as SGLang");
    s.free(&a[12..]); // page 4 released
                      // Deliberate difference: SGLang merges before it finds the pool too small; here an
                      // out-of-memory changes nothing, so the release list stays as it was.
    s.alloc(64);
    insta::assert_snapshot!(s.log);
}

#[test]
fn token_allocator_sorted_release_merges_at_the_demand() {
    // SGLang's token allocator has no batch kernel: its callers `alloc(extend_tokens)` or
    // `alloc(batch)`, which merge only when that many slots exceed the free list.
    let mut a = TokenAllocator::new(8).unwrap();
    a.set_sorted_release(true);
    let mut held = Vec::new();
    a.alloc(4, &mut held).unwrap(); // slots 1-4; free 5-8
    a.free(&held[..2]).unwrap(); // slots 1-2 released
    let mut out = Vec::new();
    a.alloc_extend(&[ext(0, 4, None)], &mut out).unwrap();
    assert_eq!(
        out,
        (5..9).map(Slot).collect::<Vec<_>>(),
        "4 ≤ 4 free: no merge"
    );
    out.clear();
    a.alloc_decode(&[dec(1, None)], &mut out).unwrap();
    assert_eq!(out, [Slot(1)], "1 > 0 free: merge, sorted");
}

#[test]
fn snapshot_free_groups() {
    let mut s = Script::new(PagedAllocator::new(32, 4).unwrap());
    let a = s.alloc(16);
    let r = s.alloc.free_group_begin();
    s.note("free_group_begin", r);
    s.free(&a[12..]);
    s.free(&a[..4]);
    s.free(&a[1..2]); // page 1 again: a double free even inside a group
    let r = s.alloc.free_group_begin();
    s.note("free_group_begin (nested)", r);
    let r = s.alloc.free_group_end();
    s.note("free_group_end", r);
    let r = s.alloc.free_group_end();
    s.note("free_group_end (unopened)", r);
    insta::assert_snapshot!(s.log);
}

#[test]
fn snapshot_token_allocator_fifo() {
    let mut s = Script::new(TokenAllocator::new(8).unwrap());
    let a = s.alloc(3);
    let b = s.alloc(2);
    s.free(&[a[2], a[0]]);
    s.free(&b);
    s.alloc(4);
    s.free(&[a[2]]);
    s.free(&[Slot(0)]);
    s.free(&[Slot(9)]);
    insta::assert_snapshot!(s.log);
}

// ---------------------------------------------------------------------------------------------
// Conformance: kv_pool::testing's suite on every implementation, at every page size it supports
// (the checks themselves live in src/testing, so a user's allocator runs the same ones).
// ---------------------------------------------------------------------------------------------

fn conforms<A: Allocator>(page_sizes: &[u32], make: impl FnMut(usize, u32) -> A) {
    if let Err(failure) = testing::check_allocator(page_sizes, make) {
        panic!("{failure}");
    }
}

#[test]
fn token_allocator_conforms() {
    conforms(&[1], |size, _| TokenAllocator::new(size).unwrap());
}

#[test]
fn paged_allocator_conforms() {
    conforms(&[1, 4, 16], |size, p| PagedAllocator::new(size, p).unwrap());
}

#[test]
fn fifo_paged_allocator_conforms() {
    conforms(&[4], |size, p| {
        SlotAllocator::<Fifo>::with_page_size(size, p).unwrap()
    });
}

#[test]
fn any_allocator_conforms() {
    conforms(&[1, 8], |size, p| {
        AnyAllocator::for_page_size(size, p).unwrap()
    });
}

#[test]
fn best_fit_allocator_conforms() {
    conforms(&[1, 4, 16], |size, p| {
        BestFitAllocator::new(size, p).unwrap()
    });
}

#[test]
fn every_allocator_by_name_conforms() {
    for name in AnyAllocator::NAMES {
        conforms(&[1, 4], |size, p| {
            let a = AnyAllocator::by_name(name, size, p).unwrap();
            assert_eq!(a.name(), name);
            a
        });
    }
    assert!(matches!(
        AnyAllocator::by_name("buddy", 64, 4),
        Err(KvPoolError::UnknownAllocator { .. })
    ));
    assert_eq!(
        AnyAllocator::by_name("best-fit", 64, 4).unwrap().name(),
        "best_fit"
    );
}

/// An allocator outside kv-pool's own types, as a user would write one: a paged allocator whose
/// `free` only frees the page of the first slot it is given (a plausible bug).
struct FirstPageOnly(PagedAllocator);

impl Allocator for FirstPageOnly {
    fn page_size(&self) -> u32 {
        self.0.page_size()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn num_pages(&self) -> usize {
        self.0.num_pages()
    }
    fn available_size(&self) -> usize {
        self.0.available_size()
    }
    fn alloc(&mut self, n: usize, out: &mut Vec<Slot>) -> kv_pool::Result<()> {
        self.0.alloc(n, out)
    }
    fn alloc_extend(
        &mut self,
        batch: &[ExtendRequest],
        out: &mut Vec<Slot>,
    ) -> kv_pool::Result<()> {
        self.0.alloc_extend(batch, out)
    }
    fn alloc_decode(
        &mut self,
        batch: &[DecodeRequest],
        out: &mut Vec<Slot>,
    ) -> kv_pool::Result<()> {
        self.0.alloc_decode(batch, out)
    }
    fn free(&mut self, slots: &[Slot]) -> kv_pool::Result<()> {
        self.0.free(&slots[..slots.len().min(1)])
    }
    fn free_group_begin(&mut self) -> kv_pool::Result<()> {
        self.0.free_group_begin()
    }
    fn free_group_end(&mut self) -> kv_pool::Result<()> {
        self.0.free_group_end()
    }
    fn free_group_open(&self) -> bool {
        self.0.free_group_open()
    }
    fn set_sorted_release(&mut self, on: bool) {
        self.0.set_sorted_release(on)
    }
    fn sorted_release(&self) -> bool {
        self.0.sorted_release()
    }
    fn merge_and_sort_free(&mut self) {
        self.0.merge_and_sort_free()
    }
    fn backup_state(&self) -> kv_pool::AllocatorState {
        self.0.backup_state()
    }
    fn restore_state(&mut self, state: &kv_pool::AllocatorState) -> kv_pool::Result<()> {
        self.0.restore_state(state)
    }
    fn clear(&mut self) {
        self.0.clear()
    }
    fn is_allocated(&self, page: Page) -> bool {
        self.0.is_allocated(page)
    }
    fn unallocated_pages(&self) -> Vec<Page> {
        self.0.unallocated_pages()
    }
}

#[test]
fn a_broken_allocator_fails_naming_the_property_and_the_operations() {
    let failure = testing::check_allocator(&[4], |size, p| {
        FirstPageOnly(PagedAllocator::new(size, p).unwrap())
    })
    .unwrap_err();
    assert!(
        failure.contains("property \"double free refused\" failed at P=4"),
        "{failure}"
    );
    // The operation log: the allocation, the refused ones, the first free, then the accepted
    // double free.
    assert!(failure.contains("1. alloc(12) -> [4-15]"), "{failure}");
    assert!(
        failure.contains("2. alloc(24) -> Err(out of KV memory"),
        "{failure}"
    );
    assert!(failure.contains("4. free([4]) -> ok"), "{failure}");
    assert!(failure.contains("5. free([8 4]) -> ok"), "{failure}");
}

#[test]
fn a_factory_ignoring_the_page_size_is_reported() {
    let failure =
        testing::check_allocator(&[4], |size, _| TokenAllocator::new(size).unwrap()).unwrap_err();
    assert!(
        failure.contains("asked for page size 4 and built an allocator with page size 1"),
        "{failure}"
    );
}

#[test]
fn alloc_extend_consumes_exactly_the_demanded_pages_at_the_edge() {
    // With exactly the demanded pages free, the batch succeeds; with one page less, it fails.
    let p = 4usize;
    for spare in [0usize, 1] {
        let mut a = PagedAllocator::new(64, 4).unwrap();
        let mut r = vec![Vec::new(); 2];
        testing::extend_requests(&mut a, &mut r, &[5, 4]).unwrap(); // pages: 2 + 1
        let demand = (5 + 9usize).div_ceil(p) - 2 + (4 + 8usize).div_ceil(p) - 1; // 2 + 2
        let mut hog = Vec::new();
        a.alloc(a.available_size() - (demand - 1 + spare) * p, &mut hog)
            .unwrap();
        let res = testing::extend_requests(&mut a, &mut r, &[9, 8]);
        if spare == 1 {
            res.unwrap();
            assert_eq!(a.available_size(), 0);
        } else {
            assert_eq!(
                res,
                Err(KvPoolError::OutOfMemory {
                    requested_tokens: 16,
                    available_tokens: 12
                })
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Proptest: random operation sequences against kv_pool::testing's ownership model (proptest
// generates and shrinks; the suite's own random runs use kv_pool::rng).
// ---------------------------------------------------------------------------------------------

type Maker = fn(usize, u32) -> Box<dyn Allocator>;

fn implementations() -> Vec<(&'static str, u32, Maker)> {
    fn token(size: usize, _p: u32) -> Box<dyn Allocator> {
        Box::new(TokenAllocator::new(size).unwrap())
    }
    fn paged(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(PagedAllocator::new(size, p).unwrap())
    }
    fn any(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(AnyAllocator::for_page_size(size, p).unwrap())
    }
    fn best_fit(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(BestFitAllocator::new(size, p).unwrap())
    }
    vec![
        ("token", 1, token as Maker),
        ("any P=1", 1, any),
        ("any P=8", 8, any),
        ("paged P=1", 1, paged),
        ("paged P=4", 4, paged),
        ("best_fit P=1", 1, best_fit),
        ("best_fit P=4", 4, best_fit),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prop::collection::vec(0usize..40, 1..4).prop_map(Op::NewRequests),
        3 => prop::collection::vec((0usize..8, 0usize..20), 1..4).prop_map(Op::Extend),
        3 => prop::collection::vec(0usize..8, 1..6).prop_map(Op::Decode),
        1 => (0usize..6).prop_map(Op::Alloc),
        2 => (0usize..8).prop_map(Op::FreeRequest),
        1 => (0usize..4).prop_map(Op::FreeBlock),
        1 => (0usize..8).prop_map(Op::DoubleFree),
        1 => Just(Op::GroupBegin),
        1 => Just(Op::GroupEnd),
        1 => any::<bool>().prop_map(Op::SortedRelease),
        1 => Just(Op::Backup),
        1 => Just(Op::Restore),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_the_partition(ops in prop::collection::vec(op(), 1..60), which in 0usize..5) {
        let (_, p, make) = implementations()[which];
        let mut a = make(24 * p as usize, p);
        if let Err(failure) = testing::run_ops(&mut *a, &ops) {
            panic!("{failure}");
        }
    }
}

#[test]
fn lifo_reuses_most_recently_freed_first() {
    let mut a = SlotAllocator::<Lifo>::with_page_size(16, 4).unwrap();
    let mut out = Vec::new();
    a.alloc(16, &mut out).unwrap();
    a.free(&out[8..12]).unwrap();
    a.free(&[out[13], out[4], out[12]]).unwrap();
    let mut again = Vec::new();
    a.alloc(4, &mut again).unwrap();
    assert_eq!(
        again[0],
        Slot(8),
        "pages of the last free, sorted ascending, come first"
    );
}

// ---------------------------------------------------------------------------------------------
// `free` against kv_pool::testing's naive slot-by-slot reference, with proptest's shrinking
// (the fast path skips runs and whole words).
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn free_matches_a_naive_reference(
        p in prop::sample::select(vec![1u32, 2, 3, 8, 16]),
        held in prop::collection::vec(prop::bool::weighted(0.9), 200),
        // Positions in thousandths of the pool's slot range (a little beyond it for errors),
        // so runs overlap (repeats within one call) and mostly hit allocated pages.
        pieces in prop::collection::vec(
            prop_oneof![
                3 => (0u32..1000, 1u32..300).prop_map(|(start, len)| FreePiece::Run { start, len }),
                1 => (0u32..1030).prop_map(FreePiece::Single),
            ],
            0..6,
        ),
    ) {
        // Both reuse orders: the one-run fast path returns pages through each order's own
        // `give_run`.
        let mut lifo = SlotAllocator::<Lifo>::with_page_size(200 * p as usize, p).unwrap();
        let mut fifo = SlotAllocator::<Fifo>::with_page_size(200 * p as usize, p).unwrap();
        for a in [&mut lifo as &mut dyn Allocator, &mut fifo] {
            if let Err(failure) = testing::check_free_against_reference(a, &held, &pieces) {
                panic!("{failure}");
            }
        }
    }
}
