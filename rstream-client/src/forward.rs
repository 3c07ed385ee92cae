//! Forwarding accepted streams to a local TCP target.
//!
//! [`relay`] is the one function that moves bytes between two streams (both directions, half-close
//! propagated); [`forward`] accepts streams from a [`StreamSource`] (a [`Tunnel`] or a
//! [`SupervisorHandle`](crate::supervisor::SupervisorHandle)) and relays each to the target.

use std::future::Future;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::client::Tunnel;
use crate::error::{Error, Result};
use crate::stream::RstreamStream;

/// Copies bytes both ways until both directions reached EOF; an EOF on one side is propagated as a
/// write shutdown (TLS `close_notify` / TCP FIN) while the other direction keeps flowing.
/// Returns the bytes copied `(a -> b, b -> a)`.
pub async fn relay<A, B>(a: &mut A, b: &mut B) -> std::io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    tokio::io::copy_bidirectional(a, b).await
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
/// the relays still running. Each stream gets its own TCP connection to the target; a stream whose
/// target connection fails is closed.
pub async fn forward<S: StreamSource>(source: &mut S, target: &str) -> Result<()> {
    if target.trim().is_empty() {
        return Err(Error::InvalidConfig("forward target is empty".into()));
    }
    let relays = TaskTracker::new();
    let hard = source.hard_close().unwrap_or_default();
    while let Some(mut stream) = source.next_stream().await {
        let target = target.to_owned();
        let hard = hard.clone();
        relays.spawn(async move {
            let run = async {
                let mut upstream = TcpStream::connect(&target).await?;
                let _ = upstream.set_nodelay(true);
                relay(&mut stream, &mut upstream).await
            };
            tokio::select! {
                _ = hard.cancelled() => debug!("relay closed with its control channel"),
                r = run => match r {
                    Ok((up, down)) => debug!(up, down, "relay finished"),
                    Err(e) => debug!(error = %e, "relay ended with an error"),
                },
            }
        });
    }
    relays.close();
    relays.wait().await;
    Ok(())
}
