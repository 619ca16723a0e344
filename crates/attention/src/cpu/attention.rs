//! Paged attention kernels of the CPU backend.
//!
//! One request is one unit of work. Its KV positions are visited in fixed blocks of
//! [`BLOCK`] positions (block `b` is positions `b·BLOCK .. (b+1)·BLOCK`, whatever the page size);
//! each block's K and V rows are decoded from the store into f32 scratch (contiguous runs of
//! slots are decoded in one call), and every query of the request that can see part of the
//! block folds it into its running softmax state (max, sum, weighted values) in position order.
//! A query at position `p` therefore always sees the same blocks, truncated at `p + 1`, in the
//! same order, with the same values read from the store: its result does not depend on the
//! other requests of the batch, on how its prompt was chunked, on whether its prefix came from
//! the cache, or on where its slots are. Threads split the batch by request, which changes
//! nothing in a request's arithmetic.

use kv_pool::dtype::decode_to_f32;
use kv_pool::{KvDtype, Slot};

use crate::backend::DoubleSparseConfig;
use crate::metadata::BatchMetadata;

/// KV positions per block of the fixed reduction order.
pub(crate) const BLOCK: usize = 32;

/// One layer buffer of a host store, read as f32 rows.
#[derive(Clone, Copy)]
pub(crate) struct RowSource<'a> {
    pub bytes: &'a [u8],
    pub dtype: KvDtype,
    pub scale: f32,
    /// Elements per row.
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

/// Head geometry of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geom {
    pub q_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Query / key head dimension.
    pub d: usize,
    /// Value head dimension.
    pub dv: usize,
    /// Elements per K row in the store.
    pub k_row: usize,
    /// Elements per V row in the store (unused when `v_in_k`).
    pub v_row: usize,
    /// MLA: the value is the first `dv` elements of the (single-head) K row.
    pub v_in_k: bool,
}

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
}

fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

/// `a · b + c`, fused when `FMA` (reserved for a SIMD build; the shipped kernel is unfused).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Dot product in a fixed order (eight lanes, then the lanes, then the tail).
#[inline(always)]
pub(crate) fn dot_with<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let ac = a.chunks_exact(8);
    let bc = b.chunks_exact(8);
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] = madd::<FMA>(x[i], y[i], lanes[i]);
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ar.iter().zip(br) {
        s = madd::<FMA>(*x, *y, s);
    }
    s
}

/// [`dot_with`] without fusion.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_with::<false>(a, b)
}

/// `e^x` for `x ≤ 0` (softmax weights), vectorisable: Cody–Waite reduction `x = n·ln2 + r`,
/// `|r| ≤ ln2/2`, a degree-6 Taylor polynomial for `e^r` (relative error below 2e-7), and
/// `2^n` built in the exponent bits. Inputs below −87 give 0 (e^−87 is below f32's normal
/// range), as do −∞.
#[inline(always)]
fn exp_nonpos<const FMA: bool>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let small = x < -87.0;
    let x = if small { -87.0 } else { x };
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = madd::<FMA>(-n, LN2_LO, madd::<FMA>(-n, LN2_HI, x));
    let mut p = 1.0 / 720.0;
    p = madd::<FMA>(p, r, 1.0 / 120.0);
    p = madd::<FMA>(p, r, 1.0 / 24.0);
    p = madd::<FMA>(p, r, 1.0 / 6.0);
    p = madd::<FMA>(p, r, 0.5);
    p = madd::<FMA>(p, r, 1.0);
    p = madd::<FMA>(p, r, 1.0);
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if small {
        0.0
    } else {
        p * scale
    }
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
/// (An AVX2+FMA build of the kernel through `#[target_feature]` was tried and measured no
/// faster in `benches/decode_attention.rs`, so there is no `unsafe` dispatch here; the kernel
/// keeps its `FMA` parameter for when a measured SIMD build lands.)
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
    dense_request_impl::<false>(g, meta, r, src, q, scale, out, sc)
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

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0.0f64;
        let mut x = 0.0f32;
        while x > -100.0 {
            let want = (x as f64).exp();
            for got in [exp_nonpos::<false>(x), exp_nonpos::<true>(x)] {
                if x < -87.0 {
                    assert_eq!(got, 0.0);
                } else {
                    worst = worst.max((got as f64 - want).abs() / want);
                }
            }
            x -= 0.013;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos::<false>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos::<false>(0.0), 1.0);
    }
}
