//! Page contiguity, measured: pure functions over a request's page list (in position order)
//! and over an allocator's unallocated pages. What an allocator policy does to contiguity
//! decides how many descriptors the consumers of a request's pages need: PD transfer sends one
//! block per run of consecutive pages (per layer and buffer), and an attention kernel that
//! reads page tables by runs reads one entry per run instead of one per page.
//!
//! - [`page_runs`]: a request's pages → [`RunStats`] (pages, maximal runs of consecutive page
//!   ids in position order, mean run length).
//! - [`FreeFragmentation::of`]: the unallocated pages, in any order → the runs they form in the
//!   page address space (their number, the largest, the fraction of free pages in runs of at
//!   least `k` pages). Order does not matter: fragmentation is about which pages are free, not
//!   about the order a free list hands them out in.
//!
//! A slot list becomes a page list with [`pages_of_slots`] (one entry per page, in position
//! order, a page repeated by consecutive positions counted once).

use crate::ids::{Page, Slot};

/// Contiguity of one page list (a request's pages in position order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunStats {
    /// Pages in the list.
    pub pages: usize,
    /// Maximal runs of consecutive ascending page ids (`p, p + 1, …`); 0 for an empty list.
    pub runs: usize,
}

impl RunStats {
    /// Mean pages per run (`pages / runs`; 0 for an empty list).
    pub fn mean_run_len(&self) -> f64 {
        if self.runs == 0 {
            0.0
        } else {
            self.pages as f64 / self.runs as f64
        }
    }

    /// Adds another list's counts (e.g. one request's to a total).
    pub fn add(&mut self, other: RunStats) {
        self.pages += other.pages;
        self.runs += other.runs;
    }
}

/// Counts the maximal runs of consecutive ascending page ids in `pages` (in the given order): a
/// new run starts wherever a page is not its predecessor plus one.
pub fn page_runs(pages: &[Page]) -> RunStats {
    let runs = pages
        .windows(2)
        .filter(|w| w[0].0.checked_add(1) != Some(w[1].0))
        .count()
        + usize::from(!pages.is_empty());
    RunStats {
        pages: pages.len(),
        runs,
    }
}

/// The distinct pages of a slot list in position order, for page size `page_size` (≥ 1): a page
/// is listed once per stretch of consecutive positions on it (the page rule keeps one page's
/// positions together).
pub fn pages_of_slots(slots: &[Slot], page_size: u32) -> Vec<Page> {
    let p = page_size.max(1);
    let mut pages: Vec<Page> = Vec::with_capacity(slots.len().div_ceil(p as usize));
    for s in slots {
        let page = Page(s.0 / p);
        if pages.last() != Some(&page) {
            pages.push(page);
        }
    }
    pages
}

/// Fragmentation of the unallocated pages: the runs they form in the page address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FreeFragmentation {
    /// Unallocated pages.
    pub free_pages: usize,
    /// Maximal runs of consecutive page ids among them.
    pub free_runs: usize,
    /// Pages in the largest run (0 when nothing is free).
    pub largest_run: usize,
    /// Free pages in runs of at least `min_run` pages.
    pub pages_in_long_runs: usize,
    /// The `k` of `pages_in_long_runs`.
    pub min_run: usize,
}

impl FreeFragmentation {
    /// The fragmentation of `free` (page ids, any order; a page listed twice counts once),
    /// counting runs of at least `min_run` pages as long.
    pub fn of(free: &[Page], min_run: usize) -> Self {
        let mut ids: Vec<u32> = free.iter().map(|p| p.0).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut f = FreeFragmentation {
            free_pages: ids.len(),
            min_run,
            ..FreeFragmentation::default()
        };
        let mut start = 0;
        for i in 1..=ids.len() {
            if i == ids.len() || ids[i - 1].checked_add(1) != Some(ids[i]) {
                let len = i - start;
                if len > 0 {
                    f.free_runs += 1;
                    f.largest_run = f.largest_run.max(len);
                    if len >= min_run {
                        f.pages_in_long_runs += len;
                    }
                }
                start = i;
            }
        }
        f
    }

    /// Fraction of the free pages in runs of at least `min_run` pages (1 when nothing is free:
    /// an empty pool is not fragmented).
    pub fn long_run_fraction(&self) -> f64 {
        if self.free_pages == 0 {
            1.0
        } else {
            self.pages_in_long_runs as f64 / self.free_pages as f64
        }
    }

    /// Mean pages per free run (0 when nothing is free).
    pub fn mean_free_run(&self) -> f64 {
        if self.free_runs == 0 {
            0.0
        } else {
            self.free_pages as f64 / self.free_runs as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pages(ids: &[u32]) -> Vec<Page> {
        ids.iter().map(|&p| Page(p)).collect()
    }

    #[test]
    fn runs_of_a_request() {
        assert_eq!(page_runs(&[]), RunStats { pages: 0, runs: 0 });
        assert_eq!(page_runs(&pages(&[7])).runs, 1);
        let r = page_runs(&pages(&[3, 4, 5, 9, 10, 2, 8]));
        assert_eq!(r, RunStats { pages: 7, runs: 4 });
        assert!((r.mean_run_len() - 1.75).abs() < 1e-12);
        // Descending neighbours are separate runs: a transfer block or a page-table run goes up.
        assert_eq!(page_runs(&pages(&[5, 4, 3])).runs, 3);
        assert_eq!(page_runs(&pages(&[u32::MAX - 1, u32::MAX])).runs, 1);
    }

    #[test]
    fn slots_to_pages() {
        let slots: Vec<Slot> = [16, 17, 18, 19, 64, 65, 20].map(Slot).to_vec();
        assert_eq!(pages_of_slots(&slots, 4), pages(&[4, 16, 5]));
        assert_eq!(pages_of_slots(&slots, 1).len(), 7);
    }

    #[test]
    fn fragmentation_of_a_free_list() {
        let f = FreeFragmentation::of(&pages(&[9, 1, 2, 3, 7, 8, 12, 3]), 3);
        assert_eq!(
            f,
            FreeFragmentation {
                free_pages: 7,
                free_runs: 3,
                largest_run: 3,
                pages_in_long_runs: 6,
                min_run: 3,
            }
        );
        assert!((f.long_run_fraction() - 6.0 / 7.0).abs() < 1e-12);
        let empty = FreeFragmentation::of(&[], 4);
        assert_eq!((empty.free_runs, empty.largest_run), (0, 0));
        assert_eq!(empty.long_run_fraction(), 1.0);
    }

    proptest! {
        /// Runs partition the list: their lengths sum to the page count, each is ascending by
        /// one, and a run boundary is exactly where the list is not ascending by one.
        #[test]
        fn runs_partition_the_list(ids in proptest::collection::vec(0u32..64, 0..48)) {
            let list = pages(&ids);
            let r = page_runs(&list);
            prop_assert_eq!(r.pages, ids.len());
            prop_assert!(r.runs <= ids.len());
            prop_assert_eq!(r.runs == 0, ids.is_empty());
            let breaks = ids.windows(2).filter(|w| w[1] != w[0] + 1).count();
            prop_assert_eq!(r.runs, breaks + usize::from(!ids.is_empty()));
            // Sorting and deduplicating never adds runs beyond the distinct pages.
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            prop_assert!(page_runs(&pages(&sorted)).runs <= sorted.len());
        }

        /// Fragmentation does not depend on order, its runs cover the free pages, and the
        /// long-run count is monotone in `k`.
        #[test]
        fn fragmentation_is_order_free(
            ids in proptest::collection::btree_set(1u32..200, 0..120),
            k in 1usize..10,
        ) {
            let asc: Vec<u32> = ids.iter().copied().collect();
            let mut rev = asc.clone();
            rev.reverse();
            let f = FreeFragmentation::of(&pages(&asc), k);
            prop_assert_eq!(f, FreeFragmentation::of(&pages(&rev), k));
            prop_assert_eq!(f.free_pages, asc.len());
            prop_assert_eq!(f.free_runs, page_runs(&pages(&asc)).runs);
            prop_assert!(f.largest_run <= f.free_pages);
            prop_assert!(f.free_runs == 0 || f.largest_run * f.free_runs >= f.free_pages);
            let longer = FreeFragmentation::of(&pages(&asc), k + 1);
            prop_assert!(longer.pages_in_long_runs <= f.pages_in_long_runs);
            prop_assert_eq!(FreeFragmentation::of(&pages(&asc), 1).pages_in_long_runs, f.free_pages);
        }
    }
}
