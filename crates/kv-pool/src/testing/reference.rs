//! `free` against a naive slot-by-slot reference. A fast `free` skips runs of consecutive slots
//! and whole bitmap words; the reference walks one slot at a time, so the two must agree on
//! every input: which error (and which slot it names), or which pages end up free.

use super::trace::{render_slots, Trace};
use crate::allocator::Allocator;
use crate::error::KvPoolError;
use crate::ids::{Page, Slot};
use crate::rng::{mix64, SplitMix64};

/// What `free(slots)` must do on a pool of `num_pages` pages of size `p` whose allocation
/// bitmap is `allocated` (indexed by page, entry 0 the padding page): slot by slot, the first
/// slot outside the pool, or the first slot of a page that is neither allocated nor freed
/// earlier in the call, is the error; otherwise the pages freed, ascending.
pub fn naive_free(
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

/// A piece of one `free` call's slot list. Positions are in thousandths of the pool's slot
/// range `0..(num_pages + 1) × P` (values a little past 1000 land outside the pool), so pieces
/// overlap (repeats within one call) and mostly hit allocated pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreePiece {
    /// `len` consecutive slots from position `start`.
    Run {
        /// Start, in thousandths of the slot range.
        start: u32,
        /// Number of slots.
        len: u32,
    },
    /// One slot, in thousandths of the slot range.
    Single(u32),
}

/// On `a`, a fresh allocator of `held.len()` pages: allocates every page, frees those whose
/// `held` entry is false (so `held` is the allocation bitmap of pages `1..`), then frees the
/// slots `pieces` describe and compares with [`naive_free`]: the same error and no change, or
/// success with exactly the reference's pages freed and `available_size()` to match.
pub fn check_free_against_reference(
    a: &mut dyn Allocator,
    held: &[bool],
    pieces: &[FreePiece],
) -> Result<(), String> {
    let p = a.page_size();
    let num_pages = a.num_pages() as u32;
    let mut t = Trace::new("free matches a naive slot-by-slot reference", p, a)?;
    t.ensure_eq(
        held.len(),
        num_pages as usize,
        "held pages given for the pool's pages",
    )?;
    let mut all = Vec::new();
    let r = t.alloc((num_pages * p) as usize, &mut all);
    t.expect_ok(r, "allocating a whole fresh pool")?;
    let release: Vec<Slot> = (1..=num_pages)
        .filter(|&pg| !held[pg as usize - 1])
        .map(|pg| Page(pg).first_slot(p))
        .collect();
    let r = t.free(&release);
    t.expect_ok(r, "freeing the pages not held")?;
    let allocated: Vec<bool> = (0..=num_pages)
        .map(|pg| pg >= 1 && held[pg as usize - 1])
        .collect();
    let scale = |thousandths: u32| thousandths * (num_pages + 1) * p / 1000;
    let slots: Vec<Slot> = pieces
        .iter()
        .flat_map(|piece| match *piece {
            FreePiece::Run { start, len } => (scale(start)..scale(start) + len)
                .map(Slot)
                .collect::<Vec<_>>(),
            FreePiece::Single(s) => vec![Slot(scale(s))],
        })
        .collect();
    let before = t.backup_state();
    let expected = naive_free(p, num_pages, &allocated, &slots);
    let got = t.free(&slots);
    match expected {
        Err(e) => {
            t.ensure_eq(got, Err(e), "free's result")?;
            t.ensure_unchanged(&before, "a refused free")
        }
        Ok(freed) => {
            t.ensure_eq(got, Ok(()), "free's result")?;
            for pg in 1..=num_pages {
                let should = allocated[pg as usize] && freed.binary_search(&pg).is_err();
                t.ensure(t.is_allocated(Page(pg)) == should, || {
                    format!(
                        "page {pg} is {} after free({}), the reference says {}",
                        if should { "free" } else { "allocated" },
                        render_slots(&slots),
                        if should { "allocated" } else { "free" },
                    )
                })?;
            }
            let held_after = allocated.iter().filter(|x| **x).count() - freed.len();
            t.ensure_eq(
                t.available_size(),
                (num_pages as usize - held_after) * p as usize,
                "available_size() after the free",
            )
        }
    }
}

/// `runs` random cases of [`check_free_against_reference`] on fresh pools of 200 pages: about
/// nine pages in ten held, and up to five pieces per free.
pub fn check_free_matches_reference<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
    seed: u64,
    runs: usize,
) -> Result<(), String> {
    const PAGES: usize = 200;
    for run in 0..runs {
        let mut rng = SplitMix64::new(mix64(!seed ^ (u64::from(p) << 32) ^ run as u64));
        let held: Vec<bool> = (0..PAGES).map(|_| rng.below(10) != 0).collect();
        let pieces: Vec<FreePiece> = (0..rng.below(6))
            .map(|_| {
                if rng.below(4) < 3 {
                    FreePiece::Run {
                        start: rng.below(1000) as u32,
                        len: 1 + rng.below(299) as u32,
                    }
                } else {
                    FreePiece::Single(rng.below(1030) as u32)
                }
            })
            .collect();
        let mut a = make(PAGES * p as usize, p);
        check_free_against_reference(&mut a, &held, &pieces).map_err(|e| {
            format!("{e}\n(free run {run} of seed {seed:#x} at P={p}; pieces: {pieces:?})")
        })?;
    }
    Ok(())
}
