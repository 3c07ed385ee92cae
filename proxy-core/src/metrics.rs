//! What the server reports, as a small observer trait, and a ready Prometheus implementation.
//!
//! The server calls the observer from its connection tasks; implementations must be cheap and
//! must not block. Byte counts are reported as deltas every
//! [`ServerConfig::report_interval`](crate::server::ServerConfig::report_interval) and at the
//! end of each connection, so long-lived connections show up in the metrics while they run.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use crate::copy::Direction;
use crate::error::ConnectError;
use crate::pipe;
use crate::relay::{Ending, RelaySummary};

/// Identifies the listener and route a connection belongs to.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct RouteLabels {
    /// The listener's local address, e.g. `0.0.0.0:9001`.
    pub listener: String,
    /// The route's name.
    pub route: String,
}

/// Receives connection events from the server.
///
/// Every [`connection_opened`](Self::connection_opened) is followed by exactly one
/// [`connection_closed`](Self::connection_closed); when the upstream could not be reached,
/// [`connect_failed`](Self::connect_failed) comes in between. All methods default to doing
/// nothing.
pub trait RelayObserver: Send + Sync {
    /// A client connection was accepted and will be relayed.
    fn connection_opened(&self, labels: &RouteLabels) {
        let _ = labels;
    }

    /// A client connection was refused because the listener is at its connection limit.
    fn connection_rejected(&self, labels: &RouteLabels) {
        let _ = labels;
    }

    /// A client was closed at accept because the listener's
    /// [source filter](crate::source::SourceFilter) does not admit its address. No
    /// [`connection_opened`](Self::connection_opened) or
    /// [`connection_closed`](Self::connection_closed) is reported for it.
    fn source_refused(&self, labels: &RouteLabels, refusal: &SourceRefusal) {
        let _ = (labels, refusal);
    }

    /// Connecting to the upstream failed; the client connection is closed.
    fn connect_failed(&self, labels: &RouteLabels, error: &ConnectError) {
        let _ = (labels, error);
    }

    /// Bytes moved since the previous report for this connection.
    fn bytes_relayed(&self, labels: &RouteLabels, direction: Direction, bytes: u64) {
        let _ = (labels, direction, bytes);
    }

    /// The connection ended.
    fn connection_closed(&self, labels: &RouteLabels, summary: &RelaySummary) {
        let _ = (labels, summary);
    }
}

/// A client refused for its source address (see [`RelayObserver::source_refused`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SourceRefusal {
    /// The listener's local address.
    pub listener: SocketAddr,
    /// The client's address.
    pub peer: SocketAddr,
}

/// An observer that ignores everything.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoopObserver;

impl RelayObserver for NoopObserver {}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    listener: String,
    route: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndingLabels {
    listener: String,
    route: String,
    ending: &'static str,
}

/// Prometheus metrics for the server, labelled by `listener` and `route`:
///
/// | name | type | extra labels |
/// |---|---|---|
/// | `proxy_connections_active` | gauge | |
/// | `proxy_connections_total` | counter | |
/// | `proxy_connections_rejected_total` | counter | |
/// | `proxy_connections_source_refused_total` | counter | |
/// | `proxy_connections_closed_total` | counter | `ending` |
/// | `proxy_bytes_total` | counter | `direction` (`to_upstream`, `to_client`) |
/// | `proxy_connect_errors_total` | counter | |
/// | `proxy_connect_timeouts_total` | counter | |
///
/// A timeout counts in both `connect_errors` and `connect_timeouts`.
///
/// It also exports the process-wide [pipe pool](crate::pipe), without labels, read at each
/// scrape:
///
/// | name | type | |
/// |---|---|---|
/// | `proxy_pipe_budget_bytes` | gauge | the budget of pipe buffer bytes |
/// | `proxy_pipe_allocated_bytes` | gauge | pipe buffer bytes held (lent and idle pipes) |
/// | `proxy_pipes_in_use` | gauge | pipes lent to a copy now |
/// | `proxy_pipes_idle` | gauge | pipes waiting in the pool |
/// | `proxy_pipes_created_total` | counter | pipes opened |
/// | `proxy_pipe_budget_exhausted_total` | counter | streaming copies that stayed buffered for want of budget |
/// | `proxy_pipe_resize_refused_total` | counter | pipe sizes the kernel refused (user pipe limit) |
///
/// ```
/// use prometheus_client::registry::Registry;
/// use proxy_core::metrics::{PrometheusObserver, RelayObserver, RouteLabels};
///
/// let mut registry = Registry::default();
/// let metrics = PrometheusObserver::register(&mut registry);
/// let labels = RouteLabels { listener: "0.0.0.0:443".into(), route: "apiserver".into() };
/// metrics.connection_opened(&labels);
///
/// let mut text = String::new();
/// prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
/// assert!(text.contains(r#"proxy_connections_active{listener="0.0.0.0:443",route="apiserver"} 1"#));
/// assert!(text.contains("proxy_pipe_budget_bytes "));
/// ```
#[derive(Clone, Debug, Default)]
pub struct PrometheusObserver {
    active: Family<RouteLabels, Gauge>,
    connections: Family<RouteLabels, Counter>,
    rejected: Family<RouteLabels, Counter>,
    source_refused: Family<RouteLabels, Counter>,
    closed: Family<EndingLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    connect_errors: Family<RouteLabels, Counter>,
    connect_timeouts: Family<RouteLabels, Counter>,
    /// Each route's series, looked up once per route rather than by labels (with their
    /// strings cloned) at every event of every connection.
    routes: Arc<RwLock<HashMap<RouteLabels, Arc<RouteMetrics>>>>,
}

/// How many kinds of [`Ending`] there are ([`RouteMetrics::closed`] has a slot for each).
const ENDING_KINDS: usize = 7;

fn ending_index(ending: &Ending) -> usize {
    match ending {
        Ending::Completed => 0,
        Ending::Reset { .. } => 1,
        Ending::Error { .. } => 2,
        Ending::IdleTimeout => 3,
        Ending::MaxLifetime => 4,
        Ending::Cancelled => 5,
        Ending::ConnectFailed => 6,
    }
}

/// One route's series. Those that only exist once something happened (rejections, errors,
/// bytes, each ending) are made on first use, so the exposition is as without the cache.
#[derive(Debug)]
struct RouteMetrics {
    labels: RouteLabels,
    active: Gauge,
    connections: Counter,
    rejected: OnceLock<Counter>,
    source_refused: OnceLock<Counter>,
    connect_errors: OnceLock<Counter>,
    connect_timeouts: OnceLock<Counter>,
    /// By [`Direction`]: to the upstream, to the client.
    bytes: [OnceLock<Counter>; 2],
    closed: [OnceLock<Counter>; ENDING_KINDS],
}

impl PrometheusObserver {
    /// The series of `labels`' route, made on its first connection.
    fn route(&self, labels: &RouteLabels) -> Arc<RouteMetrics> {
        if let Some(route) = self
            .routes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(labels)
        {
            return Arc::clone(route);
        }
        let mut routes = self.routes.write().unwrap_or_else(PoisonError::into_inner);
        let route = routes.entry(labels.clone()).or_insert_with(|| {
            Arc::new(RouteMetrics {
                labels: labels.clone(),
                active: self.active.get_or_create(labels).clone(),
                connections: self.connections.get_or_create(labels).clone(),
                rejected: OnceLock::new(),
                source_refused: OnceLock::new(),
                connect_errors: OnceLock::new(),
                connect_timeouts: OnceLock::new(),
                bytes: [OnceLock::new(), OnceLock::new()],
                closed: Default::default(),
            })
        });
        Arc::clone(route)
    }

    fn counter(
        &self,
        slot: &OnceLock<Counter>,
        family: &Family<RouteLabels, Counter>,
        labels: &RouteLabels,
    ) -> Counter {
        slot.get_or_init(|| family.get_or_create(labels).clone())
            .clone()
    }

    /// Creates the metrics and registers them under the `proxy_` prefix of `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        let registry = registry.sub_registry_with_prefix("proxy");
        registry.register(
            "connections_active",
            "Client connections currently open",
            metrics.active.clone(),
        );
        registry.register(
            "connections",
            "Client connections accepted",
            metrics.connections.clone(),
        );
        registry.register(
            "connections_rejected",
            "Client connections refused at the connection limit",
            metrics.rejected.clone(),
        );
        registry.register(
            "connections_source_refused",
            "Client connections closed at accept because the listener's source filter does not admit their address",
            metrics.source_refused.clone(),
        );
        registry.register(
            "connections_closed",
            "Client connections closed, by how they ended",
            metrics.closed.clone(),
        );
        registry.register(
            "bytes",
            "Bytes relayed, by direction",
            metrics.bytes.clone(),
        );
        registry.register(
            "connect_errors",
            "Failed upstream connects (refused, DNS, timeout, no healthy target)",
            metrics.connect_errors.clone(),
        );
        registry.register(
            "connect_timeouts",
            "Upstream connects that timed out",
            metrics.connect_timeouts.clone(),
        );
        registry.register_collector(Box::new(PipeCollector));
        metrics
    }
}

impl RelayObserver for PrometheusObserver {
    fn connection_opened(&self, labels: &RouteLabels) {
        let route = self.route(labels);
        route.active.inc();
        route.connections.inc();
    }

    fn connection_rejected(&self, labels: &RouteLabels) {
        let route = self.route(labels);
        self.counter(&route.rejected, &self.rejected, labels).inc();
    }

    fn source_refused(&self, labels: &RouteLabels, _: &SourceRefusal) {
        let route = self.route(labels);
        self.counter(&route.source_refused, &self.source_refused, labels)
            .inc();
    }

    fn connect_failed(&self, labels: &RouteLabels, error: &ConnectError) {
        let route = self.route(labels);
        self.counter(&route.connect_errors, &self.connect_errors, labels)
            .inc();
        if error.is_timeout() {
            self.counter(&route.connect_timeouts, &self.connect_timeouts, labels)
                .inc();
        }
    }

    fn bytes_relayed(&self, labels: &RouteLabels, direction: Direction, bytes: u64) {
        let route = self.route(labels);
        let slot = match direction {
            Direction::ToUpstream => &route.bytes[0],
            Direction::ToClient => &route.bytes[1],
        };
        slot.get_or_init(|| {
            let labels = DirectionLabels {
                listener: route.labels.listener.clone(),
                route: route.labels.route.clone(),
                direction: direction.as_str(),
            };
            self.bytes.get_or_create(&labels).clone()
        })
        .inc_by(bytes);
    }

    fn connection_closed(&self, labels: &RouteLabels, summary: &RelaySummary) {
        let route = self.route(labels);
        route.active.dec();
        let index = ending_index(&summary.ending);
        route.closed[index]
            .get_or_init(|| {
                let labels = EndingLabels {
                    listener: route.labels.listener.clone(),
                    route: route.labels.route.clone(),
                    ending: summary.ending.as_str(),
                };
                self.closed.get_or_create(&labels).clone()
            })
            .inc();
    }
}

/// Reads [`pipe::stats`] at each scrape.
#[derive(Debug)]
struct PipeCollector;

impl Collector for PipeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let stats = pipe::stats();
        let gauges = [
            (
                "pipe_budget_bytes",
                "Budget of pipe buffer bytes for the splice path",
                stats.budget_bytes,
            ),
            (
                "pipe_allocated_bytes",
                "Pipe buffer bytes held by lent and idle pipes",
                stats.allocated_bytes,
            ),
            ("pipes_in_use", "Pipes lent to a copy", stats.in_use),
            ("pipes_idle", "Pipes waiting in the pool", stats.idle),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters = [
            ("pipes_created", "Pipes opened", stats.created),
            (
                "pipe_budget_exhausted",
                "Streaming copies that stayed buffered because the pipe budget was spent",
                stats.budget_exhausted,
            ),
            (
                "pipe_resize_refused",
                "Pipe sizes the kernel refused (the user's pipe limit was reached)",
                stats.resize_refused,
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}
