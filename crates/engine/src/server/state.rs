//! [`AppState`]: what every handler of the server shares.

use std::sync::Arc;

use model::Tokenizer;
use serde_json::Value;

use super::chat::ChatPrompt;
use super::metrics::ServerMetrics;
use crate::engine_loop::EngineHandle;

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    pub engine: EngineHandle,
    /// The effective settings (SGLang's server-argument names), a JSON object that
    /// `/get_server_info` answers with.
    pub server_args: Value,
    pub tokenizer: Tokenizer,
    /// The chat template (the model's, or the ChatML fallback).
    pub chat: ChatPrompt,
    /// Model name for `/v1/models` and `/get_model_info`.
    pub model_name: String,
    /// Longest prompt + output.
    pub context_len: usize,
    /// Vocabulary size of the model (token ids must be below it).
    pub vocab_size: usize,
    /// EOS token ids (stop unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// `--api-key`: required on every endpoint but `/health` when set.
    pub api_key: Option<String>,
    /// Request counters and latency histograms.
    pub metrics: Arc<ServerMetrics>,
    /// `--disaggregation-mode`: prefill and decode servers take requests only with bootstrap
    /// fields.
    pub disaggregation_mode: crate::disagg::DisaggregationMode,
}
