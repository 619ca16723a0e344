//! `free` (SGLang's `free`), page-granular with double-free detection: a fast path for one run
//! of consecutive slots (a request's or a tree leaf's, the common case: a few instructions per
//! bitmap word), and the general path over any slots (runs found 64 slots at a time, repeats
//! deduplicated, the first bad slot named, nothing changed on error).

use super::bitmap::{consecutive_run, BitmapWord};
use super::order::ReuseOrder;
use super::slot::SlotAllocator;
use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};

impl<O: ReuseOrder> SlotAllocator<O> {
    /// `free`'s fast path: when `slots` is one run of consecutive slot ids, inside the pool,
    /// whose pages are all allocated (a request's or a leaf's slots, the common case), frees
    /// its pages a bitmap word at a time and returns `true`. Otherwise changes nothing and
    /// returns `false`: the general path then frees or names the error.
    #[inline]
    pub(super) fn free_run(&mut self, slots: &[Slot]) -> bool {
        let (Some(first), Some(last)) = (slots.first(), slots.last()) else {
            return false;
        };
        let (base, top) = (first.0, last.0);
        if base < self.page_size
            || top >= self.slot_end()
            || top.wrapping_sub(base) as usize != slots.len() - 1
            || (slots.len() > 2 && consecutive_run(slots) != slots.len())
        {
            return false;
        }
        let (lo, hi) = (self.page_of(base), self.page_of(top));
        let allocated = &mut self.state.allocated;
        // Bits a..=b of one word (a ≤ b, both in the word).
        let bits = |a: u32, b: u32| (u64::MAX >> (63 - b % 64)) & (u64::MAX << (a % 64));
        if lo / 64 == hi / 64 {
            // One word (every run of up to 64 pages that does not cross a word boundary).
            let (w, mask) = ((lo / 64) as usize, bits(lo, hi));
            if allocated[w] & mask != mask {
                return false;
            }
            allocated[w] &= !mask;
        } else {
            let words = (lo / 64) as usize..=(hi / 64) as usize;
            let mask = |w: usize| bits(lo.max(w as u32 * 64), hi.min(w as u32 * 64 + 63));
            if !words.clone().all(|w| allocated[w] & mask(w) == mask(w)) {
                return false;
            }
            for w in words {
                allocated[w] &= !mask(w);
            }
        }
        self.return_run(lo, hi);
        true
    }

    /// `free`'s general path: any slots, in any order, repeats allowed.
    #[inline(never)]
    pub(super) fn free_runs(&mut self, slots: &[Slot]) -> Result<()> {
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
}
