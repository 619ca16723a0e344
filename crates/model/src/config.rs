//! Hugging Face `config.json` for the Llama family, parsed field by field so that every error
//! names the field it is about.

use std::fmt;
use std::path::Path;

use attention::{RopeConfig, RopeScaling, RopeStyle};
use kv_pool::{KvDtype, KvShape};
use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// A decoder architecture this crate implements (the `architectures[0]` of `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `LlamaForCausalLM` (Llama 2 / 3, SmolLM, TinyLlama, …).
    Llama,
    /// `MistralForCausalLM` (the Llama layer; sliding windows are not applied).
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2 / 2.5: biases on the q, k, v projections).
    Qwen2,
    /// `Qwen3ForCausalLM` (RMSNorm over each head of q and k before rotary).
    Qwen3,
}

impl Architecture {
    /// Every supported architecture with its Hugging Face class name.
    pub const ALL: [(Architecture, &'static str); 4] = [
        (Architecture::Llama, "LlamaForCausalLM"),
        (Architecture::Mistral, "MistralForCausalLM"),
        (Architecture::Qwen2, "Qwen2ForCausalLM"),
        (Architecture::Qwen3, "Qwen3ForCausalLM"),
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

/// The configuration of a Llama-family decoder.
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
}

fn field_err(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::ConfigField {
        field: field.to_string(),
        reason: reason.into(),
    }
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, field: &str) -> Option<&Value> {
        self.0.get(field).filter(|v| !v.is_null())
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?
            .ok_or_else(|| field_err(field, "missing"))
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                field_err(field, format!("expected a non-negative integer, got {v}"))
            }),
        }
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| field_err(field, format!("expected a number, got {v}"))),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| field_err(field, format!("expected a boolean, got {v}"))),
        }
    }

    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let one = |v: &Value| {
            v.as_u64()
                .filter(|&x| x <= u32::MAX as u64)
                .map(|x| x as u32)
                .ok_or_else(|| field_err(field, format!("expected a token id, got {v}")))
        };
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(list)) => list.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }
}

fn parse_rope_scaling(v: Option<&Value>) -> Result<RopeScaling> {
    let Some(v) = v else {
        return Ok(RopeScaling::None);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| field_err("rope_scaling", format!("expected an object, got {v}")))?;
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| field_err("rope_scaling.rope_type", "missing"))?;
    let num = |name: &str| {
        obj.get(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| field_err(&format!("rope_scaling.{name}"), "missing or not a number"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(field_err(
            "rope_scaling.rope_type",
            format!("`{other}` is not supported (supported: default, linear, llama3)"),
        )),
    }
}

impl ModelConfig {
    /// Reads and parses `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|e| match e {
            ModelError::Json { reason, .. } => ModelError::Json {
                file: path.display().to_string(),
                reason,
            },
            e => e,
        })
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json {
            file: "config.json".into(),
            reason: e.to_string(),
        })?;
        let obj = value.as_object().ok_or_else(|| ModelError::Json {
            file: "config.json".into(),
            reason: "the top level is not an object".into(),
        })?;
        let f = Fields(obj);
        let arch_name = match f.get("architectures") {
            Some(Value::Array(list)) => list
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| field_err("architectures", "expected a non-empty list of names"))?,
            Some(v) => {
                return Err(field_err(
                    "architectures",
                    format!("expected a list of names, got {v}"),
                ))
            }
            None => return Err(field_err("architectures", "missing")),
        };
        let architecture = Architecture::from_hf_name(arch_name)?;
        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_key_value_heads = f
            .opt_usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        let head_dim = match f.opt_usize("head_dim")? {
            Some(h) => h,
            None if num_attention_heads > 0 => hidden_size / num_attention_heads,
            None => 0,
        };
        if f.bool_or("mlp_bias", false)? {
            return Err(field_err("mlp_bias", "MLP biases are not supported"));
        }
        let attention_bias = f.bool_or("attention_bias", false)?;
        let cfg = ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: f.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta: f.f64_or("rope_theta", 10_000.0)?,
            rope_scaling: parse_rope_scaling(f.get("rope_scaling"))?,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            vocab_size: f.usize("vocab_size")?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            qkv_bias: architecture == Architecture::Qwen2 || attention_bias,
            o_bias: matches!(architecture, Architecture::Llama | Architecture::Mistral)
                && attention_bias,
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

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
        Ok(())
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
        writeln!(f, "vocab_size              {}", self.vocab_size)?;
        writeln!(f, "tie_word_embeddings     {}", self.tie_word_embeddings)?;
        writeln!(
            f,
            "qkv_bias / o_bias       {} / {}",
            self.qkv_bias, self.o_bias
        )?;
        writeln!(f, "qk_norm                 {}", self.qk_norm)?;
        writeln!(
            f,
            "bos / eos               {:?} / {:?}",
            self.bos_token_id, self.eos_token_ids
        )?;
        write!(f, "parameters              {}", self.num_parameters())
    }
}
