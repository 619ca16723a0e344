//! Parsing a Hugging Face `config.json` into a [`ModelConfig`], field by field, so that every
//! error names the field it is about. Validation of the parsed values is `ModelConfig::validate`
//! (in the parent module), which parsing calls last.

use std::path::Path;

use attention::RopeScaling;
use serde_json::{Map, Value};

use super::{field_err, Architecture, MlaConfig, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};

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
    // Newer configs say `rope_type`, older ones (DeepSeek-V2) `type`; errors name the key used.
    let key = if obj.contains_key("rope_type") {
        "rope_scaling.rope_type"
    } else {
        "rope_scaling.type"
    };
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| field_err(key, "missing"))?;
    let num = |name: &str| {
        obj.get(name)
            .and_then(Value::as_f64)
            .ok_or_else(|| field_err(&format!("rope_scaling.{name}"), "missing or not a number"))
    };
    let opt = |name: &str, default: f64| match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| field_err(&format!("rope_scaling.{name}"), "not a number")),
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: num("factor")?,
        }),
        "yarn" => Ok(RopeScaling::Yarn {
            factor: num("factor")?,
            original_max_position_embeddings: opt("original_max_position_embeddings", 4096.0)?,
            beta_fast: opt("beta_fast", 32.0)?,
            beta_slow: opt("beta_slow", 1.0)?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        }),
        other => Err(field_err(
            key,
            format!("`{other}` is not supported (supported: default, linear, llama3, yarn)"),
        )),
    }
}

fn parse_mla(f: &Fields<'_>) -> Result<MlaConfig> {
    if f.bool_or("attention_bias", false)? {
        return Err(field_err(
            "attention_bias",
            "biases are not supported for DeepseekV2ForCausalLM",
        ));
    }
    let moe = match f.opt_usize("n_routed_experts")? {
        None => None,
        Some(n_routed_experts) => {
            let method = match f.get("topk_method") {
                None => "greedy",
                Some(v) => v.as_str().ok_or_else(|| {
                    field_err("topk_method", format!("expected a string, got {v}"))
                })?,
            };
            if method != "greedy" {
                return Err(field_err(
                    "topk_method",
                    format!("`{method}` is not supported (supported: greedy)"),
                ));
            }
            if let Some(v) = f.get("scoring_func") {
                if v.as_str() != Some("softmax") {
                    return Err(field_err(
                        "scoring_func",
                        format!("{v} is not supported (supported: softmax)"),
                    ));
                }
            }
            Some(MoeConfig {
                n_routed_experts,
                num_experts_per_tok: f.usize("num_experts_per_tok")?,
                n_shared_experts: f.opt_usize("n_shared_experts")?.unwrap_or(0),
                moe_intermediate_size: f.usize("moe_intermediate_size")?,
                first_k_dense_replace: f.opt_usize("first_k_dense_replace")?.unwrap_or(0),
                moe_layer_freq: f.opt_usize("moe_layer_freq")?.unwrap_or(1),
                norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
                routed_scaling_factor: f.f64_or("routed_scaling_factor", 1.0)?,
            })
        }
    };
    let (mut rope_mscale, mut softmax_mscale) = (1.0, 1.0);
    if let RopeScaling::Yarn { factor, .. } = parse_rope_scaling(f.get("rope_scaling"))? {
        let obj = f.get("rope_scaling").and_then(Value::as_object);
        let num = |name: &str, default: f64| -> Result<f64> {
            match obj.and_then(|o| o.get(name)).filter(|v| !v.is_null()) {
                None => Ok(default),
                Some(v) => v.as_f64().ok_or_else(|| {
                    field_err(
                        &format!("rope_scaling.{name}"),
                        format!("expected a number, got {v}"),
                    )
                }),
            }
        };
        let mscale = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        let (m, m_all) = (num("mscale", 1.0)?, num("mscale_all_dim", 0.0)?);
        rope_mscale = mscale(m) / mscale(m_all);
        if m_all != 0.0 {
            softmax_mscale = mscale(m_all);
        }
    }
    Ok(MlaConfig {
        q_lora_rank: f.opt_usize("q_lora_rank")?,
        kv_lora_rank: f.usize("kv_lora_rank")?,
        qk_nope_head_dim: f.usize("qk_nope_head_dim")?,
        qk_rope_head_dim: f.usize("qk_rope_head_dim")?,
        v_head_dim: f.usize("v_head_dim")?,
        moe,
        rope_mscale,
        softmax_mscale,
    })
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
        let rope_scaling = parse_rope_scaling(f.get("rope_scaling"))?;
        if matches!(rope_scaling, RopeScaling::Yarn { .. })
            && architecture != Architecture::DeepseekV2
        {
            let key = match f.get("rope_scaling").and_then(|v| v.get("rope_type")) {
                Some(_) => "rope_scaling.rope_type",
                None => "rope_scaling.type",
            };
            return Err(field_err(
                key,
                format!(
                    "`yarn` is supported for DeepseekV2ForCausalLM only, not {}",
                    architecture.hf_name()
                ),
            ));
        }
        // Qwen2 / Qwen3 configs carry a `sliding_window` that is off unless `use_sliding_window`.
        let sliding_window = match architecture {
            Architecture::Mistral => f.opt_usize("sliding_window")?,
            Architecture::Qwen2 | Architecture::Qwen3
                if f.bool_or("use_sliding_window", false)? =>
            {
                f.opt_usize("sliding_window")?
            }
            _ => None,
        };
        let mla = if architecture == Architecture::DeepseekV2 {
            Some(parse_mla(&f)?)
        } else {
            None
        };
        let (num_key_value_heads, head_dim) = match &mla {
            Some(m) => (num_attention_heads, m.qk_nope_head_dim + m.qk_rope_head_dim),
            None => (num_key_value_heads, head_dim),
        };
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
            rope_scaling,
            max_position_embeddings: f.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            sliding_window,
            vocab_size: f.usize("vocab_size")?,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            qkv_bias: architecture == Architecture::Qwen2 || (attention_bias && mla.is_none()),
            o_bias: matches!(architecture, Architecture::Llama | Architecture::Mistral)
                && attention_bias,
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            mla,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}
