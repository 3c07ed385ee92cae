//! The server's settings and the values it reports: listener and server configuration, drain
//! reports, listener and connection status, port ranges.

use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::accept::StreamAcceptor;
use crate::copy::RelayCounters;
use crate::error::ConfigError;
use crate::relay::{RelayConfig, Route};
use crate::source::SourceFilter;

/// Shortest pause after a failed accept.
pub(super) const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);

/// Server-wide settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerConfig {
    /// How often running connections report their byte counts to the observer.
    pub report_interval: Duration,
    /// Listen backlog of each listener.
    pub backlog: u32,
    /// Longest pause between accepts after repeated accept errors.
    pub accept_backoff_max: Duration,
    /// During a drain, close a connection as soon as its last bytes went to the client and
    /// nothing has moved for this long, instead of at the deadline: between an answer and the
    /// next request, as an HTTP server's graceful shutdown closes idle keep-alive connections.
    /// `None` (the default) keeps every connection until it ends or the deadline.
    pub drain_idle: Option<Duration>,
    /// Accept and relay on this many threads of the server's own, each one event loop (a
    /// current-thread runtime) with a listening socket of its own per listener, bound with
    /// `SO_REUSEPORT`: the kernel spreads new connections among the sockets, and a connection
    /// stays on the thread that accepted it, with no hand-off between threads (as Envoy's
    /// workers or HAProxy's `shards by-thread`). `None` (the default) accepts on the caller's
    /// runtime, whose scheduler then places each connection's task.
    ///
    /// The threads start with the first listener and stop when the server shuts down or its
    /// last handle is dropped. Caveat of `SO_REUSEPORT`: another process of the same user that
    /// also sets it can bind the same address and take a share of the connections.
    pub accept_workers: Option<NonZeroUsize>,
    /// What relays the connections of listeners without an accept layer: connection state
    /// machines on event loops of the server's own on Linux, a tokio task each elsewhere (the
    /// default, [`DataPath::Auto`]), or either one by choice.
    pub data_path: DataPath,
}

/// What relays a listener's plain TCP connections (listeners with an
/// [accept layer](crate::accept) always use tokio tasks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataPath {
    /// The event loops on Linux, tokio tasks elsewhere (the default: on Linux the event loops
    /// spend less CPU per connection and far less memory per idle connection, see
    /// `cargo xtask bench proxy`).
    #[default]
    Auto,
    /// Linux only: each connection a state machine on one of the server's event-loop threads
    /// (one per accept worker, or one): edge-triggered epoll, a pipe or the thread's scratch
    /// buffer for the bytes, a coarse timer wheel for its timeouts. Routes whose upstream is
    /// not a single socket address (host names, sets, connectors, HTTP proxies) are relayed by
    /// a tokio task, per connection.
    EventLoop,
    /// A tokio task per connection, on the caller's runtime or the accept workers' runtimes.
    Tokio,
}

impl DataPath {
    /// Whether plain listeners use the event loops on this system.
    pub fn uses_event_loop(self) -> bool {
        match self {
            DataPath::Auto | DataPath::EventLoop => cfg!(target_os = "linux"),
            DataPath::Tokio => false,
        }
    }

    /// The name [`FromStr`] parses: `auto`, `event-loop` or `tokio`.
    pub fn as_str(self) -> &'static str {
        match self {
            DataPath::Auto => "auto",
            DataPath::EventLoop => "event-loop",
            DataPath::Tokio => "tokio",
        }
    }
}

impl FromStr for DataPath {
    type Err = ConfigError;

    /// Parses `auto`, `event-loop` or `tokio`.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        match input.trim() {
            "auto" => Ok(DataPath::Auto),
            "event-loop" => Ok(DataPath::EventLoop),
            "tokio" => Ok(DataPath::Tokio),
            _ => Err(ConfigError::InvalidDataPath {
                input: input.to_owned(),
            }),
        }
    }
}

impl fmt::Display for DataPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Default for ServerConfig {
    /// Reports every 10 s, backlog 1024, accept backoff up to 1 s, accepts on the caller's
    /// runtime, [`DataPath::Auto`] (the event loops on Linux).
    fn default() -> Self {
        Self {
            report_interval: Duration::from_secs(10),
            backlog: 1024,
            accept_backoff_max: Duration::from_secs(1),
            drain_idle: None,
            accept_workers: None,
            data_path: DataPath::default(),
        }
    }
}

impl ServerConfig {
    /// Sets the report interval.
    #[must_use]
    pub fn with_report_interval(mut self, interval: Duration) -> Self {
        self.report_interval = interval;
        self
    }

    /// Closes answered connections idle for `idle` during a drain (see
    /// [`ServerConfig::drain_idle`]).
    #[must_use]
    pub fn with_drain_idle(mut self, idle: Duration) -> Self {
        self.drain_idle = Some(idle);
        self
    }

    /// Accepts and relays on `workers` threads of their own (see
    /// [`ServerConfig::accept_workers`]).
    #[must_use]
    pub fn with_accept_workers(mut self, workers: Option<NonZeroUsize>) -> Self {
        self.accept_workers = workers;
        self
    }

    /// Sets the data path (see [`ServerConfig::data_path`]).
    #[must_use]
    pub fn with_data_path(mut self, data_path: DataPath) -> Self {
        self.data_path = data_path;
        self
    }

    /// Rejects zero values, and the event-loop data path where it does not exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.data_path == DataPath::EventLoop && !cfg!(target_os = "linux") {
            return Err(ConfigError::Inconsistent(
                "the event-loop data path exists on Linux only",
            ));
        }
        if self.drain_idle.is_some_and(|idle| idle.is_zero()) {
            return Err(ConfigError::Zero {
                what: "drain idle time",
            });
        }
        if self.report_interval.is_zero() {
            return Err(ConfigError::Zero {
                what: "report interval",
            });
        }
        if self.backlog == 0 {
            return Err(ConfigError::Zero {
                what: "listen backlog",
            });
        }
        if self.accept_backoff_max < ACCEPT_BACKOFF_MIN {
            return Err(ConfigError::Inconsistent(
                "accept backoff maximum below 5 ms",
            ));
        }
        Ok(())
    }
}

/// One listener: where to bind, where to forward, and how.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ListenerConfig {
    /// Address to bind; port 0 picks a free port (see
    /// [`ProxyServer::add_listener`](super::ProxyServer::add_listener)'s return).
    pub bind: SocketAddr,
    /// Where connections go; replaceable with
    /// [`ProxyServer::set_route`](super::ProxyServer::set_route).
    pub route: Route,
    /// Most connections open at once, or `None` for no limit.
    pub max_connections: Option<usize>,
    /// Timeouts, copy mode and socket options.
    pub relay: RelayConfig,
    /// An accept layer (e.g. TLS termination) that prepares both legs instead of the plain TCP
    /// connect; `None` relays TCP to TCP.
    pub acceptor: Option<Arc<dyn StreamAcceptor>>,
    /// The client addresses admitted; any other client is reset at accept, before an upstream
    /// is connected, and counted. `None` admits every source. Replaceable with
    /// [`ProxyServer::set_source_filter`](super::ProxyServer::set_source_filter).
    pub source_filter: Option<SourceFilter>,
}

impl ListenerConfig {
    /// A listener on `bind` forwarding to `route`, without limit, with default relay settings.
    pub fn new(bind: SocketAddr, route: Route) -> Self {
        Self {
            bind,
            route,
            max_connections: None,
            relay: RelayConfig::default(),
            acceptor: None,
            source_filter: None,
        }
    }

    /// Admits only the clients `filter` admits (see [`ListenerConfig::source_filter`]).
    #[must_use]
    pub fn with_source_filter(mut self, filter: SourceFilter) -> Self {
        self.source_filter = Some(filter);
        self
    }

    /// Sets the accept layer.
    #[must_use]
    pub fn with_acceptor(mut self, acceptor: Arc<dyn StreamAcceptor>) -> Self {
        self.acceptor = Some(acceptor);
        self
    }

    /// Sets the connection limit.
    #[must_use]
    pub fn with_max_connections(mut self, limit: Option<usize>) -> Self {
        self.max_connections = limit;
        self
    }

    /// Sets the relay settings.
    #[must_use]
    pub fn with_relay(mut self, relay: RelayConfig) -> Self {
        self.relay = relay;
        self
    }

    /// Rejects a zero connection limit and invalid relay settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self.max_connections {
            Some(0) => Err(ConfigError::Zero {
                what: "max connections",
            }),
            Some(limit) if limit > Semaphore::MAX_PERMITS => Err(ConfigError::Inconsistent(
                "max connections above the supported maximum",
            )),
            _ => self.relay.validate(),
        }
    }
}

/// What happens to open connections when a route is replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExistingConnections {
    /// They keep their upstream until they end.
    Keep,
    /// They are closed at once.
    Close,
}

/// The outcome of a drain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Connections that ended on their own before the deadline.
    pub finished: usize,
    /// Connections closed at the deadline.
    pub forced: usize,
    /// Connections closed during the drain once answered and idle (see
    /// [`ServerConfig::drain_idle`]).
    pub closed_idle: usize,
}

impl std::ops::Add for DrainReport {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        Self {
            finished: self.finished + other.finished,
            forced: self.forced + other.forced,
            closed_idle: self.closed_idle + other.closed_idle,
        }
    }
}

/// A listener as seen from outside.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListenerStatus {
    /// The bound address.
    pub local_addr: SocketAddr,
    /// The current route's name.
    pub route: String,
    /// The current route's upstream, described.
    pub upstream: String,
    /// Connections open now.
    pub active_connections: usize,
}

/// A running connection, with live counters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConnectionStatus {
    /// Server-unique connection number.
    pub id: u64,
    /// The client's address.
    pub client: SocketAddr,
    /// The route it was accepted under.
    pub route: String,
    /// Bytes moved so far and last activity.
    pub counters: Arc<RelayCounters>,
}

/// An inclusive range of ports, e.g. for allocating mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    start: u16,
    end: u16,
}

impl PortRange {
    /// The ports `start..=end`; rejects a reversed range and port 0.
    pub fn new(start: u16, end: u16) -> Result<Self, ConfigError> {
        if start > end {
            return Err(ConfigError::ReversedPortRange { start, end });
        }
        if start == 0 {
            return Err(ConfigError::Zero {
                what: "first port of a range",
            });
        }
        Ok(Self { start, end })
    }

    /// First port.
    pub fn start(&self) -> u16 {
        self.start
    }

    /// Last port.
    pub fn end(&self) -> u16 {
        self.end
    }

    /// Whether `port` is in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }
}

impl FromStr for PortRange {
    type Err = ConfigError;

    /// Parses `9000-9100` or a single port `9000`.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let invalid = || ConfigError::InvalidAddress {
            input: input.to_owned(),
            reason: "expected PORT or PORT-PORT",
        };
        let (start, end) = input.split_once('-').unwrap_or((input, input));
        let start = start.trim().parse().map_err(|_| invalid())?;
        let end = end.trim().parse().map_err(|_| invalid())?;
        Self::new(start, end)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}
