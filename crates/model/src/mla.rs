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
//! `W_O[:, h] W_UV[h] o_latent[h]`. Both products are folded into the weights at load time
//! (computed in f64, as the DeepSeek-V2 paper describes): the query projection yields the
//! absorbed `[heads, kv_lora_rank]` query directly, and the output projection reads the
//! `[heads, kv_lora_rank]` latent output directly. The store holds one row per token,
//! `[c_kv, rope(k_pe)]`; the backend's [`Backend::attention_mla`] attends over it with softmax
//! scale `1/√(qk_nope + qk_rope)`. The folded matrices cost `kv_lora_rank / qk_nope` (query)
//! and `kv_lora_rank / v_head_dim` (output) times the unfolded projections' FLOPs; a per-head
//! batched matmul on the backend would avoid that and is a possible follow-up.
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

/// The query path of a layer, with `W_UK` folded in.
enum QueryProj<B: Backend> {
    /// `q_proj`: hidden → `[heads, kv_lora_rank]` (absorbed) and `[heads, qk_rope]`.
    Plain {
        absorbed: B::Tensor,
        rope: B::Tensor,
    },
    /// `q_a_proj` → `q_a_layernorm` → (`q_b_proj` split and absorbed).
    Lora {
        q_a: B::Tensor,
        q_a_norm: B::Tensor,
        absorbed: B::Tensor,
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
    /// `o_proj` with `W_UV` folded in, `[hidden, heads · kv_lora_rank]`.
    o_absorbed: B::Tensor,
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

/// Splits and absorbs a query projection `w` (`[heads · (nope + rope), in]`) with the `W_UK`
/// blocks of `kv_b` (`[heads · (nope + v), r]`): returns `[heads · r, in]` (row `h·r + j` is
/// `Σ_i W_UK[h][i][j] · W_q_nope[h][i]`) and the rope rows `[heads · rope, in]`.
fn absorb_query(m: &MlaConfig, heads: usize, w: &HostTensor, kv_b: &HostTensor) -> [HostTensor; 2] {
    let (nope, rope, r, v) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.kv_lora_rank,
        m.v_head_dim,
    );
    let inp = w.shape[1];
    let mut absorbed = vec![0.0f64; heads * r * inp];
    par_chunks(&mut absorbed, r * inp, |h, block| {
        let qbase = h * (nope + rope);
        for i in 0..nope {
            let qrow = &w.data[(qbase + i) * inp..(qbase + i + 1) * inp];
            let ukrow = &kv_b.data[(h * (nope + v) + i) * r..(h * (nope + v) + i + 1) * r];
            for (j, &uk) in ukrow.iter().enumerate() {
                let dst = &mut block[j * inp..(j + 1) * inp];
                for (d, &q) in dst.iter_mut().zip(qrow) {
                    *d += uk as f64 * q as f64;
                }
            }
        }
    });
    let mut rope_rows = Vec::with_capacity(heads * rope * inp);
    for h in 0..heads {
        let qbase = h * (nope + rope);
        rope_rows.extend(
            w.data[(qbase + nope) * inp..(qbase + nope + rope) * inp]
                .iter()
                .map(|&x| (x as f64 * m.rope_mscale) as f32),
        );
    }
    [
        HostTensor {
            shape: vec![heads * r, inp],
            data: absorbed.into_iter().map(|x| x as f32).collect(),
        },
        HostTensor {
            shape: vec![heads * rope, inp],
            data: rope_rows,
        },
    ]
}

/// Folds the `W_UV` blocks of `kv_b` into `o_proj` (`[hidden, heads · v]`): returns
/// `[hidden, heads · r]` with entry `(row, h·r + j) = Σ_k W_O[row][h·v + k] · W_UV[h][k][j]`.
fn absorb_output(m: &MlaConfig, heads: usize, o: &HostTensor, kv_b: &HostTensor) -> HostTensor {
    let (nope, r, v) = (m.qk_nope_head_dim, m.kv_lora_rank, m.v_head_dim);
    let d = o.shape[0];
    let mut out = vec![0.0f64; d * heads * r];
    par_chunks(&mut out, heads * r, |row, block| {
        for h in 0..heads {
            let dst = &mut block[h * r..(h + 1) * r];
            for k in 0..v {
                let wo = o.data[row * heads * v + h * v + k] as f64;
                let uv = &kv_b.data
                    [(h * (nope + v) + nope + k) * r..(h * (nope + v) + nope + k + 1) * r];
                for (x, &u) in dst.iter_mut().zip(uv) {
                    *x += wo * u as f64;
                }
            }
        }
    });
    HostTensor {
        shape: vec![d, heads * r],
        data: out.into_iter().map(|x| x as f32).collect(),
    }
}

/// Runs `f(index, chunk)` over the `chunk`-sized pieces of `data` on the available cores
/// (each piece computed by one thread in a fixed order, so the result does not depend on the
/// thread count).
fn par_chunks(data: &mut [f64], chunk: usize, f: impl Fn(usize, &mut [f64]) + Sync) {
    let pieces = data.len() / chunk.max(1);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(pieces.max(1));
    let per = pieces.div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        for (g, group) in data.chunks_mut(per * chunk.max(1)).enumerate() {
            let f = &f;
            scope.spawn(move || {
                for (k, piece) in group.chunks_mut(chunk.max(1)).enumerate() {
                    f(g * per + k, piece);
                }
            });
        }
    });
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
    /// so a bad checkpoint fails before anything is uploaded), folds `kv_b_proj` into the query
    /// and output projections, and uploads the weights to `backend`.
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
            let kv_b = loader.get(&format!("{a}kv_b_proj.weight"))?;
            let q = match m.q_lora_rank {
                None => {
                    let w = loader.get(&format!("{a}q_proj.weight"))?;
                    let [absorbed, rope] = absorb_query(&m, heads, &w, &kv_b);
                    QueryProj::Plain {
                        absorbed: loader.put(&absorbed)?,
                        rope: loader.put(&rope)?,
                    }
                }
                Some(_) => {
                    let w = loader.get(&format!("{a}q_b_proj.weight"))?;
                    let [absorbed, rope] = absorb_query(&m, heads, &w, &kv_b);
                    QueryProj::Lora {
                        q_a: loader.upload(&format!("{a}q_a_proj.weight"))?,
                        q_a_norm: loader.upload(&format!("{a}q_a_layernorm.weight"))?,
                        absorbed: loader.put(&absorbed)?,
                        rope: loader.put(&rope)?,
                    }
                }
            };
            let kv_a = loader.get(&format!("{a}kv_a_proj_with_mqa.weight"))?;
            let [latent, mut rope] = split_rows(&kv_a, m.kv_lora_rank);
            for x in &mut rope.data {
                *x = (*x as f64 * m.rope_mscale) as f32;
            }
            let o = loader.get(&format!("{a}o_proj.weight"))?;
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
                o_absorbed: loader.put(&absorb_output(&m, heads, &o, &kv_b))?,
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
        let (heads, r, dr) = (c.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim);
        let eps = c.rms_norm_eps as f32;
        let rope: RopeConfig = c.mla_rope().ok_or_else(|| ModelError::ConfigField {
            field: "qk_rope_head_dim".into(),
            reason: "missing".into(),
        })?;
        let h = backend.rms_norm(x, &w.input_norm, eps)?;
        // Query: absorbed no-position part and rotary part, per head.
        let (q_abs, mut q_pe) = match &w.q {
            QueryProj::Plain { absorbed, rope } => {
                let [a, r] = matmul_n(backend, &h, [absorbed, rope])?;
                (a, r)
            }
            QueryProj::Lora {
                q_a,
                q_a_norm,
                absorbed,
                rope,
            } => {
                let qa = backend.matmul(&h, q_a)?;
                let qa = backend.rms_norm(&qa, q_a_norm, eps)?;
                let [a, r] = matmul_n(backend, &qa, [absorbed, rope])?;
                (a, r)
            }
        };
        let q_abs = backend.reshape(q_abs, &[n, heads, r])?;
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
        let o_lat = backend.reshape(o_lat, &[n, heads * r])?;
        let o = backend.matmul(&o_lat, &w.o_absorbed)?;
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
