//! A toy paged allocator written against `kv_pool::Allocator` alone: free pages live in a
//! `BTreeSet` and are handed out lowest-first (kv-pool's allocators reuse FIFO or LIFO), and
//! batch allocations fill each request in turn (SGLang fills all partial pages of a batch, then
//! all whole pages, then all trailing pages).

use std::collections::{BTreeSet, HashSet};

use kv_pool::{
    Allocator, AllocatorState, DecodeRequest, ExtendRequest, KvPoolError, Page, Result, Slot,
};

/// The name its snapshots carry; `restore_state` refuses any other kind's.
const KIND: &str = "toy-lowest-first";

/// Lowest-first paged allocator. Pages are `1..=num_pages` (page 0 is padding); a page is in
/// exactly one of: `free`, `release` (sorted-release mode), the open free `group`, or allocated.
#[derive(Debug, Clone)]
pub struct LowestFirst {
    page_size: u32,
    num_pages: u32,
    free: BTreeSet<u32>,
    release: BTreeSet<u32>,
    group: Option<Vec<u32>>,
    /// Indexed by page; entry 0 (padding) is never set.
    allocated: Vec<bool>,
    sorted_release: bool,
    /// A deliberate bug for the negative test: a free of a free page is silently accepted.
    accepts_double_free: bool,
}

impl LowestFirst {
    /// A pool of `size` slots (a positive multiple of `page_size`) in pages of `page_size`.
    pub fn new(size: usize, page_size: u32) -> Result<Self> {
        let p = page_size as usize;
        if p == 0 || size == 0 || size % p != 0 {
            return Err(KvPoolError::NotPageAligned { n: size, page_size });
        }
        let num_pages =
            u32::try_from(size / p).map_err(|_| KvPoolError::Overflow("toy pool pages"))?;
        Ok(LowestFirst {
            page_size,
            num_pages,
            free: (1..=num_pages).collect(),
            release: BTreeSet::new(),
            group: None,
            allocated: vec![false; num_pages as usize + 1],
            sorted_release: false,
            accepts_double_free: false,
        })
    }

    /// The same allocator with a bug the conformance suite must catch: it frees a page that is
    /// already free without complaint.
    pub fn accepting_double_free(mut self) -> Self {
        self.accepts_double_free = true;
        self
    }

    fn first_slot(&self) -> u32 {
        self.page_size
    }

    fn end_slot(&self) -> u32 {
        (self.num_pages + 1) * self.page_size
    }

    /// Refuses a slot outside the pool.
    fn check_slot(&self, slot: Slot) -> Result<()> {
        if slot.0 < self.first_slot() || slot.0 >= self.end_slot() {
            return Err(KvPoolError::SlotOutOfRange {
                slot,
                first: self.first_slot(),
                end: self.end_slot(),
            });
        }
        Ok(())
    }

    /// Checks that `last_loc` can hold position `pos` of a request: inside the pool, on an
    /// allocated page, with `slot mod P == pos mod P`.
    fn check_last_loc(&self, index: usize, last_loc: Slot, pos: usize) -> Result<()> {
        let bad = |reason: String| KvPoolError::InvalidBatchEntry { index, reason };
        self.check_slot(last_loc)
            .map_err(|e| bad(format!("last_loc: {e}")))?;
        if !self.allocated[(last_loc.0 / self.page_size) as usize] {
            return Err(bad(format!("last_loc {last_loc} is on a free page")));
        }
        if last_loc.0 % self.page_size != (pos % self.page_size as usize) as u32 {
            return Err(bad(format!(
                "last_loc {last_loc} cannot hold position {pos} at page size {}",
                self.page_size
            )));
        }
        Ok(())
    }

    /// Makes `pages` pages available at the head of the free set, merging the release set if
    /// the free set alone is short; `OutOfMemory` (changing nothing) if both together are.
    fn reserve(&mut self, pages: usize, requested_tokens: usize) -> Result<()> {
        if pages > self.free.len() + self.release.len() {
            return Err(KvPoolError::OutOfMemory {
                requested_tokens,
                available_tokens: self.available_size(),
            });
        }
        if pages > self.free.len() {
            self.merge_and_sort_free();
        }
        Ok(())
    }

    /// Takes the lowest free page (after [`Self::reserve`] there is one).
    fn take_page(&mut self) -> u32 {
        let page = self.free.pop_first().expect("reserved");
        self.allocated[page as usize] = true;
        page
    }

    /// Slots for positions `from..to` of a request whose position `from − 1` is at `last`
    /// (`None`: `from` starts a page), fresh pages lowest-first.
    fn grow(&mut self, from: usize, to: usize, mut last: Option<u32>, out: &mut Vec<Slot>) {
        let p = self.page_size as usize;
        for pos in from..to {
            let slot = match last {
                Some(l) if pos % p != 0 => l + 1,
                _ => self.take_page() * self.page_size,
            };
            out.push(Slot(slot));
            last = Some(slot);
        }
    }
}

impl Allocator for LowestFirst {
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
        (self.free.len() + self.release.len()) * self.page_size as usize
    }

    fn alloc(&mut self, n: usize, out: &mut Vec<Slot>) -> Result<()> {
        let p = self.page_size as usize;
        if n % p != 0 {
            return Err(KvPoolError::NotPageAligned {
                n,
                page_size: self.page_size,
            });
        }
        self.reserve(n / p, n)?;
        for _ in 0..n / p {
            let first = self.take_page() * self.page_size;
            out.extend((first..first + self.page_size).map(Slot));
        }
        Ok(())
    }

    fn alloc_extend(&mut self, batch: &[ExtendRequest], out: &mut Vec<Slot>) -> Result<()> {
        let p = self.page_size as usize;
        let mut pages = 0usize;
        let mut continued = HashSet::new();
        for (index, r) in batch.iter().enumerate() {
            let bad = |reason: &str| KvPoolError::InvalidBatchEntry {
                index,
                reason: reason.into(),
            };
            if r.seq_len < r.prefix_len {
                return Err(bad("seq_len < prefix_len"));
            }
            match (r.prefix_len, r.last_loc) {
                (0, Some(_)) => return Err(bad("last_loc given for an empty prefix")),
                (0, None) => {}
                (n, None) if n % p != 0 => return Err(bad("a mid-page prefix needs last_loc")),
                (_, None) => {}
                (n, Some(l)) => {
                    self.check_last_loc(index, l, n - 1)?;
                    if n % p != 0 && !continued.insert(l.0 / self.page_size) {
                        return Err(bad("two entries continue one partial page"));
                    }
                }
            }
            pages = pages
                .checked_add(r.seq_len.div_ceil(p) - r.prefix_len.div_ceil(p))
                .ok_or(KvPoolError::Overflow("toy alloc_extend page demand"))?;
        }
        self.reserve(pages, pages.saturating_mul(p))?;
        for r in batch {
            self.grow(r.prefix_len, r.seq_len, r.last_loc.map(|s| s.0), out);
        }
        Ok(())
    }

    fn alloc_decode(&mut self, batch: &[DecodeRequest], out: &mut Vec<Slot>) -> Result<()> {
        let p = self.page_size as usize;
        let mut pages = 0;
        let mut continued = HashSet::new();
        for (index, r) in batch.iter().enumerate() {
            let bad = |reason: &str| KvPoolError::InvalidBatchEntry {
                index,
                reason: reason.into(),
            };
            let fresh = r.seq_len % p == 1 % p;
            match (r.seq_len, r.last_loc) {
                (0, _) => return Err(bad("seq_len 0")),
                (1, Some(_)) => return Err(bad("last_loc given for a request's first token")),
                (_, None) if !fresh => return Err(bad("a partial page needs last_loc")),
                (_, None) => {}
                (n, Some(l)) => {
                    self.check_last_loc(index, l, n - 2)?;
                    if !fresh && !continued.insert(l.0 / self.page_size) {
                        return Err(bad("two entries continue one partial page"));
                    }
                }
            }
            pages += usize::from(fresh);
        }
        self.reserve(pages, pages * p)?;
        for r in batch {
            let (from, last) = (r.seq_len - 1, r.last_loc.map(|s| s.0));
            self.grow(from, r.seq_len, last, out);
        }
        Ok(())
    }

    fn free(&mut self, slots: &[Slot]) -> Result<()> {
        let mut pages = Vec::new();
        for &slot in slots {
            self.check_slot(slot)?;
            let page = slot.0 / self.page_size;
            if pages.contains(&page) {
                continue;
            }
            if !self.allocated[page as usize] {
                if self.accepts_double_free {
                    continue;
                }
                return Err(KvPoolError::PageNotAllocated {
                    page: Page(page),
                    slot,
                });
            }
            pages.push(page);
        }
        for &page in &pages {
            self.allocated[page as usize] = false;
        }
        match (&mut self.group, self.sorted_release) {
            (Some(group), _) => group.extend(pages),
            (None, true) => self.release.extend(pages),
            (None, false) => self.free.extend(pages),
        }
        Ok(())
    }

    fn free_group_begin(&mut self) -> Result<()> {
        if self.group.is_some() {
            return Err(KvPoolError::FreeGroup("a free group is already open"));
        }
        self.group = Some(Vec::new());
        Ok(())
    }

    fn free_group_end(&mut self) -> Result<()> {
        let pages = self
            .group
            .take()
            .ok_or(KvPoolError::FreeGroup("no free group is open"))?;
        if self.sorted_release {
            self.release.extend(pages);
        } else {
            self.free.extend(pages);
        }
        Ok(())
    }

    fn free_group_open(&self) -> bool {
        self.group.is_some()
    }

    fn set_sorted_release(&mut self, on: bool) {
        if !on {
            self.merge_and_sort_free();
        }
        self.sorted_release = on;
    }

    fn sorted_release(&self) -> bool {
        self.sorted_release
    }

    /// The free set is always sorted: merging is a union.
    fn merge_and_sort_free(&mut self) {
        self.free.append(&mut self.release);
    }

    fn backup_state(&self) -> AllocatorState {
        AllocatorState::new(
            KIND,
            self.page_size,
            self.num_pages,
            self.sorted_release,
            self.free.iter().copied().collect(),
            self.release.iter().copied().collect(),
            self.group.clone(),
        )
        .expect("the toy's pages are each in one place")
    }

    fn restore_state(&mut self, state: &AllocatorState) -> Result<()> {
        if state.kind() != KIND
            || state.page_size() != self.page_size
            || state.num_pages() != self.num_pages
        {
            return Err(KvPoolError::StateMismatch(format!(
                "a {} snapshot (P={}, {} pages) into a {KIND} allocator (P={}, {} pages)",
                state.kind(),
                state.page_size(),
                state.num_pages(),
                self.page_size,
                self.num_pages
            )));
        }
        self.free = state.free_list().into_iter().collect();
        self.release = state.release_list().iter().copied().collect();
        self.group = state.group().map(<[u32]>::to_vec);
        self.allocated = vec![true; self.num_pages as usize + 1];
        self.allocated[0] = false;
        for &page in self.free.iter().chain(&self.release) {
            self.allocated[page as usize] = false;
        }
        for &page in self.group.iter().flatten() {
            self.allocated[page as usize] = false;
        }
        self.sorted_release = state.sorted_release();
        Ok(())
    }

    fn clear(&mut self) {
        let bug = self.accepts_double_free;
        let sorted = self.sorted_release;
        *self = LowestFirst::new(self.size(), self.page_size).expect("same shape");
        self.accepts_double_free = bug;
        self.sorted_release = sorted;
    }

    fn is_allocated(&self, page: Page) -> bool {
        self.allocated
            .get(page.0 as usize)
            .copied()
            .unwrap_or(false)
    }

    fn unallocated_pages(&self) -> Vec<Page> {
        let group = self.group.iter().flatten();
        let all = self.free.iter().chain(&self.release).chain(group);
        all.map(|&p| Page(p)).collect()
    }
}
