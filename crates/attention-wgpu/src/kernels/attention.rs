//! Paged attention: one kernel for extend and decode, MHA/GQA/MQA and absorbed MLA, with the
//! KV range of each query split across workgroups, and the merge of the partial softmax
//! states.
//!
//! A workgroup of [`ATTN_WG`] threads handles one query token, one KV head, a block of `HB`
//! of its query heads (the GQA group, or part of it), and one split of the token's causal KV
//! range `0..=pos`. It walks its range in blocks of [`ATTN_WG`] keys: each thread scores one key
//! against the `HB` query heads (each key element is read once for all of them), one thread
//! per head folds the block into the running max and sum (online softmax), and then each
//! thread accumulates its value columns (`c = tid + 64·i`) for all `HB` heads, reading each
//! value element once. With one split
//! the workgroup writes the normalised output; otherwise it writes `(acc, max, sum)` and
//! [`merge`] combines the splits.
//!
//! The plan buffer (built once per batch, see `plan.rs`) gives each token its request and
//! position and each request its pages: position `j` of request `r` is slot
//! `kv_indices[kv_indptr[r] + j / P] · P + j mod P`.

use super::{store_accessor, Access, Kernel, StoreAccess, StoreView, Wgsl};

/// Threads per attention workgroup, and keys per block.
pub const ATTN_WG: u32 = 64;

// The plan buffer (`crate::plan`) starts with a header of four words; word `i` holds the
// offset, in words from the buffer's start, of one array the kernels read.

/// Header word holding where the token → request index array starts.
pub const PLAN_TOK_REQ: usize = 0;
/// Header word holding where the token → position array starts.
pub const PLAN_TOK_POS: usize = 1;
/// Header word holding where FlashInfer's `kv_indptr` (per-request page ranges) starts.
pub const PLAN_KV_INDPTR: usize = 2;
/// Header word holding where `kv_indices` (the batch's pages) starts.
pub const PLAN_KV_INDICES: usize = 3;
/// Words before the first array of the plan buffer (the four offsets above).
pub const PLAN_HEADER: usize = 4;

/// The specialisation of an attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnSpec {
    /// Query/key dims per head (MLA: `kv_lora_rank + rope_dim`).
    pub d: u32,
    /// Value dims per head (MLA: `kv_lora_rank`).
    pub dv: u32,
    /// Heads of `q` and of the output (rows of `q` are `q_heads × d` elements).
    pub q_heads: u32,
    /// Query heads per KV head.
    pub group: u32,
    /// Query heads per workgroup (divides `group`).
    pub heads_per_wg: u32,
    /// `P`: the page table holds one page per `P` positions of a request.
    pub page_size: u32,
    /// The key buffer (MLA: the latent rows; values are their first `dv` dims).
    pub k: StoreView,
    /// The value buffer; `None` for MLA.
    pub v: Option<StoreView>,
    /// Write normalised output directly (one split) instead of partial states.
    pub direct: bool,
}

impl AttnSpec {
    /// Value columns each thread owns (`⌈DV / 64⌉`); it accumulates them for every head of
    /// its block.
    pub fn cols_per_thread(&self) -> u32 {
        self.dv.div_ceil(ATTN_WG)
    }

    /// Output dims each thread accumulates (`HB × cols_per_thread`).
    pub fn acc_per_thread(&self) -> u32 {
        self.heads_per_wg * self.cols_per_thread()
    }
}

/// Heads per workgroup for a group of `group` query heads: the largest divisor of `group` whose
/// query rows fit in 8 KiB of workgroup memory and whose outputs need at most 16 accumulators
/// per thread (at least 1).
pub fn heads_per_wg(group: u32, d: u32, dv: u32) -> u32 {
    (1..=group)
        .rev()
        .find(|&h| group % h == 0 && h * d <= 2048 && h * dv.div_ceil(ATTN_WG) <= 16)
        .unwrap_or(1)
}

/// The attention kernel for `spec`. Bindings: `q`, `plan`, `params` (`[scale bits, splits,
/// split length]`), `out`, the key chunks, the value chunks. Grid `(tokens, kv_heads · group /
/// HB, splits)`.
pub fn attention(spec: AttnSpec) -> Kernel {
    let hb = spec.heads_per_wg;
    let acc = spec.acc_per_thread();
    let what = format!(
        "d {} dv {} q_heads {} group {} heads/wg {} page {} k {:?}x{}{} {} acc/thread {}",
        spec.d,
        spec.dv,
        spec.q_heads,
        spec.group,
        hb,
        spec.page_size,
        spec.k.elem,
        spec.k.chunks,
        match spec.v {
            Some(v) => format!(" v {:?}x{}", v.elem, v.chunks),
            None => " (mla: v in k)".into(),
        },
        if spec.direct { "direct" } else { "split" },
        acc,
    );
    let mut w = Wgsl::new("attention", &what);
    w.buffer("q", "f32", Access::Read);
    w.buffer("plan", "u32", Access::Read);
    w.buffer("params", "u32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    store_accessor(&mut w, "k", spec.k, StoreAccess::Load);
    let (v_fn, v_off) = match spec.v {
        Some(v) => {
            store_accessor(&mut w, "v", v, StoreAccess::Load);
            ("v_load", "kvh * DV")
        }
        None => ("k_load", "0u"),
    };
    w.const_u32("D", spec.d);
    w.const_u32("DV", spec.dv);
    w.const_u32("QH", spec.q_heads);
    w.const_u32("G", spec.group);
    w.const_u32("HB", hb);
    w.const_u32("NHB", spec.group / hb);
    w.const_u32("P", spec.page_size);
    w.const_u32("B", ATTN_WG);
    w.const_u32("ACC", acc);
    w.const_u32("CPT", spec.cols_per_thread());
    w.push(&format!(
        "const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, {qs}>;
var<workgroup> sc: array<f32, {scn}>;
var<workgroup> rows: array<u32, {b}>;
var<workgroup> m_sh: array<f32, {hb}>;
var<workgroup> l_sh: array<f32, {hb}>;
var<workgroup> a_sh: array<f32, {hb}>;
var<workgroup> range_sh: vec2<u32>;

@compute @workgroup_size({b})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {{
    let t = wid.x;
    let kvh = wid.y / NHB;
    let h0 = kvh * G + (wid.y % NHB) * HB;
    let s = wid.z;
    let scale = bitcast<f32>(params[0]);
    let n_splits = params[1];
    let chunk = params[2];
    let r = plan[plan[{tok_req}] + t];
    let pos = plan[plan[{tok_pos}] + t];
    let pages = plan[{kv_indices}] + plan[plan[{kv_indptr}] + r];
    if tid == 0u {{
        let lo = min(s * chunk, pos + 1u);
        range_sh = vec2<u32>(lo, min(lo + chunk, pos + 1u));
    }}
    for (var i = tid; i < HB * D; i += B) {{
        qs[i] = q[(t * QH + h0) * D + i];
    }}
    if tid < HB {{
        m_sh[tid] = NEG;
        l_sh[tid] = 0.0;
    }}
    var acc: array<f32, ACC>;
    let range = workgroupUniformLoad(&range_sh);
    for (var start = range.x; start < range.y; start += B) {{
        let j = start + tid;
        if j < range.y {{
            let row = plan[pages + j / P] * P + j % P;
            rows[tid] = row;
            var dots: array<f32, HB>;
            for (var e = 0u; e < D; e++) {{
                let kx = k_load(row, kvh * D + e);
                for (var h = 0u; h < HB; h++) {{
                    dots[h] += qs[h * D + e] * kx;
                }}
            }}
            for (var h = 0u; h < HB; h++) {{
                sc[h * B + tid] = dots[h] * scale;
            }}
        }} else {{
            for (var h = 0u; h < HB; h++) {{
                sc[h * B + tid] = NEG;
            }}
        }}
        workgroupBarrier();
        if tid < HB {{
            let h = tid;
            var mb = NEG;
            for (var i = 0u; i < B; i++) {{
                mb = max(mb, sc[h * B + i]);
            }}
            let m_old = m_sh[h];
            let m_new = max(m_old, mb);
            var sum = 0.0;
            for (var i = 0u; i < B; i++) {{
                let p = exp(sc[h * B + i] - m_new);
                sc[h * B + i] = p;
                sum += p;
            }}
            let alpha = exp(m_old - m_new);
            l_sh[h] = l_sh[h] * alpha + sum;
            m_sh[h] = m_new;
            a_sh[h] = alpha;
        }}
        workgroupBarrier();
        let nk = min(B, range.y - start);
        for (var cc = 0u; cc < CPT; cc++) {{
            let c = tid + cc * B;
            if c < DV {{
                var vs: array<f32, HB>;
                for (var h = 0u; h < HB; h++) {{
                    vs[h] = acc[h * CPT + cc] * a_sh[h];
                }}
                for (var i = 0u; i < nk; i++) {{
                    let vx = {v_fn}(rows[i], {v_off} + c);
                    for (var h = 0u; h < HB; h++) {{
                        vs[h] += sc[h * B + i] * vx;
                    }}
                }}
                for (var h = 0u; h < HB; h++) {{
                    acc[h * CPT + cc] = vs[h];
                }}
            }}
        }}
        workgroupBarrier();
    }}
{tail}}}
",
        qs = hb * spec.d,
        scn = hb * ATTN_WG,
        b = ATTN_WG,
        hb = hb,
        tok_req = PLAN_TOK_REQ,
        tok_pos = PLAN_TOK_POS,
        kv_indptr = PLAN_KV_INDPTR,
        kv_indices = PLAN_KV_INDICES,
        tail = if spec.direct {
            "    for (var cc = 0u; cc < CPT; cc++) {
        let c = tid + cc * B;
        if c < DV {
            for (var h = 0u; h < HB; h++) {
                out[(t * QH + h0 + h) * DV + c] = acc[h * CPT + cc] / l_sh[h];
            }
        }
    }
"
        } else {
            "    for (var cc = 0u; cc < CPT; cc++) {
        let c = tid + cc * B;
        if c < DV {
            for (var h = 0u; h < HB; h++) {
                out[((t * QH + h0 + h) * n_splits + s) * (DV + 2u) + c] = acc[h * CPT + cc];
            }
        }
    }
    if tid < HB {
        let base = ((t * QH + h0 + tid) * n_splits + s) * (DV + 2u);
        out[base + DV] = m_sh[tid];
        out[base + DV + 1u] = l_sh[tid];
    }
"
        },
    ));
    w.finish()
}

/// Merges split partial states `part[t, h, s] = (acc[DV], max, sum)` into `out[t, h, DV]`:
/// `out = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s`. Params `[splits]`; grid `(tokens,
/// QH)`, 64 threads over `DV`.
pub fn merge(q_heads: u32, dv: u32) -> Kernel {
    let mut w = Wgsl::new("merge", &format!("q_heads {q_heads} dv {dv}"));
    w.buffer("part", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.const_u32("QH", q_heads);
    w.const_u32("DV", dv);
    w.push(
        "@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let th = wid.x * QH + wid.y;
    let n_splits = params[0];
    let base = th * n_splits;
    var m = -3.0e38;
    for (var s = 0u; s < n_splits; s++) {
        m = max(m, part[(base + s) * (DV + 2u) + DV]);
    }
    var l = 0.0;
    for (var s = 0u; s < n_splits; s++) {
        let at = (base + s) * (DV + 2u) + DV;
        l += exp(part[at] - m) * part[at + 1u];
    }
    for (var c = tid; c < DV; c += 64u) {
        var o = 0.0;
        for (var s = 0u; s < n_splits; s++) {
            let at = (base + s) * (DV + 2u);
            o += exp(part[at + DV] - m) * part[at + c];
        }
        out[th * DV + c] = o / l;
    }
}
",
    );
    w.finish()
}
