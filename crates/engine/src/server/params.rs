//! The one conversion from an HTTP request's sampling fields to the engine's
//! [`GenerateRequest`], shared by `/generate` (SGLang's `sampling_params`) and the OpenAI
//! endpoints (the same fields at the top level of the body).
//!
//! The endpoints' own structs keep their own fields and collect the rest in a
//! `#[serde(flatten)]` map; [`SamplingFields::from_rest`] reads that map with unknown fields
//! refused and type errors naming the field.

use model::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::{field_error, ApiError};
use super::state::AppState;
use crate::disagg::{Bootstrap, DisaggregationMode};
use crate::engine_loop::GenerateRequest;

/// The most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 64;
/// The longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 1024;
/// The longest cache namespace (`extra_key`, `cache_salt`), in bytes. A salt is an opaque id (a
/// tenant, a user, a hash of either); the prefix cache keeps one root per namespace and hashes
/// the key on every lookup, so keys stay short.
pub const MAX_CACHE_NAMESPACE_BYTES: usize = 256;

/// One value or several (`stop`, `text`, `input_ids`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "expected one value or an array of them")]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    /// The values as a list.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t],
            OneOrMany::Many(v) => v,
        }
    }
}

/// The sampling fields SGLang's `sampling_params` and OpenAI's request bodies share (names as
/// both spell them).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingFields {
    /// `0`: greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: Option<f32>,
    /// `-1`: all tokens.
    pub top_k: Option<i64>,
    /// Minimum probability relative to the most likely token.
    pub min_p: Option<f32>,
    /// HF repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// OpenAI frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// OpenAI presence penalty.
    pub presence_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany<String>>,
    /// Stop token ids (kept in the output).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep going past EOS.
    pub ignore_eos: Option<bool>,
    /// Leave special tokens out of the text (default true).
    pub skip_special_tokens: Option<bool>,
}

impl SamplingFields {
    /// Reads the fields from what an endpoint's struct left over; `prefix` is where the map
    /// sits in the body (`""` for the top level), for error messages.
    pub fn from_rest(rest: Map<String, Value>, prefix: &str) -> Result<Self, ApiError> {
        serde_path_to_error::deserialize(Value::Object(rest)).map_err(|e| {
            let path = match e.path().to_string().as_str() {
                "." => prefix.trim_end_matches('.').to_string(),
                p => format!("{prefix}{p}"),
            };
            let message = e.into_inner().to_string();
            // serde lists only this struct's fields as the expected ones; the endpoint has more.
            match message
                .strip_prefix("unknown field `")
                .and_then(|m| m.split_once('`'))
            {
                Some((field, _)) => ApiError::invalid(
                    format!("{prefix}{field}"),
                    format!("unknown field `{prefix}{field}`"),
                ),
                None => field_error(&path, &message),
            }
        })
    }
}

/// The token limit as the endpoint names it, with its default.
#[derive(Debug, Clone, Copy)]
pub struct MaxTokens {
    /// The value the client gave.
    pub value: Option<usize>,
    /// The field's name (`max_new_tokens`, `max_tokens`, `max_completion_tokens`).
    pub field: &'static str,
    /// When not given: at most this many, or all the room left (`None`).
    pub default: Option<usize>,
}

/// A validated request ready for the engine, with what the HTTP layer keeps for itself.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// What the engine runs.
    pub request: GenerateRequest,
    /// Stop strings (matched by the HTTP layer on the decoded text).
    pub stop_strings: Vec<String>,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
}

/// Validates a request's prefix-cache namespace: SGLang's `extra_key` on `/generate`, vLLM's
/// `cache_salt` on the OpenAI endpoints (`field` names it). Requests share cached prefixes only
/// within one namespace, so tenants that must not learn each other's prompts through cache
/// timing each send their own. `None` (absent or `null`) is the namespace of requests without
/// one; a given key must be a non-empty string of at most [`MAX_CACHE_NAMESPACE_BYTES`] bytes
/// (an empty one is refused, as vLLM does, rather than read as "no salt").
pub fn cache_namespace(key: Option<String>, field: &str) -> Result<Option<String>, ApiError> {
    match key {
        Some(k) if k.is_empty() => Err(ApiError::invalid(
            field,
            format!("{field} must be a non-empty string when given"),
        )),
        Some(k) if k.len() > MAX_CACHE_NAMESPACE_BYTES => Err(ApiError::invalid(
            field,
            format!(
                "{field} may be at most {MAX_CACHE_NAMESPACE_BYTES} bytes, got {}",
                k.len()
            ),
        )),
        k => Ok(k),
    }
}

/// SGLang's PD fields of a request body (`/generate` and the OpenAI endpoints): the router
/// sets all three.
#[derive(Debug, Default, Clone, Deserialize)]
pub struct BootstrapFields {
    /// The prefill server's host.
    pub bootstrap_host: Option<String>,
    /// Its bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// The pair's room id.
    pub bootstrap_room: Option<u64>,
}

impl BootstrapFields {
    /// The request's [`Bootstrap`] on a server of `mode`: a prefill or decode server needs all
    /// three fields (requests reach it through `kvserve router`) and one prompt per request; a
    /// `null`-mode server ignores them, as SGLang's.
    pub fn resolve(
        self,
        mode: DisaggregationMode,
        prompts: usize,
    ) -> Result<Option<Bootstrap>, ApiError> {
        if !mode.is_disaggregated() {
            return Ok(None);
        }
        let (host, port, room) = match (
            self.bootstrap_host,
            self.bootstrap_port,
            self.bootstrap_room,
        ) {
            (Some(h), Some(p), Some(r)) => (h, p, r),
            (h, p, _) => {
                let field = if h.is_none() {
                    "bootstrap_host"
                } else if p.is_none() {
                    "bootstrap_port"
                } else {
                    "bootstrap_room"
                };
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "this server runs --disaggregation-mode {mode}: a request needs bootstrap_host, bootstrap_port and bootstrap_room (send it through `kvserve router --pd-disaggregation`); {field} is missing"
                    ),
                ));
            }
        };
        if host.is_empty()
            || host.len() > 255
            || host.chars().any(|c| c.is_whitespace() || c == '/')
        {
            return Err(ApiError::invalid(
                "bootstrap_host",
                format!("bootstrap_host must be a host name or address, got {host:?}"),
            ));
        }
        if port == 0 {
            return Err(ApiError::invalid(
                "bootstrap_port",
                "bootstrap_port must not be 0",
            ));
        }
        if prompts != 1 {
            return Err(ApiError::invalid(
                "bootstrap_room",
                format!("a disaggregated request carries one prompt (one room), got {prompts}"),
            ));
        }
        Ok(Some(Bootstrap { host, port, room }))
    }
}

/// Checks a prompt and its sampling fields against the model and turns them into a request in
/// the prefix-cache namespace `extra_key` (validated by [`cache_namespace`]).
pub fn prepare(
    s: &AppState,
    ids: Vec<u32>,
    p: &SamplingFields,
    max: MaxTokens,
    extra_key: Option<&str>,
) -> Result<Prepared, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    in_vocabulary(s, &ids, "prompt")?;
    if ids.len() >= s.context_len {
        return Err(ApiError {
            code: "context_length_exceeded",
            ..ApiError::invalid(
                "prompt",
                format!(
                    "the prompt has {} tokens; the context length is {}, which leaves no room to generate",
                    ids.len(),
                    s.context_len
                ),
            )
        });
    }
    let room = s.context_len - ids.len();
    let max_new = max
        .value
        .unwrap_or_else(|| max.default.map_or(room, |d| d.min(room)));
    if max_new == 0 || max_new > room {
        return Err(ApiError::invalid(
            max.field,
            format!(
                "{} must be in 1..={room} for this prompt of {} tokens (context length {}), got {max_new}",
                max.field,
                ids.len(),
                s.context_len
            ),
        ));
    }
    let ignore_eos = p.ignore_eos.unwrap_or(false);
    let mut stop_token_ids = p.stop_token_ids.clone().unwrap_or_default();
    in_vocabulary(s, &stop_token_ids, "stop_token_ids")?;
    if !ignore_eos {
        stop_token_ids.extend(&s.eos_token_ids);
    }
    let top_k = match p.top_k {
        None | Some(-1) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be -1 (all) or positive, got {k}"),
            ))
        }
    };
    let stop_strings = p.stop.clone().map(OneOrMany::into_vec).unwrap_or_default();
    // Every generated token is matched against every stop string on the server's async
    // workers: bound the work (OpenAI itself allows 4 strings).
    if stop_strings.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                stop_strings.len()
            ),
        ));
    }
    if let Some(long) = stop_strings
        .iter()
        .find(|s| s.len() > MAX_STOP_STRING_BYTES)
    {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got one of {}",
                long.len()
            ),
        ));
    }
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
    sampling.validate().map_err(|e| match e {
        model::ModelError::InvalidSampling { field, reason } => {
            let field = if field == "stop_strings" {
                "stop"
            } else {
                field
            };
            ApiError::invalid(field, format!("{field}: {reason}"))
        }
        other => ApiError::bad_request("invalid_value", other.to_string()),
    })?;
    Ok(Prepared {
        request: GenerateRequest {
            input_ids: ids,
            sampling,
            max_new_tokens: max_new,
            ignore_eos,
            priority: 0,
            extra_key: extra_key.map(str::to_string),
            bootstrap: None,
        },
        stop_strings,
        skip_special_tokens: p.skip_special_tokens.unwrap_or(true),
    })
}

/// Refuses token ids the model does not have.
fn in_vocabulary(s: &AppState, ids: &[u32], param: &str) -> Result<(), ApiError> {
    match ids.iter().find(|&&t| t as usize >= s.vocab_size) {
        Some(t) => Err(ApiError::invalid(
            param,
            format!(
                "{param}: token id {t} is outside the vocabulary (0..{})",
                s.vocab_size
            ),
        )),
        None => Ok(()),
    }
}

/// Token ids of `text` (`add_special_tokens` as the tokenizer's post-processor defines).
pub fn encode(s: &AppState, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
    s.tokenizer
        .encode(text, add_special_tokens)
        .map_err(|e| ApiError::invalid("prompt", format!("cannot tokenize the text: {e}")))
}
