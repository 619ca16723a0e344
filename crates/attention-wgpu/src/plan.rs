//! The per-batch plan: the batch metadata flattened into one device buffer of `u32` that every
//! layer's attention kernel reads, plus the list of slots the batch writes.

use std::fmt;

use attention::{BatchMetadata, Result};
use kv_pool::Slot;

use crate::dispatch::Runner;
use crate::kernels::attention::{
    PLAN_HEADER, PLAN_KV_INDICES, PLAN_KV_INDPTR, PLAN_TOK_POS, PLAN_TOK_REQ,
};

/// The wgpu backend's plan for one batch (built by [`Backend::plan`](attention::Backend::plan),
/// reused by every layer).
pub struct WgpuPlan {
    pub(crate) meta: BatchMetadata,
    /// Header (offsets), then per token its request and position, `kv_indptr`, `kv_indices`.
    pub(crate) table: wgpu::Buffer,
    /// Where the batch's new rows go: `[n, slot…, row…]` (see `kernels::store`).
    pub(crate) writes: wgpu::Buffer,
    pub(crate) max_kv_len: usize,
}

impl fmt::Debug for WgpuPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuPlan")
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

impl WgpuPlan {
    /// The batch metadata the plan was built from.
    pub fn metadata(&self) -> &BatchMetadata {
        &self.meta
    }
}

/// `[n, slot…, row…]` for writing row `i` of a compact source to `slots[i]`, keeping only the
/// last occurrence of a repeated slot (the store contract: the last write wins).
pub(crate) fn write_list(slots: &[Slot]) -> Vec<u32> {
    let mut last = std::collections::HashMap::with_capacity(slots.len());
    for (i, s) in slots.iter().enumerate() {
        last.insert(s.0, i as u32);
    }
    let kept: Vec<(u32, u32)> = slots
        .iter()
        .enumerate()
        .filter(|&(i, s)| last[&s.0] == i as u32)
        .map(|(i, s)| (s.0, i as u32))
        .collect();
    let mut out = Vec::with_capacity(1 + 2 * kept.len());
    out.push(kept.len() as u32);
    out.extend(kept.iter().map(|p| p.0));
    out.extend(kept.iter().map(|p| p.1));
    out
}

pub(crate) fn build(runner: &Runner, meta: &BatchMetadata) -> Result<WgpuPlan> {
    let n_req = meta.num_requests();
    let n_tok = meta.num_tokens();
    let mut tok_req = Vec::with_capacity(n_tok);
    let mut tok_pos = Vec::with_capacity(n_tok);
    for r in 0..n_req {
        for pos in meta.prefix_len(r)..meta.kv_len(r) {
            tok_req.push(r as u32);
            tok_pos.push(pos as u32);
        }
    }
    let mut table = vec![0u32; PLAN_HEADER];
    table[PLAN_TOK_REQ] = table.len() as u32;
    table.extend(&tok_req);
    table[PLAN_TOK_POS] = table.len() as u32;
    table.extend(&tok_pos);
    table[PLAN_KV_INDPTR] = table.len() as u32;
    table.extend(meta.kv_indptr().iter().map(|&x| x as u32));
    table[PLAN_KV_INDICES] = table.len() as u32;
    table.extend(meta.kv_indices().iter().map(|p| p.0));
    Ok(WgpuPlan {
        meta: meta.clone(),
        table: runner.upload_u32("plan", &table)?,
        writes: runner.upload_u32("plan writes", &write_list(meta.out_cache_loc()))?,
        max_kv_len: meta.kv_lens().iter().copied().max().unwrap_or(0),
    })
}
