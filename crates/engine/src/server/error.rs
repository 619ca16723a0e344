//! API errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every
//! endpoint, and [`JsonBody`], the JSON extractor whose failures say which field is wrong.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde_json::json;

/// An API error: HTTP status, a message for people, the request field it is about (if one)
/// and a machine-readable code.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    /// What is wrong.
    pub message: String,
    /// The request field at fault (OpenAI's `param`), dotted for nested fields.
    pub param: Option<String>,
    /// OpenAI-style code: `invalid_json`, `invalid_value`, `context_length_exceeded`,
    /// `unsupported_parameter`, `invalid_api_key`, `queue_full`, `engine_stopped`, …
    pub code: &'static str,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::bad_request("invalid_value", message).param(param)
    }

    /// A 400 with `code` and no particular field.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
            code,
        }
    }

    /// A 400 for a parameter this server does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request("unsupported_parameter", message).param(param)
    }

    /// A 503: the engine cannot take the request now.
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
            code,
        }
    }

    /// The same error about `param`.
    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// The engine's refusal of a request (`Event::Rejected`): a full queue is a 503, the rest
    /// is bad input.
    pub fn rejected(message: String) -> Self {
        if message.contains("queue is full") {
            Self::unavailable("queue_full", message)
        } else if message.contains("shutting down") || message.contains("engine error") {
            Self::unavailable("engine_stopped", message)
        } else if message.starts_with(crate::disagg::TRANSFER_FAILED) {
            ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                code: "kv_transfer_failed",
                ..Self::bad_request("kv_transfer_failed", message)
            }
        } else {
            Self::bad_request("invalid_value", message)
        }
    }

    /// OpenAI's error `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "server_busy",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// A JSON request body of type `T`. Unlike axum's `Json` it needs no `Content-Type` header,
/// and a failure names the field: `` `sampling_params.max_new_tokens`: invalid type … ``.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::bad_request("invalid_body", e.body_text()))?;
        parse_json(&bytes).map(JsonBody)
    }
}

/// Parses `bytes` as a `T`, naming the field of a type error.
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let syntax = |e: serde_json::Error| {
        ApiError::bad_request("invalid_json", format!("the body is not valid JSON: {e}"))
    };
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            syntax(inner)
        } else {
            field_error(&path, &inner.to_string())
        }
    })?;
    de.end().map_err(syntax)?;
    Ok(value)
}

/// A 400 for a value that does not fit its field (`path` as serde_path_to_error prints it;
/// `.` is the body itself).
pub fn field_error(path: &str, message: &str) -> ApiError {
    if path == "." || path.is_empty() {
        ApiError::bad_request("invalid_value", format!("invalid request: {message}"))
    } else {
        ApiError::invalid(path, format!("`{path}`: {message}"))
    }
}
