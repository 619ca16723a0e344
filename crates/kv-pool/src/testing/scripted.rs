//! The scripted conformance checks: fixed operation sequences on a small pool, each checking
//! exact results (which slots, which error, what is available) at page size `P`.

use super::model::{check_position_rule, decode_requests, extend_requests};
use super::trace::{dec, ext, Trace};
use crate::allocator::{Allocator, DecodeRequest, ExtendRequest};
use crate::error::KvPoolError;
use crate::ids::{Page, Slot};

/// Accounting, all-or-nothing allocation, freeing by page, refused frees, backup/restore and
/// clear, on a pool of 8 pages: `size()`/`available_size()` track every call; `alloc` never
/// hands out the padding page; an allocation that does not fit is
/// [`KvPoolError::OutOfMemory`] with the right counts, leaves `out` untouched and changes
/// nothing; `alloc(n)` with `n` not a multiple of `P` is [`KvPoolError::NotPageAligned`];
/// freeing one slot frees its whole page; a double free is [`KvPoolError::PageNotAllocated`]
/// naming the page and changes nothing; slots outside the pool are
/// [`KvPoolError::SlotOutOfRange`]; a restored snapshot brings back the availability; `clear`
/// frees everything; a snapshot of a differently sized pool is [`KvPoolError::StateMismatch`].
pub fn check_accounting<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
) -> Result<(), String> {
    let pu = p as usize;
    let mut inner = make(8 * pu, p);
    let mut t = Trace::new("available() accounting", p, &mut inner)?;
    t.ensure_eq(t.size(), 8 * pu, "size() of a pool of 8 pages")?;
    t.ensure_eq(
        t.available_size(),
        8 * pu,
        "available_size() of a fresh pool",
    )?;
    let mut out = Vec::new();
    let r = t.alloc(3 * pu, &mut out);
    t.expect_ok(r, "alloc of 3 pages with 8 free")?;
    t.ensure_eq(out.len(), 3 * pu, "slots returned by alloc(3P)")?;
    t.ensure(out.iter().all(|s| s.0 >= p && s.0 < 9 * p), || {
        format!("alloc handed out a slot outside pages 1..=8 (page 0 is padding): {out:?}")
    })?;
    t.ensure_eq(
        t.available_size(),
        5 * pu,
        "available_size() after alloc(3P)",
    )?;

    t.property("OOM is OutOfMemory and changes nothing");
    let before = t.backup_state();
    let mut out2 = vec![Slot(77)];
    let r = t.alloc(6 * pu, &mut out2);
    t.ensure_eq(
        r,
        Err(KvPoolError::OutOfMemory {
            requested_tokens: 6 * pu,
            available_tokens: 5 * pu,
        }),
        "alloc(6P) with 5 pages free",
    )?;
    t.ensure_eq(&out2[..], &[Slot(77)][..], "out after a refused alloc")?;
    t.ensure_unchanged(&before, "an out-of-memory alloc")?;
    if p > 1 {
        t.property("alloc is page-aligned");
        let r = t.alloc(1, &mut out2);
        t.ensure_eq(
            r,
            Err(KvPoolError::NotPageAligned { n: 1, page_size: p }),
            "alloc(1)",
        )?;
    }

    t.property("frees by page");
    let r = t.free(&out[..1]);
    t.expect_ok(r, "freeing the first slot of an allocated page")?;
    t.ensure_eq(
        t.available_size(),
        6 * pu,
        "available_size() after freeing one slot's page",
    )?;
    t.ensure(!t.is_allocated(out[0].page(p)), || {
        format!(
            "{} is still allocated after freeing one of its slots",
            out[0].page(p)
        )
    })?;

    t.property("double free refused");
    let before = t.backup_state();
    let again: Vec<Slot> = out[pu..pu + 1].iter().chain(&out[..1]).copied().collect();
    let r = t.free(&again);
    t.ensure_eq(
        r,
        Err(KvPoolError::PageNotAllocated {
            page: out[0].page(p),
            slot: out[0],
        }),
        "freeing an allocated page together with the page freed before",
    )?;
    t.ensure_unchanged(&before, "a refused double free")?;
    t.property("out-of-range slots refused");
    for bad in [Slot(0), Slot(9 * p), Slot(u32::MAX)] {
        let r = t.free(&[bad]);
        t.ensure(matches!(r, Err(KvPoolError::SlotOutOfRange { .. })), || {
            format!("free([{bad}]) returned {r:?}, expected SlotOutOfRange")
        })?;
    }
    t.ensure_unchanged(&before, "refused out-of-range frees")?;

    t.property("backup/restore");
    let snap = t.backup_state();
    let r = t.alloc(2 * pu, &mut out2);
    t.expect_ok(r, "alloc of 2 pages with 6 free")?;
    let r = t.restore_state(&snap);
    t.expect_ok(r, "restoring the allocator's own snapshot")?;
    t.ensure_eq(t.available_size(), 6 * pu, "available_size() after restore")?;
    t.ensure_eq(t.backup_state(), snap, "state after restore")?;
    t.property("clear frees everything");
    t.clear();
    t.ensure_eq(t.available_size(), 8 * pu, "available_size() after clear")?;
    t.ensure((1..=8).all(|pg| !t.is_allocated(Page(pg))), || {
        "a page is still allocated after clear".into()
    })?;
    t.property("backup/restore refuses a snapshot of another shape");
    let other = make(16 * pu, p).backup_state();
    let r = t.restore_state(&other);
    t.ensure(matches!(r, Err(KvPoolError::StateMismatch(_))), || {
        format!("restoring a 16-page snapshot into an 8-page pool returned {r:?}, expected StateMismatch")
    })
}

/// Free groups and sorted release on a pool of 8 pages: frees inside a group are not available
/// until `free_group_end`; a double free inside a group is refused; nested begin and unopened
/// end are errors. In sorted-release mode freed pages count as available at once, and an
/// allocation of the whole pool comes out sorted ascending, fully contiguous.
pub fn check_free_groups_and_sorted_release<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
) -> Result<(), String> {
    let pu = p as usize;
    let mut inner = make(8 * pu, p);
    let mut t = Trace::new("free groups", p, &mut inner)?;
    let mut out = Vec::new();
    let r = t.alloc(4 * pu, &mut out);
    t.expect_ok(r, "alloc of 4 pages with 8 free")?;
    let r = t.free_group_begin();
    t.expect_ok(r, "free_group_begin")?;
    let r = t.free(&out[..pu]);
    t.expect_ok(r, "a free inside a group")?;
    let r = t.free(&out[2 * pu..3 * pu]);
    t.expect_ok(r, "a free inside a group")?;
    t.ensure_eq(
        t.available_size(),
        4 * pu,
        "available_size() with two pages freed in an open group (not available yet)",
    )?;
    let r = t.free(&out[..1]);
    t.ensure(r.is_err(), || {
        "a double free inside a group was accepted".into()
    })?;
    let r = t.free_group_begin();
    t.ensure(r.is_err(), || {
        "a nested free_group_begin was accepted".into()
    })?;
    let r = t.free_group_end();
    t.expect_ok(r, "free_group_end")?;
    t.ensure_eq(
        t.available_size(),
        6 * pu,
        "available_size() after free_group_end",
    )?;
    let r = t.free_group_end();
    t.ensure(r.is_err(), || {
        "free_group_end without a group was accepted".into()
    })?;

    t.property("sorted release");
    t.set_sorted_release(true);
    let r = t.free(&out[pu..2 * pu]);
    t.expect_ok(r, "a free in sorted-release mode")?;
    let r = t.free(&out[3 * pu..]);
    t.expect_ok(r, "a free in sorted-release mode")?;
    t.ensure_eq(
        t.available_size(),
        8 * pu,
        "available_size() counts released pages",
    )?;
    let mut all = Vec::new();
    let r = t.alloc(8 * pu, &mut all);
    t.expect_ok(
        r,
        "alloc of the whole pool with every page free or released",
    )?;
    t.ensure_eq(
        all.clone(),
        (p..9 * p).map(Slot).collect::<Vec<_>>(),
        "the whole pool after a merge (sorted ascending, contiguous)",
    )?;
    let r = t.free(&all);
    t.expect_ok(r, "freeing the whole pool")?;
    t.set_sorted_release(false);
    t.ensure_eq(
        t.available_size(),
        8 * pu,
        "available_size() after leaving sorted-release mode",
    )
}

/// Malformed `alloc_extend` / `alloc_decode` batches are refused, leave `out` empty and change
/// nothing: `seq_len < prefix_len`, `last_loc` for an empty prefix, a batch too large for the
/// pool, a `last_loc` outside the pool, overflowing lengths; at `P > 1` also a missing
/// `last_loc` for a mid-page prefix and one partial page continued by two entries; for decode,
/// `seq_len` 0, `last_loc` for the first token, a missing or duplicated partial page and a
/// `last_loc` outside the pool.
pub fn check_batch_errors_change_nothing<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
) -> Result<(), String> {
    let pu = p as usize;
    let mut inner = make(8 * pu, p);
    let mut t = Trace::new(
        "refused alloc_extend / alloc_decode batches change nothing",
        p,
        &mut inner,
    )?;
    let mut out = Vec::new();
    let r = t.alloc_extend(&[ext(0, pu + 1, None)], &mut out);
    t.expect_ok(r, "alloc_extend(0→P+1)")?;
    let last = out[out.len() - 1];
    let before = t.backup_state();
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
    let mut extend_refused = |t: &mut Trace, batch: &[ExtendRequest], why: &str| {
        let r = t.alloc_extend(batch, &mut junk);
        t.ensure(r.is_err(), || {
            format!("alloc_extend accepted {why}: {batch:?}")
        })?;
        t.ensure(junk.is_empty(), || {
            format!("a refused alloc_extend wrote to out ({why})")
        })?;
        t.ensure_unchanged(&before, why)
    };
    for b in &bad_batches {
        extend_refused(&mut t, b, "a malformed extend batch")?;
    }
    if p > 1 {
        extend_refused(
            &mut t,
            &[ext(pu + 1, pu + 2, None)],
            "a mid-page prefix without last_loc",
        )?;
        extend_refused(
            &mut t,
            &[
                ext(pu + 1, pu + 2, Some(last.0)),
                ext(pu + 1, pu + 2, Some(last.0)),
            ],
            "one partial page continued twice",
        )?;
    }
    let decode_refused = |t: &mut Trace, batch: &[DecodeRequest], why: &str| {
        let mut junk = Vec::new();
        let r = t.alloc_decode(batch, &mut junk);
        t.ensure(r.is_err(), || {
            format!("alloc_decode accepted {why}: {batch:?}")
        })?;
        t.ensure(junk.is_empty(), || {
            format!("a refused alloc_decode wrote to out ({why})")
        })?;
        t.ensure_unchanged(&before, why)
    };
    if p > 1 {
        decode_refused(
            &mut t,
            &[dec(pu + 2, None)],
            "a partial page without last_loc",
        )?;
        decode_refused(
            &mut t,
            &[dec(pu + 2, Some(last.0)), dec(pu + 2, Some(last.0))],
            "one partial page continued twice",
        )?;
    }
    decode_refused(&mut t, &[dec(0, None)], "seq_len 0")?;
    decode_refused(
        &mut t,
        &[dec(1, Some(last.0))],
        "last_loc for a request's first token",
    )?;
    decode_refused(
        &mut t,
        &[dec(pu + 2, Some(9 * p))],
        "a last_loc outside the pool",
    )
}

/// SGLang's page rule on every output slot of `alloc_extend` and `alloc_decode`
/// (`slot mod P == position mod P`, one physical page per page index of a request, no page
/// shared), through mixed batches: empty, mid-page and page-aligned prefixes, zero-length
/// extends and 40 decode steps; and the exact page demand `Σ ceil(seq/P)` in use at the end.
pub fn check_position_rule_on_growth<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
) -> Result<(), String> {
    let mut inner = make(4096 * p as usize, p);
    let mut t = Trace::new("alloc_extend / alloc_decode page rule", p, &mut inner)?;
    let mut requests = vec![Vec::new(); 6];
    let step = |t: &mut Trace, requests: &mut Vec<Vec<Slot>>, extend: Option<&[usize]>| {
        let r = match extend {
            Some(n) => extend_requests(t, requests, n),
            None => decode_requests(t, requests),
        };
        t.expect_ok(r, "growing requests in a pool with room")?;
        check_position_rule(p, requests).map_err(|e| t.failure(e))
    };
    step(&mut t, &mut requests, Some(&[1, 5, 16, 17, 3, 0]))?;
    step(&mut t, &mut requests, Some(&[7, 0, 16, 33, 1, 2]))?;
    for _ in 0..40 {
        step(&mut t, &mut requests, None)?;
    }
    step(&mut t, &mut requests, Some(&[100, 3, 1, 15, 64, 9]))?;
    let used: usize = requests.iter().map(|s| s.len().div_ceil(p as usize)).sum();
    t.property("alloc_extend / alloc_decode take exactly the pages demanded");
    t.ensure_eq(
        t.available_size(),
        (4096 - used) * p as usize,
        "available_size() after growth",
    )
}
