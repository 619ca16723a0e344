//! Reuse orders: where a free puts its pages in the free list, and which end allocations take
//! from. [`Fifo`] is SGLang's token allocator, [`Lifo`] its paged allocator.

use std::collections::VecDeque;
use std::fmt;

/// Where freed pages go in the free list, and which end allocations take from.
///
/// The free list is a `VecDeque<u32>`; both orders push freed pages at its back in bulk, and
/// LIFO keeps its head at the back (so "prepend" is a bulk push), FIFO at the front.
pub trait ReuseOrder: fmt::Debug + Default + Clone + Send + Sync + 'static {
    /// Name used in renderings and state checks.
    const NAME: &'static str;
    /// Whether a free's pages are sorted ascending before they are returned.
    const SORT_FREED: bool;
    /// Which SGLang allocator decides when sorted-release mode merges in a batch allocation.
    /// `true`, the paged allocator: `alloc_extend` merges when `extend_tokens / P + batch + 1`
    /// exceeds the free pages (the kernel's worst case, checked before it runs) and
    /// `alloc_decode` when the batch size does. `false`, the token allocator, whose callers
    /// allocate with plain `alloc`: both merge when the pages demanded exceed the free pages.
    const PAGED_MERGE_RULE: bool;
    /// Returns a batch of freed pages; `pages[0]` is reused first among them.
    fn give(free: &mut VecDeque<u32>, pages: &[u32]);
    /// Returns the freed pages `first..=last`, as `give` would with them in ascending order.
    /// Default: through `give`; this crate's orders push the range without a buffer.
    fn give_run(free: &mut VecDeque<u32>, first: u32, last: u32) {
        let pages: Vec<u32> = (first..=last).collect();
        Self::give(free, &pages);
    }
    /// Whether the order places each request's pages itself ([`ReuseOrder::take_for`] gets
    /// the batch's [`PageWant`]s); `false`: one [`ReuseOrder::take`] of the batch's demand.
    const PLACES_PER_REQUEST: bool = false;
    /// Moves `k ≤ free.len()` pages from the head into `out`, head first.
    fn take(free: &mut VecDeque<u32>, k: usize, out: &mut Vec<u32>);
    /// Moves `Σ wants[i].pages ≤ free.len()` pages into `out`, want by want: want `i`'s pages
    /// are the `wants[i].pages` entries after want `i − 1`'s. Called instead of `take` only when
    /// [`ReuseOrder::PLACES_PER_REQUEST`]; the default takes the whole demand from the head.
    fn take_for(free: &mut VecDeque<u32>, wants: &[PageWant], out: &mut Vec<u32>) {
        Self::take(free, wants.iter().map(|w| w.pages).sum(), out);
    }
    /// The free list in reuse order, head first.
    fn head_first(free: &VecDeque<u32>) -> Vec<u32>;
    /// A free list that hands out `ascending` in ascending order.
    fn from_ascending(ascending: Vec<u32>) -> VecDeque<u32>;
}

/// One request's share of a batch allocation, for orders that place pages per request
/// ([`ReuseOrder::PLACES_PER_REQUEST`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageWant {
    /// Fresh pages the request needs.
    pub pages: usize,
    /// The request's last page before the call (the page of its `last_loc`), if known: its new
    /// pages continue its run best right after it.
    pub after: Option<u32>,
}

/// Runs shorter than this are pushed page by page: cheaper than `extend`'s setup.
const SHORT_RUN: u32 = 8;

/// First in, first out: freed pages are appended in the order given (SGLang's token allocator).
#[derive(Debug, Default, Clone, Copy)]
pub struct Fifo;

/// Last in, first out: freed pages are sorted and prepended, so the most recently freed pages
/// are reused first (SGLang's paged allocator).
#[derive(Debug, Default, Clone, Copy)]
pub struct Lifo;

impl ReuseOrder for Fifo {
    const NAME: &'static str = "fifo";
    const SORT_FREED: bool = false;
    const PAGED_MERGE_RULE: bool = false;
    fn give(free: &mut VecDeque<u32>, pages: &[u32]) {
        free.extend(pages.iter().copied());
    }
    fn give_run(free: &mut VecDeque<u32>, first: u32, last: u32) {
        if last - first < SHORT_RUN {
            (first..=last).for_each(|p| free.push_back(p));
        } else {
            free.extend(first..last + 1); // a Range (TrustedLen): one reserve
        }
    }
    fn take(free: &mut VecDeque<u32>, k: usize, out: &mut Vec<u32>) {
        out.extend(free.range(..k).copied());
        free.drain(..k);
    }
    fn head_first(free: &VecDeque<u32>) -> Vec<u32> {
        free.iter().copied().collect()
    }
    fn from_ascending(ascending: Vec<u32>) -> VecDeque<u32> {
        ascending.into()
    }
}

impl ReuseOrder for Lifo {
    const NAME: &'static str = "lifo";
    const SORT_FREED: bool = true;
    const PAGED_MERGE_RULE: bool = true;
    fn give(free: &mut VecDeque<u32>, pages: &[u32]) {
        free.extend(pages.iter().rev().copied());
    }
    fn give_run(free: &mut VecDeque<u32>, first: u32, last: u32) {
        if last - first < SHORT_RUN {
            (first..=last).rev().for_each(|p| free.push_back(p));
        } else {
            free.extend((first..last + 1).rev());
        }
    }
    fn take(free: &mut VecDeque<u32>, k: usize, out: &mut Vec<u32>) {
        let n = free.len();
        out.extend(free.range(n - k..).rev().copied());
        free.truncate(n - k);
    }
    fn head_first(free: &VecDeque<u32>) -> Vec<u32> {
        free.iter().rev().copied().collect()
    }
    fn from_ascending(mut ascending: Vec<u32>) -> VecDeque<u32> {
        ascending.reverse();
        ascending.into()
    }
}
