//! TCP relay core for Kubernetes networking: a connection relay with half-close, timeouts,
//! `splice(2)` zero-copy and live byte counters, and a server whose listeners and routes change
//! at runtime, with connection limits, upstream sets, PROXY protocol v2, graceful drain and
//! Prometheus metrics.
//!
//! It serves three kinds of programs: an API-server TCP proxy (one listener, one upstream,
//! drain on SIGTERM), a port mapper (many listeners added, retargeted and removed at runtime)
//! and a tunnel agent (relay an already-established stream, possibly TLS, to a local target
//! with [`relay::relay_streams`]).
//!
//! # Layout
//!
//! Data flows one way, from the bottom of this list to the top:
//!
//! * [`server`]: listeners, live routes, connection limits, accept backoff, drain and shutdown
//!   ([`server::ProxyServer`]). Uses everything below.
//! * [`metrics`]: the [`metrics::RelayObserver`] trait the server reports to, and a ready
//!   Prometheus implementation ([`metrics::PrometheusObserver`]).
//! * [`relay`]: one connection: connect with a timeout, optional PROXY header, both
//!   directions concurrently, idle timeout, maximum lifetime, cancellation, and a
//!   [`relay::RelaySummary`]. Entry points: [`relay::proxy`], [`relay::relay_tcp`],
//!   [`relay::relay_streams`].
//! * [`upstream`]: where connections go: an address, a custom [`upstream::Connector`], or an
//!   [`upstream::UpstreamSet`] with round-robin, failover and TCP health checks.
//! * [`proxy_protocol`]: PROXY protocol v2 encoder and parser.
//! * [`copy`]: one direction of bytes: the adaptive buffered path (any stream) and the Linux
//!   splice path (TCP to TCP), with live [`copy::RelayCounters`].
//! * [`socket`]: socket options for both legs (`TCP_NODELAY`, keepalive) and half-close.
//! * [`error`]: typed errors: configuration, connect, server.
//!
//! # Copy path
//!
//! Chosen per connection with [`copy::CopyMode`]. `Auto` (the default) splices on Linux for
//! TCP-to-TCP relays: bytes go socket → pipe → socket without entering user space, through a
//! pipe raised to 1 MiB with `F_SETPIPE_SZ`; byte counters add up `splice` results so they
//! stay live. Any other stream uses the buffered path, whose buffer starts at 1 KiB and grows
//! to 16 KiB and 256 KiB as bytes flow, so idle connections cost little. Pipes are created on
//! the first byte of each direction, so idle spliced connections hold no pipe either.
//!
//! # Feature flags
//!
//! None. The splice path is compiled on Linux only; elsewhere every connection uses the buffered
//! path.
//!
//! # Example
//!
//! ```no_run
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use std::time::Duration;
//! use prometheus_client::registry::Registry;
//! use proxy_core::metrics::PrometheusObserver;
//! use proxy_core::relay::{RelayConfig, Route};
//! use proxy_core::server::{ListenerConfig, ProxyServer, ServerConfig};
//!
//! let mut registry = Registry::default();
//! let metrics = Arc::new(PrometheusObserver::register(&mut registry));
//! let server = ProxyServer::new(ServerConfig::default(), metrics)?;
//! let route = Route::new("apiserver", "10.0.0.1:6443".parse::<proxy_core::upstream::Upstream>()?);
//! let relay = RelayConfig::default().with_connect_timeout(Duration::from_secs(5));
//! server.add_listener(ListenerConfig::new("0.0.0.0:6443".parse()?, route).with_relay(relay))?;
//!
//! tokio::signal::ctrl_c().await?;
//! server.shutdown(Duration::from_secs(30)).await;
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod copy;
pub mod error;
pub mod metrics;
pub mod proxy_protocol;
pub mod relay;
pub mod server;
pub mod socket;
pub mod upstream;

pub use error::{ConfigError, ConnectError, ServerError};
