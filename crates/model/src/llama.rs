//! The Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM) on any
//! [`Backend`].
//!
//! Per layer: RMSNorm → q, k, v projections (+ biases) → optional per-head q/k RMSNorm →
//! rotary → paged attention over the KV store (GQA) → o projection → residual → RMSNorm →
//! gate/up → SiLU-and-mul → down → residual. Then the final RMSNorm and the LM head.

use attention::{AttentionParams, Backend, DeviceTensor};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{matmul_n, mlp_tensors, trunk_tensors, DenseMlp, Loader, Trunk};
use crate::weights::TensorSource;

/// One decoder layer's weights on the backend. Biases stay on the host and are broadcast to
/// the batch's rows at forward time (the backend has no broadcasting add).
pub struct LayerWeights<B: Backend> {
    input_norm: B::Tensor,
    q_proj: B::Tensor,
    k_proj: B::Tensor,
    v_proj: B::Tensor,
    o_proj: B::Tensor,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
    post_norm: B::Tensor,
    mlp: DenseMlp<B>,
}

/// A Llama-family decoder with its weights uploaded to a backend.
pub struct LlamaModel<B: Backend> {
    config: ModelConfig,
    trunk: Trunk<B>,
    layers: Vec<LayerWeights<B>>,
}

/// Which rows of the final hidden state get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsMode {
    /// The last new token of every request (what sampling needs).
    #[default]
    LastToken,
    /// Every new token of every request (scoring, tests).
    AllTokens,
    /// None (a middle prefill chunk that samples nothing).
    None,
}

/// The Hugging Face tensor names of layer `i` (the checkpoint layout this crate reads).
pub fn layer_tensor_names(config: &ModelConfig, i: usize) -> Vec<String> {
    let p = format!("model.layers.{i}.");
    let mut names = vec![
        format!("{p}input_layernorm.weight"),
        format!("{p}self_attn.q_proj.weight"),
        format!("{p}self_attn.k_proj.weight"),
        format!("{p}self_attn.v_proj.weight"),
        format!("{p}self_attn.o_proj.weight"),
        format!("{p}post_attention_layernorm.weight"),
        format!("{p}mlp.gate_proj.weight"),
        format!("{p}mlp.up_proj.weight"),
        format!("{p}mlp.down_proj.weight"),
    ];
    if config.qkv_bias {
        for w in ["q", "k", "v"] {
            names.push(format!("{p}self_attn.{w}_proj.bias"));
        }
    }
    if config.o_bias {
        names.push(format!("{p}self_attn.o_proj.bias"));
    }
    if config.qk_norm {
        names.push(format!("{p}self_attn.q_norm.weight"));
        names.push(format!("{p}self_attn.k_norm.weight"));
    }
    names
}

/// Every tensor name and shape the checkpoint of `config` must contain, in load order.
pub fn expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let d = config.hidden_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let inter = config.intermediate_size;
    let hd = config.head_dim;
    let (mut out, tail) = trunk_tensors(config);
    for i in 0..config.num_hidden_layers {
        for name in layer_tensor_names(config, i) {
            let leaf = name.rsplit_once("layers.").map(|x| x.1).unwrap_or(&name);
            let leaf = leaf.split_once('.').map(|x| x.1).unwrap_or(leaf);
            let shape = match leaf {
                "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![d],
                "self_attn.q_proj.weight" => vec![q, d],
                "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![kv, d],
                "self_attn.o_proj.weight" => vec![d, q],
                "self_attn.q_proj.bias" => vec![q],
                "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => vec![kv],
                "self_attn.o_proj.bias" => vec![d],
                "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![hd],
                _ => match mlp_tensors("mlp.", inter, d)
                    .into_iter()
                    .find(|(n, _)| n == leaf)
                {
                    Some((_, shape)) => shape,
                    None => vec![],
                },
            };
            out.push((name, shape));
        }
    }
    out.extend(tail);
    out
}

impl<B: Backend> LlamaModel<B> {
    /// Loads every tensor `config` needs from `source` (checking names and shapes first, so a
    /// bad checkpoint fails before anything is uploaded) and uploads them to `backend`.
    pub fn load(backend: &B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self> {
        config.validate()?;
        if config.mla.is_some() {
            return Err(ModelError::ConfigField {
                field: "architectures".into(),
                reason: format!(
                    "{} is an MLA model; load it with MlaModel",
                    config.architecture.hf_name()
                ),
            });
        }
        let loader = Loader::new(backend, source, expected_tensors(&config))?;
        let get = |name: &str| loader.get(name);
        let upload = |name: &str| loader.upload(name);
        let weight = |name: &str| loader.upload_weight(name);
        let trunk = Trunk::load(&loader, &config)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}.");
            let bias = |on: bool, w: &str| -> Result<Option<Vec<f32>>> {
                if on {
                    Ok(Some(get(&format!("{p}self_attn.{w}_proj.bias"))?.data))
                } else {
                    Ok(None)
                }
            };
            let norm = |w: &str| -> Result<Option<B::Tensor>> {
                if config.qk_norm {
                    Ok(Some(upload(&format!("{p}self_attn.{w}_norm.weight"))?))
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                input_norm: upload(&format!("{p}input_layernorm.weight"))?,
                q_proj: weight(&format!("{p}self_attn.q_proj.weight"))?,
                k_proj: weight(&format!("{p}self_attn.k_proj.weight"))?,
                v_proj: weight(&format!("{p}self_attn.v_proj.weight"))?,
                o_proj: weight(&format!("{p}self_attn.o_proj.weight"))?,
                q_bias: bias(config.qkv_bias, "q")?,
                k_bias: bias(config.qkv_bias, "k")?,
                v_bias: bias(config.qkv_bias, "v")?,
                o_bias: bias(config.o_bias, "o")?,
                q_norm: norm("q")?,
                k_norm: norm("k")?,
                post_norm: upload(&format!("{p}post_attention_layernorm.weight"))?,
                mlp: DenseMlp::load(&loader, &format!("{p}mlp."))?,
            });
        }
        Ok(LlamaModel {
            config,
            trunk,
            layers,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Token embeddings `[n, hidden]` of `ids` (every id must be `< vocab_size`).
    pub fn embed(&self, backend: &B, ids: &[u32]) -> Result<B::Tensor> {
        self.trunk.embed(backend, ids)
    }

    /// One decoder layer over the hidden state `x` (`[n, hidden]`, updated in place): the
    /// attention writes the layer's new K/V at the plan's `out_cache_loc` and reads every
    /// request's KV through the plan's page table. `positions` are the rows' token positions.
    pub fn layer_forward(
        &self,
        backend: &B,
        layer: usize,
        plan: &B::Plan,
        store: &mut B::KvStore,
        x: &mut B::Tensor,
        positions: &[u32],
    ) -> Result<()> {
        let c = &self.config;
        let w = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::InvalidInput {
                request: 0,
                reason: format!("layer {layer} out of range ({})", self.layers.len()),
            })?;
        let n = x.shape().first().copied().unwrap_or(0);
        let (hq, hkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let add_bias = |t: &mut B::Tensor, bias: &Option<Vec<f32>>| -> Result<()> {
            if let Some(b) = bias {
                let rows = b.repeat(n);
                let bt = backend.upload(&rows, &[n, b.len()])?;
                backend.add_assign(t, &bt)?;
            }
            Ok(())
        };
        let h = backend.rms_norm(x, &w.input_norm, eps)?;
        // SGLang's QKVParallelLinear: one op over the three projections.
        let [mut q, mut k, mut v] = matmul_n(backend, &h, [&w.q_proj, &w.k_proj, &w.v_proj])?;
        drop(h);
        add_bias(&mut q, &w.q_bias)?;
        add_bias(&mut k, &w.k_bias)?;
        add_bias(&mut v, &w.v_bias)?;
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let qh = backend.reshape(q, &[n * hq, hd])?;
            q = backend.rms_norm(&qh, qn, eps)?;
            let kh = backend.reshape(k, &[n * hkv, hd])?;
            k = backend.rms_norm(&kh, kn, eps)?;
        }
        let mut q = backend.reshape(q, &[n, hq, hd])?;
        let mut k = backend.reshape(k, &[n, hkv, hd])?;
        let v = backend.reshape(v, &[n, hkv, hd])?;
        let rope = c.rope();
        backend.rotary(&mut q, positions, &rope)?;
        backend.rotary(&mut k, positions, &rope)?;
        let params = AttentionParams::dense(1.0 / (hd as f32).sqrt());
        let attn = backend.attention(layer, plan, store, &q, &k, &v, &params)?;
        drop((q, k, v));
        let attn = backend.reshape(attn, &[n, hq * hd])?;
        let mut o = backend.matmul(&attn, &w.o_proj)?;
        add_bias(&mut o, &w.o_bias)?;
        backend.add_assign(x, &o)?;
        let h = backend.rms_norm(x, &w.post_norm, eps)?;
        let down = w.mlp.forward(backend, &h)?;
        backend.add_assign(x, &down)?;
        Ok(())
    }

    /// Final RMSNorm and LM head over the rows `rows` of `x` (all rows if `None`); returns
    /// `[rows, vocab]`.
    pub fn logits(&self, backend: &B, x: &B::Tensor, rows: Option<&[u32]>) -> Result<B::Tensor> {
        self.trunk.logits(backend, x, rows)
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}
