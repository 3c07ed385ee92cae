//! The error type of this crate.
//!
//! A variant that wraps a lower error returns it from `source()` and does not print it in its
//! message, which says only what failed at this level; a binary prints the whole chain
//! (the crate docs' "Errors" section has the rule, `cargo xtask errors` checks it).

/// Everything the framework can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A Kubernetes API call failed. Transparent: kube's message already says what the call
    /// was refused for, and a caller that shows only this level (a status condition) keeps it.
    #[error(transparent)]
    Kube(kube::Error),
    /// An object could not be turned into JSON.
    #[error("cannot serialize an object")]
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
    /// Signal handlers could not be installed.
    #[error("cannot install signal handlers")]
    Signal(#[source] std::io::Error),
    /// Adding or removing a finalizer failed.
    #[error("adding or removing a finalizer failed")]
    Finalizer(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
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
