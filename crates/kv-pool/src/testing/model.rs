//! The ownership model and the random-operation run: who holds which slots, the position rule
//! every request's slots obey, and [`run_ops`], which applies a sequence of [`Op`]s to an
//! allocator and checks the model against it after every step.

use std::collections::{HashMap, HashSet};

use super::trace::Trace;
use crate::allocator::{Allocator, AllocatorState, DecodeRequest, ExtendRequest};
use crate::error::KvPoolError;
use crate::ids::{ReqRow, Slot};
use crate::ownership::{Owner, OwnershipCheck};
use crate::rng::SplitMix64;

/// Checks SGLang's page rule on requests' slot lists (position `i` of a request at
/// `requests[r][i]`): `slot mod P == position mod P`, all positions of one page index of a
/// request share one physical page, and no two requests share a page.
pub fn check_position_rule(p: u32, requests: &[Vec<Slot>]) -> Result<(), String> {
    let mut page_owner = HashMap::new();
    for (r, seq) in requests.iter().enumerate() {
        for (pos, slot) in seq.iter().enumerate() {
            if slot.0 % p != pos as u32 % p {
                return Err(format!(
                    "page rule: request {r} position {pos} at {slot}: slot mod P = {} but position mod P = {}",
                    slot.0 % p,
                    pos as u32 % p
                ));
            }
            let first = seq[pos - pos % p as usize];
            if slot.page(p) != first.page(p) {
                return Err(format!(
                    "page rule: request {r} position {pos}: page index mixes {} and {}",
                    first.page(p),
                    slot.page(p)
                ));
            }
            let owner = *page_owner.entry(slot.page(p)).or_insert(r);
            if owner != r {
                return Err(format!(
                    "page rule: {} shared by requests {owner} and {r}",
                    slot.page(p)
                ));
            }
        }
    }
    Ok(())
}

/// Extends each request `i` by `extend[i]` positions with one `alloc_extend` batch (prefix =
/// the slots it holds, `last_loc` = its last slot) and appends the new slots to it.
pub fn extend_requests(
    a: &mut dyn Allocator,
    requests: &mut [Vec<Slot>],
    extend: &[usize],
) -> crate::Result<()> {
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
    debug_assert!(
        it.next().is_none(),
        "alloc_extend returned more slots than asked"
    );
    Ok(())
}

/// One decode step for every request: one `alloc_decode` batch, one new slot each.
pub fn decode_requests(a: &mut dyn Allocator, requests: &mut [Vec<Slot>]) -> crate::Result<()> {
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

/// Who owns what, as the random run believes it: requests (grown by extend and decode), plain
/// blocks (from `alloc`), and slot lists freed earlier (to try double frees with).
#[derive(Debug, Clone, Default)]
pub struct OwnershipModel {
    /// Each live request's slots, position order.
    pub requests: Vec<Vec<Slot>>,
    /// Each live `alloc` result.
    pub blocks: Vec<Vec<Slot>>,
    /// Slot lists that were freed (a second free of one is a double free unless a page was
    /// handed out again since).
    pub freed: Vec<Vec<Slot>>,
}

impl OwnershipModel {
    /// Checks that the model's owners and the allocator's unallocated pages partition the pool
    /// ([`OwnershipCheck`]), and that `available_size()` counts exactly the unallocated pages
    /// (at most them while a free group is open: its pages are not available yet).
    pub fn check(&self, a: &dyn Allocator) -> Result<(), String> {
        let mut check = OwnershipCheck::new(a);
        for (i, r) in self.requests.iter().enumerate() {
            check.claim(Owner::Request(ReqRow(i as u32 + 1)), r);
        }
        for (i, b) in self.blocks.iter().enumerate() {
            check.claim(Owner::Other("block", i as u64), b);
        }
        let summary = check
            .finish()
            .map_err(|v| format!("ownership violated: {v}"))?;
        let unallocated = summary.free_pages * a.page_size() as usize;
        if unallocated < a.available_size() {
            return Err(format!(
                "available() accounting: available_size() is {} but only {unallocated} slots are unallocated",
                a.available_size()
            ));
        }
        if !a.free_group_open() && unallocated != a.available_size() {
            return Err(format!(
                "available() accounting: available_size() is {} but {unallocated} slots are unallocated and no free group is open",
                a.available_size()
            ));
        }
        Ok(())
    }
}

/// One step of a random run (indices are taken modulo the live requests/blocks, so any value
/// is valid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Start requests with these prompt lengths (one `alloc_extend` from an empty prefix).
    NewRequests(Vec<usize>),
    /// Extend (request index, extra positions) pairs in one batch.
    Extend(Vec<(usize, usize)>),
    /// One decode step for these requests.
    Decode(Vec<usize>),
    /// `alloc` this many pages as a block.
    Alloc(usize),
    /// Free a request's slots.
    FreeRequest(usize),
    /// Free a block.
    FreeBlock(usize),
    /// Free an earlier freed slot list again: must be refused with `PageNotAllocated` and
    /// change nothing (unless its pages were handed out again since).
    DoubleFree(usize),
    /// `free_group_begin` (an error when one is open is fine).
    GroupBegin,
    /// `free_group_end` (an error when none is open is fine).
    GroupEnd,
    /// `set_sorted_release(on)`.
    SortedRelease(bool),
    /// Snapshot the allocator and the model.
    Backup,
    /// Restore the last snapshot (allocator and model).
    Restore,
}

/// Frees owner `i` (modulo their number; none when there are none) of `owners` and moves its
/// slots to `freed`. Freeing what an owner holds must succeed.
fn free_owner(
    t: &mut Trace,
    owners: &mut Vec<Vec<Slot>>,
    i: usize,
    freed: &mut Vec<Vec<Slot>>,
) -> Result<(), String> {
    if owners.is_empty() {
        return Ok(());
    }
    let slots = owners.remove(i % owners.len());
    let r = t.free(&slots);
    t.expect_ok(r, "freeing a live owner's slots")?;
    if !slots.is_empty() {
        freed.push(slots);
    }
    Ok(())
}

/// `len` random operations from `rng`, weighted toward growing and freeing requests.
pub fn random_ops(rng: &mut SplitMix64, len: usize) -> Vec<Op> {
    fn list<T>(
        rng: &mut SplitMix64,
        lo: usize,
        hi: usize,
        mut f: impl FnMut(&mut SplitMix64) -> T,
    ) -> Vec<T> {
        let n = lo + rng.below(hi - lo);
        (0..n).map(|_| f(rng)).collect()
    }
    (0..len)
        .map(|_| match rng.below(19) {
            0..=2 => Op::NewRequests(list(rng, 1, 4, |r| r.below(40))),
            3..=5 => Op::Extend(list(rng, 1, 4, |r| (r.below(8), r.below(20)))),
            6..=8 => Op::Decode(list(rng, 1, 6, |r| r.below(8))),
            9 => Op::Alloc(rng.below(6)),
            10 | 11 => Op::FreeRequest(rng.below(8)),
            12 => Op::FreeBlock(rng.below(4)),
            13 => Op::DoubleFree(rng.below(8)),
            14 => Op::GroupBegin,
            15 => Op::GroupEnd,
            16 => Op::SortedRelease(rng.below(2) == 1),
            17 => Op::Backup,
            _ => Op::Restore,
        })
        .collect()
}

/// Applies `ops` to `a` (a fresh allocator) and, after every step, checks the ownership model
/// ([`OwnershipModel::check`]), that an out-of-memory is [`KvPoolError::OutOfMemory`] and
/// changed nothing, that a double free is refused and changed nothing, and the position rule.
/// At the end it frees everything and checks the whole pool is available again. The error
/// names the property and lists every operation (high-level steps as `# …` lines).
pub fn run_ops(a: &mut dyn Allocator, ops: &[Op]) -> Result<(), String> {
    let p = a.page_size();
    let mut t = Trace::new("random operations keep the ownership model", p, a)?;
    let pu = p as usize;
    let mut m = OwnershipModel::default();
    let mut saved: Option<(AllocatorState, OwnershipModel)> = None;
    for op in ops {
        t.note(format!("# {op:?}"));
        let before = t.backup_state();
        let result: crate::Result<()> = match op {
            Op::NewRequests(lens) => {
                let mut fresh = vec![Vec::new(); lens.len()];
                let r = extend_requests(&mut t, &mut fresh, lens);
                if r.is_ok() {
                    m.requests.extend(fresh);
                }
                r
            }
            Op::Extend(picks) => {
                if m.requests.is_empty() {
                    continue;
                }
                let live = m.requests.len();
                let mut idx: Vec<usize> = picks.iter().map(|(i, _)| i % live).collect();
                idx.sort_unstable();
                idx.dedup();
                let mut sel: Vec<Vec<Slot>> = idx.iter().map(|&i| m.requests[i].clone()).collect();
                let n: Vec<usize> = idx
                    .iter()
                    .map(|&i| picks.iter().find(|(j, _)| j % live == i).map_or(0, |x| x.1))
                    .collect();
                let r = extend_requests(&mut t, &mut sel, &n);
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
                let r = decode_requests(&mut t, &mut sel);
                if r.is_ok() {
                    for (&i, s) in idx.iter().zip(sel) {
                        m.requests[i] = s;
                    }
                }
                r
            }
            Op::Alloc(pages) => {
                let mut out = Vec::new();
                let r = t.alloc(pages * pu, &mut out);
                if r.is_ok() && !out.is_empty() {
                    m.blocks.push(out);
                }
                r
            }
            Op::FreeRequest(i) => {
                free_owner(&mut t, &mut m.requests, *i, &mut m.freed)?;
                Ok(())
            }
            Op::FreeBlock(i) => {
                free_owner(&mut t, &mut m.blocks, *i, &mut m.freed)?;
                Ok(())
            }
            Op::DoubleFree(i) => {
                if m.freed.is_empty() {
                    continue;
                }
                let f = m.freed[i % m.freed.len()].clone();
                // Only a true double free if no live owner got one of its pages back since.
                let pages: HashSet<_> = f.iter().map(|s| s.page(p)).collect();
                let reused = m
                    .requests
                    .iter()
                    .chain(&m.blocks)
                    .flatten()
                    .any(|s| pages.contains(&s.page(p)));
                let r = t.free(&f);
                if !reused {
                    t.property("double free refused");
                    t.ensure(
                        matches!(r, Err(KvPoolError::PageNotAllocated { .. })),
                        || format!("a double free returned {r:?}, expected PageNotAllocated"),
                    )?;
                    t.ensure_unchanged(&before, "a refused double free")?;
                    t.property("random operations keep the ownership model");
                } else if r.is_ok() {
                    // Freeing pages someone else owns now would corrupt the model; undo.
                    let undo = t.restore_state(&before);
                    t.expect_ok(undo, "restoring the state taken before the step")?;
                }
                continue;
            }
            Op::GroupBegin => {
                let _ = t.free_group_begin();
                Ok(())
            }
            Op::GroupEnd => {
                let _ = t.free_group_end();
                Ok(())
            }
            Op::SortedRelease(on) => {
                t.set_sorted_release(*on);
                Ok(())
            }
            Op::Backup => {
                saved = Some((t.backup_state(), m.clone()));
                Ok(())
            }
            Op::Restore => {
                if let Some((s, sm)) = &saved {
                    let r = t.restore_state(s);
                    t.expect_ok(r, "restoring a snapshot of the same allocator")?;
                    m = sm.clone();
                }
                Ok(())
            }
        };
        match result {
            Ok(()) => {}
            Err(KvPoolError::OutOfMemory { .. }) => {
                t.property("OOM changes nothing");
                t.ensure_unchanged(&before, "an out-of-memory")?;
                t.property("random operations keep the ownership model");
            }
            Err(e) => return Err(t.failure(format!("unexpected error {e} for {op:?}"))),
        }
        m.check(&t).map_err(|e| t.failure(e))?;
        if matches!(op, Op::NewRequests(_) | Op::Extend(_) | Op::Decode(_)) {
            check_position_rule(p, &m.requests).map_err(|e| t.failure(e))?;
        }
    }
    // Close any group, free everything: the pool is whole again.
    t.note("# close any free group and free every owner");
    let _ = t.free_group_end();
    for r in m.requests.iter().chain(&m.blocks) {
        let freed = t.free(r);
        t.expect_ok(freed, "freeing a live owner at the end")?;
    }
    t.property("everything freed makes the whole pool available");
    t.ensure_eq(
        t.available_size(),
        t.size(),
        "available_size() after freeing every owner",
    )
}
