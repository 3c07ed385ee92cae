//! The error type of this crate (except the [`testing`](crate::testing) module's own).
//!
//! A variant that wraps a lower error prints it in its message and does not also return it from
//! `source()`, so a printed chain shows each cause once.

/// Everything the framework can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {0}")]
    Kube(kube::Error),
    /// An object could not be turned into JSON.
    #[error("serializing an object: {0}")]
    Serialize(serde_json::Error),
    /// An object handed to the framework cannot be used (e.g. it has no name).
    #[error("invalid object: {0}")]
    InvalidObject(String),
    /// A configuration value is impossible (e.g. lease timings that do not nest).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// An operation did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// The operations HTTP server could not listen or serve.
    #[error("operations server on {addr}: {cause}")]
    Serve {
        /// The address it tried to use.
        addr: std::net::SocketAddr,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// The TLS set-up of the secure metrics server failed: its certificate files could not be
    /// loaded, or no server configuration could be made.
    #[error("metrics server TLS ({what}): {}", chain(cause.as_ref()))]
    MetricsTls {
        /// What was being set up, e.g. the flags of the files.
        what: String,
        /// Why it failed.
        cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A binary's REST API could not listen.
    #[error("cannot listen on {addr} for the API: {cause}")]
    ApiBind {
        /// The address it tried to use.
        addr: std::net::SocketAddr,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("installing signal handlers: {0}")]
    Signal(std::io::Error),
    /// No Kubernetes client configuration could be loaded.
    #[error("loading the Kubernetes client configuration ({origin}): {cause}")]
    ClientConfig {
        /// Where it was looked for.
        origin: String,
        /// Why it failed.
        cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// Adding or removing a finalizer failed.
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// `error` and its causes on one line, for a wrapped error whose reason is in its own source
/// (a PEM file's parse error, say).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        text.push_str(": ");
        text.push_str(&current.to_string());
        cause = current.source();
    }
    text
}
