//! # model — decoder models, checkpoints, tokenizers and sampling for kvserve
//!
//! What it provides:
//! - [`ModelConfig`]: a Hugging Face `config.json` of the Llama family (Llama 2/3, SmolLM,
//!   Mistral, Qwen2/2.5 with q/k/v biases, Qwen3 with q/k norm) or DeepSeek-V2 (MLA and MoE
//!   fields in [`MlaConfig`] / [`MoeConfig`]), parsed field by field.
//! - [`SafetensorsCheckpoint`]: a single or sharded (index file) safetensors checkpoint,
//!   memory-mapped, bf16 / f16 / f32 converted to the backend's f32 upload (matrices through
//!   `Backend::upload_weight` with their stored type, which a backend may keep: the CPU
//!   backend keeps bf16 / f16 matrices in 16 bits); [`TensorMap`] for weights in memory.
//! - [`LlamaModel`] and [`MlaModel`] (DeepSeek-V2-Lite shape: absorbed multi-head latent
//!   attention over the MLA store, dense and MoE MLPs): decoders on any [`attention::Backend`],
//!   unified by [`Model`]; and [`ModelRunner`], which owns a backend, a model and the paged
//!   KV store and runs one forward per batch
//!   ([`ForwardInput`]: per request its new token ids and the slots of all its positions),
//!   decode batches through the backend's captured graphs when it has them
//!   ([`ModelRunner::enable_decode_graphs`] with an [`attention::DecodeGraphs`]: CUDA graphs),
//!   bitwise the eager forward's logits on the emulated CUDA device.
//! - [`Tokenizer`] (HF `tokenizer.json` or built-in tiktoken), [`IncrementalDecoder`]
//!   (streaming text that never splits a UTF-8 character), [`ChatTemplate`] (Jinja templates
//!   from `tokenizer_config.json`).
//! - [`Sampler`] / [`SamplingParams`]: greedy, temperature, top-k, top-p, min-p, repetition /
//!   frequency / presence penalties, per-request seeds, stop ids and strings.
//! - The built-in `tiny` preset ([`tiny`]): seeded random weights and the `r50k_base`
//!   vocabulary, so the engine runs with nothing downloaded; [`greedy_check`], the tiny
//!   models' greedy schedule a GPU backend's tests compare with the CPU backend's.
//!
//! ## Invariants
//! - Bad input (malformed config, missing or mis-shaped tensor, truncated file, unsupported
//!   architecture, bad sampling parameter, inconsistent batch) is a typed [`ModelError`] that
//!   names the field or tensor, never a panic.
//! - A checkpoint is validated (every expected tensor present with the expected shape) before
//!   anything is uploaded.
//! - The forward pass writes K/V only at the slots its input gives for new tokens and reads
//!   every position through the page table, so results depend only on the token history, not
//!   on slot placement, chunking or prefix caching (bitwise on a batch-invariant backend).
//! - Sampling is a pure function of logits, history and the request's seeded generator.
//!
//! ## Where it sits
//! model depends on attention (the backend traits and batch metadata) and kv-pool (slots and
//! layouts). It does not know the scheduler: the engine adapts the scheduler's `ForwardBatch`
//! into a [`ForwardInput`] and feeds sampled tokens back.

pub mod config;
pub mod decoder;
pub mod error;
pub mod greedy_check;
mod layers;
pub mod llama;
pub mod mla;
pub mod runner;
pub mod sampling;
pub mod tiny;
pub mod tokenizer;
pub mod weights;

use std::path::Path;

use attention::Backend;

pub use config::{Architecture, MlaConfig, ModelConfig, MoeConfig};
pub use decoder::Model;
pub use error::{ModelError, Result};
pub use llama::{expected_tensors, LlamaModel, LogitsMode};
pub use mla::{mla_expected_tensors, MlaModel};
pub use runner::{AttentionMode, ForwardInput, ForwardRequest, LogitsOutput, ModelRunner};
pub use sampling::{
    apply_penalties, argmax, check_logits, check_stop, greedy, stop_string_holdback, Sampler,
    SamplingParams, SplitMix64, StopReason,
};
pub use tokenizer::{ChatMessage, ChatTemplate, IncrementalDecoder, TiktokenEncoding, Tokenizer};
pub use weights::{HostTensor, SafetensorsCheckpoint, TensorMap, TensorSource};

/// Loads the model in the Hugging Face directory `dir` (`config.json` and
/// `model.safetensors` or its sharded form with `model.safetensors.index.json`) onto
/// `backend`: a Llama-family decoder or, for `DeepseekV2ForCausalLM`, the MLA decoder.
pub fn load_model_dir<B: Backend>(backend: &B, dir: &Path) -> Result<Model<B>> {
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let ckpt = SafetensorsCheckpoint::open_dir(dir)?;
    Model::load(backend, config, &ckpt)
}

/// Loads `tokenizer.json` from the model directory `dir`, and the chat template of its
/// `tokenizer_config.json` if there is one.
pub fn load_tokenizer_dir(dir: &Path) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let cfg = dir.join("tokenizer_config.json");
    let template = if cfg.exists() {
        let text = std::fs::read_to_string(&cfg).map_err(|source| ModelError::Io {
            path: cfg.display().to_string(),
            source,
        })?;
        ChatTemplate::from_tokenizer_config(&text)?
    } else {
        None
    };
    Ok((tok, template))
}
