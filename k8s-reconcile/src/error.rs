//! The error type of this crate (except the [`testing`](crate::testing) module's own).

/// Everything the framework can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("Kubernetes API call failed: {0}")]
    Kube(#[source] kube::Error),
    /// An object could not be turned into JSON.
    #[error("serializing an object: {0}")]
    Serialize(#[source] serde_json::Error),
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
    #[error("operations server on {addr}: {source}")]
    Serve {
        /// The address it tried to use.
        addr: std::net::SocketAddr,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Signal handlers could not be installed.
    #[error("installing signal handlers: {0}")]
    Signal(#[source] std::io::Error),
    /// Adding or removing a finalizer failed.
    #[error("finalizer: {0}")]
    Finalizer(String),
}
