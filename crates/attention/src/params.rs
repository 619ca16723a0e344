//! Per-call parameters of the attention ops of [`Backend`](crate::Backend): the softmax scale
//! and, for DoubleSparse layouts, the label channels and top-k.

/// DoubleSparse decode: which label channels to score with and how many tokens to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoubleSparseConfig {
    /// Tokens kept per query head (`≥ 1`). A request with `kv_len ≤ top_k` attends to all.
    pub top_k: usize,
    /// Heavy channels per KV head, `[kv_heads × heavy_channels]` row-major: indices into
    /// `head_dim`. The label row of a token is its key at these channels (written with K), and
    /// a query head scores tokens with its own values at its KV head's channels.
    pub channels: Vec<u32>,
}

/// Per-call attention parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionParams {
    /// Softmax scale applied to `q·k` (usually `1/√head_dim`).
    pub scale: f32,
    /// Required for DoubleSparse layouts (labels are written from K at these channels; decode
    /// batches attend sparsely); must be `None` for plain MHA layouts.
    pub double_sparse: Option<DoubleSparseConfig>,
}

impl AttentionParams {
    /// Dense attention with the given scale.
    pub fn dense(scale: f32) -> Self {
        AttentionParams {
            scale,
            double_sparse: None,
        }
    }
}
