//! [`StorageNamespace`]: the prefix of every key a backend writes, naming the model and the
//! KV layout (SGLang's file backend appends `_<model>_<tp_rank>_<tp_size>` to each key for the
//! same reason), so two models, or one model with another page size or KV dtype, never read
//! each other's pages.

use std::fmt;

use kv_pool::{KvKind, KvShape};

use super::StorageError;

/// The key prefix of one model's pages in an L3 store: `<model>_<layout fingerprint>`, e.g.
/// `Qwen-Qwen2.5-0.5B_mha2x64x64_24l_bfloat16_p16`. Only `[A-Za-z0-9._-]`, so it is a valid
/// file name and a Redis key pattern without escapes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorageNamespace {
    prefix: String,
}

impl StorageNamespace {
    /// The namespace of `model` (its name or path: `/` becomes `-` as in SGLang, every other
    /// character outside `[A-Za-z0-9._-]` too) with KV `shape` in pages of `page_size` tokens.
    /// The fingerprint names the attention kind and its dimensions, the layer count, the
    /// dtype and the page size: everything that decides a page's bytes in kv-pool's canonical
    /// packed format.
    pub fn new(model: &str, shape: &KvShape, page_size: u32) -> Self {
        let model: String = model
            .trim_matches('/')
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let kind = match shape.kind {
            KvKind::Mha {
                kv_heads,
                head_dim,
                v_head_dim,
            } => format!("mha{kv_heads}x{head_dim}x{v_head_dim}"),
            KvKind::Mla {
                kv_lora_rank,
                qk_rope_head_dim,
            } => format!("mla{kv_lora_rank}x{qk_rope_head_dim}"),
            KvKind::DoubleSparse {
                kv_heads,
                head_dim,
                v_head_dim,
                heavy_channels,
            } => format!("ds{kv_heads}x{head_dim}x{v_head_dim}x{heavy_channels}"),
        };
        StorageNamespace {
            prefix: format!(
                "{model}_{kind}_{}l_{}_p{page_size}",
                shape.layers, shape.dtype
            ),
        }
    }

    /// A namespace with an explicit prefix (tests, tools): non-empty, at most 200 characters
    /// of `[A-Za-z0-9._-]`, not `.` or `..`.
    pub fn from_prefix(prefix: &str) -> Result<Self, StorageError> {
        let ok = !prefix.is_empty()
            && prefix.len() <= 200
            && prefix != "."
            && prefix != ".."
            && prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if ok {
            Ok(StorageNamespace {
                prefix: prefix.to_string(),
            })
        } else {
            Err(StorageError::InvalidConfig(format!(
                "storage namespace {prefix:?} must be 1 to 200 characters of [A-Za-z0-9._-], \
                 not . or .."
            )))
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }
}

impl fmt::Display for StorageNamespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use kv_pool::{KvDtype, KvShape};

    use super::StorageNamespace;

    #[test]
    fn the_prefix_names_model_and_layout() {
        let mha = KvShape::mha(2, 64, 64, 24, KvDtype::Bf16).unwrap();
        let ns = StorageNamespace::new("Qwen/Qwen2.5-0.5B", &mha, 16);
        assert_eq!(ns.prefix(), "Qwen-Qwen2.5-0.5B_mha2x64x64_24l_bfloat16_p16");
        let mla = KvShape::mla(512, 64, 61, KvDtype::Fp8E4m3).unwrap();
        let ns = StorageNamespace::new("/models/deepseek v3/", &mla, 64);
        assert_eq!(ns.prefix(), "models-deepseek-v3_mla512x64_61l_fp8_e4m3_p64");
        // Every component of the layout separates namespaces.
        let other = StorageNamespace::new("Qwen/Qwen2.5-0.5B", &mha, 1);
        assert_ne!(other, StorageNamespace::new("Qwen/Qwen2.5-0.5B", &mha, 16));
        assert!(StorageNamespace::from_prefix(ns.prefix()).is_ok());
    }

    #[test]
    fn explicit_prefixes_are_checked() {
        for bad in ["", ".", "..", "a/b", "a b", "k:v"] {
            assert!(StorageNamespace::from_prefix(bad).is_err(), "{bad:?}");
        }
        assert!(StorageNamespace::from_prefix(&"x".repeat(201)).is_err());
        assert_eq!(
            StorageNamespace::from_prefix("t-1").unwrap().prefix(),
            "t-1"
        );
    }
}
