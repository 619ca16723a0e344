//! `kvserve serve`: the HTTP API over an [`EngineHandle`] (axum on tokio).
//!
//! Endpoints (SGLang's native API):
//! - `POST /generate`: `text` or `input_ids` (one, or a batch as a list), `sampling_params`
//!   (`max_new_tokens`, `temperature`, `top_p`, `top_k` (−1: all), `min_p`,
//!   `repetition_penalty`, `frequency_penalty`, `presence_penalty`, `seed`, `stop`,
//!   `stop_token_ids`, `ignore_eos`), `stream`. The response has `text`, `output_ids` and
//!   `meta_info` (`id`, `prompt_tokens`, `completion_tokens`, `cached_tokens`,
//!   `finish_reason`, `e2e_latency`). Streaming sends server-sent events, each the response so
//!   far, then `data: [DONE]`.
//! - `GET /health`, `GET /get_model_info`, `GET /get_server_info` (pool and cache state, with
//!   the ownership check when idle), `POST /flush_cache`, `GET /v1/models`.
//!
//! Bad input is a 400 with `{"error": {"message", "type"}}`; a full queue is a 503. A client
//! that disconnects mid-stream drops its event channel, and the engine aborts the request and
//! frees its KV. The OpenAI-compatible completion endpoints come next.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use model::{SamplingParams, Tokenizer};
use scheduler::FinishReason;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine_loop::{EngineHandle, Event, Finished, GenerateRequest};

/// What the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// Model name for `/v1/models` and `/get_model_info`.
    pub model_name: String,
    /// Longest prompt + output.
    pub context_len: usize,
    /// Vocabulary size of the model (token ids must be below it).
    pub vocab_size: usize,
    /// EOS token ids (stop unless `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
}

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/flush_cache", post(flush_cache))
        .route("/v1/models", get(models))
        .route("/generate", post(generate))
        .with_state(state)
}

/// An API error: status and message.
#[derive(Debug)]
pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.0 == StatusCode::SERVICE_UNAVAILABLE {
            "server_busy"
        } else {
            "invalid_request_error"
        };
        (
            self.0,
            Json(json!({"error": {"message": self.1, "type": kind, "code": self.0.as_u16()}})),
        )
            .into_response()
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

async fn model_info(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"model_path": s.model_name, "is_generation": true, "context_length": s.context_len, "vocab_size": s.vocab_size}),
    )
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model_name, "object": "model", "owned_by": "kvserve", "max_model_len": s.context_len}]}),
    )
}

async fn server_info(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let st = s.clone();
    let info = tokio::task::spawn_blocking(move || st.engine.info())
        .await
        .ok()
        .flatten()
        .ok_or(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is stopped".into(),
        ))?;
    Ok(Json(
        json!({"engine": info, "context_length": s.context_len}),
    ))
}

async fn flush_cache(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let st = s.clone();
    match tokio::task::spawn_blocking(move || st.engine.flush_cache()).await {
        Ok(Ok(())) => Ok(Json(json!({"success": true}))),
        Ok(Err(e)) => Err(ApiError(StatusCode::CONFLICT, e)),
        Err(e) => Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
    }
}

/// `text` / `input_ids`: one prompt or a batch.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopStrings {
    One(String),
    Many(Vec<String>),
}

/// SGLang's `sampling_params`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ApiSampling {
    max_new_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopStrings>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    #[serde(default)]
    skip_special_tokens: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateBody {
    text: Option<OneOrMany<String>>,
    input_ids: Option<OneOrMany<Vec<u32>>>,
    #[serde(default)]
    sampling_params: ApiSampling,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    rid: Option<Value>,
}

/// A validated request ready for the engine, with what the HTTP layer keeps for itself.
struct Prepared {
    request: GenerateRequest,
    stop_strings: Vec<String>,
}

fn prepare(s: &AppState, ids: Vec<u32>, p: &ApiSampling) -> Result<Prepared, ApiError> {
    if ids.is_empty() {
        return Err(bad("the prompt is empty"));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= s.vocab_size) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary (0..{})",
            s.vocab_size
        )));
    }
    if ids.len() >= s.context_len {
        return Err(bad(format!(
            "the prompt has {} tokens; the context length is {}",
            ids.len(),
            s.context_len
        )));
    }
    let room = s.context_len - ids.len();
    let max_new = p.max_new_tokens.unwrap_or(128.min(room));
    if max_new == 0 || max_new > room {
        return Err(bad(format!(
            "max_new_tokens must be in 1..={room} for this prompt (context length {})",
            s.context_len
        )));
    }
    let ignore_eos = p.ignore_eos.unwrap_or(false);
    let mut stop_token_ids = p.stop_token_ids.clone().unwrap_or_default();
    if !ignore_eos {
        stop_token_ids.extend(&s.eos_token_ids);
    }
    let top_k = match p.top_k {
        None | Some(-1) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(k) => return Err(bad(format!("top_k must be -1 (all) or positive, got {k}"))),
    };
    let stop_strings = match &p.stop {
        None => Vec::new(),
        Some(StopStrings::One(s)) => vec![s.clone()],
        Some(StopStrings::Many(v)) => v.clone(),
    };
    let d = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: p.temperature.unwrap_or(d.temperature),
        top_k,
        top_p: p.top_p.unwrap_or(d.top_p),
        min_p: p.min_p.unwrap_or(d.min_p),
        repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        seed: p.seed,
        stop_token_ids,
        stop_strings: stop_strings.clone(),
    };
    sampling.validate().map_err(|e| bad(e.to_string()))?;
    let _ = p.skip_special_tokens;
    Ok(Prepared {
        request: GenerateRequest {
            input_ids: ids,
            sampling,
            max_new_tokens: max_new,
            ignore_eos,
            priority: 0,
        },
        stop_strings,
    })
}

/// A request's progress as the HTTP layer sees it.
struct Progress {
    ids: Vec<u32>,
    text: String,
    finish: Option<Value>,
    meta: Option<Finished>,
    stopped_on: Option<String>,
}

impl Progress {
    fn new() -> Self {
        Progress {
            ids: Vec::new(),
            text: String::new(),
            finish: None,
            meta: None,
            stopped_on: None,
        }
    }

    /// Applies an event; returns `Err` for a rejection.
    fn apply(&mut self, s: &AppState, ev: Event, stops: &[String]) -> Result<(), ApiError> {
        match ev {
            Event::Tokens(t) => {
                self.ids.extend(t);
                self.text = s.tokenizer.decode(&self.ids, true).unwrap_or_default();
                if let Some((pos, stop)) = stops
                    .iter()
                    .filter_map(|st| self.text.find(st.as_str()).map(|p| (p, st)))
                    .min()
                {
                    self.text.truncate(pos);
                    self.stopped_on = Some(stop.clone());
                    self.finish = Some(json!({"type": "stop", "matched": stop}));
                }
            }
            Event::Finished(f) => {
                if self.finish.is_none() {
                    self.finish = Some(match &f.reason {
                        FinishReason::Length { length } => {
                            json!({"type": "length", "length": length})
                        }
                        FinishReason::Stop { token } => json!({"type": "stop", "matched": token}),
                        FinishReason::Abort { message } => {
                            json!({"type": "abort", "message": message})
                        }
                    });
                }
                self.meta = Some(f);
            }
            Event::Rejected(m) => {
                let status = if m.contains("queue is full") {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::BAD_REQUEST
                };
                return Err(ApiError(status, m));
            }
        }
        Ok(())
    }

    fn done(&self) -> bool {
        self.meta.is_some() || self.stopped_on.is_some()
    }

    fn json(&self, rid: &Value, prompt_len: usize) -> Value {
        let m = self.meta.as_ref();
        json!({
            "text": self.text,
            "output_ids": self.ids,
            "meta_info": {
                "id": m.map_or(rid.clone(), |m| if rid.is_null() { json!(m.id.to_string()) } else { rid.clone() }),
                "prompt_tokens": m.map_or(prompt_len, |m| m.prompt_tokens),
                "completion_tokens": self.ids.len(),
                "cached_tokens": m.map_or(0, |m| m.cached_tokens),
                "finish_reason": self.finish,
                "e2e_latency": m.map_or(0.0, |m| m.e2e_latency_s),
            }
        })
    }
}

/// Forwards the engine's (blocking) stream into an async channel. When the async side goes
/// away, the forwarder drops the engine stream, which makes the engine abort the request.
fn forward_events(stream: crate::engine_loop::RequestStream) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::task::spawn_blocking(move || {
        for ev in stream {
            if tx.send(ev).is_err() {
                break;
            }
        }
    });
    rx
}

async fn generate(
    State(s): State<Arc<AppState>>,
    body: Result<Json<GenerateBody>, axum::extract::rejection::JsonRejection>,
) -> Response {
    match generate_inner(s, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(
    s: Arc<AppState>,
    body: Result<Json<GenerateBody>, axum::extract::rejection::JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body.map_err(|e| bad(e.body_text()))?;
    let (prompts, batch): (Vec<Vec<u32>>, bool) = match (body.text, body.input_ids) {
        (Some(_), Some(_)) => return Err(bad("give either text or input_ids, not both")),
        (None, None) => return Err(bad("give text or input_ids")),
        (Some(OneOrMany::One(t)), None) => (vec![encode(&s, &t)?], false),
        (Some(OneOrMany::Many(ts)), None) => (
            ts.iter().map(|t| encode(&s, t)).collect::<Result<_, _>>()?,
            true,
        ),
        (None, Some(OneOrMany::One(ids))) => (vec![ids], false),
        (None, Some(OneOrMany::Many(ids))) => (ids, true),
    };
    if prompts.is_empty() {
        return Err(bad("the batch is empty"));
    }
    let prepared: Vec<Prepared> = prompts
        .into_iter()
        .map(|ids| prepare(&s, ids, &body.sampling_params))
        .collect::<Result<_, _>>()?;
    let rid = body.rid.unwrap_or(Value::Null);
    if body.stream {
        if batch {
            return Err(bad("streaming takes one prompt at a time"));
        }
        let p = prepared.into_iter().next().expect("one prompt");
        let prompt_len = p.request.input_ids.len();
        let mut rx = forward_events(s.engine.submit(p.request));
        // Wait for the first event so a rejection is a proper 4xx/503, not a stream.
        let first = rx.recv().await.ok_or(ApiError(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is stopped".into(),
        ))?;
        let mut progress = Progress::new();
        progress.apply(&s, first, &p.stop_strings)?;
        let state = (s, rx, progress, p.stop_strings, rid, prompt_len, false);
        let events = stream::unfold(
            state,
            |(s, mut rx, mut progress, stops, rid, prompt_len, finished)| async move {
                if finished {
                    return None;
                }
                if progress.done() {
                    let ev = SseEvent::default().data(progress.json(&rid, prompt_len).to_string());
                    let done = SseEvent::default().data("[DONE]");
                    // Emit the final chunk, then [DONE] (after which the stream ends).
                    return Some((
                        vec![ev, done],
                        (s, rx, progress, stops, rid, prompt_len, true),
                    ));
                }
                let chunk = SseEvent::default().data(progress.json(&rid, prompt_len).to_string());
                match rx.recv().await {
                    Some(ev) => {
                        let _ = progress.apply(&s, ev, &stops);
                        Some((
                            vec![chunk],
                            (s, rx, progress, stops, rid, prompt_len, false),
                        ))
                    }
                    None => Some((vec![chunk], (s, rx, progress, stops, rid, prompt_len, true))),
                }
            },
        );
        let flat = flatten(events);
        return Ok(Sse::new(flat).into_response());
    }
    let mut outputs = Vec::with_capacity(prepared.len());
    let mut receivers = Vec::with_capacity(prepared.len());
    for p in prepared {
        let len = p.request.input_ids.len();
        receivers.push((
            forward_events(s.engine.submit(p.request)),
            p.stop_strings,
            len,
        ));
    }
    for (mut rx, stops, len) in receivers {
        let mut progress = Progress::new();
        while let Some(ev) = rx.recv().await {
            progress.apply(&s, ev, &stops)?;
            if progress.done() {
                break;
            }
        }
        outputs.push(progress.json(&rid, len));
    }
    Ok(Json(if batch {
        Value::Array(outputs)
    } else {
        outputs.remove(0)
    })
    .into_response())
}

fn flatten(
    s: impl Stream<Item = Vec<SseEvent>> + Send + 'static,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> + Send + 'static {
    use futures_util::StreamExt;
    s.flat_map(|v| stream::iter(v.into_iter().map(Ok)))
}

fn encode(s: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    s.tokenizer
        .encode(text, true)
        .map_err(|e| bad(format!("cannot tokenize the text: {e}")))
}

/// Serves `state` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
