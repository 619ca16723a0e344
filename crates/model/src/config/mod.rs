//! The model configuration: a Hugging Face `config.json` for the Llama family and DeepSeek-V2
//! (MLA, MoE), its validation, and what the engine derives from it (RoPE, the KV shape, the
//! parameter count, the context a sliding window allows). Parsing, field by field so that every
//! error names its field, is in `parse`.

use std::fmt;

use attention::{RopeConfig, RopeScaling, RopeStyle};
use kv_pool::{KvDtype, KvShape};

use crate::error::{ModelError, Result};

mod parse;

/// A decoder architecture this crate implements (the `architectures[0]` of `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2 / 3, SmolLM, TinyLlama, …).
    Llama,
    /// `MistralForCausalLM`: the Llama layer. Its sliding window is not applied, so it is served
    /// only within the window ([`ModelConfig::check_context_len`]).
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2 / 2.5: biases on the q, k, v projections).
    Qwen2,
    /// `Qwen3ForCausalLM` (RMSNorm over each head of q and k before rotary).
    Qwen3,
    /// `DeepseekV2ForCausalLM` (multi-head latent attention, dense and MoE MLPs; the
    /// DeepSeek-V2-Lite shape). Its extra fields are in [`ModelConfig::mla`].
    DeepseekV2,
}

impl Architecture {
    /// Every supported architecture with its Hugging Face class name.
    pub const ALL: [(Architecture, &'static str); 5] = [
        (Architecture::Llama, "LlamaForCausalLM"),
        (Architecture::Mistral, "MistralForCausalLM"),
        (Architecture::Qwen2, "Qwen2ForCausalLM"),
        (Architecture::Qwen3, "Qwen3ForCausalLM"),
        (Architecture::DeepseekV2, "DeepseekV2ForCausalLM"),
    ];

    /// The Hugging Face class name.
    pub fn hf_name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(a, _)| *a == self)
            .map(|(_, n)| *n)
            .unwrap_or("?")
    }

    /// Looks up a Hugging Face class name.
    pub fn from_hf_name(name: &str) -> Result<Self> {
        Self::ALL
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(a, _)| *a)
            .ok_or_else(|| ModelError::UnsupportedArchitecture {
                name: name.to_string(),
                supported: Self::ALL
                    .iter()
                    .map(|(_, n)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// Multi-head latent attention and MLP routing of a DeepSeek-V2 decoder (HF
/// `DeepseekV2ForCausalLM`). Attention runs in absorbed form over one latent row per token,
/// `[kv_lora_rank + qk_rope_head_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Rank of the query compression (`q_a_proj` → `q_a_layernorm` → `q_b_proj`); `None`
    /// (V2-Lite) means a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed KV latent `c_kv` (512 in V2-Lite).
    pub kv_lora_rank: usize,
    /// Per-head query/key dims without position (128).
    pub qk_nope_head_dim: usize,
    /// Per-head rotary dims, the key part shared by all heads (64).
    pub qk_rope_head_dim: usize,
    /// Per-head value dims (128).
    pub v_head_dim: usize,
    /// Mixture-of-experts MLPs, if `n_routed_experts` is set.
    pub moe: Option<MoeConfig>,
    /// YaRN's amplitude on the rotary cos/sin, `mscale(factor, mscale) /
    /// mscale(factor, mscale_all_dim)` with `mscale(s, m) = 0.1·m·ln s + 1` (1 for `s ≤ 1`);
    /// 1 without YaRN. Folded into the q_pe and k_pe projections at load (rotation is linear).
    pub rope_mscale: f64,
    /// YaRN's softmax correction `mscale(factor, mscale_all_dim)` (1 when `mscale_all_dim` is 0
    /// or absent, and without YaRN): the softmax scale is
    /// `softmax_mscale² / √(qk_nope + qk_rope)`.
    pub softmax_mscale: f64,
}

/// DeepSeek-V2 mixture-of-experts MLP: softmax router, greedy top-k, shared experts.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Always-on shared experts (one MLP of `n_shared_experts · moe_intermediate_size`).
    pub n_shared_experts: usize,
    /// Width of each expert's MLP.
    pub moe_intermediate_size: usize,
    /// Layers `< first_k_dense_replace` have a dense MLP.
    pub first_k_dense_replace: usize,
    /// Of the later layers, those with `layer % moe_layer_freq == 0` are MoE.
    pub moe_layer_freq: usize,
    /// Renormalise the top-k weights to sum to 1 (when top-k > 1); otherwise they are
    /// multiplied by `routed_scaling_factor`.
    pub norm_topk_prob: bool,
    /// Scale of the routed output when the weights are not renormalised.
    pub routed_scaling_factor: f64,
}

impl MoeConfig {
    /// Whether decoder layer `layer` has the MoE MLP (HF's rule).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer % self.moe_layer_freq == 0
    }
}

/// The configuration of a decoder (the Llama family, or DeepSeek-V2 with [`mla`](Self::mla)).
///
/// Invariants (checked by [`validate`](Self::validate), which every constructor runs): every
/// dimension is positive, `num_attention_heads` is a multiple of `num_key_value_heads`,
/// `head_dim` is even, and `rms_norm_eps`, `rope_theta` are finite and positive.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which architecture (decides the bias and q/k-norm tensors).
    pub architecture: Architecture,
    /// Model width `d`.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA groups; equal to the query heads for MHA, 1 for MQA).
    pub num_key_value_heads: usize,
    /// Per-head dimension (`hidden_size / num_attention_heads` unless the config says).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary base.
    pub rope_theta: f64,
    /// Rotary frequency scaling (`rope_scaling`: none, `linear` or `llama3`).
    pub rope_scaling: RopeScaling,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// The attention window in tokens, when the model attends only to the last
    /// `sliding_window` positions (`sliding_window` of Mistral's config, and of Qwen2's and
    /// Qwen3's when `use_sliding_window` is true). The layers here attend to every position, so
    /// they compute the model exactly only for sequences no longer than the window:
    /// [`check_context_len`](Self::check_context_len) refuses a longer context.
    pub sliding_window: Option<usize>,
    /// Vocabulary size (rows of the embedding and the LM head).
    pub vocab_size: usize,
    /// Whether the LM head reuses the embedding table.
    pub tie_word_embeddings: bool,
    /// Biases on the q, k, v projections (Qwen2, or Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// RMSNorm over each head of q and k before rotary (Qwen3).
    pub qk_norm: bool,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (the config may give one or a list).
    pub eos_token_ids: Vec<u32>,
    /// MLA attention and MoE fields; `Some` exactly for [`Architecture::DeepseekV2`]. For it,
    /// `num_key_value_heads` equals the query heads and `head_dim` is
    /// `qk_nope_head_dim + qk_rope_head_dim` (the query head).
    pub mla: Option<MlaConfig>,
}

pub(super) fn field_err(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::ConfigField {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl MlaConfig {
    fn validate(&self) -> Result<()> {
        let mut positive = vec![
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
        ];
        if let Some(r) = self.q_lora_rank {
            positive.push(("q_lora_rank", r));
        }
        if let Some(m) = &self.moe {
            positive.extend([
                ("n_routed_experts", m.n_routed_experts),
                ("num_experts_per_tok", m.num_experts_per_tok),
                ("moe_intermediate_size", m.moe_intermediate_size),
                ("moe_layer_freq", m.moe_layer_freq),
            ]);
        }
        for (field, v) in positive {
            if v == 0 {
                return Err(field_err(field, "must be positive"));
            }
        }
        if self.qk_rope_head_dim % 2 != 0 {
            return Err(field_err(
                "qk_rope_head_dim",
                format!("{} must be even", self.qk_rope_head_dim),
            ));
        }
        if let Some(m) = &self.moe {
            if m.num_experts_per_tok > m.n_routed_experts {
                return Err(field_err(
                    "num_experts_per_tok",
                    format!(
                        "{} exceeds n_routed_experts {}",
                        m.num_experts_per_tok, m.n_routed_experts
                    ),
                ));
            }
            if !m.routed_scaling_factor.is_finite() {
                return Err(field_err("routed_scaling_factor", "must be finite"));
            }
        }
        for (field, v) in [
            ("rope_scaling.mscale", self.rope_mscale),
            ("rope_scaling.mscale_all_dim", self.softmax_mscale),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(field_err(
                    field,
                    format!("gives a scale {v}; must be finite and > 0"),
                ));
            }
        }
        Ok(())
    }
}

impl ModelConfig {
    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(field_err(field, "must be positive"));
            }
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(field_err(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(field_err("sliding_window", "must be positive"));
        }
        if self.head_dim % 2 != 0 {
            return Err(field_err(
                "head_dim",
                format!("{} must be even", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(field_err("rms_norm_eps", "must be finite and positive"));
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(field_err("vocab_size", "exceeds the u32 token id range"));
        }
        self.rope()
            .inv_freqs()
            .map_err(|e| field_err("rope_theta / rope_scaling", e.to_string()))?;
        match (&self.mla, self.architecture) {
            (Some(m), Architecture::DeepseekV2) => {
                m.validate()?;
                if self.num_key_value_heads != self.num_attention_heads
                    || self.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim
                {
                    return Err(field_err(
                        "num_key_value_heads / head_dim",
                        "an MLA config has as many KV heads as query heads and \
                         head_dim = qk_nope_head_dim + qk_rope_head_dim",
                    ));
                }
            }
            (None, Architecture::DeepseekV2) => {
                return Err(field_err(
                    "kv_lora_rank",
                    "missing (DeepseekV2 needs MLA fields)",
                ))
            }
            (Some(_), a) => {
                return Err(field_err(
                    "kv_lora_rank",
                    format!(
                        "MLA fields are only used by DeepseekV2, not {}",
                        a.hf_name()
                    ),
                ))
            }
            (None, _) => {}
        }
        Ok(())
    }

    /// Refuses to serve sequences of up to `context_len` tokens when the model has a sliding
    /// window shorter than that: the layers attend to every position, so beyond the window they
    /// would compute a different model. Within the window, full attention is exact (a position
    /// `i` attends to `j` iff `i − j < window`, which holds for every pair of a shorter
    /// sequence). The context a server offers is `max_position_embeddings` unless it is given a
    /// smaller one, so this is checked where the context length is known, not at parse time.
    ///
    /// Errors: [`ModelError::ConfigField`] naming `sliding_window`, with the largest context
    /// that can be served.
    pub fn check_context_len(&self, context_len: usize) -> Result<()> {
        match self.sliding_window {
            Some(window) if context_len > window => Err(field_err(
                "sliding_window",
                format!(
                    "{} attends within a sliding window of {window} tokens, which this crate \
                     does not apply; a context of {context_len} tokens would attend beyond it. \
                     Serve a context of at most {window} tokens (the engine's \
                     --context-length {window})",
                    self.architecture.hf_name()
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The rotary configuration of MLA's rope part (`qk_rope_head_dim`, GPT-J pairing: HF's
    /// DeepSeek-V2 de-interleaves q_pe / k_pe before `rotate_half`, which gives the same dot
    /// products as rotating interleaved pairs in place). `None` for non-MLA models.
    pub fn mla_rope(&self) -> Option<RopeConfig> {
        self.mla.as_ref().map(|m| RopeConfig {
            head_dim: m.qk_rope_head_dim,
            rotary_dim: m.qk_rope_head_dim,
            theta: self.rope_theta,
            style: RopeStyle::GptJ,
            scaling: self.rope_scaling,
        })
    }

    /// The rotary configuration of every layer (NeoX pairing over the whole head).
    pub fn rope(&self) -> RopeConfig {
        RopeConfig {
            head_dim: self.head_dim,
            rotary_dim: self.head_dim,
            theta: self.rope_theta,
            style: RopeStyle::Neox,
            scaling: self.rope_scaling,
        }
    }

    /// The per-token KV shape of this model for a store of `dtype`.
    pub fn kv_shape(&self, dtype: KvDtype) -> Result<KvShape> {
        if let Some(m) = &self.mla {
            return Ok(KvShape::mla(
                m.kv_lora_rank as u32,
                m.qk_rope_head_dim as u32,
                self.num_hidden_layers as u32,
                dtype,
            )?);
        }
        Ok(KvShape::mha(
            self.num_key_value_heads as u32,
            self.head_dim as u32,
            self.head_dim as u32,
            self.num_hidden_layers as u32,
            dtype,
        )?)
    }

    /// Parameters of the model (embedding, layers, final norm and an untied LM head).
    pub fn num_parameters(&self) -> usize {
        let d = self.hidden_size;
        if let Some(m) = &self.mla {
            return self.mla_parameters(m);
        }
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut layer = d * q + 2 * d * kv + q * d + 3 * d * self.intermediate_size + 2 * d;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += d;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + self.num_hidden_layers * layer + d + head
    }
}

impl ModelConfig {
    fn mla_parameters(&self, m: &MlaConfig) -> usize {
        let (d, h) = (self.hidden_size, self.num_attention_heads);
        let qh = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let q = match m.q_lora_rank {
            Some(r) => d * r + r + r * h * qh,
            None => d * h * qh,
        };
        let attn = q
            + d * (m.kv_lora_rank + m.qk_rope_head_dim)
            + m.kv_lora_rank
            + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
            + h * m.v_head_dim * d;
        let layers: usize = (0..self.num_hidden_layers)
            .map(|i| {
                let mlp = match &m.moe {
                    Some(moe) if moe.is_moe_layer(i) => {
                        let e = 3 * d * moe.moe_intermediate_size;
                        moe.n_routed_experts * d
                            + moe.n_routed_experts * e
                            + moe.n_shared_experts * e
                    }
                    _ => 3 * d * self.intermediate_size,
                };
                attn + mlp + 2 * d
            })
            .sum();
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * d
        };
        self.vocab_size * d + layers + d + head
    }
}

impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "architecture            {}", self.architecture.hf_name())?;
        writeln!(f, "hidden_size             {}", self.hidden_size)?;
        writeln!(f, "intermediate_size       {}", self.intermediate_size)?;
        writeln!(f, "num_hidden_layers       {}", self.num_hidden_layers)?;
        writeln!(
            f,
            "heads (q / kv)          {} / {} (group {})",
            self.num_attention_heads,
            self.num_key_value_heads,
            self.num_attention_heads / self.num_key_value_heads
        )?;
        writeln!(f, "head_dim                {}", self.head_dim)?;
        writeln!(f, "rms_norm_eps            {:e}", self.rms_norm_eps)?;
        writeln!(f, "rope_theta              {}", self.rope_theta)?;
        writeln!(f, "rope_scaling            {:?}", self.rope_scaling)?;
        writeln!(
            f,
            "max_position_embeddings {}",
            self.max_position_embeddings
        )?;
        if let Some(w) = self.sliding_window {
            writeln!(f, "sliding_window          {w}")?;
        }
        writeln!(f, "vocab_size              {}", self.vocab_size)?;
        writeln!(f, "tie_word_embeddings     {}", self.tie_word_embeddings)?;
        writeln!(
            f,
            "qkv_bias / o_bias       {} / {}",
            self.qkv_bias, self.o_bias
        )?;
        writeln!(f, "qk_norm                 {}", self.qk_norm)?;
        if let Some(m) = &self.mla {
            writeln!(
                f,
                "mla                     q_lora {:?}, kv_lora {}, nope {}, rope {}, v {}",
                m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
            )?;
            if let Some(e) = &m.moe {
                writeln!(
                    f,
                    "moe                     {} routed (top {}), {} shared, width {}, dense below {}",
                    e.n_routed_experts,
                    e.num_experts_per_tok,
                    e.n_shared_experts,
                    e.moe_intermediate_size,
                    e.first_k_dense_replace
                )?;
            }
        }
        writeln!(
            f,
            "bos / eos               {:?} / {:?}",
            self.bos_token_id, self.eos_token_ids
        )?;
        write!(f, "parameters              {}", self.num_parameters())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(architecture: &str, extra: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&format!(
            r#"{{"architectures": ["{architecture}"], "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 32768, "vocab_size": 100{extra}}}"#
        ))
    }

    #[test]
    fn a_sliding_window_limits_the_context_served() {
        // Mistral-7B-v0.1: a 4096-token window, 32768 positions.
        let c = config("MistralForCausalLM", r#", "sliding_window": 4096"#).unwrap();
        assert_eq!(c.sliding_window, Some(4096));
        let e = c.check_context_len(c.max_position_embeddings).unwrap_err();
        let ModelError::ConfigField { field, reason } = &e else {
            panic!("expected a ConfigField error, got {e:?}")
        };
        assert_eq!(field, "sliding_window");
        assert!(
            reason.contains("32768") && reason.contains("--context-length 4096"),
            "{e}"
        );
        assert!(c.check_context_len(4097).is_err());
        c.check_context_len(4096).unwrap();
        c.check_context_len(100).unwrap();

        // No window (null or absent, as Mistral-7B-v0.2+), or one as long as the context.
        for extra in [
            r#", "sliding_window": null"#,
            "",
            r#", "sliding_window": 32768"#,
        ] {
            let c = config("MistralForCausalLM", extra).unwrap();
            c.check_context_len(32768).unwrap();
        }
        // Qwen2's window is off unless use_sliding_window.
        let qwen = |extra| config("Qwen2ForCausalLM", extra).unwrap().sliding_window;
        assert_eq!(qwen(r#", "sliding_window": 4096"#), None);
        assert_eq!(
            qwen(r#", "sliding_window": 4096, "use_sliding_window": true"#),
            Some(4096)
        );
        // Llama has no window; a bad value names the field.
        assert_eq!(
            config("LlamaForCausalLM", r#", "sliding_window": 4096"#)
                .unwrap()
                .sliding_window,
            None
        );
        for bad in [r#", "sliding_window": 0"#, r#", "sliding_window": "big""#] {
            let e = config("MistralForCausalLM", bad).unwrap_err();
            assert!(e.to_string().contains("sliding_window"), "{e}");
        }
    }
}
