//! [`ChunkCache`]: no prefix reuse (SGLang's `mem_cache/chunk_cache.py`), used when the radix
//! cache is disabled: matches are empty, a request keeps its own KV across prefill chunks, and
//! a finished request frees everything it holds.

use kv_pool::{Allocator, OwnershipCheck, ReqToTokenPool, Slot};

use crate::error::{RadixCacheError, Result};
use crate::request::ReqView;
use crate::{InsertOptions, InsertResult, KvEvent, MatchResult, NodeId, PrefixCache, PrefixPeek};

/// The single (root) node every request of a chunk cache points at.
const ROOT: NodeId = NodeId {
    index: 0,
    generation: 0,
};

/// A prefix cache that caches nothing (SGLang's `ChunkCache`): a request's KV stays its own
/// from its first prefill chunk to its finish.
#[derive(Debug, Clone)]
pub struct ChunkCache {
    page_size: u32,
}

impl ChunkCache {
    /// A chunk cache for page size `page_size` (0 is taken as 1).
    pub fn new(page_size: u32) -> Self {
        ChunkCache {
            page_size: page_size.max(1),
        }
    }

    fn check_view(&self, req: &ReqView<'_>) -> Result<()> {
        req.check_lengths(self.page_size)?;
        if req.state.last_node != ROOT {
            return Err(RadixCacheError::StaleNode(req.state.last_node));
        }
        Ok(())
    }
}

impl PrefixCache for ChunkCache {
    fn page_size(&self) -> u32 {
        self.page_size
    }

    fn reuses_prefixes(&self) -> bool {
        false
    }

    fn root(&mut self, _extra_key: Option<&str>) -> NodeId {
        ROOT
    }

    fn match_prefix(
        &mut self,
        _key: &[u32],
        _extra_key: Option<&str>,
        _out: &mut Vec<Slot>,
    ) -> MatchResult {
        MatchResult {
            len: 0,
            last_node: ROOT,
            host_hit_len: 0,
            last_host_node: ROOT,
        }
    }

    fn peek_prefix(&self, _key: &[u32], _extra_key: Option<&str>) -> PrefixPeek {
        PrefixPeek::default()
    }

    fn insert(
        &mut self,
        key: &[u32],
        _extra_key: Option<&str>,
        slots: &[Slot],
        _opts: InsertOptions,
    ) -> Result<InsertResult> {
        crate::error::check_insert_lengths(key, slots)?;
        Ok(InsertResult {
            prefix_len: 0,
            inserted: 0,
            last_node: ROOT,
        })
    }

    /// The request keeps its own KV: its prefix slots become its whole committed row.
    fn cache_unfinished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &mut ReqToTokenPool,
        _alloc: &mut dyn Allocator,
        _chunked: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let slots = rows.read(req.row, req.committed_len)?;
        req.state.prefix_slots.clear();
        req.state.prefix_slots.extend_from_slice(slots);
        Ok(())
    }

    /// Frees `[cache_protected_len, committed_len)` of the request's row.
    fn cache_finished_req(
        &mut self,
        req: ReqView<'_>,
        rows: &ReqToTokenPool,
        alloc: &mut dyn Allocator,
        _insert: bool,
    ) -> Result<()> {
        self.check_view(&req)?;
        let slots = rows.read(req.row, req.committed_len)?;
        alloc.free(&slots[req.state.cache_protected_len..])?;
        req.state.cache_protected_len = 0;
        req.state.prefix_slots.clear();
        Ok(())
    }

    fn evict(&mut self, _num_tokens: usize, _alloc: &mut dyn Allocator) -> Result<usize> {
        Ok(0)
    }

    fn inc_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        if node != ROOT {
            return Err(RadixCacheError::StaleNode(node));
        }
        Ok(0)
    }

    fn dec_lock_ref(&mut self, node: NodeId) -> Result<usize> {
        self.inc_lock_ref(node)
    }

    fn evictable_size(&self) -> usize {
        0
    }

    fn protected_size(&self) -> usize {
        0
    }

    fn reset(&mut self, _alloc: &mut dyn Allocator) -> Result<()> {
        Ok(())
    }

    fn take_events(&mut self) -> Vec<KvEvent> {
        Vec::new()
    }

    fn claim_ownership(&self, _check: &mut OwnershipCheck) {}
}
