//! The mutable state of a slot allocator, and [`AllocatorState`], its snapshot (SGLang's
//! `backup_state`).

use std::collections::VecDeque;

use super::order::ReuseOrder;

/// The mutable part of an allocator, shared by [`SlotAllocator`](crate::allocator::SlotAllocator) and [`AllocatorState`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PoolState {
    pub(super) free: VecDeque<u32>,
    pub(super) release: Vec<u32>,
    /// Bit `p` set ⇔ page `p` is allocated.
    pub(super) allocated: Vec<u64>,
    /// Pages freed inside an open free group (already unallocated, not yet reusable).
    pub(super) group: Option<Vec<u32>>,
}

impl PoolState {
    pub(super) fn new<O: ReuseOrder>(num_pages: u32) -> Self {
        PoolState {
            free: O::from_ascending((1..=num_pages).collect()),
            release: Vec::new(),
            allocated: vec![0; (num_pages as usize + 1).div_ceil(64)],
            group: None,
        }
    }

    #[inline]
    pub(super) fn is_allocated(&self, page: u32) -> bool {
        self.allocated[(page / 64) as usize] & (1 << (page % 64)) != 0
    }

    #[inline]
    pub(super) fn set_allocated(&mut self, page: u32) {
        self.allocated[(page / 64) as usize] |= 1 << (page % 64);
    }
}

/// A snapshot of an allocator's state (free list, release list, allocation bitmap, open group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatorState {
    pub(super) reuse: &'static str,
    pub(super) page_size: u32,
    pub(super) num_pages: u32,
    pub(super) sorted_release: bool,
    pub(super) state: PoolState,
}
