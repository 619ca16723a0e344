//! Allocator tests: snapshots of SGLang's scenarios, the conformance suite every `Allocator`
//! implementation must pass, direct checks of the position rule, and proptest against a model.

use kv_pool::allocator::{Fifo, Lifo, SlotAllocator};
use kv_pool::{
    Allocator, DecodeRequest, ExtendRequest, KvPoolError, Owner, OwnershipCheck, Page,
    PagedAllocator, ReqRow, Slot, TokenAllocator,
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
        let desc: Vec<String> = batch
            .iter()
            .map(|r| {
                format!(
                    "{}→{}{}",
                    r.prefix_len,
                    r.seq_len,
                    r.last_loc.map_or(String::new(), |l| format!("@{}", l.0))
                )
            })
            .collect();
        self.step(&format!("alloc_extend({})", desc.join(", ")), r)
    }
    fn decode(&mut self, batch: &[DecodeRequest]) -> Vec<Slot> {
        let mut out = Vec::new();
        let r = self.alloc.alloc_decode(batch, &mut out).map(|_| out);
        let desc: Vec<String> = batch
            .iter()
            .map(|r| {
                format!(
                    "{}{}",
                    r.seq_len,
                    r.last_loc.map_or(String::new(), |l| format!("@{}", l.0))
                )
            })
            .collect();
        self.step(&format!("alloc_decode({})", desc.join(", ")), r)
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

fn ext(prefix_len: usize, seq_len: usize, last_loc: Option<u32>) -> ExtendRequest {
    ExtendRequest {
        prefix_len,
        seq_len,
        last_loc: last_loc.map(Slot),
    }
}

fn dec(seq_len: usize, last_loc: Option<u32>) -> DecodeRequest {
    DecodeRequest {
        seq_len,
        last_loc: last_loc.map(Slot),
    }
}

#[test]
fn snapshot_seed_page_size_4_example() {
    // The seed walkthrough: page size 4, pages 1–4 (slots 4..20); allocate 8 tokens, free them.
    let mut s = Script::new(PagedAllocator::new(16, 4).unwrap());
    let got = s.alloc(8);
    assert_eq!(got, (4..12).map(Slot).collect::<Vec<_>>());
    s.free(&got);
    insta::assert_snapshot!(s.log);
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
// Conformance: every Allocator implementation, at every page size it supports.
// ---------------------------------------------------------------------------------------------

type Maker = fn(usize, u32) -> Box<dyn Allocator>;

fn implementations() -> Vec<(&'static str, u32, Maker)> {
    fn token(size: usize, _p: u32) -> Box<dyn Allocator> {
        Box::new(TokenAllocator::new(size).unwrap())
    }
    fn paged(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(PagedAllocator::new(size, p).unwrap())
    }
    fn fifo_paged(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(SlotAllocator::<Fifo>::with_page_size(size, p).unwrap())
    }
    fn any(size: usize, p: u32) -> Box<dyn Allocator> {
        Box::new(kv_pool::AnyAllocator::for_page_size(size, p).unwrap())
    }
    vec![
        ("token", 1, token as Maker),
        ("any P=1", 1, any),
        ("any P=8", 8, any),
        ("paged P=1", 1, paged),
        ("paged P=4", 4, paged),
        ("paged P=16", 16, paged),
        ("fifo P=4", 4, fifo_paged),
    ]
}

fn assert_unchanged(a: &dyn Allocator, before: &kv_pool::AllocatorState, what: &str) {
    assert_eq!(&a.backup_state(), before, "{what} changed the allocator");
}

#[test]
fn conformance_basic_accounting() {
    for (name, p, make) in implementations() {
        let pu = p as usize;
        let mut a = make(8 * pu, p);
        assert_eq!(a.size(), 8 * pu, "{name}");
        assert_eq!(a.available_size(), 8 * pu, "{name}");
        let mut out = Vec::new();
        a.alloc(3 * pu, &mut out).unwrap();
        assert_eq!(out.len(), 3 * pu, "{name}");
        assert!(
            out.iter().all(|s| s.0 >= p && s.0 < 9 * p),
            "{name}: padding page never handed out"
        );
        assert_eq!(a.available_size(), 5 * pu, "{name}");
        // All-or-nothing out of memory, with its own error.
        let before = a.backup_state();
        let mut out2 = vec![Slot(77)];
        assert_eq!(
            a.alloc(6 * pu, &mut out2),
            Err(KvPoolError::OutOfMemory {
                requested_tokens: 6 * pu,
                available_tokens: 5 * pu
            }),
            "{name}"
        );
        assert_eq!(out2, [Slot(77)], "{name}: out untouched on error");
        assert_unchanged(&*a, &before, name);
        // Page alignment.
        if p > 1 {
            assert_eq!(
                a.alloc(1, &mut out2),
                Err(KvPoolError::NotPageAligned { n: 1, page_size: p }),
                "{name}"
            );
        }
        // Free any slot of a page frees the page; double free refused, nothing changed.
        a.free(&out[..1]).unwrap();
        assert_eq!(a.available_size(), 6 * pu, "{name}");
        let before = a.backup_state();
        let err = a
            .free(
                &out[pu..pu + 1]
                    .iter()
                    .chain(&out[..1])
                    .copied()
                    .collect::<Vec<_>>(),
            )
            .unwrap_err();
        assert_eq!(
            err,
            KvPoolError::PageNotAllocated {
                page: out[0].page(p),
                slot: out[0]
            },
            "{name}"
        );
        assert_unchanged(&*a, &before, name);
        // Slots outside the pool and in the padding page.
        for bad in [Slot(0), Slot(9 * p), Slot(u32::MAX)] {
            assert!(
                matches!(a.free(&[bad]), Err(KvPoolError::SlotOutOfRange { .. })),
                "{name} {bad}"
            );
        }
        assert_unchanged(&*a, &before, name);
        // Backup / restore / clear.
        let snap = a.backup_state();
        a.alloc(2 * pu, &mut out2).unwrap();
        a.restore_state(&snap).unwrap();
        assert_eq!(a.available_size(), 6 * pu, "{name}");
        a.clear();
        assert_eq!(a.available_size(), 8 * pu, "{name}");
        assert!((1..=8).all(|pg| !a.is_allocated(Page(pg))), "{name}");
        // A snapshot from another shape is refused.
        let other = make(16 * pu, p).backup_state();
        assert!(
            matches!(a.restore_state(&other), Err(KvPoolError::StateMismatch(_))),
            "{name}"
        );
    }
}

#[test]
fn conformance_free_groups_and_sorted_release() {
    for (name, p, make) in implementations() {
        let pu = p as usize;
        let mut a = make(8 * pu, p);
        let mut out = Vec::new();
        a.alloc(4 * pu, &mut out).unwrap();
        a.free_group_begin().unwrap();
        a.free(&out[..pu]).unwrap();
        a.free(&out[2 * pu..3 * pu]).unwrap();
        assert_eq!(
            a.available_size(),
            4 * pu,
            "{name}: group frees are not available yet"
        );
        assert!(
            a.free(&out[..1]).is_err(),
            "{name}: double free inside a group"
        );
        assert!(a.free_group_begin().is_err(), "{name}");
        a.free_group_end().unwrap();
        assert_eq!(a.available_size(), 6 * pu, "{name}");
        assert!(a.free_group_end().is_err(), "{name}");

        a.set_sorted_release(true);
        a.free(&out[pu..2 * pu]).unwrap();
        a.free(&out[3 * pu..]).unwrap();
        assert_eq!(
            a.available_size(),
            8 * pu,
            "{name}: released pages count as available"
        );
        // Taking everything forces a merge: the result is sorted ascending, fully contiguous.
        let mut all = Vec::new();
        a.alloc(8 * pu, &mut all).unwrap();
        assert_eq!(all, (p..9 * p).map(Slot).collect::<Vec<_>>(), "{name}");
        a.free(&all).unwrap();
        a.set_sorted_release(false);
        assert_eq!(a.available_size(), 8 * pu, "{name}");
    }
}

#[test]
fn conformance_extend_and_decode_errors_change_nothing() {
    for (name, p, make) in implementations() {
        let pu = p as usize;
        let mut a = make(8 * pu, p);
        let mut out = Vec::new();
        a.alloc_extend(&[ext(0, pu + 1, None)], &mut out).unwrap();
        let last = *out.last().unwrap();
        let before = a.backup_state();
        let mut junk = Vec::new();
        let bad_batches: Vec<Vec<ExtendRequest>> = vec![
            vec![ext(5, 4, None)],
            vec![ext(0, 3, Some(last.0))],
            vec![ext(pu + 1, 9 * pu, Some(last.0))],
            vec![ext(pu + 1, pu + 2, Some(0))],
            vec![
                ext(usize::MAX, usize::MAX, Some(last.0)),
                ext(0, usize::MAX, None),
            ],
        ];
        for b in &bad_batches {
            assert!(a.alloc_extend(b, &mut junk).is_err(), "{name}: {b:?}");
            assert!(junk.is_empty(), "{name}");
            assert_unchanged(&*a, &before, name);
        }
        if p > 1 {
            assert!(
                a.alloc_extend(&[ext(pu + 1, pu + 2, None)], &mut junk)
                    .is_err(),
                "{name}: needs last_loc"
            );
            assert!(
                a.alloc_extend(
                    &[
                        ext(pu + 1, pu + 2, Some(last.0)),
                        ext(pu + 1, pu + 2, Some(last.0))
                    ],
                    &mut junk
                )
                .is_err(),
                "{name}: one partial page continued twice"
            );
            assert!(
                a.alloc_decode(&[dec(pu + 2, None)], &mut junk).is_err(),
                "{name}"
            );
            assert!(
                a.alloc_decode(
                    &[dec(pu + 2, Some(last.0)), dec(pu + 2, Some(last.0))],
                    &mut junk
                )
                .is_err(),
                "{name}"
            );
        }
        assert!(
            a.alloc_decode(&[dec(0, None)], &mut junk).is_err(),
            "{name}"
        );
        assert!(
            a.alloc_decode(&[dec(1, Some(last.0))], &mut junk).is_err(),
            "{name}"
        );
        assert!(
            a.alloc_decode(&[dec(pu + 2, Some(9 * p))], &mut junk)
                .is_err(),
            "{name}"
        );
        assert!(junk.is_empty(), "{name}");
        assert_unchanged(&*a, &before, name);
    }
}

// ---------------------------------------------------------------------------------------------
// The position rule, checked directly on every output slot.
// ---------------------------------------------------------------------------------------------

/// Checks `slot(pos) mod P == pos mod P` and that all positions of one page index of a request
/// share one physical page, and that no two requests share a page.
fn check_position_rule(p: u32, requests: &[Vec<Slot>]) {
    let mut page_owner = std::collections::HashMap::new();
    for (r, seq) in requests.iter().enumerate() {
        for (pos, slot) in seq.iter().enumerate() {
            assert_eq!(
                slot.0 % p,
                pos as u32 % p,
                "request {r} position {pos} at {slot}"
            );
            let first = seq[pos - pos % p as usize];
            assert_eq!(
                slot.page(p),
                first.page(p),
                "request {r} position {pos}: page index mixes pages"
            );
            let owner = page_owner.entry(slot.page(p)).or_insert(r);
            assert_eq!(
                *owner,
                r,
                "{} shared by requests {owner} and {r}",
                slot.page(p)
            );
        }
    }
}

fn grow(
    a: &mut dyn Allocator,
    requests: &mut [Vec<Slot>],
    extend: &[usize],
) -> kv_pool::Result<()> {
    let batch: Vec<ExtendRequest> = requests
        .iter()
        .zip(extend)
        .map(|(seq, &n)| ExtendRequest {
            prefix_len: seq.len(),
            seq_len: seq.len() + n,
            last_loc: seq.last().copied(),
        })
        .collect();
    let mut out = Vec::new();
    a.alloc_extend(&batch, &mut out)?;
    let mut it = out.into_iter();
    for (seq, &n) in requests.iter_mut().zip(extend) {
        seq.extend(it.by_ref().take(n));
    }
    assert!(it.next().is_none());
    Ok(())
}

fn decode_all(a: &mut dyn Allocator, requests: &mut [Vec<Slot>]) -> kv_pool::Result<()> {
    let batch: Vec<DecodeRequest> = requests
        .iter()
        .map(|seq| DecodeRequest {
            seq_len: seq.len() + 1,
            last_loc: seq.last().copied(),
        })
        .collect();
    let mut out = Vec::new();
    a.alloc_decode(&batch, &mut out)?;
    for (seq, s) in requests.iter_mut().zip(out) {
        seq.push(s);
    }
    Ok(())
}

#[test]
fn position_rule_holds_for_every_output_slot() {
    for (name, p, make) in implementations() {
        let mut a = make(4096 * p as usize, p);
        let mut requests = vec![Vec::new(); 6];
        // Prefix lengths 0; then mid-page, page-aligned and zero extends mixed in one batch.
        grow(&mut *a, &mut requests, &[1, 5, 16, 17, 3, 0]).unwrap();
        check_position_rule(p, &requests);
        grow(&mut *a, &mut requests, &[7, 0, 16, 33, 1, 2]).unwrap();
        check_position_rule(p, &requests);
        for _ in 0..40 {
            decode_all(&mut *a, &mut requests).unwrap();
            check_position_rule(p, &requests);
        }
        grow(&mut *a, &mut requests, &[100, 3, 1, 15, 64, 9]).unwrap();
        check_position_rule(p, &requests);
        // Exact page demand: Σ ceil(seq/P) pages in use.
        let used: usize = requests.iter().map(|s| s.len().div_ceil(p as usize)).sum();
        assert_eq!(a.available_size(), (4096 - used) * p as usize, "{name}");
    }
}

#[test]
fn alloc_extend_consumes_exactly_the_demanded_pages_at_the_edge() {
    // With exactly the demanded pages free, the batch succeeds; with one page less, it fails.
    let p = 4usize;
    for spare in [0usize, 1] {
        let mut a = PagedAllocator::new(64, 4).unwrap();
        let mut r = vec![Vec::new(); 2];
        grow(&mut a, &mut r, &[5, 4]).unwrap(); // pages: 2 + 1
        let demand = (5 + 9usize).div_ceil(p) - 2 + (4 + 8usize).div_ceil(p) - 1; // 2 + 2
        let mut hog = Vec::new();
        a.alloc(a.available_size() - (demand - 1 + spare) * p, &mut hog)
            .unwrap();
        let res = grow(&mut a, &mut r, &[9, 8]);
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
// Proptest: random operation sequences against a model of who owns what.
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    NewRequests(Vec<usize>),
    Extend(Vec<(usize, usize)>),
    Decode(Vec<usize>),
    Alloc(usize),
    FreeRequest(usize),
    FreeBlock(usize),
    DoubleFree(usize),
    GroupBegin,
    GroupEnd,
    SortedRelease(bool),
    Backup,
    Restore,
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

#[derive(Debug, Clone, Default)]
struct Model {
    requests: Vec<Vec<Slot>>,
    blocks: Vec<Vec<Slot>>,
    freed: Vec<Vec<Slot>>,
}

fn check_partition(a: &dyn Allocator, m: &Model) {
    let mut check = OwnershipCheck::new(a);
    for (i, r) in m.requests.iter().enumerate() {
        check.claim(Owner::Request(ReqRow(i as u32 + 1)), r);
    }
    for (i, b) in m.blocks.iter().enumerate() {
        check.claim(Owner::Other("block", i as u64), b);
    }
    let summary = check
        .finish()
        .unwrap_or_else(|v| panic!("ownership violated: {v}\n{m:?}"));
    assert!(summary.free_pages * a.page_size() as usize >= a.available_size());
    if !a.free_group_open() {
        assert_eq!(
            summary.free_pages * a.page_size() as usize,
            a.available_size()
        );
    }
}

fn run_ops(a: &mut dyn Allocator, ops: &[Op]) {
    let p = a.page_size() as usize;
    let mut m = Model::default();
    let mut saved: Option<(kv_pool::AllocatorState, Model)> = None;
    for op in ops {
        let before = a.backup_state();
        let result: kv_pool::Result<()> = match op {
            Op::NewRequests(lens) => {
                let mut fresh = vec![Vec::new(); lens.len()];
                let r = grow(a, &mut fresh, lens);
                if r.is_ok() {
                    m.requests.extend(fresh);
                }
                r
            }
            Op::Extend(picks) => {
                if m.requests.is_empty() {
                    continue;
                }
                let mut idx: Vec<usize> = picks.iter().map(|(i, _)| i % m.requests.len()).collect();
                idx.sort_unstable();
                idx.dedup();
                let mut sel: Vec<Vec<Slot>> = idx.iter().map(|&i| m.requests[i].clone()).collect();
                let n: Vec<usize> = idx
                    .iter()
                    .map(|&i| {
                        picks
                            .iter()
                            .find(|(j, _)| j % m.requests.len() == i)
                            .unwrap()
                            .1
                    })
                    .collect();
                let r = grow(a, &mut sel, &n);
                if r.is_ok() {
                    for (&i, s) in idx.iter().zip(sel) {
                        m.requests[i] = s;
                    }
                }
                r
            }
            Op::Decode(picks) => {
                let mut idx: Vec<usize> = picks
                    .iter()
                    .filter(|_| !m.requests.is_empty())
                    .map(|i| i % m.requests.len())
                    .collect();
                idx.sort_unstable();
                idx.dedup();
                idx.retain(|&i| !m.requests[i].is_empty());
                let mut sel: Vec<Vec<Slot>> = idx.iter().map(|&i| m.requests[i].clone()).collect();
                let r = decode_all(a, &mut sel);
                if r.is_ok() {
                    for (&i, s) in idx.iter().zip(sel) {
                        m.requests[i] = s;
                    }
                }
                r
            }
            Op::Alloc(pages) => {
                let mut out = Vec::new();
                let r = a.alloc(pages * p, &mut out);
                if r.is_ok() && !out.is_empty() {
                    m.blocks.push(out);
                }
                r
            }
            Op::FreeRequest(i) => {
                if m.requests.is_empty() {
                    continue;
                }
                let r = m.requests.remove(i % m.requests.len());
                a.free(&r).unwrap();
                if !r.is_empty() {
                    m.freed.push(r);
                }
                Ok(())
            }
            Op::FreeBlock(i) => {
                if m.blocks.is_empty() {
                    continue;
                }
                let b = m.blocks.remove(i % m.blocks.len());
                a.free(&b).unwrap();
                m.freed.push(b);
                Ok(())
            }
            Op::DoubleFree(i) => {
                if m.freed.is_empty() {
                    continue;
                }
                let f = &m.freed[i % m.freed.len()];
                // Only a true double free if no live owner got one of its pages back since.
                let pages: std::collections::HashSet<_> =
                    f.iter().map(|s| s.page(p as u32)).collect();
                let reused = m
                    .requests
                    .iter()
                    .chain(&m.blocks)
                    .flatten()
                    .any(|s| pages.contains(&s.page(p as u32)));
                let r = a.free(f);
                if !reused {
                    assert!(
                        matches!(r, Err(KvPoolError::PageNotAllocated { .. })),
                        "double free accepted: {r:?}"
                    );
                    assert_unchanged(a, &before, "a refused double free");
                } else {
                    // Freeing pages someone else owns now would corrupt the model; undo.
                    if r.is_ok() {
                        a.restore_state(&before).unwrap();
                    }
                }
                continue;
            }
            Op::GroupBegin => {
                let _ = a.free_group_begin();
                Ok(())
            }
            Op::GroupEnd => {
                let _ = a.free_group_end();
                Ok(())
            }
            Op::SortedRelease(on) => {
                a.set_sorted_release(*on);
                Ok(())
            }
            Op::Backup => {
                saved = Some((a.backup_state(), m.clone()));
                Ok(())
            }
            Op::Restore => {
                if let Some((s, sm)) = &saved {
                    a.restore_state(s).unwrap();
                    m = sm.clone();
                }
                Ok(())
            }
        };
        match result {
            Ok(()) => {}
            Err(KvPoolError::OutOfMemory { .. }) => {
                assert_unchanged(a, &before, "an out-of-memory")
            }
            Err(e) => panic!("unexpected error {e} for {op:?}"),
        }
        check_partition(a, &m);
        if matches!(op, Op::NewRequests(_) | Op::Extend(_) | Op::Decode(_)) {
            check_position_rule(p as u32, &m.requests);
        }
    }
    // Close any group, free everything: the pool is whole again.
    let _ = a.free_group_end();
    for r in m.requests.iter().chain(&m.blocks) {
        a.free(r).unwrap();
    }
    assert_eq!(a.available_size(), a.size());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_the_partition(ops in prop::collection::vec(op(), 1..60), which in 0usize..5) {
        let (_, p, make) = implementations()[which];
        let mut a = make(24 * p as usize, p);
        run_ops(&mut *a, &ops);
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
// `free` against a naive slot-by-slot reference (the fast path skips runs and whole words).
// ---------------------------------------------------------------------------------------------

/// What `free(slots)` must do: slot by slot, the first out-of-range slot or the first slot of a
/// page that is neither allocated nor freed earlier in the call is the error; else the set of
/// pages freed.
fn naive_free(
    p: u32,
    num_pages: u32,
    allocated: &[bool],
    slots: &[Slot],
) -> Result<Vec<u32>, KvPoolError> {
    let (first, end) = (p, (num_pages + 1) * p);
    let mut freed = Vec::new();
    for &slot in slots {
        if slot.0 < first || slot.0 >= end {
            return Err(KvPoolError::SlotOutOfRange { slot, first, end });
        }
        let page = slot.0 / p;
        if freed.contains(&page) {
            continue;
        }
        if !allocated[page as usize] {
            return Err(KvPoolError::PageNotAllocated {
                page: Page(page),
                slot,
            });
        }
        freed.push(page);
    }
    freed.sort_unstable();
    Ok(freed)
}

#[derive(Debug, Clone)]
enum Piece {
    Run { start: u32, len: u32 },
    Single(u32),
}

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
                3 => (0u32..1000, 1u32..300).prop_map(|(start, len)| Piece::Run { start, len }),
                1 => (0u32..1030).prop_map(Piece::Single),
            ],
            0..6,
        ),
    ) {
        let num_pages = 200u32;
        let scale = |thousandths: u32| thousandths * (num_pages + 1) * p / 1000;
        let mut a = SlotAllocator::<Lifo>::with_page_size((num_pages * p) as usize, p).unwrap();
        let mut all = Vec::new();
        a.alloc((num_pages * p) as usize, &mut all).unwrap();
        // Free the pages not held, so `held` is the allocation bitmap.
        let release: Vec<Slot> = (1..=num_pages).filter(|&pg| !held[pg as usize - 1]).map(|pg| Page(pg).first_slot(p)).collect();
        a.free(&release).unwrap();
        let allocated: Vec<bool> = (0..=num_pages).map(|pg| pg >= 1 && held[pg as usize - 1]).collect();
        let slots: Vec<Slot> = pieces.iter().flat_map(|piece| match *piece {
            Piece::Run { start, len } => (scale(start)..scale(start) + len).map(Slot).collect::<Vec<_>>(),
            Piece::Single(s) => vec![Slot(scale(s))],
        }).collect();
        let before = a.backup_state();
        let expected = naive_free(p, num_pages, &allocated, &slots);
        let got = a.free(&slots);
        match expected {
            Err(e) => {
                prop_assert_eq!(got, Err(e));
                prop_assert_eq!(a.backup_state(), before);
            }
            Ok(freed) => {
                prop_assert_eq!(got, Ok(()));
                for pg in 1..=num_pages {
                    let should = allocated[pg as usize] && freed.binary_search(&pg).is_err();
                    prop_assert_eq!(a.is_allocated(Page(pg)), should, "page {}", pg);
                }
                prop_assert_eq!(a.available_size() as u32, (num_pages - allocated.iter().filter(|x| **x).count() as u32 + freed.len() as u32) * p);
            }
        }
    }
}
