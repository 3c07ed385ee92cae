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
//!   ([`server::ProxyServer`]), on the caller's runtime or on accept workers with a listening
//!   socket each ([`server::ServerConfig::accept_workers`]); on Linux, plain TCP listeners
//!   relay on event-loop threads by default ([`server::DataPath::Auto`]), or on a tokio task
//!   per connection when asked ([`server::DataPath::Tokio`]). Uses everything below.
//! * [`source`]: which client addresses a listener admits ([`source::SourceFilter`], checked
//!   at accept on both data paths).
//! * [`accept`]: accept layers for listeners that do more than TCP to TCP (TLS termination):
//!   [`accept::StreamAcceptor`].
//! * [`metrics`]: the [`metrics::RelayObserver`] trait the server reports to, and a ready
//!   Prometheus implementation ([`metrics::PrometheusObserver`]).
//! * [`relay`]: one connection: connect with a timeout, optional PROXY header, both
//!   directions concurrently, idle timeout, maximum lifetime, cancellation, and a
//!   [`relay::RelaySummary`]. Entry points: [`relay::proxy`], [`relay::relay_tcp`],
//!   [`relay::relay_streams`].
//! * [`upstream`]: where connections go: an address, a custom [`upstream::Connector`], or an
//!   [`upstream::UpstreamSet`] with round-robin, failover and TCP health checks.
//! * [`http_connect`]: reaching an upstream through an HTTP proxy's `CONNECT` tunnel, with
//!   optional basic auth ([`http_connect::HttpProxy`]).
//! * [`target`]: [`target::TargetAddr`], a socket address or `host:port` to connect to, used
//!   by both modules above (and re-exported as `upstream::TargetAddr`).
//! * [`proxy_protocol`]: PROXY protocol v2 encoder and parser.
//! * [`pipe`]: the process-wide pool of pipes for the splice path, under a budget that keeps
//!   the process inside the user's pipe limit.
//! * [`copy`]: one direction of bytes: the adaptive buffered path (any stream) and the Linux
//!   splice path (TCP to TCP), with live [`copy::RelayCounters`].
//! * [`socket`]: socket options for both legs (`TCP_NODELAY`, keepalive) and half-close.
//! * `tls` (feature `tls`): the one certificate verifier that accepts any certificate, PEM
//!   certificates and keys, and trust roots from a PEM bundle or the system.
//! * [`error`]: typed errors: configuration, connect, server.
//!
//! # Copy path
//!
//! Chosen per connection with [`copy::CopyMode`]. `Auto` (the default) splices on Linux for
//! TCP-to-TCP relays, the way HAProxy's `splice-auto` does: each direction starts on the
//! buffered path (a buffer of 1 KiB growing to 16 KiB and 256 KiB as bytes flow, allocated on
//! the first byte), and once a read fills a 16 KiB buffer it borrows a pipe from the
//! process-wide [`pipe`] pool (1 MiB with `F_SETPIPE_SZ`) and moves bytes socket → pipe →
//! socket without entering user space, handing the pipe back whenever its socket runs dry.
//! Connections that never stream never touch a pipe; idle ones hold two descriptors and no
//! buffer. The pool stays inside a budget of pipe bytes (a quarter of the user's
//! `pipe-user-pages-soft` by default), beyond which copies stay buffered. Byte counters add up
//! `splice` results, so they stay live.
//!
//! # Errors
//!
//! A variant with a cause returns it from `source()` and does not repeat it in its message, which
//! says only what failed at its own level ("cannot listen on 0.0.0.0:80", not "...: address in
//! use"). That is the convention of the Rust ecosystem, so a caller can walk or downcast the
//! chain, and a program that prints every cause in turn shows each one once; printing the chain
//! is the binary's job (`netkit_runtime::error_chain` does it for this workspace's).
//!
//! # Feature flags
//!
//! * `tls`: the [`tls`](mod@tls) module (rustls helpers). The splice path is compiled on Linux
//!   only; elsewhere every connection uses the buffered path.
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

#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod accept;
pub mod copy;
pub mod error;
pub mod http_connect;
pub mod metrics;
pub mod pipe;
pub mod proxy_protocol;
pub mod relay;
pub mod server;
pub mod socket;
pub mod source;
pub mod target;
#[cfg(feature = "tls")]
#[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
pub mod tls;
pub mod upstream;

// The README's code blocks are compiled as doctests, so its example stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

pub use error::{ConfigError, ConnectError, ServerError};
