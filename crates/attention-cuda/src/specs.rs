// The kernel specialisations: which source files exist, which kernels each defines, and every
// combination of #defines a source is compiled with. Plain data with no dependencies: the
// emulation crate's build script includes this file (`include!`) to compile the same list for
// the CPU, so it has no inner doc comments and uses nothing from the crate.

/// A kernel source file under `kernels/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// `dense.cu`: matmul, RMSNorm, rotary, SiLU-and-mul, residual add, embedding,
    /// concatenation, mixture-of-experts routing and experts.
    Dense,
    /// `store.cu`: KV writes at `out_cache_loc` and raw row gathers and scatters.
    Store,
    /// `attention.cu`: paged attention and the split-KV merge.
    Attention,
    /// `sparse.cu`: DoubleSparse label writes and top-k decode attention.
    Sparse,
}

impl Source {
    /// Every source, in a stable order.
    pub const ALL: [Source; 4] = [
        Source::Dense,
        Source::Store,
        Source::Attention,
        Source::Sparse,
    ];

    /// The file name under `kernels/`.
    pub const fn file(self) -> &'static str {
        match self {
            Source::Dense => "dense.cu",
            Source::Store => "store.cu",
            Source::Attention => "attention.cu",
            Source::Sparse => "sparse.cu",
        }
    }

    /// The kernels (`extern "C"` entry points) every specialisation of the source defines
    /// ([`Spec::kernels`] adds those only some define).
    pub const fn kernels(self) -> &'static [&'static str] {
        match self {
            Source::Dense => &[
                "matmul",
                "matmul_f16",
                "matmul_bf16",
                "matmul_mma",
                "bmm",
                "bmm_f16",
                "bmm_bf16",
                "round_bf16",
                "widen_f16",
                "rms_norm",
                "rotary",
                "silu_mul",
                "add_assign",
                "embedding",
                "embedding_f16",
                "embedding_bf16",
                "concat_last",
                "moe_topk",
                "moe_align",
                "moe_matmul",
                "moe_matmul_f16",
                "moe_matmul_bf16",
                "moe_matmul_mma",
                "moe_combine",
            ],
            Source::Store => &["store_kv", "gather_rows", "scatter_rows"],
            Source::Attention => &[
                "paged_attention",
                "paged_attention_pipelined",
                "merge_states",
                "zero_counters",
            ],
            Source::Sparse => &["store_labels", "ds_decode"],
        }
    }
}

/// One specialisation: a source compiled with a list of `#define NAME VALUE`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Spec {
    /// The source file.
    pub source: Source,
    /// The `#define`s put before the source, in order.
    pub defines: Vec<(&'static str, u32)>,
}

/// `KV_DTYPE` values: 0 f32, 1 f16, 2 bf16, 3 fp8 e4m3, 4 fp8 e5m2.
pub const SPEC_KV_DTYPES: [u32; 5] = [0, 1, 2, 3, 4];
/// `HEAD_DIM` values the attention kernel is compiled for (`V_HEAD_DIM` equal to it).
pub const SPEC_HEAD_DIMS: [u32; 4] = [64, 96, 128, 256];
/// `PAGE_FAMILY` values: 0 page size 1, 1 a power of two, 2 any.
pub const SPEC_PAGE_FAMILIES: [u32; 3] = [0, 1, 2];
/// `(kv_lora_rank, qk_rope_head_dim)` of the MLA stores the attention kernel is compiled for
/// (`MLA 1`, `HEAD_DIM` their sum, `V_HEAD_DIM` the rank): DeepSeek-V2/V3's 512 + 64, and
/// 32 + 16 for the conformance suite and the tiny MLA decoder.
pub const SPEC_MLA_DIMS: [(u32, u32); 2] = [(512, 64), (32, 16)];
/// Query heads one MLA attention block serves (`HEADS_PER_BLOCK`): they share the one latent
/// head, whose rows the block reads once for all of them.
pub const MLA_HEADS_PER_BLOCK: u32 = 4;
/// Query heads one block of the tensor-core MLA form of `paged_attention_pipelined` serves
/// (`MMA_HEADS`, defined only in the specialisations that select that form: f16/bf16 stores,
/// and fp8 ones of a rank that is a multiple of 128, on devices with `mma.sync`): the 16 rows
/// of an `mma.m16n8k16`.
pub const MLA_MMA_HEADS: u32 = 16;
/// Query heads one GQA attention block serves (`HEADS_PER_BLOCK`) when several share a KV
/// head: the block reads each key and value row once for up to this many of them (a group of
/// 8 takes two blocks, one of 7 a block of 4 and one of 3). MHA (a group of 1) compiles with 1.
pub const GQA_HEADS_PER_BLOCK: u32 = 4;

impl Spec {
    /// A unique identifier, usable as a C symbol suffix: the source's stem and the defines'
    /// values (`attention_kv1_hd128_vd128_pf1`).
    pub fn name(&self) -> String {
        let mut name = self.source.file().trim_end_matches(".cu").to_string();
        for (key, value) in &self.defines {
            let short: String = key
                .split('_')
                .map(|w| w.chars().next().unwrap_or('x').to_ascii_lowercase())
                .collect();
            name.push_str(&format!("_{short}{value}"));
        }
        name
    }

    /// `HEADS_PER_BLOCK`: the query heads one attention block serves (1 when not defined).
    pub fn heads_per_block(&self) -> u32 {
        self.defines
            .iter()
            .find(|(k, _)| *k == "HEADS_PER_BLOCK")
            .map_or(1, |&(_, v)| v)
    }

    /// The query heads one block of attention kernel `kernel` serves: `MMA_HEADS` for
    /// `paged_attention_pipelined` where it is defined (the tensor-core MLA form), else
    /// [`Spec::heads_per_block`]. The host's grid and the kernel's block mapping both follow it.
    pub fn heads_per_block_of(&self, kernel: &str) -> u32 {
        let mma = self.defines.iter().find(|(k, _)| *k == "MMA_HEADS");
        match mma {
            Some(&(_, heads)) if kernel == "paged_attention_pipelined" => heads,
            _ => self.heads_per_block(),
        }
    }

    /// Whether this specialisation defines `paged_prefill`, the tensor-core prefill kernel:
    /// an attention source over an f16, bf16 or fp8 store (`KV_DTYPE` 1 to 4), not MLA, with
    /// keys and values of one head dim, 64 or 128 (the condition `attention.cu` tests).
    pub fn has_prefill(&self) -> bool {
        let get = |key: &str| self.defines.iter().find(|(k, _)| *k == key).map(|d| d.1);
        self.source == Source::Attention
            && matches!(get("KV_DTYPE"), Some(1..=4))
            && get("MLA").is_none()
            && get("HEAD_DIM") == get("V_HEAD_DIM")
            && matches!(get("HEAD_DIM"), Some(64 | 128))
    }

    /// The kernels (`extern "C"` entry points) this specialisation defines: its source's, and
    /// `paged_prefill` where [`Spec::has_prefill`].
    pub fn kernels(&self) -> Vec<&'static str> {
        let mut names = self.source.kernels().to_vec();
        if self.has_prefill() {
            names.push("paged_prefill");
        }
        names
    }

    /// The `#define` lines that specialise the source.
    pub fn prelude(&self) -> String {
        self.defines
            .iter()
            .map(|(key, value)| format!("#define {key} {value}\n"))
            .collect()
    }
}

/// The attention source specialised for a store dtype (`KV_DTYPE`), key and value head dims, a
/// page-size family, the query heads a block serves (`HEADS_PER_BLOCK`, defined when above 1)
/// and, for absorbed MLA, `MLA 1` (values are the head of the key row; `heads_per_block` is
/// then [`MLA_HEADS_PER_BLOCK`] whatever is passed).
pub fn attention_spec(
    kv: u32,
    head_dim: u32,
    v_head_dim: u32,
    page_family: u32,
    heads_per_block: u32,
    mla: bool,
) -> Spec {
    let mut defines = vec![
        ("KV_DTYPE", kv),
        ("HEAD_DIM", head_dim),
        ("V_HEAD_DIM", v_head_dim),
        ("PAGE_FAMILY", page_family),
    ];
    if mla {
        defines.push(("MLA", 1));
        defines.push(("HEADS_PER_BLOCK", MLA_HEADS_PER_BLOCK));
    } else if heads_per_block > 1 {
        defines.push(("HEADS_PER_BLOCK", heads_per_block));
    }
    Spec {
        source: Source::Attention,
        defines,
    }
}

/// The absorbed-MLA attention source for a store of dtype `kv` whose rows are `rank` latent
/// then `rope` rotary-key elements, a page-size family, and with `tensor_cores`, where
/// [`mla_tensor_core_form`] has it, `MMA_HEADS` [`MLA_MMA_HEADS`]: the pipelined kernel's
/// tensor-core form (NVIDIA GPUs from sm_80, and the emulation).
pub fn attention_mla_spec(
    kv: u32,
    rank: u32,
    rope: u32,
    page_family: u32,
    tensor_cores: bool,
) -> Spec {
    let mut spec = attention_spec(
        kv,
        rank + rope,
        rank,
        page_family,
        MLA_HEADS_PER_BLOCK,
        true,
    );
    if tensor_cores && mla_tensor_core_form(kv, rank) {
        spec.defines.push(("MMA_HEADS", MLA_MMA_HEADS));
    }
    spec
}

/// Whether the tensor-core MLA form exists for `KV_DTYPE` `kv` and latent rank `rank`: f16 and
/// bf16 (1, 2) at every rank, fp8 (3, 4) where each of the block's 4 warps owns whole 32-bit
/// words of value bytes per lane (a rank that is a multiple of 128).
pub fn mla_tensor_core_form(kv: u32, rank: u32) -> bool {
    matches!(kv, 1 | 2) || (matches!(kv, 3 | 4) && rank % 128 == 0)
}

/// Every specialisation of every source: what CI compiles with NVRTC and the emulation
/// compiles for the CPU.
pub fn all_specs() -> Vec<Spec> {
    let mut specs = vec![Spec {
        source: Source::Dense,
        defines: Vec::new(),
    }];
    for source in [Source::Store, Source::Sparse] {
        for kv in SPEC_KV_DTYPES {
            specs.push(Spec {
                source,
                defines: vec![("KV_DTYPE", kv)],
            });
        }
    }
    for kv in SPEC_KV_DTYPES {
        for hd in SPEC_HEAD_DIMS {
            for pf in SPEC_PAGE_FAMILIES {
                for hpb in [1, GQA_HEADS_PER_BLOCK] {
                    specs.push(attention_spec(kv, hd, hd, pf, hpb, false));
                }
            }
        }
    }
    for kv in SPEC_KV_DTYPES {
        for (rank, rope) in SPEC_MLA_DIMS {
            for pf in SPEC_PAGE_FAMILIES {
                specs.push(attention_mla_spec(kv, rank, rope, pf, false));
                if mla_tensor_core_form(kv, rank) {
                    specs.push(attention_mla_spec(kv, rank, rope, pf, true));
                }
            }
        }
    }
    specs
}
