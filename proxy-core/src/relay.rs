//! One connection: connect the upstream (with a timeout), copy both directions until both are
//! done, and summarise how it went.
//!
//! Both directions run concurrently in the calling task. When one direction reaches EOF its
//! writer is half-closed (FIN) and the other direction keeps flowing. A reset, an idle timeout,
//! the maximum lifetime or cancellation ends both directions at once. Resets and EOF are normal
//! endings: they are reported in the [`RelaySummary`], not logged as errors.

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures::task::AtomicWaker;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::copy::{self, CopyMode, Direction, RelayCounters};
use crate::error::{ConfigError, ConnectError};
use crate::proxy_protocol;
use crate::socket::{self, SocketOptions};
use crate::upstream::Upstream;

/// Default pipe size for the splice path: 1 MiB, as mmproxy-rs uses (the Linux default is
/// 64 KiB; larger pipes mean fewer syscalls for bulk transfers).
pub const DEFAULT_PIPE_SIZE: usize = 1 << 20;

/// Timeouts, copy mode and socket options of a relayed connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Bound on connecting to the upstream (including DNS), per attempt.
    pub connect_timeout: Duration,
    /// Close the connection when no byte moved in either direction for this long.
    pub idle_timeout: Option<Duration>,
    /// Close the connection this long after it started, whatever it is doing.
    pub max_lifetime: Option<Duration>,
    /// Buffered or splice, for TCP-to-TCP relays.
    pub copy_mode: CopyMode,
    /// Requested pipe size for the splice path (the kernel may round it up or refuse it).
    pub pipe_size: usize,
    /// Options for both sockets.
    pub socket: SocketOptions,
}

impl Default for RelayConfig {
    /// 10 s connect timeout, no idle timeout or lifetime limit (API watches stay open for
    /// hours), automatic copy mode, 1 MiB pipes, `TCP_NODELAY` and keepalive.
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(10),
            idle_timeout: None,
            max_lifetime: None,
            copy_mode: CopyMode::Auto,
            pipe_size: DEFAULT_PIPE_SIZE,
            socket: SocketOptions::default(),
        }
    }
}

impl RelayConfig {
    /// Sets the connect timeout.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the idle timeout.
    #[must_use]
    pub fn with_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Sets the maximum lifetime.
    #[must_use]
    pub fn with_max_lifetime(mut self, lifetime: Option<Duration>) -> Self {
        self.max_lifetime = lifetime;
        self
    }

    /// Sets the copy mode.
    #[must_use]
    pub fn with_copy_mode(mut self, mode: CopyMode) -> Self {
        self.copy_mode = mode;
        self
    }

    /// Sets the pipe size of the splice path.
    #[must_use]
    pub fn with_pipe_size(mut self, size: usize) -> Self {
        self.pipe_size = size;
        self
    }

    /// Sets the socket options.
    #[must_use]
    pub fn with_socket_options(mut self, options: SocketOptions) -> Self {
        self.socket = options;
        self
    }

    /// Rejects zero durations and a zero pipe size.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let zero = |what| Err(ConfigError::Zero { what });
        if self.connect_timeout.is_zero() {
            return zero("connect timeout");
        }
        if self.idle_timeout.is_some_and(|d| d.is_zero()) {
            return zero("idle timeout");
        }
        if self.max_lifetime.is_some_and(|d| d.is_zero()) {
            return zero("maximum lifetime");
        }
        if self.pipe_size == 0 {
            return zero("pipe size");
        }
        Ok(())
    }
}

/// Where and how a listener forwards its connections.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Route {
    /// A name for logs and metric labels.
    pub name: String,
    /// Where connections go.
    pub upstream: Upstream,
    /// Send a PROXY protocol v2 header to the upstream first.
    pub proxy_protocol: bool,
}

impl Route {
    /// A route named `name` to `upstream`, without PROXY protocol.
    pub fn new(name: impl Into<String>, upstream: impl Into<Upstream>) -> Self {
        Self {
            name: name.into(),
            upstream: upstream.into(),
            proxy_protocol: false,
        }
    }

    /// Enables or disables the PROXY protocol v2 header.
    #[must_use]
    pub fn with_proxy_protocol(mut self, enabled: bool) -> Self {
        self.proxy_protocol = enabled;
        self
    }
}

/// How a relay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Ending {
    /// Both directions reached EOF and were half-closed in turn.
    Completed,
    /// A peer reset the connection (or the socket broke) while copying in `direction`. Normal
    /// on the Internet; the reset is passed on to the other peer.
    Reset {
        /// The direction that saw it.
        direction: Direction,
    },
    /// Another I/O error while copying in `direction`.
    Error {
        /// The direction that saw it.
        direction: Direction,
        /// The error's kind.
        kind: io::ErrorKind,
    },
    /// No byte moved for the idle timeout.
    IdleTimeout,
    /// The maximum lifetime was reached.
    MaxLifetime,
    /// The caller cancelled (drain deadline, route change, shutdown).
    Cancelled,
    /// The upstream could not be reached (used by the server; relays never return it).
    ConnectFailed,
}

impl Ending {
    /// A short lowercase name, used in logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Ending::Completed => "completed",
            Ending::Reset { .. } => "reset",
            Ending::Error { .. } => "error",
            Ending::IdleTimeout => "idle_timeout",
            Ending::MaxLifetime => "max_lifetime",
            Ending::Cancelled => "cancelled",
            Ending::ConnectFailed => "connect_failed",
        }
    }

    pub(crate) fn from_error(error: &io::Error, direction: Direction) -> Self {
        use io::ErrorKind::{
            BrokenPipe, ConnectionAborted, ConnectionReset, NotConnected, UnexpectedEof,
        };
        match error.kind() {
            ConnectionReset | BrokenPipe | ConnectionAborted | NotConnected | UnexpectedEof => {
                Ending::Reset { direction }
            }
            kind => Ending::Error { direction, kind },
        }
    }
}

/// What a finished relay did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelaySummary {
    /// Bytes written to the upstream.
    pub to_upstream: u64,
    /// Bytes written to the client.
    pub to_client: u64,
    /// Time from the creation of the counters to the end.
    pub duration: Duration,
    /// How it ended.
    pub ending: Ending,
    /// The copy path used (`Buffered` or `Splice`).
    pub copy_mode: CopyMode,
}

impl RelaySummary {
    /// A summary of `counters` as they are now.
    pub fn from_counters(counters: &RelayCounters, ending: Ending, copy_mode: CopyMode) -> Self {
        Self {
            to_upstream: counters.to_upstream(),
            to_client: counters.to_client(),
            duration: counters.started().elapsed(),
            ending,
            copy_mode,
        }
    }
}

/// Connects to the route's upstream within the connect timeout and, when the route asks for
/// it, writes the PROXY protocol header describing `client`.
pub async fn connect_upstream(
    route: &Route,
    client: &TcpStream,
    config: &RelayConfig,
) -> Result<TcpStream, ConnectError> {
    let mut upstream = route.upstream.connect(config.connect_timeout).await?;
    if route.proxy_protocol {
        let target = upstream
            .peer_addr()
            .unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
        let header_error = |cause| ConnectError::ProxyHeader { target, cause };
        let header = proxy_protocol::encode_v2(
            client.peer_addr().map_err(header_error)?,
            client.local_addr().map_err(header_error)?,
        );
        let write = upstream.write_all(&header);
        tokio::time::timeout(config.connect_timeout, write)
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
            .map_err(header_error)?;
    }
    Ok(upstream)
}

/// Connects `client` to the route's upstream and relays until both directions are done.
///
/// `cancel` closes the connection at any time, including during the connect.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use proxy_core::relay::{proxy, RelayConfig, Route};
/// use proxy_core::copy::RelayCounters;
/// use tokio::io::{AsyncReadExt, AsyncWriteExt};
/// use tokio::net::{TcpListener, TcpStream};
/// use tokio_util::sync::CancellationToken;
///
/// // An upstream that answers "pong" and closes.
/// let backend = TcpListener::bind("127.0.0.1:0").await?;
/// let route = Route::new("demo", backend.local_addr()?);
/// tokio::spawn(async move {
///     let (mut conn, _) = backend.accept().await?;
///     conn.write_all(b"pong").await?;
///     conn.shutdown().await
/// });
///
/// let front = TcpListener::bind("127.0.0.1:0").await?;
/// let mut client = TcpStream::connect(front.local_addr()?).await?;
/// let (accepted, _) = front.accept().await?;
/// let relay = tokio::spawn(async move {
///     let counters = RelayCounters::new();
///     proxy(accepted, &route, &RelayConfig::default(), &counters, &CancellationToken::new()).await
/// });
///
/// client.shutdown().await?; // nothing to send
/// let mut reply = String::new();
/// client.read_to_string(&mut reply).await?;
/// assert_eq!(reply, "pong");
/// let summary = relay.await??;
/// assert_eq!(summary.to_client, 4);
/// # Ok(())
/// # }
/// ```
pub async fn proxy(
    client: TcpStream,
    route: &Route,
    config: &RelayConfig,
    counters: &RelayCounters,
    cancel: &CancellationToken,
) -> Result<RelaySummary, ConnectError> {
    let upstream = tokio::select! {
        result = connect_upstream(route, &client, config) => result?,
        () = cancel.cancelled() => {
            return Ok(RelaySummary::from_counters(counters, Ending::Cancelled, config.copy_mode.resolve()));
        }
    };
    Ok(relay_tcp(client, upstream, config, counters, cancel).await)
}

/// Relays between two TCP sockets on the fast path: splice on Linux (per
/// [`RelayConfig::copy_mode`]), readiness-driven buffered copy otherwise. Applies the socket
/// options to both legs. A reset seen on one leg is passed on to the other as a reset.
pub async fn relay_tcp(
    client: TcpStream,
    upstream: TcpStream,
    config: &RelayConfig,
    counters: &RelayCounters,
    cancel: &CancellationToken,
) -> RelaySummary {
    relay_tcp_legs(client, upstream, config, counters, cancel, false).await
}

/// [`relay_tcp`], leaving the client's socket options alone when `client_ready` (a listener
/// whose accepted sockets inherit them).
pub(crate) async fn relay_tcp_legs(
    client: TcpStream,
    upstream: TcpStream,
    config: &RelayConfig,
    counters: &RelayCounters,
    cancel: &CancellationToken,
    client_ready: bool,
) -> RelaySummary {
    let legs = [("client", &client), ("upstream", &upstream)];
    for (leg, stream) in legs.into_iter().skip(usize::from(client_ready)) {
        if let Err(error) = config.socket.apply(stream) {
            tracing::debug!(%error, leg, "cannot set socket options");
        }
    }
    let mode = config.copy_mode.resolve();
    // Both directions share one flag: the direction that finishes second leaves the FIN to
    // the close that follows at once, one `shutdown` fewer per connection.
    let one_done = AtomicBool::new(false);
    let to_upstream = pin!(copy::copy_tcp(
        &client,
        &upstream,
        mode,
        config.pipe_size,
        counters,
        Direction::ToUpstream,
        &one_done,
    ));
    let to_client = pin!(copy::copy_tcp(
        &upstream,
        &client,
        mode,
        config.pipe_size,
        counters,
        Direction::ToClient,
        &one_done,
    ));
    let ending = drive(to_upstream, to_client, config, counters, cancel).await;
    if matches!(ending, Ending::Reset { .. } | Ending::Error { .. }) {
        socket::reset_on_close(&client);
        socket::reset_on_close(&upstream);
    }
    RelaySummary::from_counters(counters, ending, mode)
}

/// Relays between any two byte streams (TLS, tunnels, ...) with the adaptive buffered path.
/// Socket options are the caller's business here.
pub async fn relay_streams<C, U>(
    client: C,
    upstream: U,
    config: &RelayConfig,
    counters: &RelayCounters,
    cancel: &CancellationToken,
) -> RelaySummary
where
    C: AsyncRead + AsyncWrite,
    U: AsyncRead + AsyncWrite,
{
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let (mut upstream_read, mut upstream_write) = tokio::io::split(upstream);
    let to_upstream = pin!(copy::copy_stream(
        &mut client_read,
        &mut upstream_write,
        counters,
        Direction::ToUpstream,
    ));
    let to_client = pin!(copy::copy_stream(
        &mut upstream_read,
        &mut client_write,
        counters,
        Direction::ToClient,
    ));
    let ending = drive(to_upstream, to_client, config, counters, cancel).await;
    RelaySummary::from_counters(counters, ending, CopyMode::Buffered)
}

/// Runs both directions until both are done, or one fails, or a timer or `cancel` fires.
///
/// The directions come pinned by the caller, so that each lives once in the connection's
/// future (a future passed by value and pinned here would be stored twice).
async fn drive(
    mut to_upstream: Pin<&mut impl Future<Output = io::Result<()>>>,
    mut to_client: Pin<&mut impl Future<Output = io::Result<()>>>,
    config: &RelayConfig,
    counters: &RelayCounters,
    cancel: &CancellationToken,
) -> Ending {
    // A lifetime too long to represent as an instant never expires.
    let lifetime_end = config
        .max_lifetime
        .and_then(|lifetime| counters.started().checked_add(lifetime));
    let lifetime = async {
        match lifetime_end {
            Some(end) => tokio::time::sleep_until(end).await,
            None => std::future::pending().await,
        }
    };
    let idle = idle_expired(counters, config.idle_timeout);
    tokio::pin!(lifetime, idle);
    let cancelled = pin!(cancel.cancelled());
    let mut cancelled = WhenWoken::new(cancelled);
    let (mut upstream_done, mut client_done) = (false, false);
    while !(upstream_done && client_done) {
        let (direction, result) = tokio::select! {
            result = to_upstream.as_mut(), if !upstream_done => {
                upstream_done = true;
                (Direction::ToUpstream, result)
            }
            result = to_client.as_mut(), if !client_done => {
                client_done = true;
                (Direction::ToClient, result)
            }
            () = &mut idle => return Ending::IdleTimeout,
            () = &mut lifetime => return Ending::MaxLifetime,
            () = &mut cancelled => return Ending::Cancelled,
        };
        if let Err(error) = result {
            let ending = Ending::from_error(&error, direction);
            tracing::debug!(%error, ending = ending.as_str(), direction = direction.as_str(), "relay direction ended");
            return ending;
        }
    }
    Ending::Completed
}

/// Polls `inner` only once its own waker has fired. A cancellation future stays registered
/// with its token after its first poll, yet polling it again locks the token's node and its
/// notifier; without this, every wake-up of a connection (each segment that arrives) would pay
/// both locks. A few atomics per poll instead, and one allocation per connection.
struct WhenWoken<'a, F> {
    inner: Pin<&'a mut F>,
    signal: Arc<WakeSignal>,
    waker: Waker,
}

/// Set by the inner future's waker; passes the wake-up on to the task that polled last.
struct WakeSignal {
    woken: AtomicBool,
    task: AtomicWaker,
}

impl Wake for WakeSignal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl<'a, F: Future> WhenWoken<'a, F> {
    fn new(inner: Pin<&'a mut F>) -> Self {
        // Woken at first, so the first poll registers the inner future.
        let signal = Arc::new(WakeSignal {
            woken: AtomicBool::new(true),
            task: AtomicWaker::new(),
        });
        let waker = Waker::from(Arc::clone(&signal));
        Self {
            inner,
            signal,
            waker,
        }
    }
}

impl<F: Future> Future for WhenWoken<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        // Registered before the flag is read: a wake-up in between is seen either way.
        this.signal.task.register(cx.waker());
        if !this.signal.woken.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        this.inner
            .as_mut()
            .poll(&mut Context::from_waker(&this.waker))
    }
}

/// Completes once no byte has moved for `idle`; never completes without an idle timeout.
async fn idle_expired(counters: &RelayCounters, idle: Option<Duration>) {
    let Some(idle) = idle else {
        return std::future::pending().await;
    };
    loop {
        let Some(deadline) = counters.last_activity().checked_add(idle) else {
            return std::future::pending().await;
        };
        if deadline <= tokio::time::Instant::now() {
            return;
        }
        tokio::time::sleep_until(deadline).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_zero_settings() {
        let zero = Duration::ZERO;
        let some = Some(Duration::ZERO);
        assert!(RelayConfig::default().validate().is_ok());
        assert!(
            RelayConfig::default()
                .with_connect_timeout(zero)
                .validate()
                .is_err()
        );
        assert!(
            RelayConfig::default()
                .with_idle_timeout(some)
                .validate()
                .is_err()
        );
        assert!(
            RelayConfig::default()
                .with_max_lifetime(some)
                .validate()
                .is_err()
        );
        assert!(RelayConfig::default().with_pipe_size(0).validate().is_err());
    }

    #[test]
    fn resets_are_normal_endings() {
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(
            Ending::from_error(&reset, Direction::ToClient),
            Ending::Reset {
                direction: Direction::ToClient
            }
        );
        let other = io::Error::from(io::ErrorKind::PermissionDenied);
        assert_eq!(
            Ending::from_error(&other, Direction::ToUpstream).as_str(),
            "error"
        );
    }
}
