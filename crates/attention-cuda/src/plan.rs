//! Host-side planning, done once per batch and independent of the device: the packed page
//! table every attention launch reads ([`page_table`]), the write list of the new tokens' slots
//! ([`write_list`]), the split-KV plan ([`SplitPlan`]) and the query tiles of the tensor-core
//! prefill kernel ([`prefill_tiles`]).

use std::fmt;

use attention::{AttentionError, BatchMetadata, Result};
use kv_pool::Slot;

/// Entries of the page table's header (`common.cuh`'s `PLAN_*` offsets).
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

/// `PF_ROWS` in `attention.cu`: query rows of one `paged_prefill` block, (token, query head)
/// pairs: [`PREFILL_ROWS`] / `pack` tokens of `pack` heads ([`prefill_pack`]).
pub const PREFILL_ROWS: usize = 64;

/// The query heads of one KV head that a `paged_prefill` block serves together, for a GQA
/// group of `group` heads: 4 (a power of two dividing [`PREFILL_ROWS`]) or the group where it
/// is smaller, rounded down to a power of two. Their rows share every key and value row the
/// block stages, and a short extend fills more of the block's rows: 16 new tokens make 64 live
/// rows of 4 heads, where one head alone leaves 48 of its 64 rows dead. A group that is no
/// multiple of the pack leaves its last block's rows partly dead (3 in packs of 2: a quarter of
/// the rows; 7 in packs of 4: an eighth).
pub fn prefill_pack(group: usize) -> usize {
    match group {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => 4,
    }
}

/// `paged_prefill`'s tiles: each request's new tokens (consecutive in the batch, at
/// consecutive positions) in runs of up to `tile_tokens` ([`PREFILL_ROWS`] / the pack), as
/// `(first token of the batch, count)` pairs in batch order: a block per tile and group of
/// packed query heads.
pub fn prefill_tiles(meta: &BatchMetadata, tile_tokens: usize) -> Result<Vec<u32>> {
    let tile_tokens = tile_tokens.max(1);
    let mut tiles = Vec::new();
    let mut first = 0;
    for r in 0..meta.num_requests() {
        let n = meta.extend_len(r);
        for start in (0..n).step_by(tile_tokens) {
            tiles.push(to_u32("tokens", first + start)?);
            tiles.push(to_u32("tokens", (n - start).min(tile_tokens))?);
        }
        first += n;
    }
    Ok(tiles)
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
        SplitPlan::filling_waves(tokens, q_heads, max_kv_len, target_blocks, min_split, None)
    }

    /// [`SplitPlan::new`]'s plan, or where the batch is split (it does not fill the target)
    /// and `wave_blocks` (the blocks the device runs at once, [`Device::wave_blocks`]) is
    /// known, the split count between half and twice the target's that best fills the grid's
    /// last wave: a memory-bound grid of 3.2 waves leaves most of the device idle for its
    /// fourth (on an H100, f16 decode over 16384 positions × 32 requests read 84 % of the
    /// memory bandwidth in 5 splits, 3.2 waves, and 88.6 % in 6, 3.9 waves). Among equal fills
    /// the count nearest the target's wins.
    ///
    /// [`Device::wave_blocks`]: crate::device::Device::wave_blocks
    pub fn filling_waves(
        tokens: usize,
        q_heads: usize,
        max_kv_len: usize,
        target_blocks: usize,
        min_split: usize,
        wave_blocks: Option<usize>,
    ) -> SplitPlan {
        let blocks = (tokens * q_heads).max(1);
        let max_kv_len = max_kv_len.max(1);
        let min_split = min_split.max(1);
        let wanted = target_blocks.div_ceil(blocks).max(1);
        let most = max_kv_len.div_ceil(min_split);
        let of = |splits: usize| {
            let split_size = max_kv_len.div_ceil(splits).div_ceil(min_split) * min_split;
            SplitPlan {
                num_splits: max_kv_len.div_ceil(split_size) as u32,
                split_size: split_size as u32,
            }
        };
        let plain = of(wanted.min(most).max(1));
        let wave = match wave_blocks {
            Some(w) if w > 0 && wanted >= 2 && most >= 2 => w,
            _ => return plain,
        };
        // The last wave's fill (1 when the grid is whole waves), less a little per doubling
        // away from the target's count.
        let score = |p: &SplitPlan| {
            let waves = (blocks * p.num_splits as usize) as f64 / wave as f64;
            let away = (p.num_splits as f64 / wanted as f64).log2().abs();
            waves / waves.ceil() - 0.01 * away
        };
        // Candidates: per count of waves m that the range reaches, the most splits whose grid
        // stays within m waves (the fullest last wave of that count), a few per plan.
        let (lo, hi) = (wanted.div_ceil(2), (2 * wanted).min(most));
        ((blocks * lo).div_ceil(wave)..=blocks * hi / wave)
            .map(|m| m * wave / blocks)
            .filter(|s| (lo..=hi).contains(s))
            .map(of)
            .fold(
                plain,
                |best, p| if score(&p) > score(&best) { p } else { best },
            )
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
    fn prefill_tiles_cover_each_requests_new_tokens_in_runs_of_the_tile() {
        // Extends of 130 (two full tiles and 2), 1 and 64 tokens, with prefixes of 3, 0 and 10.
        let a: Vec<Slot> = (0..133).map(Slot).collect();
        let b = slots(&[200]);
        let c: Vec<Slot> = (300..374).map(Slot).collect();
        let meta = BatchMetadata::new(
            1,
            &[
                RequestKv {
                    slots: &a,
                    extend_len: 130,
                },
                RequestKv {
                    slots: &b,
                    extend_len: 1,
                },
                RequestKv {
                    slots: &c,
                    extend_len: 64,
                },
            ],
        )
        .unwrap();
        assert_eq!(
            prefill_tiles(&meta, PREFILL_ROWS).unwrap(),
            vec![0, 64, 64, 64, 128, 2, 130, 1, 131, 64]
        );
        assert_eq!(
            prefill_tiles(&meta, PREFILL_ROWS / 4).unwrap()[..8],
            [0, 16, 16, 16, 32, 16, 48, 16]
        );
        // Every token in exactly one tile, tiles never crossing a request, for every pack.
        let t = page_table(&meta).unwrap();
        let tok_req = &t[t[0] as usize..t[1] as usize];
        for group in 1..=8 {
            let tile_tokens = PREFILL_ROWS / prefill_pack(group);
            let tiles = prefill_tiles(&meta, tile_tokens).unwrap();
            let mut seen = vec![0; meta.num_tokens()];
            for pair in tiles.chunks(2) {
                let (first, count) = (pair[0] as usize, pair[1] as usize);
                assert!(count <= tile_tokens);
                for tok in first..first + count {
                    seen[tok] += 1;
                    assert_eq!(tok_req[tok], tok_req[first]);
                }
            }
            assert!(seen.iter().all(|&n| n == 1));
        }
    }

    #[test]
    fn prefill_packs_divide_the_rows_and_never_exceed_the_group() {
        for group in 1..=64 {
            let pack = prefill_pack(group);
            assert!(pack <= group && PREFILL_ROWS % pack == 0 && pack.is_power_of_two());
        }
        assert_eq!([1, 2, 3, 4, 7, 8].map(prefill_pack), [1, 2, 2, 4, 4, 4]);
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

        #[test]
        fn wave_filling_plans_cover_every_position_and_fill_no_worse(
            tokens in 1usize..300,
            heads in 1usize..64,
            kv in 1usize..40_000,
            target in 1usize..2000,
            min_split in 1usize..300,
            wave in 1usize..1000,
        ) {
            let plain = SplitPlan::new(tokens, heads, kv, target, min_split);
            let p = SplitPlan::filling_waves(tokens, heads, kv, target, min_split, Some(wave));
            let (n, s) = (p.num_splits as usize, p.split_size as usize);
            prop_assert!(n >= 1 && s % min_split == 0);
            prop_assert!(n * s >= kv && (n - 1) * s < kv);
            let fill = |p: SplitPlan| {
                let w = (tokens * heads * p.num_splits as usize) as f64 / wave as f64;
                w / w.ceil()
            };
            // Never much emptier (the score trades 1 % of fill per doubling off the target).
            prop_assert!(fill(p) >= fill(plain) - 0.05);
            if tokens * heads >= target {
                prop_assert_eq!(p, plain); // no split is added to fill waves
            } else {
                let wanted = target.div_ceil(tokens * heads) as u32;
                prop_assert!(p.num_splits <= 2 * wanted);
            }
            prop_assert_eq!(SplitPlan::filling_waves(tokens, heads, kv, target, min_split, None), plain);
        }
    }

    #[test]
    fn wave_filling_snapshot() {
        // An H100 at 3 blocks of the f16 kernel per SM (396 a wave) and 4 of fp8's (528), the
        // backend's target, Llama-3-8B decode (8 KV head groups a token) at bandwidth_decode's
        // batch sizes.
        let mut text = String::new();
        for (wave, tokens, kv) in [
            (396, 512, 1024),
            (396, 128, 4096),
            (396, 32, 16384),
            (396, 16, 32768),
            (528, 64, 16384),
            (528, 32, 32768),
            (396, 1, 100_000),
        ] {
            let plain = SplitPlan::new(tokens, 8, kv, 1056, 128);
            let p = SplitPlan::filling_waves(tokens, 8, kv, 1056, 128, Some(wave));
            let waves = |p: SplitPlan| (tokens * 8 * p.num_splits as usize) as f64 / wave as f64;
            writeln!(
                text,
                "wave {wave} tokens {tokens:>3} kv {kv:>6}: {plain} ({:.2} waves) -> {p} ({:.2} waves)",
                waves(plain),
                waves(p)
            )
            .unwrap();
        }
        insta::assert_snapshot!(text);
    }
}
