//! Typed errors of the crate, with the engine error codes and a retry classification.
//!
//! Every error type of the crate lives here, [`FrameError`] and [`DatagramError`] too (also
//! re-exported by `frame` and `datagram`), so this module depends on nothing but [`proto`].
//!
//! A variant that wraps a lower error prints it in its message and does not also return it from
//! `source()`, so a printed chain shows each cause once.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::proto::{self, MAX_DATAGRAM_LEN, MAX_FRAME_LEN};

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An engine error code (`Error.code` on the wire). Unknown values are kept in [`EngineErrorCode::Other`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EngineErrorCode {
    /// 0: no code.
    Unspecified,
    /// 1000: bad, expired or insufficient credential.
    Unauthorized,
    /// 2000: bad options.
    InvalidRequest,
    /// 2010: protocol version missing.
    ProtocolVersionMissing,
    /// 2020: protocol version invalid.
    ProtocolVersionInvalid,
    /// 2030: protocol version incompatible.
    ProtocolVersionIncompatible,
    /// 3000: private dial target missing.
    TunnelNotFound,
    /// 4000: bad or expired stream.
    InvalidStream,
    /// 5000: plan or feature not available.
    FeatureNotAvailable,
    /// 6000: dependency unavailable.
    ServiceUnavailable,
    /// 7000: engine capacity exhausted.
    CapacityExhausted,
    /// 9000: engine internal error.
    Internal,
    /// Any other value.
    Other(i32),
}

impl EngineErrorCode {
    /// Converts from the raw wire value.
    pub fn from_i32(value: i32) -> Self {
        match proto::ErrorCode::try_from(value) {
            Ok(proto::ErrorCode::Unspecified) => Self::Unspecified,
            Ok(proto::ErrorCode::Unauthorized) => Self::Unauthorized,
            Ok(proto::ErrorCode::InvalidRequest) => Self::InvalidRequest,
            Ok(proto::ErrorCode::ProtocolVersionMissing) => Self::ProtocolVersionMissing,
            Ok(proto::ErrorCode::ProtocolVersionInvalid) => Self::ProtocolVersionInvalid,
            Ok(proto::ErrorCode::ProtocolVersionIncompatible) => Self::ProtocolVersionIncompatible,
            Ok(proto::ErrorCode::TunnelNotFound) => Self::TunnelNotFound,
            Ok(proto::ErrorCode::InvalidStream) => Self::InvalidStream,
            Ok(proto::ErrorCode::FeatureNotAvailable) => Self::FeatureNotAvailable,
            Ok(proto::ErrorCode::ServiceUnavailable) => Self::ServiceUnavailable,
            Ok(proto::ErrorCode::CapacityExhausted) => Self::CapacityExhausted,
            Ok(proto::ErrorCode::Internal) => Self::Internal,
            Err(_) => Self::Other(value),
        }
    }

    /// The raw wire value.
    pub fn as_i32(self) -> i32 {
        match self {
            Self::Unspecified => 0,
            Self::Unauthorized => 1000,
            Self::InvalidRequest => 2000,
            Self::ProtocolVersionMissing => 2010,
            Self::ProtocolVersionInvalid => 2020,
            Self::ProtocolVersionIncompatible => 2030,
            Self::TunnelNotFound => 3000,
            Self::InvalidStream => 4000,
            Self::FeatureNotAvailable => 5000,
            Self::ServiceUnavailable => 6000,
            Self::CapacityExhausted => 7000,
            Self::Internal => 9000,
            Self::Other(v) => v,
        }
    }
}

impl fmt::Display for EngineErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_i32())
    }
}

/// The message the engine uses when a stable hostname is still held by a previous tunnel (transient).
pub const HOSTNAME_IN_USE: &str = "Hostname is already in use.";

/// Errors of the rstream client (and of the local engine).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The engine answered with an error.
    #[error("rstream engine error {code}: {message}")]
    Engine {
        /// The engine error code.
        code: EngineErrorCode,
        /// The engine message (or a placeholder when absent).
        message: String,
    },
    /// A frame could not be read or written.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer violated the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// TCP or TLS connection establishment failed.
    #[error("cannot connect to {addr}")]
    Connect {
        /// The address dialed.
        addr: String,
        /// The cause.
        #[source]
        cause: Arc<std::io::Error>,
    },
    /// An I/O error on an established connection (transparent: the I/O error says it all).
    #[error(transparent)]
    Io(Arc<std::io::Error>),
    /// An operation did not complete in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The control channel is closed.
    #[error("control channel closed")]
    ControlClosed,
    /// Nothing was received on the control channel for the negotiated liveness timeout.
    #[error("control channel liveness timeout: nothing received for {0:?}")]
    ControlLiveness(Duration),
    /// Too many inbound stream requests are queued.
    #[error("control channel overloaded: {0}")]
    ControlOverload(String),
    /// The tunnel is closed.
    #[error("tunnel closed")]
    TunnelClosed,
    /// A private dial or a proxy data connection failed.
    #[error("dial failed: {0}")]
    Dial(String),
    /// The engine address is invalid.
    #[error("invalid engine address: {0}")]
    InvalidEngine(String),
    /// Neither an engine address nor a project endpoint is configured.
    #[error("an engine address or a project endpoint is required")]
    EngineRequired,
    /// Token and mTLS authentication were both configured.
    #[error("token authentication and mTLS authentication cannot be used together")]
    AuthConflict,
    /// The token's `exp` claim is in the past.
    #[error("authentication token has expired")]
    TokenExpired,
    /// The requested region is not available for the project.
    #[error("region '{region}' is not available for this project (available: {})", available.join(", "))]
    RegionUnavailable {
        /// The requested region.
        region: String,
        /// Regions the project offers.
        available: Vec<String>,
    },
    /// Several regional endpoints match the requested region.
    #[error("region '{0}' is ambiguous for this project")]
    RegionAmbiguous(String),
    /// The region name is malformed or cannot be used here.
    #[error("invalid region: {0}")]
    InvalidRegion(String),
    /// The control plane answered with a non-2xx status.
    #[error("control plane HTTP error {status}: {body}")]
    ApiHttp {
        /// HTTP status code.
        status: u16,
        /// Response body (truncated).
        body: String,
    },
    /// The control plane response is not usable.
    #[error("invalid control plane response: {reason}")]
    ApiInvalidResponse {
        /// What is wrong with it.
        reason: String,
        /// The JSON decoder's or the body reader's error, when one is the cause.
        #[source]
        cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// The engine address could not be derived from the project.
    #[error("engine resolution failed: {reason}")]
    EngineResolution {
        /// Why.
        reason: String,
        /// The error of the address the project gave, when one is the cause.
        #[source]
        cause: Option<Arc<Error>>,
    },
    /// The tunnel is invalid (e.g. nothing to display).
    #[error("invalid tunnel: {0}")]
    InvalidTunnel(String),
    /// The tunnel options violate the client-side rules.
    #[error("invalid tunnel options: {0}")]
    InvalidTunnelOptions(String),
    /// A datagram stream failed (oversized or truncated record, I/O).
    #[error(transparent)]
    Datagram(#[from] DatagramError),
    /// The feature is not supported by this client (QUIC transport, `quic` tunnels, HTTP/3).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The configuration is invalid (TLS files, timeouts, ...).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The HTTP proxy could not open a tunnel (unreachable, refused `CONNECT`, wants
    /// credentials, timed out).
    #[error(transparent)]
    Proxy {
        /// What the proxy (or the way to it) did.
        cause: Arc<proxy_core::http_connect::HttpConnectError>,
    },
}

impl Error {
    /// Builds an engine error from a wire error.
    pub fn from_proto(error: &proto::Error) -> Self {
        Error::Engine {
            code: EngineErrorCode::from_i32(error.code),
            message: error
                .message
                .clone()
                .unwrap_or_else(|| "Engine error.".to_owned()),
        }
    }

    pub(crate) fn proxy(error: proxy_core::http_connect::HttpConnectError) -> Self {
        Error::Proxy {
            cause: Arc::new(error),
        }
    }

    /// Whether this is a timeout, of a dial or of an operation (a proxy's included).
    pub fn is_timeout(&self) -> bool {
        match self {
            Error::Timeout(_) => true,
            Error::Proxy { cause } => cause.is_timeout(),
            _ => false,
        }
    }

    pub(crate) fn io(error: std::io::Error) -> Self {
        Error::Io(Arc::new(error))
    }

    pub(crate) fn connect(addr: impl Into<String>, error: std::io::Error) -> Self {
        Error::Connect {
            addr: addr.into(),
            cause: Arc::new(error),
        }
    }

    /// The engine error code, if this is an engine error.
    pub fn engine_code(&self) -> Option<EngineErrorCode> {
        match self {
            Error::Engine { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether retrying (with a new connection) may succeed.
    ///
    /// Transport failures, timeouts, liveness loss and the engine codes 6000/7000/9000 are retryable,
    /// as is `INVALID_REQUEST` with the message "Hostname is already in use." (transient after a reconnect).
    /// Credentials, validation, protocol violations and configuration errors are not.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Engine { code, message } => match code {
                EngineErrorCode::ServiceUnavailable
                | EngineErrorCode::CapacityExhausted
                | EngineErrorCode::Internal => true,
                EngineErrorCode::InvalidRequest => message.trim() == HOSTNAME_IN_USE,
                _ => false,
            },
            Error::Frame(frame) => frame.is_transport(),
            Error::Connect { .. }
            | Error::Io(_)
            | Error::Timeout(_)
            | Error::ControlClosed
            | Error::ControlLiveness(_)
            | Error::ControlOverload(_)
            | Error::TunnelClosed
            | Error::Dial(_) => true,
            Error::ApiHttp { status, .. } => *status == 429 || *status >= 500,
            // The proxy's refusals and credential demands stay until someone changes them.
            Error::Proxy { cause } => matches!(
                cause.as_ref(),
                proxy_core::http_connect::HttpConnectError::Connect { .. }
                    | proxy_core::http_connect::HttpConnectError::Io { .. }
                    | proxy_core::http_connect::HttpConnectError::Timeout { .. }
            ),
            _ => false,
        }
    }
}

impl From<std::io::Error> for Error {
    fn from(error: std::io::Error) -> Self {
        Error::io(error)
    }
}

/// Frame-level errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The header announces (or the sender tried) a payload bigger than [`MAX_FRAME_LEN`].
    #[error("frame too large: {len} bytes (maximum {MAX_FRAME_LEN})")]
    TooLarge {
        /// The announced or attempted size.
        len: usize,
    },
    /// The payload is not a valid protobuf `Message`.
    #[error("malformed frame payload")]
    Decode(#[source] prost::DecodeError),
    /// The connection ended in the middle of a frame.
    #[error("connection closed in the middle of a frame ({got} of {expected} bytes)")]
    Truncated {
        /// Bytes needed (header + payload).
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// The connection ended cleanly before a frame started.
    #[error("connection closed by peer")]
    Closed,
}

impl FrameError {
    /// Whether this is a transport condition (EOF) rather than a protocol violation.
    pub fn is_transport(&self) -> bool {
        matches!(self, FrameError::Truncated { .. } | FrameError::Closed)
    }
}

/// Errors of datagram streams.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DatagramError {
    /// A datagram to send is larger than a record can carry; nothing was written.
    #[error("a {len}-byte datagram exceeds the {MAX_DATAGRAM_LEN}-byte record limit")]
    TooLarge {
        /// Its size.
        len: usize,
    },
    /// The peer announced a record larger than the limit (a protocol violation).
    #[error("the peer announced a {len}-byte datagram record (limit {MAX_DATAGRAM_LEN} bytes)")]
    RecordTooLarge {
        /// The announced size.
        len: u64,
    },
    /// The stream ended inside a record.
    #[error("the stream ended inside a datagram record ({received} of {expected} bytes received)")]
    Truncated {
        /// Bytes the record (length prefix included) needed.
        expected: usize,
        /// Bytes received.
        received: usize,
    },
    /// The underlying stream failed.
    #[error("datagram stream I/O failed")]
    Io(#[source] Arc<io::Error>),
}

impl From<io::Error> for DatagramError {
    fn from(error: io::Error) -> Self {
        Self::Io(Arc::new(error))
    }
}

/// An error and its causes on one line, `": "` between them: what a log line or a message to
/// the engine shows, since each message leaves its cause to `source()`.
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        text.push_str(": ");
        text.push_str(&current.to_string());
        cause = current.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_roundtrip_and_classify() {
        for raw in [
            0, 1000, 2000, 2010, 2020, 2030, 3000, 4000, 5000, 6000, 7000, 9000, 4242,
        ] {
            assert_eq!(EngineErrorCode::from_i32(raw).as_i32(), raw);
        }
        let e = |code: i32, m: &str| Error::Engine {
            code: EngineErrorCode::from_i32(code),
            message: m.into(),
        };
        assert!(!e(1000, "no").retryable());
        assert!(!e(2000, "bad").retryable());
        assert!(e(2000, HOSTNAME_IN_USE).retryable());
        assert!(!e(5000, "").retryable());
        assert!(e(6000, "").retryable());
        assert!(e(7000, "").retryable());
        assert!(e(9000, "").retryable());
        assert!(!e(4242, "").retryable());
        assert!(Error::ControlLiveness(Duration::from_secs(1)).retryable());
        assert!(!Error::Protocol("x".into()).retryable());
        assert!(!Error::TokenExpired.retryable());
        assert!(
            Error::ApiHttp {
                status: 503,
                body: String::new()
            }
            .retryable()
        );
        assert!(
            !Error::ApiHttp {
                status: 404,
                body: String::new()
            }
            .retryable()
        );
        assert_eq!(
            e(3000, "x").engine_code(),
            Some(EngineErrorCode::TunnelNotFound)
        );
    }
}
