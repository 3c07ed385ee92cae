//! Listeners with live routes: add, retarget and remove at runtime, per-listener connection
//! limits, graceful drain and shutdown.
//!
//! Ownership: the [`ProxyServer`] holds one entry per listener. Each listener has an accept
//! task, a byte reporter and a [`TaskTracker`] for its connections; the server's tracker holds
//! each listener's tasks, and shutdown drains every listener (which waits for its
//! connections), then waits for the server's tracker. Cancellation is a tree of
//! [`CancellationToken`]s: server shutdown → listener → route generation → connection, so
//! closing a listener or retiring a route closes exactly the connections below it.
//!
//! Choices made here, and why:
//! * Over the connection limit, a new client is accepted and reset at once (and counted as
//!   rejected) rather than left in the kernel backlog, so it fails fast and holds no
//!   descriptor.
//! * When the upstream cannot be reached, the client connection is simply closed.
//! * Accept errors that concern one connection (aborted handshakes) are skipped; others
//!   (`EMFILE`, `ENFILE`, `ENOBUFS`) pause accepting with exponential backoff, as a tight retry
//!   loop would burn a core while descriptors are exhausted.
//! * Dropping the last [`ProxyServer`] handle closes every listener and connection at once;
//!   call [`ProxyServer::shutdown`] for a graceful drain.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use crate::accept::{AcceptError, StreamAcceptor};
use crate::copy::{CopyMode, Direction, RelayCounters};
use crate::error::{ConfigError, ConnectError, ServerError};
use crate::metrics::{RelayObserver, RouteLabels};
use crate::relay::{self, Ending, RelayConfig, RelaySummary, Route};
use crate::socket;

/// Shortest pause after a failed accept.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);

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
}

impl Default for ServerConfig {
    /// Reports every 10 s, backlog 1024, accept backoff up to 1 s.
    fn default() -> Self {
        Self {
            report_interval: Duration::from_secs(10),
            backlog: 1024,
            accept_backoff_max: Duration::from_secs(1),
            drain_idle: None,
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

    /// Rejects zero values.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
    /// Address to bind; port 0 picks a free port (see [`ProxyServer::add_listener`]'s return).
    pub bind: SocketAddr,
    /// Where connections go; replaceable with [`ProxyServer::set_route`].
    pub route: Route,
    /// Most connections open at once, or `None` for no limit.
    pub max_connections: Option<usize>,
    /// Timeouts, copy mode and socket options.
    pub relay: RelayConfig,
    /// An accept layer (e.g. TLS termination) that prepares both legs instead of the plain TCP
    /// connect; `None` relays TCP to TCP.
    pub acceptor: Option<Arc<dyn StreamAcceptor>>,
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
        }
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

/// A TCP proxy server with listeners and routes that change at runtime.
///
/// Cheap to clone; all clones control the same server. Must be used inside a Tokio runtime.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use std::time::Duration;
/// use proxy_core::metrics::NoopObserver;
/// use proxy_core::relay::Route;
/// use proxy_core::server::{ListenerConfig, ProxyServer, ServerConfig};
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// use tokio::net::{TcpListener, TcpStream};
///
/// let backend = TcpListener::bind("127.0.0.1:0").await?;
/// let backend_addr = backend.local_addr()?;
/// tokio::spawn(async move {
///     let (mut conn, _) = backend.accept().await?;
///     conn.write_all(b"hello").await?;
///     conn.shutdown().await
/// });
///
/// let server = ProxyServer::new(ServerConfig::default(), Arc::new(NoopObserver))?;
/// let route = Route::new("backend", backend_addr);
/// let addr = server.add_listener(ListenerConfig::new("127.0.0.1:0".parse()?, route))?;
///
/// let mut client = TcpStream::connect(addr).await?;
/// let mut reply = String::new();
/// client.read_to_string(&mut reply).await?;
/// assert_eq!(reply, "hello");
/// drop(client); // the relay ends once both directions reached EOF
///
/// let report = server.shutdown(Duration::from_secs(5)).await;
/// assert_eq!(report.forced, 0);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ProxyServer {
    shared: Arc<ServerShared>,
    /// Cancels everything when the last handle goes away.
    _close_on_drop: Arc<DropGuard>,
}

impl fmt::Debug for ProxyServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyServer")
            .field("listeners", &self.listeners())
            .finish_non_exhaustive()
    }
}

struct ServerShared {
    config: ServerConfig,
    observer: Arc<dyn RelayObserver>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    listeners: Mutex<HashMap<SocketAddr, Arc<ListenerShared>>>,
    closing: AtomicBool,
    next_connection_id: AtomicU64,
}

struct ListenerShared {
    local_addr: SocketAddr,
    relay: RelayConfig,
    /// Accepted sockets inherit the relay's socket options from the listener (set once).
    client_options_inherited: bool,
    acceptor: Option<Arc<dyn StreamAcceptor>>,
    route: Mutex<Arc<ActiveRoute>>,
    /// Stops the accept loop; a child of the server's shutdown token.
    stop_accepting: CancellationToken,
    /// Closes every connection of this listener; a child of the server's shutdown token.
    close_connections: CancellationToken,
    connection_tasks: TaskTracker,
    connections: Mutex<HashMap<u64, Arc<Live>>>,
    limit: Option<Arc<Semaphore>>,
    accept_task: Mutex<Option<JoinHandle<()>>>,
}

/// One open connection as its listener lists it: shared by the connection's task, the
/// listener's map and the listener's byte reporter.
struct Live {
    id: u64,
    client: SocketAddr,
    route: Arc<ActiveRoute>,
    counters: Arc<RelayCounters>,
    /// Closes this connection alone; a child of its route generation's token.
    close: CancellationToken,
    /// Bytes already reported to the observer, per direction: the reporter and the
    /// connection's end both report, and `fetch_max` hands each byte to exactly one of them.
    reported: [AtomicU64; 2],
}

impl Live {
    fn status(&self) -> ConnectionStatus {
        ConnectionStatus {
            id: self.id,
            client: self.client,
            route: self.route.route.name.clone(),
            counters: Arc::clone(&self.counters),
        }
    }

    /// Reports the bytes moved since the last report.
    fn report_bytes(&self, observer: &dyn RelayObserver) {
        for (slot, direction) in self
            .reported
            .iter()
            .zip([Direction::ToUpstream, Direction::ToClient])
        {
            let now = self.counters.get(direction);
            let before = slot.fetch_max(now, Ordering::AcqRel);
            if now > before {
                observer.bytes_relayed(&self.route.labels, direction, now - before);
            }
        }
    }
}

/// One generation of a listener's route. Connections keep the generation they started with.
struct ActiveRoute {
    route: Route,
    labels: RouteLabels,
    /// Closes the connections of this generation only.
    cancel: CancellationToken,
}

/// Locks a mutex whose data stays consistent even if a holder panicked (every critical section
/// here is a single insert, remove or replace).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ProxyServer {
    /// A server without listeners, reporting to `observer`.
    pub fn new(
        config: ServerConfig,
        observer: Arc<dyn RelayObserver>,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let shutdown = CancellationToken::new();
        Ok(Self {
            _close_on_drop: Arc::new(shutdown.clone().drop_guard()),
            shared: Arc::new(ServerShared {
                config,
                observer,
                shutdown,
                tracker: TaskTracker::new(),
                listeners: Mutex::new(HashMap::new()),
                closing: AtomicBool::new(false),
                next_connection_id: AtomicU64::new(0),
            }),
        })
    }

    /// Binds a listener and starts accepting. Returns the bound address (useful with port 0).
    ///
    /// # Panics
    ///
    /// When called outside a Tokio runtime.
    pub fn add_listener(&self, config: ListenerConfig) -> Result<SocketAddr, ServerError> {
        config.validate()?;
        let shared = &self.shared;
        if shared.closing.load(Ordering::Acquire) {
            return Err(ServerError::ShuttingDown);
        }
        if config.bind.port() != 0 && lock(&shared.listeners).contains_key(&config.bind) {
            return Err(ServerError::ListenerExists(config.bind));
        }
        let listener = bind(config.bind, shared.config.backlog)?;
        let local_addr = listener.local_addr().map_err(|cause| ServerError::Bind {
            addr: config.bind,
            cause,
        })?;
        // Set once on the listener rather than on every accepted socket, where the system
        // lets accepted sockets inherit them: five fewer syscalls per connection.
        let client_options_inherited =
            config.acceptor.is_none() && config.relay.socket.apply_to_listener(&listener);
        let close_connections = shared.shutdown.child_token();
        let state = Arc::new(ListenerShared {
            local_addr,
            relay: config.relay,
            client_options_inherited,
            acceptor: config.acceptor,
            route: Mutex::new(Arc::new(ActiveRoute::new(
                config.route,
                local_addr,
                &close_connections,
            ))),
            stop_accepting: shared.shutdown.child_token(),
            close_connections,
            connection_tasks: TaskTracker::new(),
            connections: Mutex::new(HashMap::new()),
            limit: config
                .max_connections
                .map(|limit| Arc::new(Semaphore::new(limit))),
            accept_task: Mutex::new(None),
        });
        {
            // Registered and started under one lock, so a concurrent removal always finds the
            // accept task to wait for.
            let mut listeners = lock(&shared.listeners);
            if listeners.contains_key(&local_addr) {
                return Err(ServerError::ListenerExists(local_addr));
            }
            let task = shared.tracker.spawn(accept_loop(
                listener,
                Arc::clone(&state),
                Arc::clone(shared),
            ));
            *lock(&state.accept_task) = Some(task);
            shared
                .tracker
                .spawn(report_bytes(Arc::clone(&state), Arc::clone(shared)));
            listeners.insert(local_addr, Arc::clone(&state));
        }
        tracing::info!(listener = %local_addr, route = %lock(&state.route).route.name, "listening");
        Ok(local_addr)
    }

    /// Binds a listener on the first free port of `range` on `ip`; `config.bind` is ignored.
    pub fn add_listener_in_range(
        &self,
        ip: IpAddr,
        range: PortRange,
        config: ListenerConfig,
    ) -> Result<SocketAddr, ServerError> {
        for port in range.start..=range.end {
            let config = ListenerConfig {
                bind: SocketAddr::new(ip, port),
                ..config.clone()
            };
            match self.add_listener(config) {
                Err(ServerError::ListenerExists(_)) => {}
                Err(ServerError::Bind { cause, .. })
                    if cause.kind() == io::ErrorKind::AddrInUse => {}
                other => return other,
            }
        }
        Err(ServerError::NoFreePort {
            start: range.start,
            end: range.end,
        })
    }

    /// Replaces the route of a listener atomically: connections accepted from now on use
    /// `route`; open ones keep their upstream or are closed, per `existing`.
    pub fn set_route(
        &self,
        listener: SocketAddr,
        route: Route,
        existing: ExistingConnections,
    ) -> Result<(), ServerError> {
        let state = self.listener(listener)?;
        let next = Arc::new(ActiveRoute::new(
            route,
            state.local_addr,
            &state.close_connections,
        ));
        tracing::info!(listener = %listener, route = %next.route.name, upstream = %next.route.upstream.describe(), "route replaced");
        let previous = std::mem::replace(&mut *lock(&state.route), next);
        if existing == ExistingConnections::Close {
            previous.cancel.cancel();
        }
        Ok(())
    }

    /// Stops accepting on `listener` at once (the port is free when this returns), lets its
    /// connections finish for up to `drain`, then closes the rest.
    pub async fn remove_listener(
        &self,
        listener: SocketAddr,
        drain: Duration,
    ) -> Result<DrainReport, ServerError> {
        let state = lock(&self.shared.listeners)
            .remove(&listener)
            .ok_or(ServerError::UnknownListener(listener))?;
        Ok(state.drain(drain, self.shared.config.drain_idle).await)
    }

    /// Graceful shutdown: stops every listener, lets connections finish for up to `drain`,
    /// closes the rest and waits for every task. New listeners are refused from now on.
    pub async fn shutdown(&self, drain: Duration) -> DrainReport {
        self.shared.closing.store(true, Ordering::Release);
        let listeners: Vec<_> = lock(&self.shared.listeners)
            .drain()
            .map(|(_, l)| l)
            .collect();
        let reports = futures::future::join_all(
            listeners
                .iter()
                .map(|l| l.drain(drain, self.shared.config.drain_idle)),
        )
        .await;
        self.shared.shutdown.cancel();
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
        reports
            .into_iter()
            .fold(DrainReport::default(), |sum, r| sum + r)
    }

    /// The token whose cancellation closes every listener and connection at once, without
    /// drain. Cancel it from a signal handler for a hard stop.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.shared.shutdown.clone()
    }

    /// The listeners, sorted by address.
    pub fn listeners(&self) -> Vec<ListenerStatus> {
        let mut statuses: Vec<_> = lock(&self.shared.listeners)
            .values()
            .map(|state| {
                let route = Arc::clone(&lock(&state.route));
                ListenerStatus {
                    local_addr: state.local_addr,
                    route: route.route.name.clone(),
                    upstream: route.route.upstream.describe(),
                    active_connections: lock(&state.connections).len(),
                }
            })
            .collect();
        statuses.sort_by_key(|s| s.local_addr);
        statuses
    }

    /// The open connections of `listener`, sorted by id, with live counters.
    pub fn connections(&self, listener: SocketAddr) -> Result<Vec<ConnectionStatus>, ServerError> {
        let state = self.listener(listener)?;
        let mut connections: Vec<_> = lock(&state.connections)
            .values()
            .map(|live| live.status())
            .collect();
        connections.sort_by_key(|c| c.id);
        Ok(connections)
    }

    fn listener(&self, addr: SocketAddr) -> Result<Arc<ListenerShared>, ServerError> {
        lock(&self.shared.listeners)
            .get(&addr)
            .cloned()
            .ok_or(ServerError::UnknownListener(addr))
    }
}

fn bind(addr: SocketAddr, backlog: u32) -> Result<TcpListener, ServerError> {
    socket::bind_listener(addr, backlog).map_err(|cause| ServerError::Bind { addr, cause })
}

impl ActiveRoute {
    fn new(route: Route, listener: SocketAddr, parent: &CancellationToken) -> Self {
        Self {
            labels: RouteLabels {
                listener: listener.to_string(),
                route: route.name.clone(),
            },
            route,
            cancel: parent.child_token(),
        }
    }
}

impl ListenerShared {
    async fn drain(&self, deadline: Duration, idle: Option<Duration>) -> DrainReport {
        self.stop_accepting.cancel();
        let accept_task = lock(&self.accept_task).take();
        if let Some(task) = accept_task {
            // The task ends by itself once cancelled; a panic in it has been logged already.
            let _ = task.await;
        }
        let in_flight = self.connection_tasks.len();
        self.connection_tasks.close();
        let deadline = tokio::time::Instant::now() + deadline;
        // Checked a few times per idle period, so a connection closes soon after it qualifies.
        let sweep = idle.map(|idle| (idle / 4).max(Duration::from_millis(1)));
        let mut closed_idle = 0;
        let ended_in_time = loop {
            tokio::select! {
                () = self.connection_tasks.wait() => break true,
                () = tokio::time::sleep_until(deadline) => break false,
                () = tokio::time::sleep(sweep.unwrap_or_default()), if sweep.is_some() => {
                    closed_idle += idle.map_or(0, |idle| self.close_answered_idle(idle));
                }
            }
        };
        let forced = if ended_in_time {
            0
        } else {
            let remaining = self.connection_tasks.len();
            self.close_connections.cancel();
            self.connection_tasks.wait().await;
            remaining
        };
        tracing::info!(listener = %self.local_addr, in_flight, closed_idle, forced, "listener drained");
        DrainReport {
            finished: in_flight.saturating_sub(forced + closed_idle),
            forced,
            closed_idle,
        }
    }

    /// Closes the connections whose last bytes went to the client and that have been quiet for
    /// `idle`; returns how many. One that moved nothing yet may still be connecting with a
    /// request buffered, so it is left to the deadline.
    fn close_answered_idle(&self, idle: Duration) -> usize {
        let connections = lock(&self.connections);
        let mut closed = 0;
        for connection in connections.values() {
            let counters = &connection.counters;
            let answered = counters.last_direction() == Some(Direction::ToClient);
            if answered
                && counters.last_activity().elapsed() >= idle
                && !connection.close.is_cancelled()
            {
                connection.close.cancel();
                closed += 1;
            }
        }
        closed
    }

    fn start_connection(
        self: &Arc<Self>,
        client: TcpStream,
        peer: SocketAddr,
        server: &Arc<ServerShared>,
    ) {
        let route = Arc::clone(&lock(&self.route));
        let permit = match &self.limit {
            None => None,
            Some(limit) => match Arc::clone(limit).try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    tracing::debug!(listener = %self.local_addr, %peer, "connection limit reached, rejecting");
                    server.observer.connection_rejected(&route.labels);
                    socket::reset_on_close(&client);
                    return;
                }
            },
        };
        let id = server.next_connection_id.fetch_add(1, Ordering::Relaxed);
        let close = route.cancel.child_token();
        let live = Arc::new(Live {
            id,
            client: peer,
            route,
            counters: Arc::new(RelayCounters::new()),
            close,
            reported: [AtomicU64::new(0), AtomicU64::new(0)],
        });
        lock(&self.connections).insert(id, Arc::clone(&live));
        let registration = Registration {
            listener: Arc::clone(self),
            id,
            _permit: permit,
        };
        let task = run_connection(
            client,
            live,
            self.relay,
            self.client_options_inherited,
            self.acceptor.clone(),
            Arc::clone(&server.observer),
            registration,
        );
        // Tracked by the listener only: every way the server stops drains each listener,
        // which waits for these tasks.
        tokio::spawn(self.connection_tasks.track_future(task));
    }
}

/// Keeps a connection listed and its limit slot taken until it ends, however it ends.
struct Registration {
    listener: Arc<ListenerShared>,
    id: u64,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&self.listener.connections).remove(&self.id);
    }
}

/// Reports the byte counts of a listener's running connections every report interval (one
/// timer per listener, not one per connection); each connection reports the rest as it ends.
async fn report_bytes(state: Arc<ListenerShared>, server: Arc<ServerShared>) {
    let mut ticks = tokio::time::interval(server.config.report_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.reset();
    let closed = state.close_connections.cancelled();
    let drained = state.connection_tasks.wait();
    let (mut closed, mut drained) = (pin!(closed), pin!(drained));
    loop {
        tokio::select! {
            () = &mut closed => break,
            () = &mut drained => break,
            _ = ticks.tick() => {}
        }
        let running: Vec<Arc<Live>> = lock(&state.connections).values().cloned().collect();
        for live in running {
            live.report_bytes(server.observer.as_ref());
        }
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<ListenerShared>, server: Arc<ServerShared>) {
    let mut backoff = ACCEPT_BACKOFF_MIN;
    // Made once: a new `cancelled()` future per accept would register a waiter each turn.
    let mut stop = pin!(state.stop_accepting.cancelled());
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut stop => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((client, peer)) => {
                backoff = ACCEPT_BACKOFF_MIN;
                state.start_connection(client, peer, &server);
            }
            Err(error) if concerns_one_connection(&error) => {
                tracing::debug!(%error, listener = %state.local_addr, "accept failed for one connection");
            }
            Err(error) => {
                tracing::warn!(%error, listener = %state.local_addr, retry_in = ?backoff, "accept failed, backing off");
                tokio::select! {
                    () = &mut stop => break,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = backoff
                    .saturating_mul(2)
                    .min(server.config.accept_backoff_max);
            }
        }
    }
    tracing::debug!(listener = %state.local_addr, "stopped accepting");
}

fn concerns_one_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

async fn run_connection(
    client: TcpStream,
    live: Arc<Live>,
    config: RelayConfig,
    client_ready: bool,
    acceptor: Option<Arc<dyn StreamAcceptor>>,
    observer: Arc<dyn RelayObserver>,
    _registration: Registration,
) {
    let route = &live.route;
    let labels = &route.labels;
    observer.connection_opened(labels);
    let reports = Reports {
        counters: &live.counters,
        observer: observer.as_ref(),
        labels,
    };
    let close = &live.close;
    let summary = match acceptor {
        None => relay_plain(client, client_ready, route, close, &config, &reports).await,
        Some(acceptor) => {
            relay_accepted(client, acceptor.as_ref(), route, close, &config, &reports).await
        }
    };
    live.report_bytes(observer.as_ref());
    tracing::debug!(
        route = %labels.route,
        listener = %labels.listener,
        ending = summary.ending.as_str(),
        to_upstream = summary.to_upstream,
        to_client = summary.to_client,
        duration = ?summary.duration,
        "connection closed"
    );
    observer.connection_closed(labels, &summary);
}

/// TCP to TCP: connect to the route's upstream, then relay (spliced where possible).
async fn relay_plain(
    client: TcpStream,
    client_ready: bool,
    route: &ActiveRoute,
    close: &CancellationToken,
    config: &RelayConfig,
    reports: &Reports<'_>,
) -> RelaySummary {
    let mode = config.copy_mode.resolve();
    let connected = tokio::select! {
        result = relay::connect_upstream(&route.route, &client, config) => Some(result),
        () = close.cancelled() => None,
    };
    match connected {
        None => RelaySummary::from_counters(reports.counters, Ending::Cancelled, mode),
        Some(Err(error)) => {
            reports.connect_failed(&error);
            drop(client);
            RelaySummary::from_counters(reports.counters, Ending::ConnectFailed, mode)
        }
        Some(Ok(upstream)) => {
            relay::relay_tcp_legs(
                client,
                upstream,
                config,
                reports.counters,
                close,
                client_ready,
            )
            .await
        }
    }
}

/// Through an accept layer: it prepares both legs within the connect timeout, then the buffered
/// path relays them.
async fn relay_accepted(
    client: TcpStream,
    acceptor: &dyn StreamAcceptor,
    route: &ActiveRoute,
    close: &CancellationToken,
    config: &RelayConfig,
    reports: &Reports<'_>,
) -> RelaySummary {
    let mode = CopyMode::Buffered;
    let prepared = tokio::select! {
        result = tokio::time::timeout(config.connect_timeout, acceptor.accept(client, &route.route, config)) => Some(result),
        () = close.cancelled() => None,
    };
    let failed = |reports: &Reports<'_>| {
        RelaySummary::from_counters(reports.counters, Ending::ConnectFailed, mode)
    };
    match prepared {
        None => RelaySummary::from_counters(reports.counters, Ending::Cancelled, mode),
        Some(Err(_elapsed)) => {
            tracing::debug!(listener = %reports.labels.listener, timeout = ?config.connect_timeout, "accept layer took too long, closing client");
            failed(reports)
        }
        Some(Ok(Err(AcceptError::Connect(error)))) => {
            reports.connect_failed(&error);
            failed(reports)
        }
        Some(Ok(Err(error))) => {
            tracing::debug!(%error, listener = %reports.labels.listener, "accept layer refused the connection");
            failed(reports)
        }
        Some(Ok(Ok(accepted))) => {
            relay::relay_streams(
                accepted.client,
                accepted.upstream,
                config,
                reports.counters,
                close,
            )
            .await
        }
    }
}

/// What a connection reports to the observer besides its bytes.
struct Reports<'a> {
    counters: &'a RelayCounters,
    observer: &'a dyn RelayObserver,
    labels: &'a RouteLabels,
}

impl Reports<'_> {
    fn connect_failed(&self, error: &ConnectError) {
        tracing::debug!(%error, route = %self.labels.route, listener = %self.labels.listener, "upstream unreachable, closing client");
        self.observer.connect_failed(self.labels, error);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_reject_reversed_and_zero() {
        assert!(matches!(
            PortRange::new(9010, 9000),
            Err(ConfigError::ReversedPortRange {
                start: 9010,
                end: 9000
            })
        ));
        assert!(matches!(
            PortRange::new(0, 10),
            Err(ConfigError::Zero { .. })
        ));
        assert_eq!(
            "9000-9010".parse::<PortRange>().ok(),
            PortRange::new(9000, 9010).ok()
        );
        assert_eq!(
            "9000".parse::<PortRange>().ok(),
            PortRange::new(9000, 9000).ok()
        );
        assert!("9010-9000".parse::<PortRange>().is_err());
        assert!("x-9000".parse::<PortRange>().is_err());
        assert!(PortRange::new(1, 3).is_ok_and(|r| r.contains(2) && !r.contains(4)));
    }

    #[test]
    fn listener_config_rejects_zero_limit() {
        let route = Route::new("r", SocketAddr::from(([127, 0, 0, 1], 1)));
        let config = ListenerConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)), route);
        assert!(
            config
                .clone()
                .with_max_connections(Some(1))
                .validate()
                .is_ok()
        );
        assert!(matches!(
            config.with_max_connections(Some(0)).validate(),
            Err(ConfigError::Zero {
                what: "max connections"
            })
        ));
        assert!(
            ServerConfig::default()
                .with_report_interval(Duration::ZERO)
                .validate()
                .is_err()
        );
    }
}
