//! Test helpers: a tiny random checkpoint in the Hugging Face layout, and an independent f64
//! forward over the same weights (plain loops, contiguous KV; no kvserve code).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, View};
use std::borrow::Cow;

/// The relative L2 error of logits a backend may add, beyond f32's, by rounding a matmul's
/// activations to bf16 for bf16 weights (the CPU backend does, as llama.cpp: `vdpbf16ps`
/// arithmetic). Each rounding is off by at most 2⁻⁹ relative per element, so `‖δx‖ ≤ 2⁻⁹‖x‖`
/// for a matmul's input, and with weights that do not favour the rounding's direction (random
/// here) the output is off by about as much relative; to first order the matmuls on the path
/// to the logits add up: 4 per layer (qkv, o, gate/up, down) and the LM head, 9 for the test
/// models' 2 layers. Measured: about a tenth of it.
pub const BF16_ACTIVATIONS_REL: f64 = 9.0 / 512.0;

/// `‖got − want‖₂ / ‖want‖₂`.
pub fn relative_error(want: &[f64], got: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (&w, &g) in want.iter().zip(got) {
        diff += (w - g as f64).powi(2);
        norm += w * w;
    }
    (diff / norm).sqrt()
}

/// xorshift64*: the tests' own generator (independent of the crate's).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in (-1, 1).
    pub fn sym(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// Architecture variants the tests build.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Variant {
    Llama,
    Qwen2,
    Qwen3,
}

/// A test model: its config and its weights (f32 values; for bf16 checkpoints already
/// rounded to bf16 so the reference sees exactly what the loader sees).
#[derive(Clone)]
pub struct TestModel {
    pub variant: Variant,
    pub vocab: usize,
    pub hidden: usize,
    pub inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub eps: f64,
    pub theta: f64,
    pub linear_factor: Option<f64>,
    pub tied: bool,
    pub weights: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl TestModel {
    pub fn new(variant: Variant, seed: u64, bf16: bool) -> Self {
        let (head_dim, tied, linear_factor) = match variant {
            Variant::Llama => (8, false, None),
            Variant::Qwen2 => (8, true, Some(2.0)),
            Variant::Qwen3 => (16, true, None),
        };
        let mut m = TestModel {
            variant,
            vocab: 96,
            hidden: 32,
            inter: 48,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim,
            eps: 1e-5,
            theta: 10_000.0,
            linear_factor,
            tied,
            weights: BTreeMap::new(),
        };
        let mut rng = Rng::new(seed);
        let (d, q, kv) = (m.hidden, m.heads * head_dim, m.kv_heads * head_dim);
        let mut add = |name: String, shape: Vec<usize>, scale: f64, offset: f64| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|_| {
                    let v = (offset + scale * rng.sym()) as f32;
                    if bf16 {
                        half::bf16::from_f32(v).to_f32()
                    } else {
                        v
                    }
                })
                .collect();
            m.weights.insert(name, (shape, data));
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![m.vocab, d],
            1.0,
            0.0,
        );
        for i in 0..m.layers {
            let p = format!("model.layers.{i}.");
            add(format!("{p}input_layernorm.weight"), vec![d], 0.2, 1.0);
            add(
                format!("{p}post_attention_layernorm.weight"),
                vec![d],
                0.2,
                1.0,
            );
            let s = 1.0 / (d as f64).sqrt();
            add(format!("{p}self_attn.q_proj.weight"), vec![q, d], s, 0.0);
            add(format!("{p}self_attn.k_proj.weight"), vec![kv, d], s, 0.0);
            add(format!("{p}self_attn.v_proj.weight"), vec![kv, d], s, 0.0);
            add(
                format!("{p}self_attn.o_proj.weight"),
                vec![d, q],
                1.0 / (q as f64).sqrt(),
                0.0,
            );
            add(format!("{p}mlp.gate_proj.weight"), vec![m.inter, d], s, 0.0);
            add(format!("{p}mlp.up_proj.weight"), vec![m.inter, d], s, 0.0);
            add(
                format!("{p}mlp.down_proj.weight"),
                vec![d, m.inter],
                1.0 / (m.inter as f64).sqrt(),
                0.0,
            );
            if variant == Variant::Qwen2 {
                add(format!("{p}self_attn.q_proj.bias"), vec![q], 0.3, 0.0);
                add(format!("{p}self_attn.k_proj.bias"), vec![kv], 0.3, 0.0);
                add(format!("{p}self_attn.v_proj.bias"), vec![kv], 0.3, 0.0);
            }
            if variant == Variant::Qwen3 {
                add(
                    format!("{p}self_attn.q_norm.weight"),
                    vec![head_dim],
                    0.2,
                    1.0,
                );
                add(
                    format!("{p}self_attn.k_norm.weight"),
                    vec![head_dim],
                    0.2,
                    1.0,
                );
            }
        }
        add("model.norm.weight".into(), vec![d], 0.2, 1.0);
        if !tied {
            add(
                "lm_head.weight".into(),
                vec![m.vocab, d],
                1.0 / (d as f64).sqrt(),
                0.0,
            );
        }
        m
    }

    pub fn arch(&self) -> &'static str {
        match self.variant {
            Variant::Llama => "LlamaForCausalLM",
            Variant::Qwen2 => "Qwen2ForCausalLM",
            Variant::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    pub fn config_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "architectures": [self.arch()],
            "hidden_size": self.hidden,
            "intermediate_size": self.inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": self.eps,
            "rope_theta": self.theta,
            "max_position_embeddings": 512,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "bos_token_id": 1,
            "eos_token_id": [2, 3],
            "torch_dtype": "float32",
        });
        if self.variant == Variant::Qwen3 {
            v["head_dim"] = self.head_dim.into();
        }
        if let Some(f) = self.linear_factor {
            v["rope_scaling"] = serde_json::json!({"type": "linear", "factor": f});
        }
        v
    }

    fn w(&self, name: &str) -> &[f32] {
        &self.weights[name].1
    }

    /// Independent f64 forward over the whole sequence; returns the logits of every position.
    pub fn reference_logits(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let (d, hd, hq, hkv) = (self.hidden, self.head_dim, self.heads, self.kv_heads);
        let n = tokens.len();
        let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let emb = self.w("model.embed_tokens.weight");
        let mut x: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| f(&emb[t as usize * d..(t as usize + 1) * d]))
            .collect();
        let rms = |v: &[f64], w: &[f32]| -> Vec<f64> {
            let ms = v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64;
            let r = 1.0 / (ms + self.eps).sqrt();
            v.iter().zip(w).map(|(a, &b)| a * r * b as f64).collect()
        };
        let lin = |v: &[f64], w: &[f32], rows: usize| -> Vec<f64> {
            let k = v.len();
            (0..rows)
                .map(|r| (0..k).map(|c| v[c] * w[r * k + c] as f64).sum())
                .collect()
        };
        let rope = |v: &mut [f64], pos: usize| {
            let half = hd / 2;
            for i in 0..half {
                let mut inv = self.theta.powf(-(2.0 * i as f64) / hd as f64);
                if let Some(fac) = self.linear_factor {
                    inv /= fac;
                }
                let (s, c) = (pos as f64 * inv).sin_cos();
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        };
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            let w = |s: &str| self.w(&format!("{p}{s}"));
            let mut ks = vec![vec![0.0; hkv * hd]; n];
            let mut vs = vec![vec![0.0; hkv * hd]; n];
            let mut qs = vec![vec![0.0; hq * hd]; n];
            for t in 0..n {
                let h = rms(&x[t], w("input_layernorm.weight"));
                let mut q = lin(&h, w("self_attn.q_proj.weight"), hq * hd);
                let mut k = lin(&h, w("self_attn.k_proj.weight"), hkv * hd);
                let mut v = lin(&h, w("self_attn.v_proj.weight"), hkv * hd);
                if self.variant == Variant::Qwen2 {
                    for (a, &b) in q.iter_mut().zip(w("self_attn.q_proj.bias")) {
                        *a += b as f64;
                    }
                    for (a, &b) in k.iter_mut().zip(w("self_attn.k_proj.bias")) {
                        *a += b as f64;
                    }
                    for (a, &b) in v.iter_mut().zip(w("self_attn.v_proj.bias")) {
                        *a += b as f64;
                    }
                }
                for hh in 0..hq {
                    let head = &mut q[hh * hd..(hh + 1) * hd];
                    if self.variant == Variant::Qwen3 {
                        let nrm = rms(head, w("self_attn.q_norm.weight"));
                        head.copy_from_slice(&nrm);
                    }
                    rope(head, t);
                }
                for hh in 0..hkv {
                    let head = &mut k[hh * hd..(hh + 1) * hd];
                    if self.variant == Variant::Qwen3 {
                        let nrm = rms(head, w("self_attn.k_norm.weight"));
                        head.copy_from_slice(&nrm);
                    }
                    rope(head, t);
                }
                qs[t] = q;
                ks[t] = k;
                vs[t] = v;
            }
            let group = hq / hkv;
            let scale = 1.0 / (hd as f64).sqrt();
            for t in 0..n {
                let mut attn = vec![0.0; hq * hd];
                for hh in 0..hq {
                    let g = hh / group;
                    let q = &qs[t][hh * hd..(hh + 1) * hd];
                    let scores: Vec<f64> = (0..=t)
                        .map(|j| {
                            let k = &ks[j][g * hd..(g + 1) * hd];
                            scale * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for j in 0..=t {
                        for c in 0..hd {
                            attn[hh * hd + c] += e[j] / z * vs[j][g * hd + c];
                        }
                    }
                }
                let o = lin(&attn, w("self_attn.o_proj.weight"), d);
                for c in 0..d {
                    x[t][c] += o[c];
                }
                let h = rms(&x[t], w("post_attention_layernorm.weight"));
                let g = lin(&h, w("mlp.gate_proj.weight"), self.inter);
                let u = lin(&h, w("mlp.up_proj.weight"), self.inter);
                let act: Vec<f64> = g
                    .iter()
                    .zip(&u)
                    .map(|(a, b)| a / (1.0 + (-a).exp()) * b)
                    .collect();
                let down = lin(&act, w("mlp.down_proj.weight"), d);
                for c in 0..d {
                    x[t][c] += down[c];
                }
            }
        }
        let head = if self.tied {
            self.w("model.embed_tokens.weight")
        } else {
            self.w("lm_head.weight")
        };
        x.iter()
            .map(|row| lin(&rms(row, self.w("model.norm.weight")), head, self.vocab))
            .collect()
    }

    /// Greedy continuation of `prompt` by the reference (argmax, lowest index on ties).
    pub fn reference_greedy(&self, prompt: &[u32], steps: usize) -> Vec<u32> {
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

/// A fresh empty directory under the system temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvserve-model-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Raw {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Raw {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn raw(shape: &[usize], data: &[f32], bf16: bool) -> Raw {
    if bf16 {
        Raw {
            dtype: Dtype::BF16,
            shape: shape.to_vec(),
            bytes: data
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    } else {
        Raw {
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            bytes: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// A minimal WordLevel `tokenizer.json`: tokens `<unk>`, `<s>`, `</s>`, `<eos2>`, then
/// `w4 … w{vocab-1}`, whitespace pre-tokenizer.
pub fn word_level_tokenizer_json(vocab: usize) -> String {
    let mut map = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>", "<eos2>"].iter().enumerate() {
        map.insert(t.to_string(), i.into());
    }
    for i in 4..vocab {
        map.insert(format!("w{i}"), i.into());
    }
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": map, "unk_token": "<unk>"}
    })
    .to_string()
}

/// Writes the model as a Hugging Face directory: `config.json`, `tokenizer.json`,
/// `tokenizer_config.json`, and `model.safetensors` (or two shards plus the index file).
pub fn write_checkpoint(m: &TestModel, dir: &Path, bf16: bool, sharded: bool) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&m.config_json()).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        word_level_tokenizer_json(m.vocab),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>"},
            "chat_template": "{% for m in messages %}<s>{{ m.role }} {{ m.content }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant{% endif %}"
        })
        .to_string(),
    )
    .unwrap();
    write_safetensors(&m.weights, dir, bf16, sharded);
}

/// Writes `weights` as `model.safetensors` (or two shards plus the index file) in `dir`.
pub fn write_safetensors(
    weights: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    dir: &Path,
    bf16: bool,
    sharded: bool,
) {
    let raws: Vec<(String, Raw)> = weights
        .iter()
        .map(|(k, (s, d))| (k.clone(), raw(s, d, bf16)))
        .collect();
    if !sharded {
        let views: Vec<(String, &Raw)> = raws.iter().map(|(k, r)| (k.clone(), r)).collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        return;
    }
    let mut weight_map = serde_json::Map::new();
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    for (shard, file) in names.iter().enumerate() {
        let views: Vec<(String, &Raw)> = raws
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == shard)
            .map(|(_, (k, r))| {
                weight_map.insert(k.clone(), file.to_string().into());
                (k.clone(), r)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
}
