//! How attention work is cut into jobs for the pool: long extend requests into pieces of
//! consecutive query tokens, the (pieces of) requests into ranges of about equal work, and a
//! decode batch of fewer requests than threads into one job per request and KV head.
//!
//! A piece `a .. b` of request `r`'s new tokens is the request whose prefix is `r`'s first
//! `prefix_len(r) + a` positions and whose new tokens are `a .. b`: its queries see exactly
//! the positions they see in `r`, in the same fixed blocks, so their results are bitwise the
//! same (this is chunked prefill, which the batch invariance already covers). The pieces of
//! a request are consecutive rows of the batch and write the same `out_cache_loc`, so the
//! split metadata lays out `q` and the output exactly as the original.

use kv_pool::Slot;

use crate::error::Result;
use crate::metadata::{BatchMetadata, RequestKv};

/// New tokens of a piece are a multiple of this (the SIMD kernel's token chunk).
const PIECE_ALIGN: usize = 16;

/// Attention work of request `r`: query-key pairs, plus one per request.
pub(crate) fn work(meta: &BatchMetadata, r: usize) -> usize {
    let (p0, ext) = (meta.prefix_len(r), meta.extend_len(r));
    // Query t sees p0 + t + 1 positions.
    ext * p0 + ext * (ext + 1) / 2 + 1
}

/// `meta` with its long extend requests cut into pieces of about `1 / (2 · threads)` of the
/// batch's work each, or `None` when nothing is worth cutting (one thread, a decode batch,
/// or no request long enough).
pub(crate) fn token_pieces(meta: &BatchMetadata, threads: usize) -> Result<Option<BatchMetadata>> {
    let n = meta.num_requests();
    if threads < 2 || meta.is_decode() {
        return Ok(None);
    }
    let total: usize = (0..n).map(|r| work(meta, r)).sum();
    let target = total.div_ceil(2 * threads);
    // Each request's cut points in its new tokens.
    let mut cuts: Vec<Vec<usize>> = Vec::with_capacity(n);
    for r in 0..n {
        let (p0, ext) = (meta.prefix_len(r), meta.extend_len(r));
        let mut c = vec![0];
        let mut acc = 0;
        for t in 0..ext {
            acc += p0 + t + 1;
            let len = t + 1 - c[c.len() - 1];
            if acc >= target && len % PIECE_ALIGN == 0 && ext - (t + 1) >= PIECE_ALIGN {
                c.push(t + 1);
                acc = 0;
            }
        }
        c.push(ext);
        cuts.push(c);
    }
    if cuts.iter().all(|c| c.len() == 2) {
        return Ok(None);
    }
    let slots: Vec<Vec<Slot>> = (0..n)
        .map(|r| (0..meta.kv_len(r)).map(|p| meta.slot(r, p)).collect())
        .collect();
    let mut pieces = Vec::new();
    for r in 0..n {
        let p0 = meta.prefix_len(r);
        for w in cuts[r].windows(2) {
            pieces.push(RequestKv {
                slots: &slots[r][..p0 + w[1]],
                extend_len: w[1] - w[0],
            });
        }
    }
    BatchMetadata::new(meta.page_size(), &pieces).map(Some)
}

/// Bounds `0 = b_0 < … = n` of at most `jobs` contiguous ranges of `meta`'s requests, of
/// roughly equal [`work`].
pub(crate) fn request_ranges(meta: &BatchMetadata, jobs: usize) -> Vec<usize> {
    let n = meta.num_requests();
    let jobs = jobs.min(n).max(1);
    let total: usize = (0..n).map(|r| work(meta, r)).sum();
    let mut bounds = vec![0];
    let mut acc = 0;
    for r in 0..n {
        acc += work(meta, r);
        if acc * jobs >= total * bounds.len() && bounds.len() < jobs {
            bounds.push(r + 1);
        }
    }
    if bounds[bounds.len() - 1] != n {
        bounds.push(n);
    }
    bounds.dedup();
    bounds
}

/// Whether a decode batch of fewer requests than `threads` is cut by KV head instead (one job
/// per request and KV head of `kv_heads`): at batch size 1 the attention would otherwise run on
/// one thread while the others wait.
pub(crate) fn decode_by_heads(meta: &BatchMetadata, kv_heads: usize, threads: usize) -> bool {
    meta.is_decode() && kv_heads > 1 && meta.num_requests() < threads
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(reqs: &[(usize, usize)], decode: bool) -> (BatchMetadata, Vec<Vec<Slot>>) {
        // Request i on slots i·4096 + p (page size 16).
        let slots: Vec<Vec<Slot>> = reqs
            .iter()
            .enumerate()
            .map(|(i, &(p0, ext))| {
                (0..(p0 + ext) as u32)
                    .map(|p| Slot(i as u32 * 4096 + p))
                    .collect()
            })
            .collect();
        let kv: Vec<RequestKv<'_>> = reqs
            .iter()
            .zip(&slots)
            .map(|(&(_, ext), s)| RequestKv {
                slots: s,
                extend_len: ext,
            })
            .collect();
        let m = if decode {
            BatchMetadata::new_decode(16, &kv)
        } else {
            BatchMetadata::new(16, &kv)
        };
        (m.unwrap(), slots)
    }

    /// Pieces keep every query's position and visible prefix, the batch's rows and its
    /// `out_cache_loc`; short requests and decode batches are not cut.
    #[test]
    fn pieces_keep_rows_positions_and_slots() {
        let (m, _) = meta(&[(0, 512), (100, 7), (30, 200)], false);
        let split = token_pieces(&m, 2).unwrap().unwrap();
        assert!(split.num_requests() > 3);
        assert_eq!(split.num_tokens(), m.num_tokens());
        assert_eq!(split.out_cache_loc(), m.out_cache_loc());
        assert_eq!(split.positions(), m.positions());
        // Every piece ends where a query of the original request sees its last position.
        let positions = split.positions();
        for r in 0..split.num_requests() {
            let rows = split.qo_range(r);
            // Only the 7-token request is shorter than a piece.
            assert!(
                rows.len() >= PIECE_ALIGN || rows.len() == 7,
                "{r}: {rows:?}"
            );
            assert_eq!(split.kv_len(r), positions[rows.end - 1] as usize + 1);
        }
        assert!(token_pieces(&m, 1).unwrap().is_none());
        let (d, _) = meta(&[(100, 1), (7, 1)], true);
        assert!(token_pieces(&d, 4).unwrap().is_none());
        let (short, _) = meta(&[(0, 20), (5, 3)], false);
        assert!(token_pieces(&short, 2).unwrap().is_none());
    }

    #[test]
    fn only_small_decode_batches_of_several_kv_heads_go_by_heads() {
        let (d, _) = meta(&[(100, 1)], true);
        assert!(decode_by_heads(&d, 3, 2));
        assert!(!decode_by_heads(&d, 1, 2), "one KV head");
        assert!(!decode_by_heads(&d, 3, 1), "one thread");
        let (d2, _) = meta(&[(100, 1), (7, 1)], true);
        assert!(!decode_by_heads(&d2, 3, 2), "a request per thread");
        assert!(decode_by_heads(&d2, 3, 3));
        let (e, _) = meta(&[(100, 5)], false);
        assert!(!decode_by_heads(&e, 3, 2), "an extend batch");
    }

    #[test]
    fn request_ranges_cover_every_request_once() {
        let (m, _) = meta(&[(0, 512), (100, 7), (30, 200), (0, 1), (9, 9)], false);
        for jobs in 1..8 {
            let b = request_ranges(&m, jobs);
            assert_eq!(b[0], 0);
            assert_eq!(b[b.len() - 1], 5);
            assert!(b.windows(2).all(|w| w[0] < w[1]), "{b:?}");
            assert!(b.len() - 1 <= jobs);
        }
    }
}
