//! `coalesce`: the blocks built from page runs move the same bytes to the same places as a
//! naive page-by-page copy.

use kv_pool::{KvBuffer, MemoryRegion, Page};
use proptest::prelude::*;
use transfer::coalesce::{blocks, page_runs, CoalesceError, PageRun};
use transfer::{RemoteRegion, TransferBlock};

/// `n` regions with the given item lengths over `pages` pages; addresses are fake (only ids
/// and item lengths matter to `blocks`).
fn regions(item_lens: &[usize], pages: usize) -> Vec<(u32, MemoryRegion)> {
    item_lens
        .iter()
        .enumerate()
        .map(|(i, &item_len)| {
            let r = MemoryRegion {
                layer: i / 2,
                buffer: if i % 2 == 0 {
                    KvBuffer::Key
                } else {
                    KvBuffer::Value
                },
                addr: 0x1000 * (i + 1),
                len_bytes: item_len * pages,
                item_len,
            };
            (i as u32, r)
        })
        .collect()
}

fn remote(src: &[(u32, MemoryRegion)], first_id: u32) -> Vec<(u32, RemoteRegion, u64)> {
    src.iter()
        .enumerate()
        .map(|(i, (_, r))| {
            let rr = RemoteRegion {
                len: r.len_bytes as u64,
                base: 0,
            };
            (first_id + i as u32, rr, r.item_len as u64)
        })
        .collect()
}

/// Applies blocks to per-region byte buffers.
fn apply(blocks: &[TransferBlock], src: &[Vec<u8>], dst: &mut [Vec<u8>], dst_first: u32) {
    for b in blocks {
        let s = &src[b.src_region as usize][b.src_offset as usize..][..b.len as usize];
        let d = &mut dst[(b.dst_region - dst_first) as usize];
        d[b.dst_offset as usize..][..b.len as usize].copy_from_slice(s);
    }
}

fn pages(v: &[u32]) -> Vec<Page> {
    v.iter().map(|&p| Page(p)).collect()
}

#[test]
fn snapshot_of_a_small_case() {
    let src = regions(&[16, 16, 32, 32], 16);
    let dst = remote(&src, 10);
    let runs = page_runs(&pages(&[1, 2, 3, 8, 9]), &pages(&[4, 5, 9, 10, 11])).unwrap();
    let bl = blocks(&runs, &src, &dst).unwrap();
    let mut text = String::new();
    for r in &runs {
        text += &format!("run src {} dst {} len {}\n", r.src.0, r.dst.0, r.len);
    }
    for b in &bl {
        text += &format!(
            "r{}+{} -> r{}+{} ({} B)\n",
            b.src_region, b.src_offset, b.dst_region, b.dst_offset, b.len
        );
    }
    insta::assert_snapshot!(text);
}

#[test]
fn mismatches_are_typed_errors() {
    let src = regions(&[16, 16], 4);
    let mut dst = remote(&src, 0);
    assert_eq!(
        page_runs(&pages(&[1, 2]), &pages(&[1])),
        Err(CoalesceError::PageCountMismatch { src: 2, dst: 1 })
    );
    let run = [PageRun {
        src: Page(1),
        dst: Page(1),
        len: 1,
    }];
    assert_eq!(
        blocks(&run, &src, &dst[..1]),
        Err(CoalesceError::RegionCountMismatch { src: 2, dst: 1 })
    );
    dst[1].2 = 8;
    assert_eq!(
        blocks(&run, &src, &dst),
        Err(CoalesceError::ItemLenMismatch {
            index: 1,
            src: 16,
            dst: 8
        })
    );
}

proptest! {
    #[test]
    fn blocks_move_the_same_bytes_as_a_page_by_page_copy(
        item_lens in proptest::collection::vec(1usize..6, 1..5),
        pairs in proptest::collection::vec((1u32..24, 1u32..24), 0..20),
    ) {
        let n_pages = 24;
        // Destination pages must be distinct (a page is written once); sources may repeat.
        let mut seen = std::collections::HashSet::new();
        let pairs: Vec<(u32, u32)> = pairs.into_iter().filter(|&(_, d)| seen.insert(d)).collect();
        let src_pages: Vec<Page> = pairs.iter().map(|&(s, _)| Page(s)).collect();
        let dst_pages: Vec<Page> = pairs.iter().map(|&(_, d)| Page(d)).collect();
        let src = regions(&item_lens, n_pages);
        let dst = remote(&src, 3);
        let src_bytes: Vec<Vec<u8>> = src
            .iter()
            .map(|(i, r)| (0..r.len_bytes).map(|b| (b as u8).wrapping_mul(7) ^ (*i as u8 * 50)).collect())
            .collect();
        let mut got: Vec<Vec<u8>> = src.iter().map(|(_, r)| vec![0; r.len_bytes]).collect();
        let mut want = got.clone();
        let runs = page_runs(&src_pages, &dst_pages).unwrap();
        prop_assert_eq!(runs.iter().map(|r| r.len as usize).sum::<usize>(), pairs.len());
        apply(&blocks(&runs, &src, &dst).unwrap(), &src_bytes, &mut got, 3);
        for (s, d) in &pairs {
            for (k, (_, r)) in src.iter().enumerate() {
                let il = r.item_len;
                want[k][*d as usize * il..][..il]
                    .copy_from_slice(&src_bytes[k][*s as usize * il..][..il]);
            }
        }
        prop_assert_eq!(got, want);
        // Maximal: no two consecutive runs could be merged.
        for w in runs.windows(2) {
            prop_assert!(w[0].src.0 + w[0].len != w[1].src.0 || w[0].dst.0 + w[0].len != w[1].dst.0);
        }
    }
}
