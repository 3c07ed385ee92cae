//! The inside of a listener: its shared state, the accept loop, one task per connection, the
//! byte reporter and the drain.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::accept::{AcceptError, StreamAcceptor};
use crate::copy::{CopyMode, Direction, RelayCounters};
use crate::error::ConnectError;
use crate::metrics::{RelayObserver, RouteLabels, SourceRefusal};
use crate::relay::{self, Ending, RelayConfig, RelaySummary, Route};
use crate::socket;
use crate::source::SourceFilter;

use super::config::{
    ACCEPT_BACKOFF_MIN, ConnectionStatus, DrainReport, ListenerConfig, ServerConfig,
};

// The event-loop data path of a listener; it builds on the state defined here.
#[cfg(target_os = "linux")]
pub(super) mod event_loop;

pub(super) struct ServerShared {
    pub(super) config: ServerConfig,
    pub(super) observer: Arc<dyn RelayObserver>,
    pub(super) shutdown: CancellationToken,
    pub(super) tracker: TaskTracker,
    pub(super) listeners: Mutex<HashMap<SocketAddr, Arc<ListenerShared>>>,
    pub(super) closing: AtomicBool,
    pub(super) next_connection_id: AtomicU64,
    /// The accept workers' runtimes, started with the first listener when the configuration
    /// asks for them; empty otherwise.
    pub(super) workers: Mutex<Vec<tokio::runtime::Handle>>,
    /// The event loops, started with the first listener on that path.
    #[cfg(target_os = "linux")]
    pub(super) event_loops: Mutex<Option<Arc<event_loop::EventLoops>>>,
}

pub(super) struct ListenerShared {
    pub(super) local_addr: SocketAddr,
    pub(super) relay: RelayConfig,
    /// Accepted sockets inherit the relay's socket options from the listener (set once).
    pub(super) client_options_inherited: bool,
    pub(super) acceptor: Option<Arc<dyn StreamAcceptor>>,
    pub(super) route: Mutex<Arc<ActiveRoute>>,
    /// The client addresses admitted at accept; `None`: every one.
    pub(super) sources: Mutex<Option<SourceFilter>>,
    /// Stops the accept loop; a child of the server's shutdown token.
    pub(super) stop_accepting: CancellationToken,
    /// Closes every connection of this listener; a child of the server's shutdown token.
    pub(super) close_connections: CancellationToken,
    pub(super) connection_tasks: TaskTracker,
    pub(super) connections: Mutex<HashMap<u64, Arc<Live>>>,
    pub(super) limit: Option<Arc<Semaphore>>,
    /// The accept loops: one, or one per accept worker; on the event-loop path, the task that
    /// closes the loops' listening sockets when accepting stops.
    pub(super) accept_tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The event loops relaying this listener's connections, on that path.
    #[cfg(target_os = "linux")]
    pub(super) event_loops: Option<Arc<event_loop::EventLoops>>,
    /// Connections the event loops relay now (the tokio path lists its own in `connections`).
    pub(super) loop_connections: AtomicUsize,
    /// Connections the event loops closed during a drain as answered and idle.
    pub(super) loop_closed_idle: AtomicUsize,
    /// While draining with an idle limit, that limit in milliseconds; 0 otherwise.
    pub(super) drain_idle_ms: AtomicU64,
}

/// One open connection as its listener lists it: shared by the connection's task, the
/// listener's map and the listener's byte reporter.
pub(super) struct Live {
    pub(super) id: u64,
    pub(super) client: SocketAddr,
    pub(super) route: Arc<ActiveRoute>,
    pub(super) counters: Arc<RelayCounters>,
    /// Closes this connection alone; a child of its route generation's token.
    pub(super) close: CancellationToken,
    /// Bytes already reported to the observer, per direction: the reporter and the
    /// connection's end both report, and `fetch_max` hands each byte to exactly one of them.
    pub(super) reported: [AtomicU64; 2],
}

impl Live {
    pub(super) fn status(&self) -> ConnectionStatus {
        ConnectionStatus {
            id: self.id,
            client: self.client,
            route: self.route.route.name.clone(),
            counters: Arc::clone(&self.counters),
        }
    }

    /// Reports the bytes moved since the last report.
    pub(super) fn report_bytes(&self, observer: &dyn RelayObserver) {
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
pub(super) struct ActiveRoute {
    pub(super) route: Route,
    pub(super) labels: RouteLabels,
    /// Closes the connections of this generation only.
    pub(super) cancel: CancellationToken,
}

/// Locks a mutex whose data stays consistent even if a holder panicked (every critical section
/// here is a single insert, remove or replace).
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ActiveRoute {
    pub(super) fn new(route: Route, listener: SocketAddr, parent: &CancellationToken) -> Self {
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

/// A client turned away at the listener's connection limit.
pub(super) struct AtLimit;

impl ListenerShared {
    /// A listener's state: bound on `local_addr` as `config` says, its tokens children of the
    /// server's `shutdown`; on the event-loop path, `event_loops` relay its connections.
    pub(super) fn new(
        local_addr: SocketAddr,
        config: ListenerConfig,
        client_options_inherited: bool,
        shutdown: &CancellationToken,
        #[cfg(target_os = "linux")] event_loops: Option<Arc<event_loop::EventLoops>>,
    ) -> Self {
        let close_connections = shutdown.child_token();
        Self {
            local_addr,
            relay: config.relay,
            client_options_inherited,
            acceptor: config.acceptor,
            sources: Mutex::new(config.source_filter),
            route: Mutex::new(Arc::new(ActiveRoute::new(
                config.route,
                local_addr,
                &close_connections,
            ))),
            stop_accepting: shutdown.child_token(),
            close_connections,
            connection_tasks: TaskTracker::new(),
            connections: Mutex::new(HashMap::new()),
            limit: config
                .max_connections
                .map(|limit| Arc::new(Semaphore::new(limit))),
            accept_tasks: Mutex::new(Vec::new()),
            #[cfg(target_os = "linux")]
            event_loops,
            loop_connections: AtomicUsize::new(0),
            loop_closed_idle: AtomicUsize::new(0),
            drain_idle_ms: AtomicU64::new(0),
        }
    }

    /// A slot under the connection limit for a client from `peer` (`None` without a limit), or
    /// [`AtLimit`], reported here: the caller resets and drops the client.
    pub(super) fn permit(
        &self,
        peer: SocketAddr,
        route: &ActiveRoute,
        observer: &dyn RelayObserver,
    ) -> Result<Option<OwnedSemaphorePermit>, AtLimit> {
        let Some(limit) = &self.limit else {
            return Ok(None);
        };
        match Arc::clone(limit).try_acquire_owned() {
            Ok(permit) => Ok(Some(permit)),
            Err(_) => {
                tracing::debug!(listener = %self.local_addr, %peer, "connection limit reached, rejecting");
                observer.connection_rejected(&route.labels);
                Err(AtLimit)
            }
        }
    }

    /// Whether the source filter admits a client from `peer`. A refused one is reported here;
    /// the caller resets and drops it before anything else happens to it.
    pub(super) fn admits(&self, peer: SocketAddr, observer: &dyn RelayObserver) -> bool {
        let admitted = lock(&self.sources)
            .as_ref()
            .is_none_or(|filter| filter.admits(peer.ip()));
        if !admitted {
            let route = Arc::clone(&lock(&self.route));
            tracing::debug!(listener = %self.local_addr, %peer, "client refused at accept: source not admitted");
            let refusal = SourceRefusal {
                listener: self.local_addr,
                peer,
            };
            observer.source_refused(&route.labels, &refusal);
        }
        admitted
    }

    /// The idle limit of a running drain, for the event loops' connections.
    pub(super) fn drain_idle(&self) -> Option<Duration> {
        match self.drain_idle_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub(super) async fn drain(&self, deadline: Duration, idle: Option<Duration>) -> DrainReport {
        self.stop_accepting.cancel();
        let accept_tasks = std::mem::take(&mut *lock(&self.accept_tasks));
        for task in accept_tasks {
            // The task ends by itself once cancelled; a panic in it has been logged already.
            let _ = task.await;
        }
        #[cfg(target_os = "linux")]
        if let (Some(idle), Some(loops)) = (idle, &self.event_loops) {
            let ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX).max(1);
            self.drain_idle_ms.store(ms, Ordering::Relaxed);
            loops.drain_idle();
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
        let closed_idle = closed_idle + self.loop_closed_idle.load(Ordering::Relaxed);
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
    pub(super) fn close_answered_idle(&self, idle: Duration) -> usize {
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

    pub(super) fn start_connection(
        self: &Arc<Self>,
        client: TcpStream,
        peer: SocketAddr,
        server: &Arc<ServerShared>,
    ) {
        let route = Arc::clone(&lock(&self.route));
        let Ok(permit) = self.permit(peer, &route, server.observer.as_ref()) else {
            socket::reset_on_close(&client);
            return;
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
pub(super) struct Registration {
    pub(super) listener: Arc<ListenerShared>,
    pub(super) id: u64,
    pub(super) _permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        lock(&self.listener.connections).remove(&self.id);
    }
}

/// Reports the byte counts of a listener's running connections every report interval (one
/// timer per listener, not one per connection); each connection reports the rest as it ends.
pub(super) async fn report_bytes(state: Arc<ListenerShared>, server: Arc<ServerShared>) {
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

pub(super) async fn accept_loop(
    listener: TcpListener,
    state: Arc<ListenerShared>,
    server: Arc<ServerShared>,
) {
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
                if state.admits(peer, server.observer.as_ref()) {
                    state.start_connection(client, peer, &server);
                } else {
                    // A reset at once: the client learns before it sends, and no TIME_WAIT.
                    socket::reset_on_close(&client);
                }
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

pub(super) fn concerns_one_connection(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

pub(super) async fn run_connection(
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
    report_closed(observer.as_ref(), labels, &summary);
}

/// Logs a connection's end and tells the observer (both data paths).
pub(super) fn report_closed(
    observer: &dyn RelayObserver,
    labels: &RouteLabels,
    summary: &RelaySummary,
) {
    tracing::debug!(
        route = %labels.route,
        listener = %labels.listener,
        ending = summary.ending.as_str(),
        to_upstream = summary.to_upstream,
        to_client = summary.to_client,
        duration = ?summary.duration,
        "connection closed"
    );
    observer.connection_closed(labels, summary);
}

/// TCP to TCP: connect to the route's upstream, then relay (spliced where possible).
pub(super) async fn relay_plain(
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
pub(super) async fn relay_accepted(
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
            tracing::debug!(error = %crate::error::chain(&error), listener = %reports.labels.listener, "accept layer refused the connection");
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
pub(super) struct Reports<'a> {
    pub(super) counters: &'a RelayCounters,
    pub(super) observer: &'a dyn RelayObserver,
    pub(super) labels: &'a RouteLabels,
}

impl Reports<'_> {
    pub(super) fn connect_failed(&self, error: &ConnectError) {
        tracing::debug!(error = %crate::error::chain(error), route = %self.labels.route, listener = %self.labels.listener, "upstream unreachable, closing client");
        self.observer.connect_failed(self.labels, error);
    }
}
