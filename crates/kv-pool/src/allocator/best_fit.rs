//! [`BestFit`]: a reuse order that places each request's pages for contiguity — a research
//! policy beside SGLang's two, measured by `kvserve sim --allocator`.
//!
//! The free list is kept sorted ascending. An allocation is split per request (a
//! [`PageWant`] each, in batch order) and each request's pages are placed in turn:
//! 1. grow in place: when the page right after the request's last page is free, the request
//!    continues its run there (as far as that free run reaches);
//! 2. best fit: the rest goes to the smallest free run that holds all of it (lowest address on
//!    a tie), so large runs stay whole for large requests;
//! 3. when no run is large enough, the largest run is taken whole and step 2 repeats for what
//!    is left, so a request spans as few runs as the free space allows.
//!
//! Cost: one pass over the free list per allocating call (its runs), then a scan of the runs
//! per placement; frees merge into the sorted list. Linear in the free pages, where SGLang's
//! orders are constant per page: a policy to measure, not the serving default.

use std::collections::VecDeque;

use super::order::{PageWant, ReuseOrder};

/// Best-fit placement with growth in place, over a free list sorted ascending (module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct BestFit;

/// A run of free pages `start .. start + len`; `len` shrinks from the front as pages are taken.
#[derive(Debug, Clone, Copy)]
struct FreeRun {
    start: u32,
    len: u32,
}

/// The maximal runs of consecutive ids in `ascending`.
fn runs_of(ascending: &[u32]) -> Vec<FreeRun> {
    let mut runs: Vec<FreeRun> = Vec::new();
    for &p in ascending {
        match runs.last_mut() {
            Some(r) if r.start + r.len == p => r.len += 1,
            _ => runs.push(FreeRun { start: p, len: 1 }),
        }
    }
    runs
}

/// Takes `n` pages from the front of `run` into `out`.
fn take_front(run: &mut FreeRun, n: u32, out: &mut Vec<u32>) {
    out.extend(run.start..run.start + n);
    run.start += n;
    run.len -= n;
}

/// Places one want's pages (see the module docs); the caller checked that enough are free.
fn place(runs: &mut [FreeRun], want: PageWant, out: &mut Vec<u32>) {
    let mut left = want.pages as u32;
    if let Some(after) = want.after.and_then(|a| a.checked_add(1)) {
        if let Ok(i) = runs.binary_search_by_key(&after, |r| r.start) {
            let n = left.min(runs[i].len);
            take_front(&mut runs[i], n, out);
            left -= n;
        }
    }
    while left > 0 {
        // The smallest run holding everything left, else the largest run (lowest start on ties).
        let fits = runs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.len >= left)
            .min_by_key(|(i, r)| (r.len, *i));
        let i = match fits {
            Some((i, _)) => i,
            None => {
                runs.iter()
                    .enumerate()
                    .filter(|(_, r)| r.len > 0)
                    .max_by_key(|(i, r)| (r.len, std::cmp::Reverse(*i)))
                    .expect("the caller checked that enough pages are free")
                    .0
            }
        };
        let n = left.min(runs[i].len);
        take_front(&mut runs[i], n, out);
        left -= n;
    }
}

/// Merges two ascending lists.
fn merge_ascending(a: &VecDeque<u32>, b: &[u32]) -> VecDeque<u32> {
    let mut out = VecDeque::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i] <= b[j] {
            out.push_back(a[i]);
            i += 1;
        } else {
            out.push_back(b[j]);
            j += 1;
        }
    }
    out.extend(a.range(i..));
    out.extend(&b[j..]);
    out
}

impl ReuseOrder for BestFit {
    const NAME: &'static str = "best_fit";
    const SORT_FREED: bool = true;
    const PAGED_MERGE_RULE: bool = true;
    const PLACES_PER_REQUEST: bool = true;

    fn give(free: &mut VecDeque<u32>, pages: &[u32]) {
        if pages.windows(2).all(|w| w[0] < w[1]) {
            *free = merge_ascending(free, pages);
        } else {
            let mut sorted = pages.to_vec();
            sorted.sort_unstable();
            *free = merge_ascending(free, &sorted);
        }
    }

    fn take(free: &mut VecDeque<u32>, k: usize, out: &mut Vec<u32>) {
        Self::take_for(
            free,
            &[PageWant {
                pages: k,
                after: None,
            }],
            out,
        );
    }

    fn take_for(free: &mut VecDeque<u32>, wants: &[PageWant], out: &mut Vec<u32>) {
        let from = out.len();
        let mut runs = runs_of(free.make_contiguous());
        for &w in wants {
            place(&mut runs, w, out);
        }
        // Keep what was not taken, still ascending.
        let mut taken: Vec<u32> = out[from..].to_vec();
        taken.sort_unstable();
        let mut t = 0;
        free.retain(|&p| {
            while t < taken.len() && taken[t] < p {
                t += 1;
            }
            !(t < taken.len() && taken[t] == p)
        });
    }

    fn head_first(free: &VecDeque<u32>) -> Vec<u32> {
        free.iter().copied().collect()
    }

    fn from_ascending(ascending: Vec<u32>) -> VecDeque<u32> {
        ascending.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(free: &[u32], wants: &[(usize, Option<u32>)]) -> (Vec<u32>, Vec<u32>) {
        let mut list: VecDeque<u32> = free.iter().copied().collect();
        let wants: Vec<PageWant> = wants
            .iter()
            .map(|&(pages, after)| PageWant { pages, after })
            .collect();
        let mut out = Vec::new();
        BestFit::take_for(&mut list, &wants, &mut out);
        (out, list.into())
    }

    #[test]
    fn the_smallest_run_that_fits_is_chosen() {
        // Runs: 1-5 (5), 8-9 (2), 12-14 (3).
        let free = [1, 2, 3, 4, 5, 8, 9, 12, 13, 14];
        assert_eq!(take(&free, &[(2, None)]).0, [8, 9]);
        assert_eq!(take(&free, &[(3, None)]).0, [12, 13, 14]);
        // Nothing holds 7: the largest run whole, then the best fit for the 2 left.
        let (out, left) = take(&free, &[(7, None)]);
        assert_eq!(out, [1, 2, 3, 4, 5, 8, 9]);
        assert_eq!(left, [12, 13, 14]);
    }

    #[test]
    fn a_request_grows_in_place_first() {
        let free = [3, 4, 10, 11, 12, 13];
        // Page 2 is the request's last: it continues at 3-4, then the best fit for the rest.
        assert_eq!(take(&free, &[(3, Some(2))]).0, [3, 4, 10]);
        // Two requests in one batch, each placed in turn.
        let (out, left) = take(&free, &[(1, Some(9)), (2, None)]);
        assert_eq!(out, [10, 3, 4]);
        assert_eq!(left, [11, 12, 13]);
    }

    #[test]
    fn frees_merge_sorted() {
        let mut list: VecDeque<u32> = [2, 5, 9].into_iter().collect();
        BestFit::give(&mut list, &[7, 1]);
        BestFit::give(&mut list, &[3, 4]);
        assert_eq!(BestFit::head_first(&list), [1, 2, 3, 4, 5, 7, 9]);
    }
}
