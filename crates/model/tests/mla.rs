//! The MLA decoder (DeepSeek-V2-Lite shape): a tiny random `DeepseekV2ForCausalLM` checkpoint
//! in the HF layout loads, and its greedy output equals an independent f64 forward written
//! here the straightforward (non-absorbed) way; chunked prefill and batching are bitwise
//! invariant; bad checkpoints name the tensor or field.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use attention::CpuBackend;
use common::{temp_dir, write_safetensors, Rng};
use kv_pool::{KvDtype, KvLayout, KvShape, Slot};
use model::{
    load_model_dir, AttentionMode, ForwardInput, ForwardRequest, LogitsMode, LogitsOutput, Model,
    ModelConfig, ModelRunner,
};

type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// A tiny DeepSeek-V2-shaped model: 2 layers (layer 0 dense, layer 1 MoE), 4 heads,
/// kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head_dim 16, 4 routed experts (top 2) and 1
/// shared expert.
#[derive(Clone)]
struct MlaTest {
    vocab: usize,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    q_lora: Option<usize>,
    r: usize,
    nope: usize,
    rope: usize,
    v: usize,
    experts: usize,
    top_k: usize,
    shared: usize,
    moe_inter: usize,
    first_dense: usize,
    norm_topk: bool,
    scaling: f64,
    tied: bool,
    eps: f64,
    theta: f64,
    /// YaRN: factor, original context, beta_fast, beta_slow, mscale, mscale_all_dim.
    yarn: Option<[f64; 6]>,
    weights: Weights,
}

impl MlaTest {
    /// V2-Lite form (`q_proj`, no renormalisation, a routed scale) or, with `q_lora`, the V2
    /// form (`q_a_proj` / `q_b_proj`, renormalised top-k, tied embeddings).
    fn new(seed: u64, q_lora: bool) -> Self {
        let mut m = MlaTest {
            vocab: 96,
            hidden: 32,
            inter: 48,
            layers: 2,
            heads: 4,
            q_lora: q_lora.then_some(24),
            r: 32,
            nope: 16,
            rope: 8,
            v: 16,
            experts: 4,
            top_k: 2,
            shared: 1,
            moe_inter: 24,
            first_dense: 1,
            norm_topk: q_lora,
            scaling: if q_lora { 1.0 } else { 1.5 },
            tied: q_lora,
            eps: 1e-6,
            theta: 10_000.0,
            yarn: None,
            weights: BTreeMap::new(),
        };
        let mut rng = Rng::new(seed);
        let mut w = Weights::new();
        let mut add = |name: String, shape: Vec<usize>, offset: f64| {
            let n: usize = shape.iter().product();
            let scale = if offset != 0.0 {
                0.2
            } else if name.contains("embed") {
                1.0
            } else {
                1.0 / (shape[1] as f64).sqrt()
            };
            let data = (0..n)
                .map(|_| (offset + scale * rng.sym()) as f32)
                .collect();
            w.insert(name, (shape, data));
        };
        let (d, h, qh) = (m.hidden, m.heads, m.nope + m.rope);
        add("model.embed_tokens.weight".into(), vec![m.vocab, d], 0.0);
        for i in 0..m.layers {
            let p = format!("model.layers.{i}.");
            let a = format!("{p}self_attn.");
            add(format!("{p}input_layernorm.weight"), vec![d], 1.0);
            add(format!("{p}post_attention_layernorm.weight"), vec![d], 1.0);
            match m.q_lora {
                None => add(format!("{a}q_proj.weight"), vec![h * qh, d], 0.0),
                Some(qr) => {
                    add(format!("{a}q_a_proj.weight"), vec![qr, d], 0.0);
                    add(format!("{a}q_a_layernorm.weight"), vec![qr], 1.0);
                    add(format!("{a}q_b_proj.weight"), vec![h * qh, qr], 0.0);
                }
            }
            add(
                format!("{a}kv_a_proj_with_mqa.weight"),
                vec![m.r + m.rope, d],
                0.0,
            );
            add(format!("{a}kv_a_layernorm.weight"), vec![m.r], 1.0);
            add(
                format!("{a}kv_b_proj.weight"),
                vec![h * (m.nope + m.v), m.r],
                0.0,
            );
            add(format!("{a}o_proj.weight"), vec![d, h * m.v], 0.0);
            let mut mlp = |pre: String, inter: usize| {
                add(format!("{pre}gate_proj.weight"), vec![inter, d], 0.0);
                add(format!("{pre}up_proj.weight"), vec![inter, d], 0.0);
                add(format!("{pre}down_proj.weight"), vec![d, inter], 0.0);
            };
            if i < m.first_dense {
                mlp(format!("{p}mlp."), m.inter);
            } else {
                for e in 0..m.experts {
                    mlp(format!("{p}mlp.experts.{e}."), m.moe_inter);
                }
                mlp(format!("{p}mlp.shared_experts."), m.shared * m.moe_inter);
                add(format!("{p}mlp.gate.weight"), vec![m.experts, d], 0.0);
            }
        }
        add("model.norm.weight".into(), vec![d], 1.0);
        if !m.tied {
            add("lm_head.weight".into(), vec![m.vocab, d], 0.0);
        }
        m.weights = w;
        m
    }

    fn config_json(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "hidden_size": self.hidden,
            "intermediate_size": self.inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "q_lora_rank": self.q_lora,
            "kv_lora_rank": self.r,
            "qk_nope_head_dim": self.nope,
            "qk_rope_head_dim": self.rope,
            "v_head_dim": self.v,
            "n_routed_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "n_shared_experts": self.shared,
            "moe_intermediate_size": self.moe_inter,
            "first_k_dense_replace": self.first_dense,
            "moe_layer_freq": 1,
            "norm_topk_prob": self.norm_topk,
            "routed_scaling_factor": self.scaling,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "scoring_func": "softmax",
            "aux_loss_alpha": 0.001,
            "rms_norm_eps": self.eps,
            "rope_theta": self.theta,
            "rope_scaling": self.yarn.map(|[factor, orig, fast, slow, ms, ms_all]| serde_json::json!({
                "type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                "beta_fast": fast, "beta_slow": slow, "mscale": ms, "mscale_all_dim": ms_all
            })),
            "max_position_embeddings": 2048,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "attention_bias": false,
            "bos_token_id": 1,
            "eos_token_id": 2,
        })
    }

    fn write(&self, dir: &Path) {
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).unwrap();
        write_safetensors(&self.weights, dir, false, false);
    }

    fn w(&self, name: &str) -> &[f32] {
        &self.weights[name].1
    }

    /// Independent f64 forward over the whole sequence, HF `modeling_deepseek` step by step:
    /// keys and values are expanded per head from the latent (no absorption), and rotary
    /// de-interleaves q_pe / k_pe and applies `rotate_half` as HF does.
    fn reference_logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let (d, hn, n) = (self.hidden, self.heads, tokens.len());
        let (nope, dr, r, dv) = (self.nope, self.rope, self.r, self.v);
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let emb = self.w("model.embed_tokens.weight");
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| f(&emb[t as usize * d..(t as usize + 1) * d]))
            .collect();
        let rms = |v: &[f64], w: &[f32]| -> Vec<f64> {
            let ms = v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64;
            let s = 1.0 / (ms + self.eps).sqrt();
            v.iter().zip(w).map(|(a, &b)| a * s * b as f64).collect()
        };
        let lin = |v: &[f64], w: &[f32]| -> Vec<f64> {
            let k = v.len();
            (0..w.len() / k)
                .map(|o| (0..k).map(|c| v[c] * w[o * k + c] as f64).sum())
                .collect()
        };
        // HF DeepseekV2YarnRotaryEmbedding / yarn_get_mscale, step by step.
        let get_mscale = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        let (inv_freq, amp, softmax_mscale): (Vec<f64>, f64, f64) = match self.yarn {
            None => (
                (0..dr / 2)
                    .map(|i| self.theta.powf(-(2.0 * i as f64) / dr as f64))
                    .collect(),
                1.0,
                1.0,
            ),
            Some([factor, orig, fast, slow, ms, ms_all]) => {
                let corr = |rot: f64| {
                    dr as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let low = corr(fast).floor().max(0.0);
                let mut high = corr(slow).ceil().min(dr as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv = (0..dr / 2)
                    .map(|i| {
                        let extra = 1.0 / self.theta.powf(2.0 * i as f64 / dr as f64);
                        let inter = extra / factor;
                        let mask = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        inter * (1.0 - mask) + extra * mask
                    })
                    .collect();
                let sm = if ms_all != 0.0 {
                    get_mscale(factor, ms_all)
                } else {
                    1.0
                };
                (inv, get_mscale(factor, ms) / get_mscale(factor, ms_all), sm)
            }
        };
        let rope = |v: &[f64], pos: usize| -> Vec<f64> {
            let half = dr / 2;
            let de: Vec<f64> = (0..dr)
                .map(|i| {
                    if i < half {
                        v[2 * i]
                    } else {
                        v[2 * (i - half) + 1]
                    }
                })
                .collect();
            let mut out = vec![0.0; dr];
            for i in 0..half {
                let (s, c) = (pos as f64 * inv_freq[i]).sin_cos();
                let (s, c) = (s * amp, c * amp);
                out[i] = de[i] * c - de[i + half] * s;
                out[i + half] = de[i + half] * c + de[i] * s;
            }
            out
        };
        let silu = |a: f64| a / (1.0 + (-a).exp());
        let mlp = |h: &[f64], pre: &str| -> Vec<f64> {
            let g = lin(h, self.w(&format!("{pre}gate_proj.weight")));
            let u = lin(h, self.w(&format!("{pre}up_proj.weight")));
            let act: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| silu(a) * b).collect();
            lin(&act, self.w(&format!("{pre}down_proj.weight")))
        };
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            let a = format!("{p}self_attn.");
            let wt = |s: &str| self.w(&format!("{a}{s}"));
            // Per token: per-head q [nope + rope], k [nope + rope], v [dv].
            let mut qs = vec![vec![vec![0.0; nope + dr]; hn]; n];
            let mut ks = qs.clone();
            let mut vs = vec![vec![vec![0.0; dv]; hn]; n];
            for t in 0..n {
                let h = rms(&x[t], self.w(&format!("{p}input_layernorm.weight")));
                let q = match self.q_lora {
                    None => lin(&h, wt("q_proj.weight")),
                    Some(_) => {
                        let qa = rms(&lin(&h, wt("q_a_proj.weight")), wt("q_a_layernorm.weight"));
                        lin(&qa, wt("q_b_proj.weight"))
                    }
                };
                let kva = lin(&h, wt("kv_a_proj_with_mqa.weight"));
                let ckv = rms(&kva[..r], wt("kv_a_layernorm.weight"));
                let kpe = rope(&kva[r..], t);
                let kv = lin(&ckv, wt("kv_b_proj.weight"));
                for hh in 0..hn {
                    let qh = &q[hh * (nope + dr)..(hh + 1) * (nope + dr)];
                    qs[t][hh][..nope].copy_from_slice(&qh[..nope]);
                    qs[t][hh][nope..].copy_from_slice(&rope(&qh[nope..], t));
                    let kvh = &kv[hh * (nope + dv)..(hh + 1) * (nope + dv)];
                    ks[t][hh][..nope].copy_from_slice(&kvh[..nope]);
                    ks[t][hh][nope..].copy_from_slice(&kpe);
                    vs[t][hh].copy_from_slice(&kvh[nope..]);
                }
            }
            let scale = softmax_mscale * softmax_mscale / ((nope + dr) as f64).sqrt();
            for t in 0..n {
                let mut attn = vec![0.0; hn * dv];
                for hh in 0..hn {
                    let scores: Vec<f64> = (0..=t)
                        .map(|s| {
                            scale
                                * qs[t][hh]
                                    .iter()
                                    .zip(&ks[s][hh])
                                    .map(|(a, b)| a * b)
                                    .sum::<f64>()
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (s, es) in e.iter().enumerate() {
                        for j in 0..dv {
                            attn[hh * dv + j] += es / z * vs[s][hh][j];
                        }
                    }
                }
                let o = lin(&attn, wt("o_proj.weight"));
                for (xi, oi) in x[t].iter_mut().zip(o) {
                    *xi += oi;
                }
                let h = rms(
                    &x[t],
                    self.w(&format!("{p}post_attention_layernorm.weight")),
                );
                let out = if l < self.first_dense {
                    mlp(&h, &format!("{p}mlp."))
                } else {
                    let logits = lin(&h, self.w(&format!("{p}mlp.gate.weight")));
                    let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = logits.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let probs: Vec<f64> = e.iter().map(|v| v / z).collect();
                    let mut idx: Vec<usize> = (0..self.experts).collect();
                    idx.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap());
                    let top = &idx[..self.top_k];
                    let tot: f64 = top.iter().map(|&i| probs[i]).sum();
                    let mut y = mlp(&h, &format!("{p}mlp.shared_experts."));
                    for &ex in top {
                        let wgt = if self.top_k > 1 && self.norm_topk {
                            probs[ex] / tot
                        } else {
                            probs[ex] * self.scaling
                        };
                        let ye = mlp(&h, &format!("{p}mlp.experts.{ex}."));
                        for (a, b) in y.iter_mut().zip(ye) {
                            *a += wgt * b;
                        }
                    }
                    y
                };
                for (xi, oi) in x[t].iter_mut().zip(out) {
                    *xi += oi;
                }
            }
        }
        let head = if self.tied {
            self.w("model.embed_tokens.weight")
        } else {
            self.w("lm_head.weight")
        };
        x.iter()
            .map(|row| lin(&rms(row, self.w("model.norm.weight")), head))
            .collect()
    }

    fn reference_greedy(&self, prompt: &[u32], steps: usize) -> Vec<u32> {
        let mut seq = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..steps {
            let logits = self.reference_logits(&seq);
            let last = logits.last().unwrap();
            let mut best = 0;
            for (i, &v) in last.iter().enumerate() {
                if v > last[best] {
                    best = i;
                }
            }
            out.push(best as u32);
            seq.push(best as u32);
        }
        out
    }
}

const PAGE: u32 = 4;

fn runner_for(model: Model<CpuBackend>, slots: usize) -> ModelRunner<CpuBackend> {
    let shape = model.config().kv_shape(KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, PAGE, slots).unwrap();
    ModelRunner::new(CpuBackend::default(), model, layout).unwrap()
}

fn load(m: &MlaTest, name: &str) -> Model<CpuBackend> {
    let dir = temp_dir(name);
    m.write(&dir);
    load_model_dir(&CpuBackend::default(), &dir).unwrap()
}

fn check_greedy(m: &MlaTest, name: &str) {
    let model = load(m, name);
    let c = model.config();
    assert!(c.mla.is_some());
    assert_eq!(
        c.kv_shape(KvDtype::F32).unwrap(),
        KvShape::mla(32, 8, 2, KvDtype::F32).unwrap()
    );
    let mut runner = runner_for(model, 256);
    let prompt: Vec<u32> = vec![1, 17, 42, 5, 88, 23, 9];
    let steps = 6;
    let want = m.reference_greedy(&prompt, steps);
    // Scattered slots: position p on page 3 + 2·(p / PAGE) (every other page).
    let slots: Vec<Slot> = (0..(prompt.len() + steps) as u32)
        .map(|p| Slot((3 + 2 * (p / PAGE)) * PAGE + p % PAGE))
        .collect();
    let mut seq = prompt.clone();
    let mut got = Vec::new();
    let mut last = Vec::new();
    for step in 0..steps {
        let new = if step == 0 {
            &seq[..]
        } else {
            &seq[seq.len() - 1..]
        };
        let out = runner
            .forward(&ForwardInput {
                mode: if step == 0 {
                    AttentionMode::Extend
                } else {
                    AttentionMode::Decode
                },
                requests: vec![ForwardRequest {
                    input_ids: new,
                    slots: &slots[..seq.len()],
                }],
                logits: LogitsMode::LastToken,
                layer_wait: None,
            })
            .unwrap();
        last = out.last(0).unwrap().to_vec();
        let t = out.argmax()[0].unwrap();
        got.push(t);
        seq.push(t);
    }
    assert_eq!(got, want, "greedy tokens differ from the f64 reference");
    let refl = m.reference_logits(&seq[..seq.len() - 1]);
    let refl = refl.last().unwrap();
    let num: f64 = refl
        .iter()
        .zip(&last)
        .map(|(a, &b)| (a - b as f64).powi(2))
        .sum();
    let den: f64 = refl.iter().map(|a| a * a).sum();
    let rel = (num / den).sqrt();
    assert!(rel < 1e-4, "relative error {rel}");
}

#[test]
fn mla_v2_lite_checkpoint_greedy_matches_f64_reference() {
    check_greedy(&MlaTest::new(21, false), "mla-lite");
}

#[test]
fn mla_yarn_rope_scaling_greedy_matches_f64_reference() {
    let mut m = MlaTest::new(29, false);
    m.yarn = Some([40.0, 4096.0, 32.0, 1.0, 1.0, 0.707]);
    let c = ModelConfig::from_json_str(&m.config_json().to_string()).unwrap();
    let mla = c.mla.as_ref().unwrap();
    assert!(
        mla.rope_mscale > 1.05 && mla.softmax_mscale > 1.2,
        "{mla:?}"
    );
    check_greedy(&m, "mla-yarn-ok");
}

#[test]
fn mla_q_lora_renormalised_topk_greedy_matches_f64_reference() {
    check_greedy(&MlaTest::new(22, true), "mla-qlora");
}

fn extend(
    runner: &mut ModelRunner<CpuBackend>,
    ids: &[u32],
    slots: &[Slot],
    mode: LogitsMode,
) -> LogitsOutput {
    runner
        .forward(&ForwardInput {
            mode: AttentionMode::Extend,
            requests: vec![ForwardRequest {
                input_ids: ids,
                slots,
            }],
            logits: mode,
            layer_wait: None,
        })
        .unwrap()
}

#[test]
fn mla_chunked_prefill_and_batching_are_bitwise_invariant() {
    let m = MlaTest::new(23, false);
    let prompt: Vec<u32> = (0..70).map(|i| (i * 37 + 11) % 96).collect();
    let slots: Vec<Slot> = (0..prompt.len() as u32).map(|p| Slot(PAGE + p)).collect();
    let mut one = runner_for(load(&m, "mla-chunk-one"), 256);
    let full = extend(&mut one, &prompt, &slots, LogitsMode::AllTokens);
    for chunk in [1, 7, 64] {
        let mut runner = runner_for(load(&m, &format!("mla-chunk-{chunk}")), 256);
        let mut logits = Vec::new();
        let mut start = 0;
        while start < prompt.len() {
            let end = (start + chunk).min(prompt.len());
            let out = extend(
                &mut runner,
                &prompt[start..end],
                &slots[..end],
                LogitsMode::AllTokens,
            );
            logits.extend_from_slice(&out.logits);
            start = end;
        }
        assert!(
            logits == full.logits,
            "chunk size {chunk}: logits differ from one pass"
        );
    }

    // A decode batch of mixed lengths equals each request alone, bitwise.
    let a: Vec<u32> = prompt[..13].to_vec();
    let b: Vec<u32> = prompt[20..25].to_vec();
    let sa: Vec<Slot> = (0..a.len() as u32 + 1).map(|p| Slot(PAGE + p)).collect();
    let sb: Vec<Slot> = (0..b.len() as u32 + 1)
        .map(|p| Slot(10 * PAGE + p))
        .collect();
    let mut batch = runner_for(load(&m, "mla-batch"), 256);
    extend(&mut batch, &a, &sa[..a.len()], LogitsMode::None);
    extend(&mut batch, &b, &sb[..b.len()], LogitsMode::None);
    let both = batch
        .forward(&ForwardInput {
            mode: AttentionMode::Decode,
            requests: vec![
                ForwardRequest {
                    input_ids: &[7],
                    slots: &sa,
                },
                ForwardRequest {
                    input_ids: &[9],
                    slots: &sb,
                },
            ],
            logits: LogitsMode::LastToken,
            layer_wait: None,
        })
        .unwrap();
    for (r, (ids, s, next)) in [(&a, &sa, 7u32), (&b, &sb, 9u32)].into_iter().enumerate() {
        let mut alone = runner_for(load(&m, &format!("mla-alone-{r}")), 256);
        extend(&mut alone, ids, &s[..ids.len()], LogitsMode::None);
        let out = alone
            .forward(&ForwardInput {
                mode: AttentionMode::Decode,
                requests: vec![ForwardRequest {
                    input_ids: &[next],
                    slots: s,
                }],
                logits: LogitsMode::LastToken,
                layer_wait: None,
            })
            .unwrap();
        assert!(
            out.last(0) == both.last(r),
            "request {r}: batched decode differs from alone"
        );
    }
}

fn load_err(m: &MlaTest, name: &str, config: Option<serde_json::Value>) -> String {
    let dir = temp_dir(name);
    m.write(&dir);
    if let Some(cfg) = config {
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    }
    match load_model_dir(&CpuBackend::default(), &dir) {
        Ok(_) => panic!("loaded a bad checkpoint"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mla_missing_tensor_is_named() {
    let mut m = MlaTest::new(24, false);
    m.weights
        .remove("model.layers.1.mlp.experts.2.up_proj.weight");
    assert_eq!(
        load_err(&m, "mla-missing", None),
        "missing tensor `model.layers.1.mlp.experts.2.up_proj.weight`"
    );
    let mut m = MlaTest::new(24, false);
    m.weights
        .remove("model.layers.0.self_attn.kv_a_layernorm.weight");
    assert_eq!(
        load_err(&m, "mla-missing2", None),
        "missing tensor `model.layers.0.self_attn.kv_a_layernorm.weight`"
    );
}

#[test]
fn mla_wrong_shape_is_named_with_expected_and_got() {
    let mut m = MlaTest::new(25, false);
    m.weights.insert(
        "model.layers.1.self_attn.kv_b_proj.weight".into(),
        (vec![96, 32], vec![0.5; 96 * 32]),
    );
    assert_eq!(
        load_err(&m, "mla-shape", None),
        "tensor `model.layers.1.self_attn.kv_b_proj.weight`: expected shape [128, 32], got [96, 32]"
    );
}

#[test]
fn mla_unsupported_config_fields_are_named() {
    let m = MlaTest::new(26, false);
    let mut cfg = m.config_json();
    cfg["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 4.0});
    assert_eq!(
        load_err(&m, "mla-dynamic", Some(cfg)),
        "config field `rope_scaling.type`: `dynamic` is not supported (supported: default, linear, llama3, yarn)"
    );
    let mut cfg = m.config_json();
    cfg["rope_scaling"] = serde_json::json!({"type": "yarn", "beta_fast": 32});
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "config field `rope_scaling.factor`: missing or not a number"
    );

    let mut cfg = m.config_json();
    cfg["topk_method"] = "group_limited_greedy".into();
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("config field `topk_method`"), "{e}");

    let mut cfg = m.config_json();
    cfg.as_object_mut().unwrap().remove("kv_lora_rank");
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert_eq!(e, "config field `kv_lora_rank`: missing");

    let mut cfg = m.config_json();
    cfg["num_experts_per_tok"] = 5.into();
    let e = ModelConfig::from_json_str(&cfg.to_string())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("config field `num_experts_per_tok`"), "{e}");
}

#[test]
fn mla_runner_refuses_an_mha_layout() {
    let m = MlaTest::new(27, false);
    let model = load(&m, "mla-layout");
    let shape = KvShape::mha(4, 24, 24, 2, KvDtype::F32).unwrap();
    let layout = KvLayout::new(shape, PAGE, 16).unwrap();
    let e = ModelRunner::new(CpuBackend::default(), model, layout)
        .err()
        .unwrap()
        .to_string();
    assert!(e.starts_with("config field `kv layout`"), "{e}");
}

#[test]
fn mla_config_parses_v2_lite_fields() {
    let m = MlaTest::new(28, false);
    let c = ModelConfig::from_json_str(&m.config_json().to_string()).unwrap();
    let mla = c.mla.as_ref().unwrap();
    assert_eq!(
        (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim),
        (None, 32, 16)
    );
    assert_eq!((mla.qk_rope_head_dim, mla.v_head_dim), (8, 16));
    let moe = mla.moe.as_ref().unwrap();
    assert!(!moe.is_moe_layer(0) && moe.is_moe_layer(1));
    assert_eq!((c.num_key_value_heads, c.head_dim), (4, 24));
    // Every parameter of the checkpoint is counted.
    let total: usize = m
        .weights
        .values()
        .map(|(s, _)| s.iter().product::<usize>())
        .sum();
    assert_eq!(c.num_parameters(), total);
}

#[test]
fn tiny_mla_preset_loads_and_generates_deterministically() {
    let run = || {
        let backend = CpuBackend::default();
        let model = model::tiny::tiny_mla_model(&backend).unwrap();
        assert_eq!(model.num_layers(), 2);
        let mut runner = runner_for(model, 64);
        let prompt = [50_256u32, 464, 2068, 7586];
        let slots: Vec<Slot> = (0..prompt.len() as u32).map(|p| Slot(PAGE + p)).collect();
        extend(&mut runner, &prompt, &slots, LogitsMode::LastToken).argmax()[0].unwrap()
    };
    let t = run();
    assert!(t < 50_257);
    assert_eq!(t, run());
}
