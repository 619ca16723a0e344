//! Paged attention kernels of the CPU backend.
//!
//! One request is one unit of work. Its KV positions are visited in fixed blocks of
//! [`BLOCK`] positions (block `b` is positions `b·BLOCK .. (b+1)·BLOCK`, whatever the page size);
//! each block's K and V rows are read from the store (in place by the AVX2 kernel of
//! [`super::simd`] for f32, f16 and bf16; otherwise decoded into f32 scratch, contiguous runs of
//! slots in one call), and every query of the request that can see part of the block folds it
//! into its running softmax state (max, sum, weighted values) in position order.
//! A query at position `p` therefore always sees the same blocks, truncated at `p + 1`, in the
//! same order, with the same values read from the store: its result does not depend on the
//! other requests of the batch, on how its prompt was chunked, on whether its prefix came from
//! the cache, or on where its slots are. Threads split the batch by request, which changes
//! nothing in a request's arithmetic.

use kv_pool::dtype::decode_to_f32;
use kv_pool::{KvDtype, Slot};

use crate::metadata::BatchMetadata;
use crate::params::DoubleSparseConfig;

use super::primitives::{dot, dot_with, exp_nonpos, madd, Geom, BLOCK};

/// One layer buffer of a host store, read as f32 rows.
#[derive(Clone, Copy)]
pub(crate) struct RowSource<'a> {
    /// The layer buffer, row `s` for slot `s`.
    pub bytes: &'a [u8],
    pub dtype: KvDtype,
    /// The fp8 per-layer scale the decoder multiplies by (1 for other dtypes).
    pub scale: f32,
    /// Elements per row (all heads of one token).
    pub elems: usize,
}

impl RowSource<'_> {
    /// Decodes columns `col .. col + cols` of the rows of `slots` into `out` (`cols` per slot,
    /// back to back). Whole rows of consecutive slots are decoded as one run.
    pub(crate) fn load(
        &self,
        slots: impl Iterator<Item = Slot>,
        col: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        let eb = self.dtype.bytes();
        let rb = self.elems * eb;
        if col == 0 && cols == self.elems {
            let mut run: Option<(usize, usize)> = None; // (first slot, length)
            let mut done = 0;
            let mut flush = |run: (usize, usize), done: &mut usize| {
                let (first, len) = run;
                decode_to_f32(
                    self.dtype,
                    &self.bytes[first * rb..(first + len) * rb],
                    self.scale,
                    &mut out[*done * cols..(*done + len) * cols],
                );
                *done += len;
            };
            for s in slots {
                let s = s.index();
                run = match run {
                    Some((first, len)) if first + len == s => Some((first, len + 1)),
                    Some(r) => {
                        flush(r, &mut done);
                        Some((s, 1))
                    }
                    None => Some((s, 1)),
                };
            }
            if let Some(r) = run {
                flush(r, &mut done);
            }
        } else {
            for (i, s) in slots.enumerate() {
                let start = s.index() * rb + col * eb;
                decode_to_f32(
                    self.dtype,
                    &self.bytes[start..start + cols * eb],
                    self.scale,
                    &mut out[i * cols..(i + 1) * cols],
                );
            }
        }
    }
}

/// Extend tokens that go through a block together in the SIMD kernel: enough to share each
/// K/V row load, few enough that their query and output rows stay in L2.
const TOKEN_CHUNK: usize = 16;

/// Per-thread buffers reused across requests.
#[derive(Default)]
pub(crate) struct Scratch {
    kbuf: Vec<f32>,
    vbuf: Vec<f32>,
    scores: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    labels: Vec<f32>,
    order: Vec<u32>,
    slots: Vec<Slot>,
    /// The staged extend kernel's block (K and V rows as f32) and queries.
    staged_k: Vec<f32>,
    staged_v: Vec<f32>,
    staged_q: Vec<f32>,
    /// Tests: the staged kernel on these registers instead of the chosen (`Some`), or the in-place
    /// AVX2 kernel for every block (`Some(None)`), to compare each with the portable one.
    #[cfg(all(test, target_arch = "x86_64"))]
    staged_width: Option<Option<super::simd::extend::Width>>,
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// Folds one block into a query's softmax state: `scores[j]` are the block's scaled scores
/// (overwritten with the weights), `value(j)` its value rows.
#[inline(always)]
fn online<'v, const FMA: bool>(
    m: &mut f32,
    l: &mut f32,
    acc: &mut [f32],
    scores: &mut [f32],
    value: impl Fn(usize) -> &'v [f32],
) {
    let m_b = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let m_new = m.max(m_b);
    if *m != m_new {
        let corr = if *m == f32::NEG_INFINITY {
            0.0
        } else {
            exp_nonpos::<FMA>(*m - m_new)
        };
        *l *= corr;
        acc.iter_mut().for_each(|a| *a *= corr);
        *m = m_new;
    }
    for s in scores.iter_mut() {
        *s = exp_nonpos::<FMA>(*s - m_new);
    }
    let mut sum = 0.0f32;
    for &p in scores.iter() {
        sum += p;
    }
    *l += sum;
    for (j, &p) in scores.iter().enumerate() {
        for (a, &v) in acc.iter_mut().zip(value(j)) {
            *a = madd::<FMA>(p, v, *a);
        }
    }
}

/// Divides every accumulated row by its softmax sum.
fn finish(acc: &mut [f32], l: &[f32], dv: usize) {
    for (row, &l) in acc.chunks_exact_mut(dv).zip(l) {
        let inv = 1.0 / l;
        row.iter_mut().for_each(|a| *a *= inv);
    }
}

/// The store buffers one call reads.
#[derive(Clone, Copy)]
pub(crate) struct Sources<'a> {
    pub k: RowSource<'a>,
    /// `None` for MLA.
    pub v: Option<RowSource<'a>>,
    /// DoubleSparse labels.
    pub labels: Option<RowSource<'a>>,
}

/// Dense causal attention of request `r`: `q` is the request's rows `[ext, q_heads, d]`, `out`
/// its rows `[ext, q_heads, dv]` (overwritten).
///
/// Runs the AVX2 + FMA + F16C kernel ([`super::simd`]) where the CPU has it, else the portable
/// kernel without fused multiply-adds. (The choice is made once per process, so it never
/// depends on the batch.)
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_request(
    g: &Geom,
    meta: &BatchMetadata,
    r: usize,
    src: &Sources<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        return dense_request_simd(g, meta, r, src, q, scale, out, sc);
    }
    dense_request_impl::<false>(g, meta, r, src, q, scale, out, sc)
}

/// The dense kernel through [`super::simd`]: f32, f16 and bf16 rows are read in place from the
/// store; other dtypes are decoded block by block into f32 scratch first. Same visiting order
/// as [`dense_request_impl`], and bitwise the same result as its `FMA = true` instantiation.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_request_simd(
    g: &Geom,
    meta: &BatchMetadata,
    r: usize,
    src: &Sources<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let kv_heads = g.q_heads / g.group;
    dense_heads_simd(g, 0..kv_heads, meta, r, src, q, scale, out, sc);
}

/// [`dense_request_simd`] over the KV heads `heads` only (all of them from there): for a
/// decode request (one query token), `q` and `out` are then the rows of those KV heads' query
/// heads (`heads.len() · group` heads). A query head's result depends only on its own KV
/// head's rows, visited in the same blocks in the same order, so it is bitwise what the whole
/// request gives it: this is how a batch of fewer decode requests than threads is cut over
/// the pool.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_heads_simd(
    full: &Geom,
    heads: std::ops::Range<usize>,
    meta: &BatchMetadata,
    r: usize,
    src: &Sources<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    use super::simd::{self, TokenBlock};
    debug_assert!(heads.len() * full.group == full.q_heads || meta.extend_len(r) == 1);
    // The heads' geometry: their query heads, and K/V rows cut to their columns (all heads:
    // the call's own geometry, MLA's included, whose V is in its single K head).
    let g = &if heads.len() * full.group == full.q_heads {
        *full
    } else {
        Geom {
            q_heads: heads.len() * full.group,
            k_row: heads.len() * full.d,
            v_row: heads.len() * full.dv,
            ..*full
        }
    };
    let (kcol, vcol) = (heads.start * full.d, heads.start * full.dv);
    #[derive(Clone, Copy)]
    enum Path {
        F32,
        F16,
        Bf16,
        Scratch,
    }
    let (kv_len, ext, pos0) = (meta.kv_len(r), meta.extend_len(r), meta.prefix_len(r));
    let nq = ext * g.q_heads;
    out.fill(0.0);
    grow(&mut sc.m, nq).fill(f32::NEG_INFINITY);
    grow(&mut sc.l, nq).fill(0.0);
    let path = match src.k.dtype {
        KvDtype::F32 => Path::F32,
        KvDtype::F16 => Path::F16,
        KvDtype::Bf16 => Path::Bf16,
        _ => Path::Scratch,
    };
    let scratch = matches!(path, Path::Scratch);
    let kbuf = grow(&mut sc.kbuf, if scratch { BLOCK * g.k_row } else { 0 });
    let v_rows = if g.v_in_k || !scratch {
        0
    } else {
        BLOCK * g.v_row
    };
    let vbuf = grow(&mut sc.vbuf, v_rows);
    let kb = src.k.elems * src.k.dtype.bytes();
    let mut kp = [std::ptr::null::<u8>(); BLOCK];
    let mut vp = [std::ptr::null::<u8>(); BLOCK];
    // The next block's rows (in place only), for prefetching.
    let mut nkp = [std::ptr::null::<u8>(); BLOCK];
    let mut nvp = [std::ptr::null::<u8>(); BLOCK];
    let row_ptrs = |start: usize, end: usize, kp: &mut [*const u8], vp: &mut [*const u8]| {
        for (j, p) in (start..end).enumerate() {
            let s = meta.slot(r, p).index();
            let keb = src.k.dtype.bytes();
            kp[j] = src.k.bytes[s * kb + kcol * keb..][..g.k_row * keb].as_ptr();
            vp[j] = match &src.v {
                Some(v) => {
                    let (vb, veb) = (v.elems * v.dtype.bytes(), v.dtype.bytes());
                    v.bytes[s * vb + vcol * veb..][..g.v_row * veb].as_ptr()
                }
                None => kp[j],
            };
        }
    };
    if !scratch {
        row_ptrs(0, kv_len.min(BLOCK), &mut nkp, &mut nvp);
    }
    // The staged extend kernel, for blocks that several query tokens see: the queries are
    // staged once for the request, each such block once for all of them.
    let width = Some(simd::extend::Width::chosen());
    #[cfg(test)]
    let width = sc.staged_width.unwrap_or(width);
    let staging = width.filter(|_| ext >= simd::extend::WIDE_MIN_TOKENS);
    let ((ks_len, vs_len), qt_len) = if let Some(w) = staging {
        (
            simd::extend::block_len(g),
            simd::extend::queries_len(g, ext, w),
        )
    } else {
        ((0, 0), 0)
    };
    let staged_k = grow(&mut sc.staged_k, ks_len);
    let staged_v = grow(&mut sc.staged_v, vs_len);
    let staged_q = grow(&mut sc.staged_q, qt_len);
    if let Some(w) = staging {
        simd::extend::stage_queries(g, q, ext, w, staged_q);
    }
    for start in (0..kv_len).step_by(BLOCK) {
        let end = (start + BLOCK).min(kv_len);
        let n = end - start;
        let next_end = (end + BLOCK).min(kv_len);
        if scratch {
            let slots = (start..end).map(|p| meta.slot(r, p));
            src.k
                .load(slots.clone(), kcol, g.k_row, &mut kbuf[..n * g.k_row]);
            if let Some(v) = &src.v {
                v.load(slots, vcol, g.v_row, &mut vbuf[..n * g.v_row]);
            }
            for j in 0..n {
                kp[j] = kbuf[j * g.k_row..][..g.k_row].as_ptr().cast();
                vp[j] = if g.v_in_k {
                    kp[j]
                } else {
                    vbuf[j * g.v_row..][..g.v_row].as_ptr().cast()
                };
            }
        } else {
            kp = nkp;
            vp = nvp;
            row_ptrs(end, next_end, &mut nkp, &mut nvp);
        }
        let nn = if scratch { 0 } else { next_end - end };
        // Tokens before `full` see part of the block, one position more each; the tokens from
        // `full` on all see the whole block and go through it together, `TOKEN_CHUNK` at a time.
        let t0 = start.saturating_sub(pos0).min(ext);
        let full = (end - 1).saturating_sub(pos0).clamp(t0, ext);
        if let Some(width) = staging.filter(|_| ext - t0 >= simd::extend::WIDE_MIN_TOKENS) {
            let (k, v) = (&kp[..n], &vp[..n]);
            // SAFETY: AVX2, FMA, F16C were checked by the caller; every K pointer
            // starts a whole K row of the path's type, every V pointer a whole V row (or the
            // K row for MLA), as below; the staging buffers have `block_len` elements.
            unsafe {
                match path {
                    Path::F16 => simd::extend::stage_f16(g, k, v, staged_k, staged_v),
                    Path::Bf16 => simd::extend::stage_bf16(g, k, v, staged_k, staged_v),
                    Path::F32 | Path::Scratch => {
                        simd::extend::stage_f32(g, k, v, staged_k, staged_v)
                    }
                }
            }
            let st = simd::extend::Staged {
                k: staged_k,
                v: staged_v,
                qt: staged_q,
                tiles: simd::extend::tiles(g, ext, width),
                width,
            };
            let span = simd::extend::BlockSpan {
                pos0,
                ext,
                t0,
                start,
                end,
            };
            let (m, l) = (&mut sc.m[..nq], &mut sc.l[..nq]);
            // SAFETY: the CPU runs `width` (`chosen`, or AVX2 in tests; AVX2 was checked by the
            // caller); the block and the request's queries are staged for geometry `g` and
            // `width`; m, l and out hold the request's `ext` tokens.
            unsafe { simd::extend::block_staged(&st, g, span, scale, m, l, out) };
            continue;
        }
        let mut t = t0;
        while t < ext {
            let tokens = if t < full {
                t..t + 1
            } else {
                t..(t + TOKEN_CHUNK).min(ext)
            };
            let tb = TokenBlock {
                g,
                k: &kp[..n],
                v: &vp[..n],
                seen: (pos0 + t + 1).min(end) - start,
                scale,
                prefetch: t == t0 && !scratch,
                next_k: &nkp[..nn],
                next_v: &nvp[..nn],
            };
            t = tokens.end;
            let (m, l) = (&mut sc.m[..nq], &mut sc.l[..nq]);
            // SAFETY: `simd::available()` was checked by the caller; every K pointer starts a
            // whole K row (`g.k_row` elements of the path's type: a checked slice of the store
            // or of scratch), every V pointer a whole V row (or the K row for MLA), for the
            // block's `n ≥ seen` positions; q, m, l and acc hold the request's `ext` tokens.
            unsafe {
                match path {
                    Path::F16 => simd::token_block_f16(&tb, tokens, q, m, l, out),
                    Path::Bf16 => simd::token_block_bf16(&tb, tokens, q, m, l, out),
                    Path::F32 | Path::Scratch => simd::token_block_f32(&tb, tokens, q, m, l, out),
                }
            }
        }
    }
    finish(out, &sc.l[..nq], g.dv);
}

/// The dense kernel; `FMA` selects fused multiply-adds (only in the AVX2+FMA build).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dense_request_impl<const FMA: bool>(
    g: &Geom,
    meta: &BatchMetadata,
    r: usize,
    src: &Sources<'_>,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let (kv_len, ext, pos0) = (meta.kv_len(r), meta.extend_len(r), meta.prefix_len(r));
    let nq = ext * g.q_heads;
    out.fill(0.0);
    let m = grow(&mut sc.m, nq);
    m.fill(f32::NEG_INFINITY);
    grow(&mut sc.l, nq).fill(0.0);
    let kbuf = grow(&mut sc.kbuf, BLOCK * g.k_row);
    let vbuf = grow(&mut sc.vbuf, if g.v_in_k { 0 } else { BLOCK * g.v_row });
    let scores = grow(&mut sc.scores, BLOCK);
    for start in (0..kv_len).step_by(BLOCK) {
        let end = (start + BLOCK).min(kv_len);
        let n = end - start;
        let slots = (start..end).map(|p| meta.slot(r, p));
        src.k
            .load(slots.clone(), 0, g.k_row, &mut kbuf[..n * g.k_row]);
        if let Some(v) = &src.v {
            v.load(slots, 0, g.v_row, &mut vbuf[..n * g.v_row]);
        }
        let (kbuf, vbuf) = (&*kbuf, &*vbuf);
        for t in start.saturating_sub(pos0)..ext {
            let seen = (pos0 + t + 1).min(end) - start;
            for h in 0..g.q_heads {
                let gk = h / g.group;
                let i = t * g.q_heads + h;
                let qv = &q[i * g.d..(i + 1) * g.d];
                for (j, s) in scores[..seen].iter_mut().enumerate() {
                    let kr = j * g.k_row + gk * g.d;
                    *s = scale * dot_with::<FMA>(qv, &kbuf[kr..kr + g.d]);
                }
                let value = |j: usize| -> &[f32] {
                    if g.v_in_k {
                        &kbuf[j * g.k_row..j * g.k_row + g.dv]
                    } else {
                        let vr = j * g.v_row + gk * g.dv;
                        &vbuf[vr..vr + g.dv]
                    }
                };
                online::<FMA>(
                    &mut sc.m[i],
                    &mut sc.l[i],
                    &mut out[i * g.dv..(i + 1) * g.dv],
                    &mut scores[..seen],
                    value,
                );
            }
        }
    }
    finish(out, &sc.l[..nq], g.dv);
}

/// DoubleSparse decode of request `r` (one query row): each query head scores every position
/// by its label channels, keeps the `top_k` best (ties: the earlier position), and attends
/// exactly over them in position order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sparse_decode_request(
    g: &Geom,
    meta: &BatchMetadata,
    r: usize,
    src: &Sources<'_>,
    ds: &DoubleSparseConfig,
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    sc: &mut Scratch,
) {
    let kv_len = meta.kv_len(r);
    let labels = src.labels.expect("labels checked by the caller");
    let v = src.v.expect("DoubleSparse has a value buffer");
    let hc = ds.channels.len() / (g.q_heads / g.group);
    let lbuf = grow(&mut sc.labels, kv_len * labels.elems);
    labels.load((0..kv_len).map(|p| meta.slot(r, p)), 0, labels.elems, lbuf);
    let top_k = ds.top_k.min(kv_len);
    let kbuf = grow(&mut sc.kbuf, top_k * g.d);
    let vbuf = grow(&mut sc.vbuf, top_k * g.dv);
    let scores = grow(&mut sc.scores, kv_len.max(BLOCK));
    let mut qlab = vec![0.0f32; hc];
    for h in 0..g.q_heads {
        let gk = h / g.group;
        let qv = &q[h * g.d..(h + 1) * g.d];
        let chans = &ds.channels[gk * hc..(gk + 1) * hc];
        for (ql, &c) in qlab.iter_mut().zip(chans) {
            *ql = qv[c as usize];
        }
        for (j, s) in scores[..kv_len].iter_mut().enumerate() {
            let lr = j * labels.elems + gk * hc;
            *s = dot(&qlab, &lbuf[lr..lr + hc]);
        }
        sc.order.clear();
        sc.order.extend(0..kv_len as u32);
        let by_score = |a: &u32, b: &u32| {
            scores[*b as usize]
                .total_cmp(&scores[*a as usize])
                .then(a.cmp(b))
        };
        if top_k < kv_len {
            sc.order.select_nth_unstable_by(top_k - 1, by_score);
            sc.order.truncate(top_k);
        }
        sc.order.sort_unstable();
        sc.slots.clear();
        sc.slots
            .extend(sc.order.iter().map(|&p| meta.slot(r, p as usize)));
        src.k
            .load(sc.slots.iter().copied(), gk * g.d, g.d, &mut kbuf[..]);
        v.load(sc.slots.iter().copied(), gk * g.dv, g.dv, &mut vbuf[..]);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        let acc = &mut out[h * g.dv..(h + 1) * g.dv];
        acc.fill(0.0);
        for start in (0..top_k).step_by(BLOCK) {
            let end = (start + BLOCK).min(top_k);
            for (j, s) in scores[..end - start].iter_mut().enumerate() {
                let kr = (start + j) * g.d;
                *s = scale * dot(qv, &kbuf[kr..kr + g.d]);
            }
            let vb = &vbuf[start * g.dv..end * g.dv];
            online::<false>(&mut m, &mut l, acc, &mut scores[..end - start], |j| {
                &vb[j * g.dv..(j + 1) * g.dv]
            });
        }
        finish(acc, &[l], g.dv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-place AVX2 kernel, and the staged extend kernel on AVX2's registers and on
    /// AVX-512's where the CPU has it, equal the portable kernel with fused multiply-adds
    /// bitwise, for every dtype path (in place: f32, f16, bf16; through scratch: fp8), GQA
    /// groups that tile as 4, 3, 2 and 1 heads, head dims with and without 8- and 16-element
    /// tails, MLA, and a causal extend over a cached prefix on scattered pages.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_kernel_equals_portable_fma_kernel() {
        use crate::conformance::{nonzero_vec, scattered_slots};
        use crate::metadata::RequestKv;
        use kv_pool::rng::SplitMix64;
        use kv_pool::{HostKvStore, KvBuffer, KvLayout, KvShape, KvStore};

        if !super::super::simd::available() {
            eprintln!("no AVX2 + FMA + F16C: nothing to compare");
            return;
        }
        let dtypes = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Fp8E4m3];
        // (q heads, kv heads, d, dv, mla)
        let shapes = [
            (8, 2, 64, 64, false),
            (7, 1, 40, 24, false),
            (6, 2, 19, 13, false),
            (3, 3, 128, 128, false),
            (10, 2, 16, 8, false),
            (4, 1, 48, 32, true),
        ];
        let mut rng = SplitMix64::new(21);
        for dtype in dtypes {
            for &(qh, kvh, d, dv, mla) in &shapes {
                let shape = if mla {
                    KvShape::mla(dv as u32, (d - dv) as u32, 1, dtype).unwrap()
                } else {
                    KvShape::mha(kvh as u32, d as u32, dv as u32, 1, dtype).unwrap()
                };
                let page = 16;
                let layout = KvLayout::new(shape, page, 1024).unwrap();
                let mut store = HostKvStore::new(layout).unwrap();
                if dtype.is_fp8() {
                    store.set_scales(0, 0.5, 0.25).unwrap();
                }
                // A chunk over a cached prefix, a prompt, a block seen by two tokens, a single
                // token (in place), a prompt of several blocks.
                let reqs = [(70usize, 45usize), (0, 33), (31, 2), (3, 1), (0, 100)];
                let slots = scattered_slots(page, 1024, &reqs, &mut rng).unwrap();
                for (sl, &(pre, ext)) in slots.iter().zip(&reqs) {
                    let all = &sl[..pre + ext];
                    let (kr, vr) = (
                        shape.row_elems(KvBuffer::Key),
                        if mla { 0 } else { kvh * dv },
                    );
                    let k = nonzero_vec(&mut rng, all.len() * kr);
                    let v = nonzero_vec(&mut rng, all.len() * vr);
                    store.write_kv(0, all, &k, &v).unwrap();
                }
                let rk: Vec<RequestKv<'_>> = slots
                    .iter()
                    .zip(&reqs)
                    .map(|(sl, &(pre, ext))| RequestKv {
                        slots: &sl[..pre + ext],
                        extend_len: ext,
                    })
                    .collect();
                let meta = BatchMetadata::new(page, &rk).unwrap();
                let (ks, vs) = store.scales(0).unwrap();
                let src = |b: KvBuffer, scale: f32| RowSource {
                    bytes: store.layer_buffer(0, b).unwrap(),
                    dtype,
                    scale,
                    elems: shape.row_elems(b),
                };
                let sources = Sources {
                    k: src(KvBuffer::Key, ks),
                    v: (!mla).then(|| src(KvBuffer::Value, vs)),
                    labels: None,
                };
                let g = Geom {
                    q_heads: qh,
                    group: qh / kvh,
                    d,
                    dv,
                    k_row: if mla { d } else { kvh * d },
                    v_row: if mla { 0 } else { kvh * dv },
                    v_in_k: mla,
                };
                for r in 0..meta.num_requests() {
                    let ext = meta.extend_len(r);
                    let q = nonzero_vec(&mut rng, ext * qh * d);
                    let mut a = vec![0.0; ext * qh * dv];
                    let mut b = vec![1.0; ext * qh * dv];
                    let mut sc = Scratch::default();
                    dense_request_impl::<true>(&g, &meta, r, &sources, &q, 0.3, &mut b, &mut sc);
                    // The kernels the CPU takes, then the staged extend kernel on AVX2's
                    // registers, then the in-place AVX2 kernel for every block.
                    let avx2 = Some(super::super::simd::extend::Width::Avx2);
                    for staged in [None, Some(avx2), Some(None)] {
                        sc.staged_width = staged;
                        a.fill(1.0);
                        dense_request_simd(&g, &meta, r, &sources, &q, 0.3, &mut a, &mut sc);
                        assert!(
                            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{dtype} {qh}/{kvh} d {d} dv {dv} mla {mla} request {r} \
                             staged {staged:?}"
                        );
                    }
                }
            }
        }
    }
}
