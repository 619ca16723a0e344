//! Talking to one worker: a JSON `POST`, and what can go wrong with it ([`UpstreamError`]),
//! turned into the answer the router's client gets.
//!
//! A worker's 4xx is the client's mistake (a bad field, a prompt too long): its status and
//! body are passed on as they are. Everything else — the worker could not be reached, timed
//! out, answered 5xx, broke off its answer, or answered something that is not JSON — is the
//! worker's failure: a `502 Bad Gateway` in OpenAI's error shape naming the role and the
//! worker's URL.

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use super::config::WorkerUrl;
use super::metrics::Role;
use crate::server::ApiError;

/// The most bytes of a worker's error body quoted in the router's message.
const QUOTED_BODY: usize = 300;

/// What went wrong with a worker's answer.
#[derive(Debug)]
pub enum Failure {
    /// No answer: connection refused or timed out, the request could not be sent, or no
    /// response headers in time.
    Unreachable(String),
    /// A 5xx answer (its body, shortened).
    ServerError {
        /// The HTTP status.
        status: StatusCode,
        /// The start of its body.
        body: String,
    },
    /// A 4xx answer, passed on to the client as is.
    ClientError {
        /// The HTTP status.
        status: StatusCode,
        /// Its body.
        body: Bytes,
    },
    /// The answer's body broke off.
    Body(String),
    /// The answer (or one of its stream events) is not JSON (its start).
    NotJson(String),
}

/// A worker's failure: which worker, in which role, and how.
#[derive(Debug)]
pub struct UpstreamError {
    /// Prefill or decode.
    pub role: Role,
    /// The worker's URL.
    pub worker: String,
    /// What went wrong.
    pub failure: Failure,
}

impl UpstreamError {
    /// `error_type` for the router's metrics: `prefill_error` / `decode_error` /
    /// `worker_error`, or `…_client_error` for a 4xx passed on.
    pub fn error_type(&self) -> &'static str {
        match (self.role, &self.failure) {
            (Role::Prefill, Failure::ClientError { .. }) => "prefill_client_error",
            (Role::Decode, Failure::ClientError { .. }) => "decode_client_error",
            (Role::Worker, Failure::ClientError { .. }) => "worker_client_error",
            (Role::Prefill, _) => "prefill_error",
            (Role::Decode, _) => "decode_error",
            (Role::Worker, _) => "worker_error",
        }
    }

    /// Whether the worker is at fault (everything but a 4xx).
    pub fn is_worker_fault(&self) -> bool {
        !matches!(self.failure, Failure::ClientError { .. })
    }

    /// Whether the worker could not be reached at all (it is likely down).
    pub fn is_unreachable(&self) -> bool {
        matches!(self.failure, Failure::Unreachable(_))
    }

    /// The message for people.
    pub fn message(&self) -> String {
        let who = format!("{} {}", self.role.worker_noun(), self.worker);
        match &self.failure {
            Failure::Unreachable(why) => format!("{who} could not be reached: {why}"),
            Failure::ServerError { status, body } => format!("{who} answered {status}: {body}"),
            Failure::ClientError { status, .. } => format!("{who} answered {status}"),
            Failure::Body(why) => format!("{who} broke off its answer: {why}"),
            Failure::NotJson(start) => {
                format!("{who} answered something that is not JSON: {start:?}")
            }
        }
    }

    /// The router's error for this failure as an [`ApiError`] (a 502; a 4xx keeps its status).
    pub fn api_error(&self) -> ApiError {
        let status = match &self.failure {
            Failure::ClientError { status, .. } => *status,
            _ => StatusCode::BAD_GATEWAY,
        };
        ApiError {
            status,
            message: self.message(),
            param: None,
            code: self.error_type(),
        }
    }

    /// The answer the router's client gets.
    pub fn into_response(self) -> Response {
        match self.failure {
            Failure::ClientError { status, body } => (
                status,
                [(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                )],
                body,
            )
                .into_response(),
            _ => self.api_error().into_response(),
        }
    }

    /// The server-sent event that ends a stream this failure broke.
    pub fn sse_event(&self) -> Bytes {
        Bytes::from(format!("data: {}\n\n", self.api_error().body()))
    }
}

/// A failure of `worker` in `role`.
pub fn upstream_error(role: Role, worker: &WorkerUrl, failure: Failure) -> UpstreamError {
    UpstreamError {
        role,
        worker: worker.base().to_string(),
        failure,
    }
}

/// `e` with its causes (reqwest's own message says only "error sending request").
pub fn describe(e: &reqwest::Error) -> String {
    let mut s = if e.is_timeout() {
        "timed out".to_string()
    } else {
        e.to_string()
    };
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The start of a body, for a message (at most 300 bytes, lossy UTF-8).
pub fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let mut end = text.len().min(QUOTED_BODY);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut s = text[..end].trim().to_string();
    if end < text.len() {
        s.push('…');
    }
    s
}

/// One request to a worker: `POST {worker}{path}` with a JSON `body`.
#[derive(Debug, Clone)]
pub struct Call {
    /// The router's HTTP client (its connect and read timeouts apply).
    pub client: reqwest::Client,
    /// Prefill or decode.
    pub role: Role,
    /// The worker.
    pub worker: WorkerUrl,
    /// The endpoint, e.g. `/generate`.
    pub path: &'static str,
    /// The client's `Authorization` header, passed on.
    pub auth: Option<HeaderValue>,
}

impl Call {
    fn fail(&self, failure: Failure) -> UpstreamError {
        upstream_error(self.role, &self.worker, failure)
    }

    /// Sends `body` and waits for the response headers; a non-2xx answer is an error (its
    /// body read first).
    pub async fn send(self, body: Vec<u8>) -> Result<(Self, reqwest::Response), UpstreamError> {
        let mut req = self
            .client
            .post(self.worker.join(self.path))
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(auth) = &self.auth {
            req = req.header(header::AUTHORIZATION, auth.clone());
        }
        let resp = req
            .send()
            .await
            .map_err(|e| self.fail(Failure::Unreachable(describe(&e))))?;
        let status = resp.status();
        if status.is_success() {
            return Ok((self, resp));
        }
        let body = resp.bytes().await.unwrap_or_default();
        Err(if status.is_client_error() {
            let status = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_REQUEST);
            self.fail(Failure::ClientError { status, body })
        } else {
            self.fail(Failure::ServerError {
                status,
                body: quote(&body),
            })
        })
    }

    /// Sends `body` and reads the whole answer as JSON.
    pub async fn post_json(self, body: Vec<u8>) -> Result<Value, UpstreamError> {
        let (call, resp) = self.send(body).await?;
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| call.fail(Failure::Body(describe(&e))))?;
        serde_json::from_slice(&bytes).map_err(|_| call.fail(Failure::NotJson(quote(&bytes))))
    }

    /// A failure of this call's worker (for errors found after [`Call::send`]).
    pub fn error(&self, failure: Failure) -> UpstreamError {
        self.fail(failure)
    }

    /// Describes a body-read error of this call's worker.
    pub fn body_error(&self, e: &reqwest::Error) -> UpstreamError {
        self.fail(Failure::Body(describe(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_role_and_the_worker() {
        let w = WorkerUrl::parse("http://127.0.0.1:9").unwrap();
        let status = StatusCode::INTERNAL_SERVER_ERROR;
        let e = upstream_error(
            Role::Prefill,
            &w,
            Failure::ServerError {
                status,
                body: quote(b"boom"),
            },
        );
        assert_eq!(
            e.message(),
            "prefill worker http://127.0.0.1:9 answered 500 Internal Server Error: boom"
        );
        assert_eq!(e.api_error().status, StatusCode::BAD_GATEWAY);
        assert_eq!(e.error_type(), "prefill_error");
        let e = upstream_error(Role::Decode, &w, Failure::NotJson(quote(b"<html>")));
        assert_eq!(
            e.message(),
            "decode worker http://127.0.0.1:9 answered something that is not JSON: \"<html>\""
        );
        let long = "é".repeat(400);
        assert!(quote(long.as_bytes()).ends_with('…'));
    }
}
