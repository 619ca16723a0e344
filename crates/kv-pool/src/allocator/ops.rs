//! `impl Allocator for SlotAllocator`: SGLang's `alloc`, three-phase `alloc_extend`,
//! `alloc_decode`, page-granular `free`, free groups, sorted release and backup/restore.

use super::api::{Allocator, DecodeRequest, ExtendRequest};
use super::order::{PageWant, ReuseOrder};
use super::slot::SlotAllocator;
use super::state::{AllocatorState, PoolState};
use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};

impl<O: ReuseOrder> SlotAllocator<O> {
    /// Each request's new pages and last page, for an order that places per request (empty,
    /// and free, for the others).
    fn extend_wants(&self, batch: &[ExtendRequest]) -> Vec<PageWant> {
        if !O::PLACES_PER_REQUEST {
            return Vec::new();
        }
        let p = self.page_size as usize;
        batch
            .iter()
            .map(|r| PageWant {
                pages: r.seq_len.div_ceil(p) - r.prefix_len.div_ceil(p),
                after: r.last_loc.map(|l| self.page_of(l.0)),
            })
            .collect()
    }

    /// The decode requests that start a fresh page, with their last page (see
    /// `extend_wants`).
    fn decode_wants(&self, batch: &[DecodeRequest]) -> Vec<PageWant> {
        if !O::PLACES_PER_REQUEST {
            return Vec::new();
        }
        let p = self.page_size as usize;
        batch
            .iter()
            .filter(|r| (r.seq_len - 1) % p == 0)
            .map(|r| PageWant {
                pages: 1,
                after: r.last_loc.map(|l| self.page_of(l.0)),
            })
            .collect()
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
        self.take_pages(pages, &[PageWant { pages, after: None }]);
        out.reserve(n);
        for &page in &self.scratch {
            out.extend(Page(page).slots(self.page_size));
        }
        Ok(())
    }

    fn alloc_extend(&mut self, batch: &[ExtendRequest], out: &mut Vec<Slot>) -> Result<()> {
        let (demand, merge_when) = self.validate_extend(batch)?;
        self.ensure_free_pages(demand, merge_when)?;
        let wants = self.extend_wants(batch);
        self.take_pages(demand, &wants);
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
        let wants = self.decode_wants(batch);
        self.take_pages(demand, &wants);
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
        if self.free_run(slots) {
            return Ok(());
        }
        self.free_runs(slots)
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
