//! The streaming core every generation endpoint shares: a [`RequestRun`] submits one
//! [`Prepared`] request, follows its engine events into a [`Generation`] (incremental
//! detokenization, stop strings, the finish reason, usage) and times it for `/metrics`;
//! [`sse`] turns a run into server-sent events in the endpoint's own [`ChunkFormat`].
//!
//! Stop strings are matched here, on the decoded text: the text is cut before the match and
//! the engine is asked to stop the request ([`RequestStream::cancel`]); the run still waits
//! for the engine's `Finished` so usage (cached tokens) is complete. While streaming, text
//! that could be the start of a stop string is held back until it is known not to be one.
//! The text of a stop token (EOS or `stop_token_ids`) is left out; its id stays in `ids`.
//!
//! A client that goes away drops the run: its [`RequestStream`] is dropped, the engine aborts
//! the request and frees its KV, and the request counts as aborted.

use std::convert::Infallible;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use model::{IncrementalDecoder, SamplingParams, Tokenizer};
use scheduler::FinishReason;
use serde_json::{json, Value};

use super::error::ApiError;
use super::metrics::{Outcome, RequestTimer};
use super::params::Prepared;
use super::state::AppState;
use crate::engine_loop::{Event, Finished, RequestStream};

/// Why a generation ended, as the client sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish {
    /// The token limit.
    Length {
        length: usize,
    },
    /// A stop token (EOS or one of `stop_token_ids`).
    StopToken(u32),
    StopString(String),
    /// Aborted (shutdown, out of memory, an engine error).
    Abort(String),
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn openai_reason(&self) -> &'static str {
        match self {
            Finish::Length { .. } => "length",
            Finish::StopToken(_) | Finish::StopString(_) => "stop",
            Finish::Abort(_) => "abort",
        }
    }

    /// SGLang's `meta_info.finish_reason`.
    pub fn sglang_json(&self) -> Value {
        match self {
            Finish::Length { length } => json!({"type": "length", "length": length}),
            Finish::StopToken(t) => json!({"type": "stop", "matched": t}),
            Finish::StopString(s) => json!({"type": "stop", "matched": s}),
            Finish::Abort(m) => json!({"type": "abort", "message": m}),
        }
    }

    fn outcome(&self) -> Outcome {
        match self {
            Finish::Length { .. } => Outcome::Length,
            Finish::StopToken(_) | Finish::StopString(_) => Outcome::Stop,
            Finish::Abort(_) => Outcome::Abort,
        }
    }
}

/// A request's output so far.
#[derive(Debug)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated ids received (up to the stop string's match, when one matched).
    pub ids: Vec<u32>,
    /// Stable decoded text (cut before a matched stop string).
    pub text: String,
    /// Bytes of `text` handed out by [`take_delta`](Self::take_delta).
    emitted: usize,
    decoder: IncrementalDecoder,
    /// Only the stop strings are set: for [`model::stop_string_holdback`].
    stops: SamplingParams,
    stop_token_ids: Vec<u32>,
    /// Set once the generation ended (for the client).
    pub finish: Option<Finish>,
    /// The engine's end-of-request record (usage); `None` until it arrived.
    pub meta: Option<Finished>,
    closed: bool,
}

impl Generation {
    fn new(p: &Prepared) -> Self {
        Generation {
            prompt_tokens: p.request.input_ids.len(),
            ids: Vec::new(),
            text: String::new(),
            emitted: 0,
            decoder: IncrementalDecoder::new(p.skip_special_tokens),
            stops: SamplingParams {
                stop_strings: p.stop_strings.clone(),
                ..SamplingParams::default()
            },
            stop_token_ids: p.request.sampling.stop_token_ids.clone(),
            finish: None,
            meta: None,
            closed: false,
        }
    }

    /// The request is over: the engine's record arrived or the stream ended.
    pub fn done(&self) -> bool {
        self.meta.is_some() || self.closed
    }

    /// Prompt tokens served from the prefix cache.
    pub fn cached_tokens(&self) -> usize {
        self.meta.as_ref().map_or(0, |m| m.cached_tokens)
    }

    /// Generated tokens the client gets.
    pub fn completion_tokens(&self) -> usize {
        self.ids.len()
    }

    /// OpenAI's `usage` object.
    pub fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens(),
            "total_tokens": self.prompt_tokens + self.completion_tokens(),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        })
    }

    /// Text not handed out yet that is safe to send: all of it once the generation ended,
    /// otherwise what cannot be the beginning of a stop string.
    pub fn take_delta(&mut self) -> String {
        let end = if self.finish.is_some() || self.done() {
            self.text.len()
        } else {
            self.text.len() - model::stop_string_holdback(&self.stops, &self.text)
        };
        let end = end.max(self.emitted);
        let delta = self.text[self.emitted..end].to_string();
        self.emitted = end;
        delta
    }

    /// Bytes of [`text`](Self::text) handed out so far.
    pub fn emitted(&self) -> usize {
        self.emitted
    }

    /// Adds tokens; returns whether a stop string matched (the engine should stop).
    fn push_tokens(&mut self, tok: &Tokenizer, ids: Vec<u32>) -> bool {
        if self.finish.is_some() {
            return false;
        }
        let checked = self.text.len();
        for id in ids {
            self.ids.push(id);
            if self.stop_token_ids.contains(&id) {
                continue;
            }
            match self.decoder.step(tok, id) {
                Ok(t) => self.text.push_str(&t),
                Err(e) => {
                    self.finish = Some(Finish::Abort(format!("cannot decode token {id}: {e}")));
                    return true;
                }
            }
        }
        self.match_stop(checked)
    }

    /// Looks for a stop string that ends after byte `checked` of the text; cuts the text
    /// before the earliest match.
    fn match_stop(&mut self, checked: usize) -> bool {
        let longest = self.stops.stop_strings.iter().map(String::len).max();
        let Some(longest) = longest else {
            return false;
        };
        let mut from = checked.saturating_sub(longest - 1);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .stop_strings
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|at| (from + at, s)))
            .min_by_key(|&(at, s)| (at, s.len()));
        let Some((at, s)) = hit else {
            return false;
        };
        let s = s.clone();
        self.text.truncate(at);
        self.finish = Some(Finish::StopString(s));
        true
    }

    fn finished(&mut self, tok: &Tokenizer, f: Finished) {
        if self.finish.is_none() {
            let checked = self.text.len();
            let tail = self.decoder.finish(tok).unwrap_or_default();
            self.text.push_str(&tail);
            if !self.match_stop(checked) {
                self.finish = Some(match &f.reason {
                    FinishReason::Length { length } => Finish::Length { length: *length },
                    FinishReason::Stop { token } => Finish::StopToken(*token),
                    FinishReason::Abort { message } => Finish::Abort(message.clone()),
                });
            }
        }
        self.meta = Some(f);
    }

    fn close(&mut self, why: &str) {
        self.closed = true;
        if self.finish.is_none() {
            self.finish = Some(Finish::Abort(why.to_string()));
        }
    }
}

/// One request in flight: its engine stream, its output so far, its timer.
#[derive(Debug)]
pub struct RequestRun {
    stream: RequestStream,
    /// The output so far.
    pub gen: Generation,
    timer: RequestTimer,
    state: std::sync::Arc<AppState>,
}

impl RequestRun {
    /// Submits `p` and waits for its first event, so that a refusal is an error (4xx, or 503
    /// for a full queue) rather than a stream that fails.
    pub async fn start(s: &std::sync::Arc<AppState>, p: Prepared) -> Result<Self, ApiError> {
        Self::submit(s, p).first_event().await
    }

    /// Starts a batch of prompts: all are submitted before any first event is awaited, so the
    /// engine can prefill them together. If one is refused, the error is returned and the
    /// others' streams are dropped, which aborts them.
    pub async fn start_all(
        s: &std::sync::Arc<AppState>,
        prepared: Vec<Prepared>,
    ) -> Result<Vec<Self>, ApiError> {
        let submitted: Vec<Self> = prepared.into_iter().map(|p| Self::submit(s, p)).collect();
        let mut runs = Vec::with_capacity(submitted.len());
        for run in submitted {
            runs.push(run.first_event().await?);
        }
        Ok(runs)
    }

    /// Hands `p` to the engine without waiting.
    fn submit(s: &std::sync::Arc<AppState>, p: Prepared) -> Self {
        let gen = Generation::new(&p);
        let timer = s.metrics.start();
        let stream = s.engine.submit(p.request);
        RequestRun {
            stream,
            gen,
            timer,
            state: s.clone(),
        }
    }

    /// Waits for the first event: a refusal becomes the error.
    async fn first_event(mut self) -> Result<Self, ApiError> {
        let first = match self.stream.next().await {
            Some(Event::Rejected(m)) => {
                let e = ApiError::rejected(m);
                self.timer.rejected(e.code == "queue_full");
                return Err(e);
            }
            Some(ev) => ev,
            None => {
                self.timer.rejected(false);
                return Err(ApiError::unavailable(
                    "engine_stopped",
                    "the engine is stopped",
                ));
            }
        };
        self.apply(first);
        Ok(self)
    }

    /// Waits for the next event and applies it (nothing once done).
    pub async fn advance(&mut self) {
        if self.gen.done() {
            return;
        }
        match self.stream.next().await {
            Some(ev) => self.apply(ev),
            None => self.gen.close("the engine stopped"),
        }
        self.end_if_done();
    }

    /// Runs to the end.
    pub async fn collect(mut self) -> Generation {
        while !self.gen.done() {
            self.advance().await;
        }
        self.gen
    }

    fn apply(&mut self, ev: Event) {
        match ev {
            Event::Tokens(t) => {
                self.timer.tokens(t.len());
                if self.gen.push_tokens(&self.state.tokenizer, t) {
                    self.stream.cancel();
                }
            }
            Event::Finished(f) => self.gen.finished(&self.state.tokenizer, f),
            Event::Rejected(m) => self.gen.close(&m),
        }
        self.end_if_done();
    }

    fn end_if_done(&mut self) {
        if let (true, Some(f)) = (self.gen.done(), &self.gen.finish) {
            self.timer.end(f.outcome());
        }
    }
}

/// How an endpoint renders a run's progress as stream chunks.
pub trait ChunkFormat: Send + 'static {
    /// The chunks for what changed since the last call (new text from
    /// [`Generation::take_delta`]); once `gen.done()`, also the closing chunks.
    fn chunks(&mut self, gen: &mut Generation) -> Vec<Value>;
}

/// Streams `run` as server-sent events: `data: {chunk}` per chunk, then `data: [DONE]`.
pub fn sse(run: RequestRun, format: impl ChunkFormat) -> Response {
    let events = stream::unfold(Some((run, format)), |state| async move {
        let (mut run, mut format) = state?;
        let mut out: Vec<SseEvent> = format
            .chunks(&mut run.gen)
            .into_iter()
            .map(|v| SseEvent::default().data(v.to_string()))
            .collect();
        if run.gen.done() {
            out.push(SseEvent::default().data("[DONE]"));
            return Some((out, None));
        }
        run.advance().await;
        Some((out, Some((run, format))))
    });
    Sse::new(flatten(events)).into_response()
}

fn flatten(
    s: impl Stream<Item = Vec<SseEvent>> + Send + 'static,
) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static {
    s.flat_map(|v| stream::iter(v.into_iter().map(Ok)))
}
