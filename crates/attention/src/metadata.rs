//! Backend-neutral batch metadata: per request its query range, KV length and page table.
//!
//! The format follows FlashInfer's paged KV description:
//!
//! - `qo_indptr` (`n + 1` entries): request `r`'s query rows (its new tokens in this batch) are
//!   rows `qo_indptr[r] .. qo_indptr[r + 1]` of the batch's `q`, `k`, `v` and output tensors;
//! - `kv_indptr` (`n + 1`) and `kv_indices`: request `r`'s pages are
//!   `kv_indices[kv_indptr[r] .. kv_indptr[r + 1]]`, in position order;
//! - `last_page_len` (`n`): how many positions of the last page are used (`1..=P`);
//! - `kv_lens` (`n`): KV positions per request, the cached prefix plus the new tokens.
//!
//! Position `p` of request `r` lives at slot `kv_indices[kv_indptr[r] + p / P] · P + p mod P`
//! (kv-pool's page rule, checked when the metadata is built). The new tokens are the last
//! `extend_len` positions; their slots, concatenated in batch order, are `out_cache_loc` (where
//! attention writes the new K/V before it attends). A query at position `p` attends causally to
//! positions `0..=p`.
//!
//! The metadata is built once per batch on the host; a backend turns it into its own plan with
//! [`Backend::plan`](crate::Backend::plan) and reuses that plan for every layer.

use std::fmt;
use std::ops::Range;

use kv_pool::{Page, Slot};

use crate::error::{AttentionError, Result};

/// One request of a batch, as the scheduler hands it over: the slots of all its KV positions
/// (`req_to_token[row, 0..kv_len]`) and how many of them are new in this batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestKv<'a> {
    /// Slots of positions `0..kv_len` (cached prefix, then the new tokens).
    pub slots: &'a [Slot],
    /// New tokens in this batch (`1..=kv_len`): the last `extend_len` positions. A decode step
    /// has `extend_len == 1`.
    pub extend_len: usize,
}

/// The page-table description of one batch (module docs). Immutable once built; every field
/// has been validated against the page rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchMetadata {
    page_size: u32,
    qo_indptr: Vec<usize>,
    kv_lens: Vec<usize>,
    kv_indptr: Vec<usize>,
    kv_indices: Vec<Page>,
    last_page_len: Vec<u32>,
    out_cache_loc: Vec<Slot>,
    max_slot: Option<Slot>,
    decode: bool,
}

impl BatchMetadata {
    /// Builds the metadata from per-request slot lists, checking `1 ≤ extend_len ≤ kv_len`,
    /// `page_size ≥ 1` and, for every position `p`, that `slot(p) mod P == p mod P` and that
    /// `slot(p)` lies in the same page as `slot(⌊p/P⌋·P)`. The batch is an extend batch
    /// (SGLang's `ForwardMode::EXTEND`), whatever its lengths.
    pub fn new(page_size: u32, requests: &[RequestKv<'_>]) -> Result<Self> {
        Self::build(page_size, requests, false)
    }

    /// Builds a decode batch (SGLang's `ForwardMode::DECODE`): as [`new`](Self::new), and every
    /// request must have `extend_len == 1`. Backends may treat decode batches differently
    /// (DoubleSparse attends sparsely only in decode batches).
    pub fn new_decode(page_size: u32, requests: &[RequestKv<'_>]) -> Result<Self> {
        if let Some(r) = requests.iter().position(|r| r.extend_len != 1) {
            return Err(AttentionError::InvalidRequest {
                request: r,
                reason: format!(
                    "a decode batch needs extend_len 1, got {}",
                    requests[r].extend_len
                ),
            });
        }
        Self::build(page_size, requests, true)
    }

    fn build(page_size: u32, requests: &[RequestKv<'_>], decode: bool) -> Result<Self> {
        if page_size == 0 {
            return Err(AttentionError::InvalidConfig {
                field: "page_size",
                reason: "must be at least 1".into(),
            });
        }
        let p = page_size as usize;
        let n = requests.len();
        let mut meta = BatchMetadata {
            page_size,
            qo_indptr: Vec::with_capacity(n + 1),
            kv_lens: Vec::with_capacity(n),
            kv_indptr: Vec::with_capacity(n + 1),
            kv_indices: Vec::new(),
            last_page_len: Vec::with_capacity(n),
            out_cache_loc: Vec::new(),
            max_slot: None,
            decode,
        };
        meta.qo_indptr.push(0);
        meta.kv_indptr.push(0);
        for (r, req) in requests.iter().enumerate() {
            let kv_len = req.slots.len();
            if req.extend_len == 0 || req.extend_len > kv_len {
                return Err(AttentionError::InvalidRequest {
                    request: r,
                    reason: format!(
                        "extend_len {} must be in 1..=kv_len ({kv_len})",
                        req.extend_len
                    ),
                });
            }
            for (pos, &slot) in req.slots.iter().enumerate() {
                let first = req.slots[pos / p * p];
                let reason = if slot.index() % p != pos % p {
                    Some("slot mod P != position mod P")
                } else if slot.index() / p != first.index() / p {
                    Some("not in the page of the request's page index")
                } else {
                    None
                };
                if let Some(reason) = reason {
                    return Err(AttentionError::PageRule {
                        request: r,
                        position: pos,
                        slot,
                        page_size,
                        reason,
                    });
                }
                meta.max_slot = meta.max_slot.max(Some(slot));
            }
            meta.kv_indices
                .extend(req.slots.iter().step_by(p).map(|s| s.page(page_size)));
            meta.kv_indptr.push(meta.kv_indices.len());
            meta.last_page_len.push(((kv_len - 1) % p + 1) as u32);
            meta.kv_lens.push(kv_len);
            meta.out_cache_loc
                .extend_from_slice(&req.slots[kv_len - req.extend_len..]);
            meta.qo_indptr.push(meta.out_cache_loc.len());
        }
        Ok(meta)
    }

    /// Page size `P` of the batch.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Requests in the batch: the length of [`RequestKv`] list it was built from.
    pub fn num_requests(&self) -> usize {
        self.kv_lens.len()
    }

    /// Query rows (new tokens) in the batch: the first dimension of `q`, `k`, `v` and outputs.
    pub fn num_tokens(&self) -> usize {
        self.out_cache_loc.len()
    }

    /// Whether this is a decode batch (built with [`new_decode`](Self::new_decode)).
    pub fn is_decode(&self) -> bool {
        self.decode
    }

    /// FlashInfer's `qo_indptr` (`n + 1` entries).
    pub fn qo_indptr(&self) -> &[usize] {
        &self.qo_indptr
    }

    /// FlashInfer's `kv_indptr` over pages (`n + 1` entries).
    pub fn kv_indptr(&self) -> &[usize] {
        &self.kv_indptr
    }

    /// FlashInfer's `kv_indices`: every request's pages, concatenated.
    pub fn kv_indices(&self) -> &[Page] {
        &self.kv_indices
    }

    /// FlashInfer's `last_page_len` (`1..=P` per request).
    pub fn last_page_len(&self) -> &[u32] {
        &self.last_page_len
    }

    /// KV positions per request (prefix plus new tokens).
    pub fn kv_lens(&self) -> &[usize] {
        &self.kv_lens
    }

    /// Slots of the new tokens, concatenated in batch order (SGLang's `out_cache_loc`).
    pub fn out_cache_loc(&self) -> &[Slot] {
        &self.out_cache_loc
    }

    /// The largest slot any request uses (`None` for an empty batch), to check against a store.
    pub fn max_slot(&self) -> Option<Slot> {
        self.max_slot
    }

    /// Request `r`'s query rows. Panics if `r ≥ num_requests()`.
    pub fn qo_range(&self, r: usize) -> Range<usize> {
        self.qo_indptr[r]..self.qo_indptr[r + 1]
    }

    /// Request `r`'s KV length. Panics if `r ≥ num_requests()`.
    pub fn kv_len(&self, r: usize) -> usize {
        self.kv_lens[r]
    }

    /// Request `r`'s new tokens. Panics if `r ≥ num_requests()`.
    pub fn extend_len(&self, r: usize) -> usize {
        self.qo_indptr[r + 1] - self.qo_indptr[r]
    }

    /// Request `r`'s cached prefix length (`kv_len − extend_len`). Panics if out of range.
    pub fn prefix_len(&self, r: usize) -> usize {
        self.kv_len(r) - self.extend_len(r)
    }

    /// Request `r`'s pages in position order. Panics if `r ≥ num_requests()`.
    pub fn pages(&self, r: usize) -> &[Page] {
        &self.kv_indices[self.kv_indptr[r]..self.kv_indptr[r + 1]]
    }

    /// The slot of request `r`'s position `pos`. Panics if out of range.
    pub fn slot(&self, r: usize, pos: usize) -> Slot {
        let p = self.page_size as usize;
        let page = self.pages(r)[pos / p];
        Slot((page.index() * p + pos % p) as u32)
    }

    /// The position of every query row (`prefix_len + i` for the `i`-th new token of its
    /// request), as rotary embeddings need them.
    pub fn positions(&self) -> Vec<u32> {
        (0..self.num_requests())
            .flat_map(|r| (self.prefix_len(r)..self.kv_len(r)).map(|p| p as u32))
            .collect()
    }
}

impl fmt::Display for BatchMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "batch: {} requests, {} tokens, page_size {}, {}",
            self.num_requests(),
            self.num_tokens(),
            self.page_size,
            if self.is_decode() { "decode" } else { "extend" }
        )?;
        writeln!(f, "qo_indptr     {:?}", self.qo_indptr)?;
        writeln!(f, "kv_indptr     {:?}", self.kv_indptr)?;
        let pages: Vec<u32> = self.kv_indices.iter().map(|p| p.0).collect();
        writeln!(f, "kv_indices    {pages:?}")?;
        writeln!(f, "last_page_len {:?}", self.last_page_len)?;
        let loc: Vec<u32> = self.out_cache_loc.iter().map(|s| s.0).collect();
        writeln!(f, "out_cache_loc {loc:?}")?;
        for r in 0..self.num_requests() {
            let pages: Vec<u32> = self.pages(r).iter().map(|p| p.0).collect();
            writeln!(
                f,
                "  req {r}: prefix {} + extend {} = kv_len {}, queries {:?}, pages {pages:?}",
                self.prefix_len(r),
                self.extend_len(r),
                self.kv_len(r),
                self.qo_range(r),
            )?;
        }
        Ok(())
    }
}
