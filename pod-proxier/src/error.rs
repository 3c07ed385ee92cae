//! What an API request can fail with, and how each failure is answered: an HTTP status and the
//! original's `{"code","msg","data"}` envelope.

use axum::Json;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde::Serialize;

use k8s_reconcile::auth::AuthError;
use netkit_runtime::error_chain;
use netkit_runtime::rest::RequestError;

/// `code` of a success (as the original).
pub const CODE_OK: i64 = 10000;
/// `code` of a request error (as the original).
pub const CODE_ERROR: i64 = 10001;
/// `code` of "not found" (as the original, for a missing pod or mapping).
pub const CODE_NOT_FOUND: i64 = 40004;
/// `code` of a missing or rejected credential.
pub const CODE_UNAUTHENTICATED: i64 = 40001;
/// `code` of a refused access.
pub const CODE_FORBIDDEN: i64 = 40003;
/// `code` of a failure of pod-proxier or the API server behind it.
pub const CODE_UNAVAILABLE: i64 = 50003;

/// The `msg` of a success (as the original).
pub const MSG_OK: &str = "operation succeeded";

/// Every way a request fails.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request is malformed or a value is out of range.
    #[error("{0}")]
    BadRequest(String),
    /// Authentication or authorization failed (the answer to a refusal also says what
    /// pod-proxier allows).
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// Allowed caller, but the target is outside what pod-proxier serves.
    #[error("{0}")]
    OutOfScope(String),
    /// The pod, Service or mapping does not exist; `data` names it.
    #[error("{msg}")]
    NotFound {
        /// The message.
        msg: String,
        /// The `code` (40004, or 10001 where the original used it).
        code: i64,
        /// What was looked for.
        data: Option<String>,
    },
    /// The target exists but cannot be mapped now (no IP, not running).
    #[error("{0}")]
    Conflict(String),
    /// The feature is off.
    #[error("{0}")]
    Disabled(String),
    /// Query or form fields, or the body, refused (400, or 413 over the size limit).
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The body's content type is not supported.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// No route.
    #[error("{0}")]
    NoRoute(String),
    /// Method not allowed.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The request took too long.
    #[error("the request did not complete within {0} seconds")]
    Timeout(u64),
    /// The Kubernetes API server failed.
    #[error("Kubernetes API call failed")]
    Kube(#[from] kube::Error),
}

/// Appended to a refusal.
const FORBIDDEN_HINT: &str = ": pod-proxier allows what `kubectl port-forward` would need";

impl ApiError {
    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Auth(AuthError::Forbidden { .. }) => StatusCode::FORBIDDEN,
            ApiError::Auth(AuthError::Unavailable(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Auth(_) => StatusCode::UNAUTHORIZED,
            ApiError::OutOfScope(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound { .. } | ApiError::NoRoute(_) | ApiError::Disabled(_) => {
                StatusCode::NOT_FOUND
            }
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Request(err) => err.status(),
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Timeout(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Kube(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The envelope's `code`.
    pub fn code(&self) -> i64 {
        match self {
            ApiError::NotFound { code, .. } => *code,
            ApiError::Auth(AuthError::Forbidden { .. }) | ApiError::OutOfScope(_) => CODE_FORBIDDEN,
            ApiError::Auth(AuthError::Unavailable(_)) => CODE_UNAVAILABLE,
            ApiError::Auth(_) => CODE_UNAUTHENTICATED,
            ApiError::Timeout(_) | ApiError::Kube(_) => CODE_UNAVAILABLE,
            _ => CODE_ERROR,
        }
    }
}

/// The `{"code","msg","data"}` envelope of every answer. The fields are in the order the
/// answers have always had on the wire (alphabetical, as a `serde_json` map wrote them).
#[derive(Debug, Serialize)]
struct Envelope<'a, T> {
    code: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<T>,
    msg: &'a str,
}

/// A JSON envelope with `status`.
pub fn envelope<T: Serialize>(
    status: StatusCode,
    code: i64,
    msg: &str,
    data: Option<T>,
) -> Response {
    let body = Envelope { code, data, msg };
    let mut response = (status, Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            http::HeaderValue::from_static("Bearer"),
        );
    }
    response
}

/// A success envelope.
pub fn ok<T: Serialize>(data: T) -> Response {
    envelope(StatusCode::OK, CODE_OK, MSG_OK, Some(data))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let data = match &self {
            ApiError::NotFound { data, .. } => data.clone(),
            _ => None,
        };
        if matches!(
            self,
            ApiError::Kube(_) | ApiError::Auth(AuthError::Unavailable(_))
        ) {
            tracing::warn!(error = %error_chain(&self), "request failed on the API server side");
        }
        // The whole chain: a client sees why (the parser's reason, the API server's answer).
        let mut msg = error_chain(&self);
        if matches!(self, ApiError::Auth(AuthError::Forbidden { .. })) {
            msg.push_str(FORBIDDEN_HINT);
        }
        envelope(self.status(), self.code(), &msg, data)
    }
}
