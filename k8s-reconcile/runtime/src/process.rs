//! The process around a binary's work: who it is, how it runs, how it ends.

use std::error::Error as StdError;
use std::future::Future;
use std::num::NonZeroUsize;
use std::path::Path;
use std::process::ExitCode;

use prometheus_client::registry::Registry;

use crate::Error;

pub mod metrics;

/// Exit code of a failure at run time.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code of invalid flags or configuration, as clap's own errors.
pub const EXIT_USAGE: u8 = 2;

/// This replica's leader-election identity: `explicit` (a flag) when given, else `POD_NAME`, else
/// the host name, else `<binary>-<pid>`. Two replicas must never share it, and in a cluster the
/// pod name is unique and tells an operator who holds a Lease.
pub fn leader_identity(explicit: Option<&str>, binary: &str) -> String {
    let non_empty = |s: String| {
        let s = s.trim().to_owned();
        (!s.is_empty()).then_some(s)
    };
    explicit
        .map(str::to_owned)
        .and_then(non_empty)
        .or_else(|| std::env::var("POD_NAME").ok().and_then(non_empty))
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .and_then(non_empty)
        })
        .unwrap_or_else(|| format!("{binary}-{}", std::process::id()))
}

/// The namespace of this Pod, from its ServiceAccount mount; `None` outside a cluster.
pub fn own_namespace() -> Option<String> {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// `error` and each of its causes (`source()` in turn), joined by `": "`.
///
/// Error types that follow the crate docs' rule (a message leaves its cause to `source()`) show
/// each cause once; one that also prints its cause (some third-party errors do) shows it twice.
pub fn error_chain(error: &(dyn StdError + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        text.push_str(": ");
        text.push_str(&current.to_string());
        cause = current.source();
    }
    text
}

/// Prints a fatal error chain once, through the log when logging is set up (so JSON log pipelines
/// see it), else on stderr, and returns [`EXIT_FAILURE`].
fn fail(binary: &str, error: &(dyn StdError + 'static)) -> ExitCode {
    let chain = error_chain(error);
    if tracing::dispatcher::has_been_set() {
        tracing::error!(error = %chain, "{binary} failed");
    } else {
        eprintln!("{binary}: error: {chain}");
    }
    ExitCode::from(EXIT_FAILURE)
}

/// The exit code of a run's result, printing a failure with [`error_chain`].
pub fn exit_with<E>(binary: &str, result: Result<(), E>) -> ExitCode
where
    E: Into<Box<dyn StdError + Send + Sync + 'static>>,
{
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let error: Box<dyn StdError + Send + Sync + 'static> = error.into();
            fail(binary, error.as_ref())
        }
    }
}

/// Reports invalid flags or configuration the way clap does and returns [`EXIT_USAGE`].
pub fn usage_error(message: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {message}\n\nFor more information, try '--help'.");
    ExitCode::from(EXIT_USAGE)
}

/// Runs `work` on a multi-threaded runtime (one worker per CPU, or `TOKIO_WORKER_THREADS`) and
/// turns its result into the exit code.
pub fn block_on<F, E>(binary: &str, work: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Into<Box<dyn StdError + Send + Sync + 'static>>,
{
    block_on_threads(binary, None, work)
}

/// As [`block_on`] with a thread count: `1` is one event loop on the calling thread (tokio's
/// current-thread runtime, like HAProxy's `nbthread 1`: no hand-offs between workers), more is a
/// multi-threaded runtime with that many workers, `None` is [`block_on`]'s default.
pub fn block_on_threads<F, E>(binary: &str, threads: Option<NonZeroUsize>, work: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: Into<Box<dyn StdError + Send + Sync + 'static>>,
{
    let mut builder = match threads.map(NonZeroUsize::get) {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(workers) => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            builder.worker_threads(workers);
            builder
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    match builder.enable_all().build() {
        Ok(runtime) => exit_with(binary, runtime.block_on(work)),
        Err(error) => fail(binary, &error),
    }
}

/// A metrics registry for the binary `binary` at `version`, holding what every binary exports:
/// the `process_*` metrics ([`metrics`]) and `<binary>_build_info`
/// ([`k8s_reconcile::metrics::register_build_info`], dashes in the name become underscores).
pub fn metrics_registry(binary: &str, version: &str) -> Registry {
    let mut registry = Registry::default();
    metrics::register(&mut registry);
    k8s_reconcile::metrics::register_build_info(&mut registry, &binary.replace('-', "_"), version);
    registry
}

/// A client from `kubeconfig` when given, else the usual inference (in-cluster, `KUBECONFIG`,
/// `~/.kube/config`).
pub async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client, Error> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path).map_err(|source| {
                Error::ClientConfig {
                    origin: format!("reading {}", path.display()),
                    cause: Box::new(source),
                }
            })?;
            kube::Config::from_custom_kubeconfig(file, &Default::default())
                .await
                .map_err(|source| Error::ClientConfig {
                    origin: path.display().to_string(),
                    cause: Box::new(source),
                })?
        }
        None => kube::Config::infer()
            .await
            .map_err(|source| Error::ClientConfig {
                origin: "no kubeconfig given and not in a cluster".to_owned(),
                cause: Box::new(source),
            })?,
    };
    kube::Client::try_from(config).map_err(Error::Kube)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("starting")]
    struct Outer(#[source] std::io::Error);

    /// An error that prints its cause and returns it too, as some third-party ones do.
    #[derive(Debug)]
    struct Repeats(std::io::Error);

    impl std::fmt::Display for Repeats {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "starting: {}", self.0)
        }
    }

    impl StdError for Repeats {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn the_chain_is_each_source_in_turn() {
        let io = || std::io::Error::other("port taken");
        assert_eq!(error_chain(&Outer(io())), "starting: port taken");
        // No matching of texts: a type that breaks the rule shows its cause twice.
        assert_eq!(
            error_chain(&Repeats(io())),
            "starting: port taken: port taken"
        );
    }

    #[test]
    fn an_explicit_identity_wins() {
        assert_eq!(leader_identity(Some("pod-a"), "bin"), "pod-a");
        assert!(!leader_identity(Some("  "), "bin").is_empty());
    }
}
