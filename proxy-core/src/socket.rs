//! Socket options applied to both legs of a relay.
//!
//! Failures to set an option are reported to the caller, who logs them and carries on: a
//! socket without keepalive still relays bytes correctly (linkerd2-proxy does the same).

use std::io;
use std::net::Shutdown;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;

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
        stream.set_nodelay(self.nodelay)?;
        if let Some(keepalive) = self.keepalive {
            let params = TcpKeepalive::new()
                .with_time(keepalive.idle)
                .with_interval(keepalive.interval);
            #[cfg(any(target_os = "linux", target_os = "android", target_os = "macos"))]
            let params = params.with_retries(keepalive.retries);
            SockRef::from(stream).set_tcp_keepalive(&params)?;
        }
        Ok(())
    }
}

/// Sends FIN on `stream` while its read side stays open (half-close).
pub(crate) fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    SockRef::from(stream).shutdown(Shutdown::Write)
}

/// Makes the next close send RST instead of FIN, so that a peer learns the other side aborted
/// rather than finished. `SO_LINGER` with a zero timeout never blocks on close.
pub(crate) fn reset_on_close(stream: &TcpStream) {
    if let Err(error) = stream.set_zero_linger() {
        tracing::debug!(%error, "cannot set SO_LINGER 0");
    }
}
