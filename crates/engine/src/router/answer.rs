//! What the generation routes of both modes share: the request's duration recorded when its
//! answer ends ([`DurationGuard`]), and the answers to a failed worker call ([`failed`]) and
//! to a body that cannot be routed ([`bad_body`]), counted in the metrics; [`begin`] starts
//! a request with them.

use std::sync::Arc;
use std::time::Instant;

use axum::response::{IntoResponse, Response};

use serde_json::{Map, Value};

use super::inject::{parse_body, BadBody};
use super::upstream::UpstreamError;
use super::RouterState;
use crate::server::ApiError;

/// Records a request's duration when dropped: at the end of its answer, or when the client
/// goes away.
pub struct DurationGuard {
    /// The router's state (its metrics get the duration).
    pub state: Arc<RouterState>,
    /// The route timed.
    pub route: &'static str,
    start: Instant,
}

impl DurationGuard {
    /// Starts timing a request at `route`.
    pub fn start(state: Arc<RouterState>, route: &'static str) -> Self {
        DurationGuard {
            state,
            route,
            start: Instant::now(),
        }
    }
}

impl Drop for DurationGuard {
    fn drop(&mut self) {
        self.state
            .metrics
            .duration(self.route, self.start.elapsed());
    }
}

/// The answer to a failed worker call, counted in the metrics.
pub fn failed(state: &RouterState, route: &str, e: UpstreamError) -> Response {
    state.metrics.error(route, e.error_type());
    if e.is_worker_fault() {
        state.metrics.worker_error(e.role, &e.worker);
    }
    e.into_response()
}

/// The answer to a body that cannot be routed, counted in the metrics.
pub fn bad_body(state: &RouterState, route: &str, e: BadBody) -> Response {
    state.metrics.error(route, "bad_request");
    let err = ApiError::bad_request("invalid_value", e.message);
    match e.param {
        Some(p) => err.param(p),
        None => err,
    }
    .into_response()
}

/// A generation request's start: counted, timed, its body parsed (or the 400 to answer).
pub fn begin(
    state: &Arc<RouterState>,
    route: &'static str,
    body: &[u8],
) -> Result<(DurationGuard, Map<String, Value>), Box<Response>> {
    state.metrics.request(route);
    let timer = DurationGuard::start(state.clone(), route);
    match parse_body(body) {
        Ok(b) => Ok((timer, b)),
        Err(e) => Err(Box::new(bad_body(state, route, e))),
    }
}
