//! The data plane: every connection on `--listen-addr` goes to `--upstream-addr`, directly or
//! through an HTTP proxy's CONNECT tunnel (`--upstream-proxy`, `HTTPS_PROXY`).
//!
//! Passthrough (the default) relays bytes untouched through proxy-core, with splice on Linux:
//! clients keep end-to-end TLS with the API server, client certificates included. TLS-termination
//! mode ([`crate::tls`]) decrypts and re-encrypts as proxy-core's accept layer, so both modes share
//! one accept loop, its connection limit, backoff and metrics, and drain on shutdown: stop
//! accepting, let in-flight connections (long watches included) finish until the deadline, then
//! close them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use proxy_core::http_connect::HttpProxy;
use proxy_core::metrics::RelayObserver;
use proxy_core::relay::{RelayConfig, Route};
use proxy_core::server::{DataPath, DrainReport, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::upstream::Upstream;

use crate::tls::TerminatingAcceptor;

/// Route name in metrics.
pub const ROUTE: &str = "apiserver";

/// Settings of the data plane.
#[derive(Clone)]
pub struct RelaySettings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The upstream, as `--upstream-addr` parsed it.
    pub upstream: Upstream,
    /// Timeouts and copy mode.
    pub relay: RelayConfig,
    /// Connection cap (None = unlimited).
    pub max_connections: Option<usize>,
    /// Set for TLS-termination mode.
    pub tls: Option<Arc<TerminatingAcceptor>>,
    /// An HTTP proxy in front of the upstream.
    pub proxy: Option<HttpProxy>,
    /// During the drain, close answered connections idle this long (None = at the deadline).
    pub drain_idle: Option<Duration>,
    /// What relays plain connections.
    pub data_path: DataPath,
}

/// A running data plane: proxy-core's server with one listener, TLS-terminating or not.
pub struct Relay {
    server: ProxyServer,
    local: SocketAddr,
    upstream: Upstream,
}

/// Starting failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The upstream cannot be reached that way (a list cannot go through an HTTP proxy).
    #[error("--upstream-addr")]
    Upstream(#[source] proxy_core::ConfigError),
    /// proxy-core refused the listener.
    #[error("cannot start the relay on {addr}")]
    Server {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        cause: proxy_core::ServerError,
    },
}

impl Relay {
    /// Binds and starts relaying.
    pub fn start(
        settings: RelaySettings,
        observer: Arc<dyn RelayObserver>,
    ) -> Result<Self, RelayError> {
        let upstream = match settings.proxy {
            Some(proxy) => settings
                .upstream
                .via_http_proxy(proxy)
                .map_err(RelayError::Upstream)?,
            None => settings.upstream,
        };
        let server_error = |cause| RelayError::Server {
            addr: settings.listen,
            cause,
        };
        let mut server_config = ServerConfig::default().with_data_path(settings.data_path);
        if let Some(idle) = settings.drain_idle {
            server_config = server_config.with_drain_idle(idle);
        }
        let server = ProxyServer::new(server_config, observer)
            .map_err(|cause| server_error(proxy_core::ServerError::Config(cause)))?;
        let mut listener =
            ListenerConfig::new(settings.listen, Route::new(ROUTE, upstream.clone()))
                .with_relay(settings.relay)
                .with_max_connections(settings.max_connections);
        if let Some(tls) = settings.tls {
            listener = listener.with_acceptor(tls);
        }
        let local = server.add_listener(listener).map_err(server_error)?;
        Ok(Self {
            server,
            local,
            upstream,
        })
    }

    /// Where connections go (through the HTTP proxy, if any).
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Stops accepting, waits up to `deadline` for connections to end, then closes the rest.
    pub async fn drain(self, deadline: Duration) -> DrainReport {
        self.server.shutdown(deadline).await
    }
}
