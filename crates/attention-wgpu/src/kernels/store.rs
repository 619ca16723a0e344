//! Kernels that move KV rows between a store buffer and compact buffers: converting writes
//! from f32 (new K/V, host `write_kv`), and raw bit-exact gathers and scatters (reads, raw
//! writes, slot copies, pages).
//!
//! Index lists come in one `idx: array<u32>` binding: `[n, slot_0 .. slot_{n-1}, row_0 ..
//! row_{n-1}]` (the rows only for the writes: which row of the compact source goes to each
//! slot). Slots are distinct within a list (the host keeps the last occurrence of a repeated
//! slot), so no two threads write one element.

use super::{
    store_accessor, Access, Kernel, StoreAccess, StoreElem, StoreView, Wgsl, LINEAR_INDEX, MAIN_1D,
};

fn view_desc(v: StoreView) -> String {
    format!(
        "{:?} rows of {} elements, {} chunk(s) of {} rows",
        v.elem, v.row_elems, v.chunks, v.rows_per_chunk
    )
}

/// `dst[slot_p][e] = elem(src[row_p · ROW + e])` for every listed pair: f32 rows converted to
/// the store's element type. One thread per element.
pub fn write_rows(view: StoreView) -> Kernel {
    let mut w = Wgsl::new("write_rows", &view_desc(view));
    store_accessor(&mut w, "dst", view, StoreAccess::Store);
    w.buffer("src", "f32", Access::Read);
    w.buffer("idx", "u32", Access::Read);
    w.const_u32("ROW", view.row_elems);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    let n = idx[0];
    if i >= n * ROW {{ return; }}
    let p = i / ROW;
    let e = i - p * ROW;
    dst_store(idx[1u + p], e, src[idx[1u + n + p] * ROW + e]);
}}
"
    ));
    w.finish()
}

/// Compact raw rows: `out` (u32 words) gets the bits of the listed slots' rows back to back,
/// `n · ROW` elements packed as the store packs them. One thread per output word.
pub fn gather_raw(view: StoreView) -> Kernel {
    let mut w = Wgsl::new("gather_raw", &view_desc(view));
    store_accessor(&mut w, "src", view, StoreAccess::GetBits);
    w.buffer("out", "u32", Access::ReadWrite);
    w.buffer("idx", "u32", Access::Read);
    w.const_u32("ROW", view.row_elems);
    w.push(MAIN_1D);
    let body = match view.elem {
        StoreElem::F32 => format!(
            "    let i = {LINEAR_INDEX};
    let n = idx[0];
    if i >= n * ROW {{ return; }}
    let p = i / ROW;
    out[i] = src_get(idx[1u + p], i - p * ROW);
}}
"
        ),
        StoreElem::F16 => format!(
            "    let i = {LINEAR_INDEX};
    let n = idx[0];
    let total = n * ROW;
    let g = 2u * i;
    if g >= total {{ return; }}
    let p0 = g / ROW;
    var word = src_get(idx[1u + p0], g - p0 * ROW);
    if g + 1u < total {{
        let p1 = (g + 1u) / ROW;
        word = word | (src_get(idx[1u + p1], g + 1u - p1 * ROW) << 16u);
    }}
    out[i] = word;
}}
"
        ),
    };
    w.push(&body);
    w.finish()
}

/// Raw rows into the store: the bits of row `row_p` of the compact `src` words go to slot
/// `slot_p`. One thread per element.
pub fn scatter_raw(view: StoreView) -> Kernel {
    let mut w = Wgsl::new("scatter_raw", &view_desc(view));
    store_accessor(&mut w, "dst", view, StoreAccess::SetBits);
    w.buffer("src", "u32", Access::Read);
    w.buffer("idx", "u32", Access::Read);
    w.const_u32("ROW", view.row_elems);
    let get = match view.elem {
        StoreElem::F32 => "fn src_bits(g: u32) -> u32 { return src[g]; }\n\n",
        StoreElem::F16 => {
            "fn src_bits(g: u32) -> u32 { return (src[g >> 1u] >> ((g & 1u) * 16u)) & 0xffffu; }\n\n"
        }
    };
    w.push(get);
    w.push(MAIN_1D);
    w.push(&format!(
        "    let i = {LINEAR_INDEX};
    let n = idx[0];
    if i >= n * ROW {{ return; }}
    let p = i / ROW;
    let e = i - p * ROW;
    dst_set(idx[1u + p], e, src_bits(idx[1u + n + p] * ROW + e));
}}
"
    ));
    w.finish()
}
