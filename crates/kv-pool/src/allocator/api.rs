//! The [`Allocator`] trait (SGLang's `BaseTokenToKVPoolAllocator`) and the batch entries of
//! its `alloc_extend` and `alloc_decode`.

use super::state::AllocatorState;
use crate::error::Result;
use crate::ids::{Page, Slot};

/// One request of an [`Allocator::alloc_extend`] batch (SGLang's `prefix_lens[i]`,
/// `seq_lens[i]`, `last_loc[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtendRequest {
    /// Positions the request already has slots for.
    pub prefix_len: usize,
    /// Target length after the extend (`≥ prefix_len`).
    pub seq_len: usize,
    /// Slot of position `prefix_len − 1`; required when `prefix_len` is not page-aligned (the
    /// request's partial last page is continued from `last_loc + 1`), and must be `None` for an
    /// empty prefix. When given otherwise it is checked for consistency.
    pub last_loc: Option<Slot>,
}

/// One request of an [`Allocator::alloc_decode`] batch (SGLang's `seq_lens[i]`, `last_loc[i]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeRequest {
    /// The request's length after this step, counting the token being allocated (`≥ 1`).
    pub seq_len: usize,
    /// Slot of position `seq_len − 2`; required unless the new token starts a fresh page
    /// (`seq_len ≡ 1 mod P`). When given otherwise it is checked for consistency.
    pub last_loc: Option<Slot>,
}

/// A KV slot allocator (SGLang's `BaseTokenToKVPoolAllocator`). `Send`, so an engine can own
/// it on a scheduler thread.
///
/// Every method validates its whole input first: on `Err` nothing changed (and `out` was not
/// touched). Allocation methods append to `out`, so a caller can reuse one buffer across steps.
///
/// [`AnyAllocator`](crate::AnyAllocator) is the closed set of this crate's implementations, dispatched statically.
#[doc(alias = "BaseTokenToKVPoolAllocator")]
#[enum_dispatch::enum_dispatch]
pub trait Allocator: Send {
    /// Page size `P` (1 for a token allocator).
    fn page_size(&self) -> u32;
    /// Allocatable slots (`pages × P`).
    fn size(&self) -> usize;
    /// Allocatable pages; page ids are `1..=num_pages`.
    fn num_pages(&self) -> usize;
    /// Free slots: free list plus release list, times `P`. Pages buffered by an open free group
    /// are not counted until the group ends (as SGLang).
    fn available_size(&self) -> usize;

    /// Allocates `n` slots (`n` a multiple of `P`) as whole pages from the head of the free list.
    fn alloc(&mut self, n: usize, out: &mut Vec<Slot>) -> Result<()>;
    /// Allocates the new positions of a prefill batch with SGLang's three phases: finish each
    /// request's partial prefix page from `last_loc + 1`, then whole pages, then a trailing
    /// partial page. Consumes exactly `Σ ceil(seq/P) − ceil(prefix/P)` pages; request `i`'s slots
    /// are the `seq_len − prefix_len` entries after request `i − 1`'s in `out`.
    fn alloc_extend(&mut self, batch: &[ExtendRequest], out: &mut Vec<Slot>) -> Result<()>;
    /// Allocates one slot per request: `last_loc + 1`, or the first slot of a fresh page when the
    /// new length is `≡ 1 mod P`. Fresh pages are taken in batch order.
    fn alloc_decode(&mut self, batch: &[DecodeRequest], out: &mut Vec<Slot>) -> Result<()>;
    /// Frees the pages holding `slots` (each page once, however many of its slots are given).
    /// A slot whose page is not allocated is refused with [`KvPoolError::PageNotAllocated`](crate::KvPoolError::PageNotAllocated).
    fn free(&mut self, slots: &[Slot]) -> Result<()>;

    /// Starts buffering frees (SGLang's `free_group_begin`).
    fn free_group_begin(&mut self) -> Result<()>;
    /// Releases every buffered free as one `free` (SGLang's `free_group_end`).
    fn free_group_end(&mut self) -> Result<()>;
    /// Whether a free group is open: frees are buffered, not yet available, until
    /// `free_group_end`.
    fn free_group_open(&self) -> bool;

    /// Turns sorted-release mode (SGLang's `need_sort`, used in PD modes) on or off. While on,
    /// frees go to a release list that is merged into the free list and sorted ascending only
    /// when an allocation runs short, so allocations come out in contiguous runs. "Short" is
    /// SGLang's test: `alloc` merges when it wants more pages than the free list holds; the
    /// paged allocator's `alloc_extend` when `extend_tokens / P + batch + 1` does and its
    /// `alloc_decode` when the batch size does. A call that fails with `OutOfMemory` merges
    /// nothing (SGLang merges first). Turning the mode off merges the release list.
    fn set_sorted_release(&mut self, on: bool);
    /// Whether sorted-release mode (SGLang's `need_sort`) is on.
    fn sorted_release(&self) -> bool;
    /// Merges the release list into the free list and sorts the free list ascending; with an
    /// empty release list it does nothing (the free list keeps its order), as SGLang.
    fn merge_and_sort_free(&mut self);

    /// Snapshots the whole state (SGLang's `backup_state`); an allocator outside this crate
    /// builds its snapshot with [`AllocatorState::new`].
    fn backup_state(&self) -> AllocatorState;
    /// Restores a snapshot taken from an allocator of the same kind, page size and size.
    fn restore_state(&mut self, state: &AllocatorState) -> Result<()>;
    /// Frees everything: back to the initial state.
    fn clear(&mut self);

    /// Whether `page` is currently handed out (false for the padding page 0 and for pages past
    /// `num_pages`).
    fn is_allocated(&self, page: Page) -> bool;
    /// Every page that is not allocated: free list, release list and open-group pages, in that
    /// order (for the ownership checker).
    fn unallocated_pages(&self) -> Vec<Page>;
}
