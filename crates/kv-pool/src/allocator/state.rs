//! The mutable state of a slot allocator, and [`AllocatorState`], its snapshot (SGLang's
//! `backup_state`).

use std::collections::VecDeque;

use super::order::{Lifo, ReuseOrder};
use crate::error::{KvPoolError, Result};

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
///
/// An allocator implemented outside this crate builds its snapshot with
/// [`AllocatorState::new`] and reads one back with the accessors, so `backup_state` /
/// `restore_state` (and the conformance suite's "changed nothing" checks, which compare
/// snapshots) work for it too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocatorState {
    pub(super) reuse: &'static str,
    pub(super) page_size: u32,
    pub(super) num_pages: u32,
    pub(super) sorted_release: bool,
    pub(super) state: PoolState,
}

impl AllocatorState {
    /// A snapshot from its parts, for an allocator implemented outside this crate: `kind` names
    /// the implementation (a `restore_state` should refuse another kind's snapshot; this crate's
    /// are `"fifo"` and `"lifo"`), `free` is the free list head first (the next page handed out
    /// first), `release` the sorted-release list, `group` the pages buffered by an open free
    /// group (`None`: no group open). Every other page of `1..=num_pages` is allocated. A page
    /// outside `1..=num_pages`, or one listed twice, is [`KvPoolError::StateMismatch`].
    pub fn new(
        kind: &'static str,
        page_size: u32,
        num_pages: u32,
        sorted_release: bool,
        free: Vec<u32>,
        release: Vec<u32>,
        group: Option<Vec<u32>>,
    ) -> Result<Self> {
        let mut allocated = vec![0u64; (num_pages as usize + 1).div_ceil(64)];
        for page in 1..=num_pages {
            allocated[(page / 64) as usize] |= 1 << (page % 64);
        }
        let mut state = PoolState {
            free: free.into(),
            release,
            allocated,
            group,
        };
        let listed = state.free.iter().chain(&state.release);
        for &page in listed.chain(state.group.iter().flatten()) {
            if page == 0 || page > num_pages || !state.is_allocated(page) {
                return Err(KvPoolError::StateMismatch(format!(
                    "page {page} is outside 1..={num_pages} or listed twice"
                )));
            }
            state.allocated[(page / 64) as usize] &= !(1 << (page % 64));
        }
        if kind == Lifo::NAME {
            // The paged allocator keeps its free list's head at the back.
            state.free.make_contiguous().reverse();
        }
        Ok(AllocatorState {
            reuse: kind,
            page_size,
            num_pages,
            sorted_release,
            state,
        })
    }

    /// The implementation the snapshot was taken from (`"fifo"`, `"lifo"`, or another
    /// allocator's own name).
    pub fn kind(&self) -> &'static str {
        self.reuse
    }

    /// Page size `P` of the allocator the snapshot was taken from.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Allocatable pages of that allocator (page ids `1..=num_pages`).
    pub fn num_pages(&self) -> u32 {
        self.num_pages
    }

    /// Whether sorted-release mode was on.
    pub fn sorted_release(&self) -> bool {
        self.sorted_release
    }

    /// The free list, head first (the order pages would be handed out in).
    pub fn free_list(&self) -> Vec<u32> {
        if self.reuse == Lifo::NAME {
            Lifo::head_first(&self.state.free)
        } else {
            self.state.free.iter().copied().collect()
        }
    }

    /// The sorted-release list (pages freed in sorted-release mode, not yet merged).
    pub fn release_list(&self) -> &[u32] {
        &self.state.release
    }

    /// The pages buffered by an open free group; `None` when no group was open.
    pub fn group(&self) -> Option<&[u32]> {
        self.state.group.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use crate::{Allocator, AllocatorState, PagedAllocator, TokenAllocator};

    #[test]
    fn a_snapshot_rebuilt_from_its_parts_is_equal() {
        let mut paged = PagedAllocator::new(32, 4).unwrap();
        let mut token = TokenAllocator::new(8).unwrap();
        let mut out = Vec::new();
        paged.alloc(12, &mut out).unwrap();
        paged.free(&out[4..8]).unwrap();
        paged.set_sorted_release(true);
        paged.free(&out[..1]).unwrap();
        paged.free_group_begin().unwrap();
        paged.free(&out[8..9]).unwrap();
        token.alloc(3, &mut out).unwrap();
        token.free(&out[out.len() - 2..]).unwrap();
        for s in [paged.backup_state(), token.backup_state()] {
            let rebuilt = AllocatorState::new(
                s.kind(),
                s.page_size(),
                s.num_pages(),
                s.sorted_release(),
                s.free_list(),
                s.release_list().to_vec(),
                s.group().map(<[u32]>::to_vec),
            )
            .unwrap();
            assert_eq!(rebuilt, s);
        }
        let twice = AllocatorState::new("toy", 1, 4, false, vec![1, 1], vec![], None);
        assert!(twice.is_err());
        let outside = AllocatorState::new("toy", 1, 4, false, vec![5], vec![], None);
        assert!(outside.is_err());
    }
}
