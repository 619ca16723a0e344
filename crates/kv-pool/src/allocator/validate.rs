//! Batch validation for `alloc_extend` and `alloc_decode`: every entry is checked (lengths,
//! `last_loc` on an allocated page at the right offset, no partial page continued twice) and the
//! page demand computed before anything changes.

use super::api::{DecodeRequest, ExtendRequest};
use super::order::ReuseOrder;
use super::slot::SlotAllocator;
use crate::error::{KvPoolError, Result};
use crate::ids::{Page, Slot};

impl<O: ReuseOrder> SlotAllocator<O> {
    /// Validates a partial page being continued by batch entry `index` and marks it, so two
    /// entries continuing the same page (which would hand one slot out twice) are refused.
    pub(super) fn mark_partial_page(&mut self, index: usize, page: u32) -> Result<()> {
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

    pub(super) fn clear_marks(&mut self, pages: impl Iterator<Item = u32>) {
        for page in pages {
            self.marks[(page / 64) as usize] &= !(1u64 << (page % 64));
        }
    }

    /// Validates `last_loc` for an entry whose position `pos` (the last owned position) must sit
    /// at `last_loc`; returns its page.
    pub(super) fn check_last_loc(&self, index: usize, last_loc: Slot, pos: usize) -> Result<u32> {
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
    pub(super) fn validate_extend(&mut self, batch: &[ExtendRequest]) -> Result<(usize, usize)> {
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
    pub(super) fn validate_decode(&mut self, batch: &[DecodeRequest]) -> Result<usize> {
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
}
