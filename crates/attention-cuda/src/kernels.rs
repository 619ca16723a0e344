//! The kernel sources (`kernels/*.cu`, embedded with `include_str!`) and the specialisation a
//! backend op needs: [`Spec`]s for a store dtype, head dims and page size, and the full text
//! ([`source_text`]) that NVRTC (or hipRTC) compiles.

use kv_pool::KvDtype;

pub use crate::specs::{
    all_specs, Source, Spec, GQA_HEADS_PER_BLOCK, MLA_HEADS_PER_BLOCK, MLA_MMA_HEADS,
    SPEC_HEAD_DIMS, SPEC_MLA_DIMS,
};
use crate::specs::{attention_mla_spec, attention_spec};

/// `kernels/common.cuh`: dtype conversions and block reductions, prepended to every source.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// The body of a source file.
pub fn body(source: Source) -> &'static str {
    match source {
        Source::Dense => include_str!("../kernels/dense.cu"),
        Source::Store => include_str!("../kernels/store.cu"),
        Source::Attention => include_str!("../kernels/attention.cu"),
        Source::Sparse => include_str!("../kernels/sparse.cu"),
    }
}

/// What NVRTC compiles for `spec`: its `#define`s, `common.cuh`, then the source.
pub fn source_text(spec: &Spec) -> String {
    format!("{}{COMMON}\n{}", spec.prelude(), body(spec.source))
}

/// `KV_DTYPE` of a store dtype (every dtype has kernels; `Result` keeps room for one that
/// does not).
pub fn kv_dtype_define(dtype: KvDtype) -> Result<u32, String> {
    match dtype {
        KvDtype::F32 => Ok(0),
        KvDtype::F16 => Ok(1),
        KvDtype::Bf16 => Ok(2),
        KvDtype::Fp8E4m3 => Ok(3),
        KvDtype::Fp8E5m2 => Ok(4),
    }
}

/// `PAGE_FAMILY` of a page size: 0 for 1, 1 for another power of two, 2 otherwise.
pub fn page_family(page_size: u32) -> u32 {
    match page_size {
        1 => 0,
        p if p.is_power_of_two() => 1,
        _ => 2,
    }
}

/// The dense-op source (not specialised).
pub fn dense() -> Spec {
    Spec {
        source: Source::Dense,
        defines: Vec::new(),
    }
}

/// The store kernels for `dtype`.
pub fn store(dtype: KvDtype) -> Result<Spec, String> {
    Ok(Spec {
        source: Source::Store,
        defines: vec![("KV_DTYPE", kv_dtype_define(dtype)?)],
    })
}

/// The DoubleSparse kernels (label writes, top-k decode) for a store of `dtype`.
pub fn sparse(dtype: KvDtype) -> Result<Spec, String> {
    Ok(Spec {
        source: Source::Sparse,
        defines: vec![("KV_DTYPE", kv_dtype_define(dtype)?)],
    })
}

/// The attention kernels for a store of `dtype`, `head_dim`-wide keys and values, pages of
/// `page_size` and `group` query heads per KV head (a block serves up to
/// [`GQA_HEADS_PER_BLOCK`] of a group); `Err(reason)` when no specialisation exists.
pub fn attention(
    dtype: KvDtype,
    head_dim: usize,
    v_head_dim: usize,
    page_size: u32,
    group: usize,
) -> Result<Spec, String> {
    let kv = kv_dtype_define(dtype)?;
    let supported = SPEC_HEAD_DIMS.iter().any(|&d| d as usize == head_dim);
    if !supported || v_head_dim != head_dim {
        return Err(format!(
            "the CUDA attention kernels are compiled for head dims {SPEC_HEAD_DIMS:?} with equal \
             key and value dims, not {head_dim}/{v_head_dim}"
        ));
    }
    let (d, dv) = (head_dim as u32, v_head_dim as u32);
    let heads_per_block = if group > 1 { GQA_HEADS_PER_BLOCK } else { 1 };
    Ok(attention_spec(
        kv,
        d,
        dv,
        page_family(page_size),
        heads_per_block,
        false,
    ))
}

/// The absorbed-MLA attention kernels for a store of `dtype` whose rows are `kv_lora_rank`
/// latent elements then `rope_dim` rotary-key elements, pages of `page_size`, with the
/// pipelined kernel's tensor-core form where `tensor_cores` and the store is f16 or bf16
/// ([`attention_mla_spec`]); `Err(reason)` when no specialisation exists.
pub fn attention_mla(
    dtype: KvDtype,
    kv_lora_rank: usize,
    rope_dim: usize,
    page_size: u32,
    tensor_cores: bool,
) -> Result<Spec, String> {
    let kv = kv_dtype_define(dtype)?;
    let Some(&(rank, rope)) = SPEC_MLA_DIMS
        .iter()
        .find(|&&(r, p)| r as usize == kv_lora_rank && p as usize == rope_dim)
    else {
        return Err(format!(
            "the CUDA MLA attention kernels are compiled for (kv_lora_rank, rope dim) \
             {SPEC_MLA_DIMS:?}, not ({kv_lora_rank}, {rope_dim})"
        ));
    };
    Ok(attention_mla_spec(
        kv,
        rank,
        rope,
        page_family(page_size),
        tensor_cores,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_op_spec_is_in_the_compiled_list() {
        let all = all_specs();
        assert!(all.contains(&dense()));
        for dtype in KvDtype::ALL {
            assert!(all.contains(&store(dtype).unwrap()));
            assert!(all.contains(&sparse(dtype).unwrap()));
            for &d in &SPEC_HEAD_DIMS {
                for p in [1, 2, 16, 64, 3, 48] {
                    for group in [1, 2, 4, 7, 8] {
                        let spec = attention(dtype, d as usize, d as usize, p, group).unwrap();
                        assert!(all.contains(&spec), "{}", spec.name());
                    }
                }
            }
            for (r, rope) in SPEC_MLA_DIMS {
                for p in [1, 16, 48] {
                    for tensor_cores in [false, true] {
                        let spec = attention_mla(dtype, r as usize, rope as usize, p, tensor_cores)
                            .unwrap();
                        assert!(all.contains(&spec), "{}", spec.name());
                        // The tensor-core form for f16/bf16 stores, and fp8 ones at rank 512,
                        // with its own block size for the pipelined kernel only.
                        let mma = tensor_cores
                            && (matches!(dtype, KvDtype::F16 | KvDtype::Bf16)
                                || (dtype.is_fp8() && r == 512));
                        let pipelined = spec.heads_per_block_of("paged_attention_pipelined");
                        assert_eq!(
                            pipelined,
                            if mma {
                                MLA_MMA_HEADS
                            } else {
                                MLA_HEADS_PER_BLOCK
                            }
                        );
                        assert_eq!(
                            spec.heads_per_block_of("paged_attention"),
                            MLA_HEADS_PER_BLOCK
                        );
                    }
                }
            }
        }
        assert!(attention_mla(KvDtype::F16, 512, 32, 1, true).is_err());
        assert!(attention(KvDtype::F16, 72, 72, 1, 1).is_err());
        assert!(attention(KvDtype::F16, 64, 128, 1, 1).is_err());
    }

    /// `attention.cu` reads key and value rows only as whole 16-byte vectors (and refuses to
    /// compile otherwise): every specialisation's rows must be multiples of 16 bytes.
    #[test]
    fn every_attention_row_is_whole_16_byte_vectors() {
        let mut checked = 0;
        for spec in all_specs() {
            let get = |k: &str| spec.defines.iter().find(|d| d.0 == k).map(|d| d.1);
            let (Some(kv), Some(d), Some(dv)) =
                (get("KV_DTYPE"), get("HEAD_DIM"), get("V_HEAD_DIM"))
            else {
                continue;
            };
            let bytes = [4, 2, 2, 1, 1][kv as usize];
            let v_row = if get("MLA") == Some(1) { d } else { dv };
            for elems in [d, dv, v_row] {
                assert_eq!(elems * bytes % 16, 0, "{}: {elems} elements", spec.name());
            }
            checked += 1;
        }
        assert_eq!(checked, 168);
    }

    #[test]
    fn spec_names_are_unique_c_identifiers() {
        let names: Vec<String> = all_specs().iter().map(Spec::name).collect();
        let unique: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        for n in &names {
            assert!(
                n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{n}"
            );
        }
        insta::assert_snapshot!(names.join("\n"));
    }

    #[test]
    fn source_text_puts_defines_before_the_common_header() {
        let spec = attention(KvDtype::Bf16, 128, 128, 16, 1).unwrap();
        let text = source_text(&spec);
        let define = text.find("#define KV_DTYPE 2").unwrap();
        let common = text.find("kvs_f16_to_f32").unwrap();
        let kernel = text.find("paged_attention(").unwrap();
        assert!(define < common && common < kernel);
        assert!(text.contains("#define PAGE_FAMILY 1"));
    }
}
