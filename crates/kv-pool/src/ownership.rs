//! The ownership checker: proves that the allocator's unallocated pages and the pages claimed by
//! owners (tree nodes, request-private tails, anything else) partition the pool exactly.
//!
//! SGLang's leak oracle is a count identity checked when idle (`available + evictable +
//! protected == total`); a count can balance while one page is lost and another owned twice.
//! This checker looks at every page: each of pages `1..=num_pages` must be either unallocated
//! (on the free list, the release list or in an open free group, exactly once, and clear in the
//! allocation bitmap) or claimed by exactly one owner (and set in the bitmap). Later crates call
//! it after every operation in their tests and when the engine is idle.
//!
//! ```
//! use kv_pool::{Allocator, Owner, OwnershipCheck, PagedAllocator, ReqRow};
//! let mut alloc = PagedAllocator::new(16, 4).unwrap();
//! let mut slots = Vec::new();
//! alloc.alloc(8, &mut slots).unwrap();
//! let mut check = OwnershipCheck::new(&alloc);
//! check.claim(Owner::Request(ReqRow(1)), &slots);
//! let summary = check.finish().unwrap();
//! assert_eq!((summary.free_pages, summary.owned_pages), (2, 2));
//! ```

use std::fmt;

use crate::allocator::Allocator;
use crate::ids::{Page, ReqRow, Slot};

/// Who holds a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A prefix-cache tree node (by node id).
    TreeNode(u64),
    /// A request's private slots (by its request row).
    Request(ReqRow),
    /// Anything else, by a label and an id (e.g. a PD pre-allocation, a test fixture).
    Other(&'static str, u64),
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::TreeNode(id) => write!(f, "tree node {id}"),
            Owner::Request(row) => write!(f, "request {row}"),
            Owner::Other(label, id) => write!(f, "{label} {id}"),
        }
    }
}

/// The first (lowest-numbered) page at which the partition fails.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnershipViolation {
    /// Allocated, but nobody claims it: leaked.
    #[error("{page} is lost: allocated but owned by no one")]
    Lost {
        /// The lowest-numbered leaked page.
        page: Page,
    },
    /// Claimed by two different owners.
    #[error("{page} is owned twice: by {first} and by {second}")]
    OwnedTwice {
        /// The lowest-numbered page claimed twice.
        page: Page,
        /// The owner whose claim came first (in `claim` order).
        first: Owner,
        /// The owner whose claim collided with it.
        second: Owner,
    },
    /// Claimed by an owner while the allocator has it as free: a use after free.
    #[error("{page} is owned by {owner} but is free in the allocator")]
    OwnedButFree {
        /// The claimed page, which the allocator lists as unallocated.
        page: Page,
        /// Who claims it (the holder of a dangling slot).
        owner: Owner,
    },
    /// Listed twice among the allocator's unallocated pages: the free list is corrupt.
    #[error("{page} appears twice among the allocator's free pages")]
    FreeTwice {
        /// The page listed twice across the free list, release list and open free group.
        page: Page,
    },
    /// Listed as free while the allocation bitmap says allocated.
    #[error("{page} is on a free list but marked allocated")]
    FreeButAllocated {
        /// The page whose allocation bit is set although the allocator lists it as free.
        page: Page,
    },
    /// A claimed slot outside the pool (or in the padding page).
    #[error("{owner} claims {slot}, outside the pool's pages 1..={last_page}")]
    SlotOutOfRange {
        /// Who made the claim.
        owner: Owner,
        /// The claimed slot, in the padding page 0 or past `last_page`.
        slot: Slot,
        /// The pool's last page.
        last_page: u32,
    },
}

impl OwnershipViolation {
    /// The page the violation is about (0 for a claim outside the pool, so it sorts first).
    pub fn page(&self) -> Page {
        match *self {
            OwnershipViolation::Lost { page }
            | OwnershipViolation::OwnedTwice { page, .. }
            | OwnershipViolation::OwnedButFree { page, .. }
            | OwnershipViolation::FreeTwice { page }
            | OwnershipViolation::FreeButAllocated { page } => page,
            OwnershipViolation::SlotOutOfRange { .. } => Page(0),
        }
    }
}

/// Counts of a passing check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnershipSummary {
    /// Pages the allocator holds as free (including release list and open free group).
    pub free_pages: usize,
    /// Pages claimed by owners.
    pub owned_pages: usize,
    /// Distinct owners that claimed at least one page.
    pub owners: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageState {
    Unseen,
    Free,
    Owned(Owner),
}

/// One check of the partition; build it from the allocator, claim every owner's slots, then
/// [`finish`](OwnershipCheck::finish).
#[derive(Debug)]
pub struct OwnershipCheck {
    page_size: u32,
    states: Vec<PageState>,
    allocated: Vec<bool>,
    violations: Vec<OwnershipViolation>,
    owners: std::collections::HashSet<Owner>,
}

impl OwnershipCheck {
    /// Records the allocator's unallocated pages and its allocation bitmap.
    pub fn new(allocator: &dyn Allocator) -> Self {
        let n = allocator.num_pages();
        let mut check = OwnershipCheck {
            page_size: allocator.page_size(),
            states: vec![PageState::Unseen; n + 1],
            allocated: (0..=n as u32)
                .map(|p| allocator.is_allocated(Page(p)))
                .collect(),
            violations: Vec::new(),
            owners: Default::default(),
        };
        for page in allocator.unallocated_pages() {
            let i = page.index();
            if i == 0 || i > n {
                check.violations.push(OwnershipViolation::SlotOutOfRange {
                    owner: Owner::Other("free list", 0),
                    slot: page.first_slot(check.page_size),
                    last_page: n as u32,
                });
                continue;
            }
            if check.states[i] == PageState::Free {
                check
                    .violations
                    .push(OwnershipViolation::FreeTwice { page });
            }
            if check.allocated[i] {
                check
                    .violations
                    .push(OwnershipViolation::FreeButAllocated { page });
            }
            check.states[i] = PageState::Free;
        }
        check
    }

    /// Claims the pages holding `slots` for `owner`. One owner may claim a page through several
    /// slots or calls; a second owner of the same page is a violation.
    pub fn claim(&mut self, owner: Owner, slots: &[Slot]) {
        for &slot in slots {
            let page = slot.page(self.page_size);
            self.claim_page(owner, page, slot);
        }
    }

    /// Claims whole pages for `owner`.
    pub fn claim_pages(&mut self, owner: Owner, pages: &[Page]) {
        for &page in pages {
            self.claim_page(owner, page, page.first_slot(self.page_size));
        }
    }

    fn claim_page(&mut self, owner: Owner, page: Page, slot: Slot) {
        let last_page = self.states.len() as u32 - 1;
        if page.0 == 0 || page.0 > last_page {
            self.violations.push(OwnershipViolation::SlotOutOfRange {
                owner,
                slot,
                last_page,
            });
            return;
        }
        self.owners.insert(owner);
        match self.states[page.index()] {
            PageState::Unseen => {
                self.states[page.index()] = PageState::Owned(owner);
                if !self.allocated[page.index()] {
                    // Unallocated yet missing from the free lists: report as owned-but-free.
                    self.violations
                        .push(OwnershipViolation::OwnedButFree { page, owner });
                }
            }
            PageState::Owned(first) if first == owner => {}
            PageState::Owned(first) => {
                self.violations.push(OwnershipViolation::OwnedTwice {
                    page,
                    first,
                    second: owner,
                });
            }
            PageState::Free => self
                .violations
                .push(OwnershipViolation::OwnedButFree { page, owner }),
        }
    }

    /// Finishes the check: the lowest-numbered violation, or the counts if the partition holds.
    pub fn finish(mut self) -> Result<OwnershipSummary, OwnershipViolation> {
        for (i, state) in self.states.iter().enumerate().skip(1) {
            if *state == PageState::Unseen {
                self.violations.push(OwnershipViolation::Lost {
                    page: Page(i as u32),
                });
            }
        }
        if let Some(first) = self.violations.iter().min_by_key(|v| v.page()) {
            return Err(first.clone());
        }
        let free_pages = self
            .states
            .iter()
            .filter(|s| **s == PageState::Free)
            .count();
        Ok(OwnershipSummary {
            free_pages,
            owned_pages: self.states.len() - 1 - free_pages,
            owners: self.owners.len(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::{PagedAllocator, TokenAllocator};

    fn paged_with_two_requests() -> (PagedAllocator, Vec<Slot>, Vec<Slot>) {
        let mut alloc = PagedAllocator::new(32, 4).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        alloc.alloc(8, &mut a).unwrap();
        alloc.alloc(4, &mut b).unwrap();
        (alloc, a, b)
    }

    #[test]
    fn partition_holds() {
        let (alloc, a, b) = paged_with_two_requests();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Request(ReqRow(1)), &a[..5]);
        check.claim(Owner::Request(ReqRow(1)), &a[5..]);
        check.claim(Owner::TreeNode(3), &b);
        let s = check.finish().unwrap();
        assert_eq!(
            s,
            OwnershipSummary {
                free_pages: 5,
                owned_pages: 3,
                owners: 2
            }
        );
    }

    #[test]
    fn lost_page_is_reported() {
        let (alloc, a, _b) = paged_with_two_requests();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Request(ReqRow(1)), &a);
        assert_eq!(
            check.finish(),
            Err(OwnershipViolation::Lost { page: Page(3) })
        );
    }

    #[test]
    fn owned_twice_is_reported_at_the_lowest_page() {
        let (alloc, a, b) = paged_with_two_requests();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Request(ReqRow(1)), &a);
        check.claim(Owner::TreeNode(7), &b);
        check.claim(Owner::TreeNode(9), &a[4..]);
        let err = check.finish().unwrap_err();
        assert_eq!(
            err,
            OwnershipViolation::OwnedTwice {
                page: Page(2),
                first: Owner::Request(ReqRow(1)),
                second: Owner::TreeNode(9)
            }
        );
        assert_eq!(
            err.to_string(),
            "page 2 is owned twice: by request row 1 and by tree node 9"
        );
    }

    #[test]
    fn use_after_free_is_reported() {
        let (mut alloc, a, b) = paged_with_two_requests();
        alloc.free(&b).unwrap();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Request(ReqRow(1)), &a);
        check.claim(Owner::TreeNode(1), &b);
        assert_eq!(
            check.finish(),
            Err(OwnershipViolation::OwnedButFree {
                page: Page(3),
                owner: Owner::TreeNode(1)
            })
        );
    }

    #[test]
    fn open_free_group_pages_count_as_free() {
        let mut alloc = TokenAllocator::new(4).unwrap();
        let mut s = Vec::new();
        alloc.alloc(3, &mut s).unwrap();
        alloc.free_group_begin().unwrap();
        alloc.free(&s[..2]).unwrap();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Other("fixture", 0), &s[2..]);
        assert_eq!(check.finish().unwrap().free_pages, 3);
    }

    #[test]
    fn claims_outside_the_pool_are_reported() {
        let alloc = TokenAllocator::new(4).unwrap();
        let mut check = OwnershipCheck::new(&alloc);
        check.claim(Owner::Request(ReqRow(2)), &[Slot(9)]);
        assert_eq!(
            check.finish(),
            Err(OwnershipViolation::SlotOutOfRange {
                owner: Owner::Request(ReqRow(2)),
                slot: Slot(9),
                last_page: 4
            })
        );
    }
}
