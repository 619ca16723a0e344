//! The dense ops of a decoder layer: tiled matmul (and a thread per column for few rows),
//! RMSNorm, rotary, SiLU-and-mul, add, row gather (embedding) and concatenation. All f32.

use super::{Access, Kernel, Wgsl, LINEAR_INDEX, MAIN_1D};

/// Output tile of one matmul workgroup (rows and columns).
pub const MM_TILE: u32 = 32;

/// `out[m, H, n] = x[m, H, K] · w[H, n, K]ᵀ` per head `h < H` (a plain matmul when `H` = 1;
/// `bmm` otherwise) with `K` baked in. Workgroups of 16×16 threads compute 32×32 output tiles
/// of one head, staging 32×16 slices of `x` and `w` in workgroup memory; each thread owns 2×2
/// outputs and accumulates its dot products in `k` order, so every output is one fixed-order
/// dot product whatever `m` (row-invariant, like the CPU kernel). Params `[m, n, H]`; grid
/// `(⌈n/32⌉, ⌈m/32⌉, H)`.
pub fn matmul(k: u32) -> Kernel {
    let mut w = Wgsl::new(
        "matmul",
        &format!("x[m, H, {k}] · w[H, n, {k}]ᵀ, 32×32 tiles"),
    );
    w.buffer("x", "f32", Access::Read);
    w.buffer("wt", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.const_u32("K", k);
    w.push(
        "const BK: u32 = 16u;

var<workgroup> xs: array<f32, 512>;
var<workgroup> ws: array<f32, 512>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let m = params[0];
    let n = params[1];
    let heads = params[2];
    let h = wid.z;
    let row0 = wid.y * 32u;
    let col0 = wid.x * 32u;
    let tid = lid.y * 16u + lid.x;
    var a00 = 0.0;
    var a01 = 0.0;
    var a10 = 0.0;
    var a11 = 0.0;
    for (var k0 = 0u; k0 < K; k0 += BK) {
        for (var t = 0u; t < 2u; t++) {
            let l = tid + t * 256u;
            let r = l / BK;
            let c = l % BK;
            let kk = k0 + c;
            var xv = 0.0;
            if row0 + r < m && kk < K { xv = x[((row0 + r) * heads + h) * K + kk]; }
            xs[l] = xv;
            var wv = 0.0;
            if col0 + r < n && kk < K { wv = wt[(h * n + col0 + r) * K + kk]; }
            ws[l] = wv;
        }
        workgroupBarrier();
        for (var c = 0u; c < BK; c++) {
            let x0 = xs[lid.y * BK + c];
            let x1 = xs[(lid.y + 16u) * BK + c];
            let w0 = ws[lid.x * BK + c];
            let w1 = ws[(lid.x + 16u) * BK + c];
            a00 += x0 * w0;
            a01 += x0 * w1;
            a10 += x1 * w0;
            a11 += x1 * w1;
        }
        workgroupBarrier();
    }
    let r0 = row0 + lid.y;
    let r1 = r0 + 16u;
    let c0 = col0 + lid.x;
    let c1 = c0 + 16u;
    if r0 < m && c0 < n { out[(r0 * heads + h) * n + c0] = a00; }
    if r0 < m && c1 < n { out[(r0 * heads + h) * n + c1] = a01; }
    if r1 < m && c0 < n { out[(r1 * heads + h) * n + c0] = a10; }
    if r1 < m && c1 < n { out[(r1 * heads + h) * n + c1] = a11; }
}
",
    );
    w.finish()
}

/// On a CPU adapter, matmuls of at most this many rows (a decode step's batch) take
/// [`matmul_rows`] instead of [`matmul`] (`WgpuConfig::matmul_rows_max`'s default there).
pub const MM_ROWS_MAX: u32 = 8;

/// `out[m, n] = x[m, K] · w[n, K]ᵀ` for few rows (see [`MM_ROWS_MAX`]): a thread per output
/// column walks its row of `w` once per row of `x` (again from cache after the first) and
/// accumulates each dot product in `k` order with the same expression as [`matmul`], so the
/// outputs are bitwise [`matmul`]'s. No workgroup memory and no barriers: the tiled kernel
/// spends a decode step's work on 31 padding rows per tile, and a software rasteriser
/// (lavapipe, llvmpipe) most of its time on the barriers. Per head as [`matmul`]: params
/// `[m, n, H]`; grid [`super::grid`]`(n)` with `H` along z.
pub fn matmul_rows(k: u32) -> Kernel {
    let mut w = Wgsl::new(
        "matmul_rows",
        &format!("x[m, H, {k}] · w[H, n, {k}]ᵀ, a thread per column"),
    );
    w.buffer("x", "f32", Access::Read);
    w.buffer("wt", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.const_u32("K", k);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let m = params[0];
    let n = params[1];
    let heads = params[2];
    let h = gid.z;
    let col = {LINEAR_INDEX};
    if col >= n {{
        return;
    }}
    let wrow = (h * n + col) * K;
    for (var r = 0u; r < m; r++) {{
        let xrow = (r * heads + h) * K;
        var a = 0.0;
        for (var kk = 0u; kk < K; kk++) {{
            a += x[xrow + kk] * wt[wrow + kk];
        }}
        out[(r * heads + h) * n + col] = a;
    }}
}}
"
    ));
    w.finish()
}

/// RMSNorm over rows of `D` (baked): one workgroup of 256 threads per row reduces the sum of
/// squares in workgroup memory. Params `[rows, eps bits]`; grid `(rows, 1, 1)` folded into `y`.
pub fn rms_norm(d: u32) -> Kernel {
    let mut w = Wgsl::new("rms_norm", &format!("rows of {d}"));
    w.buffer("x", "f32", Access::Read);
    w.buffer("weight", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.const_u32("D", d);
    w.push(
        "var<workgroup> part: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let row = wid.x + wid.y * nwg.x;
    let rows = params[0];
    let eps = bitcast<f32>(params[1]);
    let live = row < rows;
    var s = 0.0;
    if live {
        for (var i = tid; i < D; i += 256u) {
            let v = x[row * D + i];
            s += v * v;
        }
    }
    part[tid] = s;
    workgroupBarrier();
    for (var stride = 128u; stride > 0u; stride >>= 1u) {
        if tid < stride { part[tid] += part[tid + stride]; }
        workgroupBarrier();
    }
    if !live { return; }
    let inv = 1.0 / sqrt(part[0] / f32(D) + eps);
    for (var i = tid; i < D; i += 256u) {
        out[row * D + i] = x[row * D + i] * inv * weight[i];
    }
}
",
    );
    w.finish()
}

/// Rotary embedding in place over `x[n, heads, HEAD_DIM]`, the first `ROT` dims of each head
/// rotated in NeoX (`i` with `i + ROT/2`) or GPT-J (`2i` with `2i + 1`) pairs, with cos/sin
/// from `cs[n, ROT/2, 2]` (computed on the host in f64, as the CPU backend does). Params
/// `[n, heads]`; one thread per pair.
pub fn rotary(head_dim: u32, rotary_dim: u32, neox: bool) -> Kernel {
    let style = if neox { "neox" } else { "gptj" };
    let mut w = Wgsl::new(
        "rotary",
        &format!("head_dim {head_dim}, rotary_dim {rotary_dim}, {style}"),
    );
    w.buffer("x", "f32", Access::ReadWrite);
    w.buffer("cs", "f32", Access::Read);
    w.buffer("params", "u32", Access::Read);
    w.const_u32("HD", head_dim);
    w.const_u32("HALF", rotary_dim / 2);
    let pair = if neox {
        "let a = i;\n    let b = i + HALF;"
    } else {
        "let a = 2u * i;\n    let b = 2u * i + 1u;"
    };
    w.push(MAIN_1D);
    w.push(&format!(
        "    let g = {LINEAR_INDEX};
    let n = params[0];
    let heads = params[1];
    if g >= n * heads * HALF {{ return; }}
    let i = g % HALF;
    let th = g / HALF;
    let t = th / heads;
    {pair}
    let base = th * HD;
    let c = cs[(t * HALF + i) * 2u];
    let s = cs[(t * HALF + i) * 2u + 1u];
    let xa = x[base + a];
    let xb = x[base + b];
    x[base + a] = xa * c - xb * s;
    x[base + b] = xb * c + xa * s;
}}
"
    ));
    w.finish()
}

/// `out[r, c] = silu(x[r, c]) · x[r, d + c]` for `x[m, 2d]`. Params `[m, d]`.
pub fn silu_mul() -> Kernel {
    let mut w = Wgsl::new("silu_mul", "gate then up");
    w.buffer("x", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    let m = params[0];
    let d = params[1];
    if i >= m * d {{ return; }}
    let r = i / d;
    let c = i - r * d;
    let g = x[r * 2u * d + c];
    out[i] = g / (1.0 + exp(-g)) * x[r * 2u * d + d + c];
}}
"
    ));
    w.finish()
}

/// `x[i] += y[i]`. Params `[len]`.
pub fn add_assign() -> Kernel {
    let mut w = Wgsl::new("add_assign", "x += y");
    w.buffer("x", "f32", Access::ReadWrite);
    w.buffer("y", "f32", Access::Read);
    w.buffer("params", "u32", Access::Read);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    if i >= params[0] {{ return; }}
    x[i] = x[i] + y[i];
}}
"
    ));
    w.finish()
}

/// Row gather: `out[t, c] = table[ids[t], c]`. Params `[n, d]`.
pub fn gather_rows() -> Kernel {
    let mut w = Wgsl::new("gather_rows", "embedding / row selection");
    w.buffer("table", "f32", Access::Read);
    w.buffer("ids", "u32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    let n = params[0];
    let d = params[1];
    if i >= n * d {{ return; }}
    let t = i / d;
    out[i] = table[ids[t] * d + (i - t * d)];
}}
"
    ));
    w.finish()
}

/// `out[r] = a[r] ++ b[r]` for `a[rows, da]`, `b[rows, db]`. Params `[rows, da, db]`.
pub fn concat_last() -> Kernel {
    let mut w = Wgsl::new("concat_last", "rows of a then b");
    w.buffer("a", "f32", Access::Read);
    w.buffer("b", "f32", Access::Read);
    w.buffer("out", "f32", Access::ReadWrite);
    w.buffer("params", "u32", Access::Read);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    let rows = params[0];
    let da = params[1];
    let db = params[2];
    let d = da + db;
    if i >= rows * d {{ return; }}
    let r = i / d;
    let c = i - r * d;
    if c < da {{ out[i] = a[r * da + c]; }} else {{ out[i] = b[r * db + c - da]; }}
}}
"
    ));
    w.finish()
}
