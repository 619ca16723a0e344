//! SGLang's native `POST /generate`: `text` or `input_ids` (one, or a batch as a list),
//! `sampling_params` (`max_new_tokens` and the [`SamplingFields`]), `stream`, `rid`, and
//! `extra_key` (a string: the prefix-cache namespace, see [`cache_namespace`]). The
//! response has `text`, `output_ids` and `meta_info` (`id`, `prompt_tokens`,
//! `completion_tokens`, `cached_tokens`, `finish_reason`, `e2e_latency`). Streaming sends
//! server-sent events, each the response so far, then `data: [DONE]`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::{ApiError, JsonBody};
use super::params::{
    cache_namespace, encode, prepare, BootstrapFields, MaxTokens, OneOrMany, Prepared,
    SamplingFields,
};
use super::state::AppState;
use super::stream::{sse, ChunkFormat, Generation, RequestRun};

/// `max_new_tokens` when the request does not say.
const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// SGLang's `sampling_params`: `max_new_tokens` and the shared fields.
#[derive(Debug, Default, Deserialize)]
struct GenerateSampling {
    max_new_tokens: Option<usize>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// The body of `/generate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    text: Option<OneOrMany<String>>,
    input_ids: Option<OneOrMany<Vec<u32>>>,
    #[serde(default)]
    sampling_params: GenerateSampling,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    rid: Option<Value>,
    #[serde(default)]
    extra_key: Option<String>,
    #[serde(default)]
    bootstrap_host: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
    #[serde(default)]
    bootstrap_room: Option<u64>,
}

/// `POST /generate`.
pub async fn generate(
    State(s): State<Arc<AppState>>,
    JsonBody(body): JsonBody<GenerateBody>,
) -> Result<Response, ApiError> {
    let (prompts, batch): (Vec<Vec<u32>>, bool) = match (body.text, body.input_ids) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "text",
                "give either text or input_ids, not both",
            ))
        }
        (None, None) => return Err(ApiError::invalid("text", "give text or input_ids")),
        (Some(OneOrMany::One(t)), None) => (vec![encode(&s, &t, true)?], false),
        (Some(OneOrMany::Many(ts)), None) => (
            ts.iter()
                .map(|t| encode(&s, t, true))
                .collect::<Result<_, _>>()?,
            true,
        ),
        (None, Some(OneOrMany::One(ids))) => (vec![ids], false),
        (None, Some(OneOrMany::Many(ids))) => (ids, true),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("text", "the batch is empty"));
    }
    let fields = SamplingFields::from_rest(body.sampling_params.rest, "sampling_params.")?;
    let max = MaxTokens {
        value: body.sampling_params.max_new_tokens,
        field: "max_new_tokens",
        default: Some(DEFAULT_MAX_NEW_TOKENS),
    };
    let extra_key = cache_namespace(body.extra_key, "extra_key")?;
    let bootstrap = BootstrapFields {
        bootstrap_host: body.bootstrap_host,
        bootstrap_port: body.bootstrap_port,
        bootstrap_room: body.bootstrap_room,
    }
    .resolve(s.disaggregation_mode, prompts.len())?;
    let prepared: Vec<Prepared> = prompts
        .into_iter()
        .map(|ids| {
            let mut p = prepare(&s, ids, &fields, max, extra_key.as_deref())?;
            p.request.bootstrap = bootstrap.clone();
            Ok(p)
        })
        .collect::<Result<_, ApiError>>()?;
    let rid = body.rid.unwrap_or(Value::Null);
    if body.stream {
        let [p] = <[Prepared; 1]>::try_from(prepared)
            .map_err(|_| ApiError::invalid("stream", "streaming takes one prompt at a time"))?;
        let run = RequestRun::start(&s, p).await?;
        return Ok(sse(run, Cumulative { rid, sent: None }));
    }
    let runs = RequestRun::start_all(&s, prepared).await?;
    let mut outputs = Vec::with_capacity(runs.len());
    for run in runs {
        outputs.push(response(&run.collect().await, &rid));
    }
    Ok(Json(if batch {
        Value::Array(outputs)
    } else {
        outputs.remove(0)
    })
    .into_response())
}

/// The response (or, streaming, the response so far).
fn response(g: &Generation, rid: &Value) -> Value {
    let m = g.meta.as_ref();
    let id = match (rid, m) {
        (Value::Null, Some(m)) => json!(m.id.to_string()),
        _ => rid.clone(),
    };
    json!({
        "text": g.text,
        "output_ids": g.ids,
        "meta_info": {
            "id": id,
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens(),
            "cached_tokens": g.cached_tokens(),
            "finish_reason": g.finish.as_ref().map(|f| f.sglang_json()),
            "e2e_latency": m.map_or(0.0, |m| m.e2e_latency_s),
        }
    })
}

/// SGLang's stream: every chunk is the whole response so far.
struct Cumulative {
    rid: Value,
    /// (ids, text bytes) at the last chunk.
    sent: Option<(usize, usize)>,
}

impl ChunkFormat for Cumulative {
    fn chunks(&mut self, g: &mut Generation) -> Vec<Value> {
        g.take_delta();
        let visible = g.emitted();
        let now = (g.ids.len(), visible);
        if self.sent == Some(now) && !g.done() {
            return Vec::new();
        }
        self.sent = Some(now);
        let mut r = response(g, &self.rid);
        r["text"] = json!(g.text[..visible]);
        vec![r]
    }
}
