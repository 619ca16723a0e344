//! The regular router's worker management at run time (sgl-router's endpoints):
//! `POST /add_worker?url=URL` (probed once: it starts healthy if its `/health` answers, else
//! it waits for its health checks; under `kv_events` also `&kv_events=tcp://HOST:PORT`, its
//! event endpoint, which the router then follows, and optionally `&kv_events_replay=` its
//! replay endpoint), `POST /remove_worker?url=URL` (the policy
//! forgets it, its events are no longer followed; requests in flight there finish) and
//! `GET /list_workers`.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::config::{check_endpoint, EventSource, PolicyKind, WorkerUrl};
use super::health::probe;
use super::RouterState;
use crate::server::ApiError;

/// The query parameters: the worker's `url`, and its `kv_events` endpoint.
#[derive(Debug, Deserialize)]
pub struct UrlParam {
    url: Option<String>,
    kv_events: Option<String>,
    kv_events_replay: Option<String>,
}

fn parse(p: &UrlParam) -> Result<WorkerUrl, ApiError> {
    let Some(url) = &p.url else {
        return Err(ApiError::bad_request(
            "invalid_value",
            "give the worker as ?url=http://HOST:PORT",
        )
        .param("url"));
    };
    WorkerUrl::parse(url).map_err(|m| ApiError::bad_request("invalid_value", m).param("url"))
}

fn mode_error(s: &RouterState) -> Option<Response> {
    s.config.is_pd().then(|| {
        ApiError::bad_request(
            "unsupported",
            "the PD router's workers are fixed at start (--prefill, --decode)",
        )
        .into_response()
    })
}

/// `POST /add_worker?url=URL`.
pub async fn add_worker(State(s): State<Arc<RouterState>>, Query(p): Query<UrlParam>) -> Response {
    if let Some(r) = mode_error(&s) {
        return r;
    }
    let url = match parse(&p) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    let events = match (s.config.policy == PolicyKind::KvEvents, &p.kv_events) {
        (true, Some(e)) => match check_endpoint(e) {
            Ok(()) => Some(e.clone()),
            Err(m) => {
                return ApiError::bad_request("invalid_value", m)
                    .param("kv_events")
                    .into_response()
            }
        },
        (false, None) => None,
        (true, None) => return ApiError::bad_request(
            "invalid_value",
            "the kv_events policy needs the worker's event endpoint: &kv_events=tcp://HOST:PORT",
        )
        .param("kv_events")
        .into_response(),
        (false, Some(_)) => {
            return ApiError::bad_request(
                "invalid_value",
                "only the kv_events policy reads a worker's KV events",
            )
            .param("kv_events")
            .into_response()
        }
    };
    let replay = match (&events, &p.kv_events_replay) {
        (_, None) => None,
        (Some(_), Some(r)) => match check_endpoint(r) {
            Ok(()) => Some(r.clone()),
            Err(m) => {
                return ApiError::bad_request("invalid_value", m)
                    .param("kv_events_replay")
                    .into_response()
            }
        },
        (None, Some(_)) => {
            return ApiError::bad_request(
                "invalid_value",
                "a replay endpoint goes with the kv_events policy's &kv_events=",
            )
            .param("kv_events_replay")
            .into_response()
        }
    };
    let healthy = probe(&s.client, &url, s.config.health.timeout).await;
    match s.workers.add(url.clone(), healthy) {
        Ok(w) => {
            if let Some(endpoint) = events {
                let topic = s.config.kv_events_topic.clone();
                let source = EventSource { endpoint, replay };
                s.subscribers.start(source, topic, w.id, s.kv_index.clone());
            }
            eprintln!("kvserve: router: added worker {url} (healthy: {healthy})");
            Json(json!({"success": true, "url": url.base(), "healthy": healthy})).into_response()
        }
        Err(m) => ApiError::bad_request("invalid_value", m)
            .param("url")
            .into_response(),
    }
}

/// `POST /remove_worker?url=URL`.
pub async fn remove_worker(
    State(s): State<Arc<RouterState>>,
    Query(p): Query<UrlParam>,
) -> Response {
    if let Some(r) = mode_error(&s) {
        return r;
    }
    let url = match parse(&p) {
        Ok(u) => u,
        Err(e) => return e.into_response(),
    };
    match s.workers.remove(&url) {
        Some(w) => {
            s.subscribers.stop(w.id);
            s.policy.remove_worker(w.id);
            eprintln!("kvserve: router: removed worker {url}");
            Json(json!({"success": true, "url": url.base()})).into_response()
        }
        None => ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("worker {url} is not registered"),
            param: Some("url".into()),
            code: "not_found",
        }
        .into_response(),
    }
}

/// `GET /list_workers`: `urls` (sgl-router's answer) and each worker's health and load.
pub async fn list_workers(State(s): State<Arc<RouterState>>) -> Json<serde_json::Value> {
    let all = s.workers.all();
    Json(json!({
        "urls": all.iter().map(|w| w.url.base()).collect::<Vec<_>>(),
        "workers": all.iter().map(|w| json!({
            "url": w.url.base(), "healthy": w.is_healthy(), "load": w.load(),
        })).collect::<Vec<_>>(),
    }))
}
