//! OpenAI-compatible `POST /v1/completions` and `POST /v1/chat/completions` (as vLLM and
//! SGLang serve them).
//!
//! Both read one body type: `model` (echoed back), `prompt` (completions: a string, an array
//! of strings, an array of token ids or an array of such arrays) or `messages` (chat),
//! `max_tokens` (chat also `max_completion_tokens`), `n` (1 only), `stream`,
//! `stream_options.include_usage`, `echo` (completions), `user`, `cache_salt` (vLLM's: a
//! string naming the request's prefix-cache namespace, see [`cache_namespace`]), and the
//! sampling fields shared with `/generate` ([`SamplingFields`]: `temperature`, `top_p`,
//! `top_k`, `min_p`, penalties, `seed`, `stop`, `stop_token_ids`, `ignore_eos`). `logprobs`
//! and `top_logprobs` are refused (400) rather than ignored; unknown fields too.
//!
//! Defaults as OpenAI / SGLang: completions generate at most 16 tokens, chat up to the
//! context length; temperature 1.
//!
//! Responses are OpenAI's objects (`text_completion`, `chat.completion`) with `usage`
//! including `prompt_tokens_details.cached_tokens`. Streaming sends `text_completion` /
//! `chat.completion.chunk` chunks (the first chat chunk carries `delta.role`), a last chunk
//! with `finish_reason`, a usage chunk with `stream_options.include_usage`, then
//! `data: [DONE]`.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::chat::Message;
use super::error::{ApiError, JsonBody};
use super::params::{
    cache_namespace, encode, prepare, BootstrapFields, MaxTokens, OneOrMany, Prepared,
    SamplingFields,
};
use super::state::AppState;
use super::stream::{sse, ChunkFormat, Generation, RequestRun};

/// `max_tokens` of `/v1/completions` when the request does not say (OpenAI's default).
const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// The body of both endpoints (see the module docs).
#[derive(Debug, Deserialize)]
pub struct OpenAiBody {
    model: Option<String>,
    prompt: Option<Prompt>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    n: Option<usize>,
    best_of: Option<usize>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logprobs: Option<Value>,
    top_logprobs: Option<usize>,
    echo: Option<bool>,
    #[allow(dead_code)]
    user: Option<String>,
    /// vLLM's prefix-cache namespace ([`cache_namespace`]).
    cache_salt: Option<String>,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u16>,
    bootstrap_room: Option<u64>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// `prompt`.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "expected a string, an array of strings, an array of token ids or an array of arrays of token ids"
)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Which endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Completions,
    Chat,
}

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<Arc<AppState>>,
    JsonBody(body): JsonBody<OpenAiBody>,
) -> Result<Response, ApiError> {
    respond(s, body, Endpoint::Completions).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(s): State<Arc<AppState>>,
    JsonBody(body): JsonBody<OpenAiBody>,
) -> Result<Response, ApiError> {
    respond(s, body, Endpoint::Chat).await
}

/// A prompt ready to run, with the text `echo` puts before the completion.
struct Job {
    prepared: Prepared,
    echo: Option<String>,
}

async fn respond(s: Arc<AppState>, body: OpenAiBody, ep: Endpoint) -> Result<Response, ApiError> {
    let stream = body.stream.unwrap_or(false);
    let include_usage = match (&body.stream_options, stream) {
        (Some(_), false) => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ))
        }
        (Some(o), true) => o.include_usage,
        (None, _) => false,
    };
    let (jobs, model) = jobs(&s, body, ep)?;
    let reply = Reply::new(ep, model.unwrap_or_else(|| s.model_name.clone()));
    if stream {
        let [job] = <[Job; 1]>::try_from(jobs)
            .map_err(|_| ApiError::unsupported("prompt", "streaming takes one prompt at a time"))?;
        let run = RequestRun::start(&s, job.prepared).await?;
        return Ok(sse(
            run,
            OpenAiStream {
                reply,
                include_usage,
                opened: false,
                echo: job.echo,
            },
        ));
    }
    let (prepared, echoes): (Vec<_>, Vec<_>) =
        jobs.into_iter().map(|j| (j.prepared, j.echo)).unzip();
    let runs = RequestRun::start_all(&s, prepared)
        .await?
        .into_iter()
        .zip(echoes);
    let mut choices = Vec::with_capacity(runs.len());
    let mut usage = Usage::default();
    for (i, (run, echo)) in runs.enumerate() {
        let g = run.collect().await;
        usage.add(&g);
        let text = echo.unwrap_or_default() + &g.text;
        let content = match ep {
            Endpoint::Completions => json!(text),
            Endpoint::Chat => json!({"role": "assistant", "content": text}),
        };
        choices.push(reply.choice(false, i, content, finish_reason(&g)));
    }
    Ok(Json(reply.object(false, choices, Some(usage.json()))).into_response())
}

/// A prompt's token ids and, when the client sent text, the text (for `echo`).
type PromptInput = (Vec<u32>, Option<String>);

/// Checks the endpoint-specific fields and turns the prompts into jobs; also returns the
/// request's `model`.
fn jobs(
    s: &AppState,
    body: OpenAiBody,
    ep: Endpoint,
) -> Result<(Vec<Job>, Option<String>), ApiError> {
    check_unsupported(&body, ep)?;
    let wrong = |field: &str| {
        let (this, other) = match ep {
            Endpoint::Completions => ("/v1/completions", "/v1/chat/completions"),
            Endpoint::Chat => ("/v1/chat/completions", "/v1/completions"),
        };
        ApiError::invalid(
            field,
            format!("`{field}` is not a field of {this} (it belongs to {other})"),
        )
    };
    let mut fields = SamplingFields::from_rest(body.rest, "")?;
    let (prompts, max, echo): (Vec<PromptInput>, MaxTokens, bool) = match ep {
        Endpoint::Completions => {
            if body.messages.is_some() {
                return Err(wrong("messages"));
            }
            if body.max_completion_tokens.is_some() {
                return Err(wrong("max_completion_tokens"));
            }
            let prompts = match body.prompt {
                None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
                Some(Prompt::Text(t)) => vec![(encode(s, &t, true)?, Some(t))],
                Some(Prompt::Texts(ts)) => ts
                    .into_iter()
                    .map(|t| Ok((encode(s, &t, true)?, Some(t))))
                    .collect::<Result<_, ApiError>>()?,
                Some(Prompt::Ids(ids)) => vec![(ids, None)],
                Some(Prompt::IdBatch(b)) => b.into_iter().map(|ids| (ids, None)).collect(),
            };
            let max = MaxTokens {
                value: body.max_tokens,
                field: "max_tokens",
                default: Some(DEFAULT_COMPLETION_MAX_TOKENS),
            };
            (prompts, max, body.echo.unwrap_or(false))
        }
        Endpoint::Chat => {
            if body.prompt.is_some() {
                return Err(wrong("prompt"));
            }
            if body.echo.is_some() {
                return Err(ApiError::unsupported(
                    "echo",
                    "echo is not supported by /v1/chat/completions",
                ));
            }
            let messages = body
                .messages
                .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
            let text = s.chat.render(&messages)?;
            let mut stops = fields
                .stop
                .take()
                .map(OneOrMany::into_vec)
                .unwrap_or_default();
            stops.extend(s.chat.stop_strings().iter().map(|t| t.to_string()));
            fields.stop = (!stops.is_empty()).then_some(OneOrMany::Many(stops));
            let max = match body.max_completion_tokens {
                Some(v) => MaxTokens {
                    value: Some(v),
                    field: "max_completion_tokens",
                    default: None,
                },
                None => MaxTokens {
                    value: body.max_tokens,
                    field: "max_tokens",
                    default: None,
                },
            };
            (vec![(encode(s, &text, false)?, None)], max, false)
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let salt = cache_namespace(body.cache_salt, "cache_salt")?;
    let bootstrap = BootstrapFields {
        bootstrap_host: body.bootstrap_host,
        bootstrap_port: body.bootstrap_port,
        bootstrap_room: body.bootstrap_room,
    }
    .resolve(s.disaggregation_mode, prompts.len())?;
    let jobs = prompts
        .into_iter()
        .map(|(ids, text)| {
            let echo = match (echo, text) {
                (false, _) => None,
                (true, Some(t)) => Some(t),
                (true, None) => Some(s.tokenizer.decode(&ids, true).unwrap_or_default()),
            };
            let mut prepared = prepare(s, ids, &fields, max, salt.as_deref())?;
            prepared.request.bootstrap = bootstrap.clone();
            Ok(Job { prepared, echo })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok((jobs, body.model))
}

/// Refuses what this server does not implement, rather than ignoring it.
fn check_unsupported(body: &OpenAiBody, ep: Endpoint) -> Result<(), ApiError> {
    match body.n {
        None | Some(1) => {}
        Some(0) => return Err(ApiError::invalid("n", "n must be at least 1")),
        Some(_) => {
            return Err(ApiError::unsupported(
                "n",
                "n > 1 is not supported; send n requests (with different seeds) instead",
            ))
        }
    }
    if body.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::unsupported(
            "best_of",
            "best_of > 1 is not supported",
        ));
    }
    let wants_logprobs = match (&body.logprobs, ep) {
        (None | Some(Value::Null), _) | (Some(Value::Bool(false)), Endpoint::Chat) => false,
        (Some(Value::Bool(true)), Endpoint::Chat)
        | (Some(Value::Number(_)), Endpoint::Completions) => true,
        (Some(v), _) => {
            let want = match ep {
                Endpoint::Chat => "a boolean",
                Endpoint::Completions => "an integer",
            };
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs`: expected {want}, got {v}"),
            ));
        }
    };
    if wants_logprobs || body.top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::unsupported(
            if wants_logprobs {
                "logprobs"
            } else {
                "top_logprobs"
            },
            "logprobs are not supported by this server; leave logprobs and top_logprobs unset",
        ));
    }
    Ok(())
}

/// Summed usage of a request's prompts.
#[derive(Debug, Default)]
struct Usage {
    prompt: usize,
    completion: usize,
    cached: usize,
}

impl Usage {
    fn of(g: &Generation) -> Self {
        Usage {
            prompt: g.prompt_tokens,
            completion: g.completion_tokens(),
            cached: g.cached_tokens(),
        }
    }

    fn add(&mut self, g: &Generation) {
        let u = Usage::of(g);
        self.prompt += u.prompt;
        self.completion += u.completion;
        self.cached += u.cached;
    }

    fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// What every response object of one request shares: endpoint, id, creation time, model.
#[derive(Debug)]
struct Reply {
    ep: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Reply {
    fn new(ep: Endpoint, model: String) -> Self {
        let prefix = match ep {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        };
        Reply {
            ep,
            id: format!("{prefix}-{}", random_hex()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model,
        }
    }

    /// A response object (`chunk`: a stream chunk) with these choices and usage.
    fn object(&self, chunk: bool, choices: Vec<Value>, usage: Option<Value>) -> Value {
        let object = match (self.ep, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }

    /// One choice: `content` is the `text` (completions), the `message` (chat) or the `delta`
    /// (chat chunks).
    fn choice(&self, chunk: bool, index: usize, content: Value, finish: Option<&str>) -> Value {
        let key = match (self.ep, chunk) {
            (Endpoint::Completions, _) => "text",
            (Endpoint::Chat, false) => "message",
            (Endpoint::Chat, true) => "delta",
        };
        let mut c = json!({"index": index, "logprobs": null, "finish_reason": finish});
        c[key] = content;
        c
    }
}

fn random_hex() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let a = h.finish();
    h.write_u64(a);
    format!("{a:016x}{:016x}", h.finish())
}

fn finish_reason(g: &Generation) -> Option<&'static str> {
    g.finish.as_ref().map(|f| f.openai_reason())
}

/// The OpenAI stream: role chunk (chat), text deltas, the finish chunk, the usage chunk.
struct OpenAiStream {
    reply: Reply,
    include_usage: bool,
    opened: bool,
    echo: Option<String>,
}

impl OpenAiStream {
    fn chunk(&self, content: Value, finish: Option<&str>) -> Value {
        let usage = self.include_usage.then_some(Value::Null);
        self.reply.object(
            true,
            vec![self.reply.choice(true, 0, content, finish)],
            usage,
        )
    }

    fn text(&self, text: String) -> Value {
        match self.reply.ep {
            Endpoint::Completions => json!(text),
            Endpoint::Chat => json!({"content": text}),
        }
    }
}

impl ChunkFormat for OpenAiStream {
    fn chunks(&mut self, g: &mut Generation) -> Vec<Value> {
        let mut out = Vec::new();
        if !std::mem::replace(&mut self.opened, true) && self.reply.ep == Endpoint::Chat {
            out.push(self.chunk(json!({"role": "assistant", "content": ""}), None));
        }
        let delta = self.echo.take().unwrap_or_default() + &g.take_delta();
        if !delta.is_empty() {
            out.push(self.chunk(self.text(delta), None));
        }
        if g.done() {
            let empty = match self.reply.ep {
                Endpoint::Completions => json!(""),
                Endpoint::Chat => json!({}),
            };
            out.push(self.chunk(empty, finish_reason(g)));
            if self.include_usage {
                out.push(self.reply.object(true, vec![], Some(Usage::of(g).json())));
            }
        }
        out
    }
}
