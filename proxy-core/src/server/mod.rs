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
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::runtime::Handle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use crate::error::{ConfigError, ServerError};
use crate::metrics::RelayObserver;
use crate::relay::Route;
use crate::socket;
use crate::source::SourceFilter;

mod config;
mod listener;
mod workers;

pub use config::{
    ConnectionStatus, DataPath, DrainReport, ExistingConnections, ListenerConfig, ListenerStatus,
    PortRange, ServerConfig,
};
use listener::{ActiveRoute, ListenerShared, ServerShared, accept_loop, lock, report_bytes};

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
                workers: Mutex::new(Vec::new()),
                #[cfg(target_os = "linux")]
                event_loops: Mutex::new(None),
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
        // Checked here rather than left to the kernel: with accept workers every socket has
        // `SO_REUSEPORT`, which would let a second listener share the port.
        if config.bind.port() != 0
            && let Some(taken) = lock(&shared.listeners)
                .keys()
                .find(|taken| overlap(**taken, config.bind))
        {
            return Err(ServerError::ListenerExists(*taken));
        }
        #[cfg(target_os = "linux")]
        if config.acceptor.is_none() && shared.config.data_path.uses_event_loop() {
            return self.add_loop_listener(config);
        }
        let sockets = self.bind_sockets(config.bind)?;
        let local_addr = sockets[0]
            .1
            .local_addr()
            .map_err(|cause| ServerError::Bind {
                addr: config.bind,
                cause,
            })?;
        // Set once on the listener rather than on every accepted socket, where the system
        // lets accepted sockets inherit them: five fewer syscalls per connection.
        let client_options_inherited = config.acceptor.is_none()
            && sockets
                .iter()
                .all(|(_, listener)| config.relay.socket.apply_to_listener(listener));
        let state = Arc::new(ListenerShared::new(
            local_addr,
            config,
            client_options_inherited,
            &shared.shutdown,
            #[cfg(target_os = "linux")]
            None,
        ));
        {
            // Registered and started under one lock, so a concurrent removal always finds the
            // accept tasks to wait for.
            let mut listeners = lock(&shared.listeners);
            if listeners.contains_key(&local_addr) {
                return Err(ServerError::ListenerExists(local_addr));
            }
            let mut accept_tasks = lock(&state.accept_tasks);
            for (worker, listener) in sockets {
                let accept = shared.tracker.track_future(accept_loop(
                    listener,
                    Arc::clone(&state),
                    Arc::clone(shared),
                ));
                // A worker's loop spawns its connections on that worker's runtime.
                accept_tasks.push(match worker {
                    Some(worker) => worker.spawn(accept),
                    None => tokio::spawn(accept),
                });
            }
            drop(accept_tasks);
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
        for port in range.start()..=range.end() {
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
            start: range.start(),
            end: range.end(),
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

    /// Replaces the source filter of a listener: clients accepted from now on are checked
    /// against `filter` (`None` admits every source). Open connections are left alone; to cut
    /// those of a former source, replace the route with [`ExistingConnections::Close`] too.
    pub fn set_source_filter(
        &self,
        listener: SocketAddr,
        filter: Option<SourceFilter>,
    ) -> Result<(), ServerError> {
        let state = self.listener(listener)?;
        tracing::info!(listener = %listener, sources = %filter.as_ref().map_or_else(|| "any".to_owned(), SourceFilter::to_string), "source filter replaced");
        *lock(&state.sources) = filter;
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
                    active_connections: lock(&state.connections).len()
                        + state.loop_connections.load(Ordering::Relaxed),
                }
            })
            .collect();
        statuses.sort_by_key(|s| s.local_addr);
        statuses
    }

    /// The open connections of `listener`, sorted by id, with live counters. On the event-loop
    /// data path this asks each loop for its list and waits for the answers (one turn of each
    /// loop).
    pub fn connections(&self, listener: SocketAddr) -> Result<Vec<ConnectionStatus>, ServerError> {
        let state = self.listener(listener)?;
        let mut connections: Vec<_> = lock(&state.connections)
            .values()
            .map(|live| live.status())
            .collect();
        #[cfg(target_os = "linux")]
        if let Some(loops) = &state.event_loops {
            connections.append(&mut loops.connections(state.local_addr));
        }
        connections.sort_by_key(|c| c.id);
        Ok(connections)
    }

    /// Adds a listener whose connections the event loops relay: one listening socket per loop
    /// (with `SO_REUSEPORT` when there are several), a task that closes them when accepting
    /// stops, and the byte reporter for connections handed to the tokio path.
    #[cfg(target_os = "linux")]
    fn add_loop_listener(&self, config: ListenerConfig) -> Result<SocketAddr, ServerError> {
        let shared = &self.shared;
        let runtime = Handle::current();
        let loops = self.event_loops()?;
        let backlog = shared.config.backlog;
        let bind_error = |cause| ServerError::Bind {
            addr: config.bind,
            cause,
        };
        let mut sockets = Vec::with_capacity(loops.len());
        let mut next = config.bind;
        let mut client_options_inherited = true;
        for _ in 0..loops.len() {
            let listener =
                socket::bind_listener_with(next, backlog, loops.len() > 1).map_err(bind_error)?;
            next = listener.local_addr().map_err(bind_error)?;
            // Set once on the listener: accepted sockets inherit them.
            client_options_inherited &= config.relay.socket.apply_to_listener(&listener);
            sockets.push(listener.into_std().map_err(bind_error)?);
        }
        let local_addr = next;
        let state = Arc::new(ListenerShared::new(
            local_addr,
            config,
            client_options_inherited,
            &shared.shutdown,
            Some(Arc::clone(&loops)),
        ));
        {
            let mut listeners = lock(&shared.listeners);
            if listeners.contains_key(&local_addr) {
                return Err(ServerError::ListenerExists(local_addr));
            }
            for (index, socket) in sockets.into_iter().enumerate() {
                loops.listen(index, socket, Arc::clone(&state), runtime.clone());
            }
            let stop = state.stop_accepting.clone();
            let unlisten = shared.tracker.track_future(async move {
                stop.cancelled().await;
                loops.unlisten(local_addr).await;
            });
            lock(&state.accept_tasks).push(tokio::spawn(unlisten));
            shared
                .tracker
                .spawn(report_bytes(Arc::clone(&state), Arc::clone(shared)));
            listeners.insert(local_addr, Arc::clone(&state));
        }
        tracing::info!(listener = %local_addr, route = %lock(&state.route).route.name, data_path = "event-loop", "listening");
        Ok(local_addr)
    }

    /// The event loops, started on first use: one per accept worker, or one.
    #[cfg(target_os = "linux")]
    fn event_loops(&self) -> Result<Arc<listener::event_loop::EventLoops>, ServerError> {
        let mut loops = lock(&self.shared.event_loops);
        if let Some(loops) = &*loops {
            return Ok(Arc::clone(loops));
        }
        let count = self
            .shared
            .config
            .accept_workers
            .unwrap_or(std::num::NonZeroUsize::MIN);
        let started = Arc::new(
            listener::event_loop::EventLoops::start(count, &self.shared)
                .map_err(ServerError::Workers)?,
        );
        *loops = Some(Arc::clone(&started));
        Ok(started)
    }

    /// The listening sockets for `addr`: one on the caller's runtime, or one per accept worker,
    /// each registered with its worker's runtime and bound with `SO_REUSEPORT` to the address
    /// the first one got (so port 0 yields one port for all).
    fn bind_sockets(
        &self,
        addr: SocketAddr,
    ) -> Result<Vec<(Option<Handle>, TcpListener)>, ServerError> {
        let backlog = self.shared.config.backlog;
        let workers = self.workers()?;
        if workers.is_empty() {
            let listener = socket::bind_listener(addr, backlog)
                .map_err(|cause| ServerError::Bind { addr, cause })?;
            return Ok(vec![(None, listener)]);
        }
        let mut sockets = Vec::with_capacity(workers.len());
        let mut next = addr;
        for worker in workers {
            let listener = {
                let _on_worker = worker.enter();
                socket::bind_listener_with(next, backlog, true)
            }
            .map_err(|cause| ServerError::Bind { addr, cause })?;
            next = listener
                .local_addr()
                .map_err(|cause| ServerError::Bind { addr, cause })?;
            sockets.push((Some(worker), listener));
        }
        Ok(sockets)
    }

    /// The accept workers' runtimes, started on first use; none without accept workers.
    fn workers(&self) -> Result<Vec<Handle>, ServerError> {
        let Some(count) = self.shared.config.accept_workers else {
            return Ok(Vec::new());
        };
        let mut workers = lock(&self.shared.workers);
        if workers.is_empty() {
            *workers =
                workers::start(count, &self.shared.shutdown).map_err(ServerError::Workers)?;
        }
        Ok(workers.clone())
    }

    fn listener(&self, addr: SocketAddr) -> Result<Arc<ListenerShared>, ServerError> {
        lock(&self.shared.listeners)
            .get(&addr)
            .cloned()
            .ok_or(ServerError::UnknownListener(addr))
    }
}

/// Whether listeners on `a` and `b` would take the same connections: one port, and one address
/// or a wildcard covering the other (`[::]` is bound dual-stack, so it covers IPv4 too).
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    let covers = |wide: IpAddr, other: IpAddr| match wide {
        IpAddr::V6(v6) => v6.is_unspecified(),
        IpAddr::V4(v4) => v4.is_unspecified() && other.is_ipv4(),
    };
    a.port() == b.port() && (a.ip() == b.ip() || covers(a.ip(), b.ip()) || covers(b.ip(), a.ip()))
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
    fn listeners_overlap_on_one_port_and_a_covering_address() {
        let at = |addr: &str| {
            addr.parse::<SocketAddr>()
                .unwrap_or_else(|e| panic!("{addr}: {e}"))
        };
        assert!(overlap(at("127.0.0.1:80"), at("127.0.0.1:80")));
        assert!(overlap(at("0.0.0.0:80"), at("127.0.0.1:80")));
        assert!(overlap(at("127.0.0.1:80"), at("[::]:80")));
        assert!(overlap(at("[::]:80"), at("[::1]:80")));
        assert!(!overlap(at("127.0.0.1:80"), at("127.0.0.1:81")));
        assert!(!overlap(at("127.0.0.1:80"), at("127.0.0.2:80")));
        assert!(!overlap(at("0.0.0.0:80"), at("[::1]:80")));
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
