//! Socket options applied to both legs of a relay, and how listeners bind.
//!
//! Failures to set an option are reported to the caller, who logs them and carries on: a
//! socket without keepalive still relays bytes correctly (linkerd2-proxy does the same).
//!
//! The [server](crate::server) sets the options once on each listening socket
//! ([`SocketOptions::apply_to_listener`]): on Linux accepted sockets inherit `TCP_NODELAY` and
//! the keepalive settings, which saves five `setsockopt` calls per accepted connection. The
//! upstream socket still gets them one by one.

use std::io;
use std::net::{Ipv4Addr, Shutdown, SocketAddr};
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// TCP keepalive probing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between probes.
    pub interval: Duration,
    /// Unanswered probes before the connection is dropped.
    pub retries: u32,
}

impl Default for Keepalive {
    /// 60 s idle, 10 s between probes, 6 probes: a dead peer is noticed after about 2 minutes,
    /// well before typical NAT/conntrack timeouts drop the state.
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(60),
            interval: Duration::from_secs(10),
            retries: 6,
        }
    }
}

/// Options set on every accepted and every connected socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SocketOptions {
    /// Disable Nagle's algorithm. Without it, write-write-read exchanges stall on delayed ACKs
    /// for tens of milliseconds per round trip.
    pub nodelay: bool,
    /// Keepalive probing, or `None` to leave the system default (off).
    pub keepalive: Option<Keepalive>,
}

impl Default for SocketOptions {
    fn default() -> Self {
        Self {
            nodelay: true,
            keepalive: Some(Keepalive::default()),
        }
    }
}

impl SocketOptions {
    /// Sets `nodelay`.
    #[must_use]
    pub fn with_nodelay(mut self, nodelay: bool) -> Self {
        self.nodelay = nodelay;
        self
    }

    /// Sets `keepalive`.
    #[must_use]
    pub fn with_keepalive(mut self, keepalive: Option<Keepalive>) -> Self {
        self.keepalive = keepalive;
        self
    }

    /// Applies the options to `stream`. Stops at the first option that fails.
    pub fn apply(&self, stream: &TcpStream) -> io::Result<()> {
        self.apply_to(SockRef::from(stream))
    }

    /// Applies the options to a listening socket, so that the sockets it accepts start with
    /// them and need no `setsockopt` of their own. True when accepted sockets inherit them
    /// (Linux copies `TCP_NODELAY` and the keepalive settings from the listener); false on
    /// other systems, or if an option could not be set, where each accepted socket still
    /// needs [`apply`](Self::apply).
    pub fn apply_to_listener(&self, listener: &TcpListener) -> bool {
        if !cfg!(target_os = "linux") {
            return false;
        }
        match self.apply_to(SockRef::from(listener)) {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(%error, "cannot set socket options on the listener, setting them per connection");
                false
            }
        }
    }

    pub(crate) fn apply_to(&self, socket: SockRef<'_>) -> io::Result<()> {
        socket.set_tcp_nodelay(self.nodelay)?;
        if let Some(keepalive) = self.keepalive {
            let params = TcpKeepalive::new()
                .with_time(keepalive.idle)
                .with_interval(keepalive.interval);
            #[cfg(any(target_os = "linux", target_os = "android", target_os = "macos"))]
            let params = params.with_retries(keepalive.retries);
            socket.set_tcp_keepalive(&params)?;
        }
        Ok(())
    }
}

/// Binds a listening socket with `SO_REUSEADDR` (so a restarted proxy binds while old
/// connections sit in `TIME_WAIT`).
///
/// The unspecified IPv6 address `[::]` listens the way Go's `:port` does: one IPv6 socket with
/// `IPV6_V6ONLY` off, so IPv4 clients reach it too (as IPv4-mapped addresses), whatever the
/// host's `net.ipv6.bindv6only` says. On a host without IPv6 it falls back to `0.0.0.0` on the
/// same port; the returned listener's `local_addr` tells which one was bound. Every other address
/// is bound exactly as given.
///
/// # Panics
///
/// When called outside a Tokio runtime.
pub fn bind_listener(addr: SocketAddr, backlog: u32) -> io::Result<TcpListener> {
    bind_listener_with(addr, backlog, false)
}

/// As [`bind_listener`], and with `reuse_port` also `SO_REUSEPORT`: several sockets of this
/// process then listen on one address, and the kernel spreads new connections among them by
/// their addresses' hash (one socket per accept worker).
pub(crate) fn bind_listener_with(
    addr: SocketAddr,
    backlog: u32,
    reuse_port: bool,
) -> io::Result<TcpListener> {
    let dual_stack = matches!(addr, SocketAddr::V6(v6) if v6.ip().is_unspecified());
    match bind_exact(addr, backlog, dual_stack, reuse_port) {
        // A taken port or a privileged one would fail on IPv4 as well; anything else means this
        // host cannot do IPv6 (no AF_INET6, no IPv6 address).
        Err(err)
            if dual_stack
                && !matches!(
                    err.kind(),
                    io::ErrorKind::AddrInUse | io::ErrorKind::PermissionDenied
                ) =>
        {
            tracing::debug!(%addr, error = %err, "no IPv6 here, listening on IPv4 only");
            bind_exact(
                SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port())),
                backlog,
                false,
                reuse_port,
            )
        }
        other => other,
    }
}

fn bind_exact(
    addr: SocketAddr,
    backlog: u32,
    dual_stack: bool,
    reuse_port: bool,
) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }?;
    socket.set_reuseaddr(true)?;
    if reuse_port {
        set_reuse_port(&socket)?;
    }
    if dual_stack {
        SockRef::from(&socket).set_only_v6(false)?;
    }
    socket.bind(addr)?;
    socket.listen(backlog)
}

#[cfg(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin"))
))]
fn set_reuse_port(socket: &TcpSocket) -> io::Result<()> {
    socket.set_reuseport(true)
}

#[cfg(not(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin"))
)))]
fn set_reuse_port(_socket: &TcpSocket) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "SO_REUSEPORT is not available here",
    ))
}

/// Opens a TCP connection to `addr`, as [`TcpStream::connect`] does, with one syscall fewer on
/// Linux: tokio reads `SO_ERROR` after every connect, this only when epoll reported an error or
/// a hang-up, the only ways a failed non-blocking connect shows itself.
pub(crate) async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    #[cfg(target_os = "linux")]
    {
        connect_nonblocking(addr).await
    }
    #[cfg(not(target_os = "linux"))]
    {
        TcpStream::connect(addr).await
    }
}

#[cfg(target_os = "linux")]
async fn connect_nonblocking(addr: SocketAddr) -> io::Result<TcpStream> {
    use rustix::io::Errno;
    use rustix::net::{AddressFamily, SocketFlags, SocketType, ipproto};
    use tokio::io::Interest;

    let family = match addr {
        SocketAddr::V4(_) => AddressFamily::INET,
        SocketAddr::V6(_) => AddressFamily::INET6,
    };
    let socket = rustix::net::socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        Some(ipproto::TCP),
    )?;
    match rustix::net::connect(&socket, &addr) {
        // An interrupted connect goes on in the background, as an in-progress one does.
        Ok(()) | Err(Errno::INPROGRESS | Errno::INTR) => {}
        Err(errno) => return Err(errno.into()),
    }
    let stream = TcpStream::from_std(std::net::TcpStream::from(socket))?;
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream.take_error()?.unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the connection closed while connecting",
            )
        }));
    }
    Ok(stream)
}

/// Sends FIN on `stream` while its read side stays open (half-close).
pub(crate) fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    SockRef::from(stream).shutdown(Shutdown::Write)
}

/// Sends `bytes` on `socket` (never raising `SIGPIPE`). `last`: they are the last before the
/// FIN, which the shutdown or close right after sends. On Linux those go with `MSG_MORE`:
/// queued rather than pushed, they leave with the FIN in one segment, and the peer acknowledges
/// both with one (two segments fewer per short connection; HAProxy's buffered path does the
/// same). Takes tokio's and the standard library's sockets alike.
pub(crate) fn send_before_fin<S>(socket: &S, bytes: &[u8], last: bool) -> io::Result<usize>
where
    for<'s> SockRef<'s>: From<&'s S>,
{
    let socket = SockRef::from(socket);
    #[cfg(target_os = "linux")]
    {
        use rustix::net::SendFlags;
        let flags = if last {
            SendFlags::NOSIGNAL | SendFlags::MORE
        } else {
            SendFlags::NOSIGNAL
        };
        Ok(rustix::net::send(&*socket, bytes, flags)?)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = last;
        socket.send(bytes)
    }
}

/// Makes the next close send RST instead of FIN, so that a peer learns the other side aborted
/// rather than finished. `SO_LINGER` with a zero timeout never blocks on close. Takes tokio's
/// and the standard library's sockets alike (the event loop holds the latter).
pub(crate) fn reset_on_close<S>(socket: &S)
where
    for<'s> SockRef<'s>: From<&'s S>,
{
    if let Err(error) = SockRef::from(socket).set_linger(Some(Duration::ZERO)) {
        tracing::debug!(%error, "cannot set SO_LINGER 0");
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv6Addr, SocketAddr};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;

    /// Connects to `addr`, has the listener answer, and returns the peer address it saw.
    async fn round_trip(listener: &TcpListener, addr: SocketAddr) -> SocketAddr {
        let mut client = TcpStream::connect(addr).await.unwrap();
        let (mut served, peer) = listener.accept().await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        served.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        served.write_all(b"pong").await.unwrap();
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
        peer
    }

    #[tokio::test]
    async fn the_unspecified_ipv6_address_serves_both_families() {
        let listener = bind_listener(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)), 16).unwrap();
        let local = listener.local_addr().unwrap();
        assert!(local.is_ipv6(), "this host has IPv6 on loopback: {local}");
        let port = local.port();
        // An IPv6-only client, over ::1 alone.
        let peer = round_trip(&listener, SocketAddr::from((Ipv6Addr::LOCALHOST, port))).await;
        assert_eq!(peer.ip(), Ipv6Addr::LOCALHOST);
        // An IPv4 client reaches the same socket as an IPv4-mapped address.
        let peer = round_trip(&listener, SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await;
        assert_eq!(
            peer.ip(),
            std::net::IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped())
        );
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn accepted_sockets_inherit_the_listeners_options() {
        let listener = bind_listener(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 16).unwrap();
        let options = SocketOptions::default().with_keepalive(Some(Keepalive {
            idle: Duration::from_secs(61),
            interval: Duration::from_secs(11),
            retries: 7,
        }));
        assert!(options.apply_to_listener(&listener));
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        let accepted = SockRef::from(&accepted);
        assert!(accepted.tcp_nodelay().unwrap());
        assert!(accepted.keepalive().unwrap());
        assert_eq!(
            accepted.tcp_keepalive_time().unwrap(),
            Duration::from_secs(61)
        );
        assert_eq!(
            accepted.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(11)
        );
        assert_eq!(accepted.tcp_keepalive_retries().unwrap(), 7);
    }

    #[tokio::test]
    async fn connect_reaches_a_listener_and_reports_a_refusal() {
        let listener = bind_listener(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 16).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = connect(addr).await.unwrap();
        let (mut served, _) = listener.accept().await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        served.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        // Nothing listens on the port once the listener is gone: the refusal is the error.
        drop(listener);
        let refused = connect(addr).await.map(|_| ()).map_err(|e| e.kind());
        assert_eq!(refused, Err(io::ErrorKind::ConnectionRefused));
        let refused = connect(SocketAddr::from((Ipv6Addr::LOCALHOST, addr.port())))
            .await
            .map(|_| ())
            .map_err(|e| e.kind());
        assert_eq!(refused, Err(io::ErrorKind::ConnectionRefused));
    }

    #[tokio::test]
    async fn other_addresses_bind_as_given() {
        let listener = bind_listener(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)), 16).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listener.local_addr().unwrap().is_ipv4());
        round_trip(&listener, SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await;
        // 0.0.0.0 stays IPv4 only.
        assert!(
            TcpStream::connect(SocketAddr::from((Ipv6Addr::LOCALHOST, port)))
                .await
                .is_err()
        );
        // A taken port is reported, not papered over by the IPv4 fallback.
        let taken = bind_listener(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)), 16);
        assert_eq!(
            taken.map(|_| ()).map_err(|e| e.kind()),
            Err(io::ErrorKind::AddrInUse)
        );
    }
}
