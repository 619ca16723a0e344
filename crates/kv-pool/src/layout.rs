//! KV layouts and their byte math: what one token's KV looks like ([`KvShape`]) and how a pool of
//! them is laid out ([`KvLayout`]).
//!
//! Layouts mirror SGLang's pools (`memory_pool.py`):
//! - MHA/GQA (`MHATokenToKVPool`): per layer a K buffer `[size + P, kv_heads, head_dim]` and a V
//!   buffer `[size + P, kv_heads, v_head_dim]`;
//! - MLA (`MLATokenToKVPool`): per layer one buffer `[size + P, 1, kv_lora_rank +
//!   qk_rope_head_dim]`; the "value" is the first `kv_lora_rank` dims of the same row;
//! - DoubleSparse (`DoubleSparseTokenToKVPool`): K and V as MHA plus a label buffer
//!   `[size + P, kv_heads, heavy_channels]`.
//!
//! `cell_size` is exactly SGLang's pool-sizing figure (`kv_cache_configurator.py`), which counts K
//! and V only; [`KvShape::slot_bytes`] is the true per-token footprint including labels.

use std::fmt;
use std::str::FromStr;

use crate::error::{KvPoolError, Result};

/// Element type of a KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    Bf16,
    /// fp8 e4m3 ("fn": finite, max 448), stored as bytes, with per-layer scales.
    Fp8E4m3,
    /// fp8 e5m2 (max 57344), stored as bytes, with per-layer scales.
    Fp8E5m2,
}

impl KvDtype {
    /// Every dtype, in a stable order.
    pub const ALL: [KvDtype; 5] = [
        KvDtype::F32,
        KvDtype::F16,
        KvDtype::Bf16,
        KvDtype::Fp8E4m3,
        KvDtype::Fp8E5m2,
    ];

    /// Bytes per element.
    pub const fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
            KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2 => 1,
        }
    }

    /// Whether this is an fp8 type (stored as bytes, with per-layer K and V scales).
    pub const fn is_fp8(self) -> bool {
        matches!(self, KvDtype::Fp8E4m3 | KvDtype::Fp8E5m2)
    }

    /// The canonical name, as accepted by `--kv-cache-dtype`.
    pub const fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "float32",
            KvDtype::F16 => "float16",
            KvDtype::Bf16 => "bfloat16",
            KvDtype::Fp8E4m3 => "fp8_e4m3",
            KvDtype::Fp8E5m2 => "fp8_e5m2",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = KvPoolError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" | "float" => KvDtype::F32,
            "f16" | "fp16" | "float16" | "half" => KvDtype::F16,
            "bf16" | "bfloat16" => KvDtype::Bf16,
            "fp8_e4m3" | "fp8e4m3" | "e4m3" => KvDtype::Fp8E4m3,
            "fp8_e5m2" | "fp8e5m2" | "e5m2" => KvDtype::Fp8E5m2,
            _ => {
                return Err(KvPoolError::InvalidConfig {
                    field: "kv-cache-dtype",
                    reason: format!(
                        "unknown dtype {s:?}; expected one of float32, float16, bfloat16, fp8_e4m3, fp8_e5m2"
                    ),
                })
            }
        })
    }
}

/// The attention family, which decides the per-layer buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvKind {
    /// Multi-head / grouped-query / multi-query attention: K and V per KV head.
    Mha {
        /// KV heads held by this pool (after tensor-parallel sharding).
        kv_heads: u32,
        /// Key head dimension.
        head_dim: u32,
        /// Value head dimension (may differ from `head_dim`).
        v_head_dim: u32,
    },
    /// Multi-head latent attention: one latent row per token.
    Mla {
        /// Latent (compressed KV) dimension; the "value" is these first dims.
        kv_lora_rank: u32,
        /// Decoupled rotary key dimension stored after the latent.
        qk_rope_head_dim: u32,
    },
    /// Double sparsity: MHA K/V plus a label buffer of heavy channels per KV head.
    DoubleSparse {
        /// KV heads held by this pool.
        kv_heads: u32,
        /// Key head dimension.
        head_dim: u32,
        /// Value head dimension.
        v_head_dim: u32,
        /// Heavy channels kept per head in the label buffer.
        heavy_channels: u32,
    },
}

/// One of the per-layer buffers of a KV store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvBuffer {
    /// Keys (MHA, DoubleSparse) or the latent row (MLA).
    Key,
    /// Values (MHA, DoubleSparse). MLA has none: its value is a view of the latent.
    Value,
    /// DoubleSparse heavy-channel labels.
    Label,
}

impl KvBuffer {
    /// Short name used in renderings and errors.
    pub const fn name(self) -> &'static str {
        match self {
            KvBuffer::Key => "k",
            KvBuffer::Value => "v",
            KvBuffer::Label => "label",
        }
    }
}

/// What one token's KV looks like in one model: attention kind, layer count and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Attention family and head geometry.
    pub kind: KvKind,
    /// Layers held by this pool.
    pub layers: u32,
    /// Store element type.
    pub dtype: KvDtype,
}

impl KvShape {
    /// A multi-head / grouped-query attention shape: per layer, a key row of
    /// `kv_heads × head_dim` and a value row of `kv_heads × v_head_dim` per token. Zero
    /// dimensions are [`KvPoolError::InvalidConfig`].
    pub fn mha(
        kv_heads: u32,
        head_dim: u32,
        v_head_dim: u32,
        layers: u32,
        dtype: KvDtype,
    ) -> Result<Self> {
        Self::new(
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            },
            layers,
            dtype,
        )
    }

    /// A multi-head latent attention shape (DeepSeek): per layer, one row of
    /// `kv_lora_rank + qk_rope_head_dim` per token; the value is the latent's first
    /// `kv_lora_rank` dims.
    pub fn mla(
        kv_lora_rank: u32,
        qk_rope_head_dim: u32,
        layers: u32,
        dtype: KvDtype,
    ) -> Result<Self> {
        Self::new(
            KvKind::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
            },
            layers,
            dtype,
        )
    }

    /// A DoubleSparse shape: the MHA key and value rows plus a label row of
    /// `kv_heads × heavy_channels` per token (the heavy channels used to pick tokens).
    pub fn double_sparse(
        kv_heads: u32,
        head_dim: u32,
        v_head_dim: u32,
        heavy_channels: u32,
        layers: u32,
        dtype: KvDtype,
    ) -> Result<Self> {
        Self::new(
            KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                heavy_channels,
            },
            layers,
            dtype,
        )
    }

    /// Validates and builds a shape: every dimension must be non-zero, and one layer's slot row
    /// must fit comfortably in memory arithmetic.
    pub fn new(kind: KvKind, layers: u32, dtype: KvDtype) -> Result<Self> {
        let dims: &[(&'static str, u32)] = match kind {
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            } => &[
                ("kv_heads", kv_heads),
                ("head_dim", head_dim),
                ("v_head_dim", v_head_dim),
            ],
            KvKind::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
            } => &[
                ("kv_lora_rank", kv_lora_rank),
                ("qk_rope_head_dim", qk_rope_head_dim),
            ],
            KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                heavy_channels,
            } => &[
                ("kv_heads", kv_heads),
                ("head_dim", head_dim),
                ("v_head_dim", v_head_dim),
                ("heavy_channels", heavy_channels),
            ],
        };
        for &(field, v) in dims.iter().chain(&[("layers", layers)]) {
            if v == 0 {
                return Err(KvPoolError::InvalidConfig {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        if let KvKind::DoubleSparse {
            head_dim,
            heavy_channels,
            ..
        } = kind
        {
            if heavy_channels > head_dim {
                return Err(KvPoolError::InvalidConfig {
                    field: "heavy_channels",
                    reason: format!("{heavy_channels} exceeds head_dim {head_dim}"),
                });
            }
        }
        let shape = KvShape {
            kind,
            layers,
            dtype,
        };
        // Every per-token figure is at most a few products of u32s; make sure the largest fits.
        shape
            .checked_slot_bytes()
            .ok_or(KvPoolError::Overflow("bytes per token"))?;
        Ok(shape)
    }

    /// The buffers each layer holds, in canonical order (K, then V, then labels).
    pub fn buffers(&self) -> &'static [KvBuffer] {
        match self.kind {
            KvKind::Mha { .. } => &[KvBuffer::Key, KvBuffer::Value],
            KvKind::Mla { .. } => &[KvBuffer::Key],
            KvKind::DoubleSparse { .. } => &[KvBuffer::Key, KvBuffer::Value, KvBuffer::Label],
        }
    }

    /// Whether the layout has this buffer.
    pub fn has_buffer(&self, buffer: KvBuffer) -> bool {
        self.buffers().contains(&buffer)
    }

    /// Elements in one slot's row of `buffer` (0 if the layout has no such buffer).
    pub fn row_elems(&self, buffer: KvBuffer) -> usize {
        // Saturating, so a hand-built shape that bypassed `new` cannot overflow here; `new`
        // refuses any shape whose figures do not fit.
        let prod = |a: u32, b: u32| (a as usize).saturating_mul(b as usize);
        match (self.kind, buffer) {
            (
                KvKind::Mha {
                    kv_heads, head_dim, ..
                },
                KvBuffer::Key,
            )
            | (
                KvKind::DoubleSparse {
                    kv_heads, head_dim, ..
                },
                KvBuffer::Key,
            ) => prod(kv_heads, head_dim),
            (
                KvKind::Mha {
                    kv_heads,
                    v_head_dim,
                    ..
                },
                KvBuffer::Value,
            )
            | (
                KvKind::DoubleSparse {
                    kv_heads,
                    v_head_dim,
                    ..
                },
                KvBuffer::Value,
            ) => prod(kv_heads, v_head_dim),
            (
                KvKind::DoubleSparse {
                    kv_heads,
                    heavy_channels,
                    ..
                },
                KvBuffer::Label,
            ) => prod(kv_heads, heavy_channels),
            (
                KvKind::Mla {
                    kv_lora_rank,
                    qk_rope_head_dim,
                },
                KvBuffer::Key,
            ) => (kv_lora_rank as usize).saturating_add(qk_rope_head_dim as usize),
            _ => 0,
        }
    }

    /// Bytes in one slot's row of `buffer`.
    pub fn row_bytes(&self, buffer: KvBuffer) -> usize {
        self.row_elems(buffer) * self.dtype.bytes()
    }

    /// Bytes of one token in one layer, over all of that layer's buffers.
    pub fn slot_bytes_per_layer(&self) -> usize {
        self.buffers().iter().map(|&b| self.row_bytes(b)).sum()
    }

    /// Bytes of one token over all layers and buffers (labels included).
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes_per_layer() * self.layers as usize
    }

    fn checked_slot_bytes(&self) -> Option<usize> {
        self.buffers()
            .iter()
            .try_fold(0usize, |acc, &b| {
                acc.checked_add(self.row_elems(b).checked_mul(self.dtype.bytes())?)
            })?
            .checked_mul(self.layers as usize)
    }

    /// SGLang's `cell_size`: bytes per token used to size the pool. MHA and DoubleSparse:
    /// `kv_heads × (head_dim + v_head_dim) × layers × dtype_bytes` (labels are not counted, as in
    /// SGLang); MLA: `(kv_lora_rank + qk_rope_head_dim) × layers × dtype_bytes`.
    pub fn cell_size(&self) -> usize {
        let per_layer_elems = match self.kind {
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            }
            | KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                ..
            } => kv_heads as usize * (head_dim as usize + v_head_dim as usize),
            KvKind::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
            } => kv_lora_rank as usize + qk_rope_head_dim as usize,
        };
        per_layer_elems * self.layers as usize * self.dtype.bytes()
    }
}

impl fmt::Display for KvShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            KvKind::Mha { kv_heads, head_dim, v_head_dim } => write!(
                f,
                "MHA kv_heads={kv_heads} head_dim={head_dim} v_head_dim={v_head_dim}"
            )?,
            KvKind::Mla { kv_lora_rank, qk_rope_head_dim } => {
                write!(f, "MLA kv_lora_rank={kv_lora_rank} qk_rope_head_dim={qk_rope_head_dim}")?
            }
            KvKind::DoubleSparse { kv_heads, head_dim, v_head_dim, heavy_channels } => write!(
                f,
                "DoubleSparse kv_heads={kv_heads} head_dim={head_dim} v_head_dim={v_head_dim} heavy_channels={heavy_channels}"
            )?,
        }
        write!(f, " layers={} dtype={}", self.layers, self.dtype)
    }
}

/// A [`KvShape`] placed in a pool of `size` allocatable slots with page size `page_size`.
///
/// Every per-layer buffer has `size + page_size` rows: page 0 (slots `0..P`) is the padding
/// target, real slots are `P..size + P` for paged pools and `1..=size` for token pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvLayout {
    /// Per-token KV shape.
    pub shape: KvShape,
    /// Page size `P` (1 for a token pool).
    pub page_size: u32,
    /// Allocatable slots (a multiple of `P`).
    pub size: usize,
}

/// Validates a pool of `size` allocatable slots in pages of `page_size` (shared by layouts and
/// allocators): `page_size ≥ 1`, `size` a positive multiple of it, and every slot id including
/// the padding page (`size + page_size` rows) representable as `u32`. Returns the page count.
pub fn checked_pool_pages(size: usize, page_size: u32) -> Result<u32> {
    if page_size == 0 {
        return Err(KvPoolError::InvalidConfig {
            field: "page_size",
            reason: "must be at least 1".into(),
        });
    }
    if size == 0 {
        return Err(KvPoolError::InvalidConfig {
            field: "size",
            reason: "the pool must hold at least one page".into(),
        });
    }
    if size % page_size as usize != 0 {
        return Err(KvPoolError::NotPageAligned { n: size, page_size });
    }
    if size
        .checked_add(page_size as usize)
        .is_none_or(|rows| rows > u32::MAX as usize)
    {
        return Err(KvPoolError::InvalidConfig {
            field: "size",
            reason: format!("{size} slots plus the padding page exceed the u32 slot id range"),
        });
    }
    Ok((size / page_size as usize) as u32)
}

impl KvLayout {
    /// Validates and builds a layout: `page_size ≥ 1`, `size` a positive multiple of it, slot ids
    /// representable as `u32`, and every buffer's byte size representable as `usize`.
    pub fn new(shape: KvShape, page_size: u32, size: usize) -> Result<Self> {
        checked_pool_pages(size, page_size)?;
        let rows = size + page_size as usize;
        rows.checked_mul(shape.slot_bytes_per_layer())
            .and_then(|b| b.checked_mul(shape.layers as usize))
            .ok_or(KvPoolError::Overflow("pool bytes"))?;
        Ok(KvLayout {
            shape,
            page_size,
            size,
        })
    }

    /// Rows in every per-layer buffer (`size + P`, the padding page included).
    pub fn rows(&self) -> usize {
        self.size + self.page_size as usize
    }

    /// Allocatable pages (`size / P`); page ids are `1..=pages`.
    pub fn pages(&self) -> usize {
        self.size / self.page_size as usize
    }

    /// Bytes of one page of one layer of `buffer` (SGLang's registration `item_len`).
    pub fn page_bytes_per_layer(&self, buffer: KvBuffer) -> usize {
        self.shape.row_bytes(buffer) * self.page_size as usize
    }

    /// Bytes of one page over every layer and buffer: the length of one page in the canonical
    /// packed format.
    pub fn page_bytes(&self) -> usize {
        self.shape.slot_bytes() * self.page_size as usize
    }

    /// Bytes of one layer's `buffer` (all rows, padding included).
    pub fn buffer_bytes(&self, buffer: KvBuffer) -> usize {
        self.shape.row_bytes(buffer) * self.rows()
    }

    /// Bytes of one layer over all its buffers.
    pub fn layer_bytes(&self) -> usize {
        self.shape.slot_bytes_per_layer() * self.rows()
    }

    /// Bytes of the whole pool.
    pub fn total_bytes(&self) -> usize {
        self.layer_bytes() * self.shape.layers as usize
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.shape)?;
        writeln!(
            f,
            "page_size={} size={} slots ({} pages, {} rows per buffer with padding)",
            self.page_size,
            self.size,
            self.pages(),
            self.rows()
        )?;
        writeln!(
            f,
            "bytes: cell_size={} slot={} slot/layer={} page={} layer={} total={}",
            self.shape.cell_size(),
            self.shape.slot_bytes(),
            self.shape.slot_bytes_per_layer(),
            self.page_bytes(),
            self.layer_bytes(),
            self.total_bytes()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_model_cell_sizes() {
        // Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 → 128 KiB per token.
        let l8 = KvShape::mha(8, 128, 128, 32, KvDtype::Bf16).unwrap();
        assert_eq!(l8.cell_size(), 128 * 1024);
        assert_eq!(l8.slot_bytes(), 128 * 1024);
        // Llama-3-70B: 80 layers, 8 KV heads of 128, bf16 → 320 KiB per token.
        let l70 = KvShape::mha(8, 128, 128, 80, KvDtype::Bf16).unwrap();
        assert_eq!(l70.cell_size(), 320 * 1024);
        // DeepSeek-V3 MLA: 61 layers × (512 + 64) × 2 bytes.
        let ds = KvShape::mla(512, 64, 61, KvDtype::Bf16).unwrap();
        assert_eq!(ds.cell_size(), 61 * 576 * 2);
        assert_eq!(ds.buffers(), &[KvBuffer::Key]);
    }

    #[test]
    fn double_sparse_counts_labels_only_in_slot_bytes() {
        let s = KvShape::double_sparse(8, 128, 128, 16, 32, KvDtype::F16).unwrap();
        assert_eq!(s.cell_size(), 8 * 256 * 32 * 2);
        assert_eq!(s.slot_bytes(), (8 * 256 + 8 * 16) * 32 * 2);
    }

    #[test]
    fn fp8_is_one_byte_and_different_v_dim() {
        let s = KvShape::mha(4, 192, 128, 2, KvDtype::Fp8E4m3).unwrap();
        assert_eq!(s.row_bytes(KvBuffer::Key), 4 * 192);
        assert_eq!(s.row_bytes(KvBuffer::Value), 4 * 128);
        assert_eq!(s.cell_size(), 4 * 320 * 2);
    }

    #[test]
    fn bad_shapes_and_layouts_are_errors() {
        assert!(matches!(
            KvShape::mha(0, 128, 128, 32, KvDtype::F16),
            Err(KvPoolError::InvalidConfig {
                field: "kv_heads",
                ..
            })
        ));
        assert!(KvShape::mla(512, 64, 0, KvDtype::F16).is_err());
        assert!(KvShape::double_sparse(8, 64, 64, 65, 2, KvDtype::F16).is_err());
        assert!(matches!(
            KvShape::mha(u32::MAX, u32::MAX, u32::MAX, u32::MAX, KvDtype::F32),
            Err(KvPoolError::Overflow(_))
        ));
        let s = KvShape::mha(1, 8, 8, 1, KvDtype::F32).unwrap();
        assert!(KvLayout::new(s, 0, 16).is_err());
        assert!(KvLayout::new(s, 4, 0).is_err());
        assert_eq!(
            KvLayout::new(s, 4, 10),
            Err(KvPoolError::NotPageAligned {
                n: 10,
                page_size: 4
            })
        );
        assert!(KvLayout::new(s, 1, u32::MAX as usize).is_err());
    }

    #[test]
    fn layout_byte_math() {
        let s = KvShape::mha(2, 4, 4, 3, KvDtype::F16).unwrap();
        let l = KvLayout::new(s, 4, 16).unwrap();
        assert_eq!(l.rows(), 20);
        assert_eq!(l.pages(), 4);
        assert_eq!(l.page_bytes_per_layer(KvBuffer::Key), 4 * 8 * 2);
        assert_eq!(l.page_bytes(), 4 * 16 * 2 * 3);
        assert_eq!(l.layer_bytes(), 20 * 32);
        assert_eq!(l.total_bytes(), 20 * 32 * 3);
    }

    #[test]
    fn dtype_names_parse() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert_eq!("bf16".parse::<KvDtype>().unwrap(), KvDtype::Bf16);
        assert!("int4".parse::<KvDtype>().is_err());
    }
}
