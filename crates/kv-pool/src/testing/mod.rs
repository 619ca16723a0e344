//! # kv_pool::testing — the allocator conformance suite (feature `testing`)
//!
//! Checks any [`Allocator`] implementation against the contract the rest of kvserve relies on,
//! with one call from the implementing crate. The suite is what kv-pool's own tests run on
//! [`TokenAllocator`](crate::TokenAllocator), [`PagedAllocator`](crate::PagedAllocator) and
//! [`AnyAllocator`](crate::AnyAllocator).
//!
//! Enable it for tests only:
//!
//! ```toml
//! [dev-dependencies]
//! kv-pool = { version = "…", features = ["testing"] }
//! ```
//!
//! then, in a test, hand [`check_allocator`] the page sizes your allocator supports and a
//! factory building a fresh one with `size` allocatable slots (a multiple of the page size) and
//! page size `page_size`:
//!
//! ```
//! use kv_pool::{testing, PagedAllocator};
//!
//! // A user's allocator would be built here instead.
//! testing::check_allocator(&[1, 4, 16], |size, page_size| {
//!     PagedAllocator::new(size, page_size).unwrap()
//! })
//! .unwrap_or_else(|failure| panic!("{failure}"));
//! ```
//!
//! What is checked, at every page size `P` given:
//! - all-or-nothing allocation; out of memory is [`KvPoolError::OutOfMemory`] with the right
//!   counts and changes nothing; `alloc` sizes must be multiples of `P`;
//! - `available_size()` accounting after every call (released pages count, pages in an open
//!   free group do not);
//! - frees by page (any slot frees its page); a double free and a free outside the pool are
//!   refused and change nothing; random `free` calls agree with a naive slot-by-slot
//!   reference ([`naive_free`]) on the error or on the pages freed;
//! - free groups, sorted release (a merged pool comes out sorted), backup/restore, `clear`;
//! - malformed `alloc_extend` / `alloc_decode` batches are refused and change nothing;
//! - the page rule `slot mod P == position mod P` on every slot `alloc_extend` and
//!   `alloc_decode` hand out, one physical page per page index of a request, and the exact
//!   page demand `Σ ceil(seq/P) − ceil(prefix/P)`;
//! - random operation sequences ([`run_ops`]) against an [`OwnershipModel`]: after every step
//!   the model's owners and the allocator's unallocated pages partition the pool exactly.
//!
//! A failure is an `Err(String)` naming the property, the page size and every operation applied
//! so far (see [`Trace`]). The individual checks are public too, and [`run_ops`] takes any
//! [`Op`] sequence, so a property-testing framework can generate and shrink its own.

mod controller;
mod device_rows;
mod model;
mod reference;
mod scripted;
mod trace;

pub use controller::{ImmediateController, LoggedOp};
pub use device_rows::{check_device_rows, LockedStoreRows};
pub use model::{
    check_position_rule, decode_requests, extend_requests, random_ops, run_ops, Op, OwnershipModel,
};
pub use reference::{
    check_free_against_reference, check_free_matches_reference, naive_free, FreePiece,
};
pub use scripted::{
    check_accounting, check_batch_errors_change_nothing, check_free_groups_and_sorted_release,
    check_position_rule_on_growth,
};
pub use trace::{dec, ext, render_decode_batch, render_extend_batch, Trace};

use crate::allocator::Allocator;
#[allow(unused_imports)] // doc links
use crate::error::KvPoolError;
use crate::rng::{mix64, SplitMix64};

/// How many random operation sequences [`check_allocator`] runs per page size.
pub const RANDOM_RUNS: usize = 64;
/// The longest random operation sequence [`check_allocator`] runs.
pub const MAX_RANDOM_OPS: usize = 60;
/// The seed [`check_allocator`] derives its random sequences from (fixed, so a failure
/// reproduces).
pub const SEED: u64 = 0x6b76_2d70_6f6f_6c00;

/// Runs the whole suite on allocators built by `make(size, page_size)` at each page size in
/// `page_sizes`: the scripted checks, then [`RANDOM_RUNS`] random `free` calls against a naive
/// reference ([`check_free_matches_reference`]) and [`RANDOM_RUNS`] random operation sequences
/// ([`check_random_operations`]) per page size.
/// `make` must return a fresh, empty allocator of exactly that page size and size (the suite
/// checks the page size). `Ok(())` or the first failure.
pub fn check_allocator<A: Allocator>(
    page_sizes: &[u32],
    mut make: impl FnMut(usize, u32) -> A,
) -> Result<(), String> {
    if page_sizes.is_empty() {
        return Err("allocator conformance: no page size to check".into());
    }
    for &p in page_sizes {
        check_accounting(p, &mut make)?;
        check_free_groups_and_sorted_release(p, &mut make)?;
        check_batch_errors_change_nothing(p, &mut make)?;
        check_position_rule_on_growth(p, &mut make)?;
        check_free_matches_reference(p, &mut make, SEED, RANDOM_RUNS)?;
        check_random_operations(p, &mut make, SEED, RANDOM_RUNS)?;
    }
    Ok(())
}

/// `runs` random sequences of 1 to [`MAX_RANDOM_OPS`] operations ([`random_ops`]), each on a
/// fresh pool of 24 pages, checked by [`run_ops`]. A failure also names the run and its whole
/// operation list, to replay with [`run_ops`].
pub fn check_random_operations<A: Allocator>(
    p: u32,
    make: &mut impl FnMut(usize, u32) -> A,
    seed: u64,
    runs: usize,
) -> Result<(), String> {
    for run in 0..runs {
        let mut rng = SplitMix64::new(mix64(seed ^ (u64::from(p) << 32) ^ run as u64));
        let len = 1 + rng.below(MAX_RANDOM_OPS);
        let ops = random_ops(&mut rng, len);
        let mut a = make(24 * p as usize, p);
        run_ops(&mut a, &ops).map_err(|e| {
            format!("{e}\n(random run {run} of seed {seed:#x} at P={p}; its operations: {ops:?})")
        })?;
    }
    Ok(())
}

/// A [`HostKvStore`](crate::HostKvStore) of `layout` with random bytes in every row of every
/// layer and buffer (the padding page included), for tests that move rows around.
pub fn random_host_store(
    layout: crate::KvLayout,
    seed: &mut crate::SplitMix64,
) -> crate::HostKvStore {
    use crate::KvStore as _;
    let mut s = crate::HostKvStore::new(layout).expect("a test layout fits in memory");
    let all: Vec<crate::Slot> = (0..layout.rows()).map(|i| crate::Slot(i as u32)).collect();
    for layer in 0..layout.shape.layers as usize {
        for &b in layout.shape.buffers() {
            let bytes: Vec<u8> = (0..all.len() * layout.shape.row_bytes(b))
                .map(|_| seed.next_u64() as u8)
                .collect();
            s.write_raw(layer, b, &all, &bytes)
                .expect("every row of the layout");
        }
    }
    s
}

/// Every byte a store holds, as its trait reads them: the raw rows of every layer and buffer
/// (the padding page included), then every page in the canonical packed format. Two stores
/// with equal dumps hold the same KV; a store whose dump did not change was not written.
pub fn dump_store(s: &dyn crate::KvStore) -> crate::Result<Vec<u8>> {
    let layout = *s.layout();
    let all: Vec<crate::Slot> = (0..layout.rows() as u32).map(crate::Slot).collect();
    let mut out = Vec::new();
    for layer in 0..layout.shape.layers as usize {
        for &b in layout.shape.buffers() {
            let mut rows = vec![0u8; all.len() * layout.shape.row_bytes(b)];
            s.read_raw(layer, b, &all, &mut rows)?;
            out.extend(rows);
        }
    }
    let pages: Vec<crate::Page> = (1..=layout.pages() as u32).map(crate::Page).collect();
    let mut packed = vec![0u8; pages.len() * layout.page_bytes()];
    s.read_pages(&pages, &mut packed)?;
    out.extend(packed);
    Ok(out)
}
