//! The router's other routes: `GET /health` (the router's own liveness), `GET /metrics`
//! (its Prometheus text), `GET /get_server_info` (every worker with its health and its own
//! `/get_server_info`), `GET /v1/models` (from a decode or healthy regular worker) and
//! `POST /flush_cache` (forwarded to every worker, as sgl-router).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use super::config::WorkerUrl;
use super::metrics::Role;
use super::upstream::describe;
use super::RouterState;
use crate::server::ApiError;

/// The longest wait for a worker's answer to an informational request.
const INFO_TIMEOUT: Duration = Duration::from_secs(5);

/// `GET /health`: 200 while the router runs (workers are checked by `/get_server_info`).
pub async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`.
pub async fn metrics(State(s): State<Arc<RouterState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

/// A `GET`/`POST` without a body to `worker`, within [`INFO_TIMEOUT`]: the JSON answer (or
/// `null` for an empty 2xx body), or why not.
async fn fetch(
    client: reqwest::Client,
    method: reqwest::Method,
    worker: WorkerUrl,
    path: &'static str,
    auth: Option<header::HeaderValue>,
) -> Result<Value, String> {
    let mut req = client
        .request(method, worker.join(path))
        .timeout(INFO_TIMEOUT);
    if let Some(a) = auth {
        req = req.header(header::AUTHORIZATION, a);
    }
    let resp = req
        .send()
        .await
        .map_err(|e| format!("could not be reached: {}", describe(&e)))?;
    let status = resp.status();
    let body = resp
        .bytes()
        .await
        .map_err(|e| format!("broke off its answer: {}", describe(&e)))?;
    if !status.is_success() {
        return Err(format!(
            "answered {status}: {}",
            String::from_utf8_lossy(&body).trim()
        ));
    }
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&body).map_err(|_| "answered something that is not JSON".into())
}

/// Every worker as (role, URL, bootstrap port).
fn workers(s: &RouterState) -> Vec<(Role, WorkerUrl, Option<u16>)> {
    let prefill = s
        .config
        .prefill
        .iter()
        .map(|p| (Role::Prefill, p.url.clone(), Some(p.bootstrap_port)));
    let decode = s
        .config
        .decode
        .iter()
        .map(|d| (Role::Decode, d.clone(), None));
    let regular = s
        .workers
        .all()
        .into_iter()
        .map(|w| (Role::Worker, w.url.clone(), None));
    prefill.chain(decode).chain(regular).collect()
}

/// `GET /get_server_info`: the router's settings and every worker, in the order given on the
/// command line, with `healthy` (its `/health` answered 2xx) and its own server info (or
/// `error`); in regular mode also the pages the `kv_events` index holds per worker.
pub async fn server_info(State(s): State<Arc<RouterState>>, h: HeaderMap) -> Json<Value> {
    let auth = h.get(header::AUTHORIZATION).cloned();
    let mut tasks = JoinSet::new();
    for (i, (role, url, port)) in workers(&s).into_iter().enumerate() {
        let client = s.client.clone();
        let auth = auth.clone();
        tasks.spawn(async move {
            let get = reqwest::Method::GET;
            let (health, info) = tokio::join!(
                fetch(
                    client.clone(),
                    get.clone(),
                    url.clone(),
                    "/health",
                    auth.clone()
                ),
                fetch(client, get, url.clone(), "/get_server_info", auth),
            );
            let mut w = json!({"url": url.base(), "healthy": health.is_ok()});
            if let Some(p) = port {
                w["bootstrap_port"] = json!(p);
            }
            match info {
                Ok(v) => w["server_info"] = v,
                Err(e) => {
                    w["server_info"] = Value::Null;
                    w["error"] = json!(format!("{} {url} {e}", role.worker_noun()));
                }
            }
            (i, role, w)
        });
    }
    let mut found: Vec<(usize, Role, Value)> = tasks.join_all().await;
    found.sort_by_key(|(i, _, _)| *i);
    let of = |role| -> Vec<Value> {
        found
            .iter()
            .filter(|(_, r, _)| *r == role)
            .map(|(_, _, w)| w.clone())
            .collect()
    };
    if !s.config.is_pd() {
        let mut workers = of(Role::Worker);
        let index = s.kv_index.lock().unwrap_or_else(|e| e.into_inner());
        for (w, info) in s.workers.all().iter().zip(&mut workers) {
            info["kv_pages"] = json!(index.held_pages(w.id));
        }
        return Json(json!({
            "router": {
                "mode": "regular",
                "policy": s.policy.name(),
                "request_timeout_secs": s.config.request_timeout.as_secs(),
                "health_check_interval_secs": s.config.health.interval.as_secs(),
                "kv_index": {
                    "block_size": index.block_size(),
                    "unplaced_pages": index.unplaced(),
                },
            },
            "workers": workers,
        }));
    }
    Json(json!({
        "router": {
            "mode": "pd_disaggregation",
            "prefill_policy": s.config.prefill_policy.as_str(),
            "decode_policy": s.config.decode_policy.as_str(),
            "request_timeout_secs": s.config.request_timeout.as_secs(),
        },
        "prefill": of(Role::Prefill),
        "decode": of(Role::Decode),
    }))
}

/// `GET /v1/models`: the first decode (or healthy regular) worker's answer (the next one's
/// if it fails).
pub async fn models(State(s): State<Arc<RouterState>>, h: HeaderMap) -> Response {
    let auth = h.get(header::AUTHORIZATION).cloned();
    let mut errors = Vec::new();
    let sources: Vec<WorkerUrl> = if s.config.is_pd() {
        s.config.decode.clone()
    } else {
        s.workers
            .candidates(&[])
            .0
            .iter()
            .map(|w| w.url.clone())
            .collect()
    };
    let role = if s.config.is_pd() { "decode " } else { "" };
    for url in &sources {
        let get = reqwest::Method::GET;
        match fetch(
            s.client.clone(),
            get,
            url.clone(),
            "/v1/models",
            auth.clone(),
        )
        .await
        {
            Ok(v) => return Json(v).into_response(),
            Err(e) => errors.push(format!("{role}worker {url} {e}")),
        }
    }
    let code = if s.config.is_pd() {
        "decode_error"
    } else {
        "worker_error"
    };
    s.metrics.error("/v1/models", code);
    if errors.is_empty() {
        errors.push("no healthy worker".into());
    }
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message: errors.join("; "),
        param: None,
        code,
    }
    .into_response()
}

/// `POST /flush_cache`: forwarded to every worker; 200 if all of them flushed, else 502
/// naming the ones that did not.
pub async fn flush_cache(State(s): State<Arc<RouterState>>, h: HeaderMap) -> Response {
    let auth = h.get(header::AUTHORIZATION).cloned();
    let mut tasks = JoinSet::new();
    for (role, url, _) in workers(&s) {
        let (client, auth) = (s.client.clone(), auth.clone());
        tasks.spawn(async move {
            let r = fetch(
                client,
                reqwest::Method::POST,
                url.clone(),
                "/flush_cache",
                auth,
            )
            .await;
            r.map_err(|e| format!("{} {url} {e}", role.worker_noun()))
        });
    }
    let failed: Vec<String> = tasks
        .join_all()
        .await
        .into_iter()
        .filter_map(Result::err)
        .collect();
    if failed.is_empty() {
        return Json(json!({"success": true})).into_response();
    }
    s.metrics.error("/flush_cache", "worker_error");
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message: format!("flush_cache failed on: {}", failed.join(", ")),
        param: None,
        code: "worker_error",
    }
    .into_response()
}
