//! Host-side planning, done once per batch and independent of the device: the packed page
//! table every attention launch reads ([`page_table`]), the write list of the new tokens' slots
//! ([`write_list`]) and the split-KV plan ([`SplitPlan`]).

use std::fmt;

use attention::{AttentionError, BatchMetadata, Result};
use kv_pool::Slot;

/// Entries of the page table's header (`attention.cu`'s `PLAN_*` offsets).
pub const PLAN_HEADER: usize = 4;

fn to_u32(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| AttentionError::InvalidConfig {
        field: what,
        reason: format!("{x} does not fit the kernels' 32-bit indices"),
    })
}

/// The batch's page table as the attention kernel reads it: a header of 4 offsets into the
/// table (`tok_req`, `tok_pos`, `kv_indptr`, `kv_indices`), then per token its request and its
/// position, then FlashInfer's `kv_indptr` and `kv_indices` (pages). A count past `u32` is an
/// [`AttentionError::InvalidConfig`].
pub fn page_table(meta: &BatchMetadata) -> Result<Vec<u32>> {
    let n_tok = meta.num_tokens();
    let mut table = vec![0u32; PLAN_HEADER];
    table.reserve(2 * n_tok + meta.kv_indptr().len() + meta.kv_indices().len());
    table[0] = to_u32("page table", table.len())?;
    for r in 0..meta.num_requests() {
        table.extend(std::iter::repeat_n(
            to_u32("requests", r)?,
            meta.extend_len(r),
        ));
    }
    table[1] = to_u32("page table", table.len())?;
    for r in 0..meta.num_requests() {
        for pos in meta.prefix_len(r)..meta.kv_len(r) {
            table.push(to_u32("kv_len", pos)?);
        }
    }
    table[2] = to_u32("page table", table.len())?;
    for &x in meta.kv_indptr() {
        table.push(to_u32("kv_indptr", x)?);
    }
    table[3] = to_u32("page table", table.len())?;
    table.extend(meta.kv_indices().iter().map(|p| p.0));
    to_u32("page table", table.len())?;
    Ok(table)
}

/// `[count, slot…, row…]`: row `i` of a compact source goes to `slots[i]`, keeping only the
/// last occurrence of a repeated slot (the store contract: the last write wins), so the blocks
/// of one scatter never write the same row.
pub fn write_list(slots: &[Slot]) -> Vec<u32> {
    let mut last = std::collections::HashMap::with_capacity(slots.len());
    for (i, s) in slots.iter().enumerate() {
        last.insert(s.0, i);
    }
    let kept: Vec<(u32, u32)> = slots
        .iter()
        .enumerate()
        .filter(|&(i, s)| last[&s.0] == i)
        .map(|(i, s)| (s.0, i as u32))
        .collect();
    let mut out = Vec::with_capacity(1 + 2 * kept.len());
    out.push(kept.len() as u32);
    out.extend(kept.iter().map(|p| p.0));
    out.extend(kept.iter().map(|p| p.1));
    out
}

/// How the KV range of every query is split across blocks: `num_splits` blocks per (token,
/// head), each over `split_size` consecutive positions (the last splits of short requests are
/// empty and merge with weight zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    /// Blocks per (token, query head).
    pub num_splits: u32,
    /// Positions per split (a multiple of `min_split`, at least one).
    pub split_size: u32,
}

impl SplitPlan {
    /// Splits so that `tokens × q_heads × num_splits` reaches `target_blocks` where the
    /// longest request allows it: no split when the batch already fills the target, and never
    /// a split shorter than `min_split` positions (one block's chunk of keys).
    pub fn new(
        tokens: usize,
        q_heads: usize,
        max_kv_len: usize,
        target_blocks: usize,
        min_split: usize,
    ) -> SplitPlan {
        let blocks = (tokens * q_heads).max(1);
        let max_kv_len = max_kv_len.max(1);
        let min_split = min_split.max(1);
        let wanted = target_blocks.div_ceil(blocks).max(1);
        let most = max_kv_len.div_ceil(min_split);
        let splits = wanted.min(most).max(1);
        let split_size = max_kv_len.div_ceil(splits).div_ceil(min_split) * min_split;
        let num_splits = max_kv_len.div_ceil(split_size);
        SplitPlan {
            num_splits: num_splits as u32,
            split_size: split_size as u32,
        }
    }
}

impl fmt::Display for SplitPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} splits of {}", self.num_splits, self.split_size)
    }
}

#[cfg(test)]
mod tests {
    use std::fmt::Write;

    use attention::RequestKv;
    use proptest::prelude::*;

    use super::*;

    fn slots(v: &[u32]) -> Vec<Slot> {
        v.iter().map(|&s| Slot(s)).collect()
    }

    #[test]
    fn page_table_snapshot() {
        let a = slots(&[16, 17, 18, 19, 48, 49]);
        let b = slots(&[32, 33, 34]);
        let meta = BatchMetadata::new(
            4,
            &[
                RequestKv {
                    slots: &a,
                    extend_len: 2,
                },
                RequestKv {
                    slots: &b,
                    extend_len: 3,
                },
            ],
        )
        .unwrap();
        let t = page_table(&meta).unwrap();
        let mut text = format!("{meta}");
        let h = [t[0] as usize, t[1] as usize, t[2] as usize, t[3] as usize];
        writeln!(text, "header     {:?}", &t[..PLAN_HEADER]).unwrap();
        writeln!(text, "tok_req    {:?}", &t[h[0]..h[1]]).unwrap();
        writeln!(text, "tok_pos    {:?}", &t[h[1]..h[2]]).unwrap();
        writeln!(text, "kv_indptr  {:?}", &t[h[2]..h[3]]).unwrap();
        writeln!(text, "kv_indices {:?}", &t[h[3]..]).unwrap();
        insta::assert_snapshot!(text);
    }

    #[test]
    fn write_list_keeps_the_last_write_of_a_slot() {
        let list = write_list(&slots(&[5, 9, 5, 7, 9]));
        assert_eq!(list, vec![3, 5, 7, 9, 2, 3, 4]);
        assert_eq!(write_list(&[]), vec![0]);
    }

    #[test]
    fn split_plans_snapshot() {
        let mut text = String::new();
        // (tokens, q_heads, max_kv_len): decode batches short and long, an extend batch.
        for (tokens, heads, kv) in [
            (1, 32, 1),
            (1, 32, 128),
            (1, 32, 129),
            (1, 32, 4096),
            (1, 8, 100_000),
            (5, 32, 200),
            (8, 32, 4096),
            (64, 32, 131),
            (512, 32, 4096),
        ] {
            let plan = SplitPlan::new(tokens, heads, kv, 264, 128);
            writeln!(
                text,
                "tokens {tokens:>3} heads {heads:>2} kv {kv:>6}: {plan}"
            )
            .unwrap();
        }
        insta::assert_snapshot!(text);
    }

    proptest! {
        #[test]
        fn splits_cover_every_position_once(
            tokens in 1usize..300,
            heads in 1usize..64,
            kv in 1usize..20_000,
            target in 1usize..2000,
            min_split in 1usize..300,
        ) {
            let p = SplitPlan::new(tokens, heads, kv, target, min_split);
            let (n, s) = (p.num_splits as usize, p.split_size as usize);
            prop_assert!(n >= 1 && s >= 1);
            prop_assert_eq!(s % min_split, 0);
            // The splits cover 0..kv and none is wholly past it.
            prop_assert!(n * s >= kv);
            prop_assert!((n - 1) * s < kv);
            // No split when the batch already has the target's blocks.
            if tokens * heads >= target {
                prop_assert_eq!(n, 1);
            }
        }
    }
}
