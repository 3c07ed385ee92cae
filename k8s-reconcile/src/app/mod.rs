//! What every binary of the project builds its process from, so each `main` is only its own
//! wiring.
//!
//! * [`logging`]: one [`LogFormat`] and one filter precedence (`RUST_LOG`, then the binary's
//!   level flag, then `info`), always on stderr.
//! * [`values`]: flag values: Go durations and booleans, listen addresses, DNS names.
//! * [`flags`]: Go's syntax for boolean flags (`--flag`, `--flag=false`) on any clap command;
//!   parse with [`parse_args`].
//! * [`rest`]: a binary's REST API: a server bounded against slow and abusive clients, strict
//!   query and form fields, request bodies under a size limit.
//! * [`process`]: the leader identity, the async runtime, exit codes, the one way a fatal
//!   error chain is printed, the Kubernetes client and the operations servers.
//!
//! A binary's `main` then reads:
//!
//! ```no_run
//! use std::process::ExitCode;
//! use k8s_reconcile::app::{self, LogFormat};
//!
//! async fn run() -> Result<(), k8s_reconcile::Error> {
//!     let shutdown = k8s_reconcile::ops::shutdown_on_signals()?;
//!     shutdown.cancelled().await;
//!     Ok(())
//! }
//!
//! fn main() -> ExitCode {
//!     app::init_logging(LogFormat::Text, None);
//!     app::block_on("my-binary", run())
//! }
//! ```

pub mod flags;
pub mod logging;
pub mod process;
pub mod rest;
pub mod values;

pub use flags::{go_bool_flags, parse_args, try_parse_args_from};
pub use logging::{LogFormat, init_logging, parse_log_level};
pub use process::{
    EXIT_FAILURE, EXIT_USAGE, block_on, block_on_threads, error_chain, exit_with, kube_client,
    leader_identity, metrics_registry, own_namespace, serve_ops, usage_error,
};
pub use values::{
    OptionalListenAddr, SecondsOrDuration, ValueError, parse_duration, parse_go_bool,
    parse_listen_addr, parse_optional_listen_addr, parse_positive_duration,
    parse_seconds_or_duration, validate_dns_label, validate_dns_subdomain,
};
