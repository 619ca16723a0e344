//! `--api-key` (as SGLang): when set, every endpoint except `/health` requires
//! `Authorization: Bearer <key>`; anything else is a 401 with an OpenAI-style error
//! (`code: "invalid_api_key"`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;

/// Paths open without a key.
const OPEN_PATHS: &[&str] = &["/health"];

/// The middleware: passes the request on, or answers 401.
pub async fn require_api_key(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = s.api_key.as_deref() else {
        return next.run(req).await;
    };
    if OPEN_PATHS.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or_default());
    let message = match given.map(|v| v.strip_prefix("Bearer ")) {
        Some(Some(k)) if same(k.trim().as_bytes(), key.as_bytes()) => {
            return next.run(req).await;
        }
        Some(Some(_)) => "Incorrect API key provided.",
        Some(None) => "The Authorization header must be `Bearer <api key>`.",
        None => "An API key is required: send `Authorization: Bearer <api key>`.",
    };
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: message.into(),
        param: None,
        code: "invalid_api_key",
    }
    .into_response()
}

/// Compares in time that does not depend on where the keys differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
