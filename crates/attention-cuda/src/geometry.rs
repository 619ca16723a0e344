//! Launch geometry of every kernel: grid and block sizes from the op's shape, with CUDA's grid
//! limits checked so an oversized op is a typed error, never a failed launch.

use attention::{AttentionError, Result};

use crate::device::LaunchConfig;
use crate::plan::SplitPlan;

/// Threads per block of the elementwise and row kernels.
pub const THREADS: u32 = 256;
/// Threads per attention block (`ATTN_THREADS` in `attention.cu`), also the split granularity.
pub const ATTN_THREADS: u32 = 128;
/// Threads per store-row block.
pub const ROW_THREADS: u32 = 128;
/// Threads per DoubleSparse decode block (`DS_THREADS` in `sparse.cu`).
pub const DS_THREADS: u32 = 128;
/// `DS_MAX_DIM` in `sparse.cu`: the widest key or value head `ds_decode` takes.
pub const DS_MAX_DIM: usize = 256;
/// `MATMUL_WARPS` in `dense.cu`: output columns (one warp each) of a `matmul` block.
pub const MATMUL_WARPS: u32 = 4;
/// `MATMUL_BLOCK_ROWS` in `dense.cu`: rows of x a `matmul` block computes.
pub const MATMUL_BLOCK_ROWS: u32 = 64;

/// `MOE_TILE` in `dense.cu`: rows of one expert (and outputs) a `moe_matmul` block computes.
pub const MOE_TILE: u32 = 16;
/// `GEMM_MMA_ROWS` in `dense.cu`: rows a tensor-core GEMM block computes (`matmul_mma`,
/// `moe_matmul_mma`; the tile `moe_align` groups rows in when either of a layer's expert
/// matmuls takes that form).
pub const GEMM_MMA_ROWS: u32 = 64;
/// `GEMM_MMA_N` in `dense.cu`: outputs a tensor-core GEMM block computes.
pub const GEMM_MMA_N: u32 = 64;
/// `GEMM_MMA_WARPS` in `dense.cu`: warps of a tensor-core GEMM block.
pub const GEMM_MMA_WARPS: u32 = 4;
/// `MOE_MAX_EXPERTS` in `dense.cu`: the most experts `moe_align` groups rows for.
pub const MOE_MAX_EXPERTS: usize = 512;

/// CUDA's largest grid along x.
const MAX_GRID_X: u64 = (1 << 31) - 1;
/// CUDA's largest grid along y and z.
const MAX_GRID_YZ: u64 = 65_535;

fn grid(what: &'static str, x: u64, y: u64) -> Result<[u32; 3]> {
    if x > MAX_GRID_X || y > MAX_GRID_YZ {
        return Err(AttentionError::InvalidConfig {
            field: what,
            reason: format!("a grid of {x} × {y} blocks exceeds CUDA's limits"),
        });
    }
    Ok([x.max(1) as u32, y.max(1) as u32, 1])
}

/// One thread per element, [`THREADS`] per block.
pub fn elementwise(what: &'static str, elems: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(what, (elems as u64).div_ceil(THREADS as u64), 1)?,
        block: THREADS,
    })
}

/// One block of `threads` per row.
pub fn per_row(what: &'static str, rows: usize, threads: u32) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(what, rows as u64, 1)?,
        block: threads,
    })
}

/// `matmul` for `[m, k] · [n, k]ᵀ`: a warp per output column, [`MATMUL_WARPS`] to a block
/// (x over `n`), and blocks of [`MATMUL_BLOCK_ROWS`] rows (y over `m`).
pub fn matmul(m: usize, n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(
            "matmul",
            (n as u64).div_ceil(MATMUL_WARPS as u64),
            (m as u64).div_ceil(MATMUL_BLOCK_ROWS as u64),
        )?,
        block: MATMUL_WARPS * 32,
    })
}

/// `bmm`: [`matmul`]'s blocks for each of `heads` along grid.z.
pub fn bmm(m: usize, n: usize, heads: usize) -> Result<LaunchConfig> {
    let mut cfg = matmul(m, n)?;
    if heads as u64 > MAX_GRID_YZ {
        return Err(AttentionError::InvalidConfig {
            field: "bmm",
            reason: format!("{heads} heads exceed CUDA's grid limits"),
        });
    }
    cfg.grid[2] = heads.max(1) as u32;
    Ok(cfg)
}

/// Tiles `moe_align` may fill for `rows` (token, rank) rows over `experts` experts: each
/// expert's rows in tiles of `tile_rows` ([`MOE_TILE`] or [`GEMM_MMA_ROWS`]), so at most
/// `⌈rows / tile_rows⌉ + experts` of them, and at most `rows` (a tile holds a row): the grid of
/// the expert matmuls, fixed by the batch's size alone so a graph can replay it (a decode
/// token's 6 rows over 64 experts: 6 tiles).
pub fn moe_tiles(rows: usize, experts: usize, tile_rows: u32) -> usize {
    (rows.div_ceil(tile_rows as usize) + experts).min(rows)
}

/// `moe_matmul` over `tiles` tiles of `n` outputs: a block per tile and [`MATMUL_WARPS`]
/// outputs (a warp each), x over tiles, y over outputs.
pub fn moe_matmul(tiles: usize, n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(
            "moe_matmul",
            tiles as u64,
            (n as u64).div_ceil(MATMUL_WARPS as u64),
        )?,
        block: MATMUL_WARPS * 32,
    })
}

/// `moe_matmul_mma` over `tiles` tiles (of [`GEMM_MMA_ROWS`] rows) of `n` outputs: a block of
/// [`GEMM_MMA_WARPS`] warps per tile and [`GEMM_MMA_N`] outputs, x over tiles, y over outputs.
pub fn moe_matmul_mma(tiles: usize, n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(
            "moe_matmul_mma",
            tiles as u64,
            (n as u64).div_ceil(GEMM_MMA_N as u64),
        )?,
        block: GEMM_MMA_WARPS * 32,
    })
}

/// `matmul_mma` for `[m, k] · [n, k]ᵀ`: a block of [`GEMM_MMA_WARPS`] warps per
/// [`GEMM_MMA_ROWS`] rows (x) and [`GEMM_MMA_N`] outputs (y).
pub fn matmul_mma(m: usize, n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(
            "matmul_mma",
            (m as u64).div_ceil(GEMM_MMA_ROWS as u64),
            (n as u64).div_ceil(GEMM_MMA_N as u64),
        )?,
        block: GEMM_MMA_WARPS * 32,
    })
}

/// Threads of a `paged_prefill` block (`PF_THREADS` in `attention.cu`: four warps of 16 query
/// rows).
pub const PREFILL_THREADS: u32 = 128;

/// The shortest split of `paged_prefill`'s KV range, in positions: four of its steps of 32
/// (the attention kernels' is one chunk of 128). Untimed: each split costs its rows' partial
/// states (64 rows × the value head dim) written and merged.
pub const PREFILL_MIN_SPLIT: usize = 128;

/// `paged_prefill` over `tiles` query tiles, `head_blocks` packs of query heads
/// ([`attention_head_groups`] of the pack) and `split`'s splits: a block per (tile, pack,
/// split).
pub fn prefill(tiles: usize, head_blocks: usize, split: SplitPlan) -> Result<LaunchConfig> {
    let [x, y, _] = grid("paged_prefill", tiles as u64, head_blocks as u64)?;
    if split.num_splits as u64 > MAX_GRID_YZ {
        return Err(AttentionError::InvalidConfig {
            field: "paged_prefill",
            reason: format!("{} splits exceed CUDA's grid limit", split.num_splits),
        });
    }
    Ok(LaunchConfig {
        grid: [x, y, split.num_splits.max(1)],
        block: PREFILL_THREADS,
    })
}

/// Attention blocks per token: per KV head, its `q_heads / kv_heads` query heads in blocks of
/// up to `heads_per_block` (`attention.cu` derives each block's KV head and heads the same
/// way: a group of 7 over blocks of 4 takes a block of 4 and one of 3).
pub fn attention_head_groups(q_heads: usize, kv_heads: usize, heads_per_block: u32) -> usize {
    let group = q_heads / kv_heads.max(1);
    kv_heads * group.div_ceil(heads_per_block.max(1) as usize)
}

/// `paged_attention`: x over (token, [`attention_head_groups`]), y over splits.
pub fn attention(tokens: usize, head_groups: usize, split: SplitPlan) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid: grid(
            "attention",
            (tokens * head_groups) as u64,
            split.num_splits as u64,
        )?,
        block: ATTN_THREADS,
    })
}

#[cfg(test)]
mod tests {
    use std::fmt::Write;

    use super::*;

    #[test]
    fn geometry_snapshot() {
        let mut text = String::new();
        let split = SplitPlan::new(5, 32, 200, 264, ATTN_THREADS as usize);
        let rows = [
            ("elementwise 1000", elementwise("x", 1000).unwrap()),
            ("elementwise 0", elementwise("x", 0).unwrap()),
            ("per_row 7", per_row("x", 7, THREADS).unwrap()),
            ("matmul 33x96", matmul(33, 96).unwrap()),
            ("matmul 1x17", matmul(1, 17).unwrap()),
            ("matmul_mma 130x4096", matmul_mma(130, 4096).unwrap()),
            ("bmm 1x16x512 (an MLA decode row)", bmm(1, 512, 16).unwrap()),
            ("bmm 70x16x128", bmm(70, 128, 16).unwrap()),
            ("attention 5x32", attention(5, 32, split).unwrap()),
            // MHA, 32 heads: 3 tiles of 64 tokens.
            (
                "prefill 3 tiles x32",
                prefill(3, 32, SplitPlan::new(3, 32, 200, 1, PREFILL_MIN_SPLIT)).unwrap(),
            ),
            // Llama-3-8B (8 KV heads of 4, packed): 20 new tokens after 4000 cached, tiles of
            // 16 and 4 tokens, 8 head blocks, split 32 ways of 128.
            (
                "prefill 2 tiles x8 split",
                prefill(2, 8, SplitPlan::new(2, 8, 4020, 528, PREFILL_MIN_SPLIT)).unwrap(),
            ),
            // DeepSeek-V2-Lite (64 experts): one decode token's 6 rows through gate/up
            // (2 · 1408 outputs), and a 16384-token prefill's 98304 rows through down (2048).
            (
                "moe_matmul 6x2816",
                moe_matmul(moe_tiles(6, 64, MOE_TILE), 2816).unwrap(),
            ),
            (
                "moe_matmul 98304x2048",
                moe_matmul(moe_tiles(98_304, 64, MOE_TILE), 2048).unwrap(),
            ),
            (
                "moe_matmul_mma 98304x2048",
                moe_matmul_mma(moe_tiles(98_304, 64, GEMM_MMA_ROWS), 2048).unwrap(),
            ),
        ];
        for (name, cfg) in rows {
            writeln!(text, "{name:<26} grid {:?} block {}", cfg.grid, cfg.block).unwrap();
        }
        insta::assert_snapshot!(text);
    }

    #[test]
    fn moe_tiles_bound_every_grouping() {
        // Every way 40 rows can fall on 4 experts needs at most moe_tiles(40, 4, tile) tiles.
        for a in 0..=40 {
            for b in 0..=40 - a {
                for c in 0..=40 - a - b {
                    let counts = [a, b, c, 40 - a - b - c];
                    for tile in [MOE_TILE, GEMM_MMA_ROWS, 7] {
                        let used: usize = counts
                            .iter()
                            .map(|&n: &usize| n.div_ceil(tile as usize))
                            .sum();
                        assert!(used <= moe_tiles(40, 4, tile), "{counts:?} in {tile}");
                    }
                }
            }
        }
        assert_eq!(moe_tiles(6, 64, MOE_TILE), 6);
        assert_eq!(moe_tiles(98_304, 64, MOE_TILE), 6208);
        assert_eq!(moe_tiles(98_304, 64, GEMM_MMA_ROWS), 1600);
    }

    #[test]
    fn head_groups_cover_every_query_head_once_per_kv_head() {
        // MHA, GQA with groups of 4, 8 and 7 (blocks of 4), MLA's 16 heads over one latent.
        assert_eq!(attention_head_groups(16, 16, 1), 16);
        assert_eq!(attention_head_groups(32, 8, 4), 8);
        assert_eq!(attention_head_groups(64, 8, 4), 16);
        assert_eq!(attention_head_groups(14, 2, 4), 4);
        assert_eq!(attention_head_groups(16, 1, 4), 4);
    }

    #[test]
    fn oversized_grids_are_typed_errors() {
        let split = SplitPlan {
            num_splits: 70_000,
            split_size: 128,
        };
        assert!(matches!(
            attention(1, 1, split),
            Err(AttentionError::InvalidConfig { .. })
        ));
        assert!(matches!(
            matmul(64 * 70_000, 1),
            Err(AttentionError::InvalidConfig { .. })
        ));
        for (rows, heads) in [(64 * 70_000, 16), (1, 70_000)] {
            assert!(matches!(
                bmm(rows, 128, heads),
                Err(AttentionError::InvalidConfig { .. })
            ));
        }
    }
}
