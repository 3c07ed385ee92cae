//! The API's HTTP server: [`k8s_reconcile::app::rest::serve_api_with`]'s loop (limits, busy
//! answer, handshake bound, graceful drain), with the client's address handed to the handlers as
//! a [`ClientAddr`] request extension: a V1 mapping admits its requester's address.
//!
//! The library's server does not pass the peer address on; until it does, this is its loop with
//! that one addition.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::{Extension, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use k8s_reconcile::app::rest::{ApiLimits, ApiTransport};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::Layer as _;

/// The address of the API client a request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientAddr(pub SocketAddr);

/// The whole answer to a connection over the limit.
fn busy_answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `router` over `transport` on `listener` under `limits` until `shutdown`, each request
/// carrying its [`ClientAddr`]; then lets the requests in flight finish within
/// [`ApiLimits::drain_timeout`].
pub async fn serve_api<T: ApiTransport>(
    listener: TcpListener,
    router: Router,
    limits: ApiLimits,
    shutdown: CancellationToken,
    transport: T,
) {
    let transport = Arc::new(transport);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let busy = busy_answer(limits.busy_body);
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let http = Arc::new(http);
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of file descriptors, usually: pause rather than spin.
                tracing::warn!(error = %err, "accepting an API connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            if T::PLAIN {
                let _ = stream.try_write(&busy);
            }
            tracing::debug!(%peer, "API connection refused: too many connections");
            continue;
        };
        let watcher = graceful.watcher();
        let (transport, http) = (Arc::clone(&transport), Arc::clone(&http));
        let service = Extension(ClientAddr(peer)).layer(router.clone());
        let handshake_timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            let stream =
                match tokio::time::timeout(handshake_timeout, transport.handshake(stream)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(err)) => {
                        tracing::debug!(%peer, error = %err, "API handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "API handshake timed out");
                        return;
                    }
                };
            let connection = watcher.watch(
                http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service)),
            );
            if let Err(err) = connection.await {
                tracing::debug!(%peer, error = %err, "API connection closed");
            }
            drop(permit);
        });
    }
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(drain = ?limits.drain_timeout, "API connections still open after the drain time; closing them");
    }
}
