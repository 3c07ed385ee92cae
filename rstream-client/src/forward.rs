//! Forwarding accepted streams to a local TCP or UDP target.
//!
//! Bytes move through proxy-core's copy engine, the one every relay of the workspace uses:
//! [`relay`] between two streams, [`relay_to`] from a stream to a TCP target; [`relay_and_log`]
//! relays one stream to a TCP or a UDP ([`crate::datagram`]) target. [`forward`] and
//! [`forward_to`] accept streams from a [`StreamSource`] (a [`Tunnel`] or a
//! [`SupervisorHandle`](crate::supervisor::SupervisorHandle)) and relay each to the target.

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use proxy_core::copy::RelayCounters;
use proxy_core::relay::{Ending, RelayConfig, RelaySummary, relay_streams};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::client::Tunnel;
use crate::error::{Error, Result};
use crate::stream::RstreamStream;

/// How long [`forward`] waits for a TCP connection to its target.
pub const TARGET_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Copies bytes both ways until both directions reached EOF; an EOF on one side is propagated as a
/// write shutdown (TLS `close_notify` / TCP FIN) while the other direction keeps flowing.
/// Returns the bytes copied `(a -> b, b -> a)`.
pub async fn relay<A, B>(a: &mut A, b: &mut B) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let counters = RelayCounters::new();
    let never = CancellationToken::new();
    let summary = relay_streams(a, b, &RelayConfig::default(), &counters, &never).await;
    match summary.ending {
        Ending::Error { kind, .. } => Err(std::io::Error::from(kind)),
        Ending::Reset { .. } => Err(std::io::ErrorKind::ConnectionReset.into()),
        _ => Ok((summary.to_upstream, summary.to_client)),
    }
}

/// Connects to the TCP address `target` within `connect_timeout` and relays `stream` to it until
/// both directions end or `cancel` fires. "Upstream" in the summary is the target.
pub async fn relay_to<S>(
    stream: S,
    target: &str,
    connect_timeout: Duration,
    cancel: &CancellationToken,
) -> Result<RelaySummary>
where
    S: AsyncRead + AsyncWrite,
{
    let upstream = tokio::time::timeout(connect_timeout, TcpStream::connect(target))
        .await
        .map_err(|_| Error::Timeout(format!("connecting to {target}")))?
        .map_err(|e| Error::connect(target, e))?;
    // Tunnel streams carry interactive protocols: do not delay small writes.
    let _ = upstream.set_nodelay(true);
    let counters = RelayCounters::new();
    Ok(relay_streams(stream, upstream, &RelayConfig::default(), &counters, cancel).await)
}

/// What a stream is relayed to: bytes to a TCP target, or datagram records to a UDP target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TargetKind {
    /// A TCP target (bytestream tunnels).
    #[default]
    Tcp,
    /// A UDP target (datagram tunnels).
    Udp,
}

impl FromStr for TargetKind {
    type Err = Error;
    /// `TCP` or `UDP`, in any case.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_uppercase().as_str() {
            "TCP" => Ok(Self::Tcp),
            "UDP" => Ok(Self::Udp),
            other => Err(Error::InvalidConfig(format!(
                "the target protocol must be TCP or UDP, not '{other}'"
            ))),
        }
    }
}

/// What [`relay_and_log`] carried on one stream, for callers that count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Relayed {
    /// A TCP stream ended: bytes each way.
    Bytes {
        /// Bytes written to the target.
        to_target: u64,
        /// Bytes from the target written to the stream.
        from_target: u64,
    },
    /// A UDP stream ended: datagrams each way.
    Datagrams {
        /// Datagrams sent to the target.
        to_target: u64,
        /// Datagrams from the target written to the stream.
        from_target: u64,
    },
    /// The target could not be reached, or the relay failed.
    Failed,
}

/// Relays one stream to `target` ([`relay_to`] for TCP, [`crate::datagram::relay_udp`] with its
/// default idle timeout for UDP) until it ends or `cancel` fires, logs the outcome (debug when
/// the relay ends, warn when the target cannot be reached) and returns what it carried.
pub async fn relay_and_log(
    stream: RstreamStream,
    target: Arc<str>,
    kind: TargetKind,
    cancel: CancellationToken,
) -> Relayed {
    let outcome = match kind {
        TargetKind::Tcp => relay_to(stream, &target, TARGET_CONNECT_TIMEOUT, &cancel)
            .await
            .map(|s| {
                let summary = format!(
                    "{} bytes to the target, {} back, {}",
                    s.to_upstream,
                    s.to_client,
                    s.ending.as_str()
                );
                let relayed = Relayed::Bytes {
                    to_target: s.to_upstream,
                    from_target: s.to_client,
                };
                (summary, relayed)
            }),
        TargetKind::Udp => {
            let idle = crate::datagram::DEFAULT_UDP_IDLE_TIMEOUT;
            crate::datagram::relay_udp(stream, &target, idle, &cancel)
                .await
                .map(|s| {
                    let summary = format!(
                        "{} datagrams to the target, {} back, {} dropped, {:?}",
                        s.to_target, s.from_target, s.dropped, s.ending
                    );
                    let relayed = Relayed::Datagrams {
                        to_target: s.to_target,
                        from_target: s.from_target,
                    };
                    (summary, relayed)
                })
        }
    };
    match outcome {
        Ok((summary, relayed)) => {
            debug!(%target, %summary, "stream finished");
            relayed
        }
        Err(error) => {
            warn!(%target, error = %crate::error::chain(&error), "cannot reach the target");
            Relayed::Failed
        }
    }
}

/// A source of accepted streams.
pub trait StreamSource {
    /// The next stream; `None` when the source is finished.
    fn next_stream(&mut self) -> impl Future<Output = Option<RstreamStream>> + Send;
    /// Cancelled when relayed streams must be closed (explicit close); `None` if never.
    fn hard_close(&self) -> Option<CancellationToken> {
        None
    }
}

impl StreamSource for Tunnel {
    async fn next_stream(&mut self) -> Option<RstreamStream> {
        self.accept().await.ok()
    }
    fn hard_close(&self) -> Option<CancellationToken> {
        Some(self.hard_close_token())
    }
}

/// Relays every stream of `source` to the TCP address `target` until the source ends, then waits for
/// the relays still running: [`forward_to`] with [`TargetKind::Tcp`].
pub async fn forward<S: StreamSource>(source: &mut S, target: &str) -> Result<()> {
    forward_to(source, target, TargetKind::Tcp).await
}

/// Relays every stream of `source` to `target` with [`relay_and_log`] until the source ends, then
/// waits for the relays still running. Each stream gets its own connection (TCP) or socket (UDP)
/// to the target; a stream whose target cannot be reached is closed.
pub async fn forward_to<S: StreamSource>(
    source: &mut S,
    target: &str,
    kind: TargetKind,
) -> Result<()> {
    if target.trim().is_empty() {
        return Err(Error::InvalidConfig("forward target is empty".into()));
    }
    let target: Arc<str> = target.into();
    let relays = TaskTracker::new();
    let hard = source.hard_close().unwrap_or_default();
    while let Some(stream) = source.next_stream().await {
        relays.spawn(relay_and_log(
            stream,
            Arc::clone(&target),
            kind,
            hard.clone(),
        ));
    }
    relays.close();
    relays.wait().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn target_kinds_parse_in_any_case_and_name_a_bad_value() {
        assert_eq!("tcp".parse::<TargetKind>().unwrap(), TargetKind::Tcp);
        assert_eq!(" UDP ".parse::<TargetKind>().unwrap(), TargetKind::Udp);
        let err = "sctp".parse::<TargetKind>().unwrap_err().to_string();
        assert!(err.contains("TCP or UDP, not 'SCTP'"), "{err}");
    }
}
