//! The one way a binary builds its process: [`App::builder`] owns the metrics registry, the
//! readiness checks, the operations server and the shutdown signal, so a binary's own code only
//! registers its metrics and runs its work.
//!
//! ```no_run
//! use netkit_runtime::{App, ClientArgs};
//!
//! async fn run(client_args: ClientArgs) -> Result<(), netkit_runtime::Error> {
//!     let mut builder = App::builder("my-binary", "0.1.0");
//!     let _reconciles = k8s_reconcile::metrics::ControllerMetrics::register(builder.registry());
//!     let app = builder
//!         .serve_ops(["0.0.0.0:8080".parse().expect("an address")])
//!         .start()
//!         .await?;
//!     let _client = client_args.client().await?;
//!     // ... the binary's work, until SIGTERM:
//!     app.shutdown().cancelled().await;
//!     app.finish().await;
//!     Ok(())
//! }
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::ops_server;
use super::secure_metrics::MetricsAccess;
use crate::Error;
use k8s_reconcile::ops::{self, Health};

/// How often the certificate files of a secure metrics server are checked for a new pair.
const METRICS_CERT_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Readiness check the builder adds: false from the first SIGTERM/SIGINT, so Services and load
/// balancers stop sending new work while the binary drains.
pub const SHUTDOWN_CHECK: &str = "shutdown";

/// `--kubeconfig`, the client flag of every binary that talks to Kubernetes; flatten it into the
/// binary's arguments (`#[command(flatten)]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct ClientArgs {
    /// kubeconfig for running outside a cluster (default: $KUBECONFIG, which may list several
    /// files, then ~/.kube/config, then the in-cluster ServiceAccount).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
}

impl ClientArgs {
    /// A client from these flags ([`super::kube_client`]).
    pub async fn client(&self) -> Result<kube::Client, Error> {
        super::kube_client(self.kubeconfig.as_deref()).await
    }
}

/// What a taken operations port does at [`AppBuilder::start`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OpsBindFailure {
    /// Stop the start with the error: the default, as a taken port is usually a mistake.
    #[default]
    Exit,
    /// Log the error and run without that server, for a host-network Pod on nodes where
    /// another program may hold the port: the work matters more than its probes and metrics.
    Log,
}

/// What a binary registers before it starts: metrics, readiness checks and the operations
/// addresses. Made by [`App::builder`].
#[derive(Debug)]
pub struct AppBuilder {
    registry: Registry,
    health: Health,
    listeners: Vec<Listener>,
    bind_failure: OpsBindFailure,
    unbound: Gauge,
    shutdown: CancellationToken,
}

/// One operations address and what it serves.
#[derive(Debug)]
struct Listener {
    addr: SocketAddr,
    health: bool,
    metrics: Option<MetricsAccess>,
}

impl Listener {
    fn describe(&self) -> &'static str {
        match (self.health, &self.metrics) {
            (true, Some(m)) if m.is_secure() => "/healthz, /readyz and /metrics over HTTPS",
            (true, Some(_)) => "/healthz, /readyz and /metrics",
            (true, None) => "/healthz and /readyz",
            (false, Some(m)) if m.is_secure() => "/metrics over HTTPS",
            (false, _) => "/metrics",
        }
    }
}

impl AppBuilder {
    /// The registry every metric of the binary goes into; it already holds the `process_*`
    /// metrics and `<binary>_build_info` ([`super::metrics_registry`]).
    pub fn registry(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The readiness checks `/readyz` will report; parts of the binary take clones.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The token [`App::shutdown`] will be: cancelled on the first SIGTERM or SIGINT once
    /// started, so work spawned before [`AppBuilder::start`] can stop with the rest.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Serve `/healthz`, `/readyz` and `/metrics`, all open, on each of `addrs` (a repeated
    /// address is served once; none at all is allowed).
    #[must_use]
    pub fn serve_ops(self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        let addrs: Vec<_> = addrs.into_iter().collect();
        self.serve_health(addrs.iter().copied())
            .serve_metrics(addrs, MetricsAccess::open())
    }

    /// Serve `/healthz`, `/livez` and `/readyz` on each of `addrs`, open to anyone (the
    /// kubelet's probes carry no token).
    #[must_use]
    pub fn serve_health(mut self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        for addr in addrs {
            self.listener(addr).health = true;
        }
        self
    }

    /// Serve `/metrics` on each of `addrs` to whom `access` lets in
    /// ([`MetricsArgs::access`](super::MetricsArgs::access)). An address that also serves
    /// health serves it over HTTPS too when `access` is secure (a kubelet probe of it then
    /// needs `scheme: HTTPS`), so keep them apart.
    #[must_use]
    pub fn serve_metrics(
        mut self,
        addrs: impl IntoIterator<Item = SocketAddr>,
        access: MetricsAccess,
    ) -> Self {
        for addr in addrs {
            self.listener(addr).metrics = Some(access.clone());
        }
        self
    }

    fn listener(&mut self, addr: SocketAddr) -> &mut Listener {
        let at = match self.listeners.iter().position(|l| l.addr == addr) {
            Some(at) => at,
            None => {
                self.listeners.push(Listener {
                    addr,
                    health: false,
                    metrics: None,
                });
                self.listeners.len() - 1
            }
        };
        &mut self.listeners[at]
    }

    /// What a taken operations port does ([`OpsBindFailure::Exit`] unless set).
    #[must_use]
    pub fn ops_bind_failure(mut self, failure: OpsBindFailure) -> Self {
        self.bind_failure = failure;
        self
    }

    /// Installs the SIGTERM/SIGINT handler and binds every operations address: a taken port
    /// stops the start here, before the binary does any work (or is logged, with
    /// [`OpsBindFailure::Log`]). Call it inside the runtime.
    pub async fn start(self) -> Result<App, Error> {
        let signals = ops::shutdown_on_signals()?;
        let shutdown = self.shutdown;
        {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = signals.cancelled() => shutdown.cancel(),
                    () = shutdown.cancelled() => {}
                }
            });
        }
        let health = self.health;
        health.set(SHUTDOWN_CHECK, true, "running");
        {
            let health = health.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                shutdown.cancelled().await;
                health.set(SHUTDOWN_CHECK, false, "shutting down");
            });
        }
        let registry = Arc::new(self.registry);
        // The operations servers outlive the work: /readyz says "shutting down" during a drain
        // and /metrics still shows it.
        let ops_stop = CancellationToken::new();
        let mut servers = Vec::with_capacity(self.listeners.len());
        for listener in self.listeners {
            let addr = listener.addr;
            let what = listener.describe();
            let mut router = axum::Router::new();
            if listener.health {
                router = router.merge(ops_server::health_router(health.clone()));
            }
            let served = match listener.metrics.as_ref().map(|m| m.secure_parts()) {
                Some(Some(secure)) => {
                    let metrics = ops_server::metrics_router(
                        Arc::clone(&registry),
                        Some(Arc::clone(&secure.auth)),
                    );
                    let served = ops_server::serve_tls(
                        addr,
                        router.merge(metrics),
                        Arc::clone(&secure.tls),
                        ops_stop.clone(),
                    )
                    .await;
                    if served.is_ok()
                        && let Some(cert) = &secure.reload
                    {
                        // Until the server stops; an address served twice checks twice, harmlessly.
                        Arc::clone(cert).watch(METRICS_CERT_RECHECK, ops_stop.clone());
                    }
                    served
                }
                Some(None) => {
                    let metrics = ops_server::metrics_router(Arc::clone(&registry), None);
                    ops_server::serve(addr, router.merge(metrics), ops_stop.clone()).await
                }
                None => ops_server::serve(addr, router, ops_stop.clone()).await,
            };
            match served {
                Ok(server) => {
                    servers.push(server);
                    tracing::info!(%addr, "serving {what}");
                }
                Err(error) if self.bind_failure == OpsBindFailure::Log => {
                    self.unbound.inc();
                    tracing::warn!(
                        %addr,
                        error = %super::error_chain(&error),
                        "not serving {what} here; running without them"
                    );
                }
                Err(error) => {
                    ops_stop.cancel();
                    return Err(error);
                }
            }
        }
        Ok(App {
            health,
            registry,
            shutdown,
            ops_stop,
            servers,
        })
    }
}

/// A started binary: its readiness checks, registry, shutdown signal and running operations
/// servers. End it with [`App::finish`] once the work has stopped.
#[derive(Debug)]
pub struct App {
    health: Health,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    ops_stop: CancellationToken,
    servers: Vec<JoinHandle<()>>,
}

impl App {
    /// A builder for the binary `binary` at `version` (for `<binary>_build_info`).
    pub fn builder(binary: &str, version: &str) -> AppBuilder {
        let mut registry = super::metrics_registry(binary, version);
        let unbound = Gauge::default();
        registry.register(
            format!("{}_ops_listeners_unbound", binary.replace('-', "_")),
            "Operations addresses not served because their port was taken (ops bind failure `log`)",
            unbound.clone(),
        );
        AppBuilder {
            registry,
            health: Health::new(),
            listeners: Vec::new(),
            bind_failure: OpsBindFailure::Exit,
            unbound,
            shutdown: CancellationToken::new(),
        }
    }

    /// The readiness checks `/readyz` reports.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// The metrics registry, as served.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Cancelled on the first SIGTERM or SIGINT (or by the binary, to stop on its own).
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Stops the operations servers and waits for them; call it after the work has ended.
    pub async fn finish(self) {
        self.shutdown.cancel();
        self.ops_stop.cancel();
        for server in self.servers {
            if let Err(error) = server.await {
                tracing::warn!(%error, "an operations server ended badly");
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_ops_port_stops_the_start_and_the_others_close() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free_addr = free.local_addr().unwrap();
        drop(free);
        let started = App::builder("t", "0")
            .serve_ops([free_addr, taken.local_addr().unwrap()])
            .start()
            .await;
        assert!(matches!(started, Err(Error::Serve { .. })), "{started:?}");
        // The server bound before the failure is stopped, so its port is free again.
        let mut rebound = None;
        // Polled, bounded generously (30 s).
        for _ in 0..1500 {
            if let Ok(listener) = std::net::TcpListener::bind(free_addr) {
                rebound = Some(listener);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(
            rebound.is_some(),
            "{free_addr} still taken after a failed start"
        );
    }

    #[tokio::test]
    async fn with_log_a_taken_ops_port_is_skipped_and_the_others_serve() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free_addr = free.local_addr().unwrap();
        drop(free);
        let app = App::builder("t", "0")
            .serve_ops([taken.local_addr().unwrap(), free_addr])
            .ops_bind_failure(OpsBindFailure::Log)
            .start()
            .await
            .unwrap();
        assert!(tokio::net::TcpStream::connect(free_addr).await.is_ok());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, app.registry()).unwrap();
        assert!(text.contains("t_ops_listeners_unbound 1\n"), "{text}");
        app.finish().await;
    }

    #[tokio::test]
    async fn readiness_turns_false_at_shutdown_and_finish_stops_serving() {
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = free.local_addr().unwrap();
        drop(free);
        let app = App::builder("t", "0")
            .serve_ops([addr, addr])
            .start()
            .await
            .unwrap();
        assert!(app.health().check(SHUTDOWN_CHECK).unwrap().ok);
        app.shutdown().cancel();
        let mut waited = 0;
        while app.health().ready() && waited < 3000 {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            waited += 1;
        }
        assert!(
            !app.health().ready(),
            "still ready after the shutdown signal"
        );
        assert!(tokio::net::TcpStream::connect(addr).await.is_ok());
        app.finish().await;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }
}
