//! The process runtime of this workspace's three binaries (steward-tcp-proxy, rstream-operator,
//! pod-proxier), so each `main` is only its own wiring: flags, logging, the operations and REST
//! servers, the shutdown signal, exit codes and the Kubernetes client. The reconciler framework
//! itself is `k8s-reconcile`, which this crate builds on.
//!
//! Unpublished (`publish = false`): its shape follows what these binaries need and changes with
//! them, so it makes no promise to other users; a controller written on `k8s-reconcile` alone
//! pulls neither a CLI parser nor a web stack.
//!
//! # Layout
//!
//! * [`logging`]: one [`LogFormat`] and one filter precedence (`RUST_LOG`, then the binary's
//!   level flag, then `info`), always on stderr.
//! * [`values`]: flag values: Go durations and booleans, listen addresses, DNS names.
//! * [`flags`]: Go's syntax for boolean flags (`--flag`, `--flag=false`) on any clap command;
//!   parse with [`parse_args`].
//! * [`rest`]: a binary's REST API: a server bounded against slow and abusive clients, strict
//!   query and form fields, request bodies under a size limit.
//! * [`builder`]: [`App::builder`], which owns the metrics registry, the readiness checks, the
//!   operations server and the shutdown signal; [`LogArgs`] and [`ClientArgs`], the flags every
//!   binary flattens into its own.
//! * [`ops_server`]: the HTTP server of `/healthz`, `/livez`, `/readyz` and `/metrics` that
//!   [`App`] runs, on the framework's readiness checks (`k8s_reconcile::ops::Health`).
//! * [`secure_metrics`]: `--metrics-secure`, `/metrics` over HTTPS behind TokenReview and
//!   SubjectAccessReview ([`MetricsArgs`], [`MetricsAccess`]); health stays open.
//! * [`process`]: the leader identity, the async runtime, exit codes, the one way a fatal
//!   error chain is printed, the Kubernetes client; [`process::metrics`], the `process_*`
//!   metrics every binary exports.
//! * [`Error`]: what these can fail with beyond the framework's own errors (which it wraps). A
//!   cause is returned by `source()`, never printed in the message; [`error_chain`] prints the
//!   whole chain.
//!
//! The flow is one-way: [`builder`] uses [`ops_server`], [`secure_metrics`] and [`process`];
//! [`ops_server`] uses [`rest`]; [`flags`], [`logging`] and [`secure_metrics`] use [`values`].
//!
//! A binary's `main` then reads:
//!
//! ```no_run
//! use std::process::ExitCode;
//! use netkit_runtime::{self as runtime, App, ClientArgs, LogArgs};
//!
//! /// My binary.
//! #[derive(clap::Parser)]
//! #[command(
//!     name = "my-binary",
//!     mut_arg("log_format", |a| a.env("MY_BINARY_LOG_FORMAT")),
//!     mut_arg("log_level", |a| a.env("MY_BINARY_LOG_LEVEL"))
//! )]
//! struct Args {
//!     #[command(flatten)]
//!     log: LogArgs,
//!     #[command(flatten)]
//!     client: ClientArgs,
//!     /// Where /healthz, /readyz and /metrics are served.
//!     #[arg(long, default_value = ":8080", value_parser = runtime::parse_listen_addr)]
//!     metrics_addr: std::net::SocketAddr,
//! }
//!
//! async fn run(args: Args) -> Result<(), netkit_runtime::Error> {
//!     let builder = App::builder("my-binary", env!("CARGO_PKG_VERSION"));
//!     let app = builder.serve_ops([args.metrics_addr]).start().await?;
//!     let _client = args.client.client().await?;
//!     app.shutdown().cancelled().await;
//!     app.finish().await;
//!     Ok(())
//! }
//!
//! fn main() -> ExitCode {
//!     let args: Args = runtime::parse_args();
//!     args.log.init();
//!     runtime::block_on("my-binary", run(args))
//! }
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod builder;
mod error;
pub mod flags;
pub mod logging;
pub mod ops_server;
pub mod process;
pub mod rest;
pub mod secure_metrics;
pub mod values;

pub use builder::{App, AppBuilder, ClientArgs, OpsBindFailure};
pub use error::Error;
pub use flags::{go_bool_flags, parse_args, try_parse_args_from};
pub use logging::{LogArgs, LogFormat, init_logging, parse_log_level};
pub use process::{
    EXIT_FAILURE, EXIT_USAGE, block_on, block_on_threads, error_chain, exit_with, kube_client,
    leader_identity, metrics_registry, own_namespace, usage_error,
};
pub use secure_metrics::{MetricsAccess, MetricsArgs};
pub use values::{
    OptionalListenAddr, SecondsOrDuration, ValueError, is_qualified_name_part, parse_duration,
    parse_go_bool, parse_listen_addr, parse_optional_listen_addr, parse_positive_duration,
    parse_seconds_or_duration, validate_dns_label, validate_dns_subdomain, validate_qualified_name,
};

// The README's code blocks are compiled as doctests, so its example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
