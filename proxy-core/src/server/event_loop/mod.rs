//! The Linux data path: connections as state machines on per-thread event loops, without a
//! tokio task per connection ([`DataPath::EventLoop`](super::DataPath::EventLoop)).
//!
//! # Where it plugs in
//!
//! [`ProxyServer::add_listener`](super::ProxyServer::add_listener) picks the path per listener:
//! a listener without an accept layer (plain TCP to TCP) goes to the event loops when
//! [`ServerConfig::data_path`](super::ServerConfig::data_path) asks for them; one with an accept
//! layer (TLS termination, any async handshake) stays on the tokio path. The loops are threads
//! of the server's own (`proxy-worker-N`), as many as
//! [`ServerConfig::accept_workers`](super::ServerConfig::accept_workers) says (one without it),
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
//! since [`ProxyServer::connections`](super::ProxyServer::connections) hands them out live);
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
//! * **Relay**: each socket is registered edge-triggered once, for reading and writing; the
//!   loop keeps its own readiness flags, cleared by `EAGAIN` or a short transfer. A direction
//!   copies while its source is readable and its destination writable: through the per-thread
//!   scratch buffer, or, once a read fills 16 KiB and the copy mode allows it, through a pipe
//!   from the process-wide [pool](crate::pipe) (same budget, same hand-back when the source
//!   runs dry). When the destination is full the source's read interest is dropped
//!   (`epoll_ctl` MOD) until the destination drains, so segments arriving meanwhile do not
//!   wake the thread: HAProxy's way to few wake-ups per MiB.
//! * **End**: the FIN follows the last byte in the same turn (`shutdown(SHUT_WR)` right after
//!   the final write); the direction that finishes second leaves it to the close. A reset or
//!   error on one leg resets the other (`SO_LINGER` 0). Closing the descriptors removes them
//!   from epoll; there is no `EPOLL_CTL_DEL`. A slab slot freed during a turn is reused only in
//!   the next, so late events of the turn cannot reach a new connection.
//!
//! # Timers
//!
//! One coarse timer wheel per loop (100 ms slots) holds connect deadlines, idle timeouts and
//! maximum lifetimes: a connection sits in at most one slot at a time, and an expiry that
//! finds the connection active since re-files it (no work per byte). The same turn reports
//! byte counts every [`report_interval`](super::ServerConfig::report_interval) and, during a
//! drain with [`drain_idle`](super::ServerConfig::drain_idle), closes answered idle
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
//!   [`ProxyServer::connections`](super::ProxyServer::connections) asks each loop for its list
//!   and waits for the answer (one turn of the loop).
//! * **Metrics**: the observer is called from the loop thread, as from a connection task:
//!   opened, rejected, connect failed, bytes (each report interval and at the end), closed.
