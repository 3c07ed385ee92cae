//! The data plane: every connection on `--listen-addr` goes to `--upstream-addr`.
//!
//! Passthrough (the default) relays bytes untouched through proxy-core, with splice on Linux:
//! clients keep end-to-end TLS with the API server, client certificates included. TLS-termination
//! mode ([`crate::tls`]) decrypts and re-encrypts. Both drain on shutdown: stop accepting, let
//! in-flight connections (long watches included) finish until the deadline, then close them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use proxy_core::copy::RelayCounters;
use proxy_core::metrics::{RelayObserver, RouteLabels};
use proxy_core::relay::{Ending, RelayConfig, RelaySummary, Route};
use proxy_core::server::{DrainReport, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::upstream::Upstream;
use rustls::pki_types::ServerName;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::{LazyConfigAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::tls::{ReloadingCert, server_config};

/// Route name in metrics.
pub const ROUTE: &str = "apiserver";

/// Settings of the data plane.
#[derive(Clone)]
pub struct RelaySettings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The upstream, `host:port`.
    pub upstream: String,
    /// Timeouts and copy mode.
    pub relay: RelayConfig,
    /// Connection cap (None = unlimited).
    pub max_connections: Option<usize>,
    /// Set for TLS-termination mode.
    pub tls: Option<TlsSettings>,
}

/// TLS-termination settings.
#[derive(Clone)]
pub struct TlsSettings {
    /// Our serving certificate.
    pub cert: Arc<ReloadingCert>,
    /// The upstream leg's client configuration (without ALPN).
    pub client: Arc<rustls::ClientConfig>,
    /// The server name to verify the upstream as.
    pub upstream_name: ServerName<'static>,
}

/// A running data plane.
pub enum Relay {
    /// proxy-core does everything.
    Passthrough {
        /// The server.
        server: ProxyServer,
        /// The bound address.
        local: SocketAddr,
    },
    /// Our accept loop with TLS on both legs.
    Terminating {
        /// Stops accepting.
        accept_stop: CancellationToken,
        /// Cancels running connections at the drain deadline.
        connections_stop: CancellationToken,
        /// The running connections.
        tracker: TaskTracker,
        /// The bound address.
        local: SocketAddr,
    },
}

/// Starting failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The upstream address is not usable.
    #[error("--upstream-addr: {0}")]
    Upstream(String),
    /// proxy-core refused the listener.
    #[error("listening on {addr}: {source}")]
    Server {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: proxy_core::ServerError,
    },
    /// Binding the TLS listener failed.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Relay {
    /// Binds and starts relaying.
    pub async fn start(
        settings: RelaySettings,
        observer: Arc<dyn RelayObserver>,
    ) -> Result<Self, RelayError> {
        match settings.tls.clone() {
            None => {
                let upstream: Upstream = settings
                    .upstream
                    .parse()
                    .map_err(|e: proxy_core::ConfigError| RelayError::Upstream(e.to_string()))?;
                let server =
                    ProxyServer::new(ServerConfig::default(), observer).map_err(|source| {
                        RelayError::Server {
                            addr: settings.listen,
                            source: proxy_core::ServerError::Config(source),
                        }
                    })?;
                let listener = ListenerConfig::new(settings.listen, Route::new(ROUTE, upstream))
                    .with_relay(settings.relay)
                    .with_max_connections(settings.max_connections);
                let local = server
                    .add_listener(listener)
                    .map_err(|source| RelayError::Server {
                        addr: settings.listen,
                        source,
                    })?;
                Ok(Self::Passthrough { server, local })
            }
            Some(tls) => {
                let listener = TcpListener::bind(settings.listen).await.map_err(|source| {
                    RelayError::Bind {
                        addr: settings.listen,
                        source,
                    }
                })?;
                let local = listener.local_addr().map_err(|source| RelayError::Bind {
                    addr: settings.listen,
                    source,
                })?;
                let accept_stop = CancellationToken::new();
                let connections_stop = CancellationToken::new();
                let tracker = TaskTracker::new();
                tokio::spawn(accept_loop(
                    listener,
                    Arc::new(settings),
                    tls,
                    observer,
                    accept_stop.clone(),
                    connections_stop.clone(),
                    tracker.clone(),
                ));
                Ok(Self::Terminating {
                    accept_stop,
                    connections_stop,
                    tracker,
                    local,
                })
            }
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            Self::Passthrough { local, .. } | Self::Terminating { local, .. } => *local,
        }
    }

    /// Stops accepting, waits up to `deadline` for connections to end, then closes the rest.
    pub async fn drain(self, deadline: Duration) -> DrainReport {
        match self {
            Self::Passthrough { server, .. } => server.shutdown(deadline).await,
            Self::Terminating {
                accept_stop,
                connections_stop,
                tracker,
                ..
            } => {
                accept_stop.cancel();
                tracker.close();
                let running = tracker.len();
                if tokio::time::timeout(deadline, tracker.wait()).await.is_ok() {
                    let mut report = DrainReport::default();
                    report.finished = running;
                    return report;
                }
                let forced = tracker.len();
                connections_stop.cancel();
                tracker.wait().await;
                let mut report = DrainReport::default();
                report.finished = running.saturating_sub(forced);
                report.forced = forced;
                report
            }
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    settings: Arc<RelaySettings>,
    tls: TlsSettings,
    observer: Arc<dyn RelayObserver>,
    stop: CancellationToken,
    connections_stop: CancellationToken,
    tracker: TaskTracker,
) {
    let labels = RouteLabels {
        listener: settings.listen.to_string(),
        route: ROUTE.to_owned(),
    };
    let limit = Arc::new(Semaphore::new(
        settings.max_connections.unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let mut backoff = Duration::from_millis(5);
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (client, peer) = match accepted {
            Ok(pair) => {
                backoff = Duration::from_millis(5);
                pair
            }
            Err(err) => {
                // EMFILE and friends: pause instead of spinning.
                tracing::warn!(error = %err, "accept failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&limit).try_acquire_owned() else {
            observer.connection_rejected(&labels);
            drop(client);
            continue;
        };
        let settings = Arc::clone(&settings);
        let tls = tls.clone();
        let observer = Arc::clone(&observer);
        let labels = labels.clone();
        let cancel = connections_stop.clone();
        tracker.spawn(async move {
            observer.connection_opened(&labels);
            let counters = RelayCounters::new();
            let summary = terminate(client, &settings, &tls, &counters, &cancel).await;
            match &summary {
                Ok(summary) => {
                    observer.bytes_relayed(
                        &labels,
                        proxy_core::copy::Direction::ToUpstream,
                        summary.to_upstream,
                    );
                    observer.bytes_relayed(
                        &labels,
                        proxy_core::copy::Direction::ToClient,
                        summary.to_client,
                    );
                    observer.connection_closed(&labels, summary);
                }
                Err(reason) => {
                    tracing::debug!(%peer, %reason, "TLS connection not relayed");
                    let summary = RelaySummary::from_counters(
                        &counters,
                        Ending::ConnectFailed,
                        proxy_core::copy::CopyMode::Buffered,
                    );
                    observer.connection_closed(&labels, &summary);
                }
            }
            drop(permit);
        });
    }
}

/// One TLS-terminated connection: client hello, upstream TLS with the client's ALPN offer, our
/// handshake with the upstream's choice, then relay.
async fn terminate(
    client: TcpStream,
    settings: &RelaySettings,
    tls: &TlsSettings,
    counters: &RelayCounters,
    cancel: &CancellationToken,
) -> Result<RelaySummary, String> {
    let timeout = settings.relay.connect_timeout;
    let setup = async {
        let _ = client.set_nodelay(true);
        let start = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), client)
            .await
            .map_err(|e| format!("client hello: {e}"))?;
        let offered: Vec<Vec<u8>> = start
            .client_hello()
            .alpn()
            .map(|protocols| protocols.map(<[u8]>::to_vec).collect())
            .unwrap_or_default();
        let upstream_tcp = TcpStream::connect(&settings.upstream)
            .await
            .map_err(|e| format!("connecting to {}: {e}", settings.upstream))?;
        let _ = upstream_tcp.set_nodelay(true);
        let mut client_config = (*tls.client).clone();
        client_config.alpn_protocols = offered;
        let upstream = TlsConnector::from(Arc::new(client_config))
            .connect(tls.upstream_name.clone(), upstream_tcp)
            .await
            .map_err(|e| format!("TLS to {}: {e}", settings.upstream))?;
        let chosen = upstream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        let config = server_config(Arc::clone(&tls.cert), chosen).map_err(|e| e.to_string())?;
        let client = start
            .into_stream(Arc::new(config))
            .await
            .map_err(|e| format!("client handshake: {e}"))?;
        Ok::<_, String>((client, upstream))
    };
    let (client, upstream) = tokio::select! {
        result = tokio::time::timeout(timeout, setup) => {
            result.map_err(|_| format!("handshakes took longer than {timeout:?}"))??
        }
        () = cancel.cancelled() => return Err("shutting down".to_owned()),
    };
    Ok(proxy_core::relay::relay_streams(client, upstream, &settings.relay, counters, cancel).await)
}
