//! Slot allocators: the [`Allocator`] trait and its two implementations, [`TokenAllocator`]
//! (page size 1, FIFO reuse, SGLang's `TokenToKVPoolAllocator`) and [`PagedAllocator`] (page size
//! `P`, LIFO reuse, SGLang's `PagedTokenToKVPoolAllocator`).
//!
//! Both are one generic [`SlotAllocator`] whose [`ReuseOrder`] decides where freed pages go:
//! FIFO appends them in the order given, LIFO prepends them sorted ascending (SGLang's
//! `torch.unique` + `cat`). Everything else, including the three-phase `alloc_extend`, is the
//! same code; at `P = 1` it collapses to "take the next n free slots".
//!
//! State: a free list of pages (allocations take from its head), a release list used in
//! sorted-release mode (SGLang's `need_sort` for PD), the pages buffered by an open free group,
//! and a bitmap of allocated pages. The bitmap is what makes a double free an error instead of
//! a corrupted free list (SGLang's free is not idempotent).

use std::collections::VecDeque;
use std::fmt;
use std::marker::PhantomData;

use crate::error::{KvPoolError, Result};
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
/// [`AnyAllocator`] is the closed set of this crate's implementations, dispatched statically.
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
    /// A slot whose page is not allocated is refused with [`KvPoolError::PageNotAllocated`].
    fn free(&mut self, slots: &[Slot]) -> Result<()>;

    /// Starts buffering frees (SGLang's `free_group_begin`).
    fn free_group_begin(&mut self) -> Result<()>;
    /// Releases every buffered free as one `free` (SGLang's `free_group_end`).
    fn free_group_end(&mut self) -> Result<()>;
    /// Whether a free group is open.
    fn free_group_open(&self) -> bool;

    /// Turns sorted-release mode (SGLang's `need_sort`, used in PD modes) on or off. While on,
    /// frees go to a release list that is merged into the free list and sorted ascending only
    /// when an allocation runs short, so allocations come out in contiguous runs. "Short" is
    /// SGLang's test: `alloc` merges when it wants more pages than the free list holds; the
    /// paged allocator's `alloc_extend` when `extend_tokens / P + batch + 1` does and its
    /// `alloc_decode` when the batch size does. A call that fails with `OutOfMemory` merges
    /// nothing (SGLang merges first). Turning the mode off merges the release list.
    fn set_sorted_release(&mut self, on: bool);
    /// Whether sorted-release mode is on.
    fn sorted_release(&self) -> bool;
    /// Merges the release list into the free list and sorts the free list ascending; with an
    /// empty release list it does nothing (the free list keeps its order), as SGLang.
    fn merge_and_sort_free(&mut self);

    /// Snapshots the whole state (SGLang's `backup_state`).
    fn backup_state(&self) -> AllocatorState;
    /// Restores a snapshot taken from an allocator of the same kind, page size and size.
    fn restore_state(&mut self, state: &AllocatorState) -> Result<()>;
    /// Frees everything: back to the initial state.
    fn clear(&mut self);

    /// Whether `page` is currently allocated.
    fn is_allocated(&self, page: Page) -> bool;
    /// Every page that is not allocated: free list, release list and open-group pages, in that
    /// order (for the ownership checker).
    fn unallocated_pages(&self) -> Vec<Page>;
}

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
    /// Moves `k ≤ free.len()` pages from the head into `out`, head first.
    fn take(free: &mut VecDeque<u32>, k: usize, out: &mut Vec<u32>);
    /// The free list in reuse order, head first.
    fn head_first(free: &VecDeque<u32>) -> Vec<u32>;
    /// A free list that hands out `ascending` in ascending order.
    fn from_ascending(ascending: Vec<u32>) -> VecDeque<u32>;
}

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

/// Page size 1, FIFO reuse: SGLang's `TokenToKVPoolAllocator`.
pub type TokenAllocator = SlotAllocator<Fifo>;
/// Page size `P`, LIFO reuse: SGLang's `PagedTokenToKVPoolAllocator`.
pub type PagedAllocator = SlotAllocator<Lifo>;

/// The mutable part of an allocator, shared by [`SlotAllocator`] and [`AllocatorState`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolState {
    free: VecDeque<u32>,
    release: Vec<u32>,
    /// Bit `p` set ⇔ page `p` is allocated.
    allocated: Vec<u64>,
    /// Pages freed inside an open free group (already unallocated, not yet reusable).
    group: Option<Vec<u32>>,
}

impl PoolState {
    fn new<O: ReuseOrder>(num_pages: u32) -> Self {
        PoolState {
            free: O::from_ascending((1..=num_pages).collect()),
            release: Vec::new(),
            allocated: vec![0; (num_pages as usize + 1).div_ceil(64)],
            group: None,
        }
    }

    #[inline]
    fn is_allocated(&self, page: u32) -> bool {
        self.allocated[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    #[inline]
    fn set_allocated(&mut self, page: u32) {
        self.allocated[(page / 64) as usize] |= 1 << (page % 64);
    }
}

/// A snapshot of an allocator's state (free list, release list, allocation bitmap, open group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatorState {
    reuse: &'static str,
    page_size: u32,
    num_pages: u32,
    sorted_release: bool,
    state: PoolState,
}

/// The allocator behind [`TokenAllocator`] and [`PagedAllocator`]; `O` picks the reuse order.
#[derive(Debug, Clone)]
pub struct SlotAllocator<O: ReuseOrder> {
    page_size: u32,
    /// `log2(page_size)` when it is a power of two (the common case): page math by shift.
    page_shift: Option<u32>,
    num_pages: u32,
    sorted_release: bool,
    state: PoolState,
    /// Scratch: pages taken or freed by the current call.
    scratch: Vec<u32>,
    /// Scratch bitmap marking partial pages continued by the current batch (duplicate check).
    marks: Vec<u64>,
    _order: PhantomData<O>,
}

impl TokenAllocator {
    /// A token allocator over slots `1..=size`.
    pub fn new(size: usize) -> Result<Self> {
        Self::with_page_size(size, 1)
    }
}

impl PagedAllocator {
    /// A paged allocator over pages `1..=size/P` (slots `P..size+P`); `size` must be a positive
    /// multiple of `page_size`.
    pub fn new(size: usize, page_size: u32) -> Result<Self> {
        Self::with_page_size(size, page_size)
    }
}

impl<O: ReuseOrder> SlotAllocator<O> {
    /// An allocator with any reuse order and page size (for experiments: e.g. FIFO at `P = 16`).
    pub fn with_page_size(size: usize, page_size: u32) -> Result<Self> {
        let num_pages = crate::layout::checked_pool_pages(size, page_size)?;
        let state = PoolState::new::<O>(num_pages);
        let marks = vec![0; state.allocated.len()];
        Ok(SlotAllocator {
            page_size,
            page_shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            num_pages,
            sorted_release: false,
            state,
            scratch: Vec::new(),
            marks,
            _order: PhantomData,
        })
    }

    /// The page holding slot id `slot`.
    #[inline]
    fn page_of(&self, slot: u32) -> u32 {
        match self.page_shift {
            Some(shift) => slot >> shift,
            None => slot / self.page_size,
        }
    }

    /// One past the last allocatable slot.
    fn slot_end(&self) -> u32 {
        (self.num_pages + 1) * self.page_size
    }

    /// Checks that `slot` is an allocatable slot on an allocated page; returns its page.
    fn check_owned_slot(&self, slot: Slot) -> Result<u32> {
        if slot.0 < self.page_size || slot.0 >= self.slot_end() {
            return Err(KvPoolError::SlotOutOfRange {
                slot,
                first: self.page_size,
                end: self.slot_end(),
            });
        }
        let page = slot.0 / self.page_size;
        if !self.state.is_allocated(page) {
            return Err(KvPoolError::PageNotAllocated {
                page: Page(page),
                slot,
            });
        }
        Ok(page)
    }

    /// Makes sure `pages` pages can be taken from the free list; `Err(OutOfMemory)` (nothing
    /// changed) otherwise.
    ///
    /// In sorted-release mode the release list is merged first when SGLang would merge:
    /// `merge_when` is SGLang's estimate of the pages the call needs (`≥ pages`), and the merge
    /// happens when it exceeds the free list. One deliberate difference: SGLang merges before it
    /// knows the call fails; here a call that fails with `OutOfMemory` merges nothing, so an
    /// `Err` changes nothing (the crate's invariant).
    fn ensure_free_pages(&mut self, pages: usize, merge_when: usize) -> Result<()> {
        debug_assert!(merge_when >= pages);
        let free = self.state.free.len();
        let release = self.state.release.len();
        if self.sorted_release && merge_when > free && pages <= free + release {
            self.merge_and_sort_free();
        }
        if pages <= self.state.free.len() {
            return Ok(());
        }
        Err(KvPoolError::OutOfMemory {
            requested_tokens: pages.saturating_mul(self.page_size as usize),
            available_tokens: self.available_size(),
        })
    }

    /// Moves `pages` pages from the head of the free list into `self.scratch`, marking them
    /// allocated. The caller has checked availability.
    fn take_pages(&mut self, pages: usize) {
        self.scratch.clear();
        O::take(&mut self.state.free, pages, &mut self.scratch);
        // Consecutive pages share a bitmap word: accumulate in a register, store once per word.
        let mut word = BitmapWord {
            index: usize::MAX,
            allocated: 0,
            marks: 0,
        };
        for &page in &self.scratch {
            let w = (page / 64) as usize;
            if w != word.index {
                word.flush_allocated(&mut self.state.allocated);
                word = BitmapWord {
                    index: w,
                    allocated: self.state.allocated[w],
                    marks: 0,
                };
            }
            debug_assert!(
                word.allocated & (1 << (page % 64)) == 0,
                "free page {page} is allocated"
            );
            word.allocated |= 1 << (page % 64);
        }
        word.flush_allocated(&mut self.state.allocated);
    }

    /// Validates a partial page being continued by batch entry `index` and marks it, so two
    /// entries continuing the same page (which would hand one slot out twice) are refused.
    fn mark_partial_page(&mut self, index: usize, page: u32) -> Result<()> {
        let (w, b) = ((page / 64) as usize, 1u64 << (page % 64));
        if self.marks[w] & b != 0 {
            return Err(KvPoolError::InvalidBatchEntry {
                index,
                reason: format!(
                    "continues {} which an earlier entry of the batch also continues",
                    Page(page)
                ),
            });
        }
        self.marks[w] |= b;
        Ok(())
    }

    fn clear_marks(&mut self, pages: impl Iterator<Item = u32>) {
        for page in pages {
            self.marks[(page / 64) as usize] &= !(1u64 << (page % 64));
        }
    }

    /// Validates `last_loc` for an entry whose position `pos` (the last owned position) must sit
    /// at `last_loc`; returns its page.
    fn check_last_loc(&self, index: usize, last_loc: Slot, pos: usize) -> Result<u32> {
        let page = self
            .check_owned_slot(last_loc)
            .map_err(|e| KvPoolError::InvalidBatchEntry {
                index,
                reason: format!("last_loc: {e}"),
            })?;
        let p = self.page_size as usize;
        if last_loc.0 as usize % p != pos % p {
            return Err(KvPoolError::InvalidBatchEntry {
                index,
                reason: format!(
                    "last_loc {last_loc} has page offset {} but position {pos} needs offset {}",
                    last_loc.0 as usize % p,
                    pos % p
                ),
            });
        }
        Ok(page)
    }

    /// Validates an extend batch; returns the number of new pages it needs and the page count
    /// at which sorted-release mode merges (see [`ReuseOrder::PAGED_MERGE_RULE`]).
    fn validate_extend(&mut self, batch: &[ExtendRequest]) -> Result<(usize, usize)> {
        let p = self.page_size as usize;
        let mut demand = 0usize;
        let mut extend_tokens = 0usize;
        let mut partial_pages = Vec::new();
        let result = (|| {
            for (index, r) in batch.iter().enumerate() {
                if r.seq_len < r.prefix_len {
                    return Err(KvPoolError::InvalidBatchEntry {
                        index,
                        reason: format!(
                            "seq_len {} is shorter than prefix_len {}",
                            r.seq_len, r.prefix_len
                        ),
                    });
                }
                match (r.prefix_len, r.last_loc) {
                    (0, Some(l)) => {
                        return Err(KvPoolError::InvalidBatchEntry {
                            index,
                            reason: format!("last_loc {l} given for an empty prefix"),
                        })
                    }
                    (0, None) => {}
                    (prefix, None) if prefix % p != 0 => {
                        return Err(KvPoolError::InvalidBatchEntry {
                            index,
                            reason: format!(
                                "prefix_len {prefix} ends inside a page, so last_loc is required"
                            ),
                        })
                    }
                    (_, None) => {}
                    (prefix, Some(l)) => {
                        let page = self.check_last_loc(index, l, prefix - 1)?;
                        // Only a partial page that gets new slots is continued.
                        if prefix % p != 0 && r.seq_len > r.prefix_len {
                            self.mark_partial_page(index, page)?;
                            partial_pages.push(page);
                        }
                    }
                }
                let new_pages = r.seq_len.div_ceil(p) - r.prefix_len.div_ceil(p);
                demand = demand
                    .checked_add(new_pages)
                    .ok_or(KvPoolError::Overflow("alloc_extend page demand"))?;
                extend_tokens = extend_tokens.saturating_add(r.seq_len - r.prefix_len);
            }
            // SGLang's paged allocator: `extend_num_tokens // P + bs + 1 > len(free_pages)`;
            // this bound is at least `demand + 1`, so it never merges less than the demand needs.
            let merge_when = if O::PAGED_MERGE_RULE {
                (extend_tokens / p).saturating_add(batch.len() + 1)
            } else {
                demand
            };
            Ok((demand, merge_when))
        })();
        self.clear_marks(partial_pages.into_iter());
        result
    }

    /// Validates a decode batch; returns the number of new pages it needs (at most the batch
    /// size, which is where SGLang's paged allocator merges in sorted-release mode).
    fn validate_decode(&mut self, batch: &[DecodeRequest]) -> Result<usize> {
        let p = self.page_size as usize;
        let mut demand = 0usize;
        let mut partial_pages = Vec::new();
        let result = (|| {
            for (index, r) in batch.iter().enumerate() {
                if r.seq_len == 0 {
                    return Err(KvPoolError::InvalidBatchEntry {
                        index,
                        reason: "seq_len must count the new token (≥ 1)".into(),
                    });
                }
                let needs_page = (r.seq_len - 1) % p == 0;
                match r.last_loc {
                    None if !needs_page => {
                        return Err(KvPoolError::InvalidBatchEntry {
                            index,
                            reason: format!(
                                "seq_len {} continues a partial page, so last_loc is required",
                                r.seq_len
                            ),
                        })
                    }
                    None => {}
                    Some(l) if r.seq_len == 1 => {
                        return Err(KvPoolError::InvalidBatchEntry {
                            index,
                            reason: format!(
                                "last_loc {l} given for a request with no previous token"
                            ),
                        })
                    }
                    Some(l) => {
                        let page = self.check_last_loc(index, l, r.seq_len - 2)?;
                        if !needs_page {
                            self.mark_partial_page(index, page)?;
                            partial_pages.push(page);
                        }
                    }
                }
                demand += usize::from(needs_page);
            }
            Ok(demand)
        })();
        self.clear_marks(partial_pages.into_iter());
        result
    }

    /// Returns freed pages (already unallocated in the bitmap) to the group buffer, the release
    /// list or the free list.
    fn return_freed(&mut self, mut pages: Vec<u32>) {
        if O::SORT_FREED {
            pages.sort_unstable();
        }
        if let Some(group) = &mut self.state.group {
            group.extend_from_slice(&pages);
        } else if self.sorted_release {
            self.state.release.extend_from_slice(&pages);
        } else {
            O::give(&mut self.state.free, &pages);
        }
        pages.clear();
        self.scratch = pages;
    }
}

impl<O: ReuseOrder> Allocator for SlotAllocator<O> {
    fn page_size(&self) -> u32 {
        self.page_size
    }

    fn size(&self) -> usize {
        self.num_pages as usize * self.page_size as usize
    }

    fn num_pages(&self) -> usize {
        self.num_pages as usize
    }

    fn available_size(&self) -> usize {
        (self.state.free.len() + self.state.release.len()) * self.page_size as usize
    }

    fn alloc(&mut self, n: usize, out: &mut Vec<Slot>) -> Result<()> {
        let p = self.page_size as usize;
        if n % p != 0 {
            return Err(KvPoolError::NotPageAligned {
                n,
                page_size: self.page_size,
            });
        }
        let pages = n / p;
        self.ensure_free_pages(pages, pages)?;
        self.take_pages(pages);
        out.reserve(n);
        for &page in &self.scratch {
            out.extend(Page(page).slots(self.page_size));
        }
        Ok(())
    }

    fn alloc_extend(&mut self, batch: &[ExtendRequest], out: &mut Vec<Slot>) -> Result<()> {
        let (demand, merge_when) = self.validate_extend(batch)?;
        self.ensure_free_pages(demand, merge_when)?;
        self.take_pages(demand);
        let p = self.page_size;
        let total: usize = batch.iter().map(|r| r.seq_len - r.prefix_len).sum();
        out.reserve(total);
        let mut next_page = 0usize;
        for r in batch {
            // Phase 1: finish the partial prefix page from last_loc + 1.
            let prefix_page_end = r.prefix_len.div_ceil(p as usize) * p as usize;
            let phase1 = prefix_page_end.min(r.seq_len) - r.prefix_len;
            if phase1 > 0 {
                let first = r
                    .last_loc
                    .expect("validated: partial prefix has last_loc")
                    .0
                    + 1;
                out.extend((first..first + phase1 as u32).map(Slot));
            }
            // Phases 2 and 3: whole pages, then a trailing partial page at offsets 0, 1, ….
            let mut remaining = r.seq_len - r.prefix_len - phase1;
            if p == 1 {
                out.extend_from_slice(crate::ids::u32_as_slots(
                    &self.scratch[next_page..next_page + remaining],
                ));
                next_page += remaining;
                continue;
            }
            while remaining > 0 {
                let n = remaining.min(p as usize) as u32;
                let first = self.scratch[next_page] * p;
                out.extend((first..first + n).map(Slot));
                next_page += 1;
                remaining -= n as usize;
            }
        }
        debug_assert_eq!(next_page, demand);
        Ok(())
    }

    fn alloc_decode(&mut self, batch: &[DecodeRequest], out: &mut Vec<Slot>) -> Result<()> {
        let demand = self.validate_decode(batch)?;
        let merge_when = if O::PAGED_MERGE_RULE {
            batch.len()
        } else {
            demand
        };
        self.ensure_free_pages(demand, merge_when)?;
        self.take_pages(demand);
        let p = self.page_size as usize;
        out.reserve(batch.len());
        let mut next_page = 0usize;
        for r in batch {
            if (r.seq_len - 1) % p == 0 {
                out.push(Page(self.scratch[next_page]).first_slot(self.page_size));
                next_page += 1;
            } else {
                out.push(Slot(
                    r.last_loc.expect("validated: partial page has last_loc").0 + 1,
                ));
            }
        }
        Ok(())
    }

    fn free(&mut self, slots: &[Slot]) -> Result<()> {
        // One pass over maximal runs of consecutive slots (the common case: a request's slots),
        // found 64 at a time with branch-free compares; each page a run covers is visited once.
        // A page seen earlier in this call is marked, so a repeat is deduped rather than taken
        // for a double free; on error every page cleared so far is restored: nothing changes.
        let mut pages = std::mem::take(&mut self.scratch);
        pages.clear();
        let (first, end) = (self.page_size, self.slot_end());
        // The bitmap word of the current page, kept in registers: consecutive pages share a
        // word, and a load/store per page would chain through memory.
        let mut word = BitmapWord {
            index: usize::MAX,
            allocated: 0,
            marks: 0,
        };
        let mut prev = u32::MAX;
        let mut error = None;
        let mut i = 0;
        'runs: while i < slots.len() {
            let base = slots[i].0;
            let len = consecutive_run(&slots[i..]);
            let last = base as u64 + len as u64 - 1;
            // A run that leaves the pool is handled slot by slot, to name the offending slot.
            let len = if base >= first && last < end as u64 {
                len
            } else {
                1
            };
            let slot = slots[i];
            if slot.0 < first || slot.0 >= end {
                error = Some(KvPoolError::SlotOutOfRange { slot, first, end });
                break;
            }
            let (mut page, last_page) = (self.page_of(base), self.page_of(base + (len as u32 - 1)));
            if page == prev {
                page += 1; // the previous run ended in this page
            }
            // Word by word: bits page..=hi of word w; all allocated (the common case) is one
            // mask operation for up to 64 pages.
            while page <= last_page {
                let w = (page / 64) as usize;
                let hi = last_page.min(page | 63);
                let mask = (u64::MAX >> (63 - hi % 64)) & (u64::MAX << (page % 64));
                if w != word.index {
                    word.flush(&mut self.state.allocated, &mut self.marks);
                    word = BitmapWord::load(w, &self.state.allocated, &self.marks);
                }
                if word.allocated & mask == mask {
                    word.allocated &= !mask;
                    word.marks |= mask;
                    pages.extend(page..hi + 1); // a Range (TrustedLen), unlike ..=
                } else {
                    for pg in page..=hi {
                        let b = 1u64 << (pg % 64);
                        if word.allocated & b != 0 {
                            word.allocated &= !b;
                            word.marks |= b;
                            pages.push(pg);
                        } else if word.marks & b == 0 {
                            // Name the first slot of the run that lies in this page.
                            let slot = Slot(base.max(pg * self.page_size));
                            error = Some(KvPoolError::PageNotAllocated {
                                page: Page(pg),
                                slot,
                            });
                            break 'runs;
                        }
                    }
                }
                page = hi + 1;
            }
            prev = last_page;
            i += len;
        }
        word.flush(&mut self.state.allocated, &mut self.marks);
        // Marks are all zero between calls, so clearing a touched word is a plain store.
        for &page in &pages {
            self.marks[(page / 64) as usize] = 0;
        }
        if let Some(e) = error {
            for &page in &pages {
                self.state.set_allocated(page);
            }
            pages.clear();
            self.scratch = pages;
            return Err(e);
        }
        self.return_freed(pages);
        Ok(())
    }

    fn free_group_begin(&mut self) -> Result<()> {
        if self.state.group.is_some() {
            return Err(KvPoolError::FreeGroup(
                "free_group_begin while a group is already open",
            ));
        }
        self.state.group = Some(Vec::new());
        Ok(())
    }

    fn free_group_end(&mut self) -> Result<()> {
        let pages = self.state.group.take().ok_or(KvPoolError::FreeGroup(
            "free_group_end without free_group_begin",
        ))?;
        self.return_freed(pages);
        Ok(())
    }

    fn free_group_open(&self) -> bool {
        self.state.group.is_some()
    }

    fn set_sorted_release(&mut self, on: bool) {
        if !on && !self.state.release.is_empty() {
            self.merge_and_sort_free();
        }
        self.sorted_release = on;
    }

    fn sorted_release(&self) -> bool {
        self.sorted_release
    }

    fn merge_and_sort_free(&mut self) {
        // As SGLang: with nothing released there is nothing to merge, and the free list keeps
        // its order.
        if self.state.release.is_empty() {
            return;
        }
        let release = std::mem::take(&mut self.state.release);
        let mut all: Vec<u32> = std::mem::take(&mut self.state.free).into();
        all.extend_from_slice(&release);
        all.sort_unstable();
        self.state.free = O::from_ascending(all);
    }

    fn backup_state(&self) -> AllocatorState {
        AllocatorState {
            reuse: O::NAME,
            page_size: self.page_size,
            num_pages: self.num_pages,
            sorted_release: self.sorted_release,
            state: self.state.clone(),
        }
    }

    fn restore_state(&mut self, state: &AllocatorState) -> Result<()> {
        if state.reuse != O::NAME
            || state.page_size != self.page_size
            || state.num_pages != self.num_pages
        {
            return Err(KvPoolError::StateMismatch(format!(
                "snapshot of a {} allocator with P={} and {} pages restored into a {} allocator with P={} and {} pages",
                state.reuse, state.page_size, state.num_pages, O::NAME, self.page_size, self.num_pages
            )));
        }
        self.sorted_release = state.sorted_release;
        self.state.clone_from(&state.state);
        Ok(())
    }

    fn clear(&mut self) {
        self.state = PoolState::new::<O>(self.num_pages);
    }

    fn is_allocated(&self, page: Page) -> bool {
        page.0 >= 1 && page.0 <= self.num_pages && self.state.is_allocated(page.0)
    }

    fn unallocated_pages(&self) -> Vec<Page> {
        let group = self.state.group.iter().flatten();
        self.state
            .free
            .iter()
            .chain(&self.state.release)
            .chain(group)
            .map(|&p| Page(p))
            .collect()
    }
}

/// Length of the run of consecutive slot ids at the start of `slots` (at least 1 if non-empty).
fn consecutive_run(slots: &[Slot]) -> usize {
    const CHUNK: usize = 64;
    let Some(base) = slots.first().map(|s| s.0) else {
        return 0;
    };
    let mut len = 1;
    // Whole chunks, branch-free inside, so each compiles to vector compares.
    while let Some(chunk) = slots.get(len..len + CHUNK) {
        let mut consecutive = true;
        for (k, s) in chunk.iter().enumerate() {
            consecutive &= s.0 == base.wrapping_add((len + k) as u32);
        }
        if !consecutive {
            break;
        }
        len += CHUNK;
    }
    while len < slots.len() && slots[len].0 == base.wrapping_add(len as u32) {
        len += 1;
    }
    len
}

/// One word of the allocation and mark bitmaps, cached while `free` walks consecutive pages.
struct BitmapWord {
    index: usize,
    allocated: u64,
    marks: u64,
}

impl BitmapWord {
    fn load(index: usize, allocated: &[u64], marks: &[u64]) -> Self {
        BitmapWord {
            index,
            allocated: allocated[index],
            marks: marks[index],
        }
    }

    fn flush(&self, allocated: &mut [u64], marks: &mut [u64]) {
        if self.index != usize::MAX {
            allocated[self.index] = self.allocated;
            marks[self.index] = self.marks;
        }
    }

    fn flush_allocated(&self, allocated: &mut [u64]) {
        if self.index != usize::MAX {
            allocated[self.index] = self.allocated;
        }
    }
}

/// Renders a list of page ids compactly: ascending runs of consecutive ids as `a-b`.
pub fn render_page_runs(pages: impl IntoIterator<Item = u32>) -> String {
    let mut out = String::new();
    let mut run: Option<(u32, u32)> = None;
    let flush = |out: &mut String, (a, b): (u32, u32)| {
        if !out.is_empty() {
            out.push(' ');
        }
        if a == b {
            out.push_str(&a.to_string());
        } else {
            out.push_str(&format!("{a}-{b}"));
        }
    };
    for p in pages {
        run = match run {
            Some((a, b)) if p == b + 1 => Some((a, p)),
            Some(r) => {
                flush(&mut out, r);
                Some((p, p))
            }
            None => Some((p, p)),
        };
    }
    if let Some(r) = run {
        flush(&mut out, r);
    }
    out
}

impl<O: ReuseOrder> fmt::Display for SlotAllocator<O> {
    /// One readable line: reuse order, page size, available slots, the free list in order, the
    /// release list, the open group, and the allocated pages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let allocated = (1..=self.num_pages).filter(|&p| self.state.is_allocated(p));
        write!(
            f,
            "{} P={} pages={} available={} free=[{}] release=[{}]",
            O::NAME,
            self.page_size,
            self.num_pages,
            self.available_size(),
            render_page_runs(O::head_first(&self.state.free)),
            render_page_runs(self.state.release.iter().copied()),
        )?;
        if let Some(group) = &self.state.group {
            write!(f, " group=[{}]", render_page_runs(group.iter().copied()))?;
        }
        write!(f, " allocated=[{}]", render_page_runs(allocated))
    }
}

/// Every allocator this crate implements, as one value with static dispatch (the engine's
/// allocator component). [`AnyAllocator::for_page_size`] picks as SGLang does: the token
/// allocator for `P = 1`, the paged one otherwise.
#[enum_dispatch::enum_dispatch(Allocator)]
#[derive(Debug)]
pub enum AnyAllocator {
    /// [`TokenAllocator`] (FIFO reuse, `P = 1`).
    Token(TokenAllocator),
    /// [`PagedAllocator`] (LIFO page reuse).
    Paged(PagedAllocator),
}

impl AnyAllocator {
    /// The names [`AnyAllocator::name`] returns, for listings.
    pub const NAMES: [&'static str; 2] = ["token", "paged"];

    /// SGLang's choice for `size` slots of page size `page_size`: [`TokenAllocator`] when
    /// `page_size == 1` (`TokenToKVPoolAllocator`), [`PagedAllocator`] otherwise
    /// (`PagedTokenToKVPoolAllocator`).
    pub fn for_page_size(size: usize, page_size: u32) -> Result<Self> {
        Ok(if page_size == 1 {
            AnyAllocator::Token(TokenAllocator::new(size)?)
        } else {
            AnyAllocator::Paged(PagedAllocator::new(size, page_size)?)
        })
    }

    /// The implementation's name (one of [`AnyAllocator::NAMES`]).
    pub fn name(&self) -> &'static str {
        match self {
            AnyAllocator::Token(_) => Self::NAMES[0],
            AnyAllocator::Paged(_) => Self::NAMES[1],
        }
    }
}
