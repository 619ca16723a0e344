//! Relaying decode's server-sent-event stream to the client as it arrives, event by event,
//! with the prefill's cached-token count merged into the events that carry one.
//!
//! The prefill's answer is awaited alongside decode's stream. An event that carries a
//! cached-token count waits for it (decode cannot produce a token before the prefill has
//! sent its KV, so that wait is short). A failure of either worker, or a decode event that
//! is not JSON, ends the stream with one `data: {"error": …}` event naming the worker.
//! Dropping the stream (the client went away) drops both upstream connections.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Bytes;
use futures_util::stream::{self, Stream};
use serde_json::Value;

use super::answer::DurationGuard;
use super::merge::{has_cached, merge_cached, take_event, NotJson, PrefillCached, SseEvent};
use super::upstream::{Call, Failure, UpstreamError};
use super::workers::InFlight;
use super::RouterState;

/// The prefill's pending JSON answer.
pub type PrefillAnswer = Pin<Box<dyn Future<Output = Result<Value, UpstreamError>> + Send>>;

/// What woke the relay up.
enum Step {
    Chunk(reqwest::Result<Option<Bytes>>),
    Prefill(Result<Value, UpstreamError>),
}

enum Prefill {
    Pending(PrefillAnswer),
    Ready(PrefillCached),
}

/// What a PD request holds until its answer is complete: its latency timer, and its count
/// in flight on the decode server.
pub struct Held {
    /// The request timer (observed on drop).
    pub timer: DurationGuard,
    /// The decode server's in-flight count.
    pub decode: InFlight,
}

/// The state of one relayed stream.
pub struct Relay {
    decode_call: Call,
    decode: reqwest::Response,
    prefill: Prefill,
    buf: Vec<u8>,
    finished: bool,
    state: Arc<RouterState>,
    route: &'static str,
    _held: Held,
}

impl Relay {
    /// A relay of `decode`'s body; `prefill_done` is the prefill's answer if it came already.
    pub fn new(
        decode_call: Call,
        decode: reqwest::Response,
        prefill: PrefillAnswer,
        prefill_done: Option<Value>,
        state: Arc<RouterState>,
        route: &'static str,
        held: Held,
    ) -> Self {
        let prefill = match prefill_done {
            Some(v) => Prefill::Ready(PrefillCached::from_answer(&v)),
            None => Prefill::Pending(prefill),
        };
        Relay {
            decode_call,
            decode,
            prefill,
            buf: Vec::new(),
            finished: false,
            state,
            route,
            _held: held,
        }
    }

    /// The relayed bytes, for `axum::body::Body::from_stream`.
    pub fn into_stream(self) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
        stream::unfold(self, |mut r| async move {
            let out = r.next().await?;
            Some((Ok(out), r))
        })
    }

    /// Ends the stream with `e`'s error event.
    fn fail(&mut self, e: UpstreamError) -> Bytes {
        self.finished = true;
        self.state.metrics.error(self.route, e.error_type());
        if e.is_worker_fault() {
            self.state.metrics.worker_error(e.role, &e.worker);
        }
        e.sse_event()
    }

    /// The prefill's counts, waiting for its answer if need be.
    async fn prefill_cached(&mut self) -> Result<PrefillCached, UpstreamError> {
        if let Prefill::Pending(f) = &mut self.prefill {
            let v = f.await?;
            self.prefill = Prefill::Ready(PrefillCached::from_answer(&v));
        }
        match &self.prefill {
            Prefill::Ready(c) => Ok(c.clone()),
            Prefill::Pending(_) => unreachable!("set just above"),
        }
    }

    /// The next bytes for the client; `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if self.finished {
                return None;
            }
            if let Some(raw) = take_event(&mut self.buf) {
                return Some(self.relay_event(&raw).await);
            }
            let step = match &mut self.prefill {
                Prefill::Pending(f) => tokio::select! {
                    c = self.decode.chunk() => Step::Chunk(c),
                    p = f => Step::Prefill(p),
                },
                Prefill::Ready(_) => Step::Chunk(self.decode.chunk().await),
            };
            let chunk = match step {
                Step::Chunk(c) => c,
                Step::Prefill(Ok(v)) => {
                    self.prefill = Prefill::Ready(PrefillCached::from_answer(&v));
                    continue;
                }
                Step::Prefill(Err(e)) => return Some(self.fail(e)),
            };
            match chunk {
                Ok(Some(bytes)) => self.buf.extend_from_slice(&bytes),
                Ok(None) => {
                    // Decode ended its stream; pass on any unterminated tail as it is.
                    self.finished = true;
                    if self.buf.is_empty() {
                        return None;
                    }
                    return Some(Bytes::from(std::mem::take(&mut self.buf)));
                }
                Err(e) => {
                    let e = self.decode_call.body_error(&e);
                    return Some(self.fail(e));
                }
            }
        }
    }

    /// One complete event of decode's, merged.
    async fn relay_event(&mut self, raw: &[u8]) -> Bytes {
        match SseEvent::parse(raw) {
            Err(NotJson(text)) => {
                let e = self.decode_call.error(Failure::NotJson(text));
                self.fail(e)
            }
            Ok(SseEvent::Json {
                other_lines,
                mut data,
            }) if has_cached(&data) => match self.prefill_cached().await {
                Ok(c) => {
                    merge_cached(&mut data, &c);
                    Bytes::from(SseEvent::Json { other_lines, data }.to_bytes())
                }
                Err(e) => self.fail(e),
            },
            Ok(event) => Bytes::from(event.to_bytes()),
        }
    }
}
