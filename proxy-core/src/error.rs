//! Error types.
//!
//! A variant that wraps a lower error returns it from `source()` and does not print it in its
//! message, which says only what failed at its own level: print the whole chain (each `source()`
//! in turn) where an error is shown. `cargo xtask errors` checks this rule.
//!
//! Three families, one per moment a thing can go wrong:
//!
//! * [`ConfigError`]: a configuration that can never work (unparsable address, zero limit,
//!   reversed port range). Returned when the configuration is built or added, never later.
//! * [`ConnectError`]: reaching an upstream failed for one client connection (DNS, refused,
//!   timeout, nothing healthy). It closes that connection and is counted; it never stops a
//!   listener.
//! * [`ServerError`]: an operation on the [`ProxyServer`](crate::server::ProxyServer) failed
//!   (bind, unknown listener, shutting down).
//! * [`HttpConnectError`]: tunnelling through an HTTP proxy failed (also re-exported as
//!   `http_connect::HttpConnectError`). It lives here, with the others, so this module depends
//!   on no other module of the crate.
//!
//! Errors *during* a relay (reset, broken pipe) are not errors of this crate: they are reported
//! as an [`Ending`](crate::relay::Ending) in the relay summary.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

/// A configuration value that can never work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text is neither `ip:port` nor `host:port`.
    #[error("invalid address {input:?}: {reason}")]
    InvalidAddress {
        /// The text that was given.
        input: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// A limit, size or duration that must be positive is zero.
    #[error("{what} must be greater than zero")]
    Zero {
        /// The name of the setting.
        what: &'static str,
    },
    /// A port range whose start lies after its end.
    #[error("port range {start}-{end} is reversed")]
    ReversedPortRange {
        /// First port.
        start: u16,
        /// Last port.
        end: u16,
    },
    /// An upstream set without any target.
    #[error("an upstream set needs at least one target")]
    NoTargets,
    /// Two settings contradict each other.
    #[error("inconsistent configuration: {0}")]
    Inconsistent(&'static str),
    /// A data path name other than `auto`, `event-loop` or `tokio`.
    #[error("invalid data path {input:?}: expected auto, event-loop or tokio")]
    InvalidDataPath {
        /// The text that was given.
        input: String,
    },
}

/// Reaching the upstream failed for one client connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The host name could not be resolved, or resolved to no address.
    #[error("cannot resolve {target}")]
    Resolve {
        /// The target as configured.
        target: String,
        /// The resolver's error.
        #[source]
        cause: io::Error,
    },
    /// The connect did not complete within the connect timeout.
    #[error("connect to {target} timed out after {after:?}")]
    Timeout {
        /// The target as configured.
        target: String,
        /// The timeout that fired.
        after: Duration,
    },
    /// The connect failed (refused, unreachable, ...).
    #[error("connect to {target} failed")]
    Io {
        /// The target as configured.
        target: String,
        /// The socket error.
        #[source]
        cause: io::Error,
    },
    /// Every target of an upstream set is marked unhealthy.
    #[error("no healthy target among {targets} configured")]
    NoHealthyTarget {
        /// How many targets the set has.
        targets: usize,
    },
    /// Every healthy target was tried and none could be reached; `last` is the last failure.
    #[error("all {tried} healthy targets failed, the last one")]
    AllTargetsFailed {
        /// How many targets were tried.
        tried: usize,
        /// The last failure.
        #[source]
        last: Box<ConnectError>,
    },
    /// The HTTP proxy in front of the upstream could not open a tunnel to it.
    #[error(transparent)]
    HttpProxy {
        /// What went wrong with the proxy.
        cause: Box<HttpConnectError>,
    },
    /// The PROXY protocol header could not be written to the upstream.
    #[error("writing the PROXY protocol header to {target} failed")]
    ProxyHeader {
        /// The upstream address.
        target: SocketAddr,
        /// The socket error.
        #[source]
        cause: io::Error,
    },
}

impl ConnectError {
    /// True when the failure is a timeout (directly or as the last failure of a failover).
    pub fn is_timeout(&self) -> bool {
        match self {
            ConnectError::Timeout { .. } => true,
            ConnectError::AllTargetsFailed { last, .. } => last.is_timeout(),
            ConnectError::HttpProxy { cause } => cause.is_timeout(),
            _ => false,
        }
    }
}

/// An operation on the proxy server failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listening socket could not be created.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        cause: io::Error,
    },
    /// A listener is already bound to this address by this server.
    #[error("a listener on {0} already exists")]
    ListenerExists(SocketAddr),
    /// No listener is bound to this address by this server.
    #[error("no listener on {0}")]
    UnknownListener(SocketAddr),
    /// Every port of the range is taken.
    #[error("no free port in {start}-{end}")]
    NoFreePort {
        /// First port of the range.
        start: u16,
        /// Last port of the range.
        end: u16,
    },
    /// The server is shutting down and accepts no new listener.
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The accept workers' threads or runtimes could not be started.
    #[error("cannot start the accept workers")]
    Workers(#[source] io::Error),
}

/// Tunnelling through an HTTP proxy failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HttpConnectError {
    /// The proxy URL cannot be used (the password, if any, is masked in `input`).
    #[error("invalid HTTP proxy URL {input:?}: {reason}")]
    InvalidProxyUrl {
        /// The URL as given, password masked.
        input: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// An extra header cannot be sent.
    #[error("invalid HTTP proxy header {name:?}: {reason}")]
    InvalidHeader {
        /// The header name as given.
        name: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The proxy itself could not be reached.
    #[error("cannot reach the HTTP proxy {proxy}")]
    Connect {
        /// The proxy.
        proxy: String,
        /// The connect failure.
        #[source]
        cause: ConnectError,
    },
    /// The connection to the proxy broke during the exchange.
    #[error("the connection to the HTTP proxy {proxy} broke")]
    Io {
        /// The proxy.
        proxy: String,
        /// The socket error.
        #[source]
        cause: io::Error,
    },
    /// No tunnel within the timeout.
    #[error("no tunnel to {target} through the HTTP proxy {proxy} within {after:?}")]
    Timeout {
        /// The proxy.
        proxy: String,
        /// The target asked for.
        target: String,
        /// The timeout that fired.
        after: Duration,
    },
    /// The proxy answered 407 (or 401): it wants credentials, or refused the ones sent.
    #[error(
        "the HTTP proxy {proxy} requires credentials{}: it answered {status_line:?}",
        if *credentials_sent { " and refused the ones given" } else { " (put user:password@ in the proxy URL)" }
    )]
    CredentialsRequired {
        /// The proxy.
        proxy: String,
        /// The proxy's status line, e.g. `HTTP/1.1 407 Proxy Authentication Required`.
        status_line: String,
        /// Whether credentials were sent.
        credentials_sent: bool,
    },
    /// The proxy answered with another non-2xx status (403: not allowed to go there, 502: the
    /// target could not be reached, ...).
    #[error("the HTTP proxy {proxy} refused CONNECT {target}: it answered {status_line:?}")]
    Refused {
        /// The proxy.
        proxy: String,
        /// The target asked for.
        target: String,
        /// The proxy's status line.
        status_line: String,
    },
    /// The proxy's answer is not HTTP, or too long.
    #[error("the HTTP proxy {proxy} gave an unusable answer: {reason}")]
    BadResponse {
        /// The proxy.
        proxy: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl HttpConnectError {
    /// True when the failure is a timeout (of the tunnel or of reaching the proxy).
    pub fn is_timeout(&self) -> bool {
        match self {
            HttpConnectError::Timeout { .. } => true,
            HttpConnectError::Connect { cause, .. } => cause.is_timeout(),
            _ => false,
        }
    }
}

/// An error and its causes on one line, `": "` between them: what a log line shows, since each
/// message leaves its cause to `source()`.
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
