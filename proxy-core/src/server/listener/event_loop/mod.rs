//! The Linux data path: connections as state machines on per-thread event loops, without a
//! tokio task per connection ([`DataPath::EventLoop`](crate::server::DataPath::EventLoop)).
//!
//! # Where it plugs in
//!
//! [`ProxyServer::add_listener`](crate::server::ProxyServer::add_listener) picks the path per listener:
//! a listener without an accept layer (plain TCP to TCP) goes to the event loops when
//! [`ServerConfig::data_path`](crate::server::ServerConfig::data_path) asks for them; one with an accept
//! layer (TLS termination, any async handshake) stays on the tokio path. The loops are threads
//! of the server's own (`proxy-worker-N`), as many as
//! [`ServerConfig::accept_workers`](crate::server::ServerConfig::accept_workers) says (one without it),
//! started with the first such listener. Each loop owns one listening socket per listener (with
//! `SO_REUSEPORT` when there are several loops), so a connection lives and dies on the thread
//! that accepted it, with no hand-off and no lock on the data path.
//!
//! Everything else stays on tokio: listeners, routes, metrics scrapes, health checks, drain
//! deadlines. The control plane talks to a loop through a command queue and an `eventfd`
//! ([`mio::Waker`]); the loop talks back through the same shared state the tokio path uses.
//!
//! # One connection
//!
//! One entry in the loop's slab: the two sockets, per direction an optional borrowed pipe and
//! the bytes held in it (or in a small buffer when a buffered write came short), a state
//! (connecting, relaying), the deadlines and the permit of the connection limit. The only heap
//! allocation of a connection is its [`RelayCounters`](crate::copy::RelayCounters) (an `Arc`,
//! since [`ProxyServer::connections`](crate::server::ProxyServer::connections) hands them out live);
//! buffered copies read into one scratch buffer per thread.
//!
//! * **Accept**: `accept4` (non-blocking, close-on-exec) until `EAGAIN`, edge-triggered. Errors
//!   that exhaust resources (`EMFILE`, ...) pause accepting on that socket with the same
//!   exponential backoff as the tokio path, checked by the loop's timer.
//! * **Route**: the listener's current route generation is read at accept, as on the tokio
//!   path. A route whose upstream is one socket address is connected by the loop itself
//!   (non-blocking `connect`); any other upstream (host names needing DNS, sets with failover
//!   and health, custom connectors, HTTP `CONNECT`) is handed to the tokio path for that
//!   connection, on the runtime `add_listener` was called on.
//! * **Connect**: the upstream socket is registered at once; the first writable (or error)
//!   event ends the connect, `SO_ERROR` is read only on an error or hang-up event. The PROXY v2
//!   header is written then, in one `send` on the fresh socket (a short write fails the
//!   connection as a header error, which a socket with an empty send buffer never does).
//! * **Relay**: each socket is registered edge-triggered once, the client for reading, the
//!   upstream for writing too (which ends its connect). The client gets write interest only
//!   when a write finds its send buffer full, so its ACKs and the ACK of our FIN do not wake
//!   the loop for nothing (HAProxy asks for writes only while one is pending, too). The loop
//!   keeps its own readiness flags, cleared by `EAGAIN` or a short transfer. A direction
//!   copies while its source is readable and its destination writable: through the per-thread
//!   scratch buffer, or, once a read fills 16 KiB and the copy mode allows it, through a pipe
//!   from the process-wide [pool](crate::pipe) (same budget, same hand-back when the source
//!   runs dry). When the destination is full the source's read interest is dropped
//!   (`epoll_ctl` MOD) until the destination drains, so segments arriving meanwhile do not
//!   wake the thread: HAProxy's way to few wake-ups per MiB.
//! * **End**: the FIN follows the last byte in the same turn (`shutdown(SHUT_WR)` right after
//!   the final write); the direction that finishes second leaves it to the close. Bytes read
//!   together with the FIN are sent with `MSG_MORE`, so they and the FIN leave in one
//!   segment, which the peer acknowledges with its own FIN: a short request/answer connection
//!   costs 18 segments through the relay instead of 20 when the answer and its FIN are in
//!   before the loop reads (otherwise they go apart, as before). A reset or
//!   error on one leg resets the other (`SO_LINGER` 0). Closing the descriptors removes them
//!   from epoll; there is no `EPOLL_CTL_DEL`. A slab slot freed during a turn is reused only in
//!   the next, so late events of the turn cannot reach a new connection.
//!
//! # Timers
//!
//! One coarse timer wheel per loop (100 ms slots) holds connect deadlines, idle timeouts and
//! maximum lifetimes: a connection sits in at most one slot at a time, and an expiry that
//! finds the connection active since re-files it (no work per byte). The same turn reports
//! byte counts every [`report_interval`](crate::server::ServerConfig::report_interval) and, during a
//! drain with [`drain_idle`](crate::server::ServerConfig::drain_idle), closes answered idle
//! connections.
//!
//! # Control plane
//!
//! * **Cancellation** (route replaced with `Close`, drain deadline, shutdown): the loop polls
//!   each route generation's `CancellationToken::cancelled` future with a waker that fires its
//!   `eventfd`, and closes that generation's connections when it completes; the server's
//!   token stops the loop the same way, so a server dropped without its runtime still stops.
//! * **Drain**: every connection holds a token of its listener's
//!   [`TaskTracker`](tokio_util::task::TaskTracker), so the drain waits for loop connections as
//!   for tasks. Removing a listener sends the loop a command and waits for its sockets to be
//!   closed.
//! * **Status**: the listener counts its loop connections in an atomic;
//!   [`ProxyServer::connections`](crate::server::ProxyServer::connections) asks each loop for its list
//!   and waits for the answer (one turn of the loop).
//! * **Metrics**: the observer is called from the loop thread, as from a connection task:
//!   opened, rejected, connect failed, bytes (each report interval and at the end), closed.

mod wheel;

use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Read as _, Write as _};
use std::net::{
    Ipv4Addr, Shutdown, SocketAddr, TcpListener as StdListener, TcpStream as StdStream,
};
use std::num::NonZeroUsize;
use std::os::fd::{AsRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::{Duration, Instant};

use mio::event::Event;
use mio::unix::SourceFd;
use mio::{Events, Interest, Registry, Token};
use rustix::io::Errno;
use rustix::net::{AddressFamily, SocketFlags, SocketType, ipproto};
use rustix::pipe::{SpliceFlags, splice};
use socket2::SockRef;
use tokio::runtime::Handle;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::WaitForCancellationFutureOwned;
use tokio_util::task::task_tracker::TaskTrackerToken;

use crate::copy::{CopyMode, Direction, RelayCounters, STREAMING_READ};
use crate::error::ConnectError;
use crate::pipe::{self, PooledPipe};
use crate::proxy_protocol;
use crate::relay::{Ending, RelaySummary};
use crate::socket::{reset_on_close, send_before_fin};
use crate::target::TargetAddr;
use crate::upstream::Upstream;

use super::{
    ActiveRoute, ListenerShared, ServerShared, concerns_one_connection, lock, report_closed,
};
use crate::server::config::{ACCEPT_BACKOFF_MIN, ConnectionStatus};
use wheel::{TICK, Wheel};

/// The waker's token; listeners' tokens have the top bit set; a connection's are its slab key
/// shifted left once, plus 1 for the upstream leg.
const WAKER: Token = Token(usize::MAX);
const LISTENER: usize = 1 << (usize::BITS - 1);
/// Bytes the per-thread scratch buffer holds: the most one buffered read moves.
const SCRATCH: usize = 64 * 1024;
/// Copy steps one connection gets per turn before the others get theirs.
const BUDGET: usize = 16;
/// Events taken from epoll per turn.
const EVENTS: usize = 1024;
const SPLICE: SpliceFlags = SpliceFlags::NONBLOCK.union(SpliceFlags::MOVE);

/// The server's event loops.
pub(in crate::server) struct EventLoops {
    loops: Vec<Arc<LoopShared>>,
}

/// What the control plane shares with one loop.
struct LoopShared {
    commands: Mutex<Commands>,
    waker: mio::Waker,
    /// Set by a cancellation future's waker: the loop polls its watches.
    watches_woken: AtomicBool,
}

#[derive(Default)]
struct Commands {
    queue: Vec<Command>,
    /// The loop has exited: commands are dropped (their reply channels close).
    stopped: bool,
}

enum Command {
    Listen {
        socket: StdListener,
        state: Arc<ListenerShared>,
        runtime: Handle,
    },
    Unlisten {
        addr: SocketAddr,
        done: tokio::sync::oneshot::Sender<()>,
    },
    List {
        addr: SocketAddr,
        reply: std::sync::mpsc::Sender<Vec<ConnectionStatus>>,
    },
    /// A listener started a drain that closes answered idle connections.
    DrainIdle,
}

impl Wake for LoopShared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.watches_woken.store(true, Ordering::Release);
        self.wake_loop();
    }
}

impl LoopShared {
    fn wake_loop(&self) {
        if let Err(error) = self.waker.wake() {
            tracing::warn!(%error, "cannot wake an event loop");
        }
    }

    /// Queues `command`; false when the loop has exited.
    fn send(&self, command: Command) -> bool {
        {
            let mut commands = lock(&self.commands);
            if commands.stopped {
                return false;
            }
            commands.queue.push(command);
        }
        self.wake_loop();
        true
    }
}

impl EventLoops {
    /// Starts `count` loop threads for `server`; they stop when its shutdown token fires.
    pub(in crate::server) fn start(
        count: NonZeroUsize,
        server: &Arc<ServerShared>,
    ) -> io::Result<Self> {
        let mut loops = Vec::with_capacity(count.get());
        for index in 0..count.get() {
            let poll = mio::Poll::new()?;
            let waker = mio::Waker::new(poll.registry(), WAKER)?;
            let shared = Arc::new(LoopShared {
                commands: Mutex::new(Commands::default()),
                waker,
                watches_woken: AtomicBool::new(false),
            });
            let event_loop = Loop::new(poll, Arc::clone(&shared), Arc::clone(server));
            std::thread::Builder::new()
                .name(format!("proxy-worker-{index}"))
                .spawn(move || event_loop.run())?;
            loops.push(shared);
        }
        Ok(Self { loops })
    }

    /// How many loops there are (one listening socket each per listener).
    pub(in crate::server) fn len(&self) -> usize {
        self.loops.len()
    }

    /// Hands listening socket `socket` of `state` to loop `index`; connections it cannot relay
    /// itself go to `runtime`.
    pub(in crate::server) fn listen(
        &self,
        index: usize,
        socket: StdListener,
        state: Arc<ListenerShared>,
        runtime: Handle,
    ) {
        if let Some(shared) = self.loops.get(index) {
            shared.send(Command::Listen {
                socket,
                state,
                runtime,
            });
        }
    }

    /// Closes every loop's listening socket of `addr`; returns once they are closed.
    pub(in crate::server) async fn unlisten(&self, addr: SocketAddr) {
        let mut closed = Vec::with_capacity(self.loops.len());
        for shared in &self.loops {
            let (done, rx) = tokio::sync::oneshot::channel();
            if shared.send(Command::Unlisten { addr, done }) {
                closed.push(rx);
            }
        }
        for rx in closed {
            // An error means the loop exited, which closed the socket too.
            let _ = rx.await;
        }
    }

    /// The loops' connections of listener `addr`. Waits for each loop to answer (one turn).
    pub(in crate::server) fn connections(&self, addr: SocketAddr) -> Vec<ConnectionStatus> {
        let (reply, answers) = std::sync::mpsc::channel();
        let asked = self
            .loops
            .iter()
            .filter(|shared| {
                shared.send(Command::List {
                    addr,
                    reply: reply.clone(),
                })
            })
            .count();
        drop(reply);
        let mut connections = Vec::new();
        for _ in 0..asked {
            match answers.recv_timeout(Duration::from_secs(5)) {
                Ok(mut some) => connections.append(&mut some),
                Err(_) => break,
            }
        }
        connections
    }

    /// Tells every loop that a listener drains with an idle limit.
    pub(in crate::server) fn drain_idle(&self) {
        for shared in &self.loops {
            shared.send(Command::DrainIdle);
        }
    }
}

/// A listening socket on a loop.
struct LoopListener {
    socket: StdListener,
    state: Arc<ListenerShared>,
    runtime: Handle,
    backoff: Duration,
    /// Accepting paused until then, after an error that exhausted resources.
    retry_at: Option<Instant>,
}

/// One leg of a connection.
struct Leg {
    socket: StdStream,
    /// The loop's readiness: set by events, cleared by `EAGAIN` or a short transfer.
    readable: bool,
    writable: bool,
    /// The peer's FIN was seen: read until EOF even after a short read.
    read_closed: bool,
    /// An event reported an error: a short read after the FIN may hide it, so read on.
    errored: bool,
    /// Registered for reading (dropped while the other leg cannot take this leg's bytes).
    read_interest: bool,
    /// Registered for writing: from the first write that found the send buffer full (or the
    /// connect) on. Without it, no event comes for the peer's ACKs and state changes (the ACK
    /// of a FIN would wake the loop for nothing to do).
    write_interest: bool,
}

impl Leg {
    /// A connected leg: writable until a write says otherwise, registered for reading only.
    fn connected(socket: StdStream) -> Self {
        Self {
            socket,
            readable: false,
            writable: true,
            read_closed: false,
            errored: false,
            read_interest: true,
            write_interest: false,
        }
    }

    /// A leg still connecting: registered for writing too, which ends the connect.
    fn connecting(socket: StdStream) -> Self {
        Self {
            writable: false,
            write_interest: true,
            ..Self::connected(socket)
        }
    }

    fn note(&mut self, event: &Event) {
        let broken = event.is_error();
        self.readable |= event.is_readable() || event.is_read_closed() || broken;
        self.writable |= event.is_writable() || event.is_write_closed() || broken;
        self.read_closed |= event.is_read_closed();
        self.errored |= broken;
    }

    /// The interest this leg is registered with.
    fn interest(&self) -> Interest {
        match (self.read_interest, self.write_interest) {
            (true, true) => Interest::READABLE | Interest::WRITABLE,
            (true, false) => Interest::READABLE,
            _ => Interest::WRITABLE,
        }
    }

    /// Registers or drops read interest. Write interest stays, and comes with a dropped read
    /// interest (a registration cannot be empty; edge-triggered, it fires only after a write
    /// found the send buffer full or on a state change).
    fn want_read(&mut self, want: bool, registry: &Registry, token: Token) -> io::Result<()> {
        if self.read_interest == want {
            return Ok(());
        }
        self.read_interest = want;
        self.write_interest |= !want;
        registry.reregister(
            &mut SourceFd(&self.socket.as_raw_fd()),
            token,
            self.interest(),
        )
    }

    /// Registers write interest once a write found the send buffer full; it stays (one
    /// `epoll_ctl` per connection that ever stalls, not one per stall).
    fn want_write(&mut self, registry: &Registry, token: Token) -> io::Result<()> {
        if self.write_interest {
            return Ok(());
        }
        self.write_interest = true;
        registry.reregister(
            &mut SourceFd(&self.socket.as_raw_fd()),
            token,
            self.interest(),
        )
    }
}

/// One direction of a connection.
#[derive(Default)]
struct Flow {
    /// Borrowed while the direction streams; holds `in_pipe` bytes.
    pipe: Option<PooledPipe>,
    in_pipe: usize,
    /// Bytes read through the scratch buffer that the destination did not take yet.
    held: Vec<u8>,
    held_from: usize,
    /// A buffered read filled 16 KiB: borrow a pipe from now on (splice mode).
    streaming: bool,
    /// The source reached EOF.
    eof: bool,
    /// EOF passed on (or left to the close): nothing more moves this way.
    done: bool,
    /// The source's read interest is dropped: set when the destination could not take the held
    /// bytes, cleared only when the source runs dry (see [`Copier::pump`]).
    blocked: bool,
}

impl Flow {
    fn give_back_pipe(&mut self) {
        if self.in_pipe == 0
            && let Some(pipe) = self.pipe.take()
        {
            pipe.give_back();
        }
    }
}

/// Connecting to the upstream.
struct Connecting {
    target: SocketAddr,
    deadline: Instant,
}

/// One relayed connection: the only per-connection state of the loop path.
struct Conn {
    id: u64,
    peer: SocketAddr,
    listener: Arc<ListenerShared>,
    route: Arc<ActiveRoute>,
    counters: Arc<RelayCounters>,
    client: Leg,
    upstream: Option<Leg>,
    connecting: Option<Connecting>,
    /// To the upstream, to the client.
    flows: [Flow; 2],
    /// Bytes reported to the observer, per direction.
    reported: [u64; 2],
    /// The wheel tick this connection is filed for (0: none).
    timer_tick: u64,
    _permit: Option<OwnedSemaphorePermit>,
    /// Counts as a task of the listener's tracker, so drains wait for the connection.
    _task: TaskTrackerToken,
}

impl Conn {
    fn report_bytes(&mut self, server: &ServerShared) {
        for (index, direction) in [Direction::ToUpstream, Direction::ToClient]
            .into_iter()
            .enumerate()
        {
            let now = self.counters.get(direction);
            if now > self.reported[index] {
                server.observer.bytes_relayed(
                    &self.route.labels,
                    direction,
                    now - self.reported[index],
                );
                self.reported[index] = now;
            }
        }
    }

    /// The earliest of the connect deadline, the idle deadline and the end of the lifetime.
    fn deadline(&self) -> Option<Instant> {
        let config = &self.listener.relay;
        let connect = self.connecting.as_ref().map(|c| c.deadline);
        let idle = config
            .idle_timeout
            .and_then(|idle| self.counters.last_activity().into_std().checked_add(idle));
        let lifetime = config
            .max_lifetime
            .and_then(|lifetime| self.counters.started().into_std().checked_add(lifetime));
        [connect, idle, lifetime].into_iter().flatten().min()
    }
}

/// A route generation that connections of this loop belong to.
struct RouteWatch {
    /// Held so that the address keying the watch stays this generation's.
    route: Arc<ActiveRoute>,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    connections: usize,
}

struct Loop {
    shared: Arc<LoopShared>,
    server: Arc<ServerShared>,
    poll: mio::Poll,
    waker: Waker,
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
    listeners: Vec<Option<LoopListener>>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Slots freed this turn, reusable from the next one.
    freed: Vec<usize>,
    wheel: Wheel,
    due: Vec<wheel::Entry>,
    scratch: Box<[u8]>,
    watches: HashMap<usize, RouteWatch>,
    /// Connections whose copy budget ran out with work left.
    again: Vec<usize>,
    next_report: Instant,
    /// Sweeping for answered idle connections of draining listeners.
    sweeping: bool,
    next_sweep: Instant,
}

/// Why a turn's copy step stopped.
enum Pumped {
    /// Nothing to do until an event.
    Waiting,
    /// The budget ran out with work left.
    Budget,
}

impl Loop {
    fn new(poll: mio::Poll, shared: Arc<LoopShared>, server: Arc<ServerShared>) -> Self {
        let now = Instant::now();
        Self {
            waker: Waker::from(Arc::clone(&shared)),
            stop: Box::pin(server.shutdown.clone().cancelled_owned()),
            next_report: now + server.config.report_interval,
            shared,
            server,
            poll,
            listeners: Vec::new(),
            conns: Vec::new(),
            free: Vec::new(),
            freed: Vec::new(),
            wheel: Wheel::new(now),
            due: Vec::new(),
            scratch: vec![0; SCRATCH].into_boxed_slice(),
            watches: HashMap::new(),
            again: Vec::new(),
            sweeping: false,
            next_sweep: now,
        }
    }

    fn run(mut self) {
        let mut events = Events::with_capacity(EVENTS);
        let mut stopping = self.stopped();
        while !stopping {
            let timeout = self.timeout();
            if let Err(error) = self.poll.poll(&mut events, timeout)
                && error.kind() != io::ErrorKind::Interrupted
            {
                tracing::error!(%error, "event loop cannot wait for events, closing its connections");
                break;
            }
            for event in &events {
                self.dispatch(event);
            }
            for key in std::mem::take(&mut self.again) {
                self.drive(key);
            }
            self.run_commands();
            if self.shared.watches_woken.swap(false, Ordering::AcqRel) {
                stopping = self.stopped();
                self.poll_watches();
            }
            let now = Instant::now();
            self.expire(now);
            self.retry_accepts(now);
            if now >= self.next_report {
                self.report_bytes();
                self.next_report = now + self.server.config.report_interval;
            }
            if self.sweeping && now >= self.next_sweep {
                self.sweep_idle();
                self.next_sweep = now + TICK;
            }
            self.free.append(&mut self.freed);
        }
        self.close_everything();
    }

    fn stopped(&mut self) -> bool {
        let mut context = Context::from_waker(&self.waker);
        self.stop.as_mut().poll(&mut context).is_ready()
    }

    /// How long the next wait may last: until the next timer, report, sweep or accept retry.
    fn timeout(&self) -> Option<Duration> {
        if !self.again.is_empty() {
            return Some(Duration::ZERO);
        }
        let has_connections = self.conns.len() > self.free.len() + self.freed.len();
        let report = (has_connections || !self.watches.is_empty()).then_some(self.next_report);
        let sweep = self.sweeping.then_some(self.next_sweep);
        let retries = self
            .listeners
            .iter()
            .flatten()
            .filter_map(|listener| listener.retry_at);
        let next = [self.wheel.next_due(), report, sweep]
            .into_iter()
            .flatten()
            .chain(retries)
            .min()?;
        Some(next.saturating_duration_since(Instant::now()))
    }

    fn dispatch(&mut self, event: &Event) {
        let token = event.token();
        if token == WAKER {
            return;
        }
        if token.0 & LISTENER != 0 {
            self.accept_all(token.0 & !LISTENER);
            return;
        }
        let (key, upstream_leg) = (token.0 >> 1, token.0 & 1 == 1);
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return;
        };
        if upstream_leg {
            let Some(leg) = conn.upstream.as_mut() else {
                return;
            };
            leg.note(event);
            if conn.connecting.is_some() {
                let failed = event.is_error() || event.is_write_closed();
                if failed || event.is_writable() {
                    self.connected(key, failed);
                }
                return;
            }
        } else {
            conn.client.note(event);
        }
        self.drive(key);
    }

    // ---- accepting ----

    fn accept_all(&mut self, index: usize) {
        loop {
            let Some(Some(listener)) = self.listeners.get_mut(index) else {
                return;
            };
            if listener.retry_at.is_some() {
                return;
            }
            let accepted = rustix::net::acceptfrom_with(
                &listener.socket,
                SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
            );
            match accepted {
                Ok((client, peer)) => {
                    listener.backoff = ACCEPT_BACKOFF_MIN;
                    let peer = peer
                        .and_then(|peer| SocketAddr::try_from(peer).ok())
                        .unwrap_or_else(|| SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)));
                    self.open(index, client, peer);
                }
                Err(Errno::AGAIN) => return,
                Err(errno) => {
                    let error = io::Error::from(errno);
                    if errno == Errno::INTR || concerns_one_connection(&error) {
                        tracing::debug!(%error, listener = %listener.state.local_addr, "accept failed for one connection");
                        continue;
                    }
                    tracing::warn!(%error, listener = %listener.state.local_addr, retry_in = ?listener.backoff, "accept failed, backing off");
                    listener.retry_at = Some(Instant::now() + listener.backoff);
                    listener.backoff = listener
                        .backoff
                        .saturating_mul(2)
                        .min(self.server.config.accept_backoff_max);
                    return;
                }
            }
        }
    }

    fn retry_accepts(&mut self, now: Instant) {
        for index in 0..self.listeners.len() {
            let Some(Some(listener)) = self.listeners.get_mut(index) else {
                continue;
            };
            if listener.retry_at.is_some_and(|at| at <= now) {
                listener.retry_at = None;
                self.accept_all(index);
            }
        }
    }

    /// Starts relaying an accepted client.
    fn open(&mut self, index: usize, client: OwnedFd, peer: SocketAddr) {
        let Some(Some(listener)) = self.listeners.get(index) else {
            return;
        };
        let state = Arc::clone(&listener.state);
        if !state.admits(peer, self.server.observer.as_ref()) {
            // Checked before the hand-off below, so no path relays a refused client.
            reset_on_close(&StdStream::from(client));
            return;
        }
        let route = Arc::clone(&lock(&state.route));
        let target = match &route.route.upstream {
            Upstream::Target(TargetAddr::Socket(target)) => *target,
            // Resolution, failover, custom connectors and tunnels are async work: the tokio
            // path relays this connection.
            _ => {
                let server = Arc::clone(&self.server);
                listener.runtime.spawn(async move {
                    match tokio::net::TcpStream::from_std(StdStream::from(client)) {
                        Ok(client) => state.start_connection(client, peer, &server),
                        Err(error) => {
                            tracing::debug!(%error, "cannot hand a connection to the runtime");
                        }
                    }
                });
                return;
            }
        };
        let client = StdStream::from(client);
        let Ok(permit) = state.permit(peer, &route, self.server.observer.as_ref()) else {
            reset_on_close(&client);
            return;
        };
        if !state.client_options_inherited
            && let Err(error) = state.relay.socket.apply_to(SockRef::from(&client))
        {
            tracing::debug!(%error, leg = "client", "cannot set socket options");
        }
        let id = self
            .server
            .next_connection_id
            .fetch_add(1, Ordering::Relaxed);
        self.server.observer.connection_opened(&route.labels);
        state.loop_connections.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + state.relay.connect_timeout;
        let key = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        self.conns[key] = Some(Conn {
            id,
            peer,
            counters: Arc::new(RelayCounters::new()),
            client: Leg::connected(client),
            upstream: None,
            connecting: Some(Connecting { target, deadline }),
            flows: Default::default(),
            reported: [0, 0],
            timer_tick: 0,
            _permit: permit,
            _task: state.connection_tasks.token(),
            route: Arc::clone(&route),
            listener: state,
        });
        if !self.watch(&route) {
            self.close(key, Ending::Cancelled);
            return;
        }
        let registered = self
            .conns
            .get_mut(key)
            .and_then(Option::as_mut)
            .map(|conn| {
                self.poll.registry().register(
                    &mut SourceFd(&conn.client.socket.as_raw_fd()),
                    Token(key << 1),
                    conn.client.interest(),
                )
            });
        if let Some(Err(error)) = registered {
            tracing::warn!(%error, "cannot register a client with the event loop");
            self.close(
                key,
                Ending::Error {
                    direction: Direction::ToUpstream,
                    kind: error.kind(),
                },
            );
            return;
        }
        let upstream = start_connect(target).and_then(|upstream| {
            self.poll.registry().register(
                &mut SourceFd(&upstream.as_raw_fd()),
                Token(key << 1 | 1),
                Interest::READABLE | Interest::WRITABLE,
            )?;
            Ok(upstream)
        });
        match upstream {
            Ok(upstream) => {
                if let Some(Some(conn)) = self.conns.get_mut(key) {
                    conn.upstream = Some(Leg::connecting(upstream));
                }
                self.arm(key);
            }
            Err(cause) => self.connect_failed(
                key,
                ConnectError::Io {
                    target: target.to_string(),
                    cause,
                },
            ),
        }
    }

    /// Ends the connect of `key`: `failed` when epoll reported an error or hang-up.
    fn connected(&mut self, key: usize, failed: bool) {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return;
        };
        let (Some(upstream), Some(connecting)) = (conn.upstream.as_ref(), &conn.connecting) else {
            return;
        };
        let target = connecting.target;
        if failed {
            let cause = match upstream.socket.take_error() {
                Ok(Some(error)) | Err(error) => error,
                Ok(None) => io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "the connection closed while connecting",
                ),
            };
            self.connect_failed(
                key,
                ConnectError::Io {
                    target: target.to_string(),
                    cause,
                },
            );
            return;
        }
        conn.connecting = None;
        if let Err(error) = conn
            .listener
            .relay
            .socket
            .apply_to(SockRef::from(&upstream.socket))
        {
            tracing::debug!(%error, leg = "upstream", "cannot set socket options");
        }
        if conn.route.route.proxy_protocol
            && let Err(cause) = write_proxy_header(conn.peer, &conn.client.socket, &upstream.socket)
        {
            self.connect_failed(key, ConnectError::ProxyHeader { target, cause });
            return;
        }
        self.arm(key);
        self.drive(key);
    }

    fn connect_failed(&mut self, key: usize, error: ConnectError) {
        let Some(Some(conn)) = self.conns.get(key) else {
            return;
        };
        let labels = &conn.route.labels;
        tracing::debug!(error = %crate::error::chain(&error), route = %labels.route, listener = %labels.listener, "upstream unreachable, closing client");
        self.server.observer.connect_failed(labels, &error);
        self.close(key, Ending::ConnectFailed);
    }

    // ---- relaying ----

    /// Moves what can be moved both ways; closes the connection when both ways are done or one
    /// failed.
    fn drive(&mut self, key: usize) {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return;
        };
        let Some(upstream) = conn.upstream.as_mut() else {
            return;
        };
        if conn.connecting.is_some() {
            return;
        }
        let config = &conn.listener.relay;
        let splice_size =
            (config.copy_mode.resolve() == CopyMode::Splice).then_some(config.pipe_size);
        let registry = self.poll.registry();
        let [to_upstream, to_client] = &mut conn.flows;
        let mut copy = Copier {
            registry,
            scratch: &mut self.scratch,
            counters: &conn.counters,
            splice_size,
        };
        let first = copy.pump(
            &mut conn.client,
            upstream,
            to_upstream,
            to_client.done,
            Token(key << 1),
            Direction::ToUpstream,
        );
        let second = match first {
            Ok(_) => copy.pump(
                upstream,
                &mut conn.client,
                to_client,
                to_upstream.done,
                Token(key << 1 | 1),
                Direction::ToClient,
            ),
            Err(_) => Ok(Pumped::Waiting),
        };
        let completed = to_upstream.done && to_client.done;
        match (first, second) {
            (Err((error, direction)), _) | (_, Err((error, direction))) => {
                let ending = Ending::from_error(&error, direction);
                tracing::debug!(%error, ending = ending.as_str(), direction = direction.as_str(), "relay direction ended");
                self.close(key, ending);
            }
            _ if completed => self.close(key, Ending::Completed),
            (Ok(Pumped::Budget), _) | (_, Ok(Pumped::Budget)) => self.again.push(key),
            _ => {}
        }
    }

    // ---- ending ----

    fn close(&mut self, key: usize, ending: Ending) {
        let Some(mut conn) = self.conns.get_mut(key).and_then(Option::take) else {
            return;
        };
        self.freed.push(key);
        conn.report_bytes(&self.server);
        if matches!(ending, Ending::Reset { .. } | Ending::Error { .. }) {
            reset_on_close(&conn.client.socket);
            if let Some(upstream) = &conn.upstream {
                reset_on_close(&upstream.socket);
            }
        }
        let mode = conn.listener.relay.copy_mode.resolve();
        let summary = RelaySummary::from_counters(&conn.counters, ending, mode);
        // Closed before the observer hears of the end, as on the tokio path: closing the
        // descriptors also takes them out of epoll; a pipe still holding bytes is closed too.
        drop(conn.client);
        drop(conn.upstream);
        drop(conn.flows);
        report_closed(self.server.observer.as_ref(), &conn.route.labels, &summary);
        conn.listener
            .loop_connections
            .fetch_sub(1, Ordering::Relaxed);
        let route = route_key(&conn.route);
        // The watch stays while its generation is the listener's (no allocation per
        // connection); `report_bytes` prunes it once the generation is gone.
        if let Some(watch) = self.watches.get_mut(&route) {
            watch.connections -= 1;
        }
        // Dropping the rest releases the limit's permit and the drain's task token.
    }

    fn close_everything(&mut self) {
        for key in 0..self.conns.len() {
            self.close(key, Ending::Cancelled);
        }
        self.listeners.clear();
        let mut commands = lock(&self.shared.commands);
        commands.stopped = true;
        commands.queue.clear();
    }

    // ---- timers ----

    /// Files `key` in the wheel for its next deadline, unless filed earlier already.
    fn arm(&mut self, key: usize) {
        let Some(Some(conn)) = self.conns.get_mut(key) else {
            return;
        };
        let Some(at) = conn.deadline() else {
            conn.timer_tick = 0;
            return;
        };
        if conn.timer_tick == 0 || self.wheel.before(at, conn.timer_tick) {
            conn.timer_tick = self.wheel.schedule(key, conn.id, at);
        }
    }

    fn expire(&mut self, now: Instant) {
        let mut due = std::mem::take(&mut self.due);
        self.wheel.expire(now, &mut due);
        for entry in due.drain(..) {
            let Some(Some(conn)) = self.conns.get_mut(entry.key) else {
                continue;
            };
            if conn.id != entry.id || conn.timer_tick != entry.tick {
                continue;
            }
            conn.timer_tick = 0;
            let config = &conn.listener.relay;
            let now = Instant::now();
            if let Some(connecting) = &conn.connecting
                && connecting.deadline <= now
            {
                let error = ConnectError::Timeout {
                    target: connecting.target.to_string(),
                    after: config.connect_timeout,
                };
                self.connect_failed(entry.key, error);
                continue;
            }
            let lifetime_over = config
                .max_lifetime
                .and_then(|lifetime| conn.counters.started().into_std().checked_add(lifetime))
                .is_some_and(|end| end <= now);
            let idle_over = config
                .idle_timeout
                .and_then(|idle| conn.counters.last_activity().into_std().checked_add(idle))
                .is_some_and(|end| end <= now);
            if lifetime_over {
                self.close(entry.key, Ending::MaxLifetime);
            } else if idle_over {
                self.close(entry.key, Ending::IdleTimeout);
            } else {
                self.arm(entry.key);
            }
        }
        self.due = due;
    }

    fn report_bytes(&mut self) {
        for conn in self.conns.iter_mut().flatten() {
            conn.report_bytes(&self.server);
        }
        // Nothing else holds a generation that was replaced (or whose listener went) and has
        // no connection here.
        self.watches
            .retain(|_, watch| watch.connections > 0 || Arc::strong_count(&watch.route) > 1);
    }

    /// Closes the answered, idle connections of listeners that drain with an idle limit
    /// (as the tokio path's drain does for its tasks); stops sweeping when none drains.
    fn sweep_idle(&mut self) {
        let mut draining = false;
        let mut idle = Vec::new();
        for (key, conn) in self.conns.iter().enumerate() {
            let Some(conn) = conn else { continue };
            let Some(limit) = conn.listener.drain_idle() else {
                continue;
            };
            draining = true;
            let counters = &conn.counters;
            if counters.last_direction() == Some(Direction::ToClient)
                && counters.last_activity().elapsed() >= limit
            {
                idle.push(key);
            }
        }
        for key in idle {
            if let Some(Some(conn)) = self.conns.get(key) {
                conn.listener
                    .loop_closed_idle
                    .fetch_add(1, Ordering::Relaxed);
            }
            self.close(key, Ending::Cancelled);
        }
        self.sweeping = draining;
    }

    // ---- control plane ----

    fn run_commands(&mut self) {
        let commands = std::mem::take(&mut lock(&self.shared.commands).queue);
        for command in commands {
            match command {
                Command::Listen {
                    socket,
                    state,
                    runtime,
                } => self.listen(socket, state, runtime),
                Command::Unlisten { addr, done } => {
                    for slot in &mut self.listeners {
                        if slot
                            .as_ref()
                            .is_some_and(|listener| listener.state.local_addr == addr)
                        {
                            *slot = None;
                        }
                    }
                    let _ = done.send(());
                }
                Command::List { addr, reply } => {
                    let connections = self
                        .conns
                        .iter()
                        .flatten()
                        .filter(|conn| conn.listener.local_addr == addr)
                        .map(|conn| ConnectionStatus {
                            id: conn.id,
                            client: conn.peer,
                            route: conn.route.route.name.clone(),
                            counters: Arc::clone(&conn.counters),
                        })
                        .collect();
                    let _ = reply.send(connections);
                }
                Command::DrainIdle => {
                    self.sweeping = true;
                    self.next_sweep = Instant::now();
                }
            }
        }
    }

    fn listen(&mut self, socket: StdListener, state: Arc<ListenerShared>, runtime: Handle) {
        let index = self
            .listeners
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.listeners.push(None);
                self.listeners.len() - 1
            });
        if let Err(error) = self.poll.registry().register(
            &mut SourceFd(&socket.as_raw_fd()),
            Token(LISTENER | index),
            Interest::READABLE,
        ) {
            tracing::error!(%error, listener = %state.local_addr, "cannot register a listening socket with the event loop");
            return;
        }
        self.listeners[index] = Some(LoopListener {
            socket,
            state,
            runtime,
            backoff: ACCEPT_BACKOFF_MIN,
            retry_at: None,
        });
        // Connections may have queued before the registration.
        self.accept_all(index);
    }

    /// Counts a new connection under its route generation's watch, made (and polled once, to register
    /// the loop's waker) on the generation's first connection here. False when the generation
    /// is cancelled already.
    fn watch(&mut self, route: &Arc<ActiveRoute>) -> bool {
        let watch = self
            .watches
            .entry(route_key(route))
            .or_insert_with(|| RouteWatch {
                route: Arc::clone(route),
                cancelled: Box::pin(route.cancel.clone().cancelled_owned()),
                connections: 0,
            });
        watch.connections += 1;
        let mut context = Context::from_waker(&self.waker);
        watch.cancelled.as_mut().poll(&mut context).is_pending()
    }

    /// Closes the connections of every route generation cancelled since the last look.
    fn poll_watches(&mut self) {
        let mut context = Context::from_waker(&self.waker);
        let cancelled: Vec<usize> = self
            .watches
            .iter_mut()
            .filter_map(|(route, watch)| {
                watch
                    .cancelled
                    .as_mut()
                    .poll(&mut context)
                    .is_ready()
                    .then_some(*route)
            })
            .collect();
        if cancelled.is_empty() {
            return;
        }
        for key in 0..self.conns.len() {
            let Some(Some(conn)) = self.conns.get(key) else {
                continue;
            };
            if cancelled.contains(&route_key(&conn.route)) {
                self.close(key, Ending::Cancelled);
            }
        }
        for route in cancelled {
            self.watches.remove(&route);
        }
    }
}

fn route_key(route: &Arc<ActiveRoute>) -> usize {
    Arc::as_ptr(route) as usize
}

/// A non-blocking connect to `target`, under way.
fn start_connect(target: SocketAddr) -> io::Result<StdStream> {
    let family = match target {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let socket = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        Some(ipproto::TCP),
    )?;
    match rustix::net::connect(&socket, &target) {
        // An interrupted connect goes on in the background, as an in-progress one does.
        Ok(()) | Err(Errno::INPROGRESS | Errno::INTR) => Ok(StdStream::from(socket)),
        Err(errno) => Err(errno.into()),
    }
}

/// Writes the PROXY v2 header for `peer` → the client's local address, in one `send` on the
/// freshly connected upstream (its empty send buffer takes it whole).
fn write_proxy_header(
    peer: SocketAddr,
    client: &StdStream,
    upstream: &StdStream,
) -> io::Result<()> {
    let header = proxy_protocol::encode_v2(peer, client.local_addr()?);
    match (&*upstream).write(&header) {
        Ok(written) if written == header.len() => Ok(()),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "the upstream took part of the PROXY header",
        )),
        Err(error) => Err(error),
    }
}

/// What one direction's copy needs besides its legs.
struct Copier<'a> {
    registry: &'a Registry,
    scratch: &'a mut [u8],
    counters: &'a RelayCounters,
    /// The pipe size, when this connection may splice.
    splice_size: Option<usize>,
}

impl Copier<'_> {
    /// Copies `src` to `dst` as far as readiness allows, within the turn's budget. Nothing is
    /// read while earlier bytes wait for `dst`; then `src`'s read interest is dropped, and it
    /// stays dropped after `dst` drains for as long as `src` still has bytes to read: only a
    /// source that runs dry needs an event to resume. In a bulk transfer bound by `dst` the
    /// interest is thus changed twice per stall of the source, not twice per full send buffer,
    /// and no event wakes the loop for bytes it cannot move yet. At EOF, `dst` is half-closed
    /// unless `other_done` (the close that follows sends the FIN).
    fn pump(
        &mut self,
        src: &mut Leg,
        dst: &mut Leg,
        flow: &mut Flow,
        other_done: bool,
        src_token: Token,
        direction: Direction,
    ) -> Result<Pumped, (io::Error, Direction)> {
        let fail = |error| (error, direction);
        if flow.done {
            return Ok(Pumped::Waiting);
        }
        for _ in 0..BUDGET {
            // Held bytes first.
            if flow.in_pipe > 0 || flow.held_from < flow.held.len() {
                if !dst.writable {
                    dst.want_write(self.registry, Token(src_token.0 ^ 1))
                        .map_err(fail)?;
                    if !flow.blocked && !flow.eof {
                        src.want_read(false, self.registry, src_token)
                            .map_err(fail)?;
                        flow.blocked = true;
                    }
                    return Ok(Pumped::Waiting);
                }
                self.flush(dst, flow, direction).map_err(fail)?;
                continue;
            }
            if flow.eof {
                flow.give_back_pipe();
                flow.done = true;
                if !other_done {
                    dst.socket.shutdown(Shutdown::Write).map_err(fail)?;
                }
                return Ok(Pumped::Waiting);
            }
            if !src.readable {
                if flow.blocked {
                    // Registering again reports bytes that came in the meantime at once.
                    src.want_read(true, self.registry, src_token)
                        .map_err(fail)?;
                    flow.blocked = false;
                }
                flow.give_back_pipe();
                return Ok(Pumped::Waiting);
            }
            if flow.pipe.is_none()
                && flow.streaming
                && let Some(size) = self.splice_size
            {
                flow.pipe = pipe::take(size);
            }
            if let Some((pipe_in, _, capacity)) = flow.pipe.as_ref().and_then(PooledPipe::ends) {
                match splice(&src.socket, None, pipe_in, None, capacity, SPLICE) {
                    Ok(0) => flow.eof = true,
                    Ok(filled) => {
                        flow.in_pipe = filled;
                        if filled < capacity && !src.read_closed {
                            src.readable = false;
                        }
                    }
                    Err(Errno::AGAIN) => src.readable = false,
                    Err(errno) => return Err(fail(errno.into())),
                }
                continue;
            }
            let want = if self.splice_size.is_some() && !flow.streaming {
                STREAMING_READ
            } else {
                self.scratch.len()
            };
            let read = match (&src.socket).read(&mut self.scratch[..want]) {
                Ok(0) => {
                    flow.eof = true;
                    continue;
                }
                Ok(read) => read,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    src.readable = false;
                    continue;
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(fail(error)),
            };
            if read < want && src.read_closed && !src.errored {
                // TCP takes a FIN only after every byte before it, and a read returns all it
                // has: what came with the FIN was just read whole. The read that would return
                // 0 is saved (HAProxy does the same).
                flow.eof = true;
            } else if read < want && !src.read_closed {
                src.readable = false;
            }
            flow.streaming = read == want && want >= STREAMING_READ;
            let mut written = 0;
            while written < read && dst.writable {
                match send_before_fin(&dst.socket, &self.scratch[written..read], flow.eof) {
                    Ok(0) => return Err(fail(io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        written += n;
                        self.counters.record(direction, n);
                        if written < read {
                            dst.writable = false;
                        }
                    }
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        dst.writable = false;
                    }
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                    Err(error) => return Err(fail(error)),
                }
            }
            if written < read {
                flow.held.extend_from_slice(&self.scratch[written..read]);
            }
        }
        Ok(Pumped::Budget)
    }

    /// Writes held bytes (pipe or buffer) to `dst` once.
    fn flush(&mut self, dst: &mut Leg, flow: &mut Flow, direction: Direction) -> io::Result<()> {
        let result = if flow.in_pipe > 0 {
            let Some((_, pipe_out, _)) = flow.pipe.as_ref().and_then(PooledPipe::ends) else {
                // A pipe always holds its bytes; this cannot be reached without one.
                flow.in_pipe = 0;
                return Ok(());
            };
            let wanted = flow.in_pipe;
            splice(pipe_out, None, &dst.socket, None, wanted, SPLICE)
                .map_err(io::Error::from)
                .map(|out| (out, wanted))
        } else {
            let rest = &flow.held[flow.held_from..];
            send_before_fin(&dst.socket, rest, flow.eof).map(|out| (out, rest.len()))
        };
        match result {
            Ok((0, _)) => Err(io::ErrorKind::WriteZero.into()),
            Ok((out, wanted)) => {
                self.counters.record(direction, out);
                if out < wanted {
                    dst.writable = false;
                }
                if flow.in_pipe > 0 {
                    flow.in_pipe -= out;
                } else {
                    flow.held_from += out;
                    if flow.held_from == flow.held.len() {
                        // Held bytes are rare: give the memory back.
                        flow.held = Vec::new();
                        flow.held_from = 0;
                    }
                }
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                dst.writable = false;
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(error) => Err(error),
        }
    }
}
