//! The in-process data plane on proxy-core: a route change is one atomic swap, live for the next
//! accepted connection; nothing reloads, and established connections keep their upstream unless
//! the mapping asks to close them.
//!
//! An entry port whose access is checked (V1 with `--entry-access=requester`) has a
//! [`SourceGate`]: a client from a source the mapping does not admit is closed at accept, before
//! any upstream is connected, and counted. proxy-core relays such a listener's connections on
//! its buffered path (an accept layer hands over streams, not sockets to splice).

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::future::BoxFuture;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use proxy_core::accept::{AcceptError, Accepted, StreamAcceptor};
use proxy_core::metrics::RelayObserver;
use proxy_core::relay::{self, RelayConfig, Route};
use proxy_core::server::{ExistingConnections, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::upstream::{HealthCheck, TargetAddr, TargetStatus, Upstream, UpstreamSet};
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{DesiredPorts, PortError, PortRoute};
use crate::access::{Cidr, admits};
use crate::metrics::EntryLabels;

/// The sources an entry port admits, checked on every accepted client.
#[derive(Debug)]
pub struct SourceGate {
    /// `None`: every source (an idle port, which refuses anyway).
    allowed: RwLock<Option<Arc<[Cidr]>>>,
    /// Clients closed because of their source.
    refused: Counter,
}

impl SourceGate {
    /// A gate admitting `allowed` (`None`: everyone), counting refusals in `refused`.
    pub fn new(allowed: Option<&[Cidr]>, refused: Counter) -> Self {
        Self {
            allowed: RwLock::new(allowed.map(Arc::from)),
            refused,
        }
    }

    /// Admits `allowed` from the next accepted client on.
    pub fn set(&self, allowed: Option<&[Cidr]>) {
        let next = allowed.map(Arc::from);
        match self.allowed.write() {
            Ok(mut current) => *current = next,
            Err(poisoned) => *poisoned.into_inner() = next,
        }
    }

    /// Whether a client from `ip` may pass.
    pub fn admits(&self, ip: IpAddr) -> bool {
        let allowed = match self.allowed.read() {
            Ok(current) => current.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        allowed.is_none_or(|cidrs| admits(&cidrs, ip))
    }
}

/// Why a client was closed at accept.
#[derive(Debug, thiserror::Error)]
#[error("source {0} is not admitted by this entry port's mapping")]
struct NotAdmitted(String);

impl StreamAcceptor for SourceGate {
    fn accept<'a>(
        &'a self,
        client: TcpStream,
        route: &'a Route,
        config: &'a RelayConfig,
    ) -> BoxFuture<'a, Result<Accepted, AcceptError>> {
        Box::pin(async move {
            let peer = client.peer_addr().ok();
            if !peer.is_some_and(|peer| self.admits(peer.ip())) {
                self.refused.inc();
                let source = peer.map_or_else(|| "unknown".to_owned(), |p| p.ip().to_string());
                tracing::debug!(%source, route = %route.name, "client refused at accept: source not admitted");
                // Dropping the client closes it; nothing was connected upstream.
                return Err(AcceptError::Handshake {
                    stage: "source address check".to_owned(),
                    cause: Box::new(NotAdmitted(source)),
                });
            }
            let upstream = relay::connect_upstream(route, &client, config).await?;
            Ok(Accepted {
                client: Box::new(client),
                upstream: Box::new(upstream),
            })
        })
    }
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
    /// The source check, on a port whose access is checked.
    gate: Option<Arc<SourceGate>>,
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
    /// Clients refused for their source, per entry port.
    refused: Family<EntryLabels, Counter>,
}

impl EmbeddedPlane {
    /// A data plane binding its entry ports on `ip`.
    pub fn new(
        ip: IpAddr,
        observer: Arc<dyn RelayObserver>,
        health_check: Option<HealthCheck>,
        drain: Duration,
    ) -> Result<Self, proxy_core::ServerError> {
        let server = ProxyServer::new(ServerConfig::default(), observer)?;
        Ok(Self {
            server,
            ip,
            relay: RelayConfig::default().with_connect_timeout(Duration::from_secs(5)),
            health_check,
            ports: Mutex::new(HashMap::new()),
            drain,
            gated: BTreeSet::new(),
            refused: Family::default(),
        })
    }

    /// Checks the source of every client of `ports` against its route's
    /// [`PortRoute::allowed_sources`], counting refusals per port in `refused`. Set before the
    /// first [`sync`](Self::sync).
    pub fn with_source_checks(
        mut self,
        ports: impl IntoIterator<Item = u16>,
        refused: Family<EntryLabels, Counter>,
    ) -> Self {
        self.gated = ports.into_iter().collect();
        self.refused = refused;
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
            match ports.get_mut(&port) {
                Some(active) if !active.route.forwarding_differs(route) => {
                    if let Some(gate) = &active.gate {
                        gate.set(route.allowed_sources.as_deref());
                    }
                    // Only the close flag may differ; remember it for the next switch.
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
                    let gate = active.gate.clone();
                    if let Some(gate) = &gate
                        && active.route.access_differs(route)
                    {
                        gate.set(Some(&[]));
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
                    if let Some(gate) = &gate {
                        gate.set(active.route.allowed_sources.as_deref());
                    }
                }
                None => {
                    let (next, checks, set) = self.build(port, route);
                    let mut config = ListenerConfig::new(SocketAddr::new(self.ip, port), next)
                        .with_relay(self.relay);
                    let gate = self.gated.contains(&port).then(|| {
                        let refused = self
                            .refused
                            .get_or_create(&EntryLabels { entry_port: port })
                            .clone();
                        Arc::new(SourceGate::new(route.allowed_sources.as_deref(), refused))
                    });
                    if let Some(gate) = &gate {
                        config = config.with_acceptor(Arc::clone(gate) as Arc<dyn StreamAcceptor>);
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
                                    gate,
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
