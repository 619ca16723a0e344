//! `kvserve serve`: the HTTP API over an [`EngineHandle`](crate::engine_loop::EngineHandle)
//! (axum on tokio).
//!
//! Endpoints:
//! - SGLang's native API: `POST /generate` ([`generate`]), `GET /health`,
//!   `GET /get_model_info` (with the chat template in use), `GET /get_server_info` (pool and
//!   cache state, with the ownership check when idle), `POST /flush_cache`, `GET /v1/models`.
//! - OpenAI's: `POST /v1/completions`, `POST /v1/chat/completions` ([`openai`], prompts from
//!   chat messages by [`chat`]).
//! - `GET /metrics`: Prometheus text ([`metrics`]).
//!
//! Every generation endpoint goes through the same two pieces: [`params::prepare`] (request
//! fields → the engine's validated request) and [`stream`] (engine events → text, stop
//! strings, usage, timing; server-sent events). Errors are OpenAI-shaped JSON ([`error`]):
//! bad input is a 4xx naming the field, a full queue a 503. With `--api-key`, [`auth`]
//! guards every endpoint but `/health`. A client that disconnects drops its request's event
//! stream, and the engine aborts the request and frees its KV.

pub mod auth;
pub mod chat;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod openai;
pub mod params;
pub mod state;
pub mod stream;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use serde_json::{json, Value};

pub use error::ApiError;
pub use state::AppState;

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/flush_cache", post(flush_cache))
        .route("/metrics", get(prometheus))
        .route("/v1/models", get(models))
        .route("/generate", post(generate::generate))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .with_state(state)
}

async fn model_info(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "model_path": s.model_name,
        "is_generation": true,
        "context_length": s.context_len,
        "vocab_size": s.vocab_size,
        "chat_template": s.chat.describe(),
    }))
}

async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": s.model_name, "object": "model", "owned_by": "kvserve", "max_model_len": s.context_len}]}),
    )
}

async fn prometheus(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(
            &s.engine.metrics().snapshot(),
            s.engine.metrics().pd_snapshot().as_ref(),
            s.engine.metrics().hicache_snapshot().as_ref(),
        ),
    )
}

async fn server_info(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let st = s.clone();
    let info = tokio::task::spawn_blocking(move || st.engine.info())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| ApiError::unavailable("engine_stopped", "the engine is stopped"))?;
    let mut out = s.server_args.clone();
    if let Some(map) = out.as_object_mut() {
        map.insert("engine".into(), json!(info));
        map.insert("context_length".into(), json!(s.context_len));
    }
    Ok(Json(out))
}

/// `GET /health`: 200 while the engine loop runs, 503 once it has stopped.
async fn health(State(s): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    if s.engine.is_running() {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::unavailable(
            "engine_stopped",
            "the engine is stopped",
        ))
    }
}

async fn flush_cache(State(s): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let st = s.clone();
    match tokio::task::spawn_blocking(move || st.engine.flush_cache()).await {
        Ok(Ok(())) => Ok(Json(json!({"success": true}))),
        Ok(Err(_)) if !s.engine.is_running() => Err(ApiError::unavailable(
            "engine_stopped",
            "the engine is stopped",
        )),
        Ok(Err(e)) => Err(ApiError {
            status: StatusCode::CONFLICT,
            ..ApiError::bad_request("busy", e)
        }),
        Err(e) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            ..ApiError::bad_request("internal", e.to_string())
        }),
    }
}

/// Serves `state` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

/// A server on its own thread and tokio runtime, stopped (gracefully) on drop: for tests,
/// benches and programs that embed the server.
#[derive(Debug)]
pub struct BackgroundServer {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds `addr` (port 0: any free port) and serves `state` on a new thread with a runtime of
/// `worker_threads` threads.
pub fn spawn(
    state: Arc<AppState>,
    addr: &str,
    worker_threads: usize,
) -> std::io::Result<BackgroundServer> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads.max(1))
        .enable_all()
        .build()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind(addr))?;
    let local = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kvserve-http".into())
        .spawn(move || {
            rt.block_on(serve(listener, state, async {
                let _ = stopped.await;
            }))
        })?;
    Ok(BackgroundServer {
        addr: local,
        stop: Some(stop),
        thread: Some(thread),
    })
}
