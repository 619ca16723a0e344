//! The DeepSeek-V2 decoder (HF `DeepseekV2ForCausalLM`, the V2-Lite shape): multi-head latent
//! attention in absorbed form over the paged MLA store, dense and mixture-of-experts MLPs.
//!
//! Per layer: RMSNorm → query (`q_proj`, or `q_a_proj` → `q_a_layernorm` → `q_b_proj`) →
//! `kv_a_proj_with_mqa` split into the latent `c_kv` (→ `kv_a_layernorm`) and the shared rotary
//! key `k_pe` → absorbed MLA attention → output → residual → RMSNorm → dense MLP (layers
//! `< first_k_dense_replace`) or MoE (softmax router, greedy top-k, shared experts) → residual.
//!
//! ## Absorption
//! With `W_UK[h]` `[qk_nope, kv_lora_rank]` and `W_UV[h]` `[v_head_dim, kv_lora_rank]` the
//! per-head blocks of `kv_b_proj`, the no-position score of head `h` is
//! `q_nope[h]·(W_UK[h] c) = (W_UK[h]ᵀ q_nope[h])·c`, and its output through `o_proj` is
//! `W_O[:, h] W_UV[h] o_latent[h]`. As in SGLang (`w_kc`, `w_vc` and `torch.bmm` in
//! `deepseek_v2.py`), both products are per-head matmuls ([`Backend::bmm`]) at run time: the
//! query projection's no-position rows give `q_nope`, `bmm` by `w_kc` (`W_UK[h]ᵀ`, `[heads,
//! kv_lora_rank, qk_nope]`) gives the absorbed `[heads, kv_lora_rank]` query, and the latent
//! output goes through `bmm` by `w_vc` (`W_UV[h]`, `[heads, v_head_dim, kv_lora_rank]`) and
//! then `o_proj` as it is. The store holds one row per token, `[c_kv, rope(k_pe)]`; the
//! backend's [`Backend::attention_mla`] attends over it with softmax scale
//! `1/√(qk_nope + qk_rope)`. (Folding `W_UK` into the query projection and `W_UV` into
//! `o_proj` at load time, as this crate did first, costs `kv_lora_rank / qk_nope` (4×) the
//! projections' weights and FLOPs.) The query's no-position rows and `o_proj` keep the
//! checkpoint's type (the slices are exact); `w_kc` and `w_vc` (2 · heads · 128 · 512 values a
//! layer) are kept in f32, so a backend that rounds a 16-bit weight's activations (the CPU's
//! bf16 matmul) does not round the absorbed query or the latent output: with them in bf16,
//! the emulated CUDA backend's greedy tokens on the tiny MLA preset left the CPU's at a
//! near-tie (`attention-cuda-emu`'s `tiny_mla_decoder_greedy_matches_cpu`).
//!
//! ## Rotary and YaRN
//! q_pe and k_pe use GPT-J (interleaved) pairing, which gives the same scores as HF's
//! de-interleave-then-`rotate_half`. With `rope_scaling.type = "yarn"` the frequencies come
//! from [`attention::RopeScaling::Yarn`]; YaRN's cos/sin amplitude
//! ([`MlaConfig::rope_mscale`]) is folded into the q_pe and k_pe projection rows, and the
//! softmax scale is multiplied by [`MlaConfig::softmax_mscale`]², as in HF.
//!
//! ## MoE routing
//! Router logits come from the backend's matmul; routing and the routed experts are one backend
//! op, [`Backend::fused_moe`] (softmax, greedy top-k with ties to the lower expert index, each
//! expert's MLP, a token's experts added in its rank order), over the experts' weights stacked
//! at load time ([`MoeExperts`], SGLang's `w13` / `w2`); the shared experts are a dense MLP
//! added after. The CPU backend runs each expert's MLP over the rows routed to it, so a token's
//! result does not depend on which other tokens share the batch; the CUDA backend keeps the
//! routing on the device, so the decoder's decode forward can be captured as a CUDA graph.

use attention::{AttentionParams, Backend, DeviceTensor, MoeExperts, MoeRouting, RopeConfig};

use crate::config::{MlaConfig, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::layers::{matmul_n, mlp_tensors, trunk_tensors, DenseMlp, Loader, Trunk};
use crate::weights::{HostTensor, TensorSource};

/// The query path of a layer, its projection split into the no-position and rotary rows.
enum QueryProj<B: Backend> {
    /// `q_proj`: hidden → `[heads, qk_nope]` and `[heads, qk_rope]`.
    Plain { nope: B::Tensor, rope: B::Tensor },
    /// `q_a_proj` → `q_a_layernorm` → `q_b_proj`, split.
    Lora {
        q_a: B::Tensor,
        q_a_norm: B::Tensor,
        nope: B::Tensor,
        rope: B::Tensor,
    },
}

/// A mixture-of-experts MLP.
struct Moe<B: Backend> {
    /// Router `[n_routed_experts, hidden]`.
    gate: B::Tensor,
    /// The routed experts, stacked.
    experts: MoeExperts<B::Tensor>,
    shared: Option<DenseMlp<B>>,
    routing: MoeRouting,
}

enum Mlp<B: Backend> {
    Dense(DenseMlp<B>),
    Moe(Moe<B>),
}

/// One MLA decoder layer's weights on the backend.
struct MlaLayer<B: Backend> {
    input_norm: B::Tensor,
    q: QueryProj<B>,
    /// The `c_kv` rows of `kv_a_proj_with_mqa`, `[kv_lora_rank, hidden]`.
    kv_a_latent: B::Tensor,
    /// The `k_pe` rows of `kv_a_proj_with_mqa`, `[qk_rope, hidden]`.
    kv_a_rope: B::Tensor,
    kv_a_norm: B::Tensor,
    /// `W_UK[h]ᵀ` per head, `[heads, kv_lora_rank, qk_nope]` (SGLang's `w_kc`).
    w_kc: B::Tensor,
    /// `W_UV[h]` per head, `[heads, v_head_dim, kv_lora_rank]` (SGLang's `w_vc`).
    w_vc: B::Tensor,
    /// `o_proj`, `[hidden, heads · v_head_dim]`.
    o_proj: B::Tensor,
    post_norm: B::Tensor,
    mlp: Mlp<B>,
}

/// A DeepSeek-V2 (MLA) decoder with its weights uploaded to a backend.
pub struct MlaModel<B: Backend> {
    config: ModelConfig,
    trunk: Trunk<B>,
    layers: Vec<MlaLayer<B>>,
}

fn mla_of(config: &ModelConfig) -> Result<&MlaConfig> {
    config.mla.as_ref().ok_or_else(|| ModelError::ConfigField {
        field: "kv_lora_rank".into(),
        reason: format!(
            "{} is not an MLA model; load it with LlamaModel",
            config.architecture.hf_name()
        ),
    })
}

/// Every tensor name and shape the checkpoint of an MLA `config` must contain, in load order
/// (HF `DeepseekV2ForCausalLM` names). Empty for a non-MLA config.
pub fn mla_expected_tensors(config: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let Some(m) = &config.mla else {
        return Vec::new();
    };
    let (d, h) = (config.hidden_size, config.num_attention_heads);
    let qh = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let (mut out, tail) = trunk_tensors(config);
    for i in 0..config.num_hidden_layers {
        let p = format!("model.layers.{i}.");
        let a = format!("{p}self_attn.");
        out.push((format!("{p}input_layernorm.weight"), vec![d]));
        match m.q_lora_rank {
            None => out.push((format!("{a}q_proj.weight"), vec![h * qh, d])),
            Some(r) => out.extend([
                (format!("{a}q_a_proj.weight"), vec![r, d]),
                (format!("{a}q_a_layernorm.weight"), vec![r]),
                (format!("{a}q_b_proj.weight"), vec![h * qh, r]),
            ]),
        }
        out.extend([
            (
                format!("{a}kv_a_proj_with_mqa.weight"),
                vec![m.kv_lora_rank + m.qk_rope_head_dim, d],
            ),
            (format!("{a}kv_a_layernorm.weight"), vec![m.kv_lora_rank]),
            (
                format!("{a}kv_b_proj.weight"),
                vec![h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
            ),
            (format!("{a}o_proj.weight"), vec![d, h * m.v_head_dim]),
            (format!("{p}post_attention_layernorm.weight"), vec![d]),
        ]);
        match &m.moe {
            Some(e) if e.is_moe_layer(i) => {
                out.push((format!("{p}mlp.gate.weight"), vec![e.n_routed_experts, d]));
                for x in 0..e.n_routed_experts {
                    out.extend(mlp_tensors(
                        &format!("{p}mlp.experts.{x}."),
                        e.moe_intermediate_size,
                        d,
                    ));
                }
                if e.n_shared_experts > 0 {
                    out.extend(mlp_tensors(
                        &format!("{p}mlp.shared_experts."),
                        e.n_shared_experts * e.moe_intermediate_size,
                        d,
                    ));
                }
            }
            _ => out.extend(mlp_tensors(
                &format!("{p}mlp."),
                config.intermediate_size,
                d,
            )),
        }
    }
    out.extend(tail);
    out
}

/// Splits a query projection `w` (`[heads · (nope + rope), in]`) into its no-position rows
/// `[heads · nope, in]` and its rotary rows `[heads · rope, in]`, the latter times YaRN's
/// amplitude.
fn split_query(m: &MlaConfig, heads: usize, w: &HostTensor) -> [HostTensor; 2] {
    let (nope, rope) = (m.qk_nope_head_dim, m.qk_rope_head_dim);
    let inp = w.shape[1];
    let rows = |h: usize, from: usize, len: usize| {
        let start = (h * (nope + rope) + from) * inp;
        &w.data[start..start + len * inp]
    };
    let nope_rows: Vec<f32> = (0..heads).flat_map(|h| rows(h, 0, nope)).copied().collect();
    let rope_rows: Vec<f32> = (0..heads)
        .flat_map(|h| rows(h, nope, rope))
        .map(|&x| (x as f64 * m.rope_mscale) as f32)
        .collect();
    [
        HostTensor {
            shape: vec![heads * nope, inp],
            data: nope_rows,
        },
        HostTensor {
            shape: vec![heads * rope, inp],
            data: rope_rows,
        },
    ]
}

/// `kv_b_proj` (`[heads · (nope + v), r]`) as SGLang's per-head `w_kc` (`W_UK[h]ᵀ`,
/// `[heads, r, nope]`) and `w_vc` (`W_UV[h]`, `[heads, v, r]`).
fn split_kv_b(m: &MlaConfig, heads: usize, kv_b: &HostTensor) -> [HostTensor; 2] {
    let (nope, r, v) = (m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim);
    let row = |h: usize, i: usize| &kv_b.data[(h * (nope + v) + i) * r..][..r];
    let mut w_kc = Vec::with_capacity(heads * r * nope);
    let mut w_vc = Vec::with_capacity(heads * v * r);
    for h in 0..heads {
        for j in 0..r {
            w_kc.extend((0..nope).map(|i| row(h, i)[j]));
        }
        for k in 0..v {
            w_vc.extend_from_slice(row(h, nope + k));
        }
    }
    [
        HostTensor {
            shape: vec![heads, r, nope],
            data: w_kc,
        },
        HostTensor {
            shape: vec![heads, v, r],
            data: w_vc,
        },
    ]
}

/// Splits rows `[0, at)` and `[at, ..)` of a matrix.
fn split_rows(t: &HostTensor, at: usize) -> [HostTensor; 2] {
    let cols = t.shape[1];
    [
        HostTensor {
            shape: vec![at, cols],
            data: t.data[..at * cols].to_vec(),
        },
        HostTensor {
            shape: vec![t.shape[0] - at, cols],
            data: t.data[at * cols..].to_vec(),
        },
    ]
}

impl<B: Backend> MlaModel<B> {
    /// Loads every tensor an MLA `config` needs from `source` (checking names and shapes first,
    /// so a bad checkpoint fails before anything is uploaded), splits the query projection and
    /// `kv_b_proj` per head, and uploads the weights to `backend`.
    pub fn load(backend: &B, config: ModelConfig, source: &dyn TensorSource) -> Result<Self> {
        config.validate()?;
        let m = mla_of(&config)?.clone();
        let heads = config.num_attention_heads;
        let loader = Loader::new(backend, source, mla_expected_tensors(&config))?;
        let trunk = Trunk::load(&loader, &config)?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}.");
            let a = format!("{p}self_attn.");
            let kv_b_name = format!("{a}kv_b_proj.weight");
            let [w_kc, w_vc] = split_kv_b(&m, heads, &loader.get(&kv_b_name)?);
            let q_name = match m.q_lora_rank {
                None => format!("{a}q_proj.weight"),
                Some(_) => format!("{a}q_b_proj.weight"),
            };
            let [nope, rope] = split_query(&m, heads, &loader.get(&q_name)?);
            let (nope, rope) = (loader.put_weight_of(&nope, &q_name)?, loader.put(&rope)?);
            let q = match m.q_lora_rank {
                None => QueryProj::Plain { nope, rope },
                Some(_) => QueryProj::Lora {
                    q_a: loader.upload(&format!("{a}q_a_proj.weight"))?,
                    q_a_norm: loader.upload(&format!("{a}q_a_layernorm.weight"))?,
                    nope,
                    rope,
                },
            };
            let kv_a = loader.get(&format!("{a}kv_a_proj_with_mqa.weight"))?;
            let [latent, mut rope] = split_rows(&kv_a, m.kv_lora_rank);
            for x in &mut rope.data {
                *x = (*x as f64 * m.rope_mscale) as f32;
            }
            let mlp = match &m.moe {
                Some(e) if e.is_moe_layer(i) => {
                    Mlp::Moe(Moe::load(&loader, &format!("{p}mlp."), e)?)
                }
                _ => Mlp::Dense(DenseMlp::load(&loader, &format!("{p}mlp."))?),
            };
            layers.push(MlaLayer {
                input_norm: loader.upload(&format!("{p}input_layernorm.weight"))?,
                q,
                kv_a_latent: loader.put(&latent)?,
                kv_a_rope: loader.put(&rope)?,
                kv_a_norm: loader.upload(&format!("{a}kv_a_layernorm.weight"))?,
                w_kc: loader.put(&w_kc)?,
                w_vc: loader.put(&w_vc)?,
                o_proj: loader.upload_weight(&format!("{a}o_proj.weight"))?,
                post_norm: loader.upload(&format!("{p}post_attention_layernorm.weight"))?,
                mlp,
            });
        }
        Ok(MlaModel {
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

    /// One decoder layer over the hidden state `x` (`[n, hidden]`, updated in place): writes
    /// the layer's latent rows at the plan's `out_cache_loc` and attends over every request's
    /// latent rows through the plan's page table. `positions` are the rows' token positions.
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
        let m = mla_of(c)?;
        let w = self
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::InvalidInput {
                request: 0,
                reason: format!("layer {layer} out of range ({})", self.layers.len()),
            })?;
        let n = x.shape().first().copied().unwrap_or(0);
        let (heads, dr) = (c.num_attention_heads, m.qk_rope_head_dim);
        let (nope, v) = (m.qk_nope_head_dim, m.v_head_dim);
        let eps = c.rms_norm_eps as f32;
        let rope: RopeConfig = c.mla_rope().ok_or_else(|| ModelError::ConfigField {
            field: "qk_rope_head_dim".into(),
            reason: "missing".into(),
        })?;
        let h = backend.rms_norm(x, &w.input_norm, eps)?;
        // Query: no-position part absorbed through w_kc, and rotary part, per head.
        let (q_nope, mut q_pe) = match &w.q {
            QueryProj::Plain { nope, rope } => {
                let [a, r] = matmul_n(backend, &h, [nope, rope])?;
                (a, r)
            }
            QueryProj::Lora {
                q_a,
                q_a_norm,
                nope,
                rope,
            } => {
                let qa = backend.matmul(&h, q_a)?;
                let qa = backend.rms_norm(&qa, q_a_norm, eps)?;
                let [a, r] = matmul_n(backend, &qa, [nope, rope])?;
                (a, r)
            }
        };
        let q_nope = backend.reshape(q_nope, &[n, heads, nope])?;
        let q_abs = backend.bmm(&q_nope, &w.w_kc)?;
        drop(q_nope);
        q_pe = backend.reshape(q_pe, &[n, heads, dr])?;
        backend.rotary(&mut q_pe, positions, &rope)?;
        let q = backend.concat_last(&q_abs, &q_pe)?;
        drop((q_abs, q_pe));
        // Latent row: normalised c_kv, then the rotary key shared by all heads.
        let [ckv, k_pe] = matmul_n(backend, &h, [&w.kv_a_latent, &w.kv_a_rope])?;
        let ckv = backend.rms_norm(&ckv, &w.kv_a_norm, eps)?;
        drop(h);
        let mut k_pe = backend.reshape(k_pe, &[n, 1, dr])?;
        backend.rotary(&mut k_pe, positions, &rope)?;
        let k_pe = backend.reshape(k_pe, &[n, dr])?;
        let latent = backend.concat_last(&ckv, &k_pe)?;
        drop((ckv, k_pe));
        let scale = m.softmax_mscale * m.softmax_mscale / ((m.qk_nope_head_dim + dr) as f64).sqrt();
        let params = AttentionParams::dense(scale as f32);
        let o_lat = backend.attention_mla(layer, plan, store, &q, &latent, &params)?;
        drop((q, latent));
        let o_heads = backend.bmm(&o_lat, &w.w_vc)?;
        drop(o_lat);
        let o_heads = backend.reshape(o_heads, &[n, heads * v])?;
        let o = backend.matmul(&o_heads, &w.o_proj)?;
        backend.add_assign(x, &o)?;
        let h = backend.rms_norm(x, &w.post_norm, eps)?;
        let out = match &w.mlp {
            Mlp::Dense(mlp) => mlp.forward(backend, &h)?,
            Mlp::Moe(moe) => moe.forward(backend, &h)?,
        };
        backend.add_assign(x, &out)?;
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

impl<B: Backend> Moe<B> {
    /// Loads the router, the routed experts stacked ([`MoeExperts`]) and the shared experts
    /// of the layer under `prefix` (`model.layers.{i}.mlp.`).
    fn load(loader: &Loader<'_, B>, prefix: &str, cfg: &MoeConfig) -> Result<Self> {
        let expert = |x: usize, names: &[&str]| -> Vec<String> {
            names
                .iter()
                .map(|n| format!("{prefix}experts.{x}.{n}_proj.weight"))
                .collect()
        };
        let e = cfg.n_routed_experts;
        let gate_up: Vec<Vec<String>> = (0..e).map(|x| expert(x, &["gate", "up"])).collect();
        let down: Vec<Vec<String>> = (0..e).map(|x| expert(x, &["down"])).collect();
        Ok(Moe {
            gate: loader.upload(&format!("{prefix}gate.weight"))?,
            experts: MoeExperts {
                gate_up: loader.upload_stacked(&gate_up)?,
                down: loader.upload_stacked(&down)?,
                intermediate: cfg.moe_intermediate_size,
            },
            shared: if cfg.n_shared_experts > 0 {
                Some(DenseMlp::load(loader, &format!("{prefix}shared_experts."))?)
            } else {
                None
            },
            routing: MoeRouting {
                top_k: cfg.num_experts_per_tok,
                renormalize: cfg.norm_topk_prob,
                routed_scaling_factor: cfg.routed_scaling_factor,
            },
        })
    }

    /// Routed experts (weighted by the router, [`Backend::fused_moe`]) plus the shared
    /// experts, `[n, hidden]`.
    fn forward(&self, backend: &B, h: &B::Tensor) -> Result<B::Tensor> {
        let logits = backend.matmul(h, &self.gate)?;
        let mut routed = backend.fused_moe(h, &logits, &self.experts, &self.routing)?;
        if let Some(shared) = &self.shared {
            let s = shared.forward(backend, h)?;
            backend.add_assign(&mut routed, &s)?;
        }
        Ok(routed)
    }
}
