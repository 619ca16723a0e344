//! The regular router's generation routes (`--worker-urls`): each request goes to one worker
//! chosen by the policy among the healthy ones, its body unchanged, and the worker's answer
//! (a JSON body, or a stream passed through chunk by chunk) is the client's.
//!
//! A worker that fails before anything reached the client — it cannot be reached, answers
//! 5xx, or breaks off an unstreamed answer — gets the request retried once on another
//! healthy worker (chosen by the policy without it); a second failure is a 502 naming that
//! worker, no healthy worker a 503 (`no_available_workers`). A worker that cannot be reached
//! is skipped from then on until its health checks pass. A stream that breaks after it
//! started ends with one `data: {"error": …}` event. A 4xx is the client's: passed on.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};

use super::answer::{begin, failed, DurationGuard};
use super::metrics::Role;
use super::policies::WorkerId;
use super::prompt::routing_prompt;
use super::upstream::{Call, UpstreamError};
use super::workers::InFlight;
use super::RouterState;
use crate::server::ApiError;

/// How many workers one request may be sent to (the first and one retry).
const ATTEMPTS: usize = 2;

/// No healthy worker left to try.
fn no_worker(state: &RouterState, route: &str) -> Response {
    state.metrics.error(route, "no_available_workers");
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "no healthy worker to send the request to".into(),
        param: None,
        code: "no_available_workers",
    }
    .into_response()
}

/// One generation request at `route`, sent to one worker (retried once on another).
pub async fn route(
    state: Arc<RouterState>,
    route: &'static str,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (timer, parsed) = match begin(&state, route, &body) {
        Ok(started) => started,
        Err(r) => return *r,
    };
    let mut timer = Some(timer);
    let prompt = routing_prompt(route, &parsed, state.prompt_encoder.as_ref());
    let auth = headers.get(header::AUTHORIZATION).cloned();
    let mut tried: Vec<WorkerId> = Vec::new();
    let mut last: Option<UpstreamError> = None;
    for _ in 0..ATTEMPTS {
        let (workers, candidates) = state.workers.candidates(&tried);
        let Some(i) = state.policy.select(&candidates, &prompt) else {
            break;
        };
        let worker = workers[i].clone();
        tried.push(worker.id);
        let in_flight = InFlight::new(worker.clone());
        state
            .metrics
            .worker_request(Role::Worker, worker.url.base());
        let call = Call {
            client: state.client.clone(),
            role: Role::Worker,
            worker: worker.url.clone(),
            path: route,
            auth: auth.clone(),
        };
        let e = match call.send(body.to_vec()).await {
            Ok((call, resp)) => match answer(call, resp, in_flight, &mut timer).await {
                Ok(r) => return r,
                Err(e) => e,
            },
            Err(e) => e,
        };
        if !e.is_worker_fault() {
            return failed(&state, route, e);
        }
        state.metrics.worker_error(Role::Worker, &e.worker);
        if e.is_unreachable() {
            worker.mark_unhealthy();
        }
        last = Some(e);
    }
    match last {
        Some(e) => {
            state.metrics.error(route, e.error_type());
            e.into_response()
        }
        None => no_worker(&state, route),
    }
}

/// The worker's answer for the client: a stream passed through (`timer` goes with it), or
/// the whole body; a body that breaks off before anything was passed on is an error (the
/// request may be retried).
async fn answer(
    call: Call,
    resp: reqwest::Response,
    in_flight: InFlight,
    timer: &mut Option<DurationGuard>,
) -> Result<Response, UpstreamError> {
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_static("application/json"));
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::OK);
    let is_sse = content_type
        .to_str()
        .is_ok_and(|v| v.starts_with("text/event-stream"));
    if is_sse {
        let body = Body::from_stream(pass_through(call, resp, in_flight, timer.take()));
        return Ok((
            status,
            [
                (header::CONTENT_TYPE, content_type),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            ],
            body,
        )
            .into_response());
    }
    match resp.bytes().await {
        Ok(bytes) => Ok((status, [(header::CONTENT_TYPE, content_type)], bytes).into_response()),
        Err(e) => Err(call.body_error(&e)),
    }
}

/// A worker's stream, chunk by chunk; a break ends it with an error event. The guards live
/// as long as the stream (its end, or the client going away).
fn pass_through(
    call: Call,
    resp: reqwest::Response,
    in_flight: InFlight,
    timer: Option<DurationGuard>,
) -> impl Stream<Item = Result<Bytes, Infallible>> + Send {
    struct Relay {
        call: Call,
        resp: reqwest::Response,
        done: bool,
        _in_flight: InFlight,
        timer: Option<DurationGuard>,
    }
    let relay = Relay {
        call,
        resp,
        done: false,
        _in_flight: in_flight,
        timer,
    };
    stream::unfold(relay, |mut r| async move {
        if r.done {
            return None;
        }
        match r.resp.chunk().await {
            Ok(Some(bytes)) => Some((Ok(bytes), r)),
            Ok(None) => None,
            Err(e) => {
                r.done = true;
                let e = r.call.body_error(&e);
                if let Some(t) = &r.timer {
                    t.state.metrics.error(t.route, e.error_type());
                    t.state.metrics.worker_error(e.role, &e.worker);
                }
                Some((Ok(e.sse_event()), r))
            }
        }
    })
}
