//! The error type of this crate: what starting a binary's process can fail with, beyond the
//! framework's own errors.
//!
//! As in every crate of the workspace, a variant with a cause returns it from `source()` and does
//! not print it; [`error_chain`](crate::error_chain) prints the whole chain.

/// Everything the runtime can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The framework failed (signal handlers, a Kubernetes call). Transparent: the framework's
    /// error already says what failed.
    #[error(transparent)]
    Framework(#[from] k8s_reconcile::Error),
    /// A Kubernetes client could not be built from its configuration. Transparent, as the
    /// framework's own `Kube` variant.
    #[error(transparent)]
    Kube(kube::Error),
    /// The operations HTTP server could not listen or serve.
    #[error("operations server on {addr} failed")]
    Serve {
        /// The address it tried to use.
        addr: std::net::SocketAddr,
        /// The underlying error.
        #[source]
        cause: std::io::Error,
    },
    /// The TLS set-up of the secure metrics server failed: its certificate files could not be
    /// loaded, or no server configuration could be made.
    #[error("metrics server TLS ({what})")]
    MetricsTls {
        /// What was being set up, e.g. the flags of the files.
        what: String,
        /// Why it failed.
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A binary's REST API could not listen.
    #[error("cannot listen on {addr} for the API")]
    ApiBind {
        /// The address it tried to use.
        addr: std::net::SocketAddr,
        /// The underlying error.
        #[source]
        cause: std::io::Error,
    },
    /// No Kubernetes client configuration could be loaded.
    #[error("cannot load the Kubernetes client configuration ({origin})")]
    ClientConfig {
        /// Where it was looked for.
        origin: String,
        /// Why it failed.
        #[source]
        cause: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}
