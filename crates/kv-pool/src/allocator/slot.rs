//! [`SlotAllocator`]: the one allocator behind [`TokenAllocator`] and [`PagedAllocator`] —
//! construction, page math, and taking pages from / returning them to the free list.

use std::fmt;
use std::marker::PhantomData;

use super::api::Allocator;
use super::best_fit::BestFit;
use super::bitmap::BitmapWord;
use super::order::{Fifo, Lifo, PageWant, ReuseOrder};
use super::render::render_page_runs;
use super::state::PoolState;
use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};

/// Page size 1, FIFO reuse: SGLang's `TokenToKVPoolAllocator`.
#[doc(alias = "TokenToKVPoolAllocator")]
pub type TokenAllocator = SlotAllocator<Fifo>;
/// Page size `P`, LIFO reuse: SGLang's `PagedTokenToKVPoolAllocator`.
#[doc(alias = "PagedTokenToKVPoolAllocator")]
pub type PagedAllocator = SlotAllocator<Lifo>;

/// Page size `P`, best-fit placement per request with growth in place: a research policy
/// (see [`BestFit`]), not one of SGLang's.
pub type BestFitAllocator = SlotAllocator<BestFit>;

/// The allocator behind [`TokenAllocator`] and [`PagedAllocator`]; `O` picks the reuse order.
#[derive(Debug, Clone)]
pub struct SlotAllocator<O: ReuseOrder> {
    pub(super) page_size: u32,
    /// `log2(page_size)` when it is a power of two (the common case): page math by shift.
    pub(super) page_shift: Option<u32>,
    pub(super) num_pages: u32,
    pub(super) sorted_release: bool,
    pub(super) state: PoolState,
    /// Scratch: pages taken or freed by the current call.
    pub(super) scratch: Vec<u32>,
    /// Scratch bitmap marking partial pages continued by the current batch (duplicate check).
    pub(super) marks: Vec<u64>,
    pub(super) _order: PhantomData<O>,
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

impl BestFitAllocator {
    /// A best-fit allocator over pages `1..=size/P`; `size` must be a positive multiple of
    /// `page_size`.
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

    /// Grows the pool to `size` slots (a positive multiple of the page size, at least the
    /// current size): the new pages `old + 1 ..= size / P` join the free list as a freed run
    /// would. Allocated slots and the free list's order of the old pages are untouched. For
    /// pools whose slots name no memory (the router's KV index); a pool backed by a KV store
    /// must not outgrow it. `Err` changes nothing.
    pub fn grow(&mut self, size: usize) -> Result<()> {
        let num_pages = crate::layout::checked_pool_pages(size, self.page_size)?;
        if num_pages < self.num_pages {
            return Err(KvPoolError::InvalidConfig {
                field: "size",
                reason: format!(
                    "a pool of {} slots cannot grow to {size}",
                    self.num_pages as usize * self.page_size as usize
                ),
            });
        }
        if num_pages == self.num_pages {
            return Ok(());
        }
        let words = (num_pages as usize + 1).div_ceil(64);
        self.state.allocated.resize(words, 0);
        self.marks.resize(words, 0);
        O::give_run(&mut self.state.free, self.num_pages + 1, num_pages);
        self.num_pages = num_pages;
        Ok(())
    }

    /// The page holding slot id `slot`.
    #[inline]
    pub(super) fn page_of(&self, slot: u32) -> u32 {
        match self.page_shift {
            Some(shift) => slot >> shift,
            None => slot / self.page_size,
        }
    }

    /// One past the last allocatable slot.
    pub(super) fn slot_end(&self) -> u32 {
        (self.num_pages + 1) * self.page_size
    }

    /// Checks that `slot` is an allocatable slot on an allocated page; returns its page.
    pub(super) fn check_owned_slot(&self, slot: Slot) -> Result<u32> {
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
    pub(super) fn ensure_free_pages(&mut self, pages: usize, merge_when: usize) -> Result<()> {
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

    /// Moves `pages` pages from the free list into `self.scratch`, marking them allocated: from
    /// the head, or placed want by want by an order that places per request (`wants` then
    /// splits `pages` by request). The caller has checked availability.
    pub(super) fn take_pages(&mut self, pages: usize, wants: &[PageWant]) {
        self.scratch.clear();
        if O::PLACES_PER_REQUEST && !wants.is_empty() {
            O::take_for(&mut self.state.free, wants, &mut self.scratch);
        } else {
            O::take(&mut self.state.free, pages, &mut self.scratch);
        }
        debug_assert_eq!(self.scratch.len(), pages);
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

    /// Returns the freed pages `first..=last` (already unallocated in the bitmap), as
    /// `return_freed` would, without a buffer.
    pub(super) fn return_run(&mut self, first: u32, last: u32) {
        let pages = first..last + 1;
        if let Some(group) = &mut self.state.group {
            group.extend(pages);
        } else if self.sorted_release {
            self.state.release.extend(pages);
        } else {
            O::give_run(&mut self.state.free, first, last);
        }
    }

    /// Returns freed pages (already unallocated in the bitmap) to the group buffer, the release
    /// list or the free list.
    pub(super) fn return_freed(&mut self, mut pages: Vec<u32>) {
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
