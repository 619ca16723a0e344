//! The generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`): SGLang's
//! PD dual dispatch.
//!
//! Per request: pick a prefill and a decode worker, inject the bootstrap fields (one random
//! room, the same to both), send both requests at once, and answer with decode's response,
//! the prefill's cached-token count merged in. The prefill's answer is always waited for
//! (it says how many tokens it found cached, and whether it failed):
//! - a failure of either worker ends the request at once with that worker's error and drops
//!   the other request's connection, which is how a kvserve server learns its client has gone
//!   (the decode server then frees its preallocated KV, the prefill server its request); only
//!   a prefill failure after decode's whole unstreamed answer came leaves that answer standing
//!   (the KV had arrived);
//! - a client that disconnects drops this handler (or the stream), and with it both upstream
//!   requests.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use super::answer::{bad_body, begin, failed};
use super::inject::{batch_size, inject_bootstrap, is_stream, prefill_body};
use super::merge::{merge_cached, PrefillCached};
use super::metrics::Role;
use super::prompt::routing_prompt;
use super::relay::{Held, PrefillAnswer, Relay};
use super::upstream::{quote, Call, Failure, UpstreamError};
use super::RouterState;

/// One generation request at `route`, dispatched to a prefill and a decode worker.
pub async fn dual_dispatch(
    state: Arc<RouterState>,
    route: &'static str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (timer, mut body) = match begin(&state, route, &body) {
        Ok(started) => started,
        Err(r) => return *r,
    };
    let batch = match batch_size(&body) {
        Ok(b) => b,
        Err(e) => return bad_body(&state, route, e),
    };
    let prompt = routing_prompt(route, &body, state.prompt_encoder.as_ref());
    let super::PdPick {
        prefill,
        decode,
        in_flight: [in_flight, decode_in_flight],
    } = state.pick(&prompt);
    inject_bootstrap(
        &mut body,
        batch,
        prefill.url.host(),
        prefill.bootstrap_port,
        &state.rooms,
    );
    let stream = is_stream(&body);
    let auth = headers.get(header::AUTHORIZATION).cloned();
    let call = |role, worker: &super::config::WorkerUrl| Call {
        client: state.client.clone(),
        role,
        worker: worker.clone(),
        path: route,
        auth: auth.clone(),
    };
    let prefill_call = call(Role::Prefill, &prefill.url);
    let decode_call = call(Role::Decode, decode);
    state
        .metrics
        .worker_request(Role::Prefill, prefill.url.base());
    state.metrics.worker_request(Role::Decode, decode.base());
    // Serializing a map of JSON values cannot fail.
    let prefill_bytes = serde_json::to_vec(&prefill_body(&body)).unwrap_or_default();
    let decode_bytes = serde_json::to_vec(&body).unwrap_or_default();

    let dispatch = Dispatch {
        prefill: Box::pin(async move {
            let _in_flight = in_flight;
            prefill_call.post_json(prefill_bytes).await
        }),
        state,
        route,
        held: Held {
            timer,
            decode: decode_in_flight,
        },
    };
    if stream {
        dispatch.streamed(decode_call, decode_bytes).await
    } else {
        dispatch.unstreamed(decode_call, decode_bytes).await
    }
}

/// One request sent to both workers, the prefill's answer pending.
struct Dispatch {
    prefill: PrefillAnswer,
    state: Arc<RouterState>,
    route: &'static str,
    held: Held,
}

impl Dispatch {
    fn failed(&self, e: UpstreamError) -> Response {
        failed(&self.state, self.route, e)
    }

    /// Decode answered in one piece: `d`, with the prefill's count merged in (`prefill`, or
    /// its answer awaited now). The KV has arrived, so a prefill failure now is counted and
    /// decode's answer stands, unmerged.
    async fn finish(self, prefill: Option<Value>, mut d: Value) -> Response {
        let p = match prefill {
            Some(p) => Some(p),
            None => match self.prefill.await {
                Ok(p) => Some(p),
                Err(e) => {
                    if e.is_worker_fault() {
                        self.state.metrics.worker_error(e.role, &e.worker);
                    }
                    None
                }
            },
        };
        if let Some(p) = p {
            merge_cached(&mut d, &PrefillCached::from_answer(&p));
        }
        drop(self.held);
        Json::<Value>(d).into_response()
    }

    /// Not streamed: both JSON answers. A failure while the other is pending ends the
    /// request; dropping the other future closes its connection.
    async fn unstreamed(mut self, decode: Call, body: Vec<u8>) -> Response {
        let mut decode_fut = Box::pin(decode.post_json(body));
        tokio::select! {
            p = &mut self.prefill => match p {
                Err(e) => self.failed(e),
                Ok(p) => match decode_fut.await {
                    Err(e) => self.failed(e),
                    Ok(d) => self.finish(Some(p), d).await,
                },
            },
            d = &mut decode_fut => match d {
                Err(e) => self.failed(e),
                Ok(d) => self.finish(None, d).await,
            },
        }
    }

    /// Streamed: waits for decode's response headers (or the prefill's failure), then relays
    /// decode's events as they arrive.
    async fn streamed(mut self, decode: Call, body: Vec<u8>) -> Response {
        let mut decode_fut = Box::pin(decode.send(body));
        let mut prefill_done: Option<Value> = None;
        let (decode, resp) = loop {
            tokio::select! {
                p = &mut self.prefill, if prefill_done.is_none() => match p {
                    Err(e) => return self.failed(e),
                    Ok(v) => prefill_done = Some(v),
                },
                d = &mut decode_fut => match d {
                    Err(e) => return self.failed(e),
                    Ok(r) => break r,
                },
            }
        };
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let is_sse = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            // Decode answered in one piece after all: a JSON answer, as unstreamed ones.
            let bytes = match resp.bytes().await {
                Ok(b) => b,
                Err(e) => return self.failed(decode.body_error(&e)),
            };
            return match serde_json::from_slice::<Value>(&bytes) {
                Ok(d) => self.finish(prefill_done, d).await,
                Err(_) => self.failed(decode.error(Failure::NotJson(quote(&bytes)))),
            };
        }
        let content_type =
            content_type.unwrap_or_else(|| HeaderValue::from_static("text/event-stream"));
        let Dispatch {
            prefill,
            state,
            route,
            held,
        } = self;
        let relay = Relay::new(decode, resp, prefill, prefill_done, state, route, held);
        (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            Body::from_stream(relay.into_stream()),
        )
            .into_response()
    }
}
