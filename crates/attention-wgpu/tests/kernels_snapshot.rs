//! The generated WGSL for a few specialisations, as snapshots: a change to a generator shows
//! up as a readable diff. Where an adapter exists, each snapshotted kernel is also compiled on
//! it (f16 ones only when the adapter has f16 shaders).

use attention_wgpu::kernels::attention::{attention, heads_per_wg, merge, AttnSpec};
use attention_wgpu::kernels::dense::{matmul, matmul_rows, rms_norm, rotary};
use attention_wgpu::kernels::store::{gather_raw, scatter_raw, write_rows};
use attention_wgpu::kernels::{Kernel, StoreElem, StoreView};
use attention_wgpu::test_support::backend_or_skip;

/// Compiles `kernel` on the test adapter, if there is one.
fn compiles(kernel: &Kernel) {
    let Some(b) = backend_or_skip("kernels_snapshot compile") else {
        return;
    };
    if kernel.source.contains("enable f16;") && !b.report().f16 {
        println!(
            "SKIP compiling {}: the adapter has no f16 shaders",
            kernel.name
        );
        return;
    }
    b.compile(kernel).unwrap();
}

/// Snapshots `kernel`'s source under `name` and compiles it.
macro_rules! snap {
    ($name:expr, $kernel:expr) => {{
        let k = $kernel;
        insta::assert_snapshot!($name, k.source);
        compiles(&k);
    }};
}

fn view(elem: StoreElem, row_elems: u32, chunks: u32) -> StoreView {
    StoreView {
        elem,
        row_elems,
        rows_per_chunk: 4096,
        chunks,
    }
}

#[test]
fn dense_kernels() {
    snap!("matmul_k64", matmul(64));
    snap!("matmul_rows_k64", matmul_rows(64));
    snap!("rms_norm_d4096", rms_norm(4096));
    snap!("rotary_neox_128", rotary(128, 128, true));
    snap!("rotary_gptj_partial", rotary(64, 16, false));
}

#[test]
fn store_kernels() {
    snap!(
        "write_rows_f16_3chunks",
        write_rows(view(StoreElem::F16, 1024, 3))
    );
    snap!("gather_raw_f16", gather_raw(view(StoreElem::F16, 3, 1)));
    snap!(
        "scatter_raw_f32_2chunks",
        scatter_raw(view(StoreElem::F32, 256, 2))
    );
}

#[test]
fn attention_kernels() {
    // Llama-3-8B-shaped GQA decode over an f16 store split in two chunks, with split-KV.
    let gqa = AttnSpec {
        d: 128,
        dv: 128,
        q_heads: 32,
        group: 4,
        heads_per_wg: heads_per_wg(4, 128, 128),
        page_size: 16,
        k: view(StoreElem::F16, 1024, 2),
        v: Some(view(StoreElem::F16, 1024, 2)),
        direct: false,
    };
    assert_eq!(gqa.heads_per_wg, 4);
    snap!("attention_gqa_f16_split", attention(gqa));
    // DeepSeek-V2-shaped absorbed MLA extend, f32, one split.
    let mla = AttnSpec {
        d: 576,
        dv: 512,
        q_heads: 16,
        group: 16,
        heads_per_wg: heads_per_wg(16, 576, 512),
        page_size: 1,
        k: view(StoreElem::F32, 576, 1),
        v: None,
        direct: true,
    };
    assert_eq!(mla.heads_per_wg, 2);
    snap!("attention_mla_f32_direct", attention(mla));
    snap!("merge_32x128", merge(32, 128));
}
