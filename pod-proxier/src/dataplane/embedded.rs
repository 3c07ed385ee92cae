//! The in-process data plane on proxy-core: a route change is one atomic swap, live for the next
//! accepted connection; nothing reloads, and established connections keep their upstream unless
//! the mapping asks to close them.
//!
//! An entry port whose access is checked (V1 with `--entry-access=requester`) has a proxy-core
//! source filter: a client from a source the mapping does not admit is reset at accept, before
//! any upstream is connected, and counted per entry port. The check is proxy-core's own, so
//! such a port keeps the splice path and the event loops.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use proxy_core::ConnectError;
use proxy_core::copy::Direction;
use proxy_core::metrics::{RelayObserver, RouteLabels, SourceRefusal};
use proxy_core::relay::{RelayConfig, RelaySummary, Route};
use proxy_core::server::{
    DataPath, ExistingConnections, ListenerConfig, ProxyServer, ServerConfig,
};
use proxy_core::source::SourceFilter;
use proxy_core::upstream::{HealthCheck, TargetAddr, TargetStatus, Upstream, UpstreamSet};
use tokio::sync::Mutex;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{DesiredPorts, PortError, PortRoute};
use crate::access::source_filter;
use crate::metrics::EntryLabels;

/// The relay's observer, which also counts the clients proxy-core refused for their source per
/// entry port (`podproxier_entry_source_refused_total`).
struct EntryObserver {
    inner: Arc<dyn RelayObserver>,
    /// Set by [`EmbeddedPlane::with_source_checks`], before any port listens.
    refused: Arc<OnceLock<Family<EntryLabels, Counter>>>,
}

impl RelayObserver for EntryObserver {
    fn connection_opened(&self, labels: &RouteLabels) {
        self.inner.connection_opened(labels);
    }

    fn connection_rejected(&self, labels: &RouteLabels) {
        self.inner.connection_rejected(labels);
    }

    fn source_refused(&self, labels: &RouteLabels, refusal: &SourceRefusal) {
        if let Some(refused) = self.refused.get() {
            refused
                .get_or_create(&EntryLabels {
                    entry_port: refusal.listener.port(),
                })
                .inc();
        }
        self.inner.source_refused(labels, refusal);
    }

    fn connect_failed(&self, labels: &RouteLabels, error: &ConnectError) {
        self.inner.connect_failed(labels, error);
    }

    fn bytes_relayed(&self, labels: &RouteLabels, direction: Direction, bytes: u64) {
        self.inner.bytes_relayed(labels, direction, bytes);
    }

    fn connection_closed(&self, labels: &RouteLabels, summary: &RelaySummary) {
        self.inner.connection_closed(labels, summary);
    }
}

/// The source filter of a checked port for `route` (`None`: every source, an idle port that
/// refuses anyway).
fn filter_of(route: &PortRoute) -> Option<SourceFilter> {
    route.allowed_sources.as_deref().map(source_filter)
}

/// Why an entry port without a mapping closes every connection at once. (The original
/// forwarded idle entry ports to its own unauthenticated API.)
const NO_MAPPING: &str = "no mapping on this entry port";

struct ActivePort {
    addr: SocketAddr,
    route: PortRoute,
    /// Stops the health checks of the current upstream set when dropped.
    checks: Option<DropGuard>,
    /// The current upstream set, when the route has several targets or health checks.
    set: Option<Arc<UpstreamSet>>,
}

/// What [`EmbeddedPlane::build`] makes of a route: the proxy-core route, the guard of its health
/// checks and its upstream set.
type Built = (Route, Option<DropGuard>, Option<Arc<UpstreamSet>>);

/// proxy-core listeners, one per entry port.
pub struct EmbeddedPlane {
    server: ProxyServer,
    ip: IpAddr,
    relay: RelayConfig,
    health_check: Option<HealthCheck>,
    ports: Mutex<HashMap<u16, ActivePort>>,
    /// How long removed listeners let their connections finish.
    drain: Duration,
    /// The entry ports whose clients' sources are checked.
    gated: BTreeSet<u16>,
    /// Clients refused for their source, per entry port (shared with the observer).
    refused: Arc<OnceLock<Family<EntryLabels, Counter>>>,
}

impl EmbeddedPlane {
    /// A data plane binding its entry ports on `ip`, relayed by `data_path`.
    pub fn new(
        ip: IpAddr,
        observer: Arc<dyn RelayObserver>,
        health_check: Option<HealthCheck>,
        drain: Duration,
        data_path: DataPath,
    ) -> Result<Self, proxy_core::ServerError> {
        let refused = Arc::new(OnceLock::new());
        let observer = Arc::new(EntryObserver {
            inner: observer,
            refused: Arc::clone(&refused),
        });
        let server = ProxyServer::new(ServerConfig::default().with_data_path(data_path), observer)?;
        Ok(Self {
            server,
            ip,
            relay: RelayConfig::default().with_connect_timeout(Duration::from_secs(5)),
            health_check,
            ports: Mutex::new(HashMap::new()),
            drain,
            gated: BTreeSet::new(),
            refused,
        })
    }

    /// Checks the source of every client of `ports` against its route's
    /// [`PortRoute::allowed_sources`], counting refusals per port in `refused`. Set before the
    /// first [`sync`](Self::sync), once (a second `refused` is ignored).
    pub fn with_source_checks(
        mut self,
        ports: impl IntoIterator<Item = u16>,
        refused: Family<EntryLabels, Counter>,
    ) -> Self {
        self.gated = ports.into_iter().collect();
        let _ = self.refused.set(refused);
        self
    }

    fn build(&self, port: u16, route: &PortRoute) -> Built {
        let name = format!("{}:{port}", route.name);
        match route.upstreams.as_slice() {
            [] => (Route::new(name, Upstream::refuse(NO_MAPPING)), None, None),
            [single] if !route.health_checked => (Route::new(name, *single), None, None),
            targets => {
                let targets = targets.iter().map(|a| TargetAddr::Socket(*a)).collect();
                let set = UpstreamSet::new(targets).and_then(|set| match self.health_check {
                    Some(check) if route.health_checked => set.with_health_check(check),
                    _ => Ok(set),
                });
                match set {
                    Ok(set) => {
                        let set = Arc::new(set);
                        let cancel = CancellationToken::new();
                        let checks = set
                            .spawn_health_checks(cancel.clone())
                            .map(|_| cancel.drop_guard());
                        (
                            Route::new(name, Upstream::Set(Arc::clone(&set))),
                            checks,
                            Some(set),
                        )
                    }
                    Err(err) => {
                        tracing::error!(port, error = %err, "invalid upstream set; refusing connections");
                        (Route::new(name, Upstream::refuse(NO_MAPPING)), None, None)
                    }
                }
            }
        }
    }

    /// Makes the listeners match `desired`.
    pub async fn sync(&self, desired: &DesiredPorts) -> Vec<PortError> {
        let mut ports = self.ports.lock().await;
        let mut errors = Vec::new();
        // Ports no longer wanted: stop accepting now, drain in the background.
        let gone: Vec<u16> = ports
            .keys()
            .filter(|p| !desired.contains_key(p))
            .copied()
            .collect();
        for port in gone {
            if let Some(active) = ports.remove(&port) {
                drop(active.checks);
                let drain = if active.route.close_connections {
                    Duration::ZERO
                } else {
                    self.drain
                };
                let server = self.server.clone();
                tokio::spawn(async move {
                    if let Err(err) = server.remove_listener(active.addr, drain).await {
                        tracing::warn!(port, error = %err, "removing listener");
                    }
                });
                tracing::info!(port, "entry port closed");
            }
        }
        for (&port, route) in desired {
            let gated = self.gated.contains(&port);
            match ports.get_mut(&port) {
                Some(active) if !active.route.forwarding_differs(route) => {
                    if gated
                        && active.route.access_differs(route)
                        && let Err(err) =
                            self.server.set_source_filter(active.addr, filter_of(route))
                    {
                        errors.push(PortError {
                            port,
                            message: err.to_string(),
                        });
                        continue;
                    }
                    // Only the close flag and the sources may differ; remember them.
                    active.route = route.clone();
                }
                Some(active) => {
                    let existing = if active.route.closes_on_switch_to(route) {
                        ExistingConnections::Close
                    } else {
                        ExistingConnections::Keep
                    };
                    let (next, checks, set) = self.build(port, route);
                    // Closed while the route switches, so no client of one mapping's sources
                    // reaches another mapping's target.
                    let refilter = gated && active.route.access_differs(route);
                    if refilter {
                        let _ = self
                            .server
                            .set_source_filter(active.addr, Some(SourceFilter::deny_all()));
                    }
                    match self.server.set_route(active.addr, next, existing) {
                        Ok(()) => {
                            // Replacing the guard stops the old set's checks.
                            active.checks = checks;
                            active.set = set;
                            active.route = route.clone();
                        }
                        // Dropping `checks` stops the new set's checks.
                        Err(err) => {
                            errors.push(PortError {
                                port,
                                message: err.to_string(),
                            });
                        }
                    }
                    // The new mapping's sources, or the old ones if the switch failed.
                    if refilter
                        && let Err(err) = self
                            .server
                            .set_source_filter(active.addr, filter_of(&active.route))
                    {
                        errors.push(PortError {
                            port,
                            message: err.to_string(),
                        });
                    }
                }
                None => {
                    let (next, checks, set) = self.build(port, route);
                    let mut config = ListenerConfig::new(SocketAddr::new(self.ip, port), next)
                        .with_relay(self.relay);
                    if gated && let Some(filter) = filter_of(route) {
                        config = config.with_source_filter(filter);
                    }
                    match self.server.add_listener(config) {
                        Ok(addr) => {
                            ports.insert(
                                port,
                                ActivePort {
                                    addr,
                                    route: route.clone(),
                                    checks,
                                    set,
                                },
                            );
                        }
                        Err(err) => {
                            errors.push(PortError {
                                port,
                                message: err.to_string(),
                            });
                        }
                    }
                }
            }
        }
        errors
    }

    /// The targets of entry port `port` and whether each takes new connections, when its route
    /// has an upstream set (several targets, or health checks).
    pub async fn upstream_status(&self, port: u16) -> Option<Vec<TargetStatus>> {
        let ports = self.ports.lock().await;
        ports.get(&port)?.set.as_ref().map(|set| set.status())
    }

    /// Stops every listener and lets connections finish for up to `drain`.
    pub async fn shutdown(&self, drain: Duration) {
        // Dropping the ports' guards stops their health checks.
        self.ports.lock().await.clear();
        let report = self.server.shutdown(drain).await;
        tracing::info!(
            finished = report.finished,
            forced = report.forced,
            "data plane drained"
        );
    }
}
