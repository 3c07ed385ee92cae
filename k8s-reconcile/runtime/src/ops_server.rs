//! The operations HTTP server a binary's [`App`](super::App) runs: `/healthz`, `/livez` and
//! `/readyz` from a [`Health`], `/metrics` from a registry, open or behind token and access
//! reviews, over plain HTTP or TLS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::rest::{ApiLimits, ApiTransport, serve_api_with};
use crate::Error;
use k8s_reconcile::auth::{AuthError, Authenticator};
use k8s_reconcile::ops::Health;

#[derive(Clone)]
struct MetricsState {
    registry: Arc<Registry>,
    guard: Option<Arc<Authenticator>>,
}

/// A router with `/healthz`, `/readyz` and `/metrics`, all open.
pub fn router(health: Health, registry: Arc<Registry>) -> Router {
    health_router(health).merge(metrics_router(registry, None))
}

/// A router with `/healthz`, `/livez` and `/readyz`, open to anyone (the kubelet's probes
/// carry no token).
pub fn health_router(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// A router with `/metrics`. With a `guard`, a scrape needs a bearer token the API server
/// accepts (`401` otherwise) whose user may `get` the non-resource URL `/metrics` (`403`
/// otherwise; `503` when the API server cannot be asked). Serve a guarded router over TLS
/// ([`serve_tls`]), or the scraper's token crosses the network in the clear.
pub fn metrics_router(registry: Arc<Registry>, guard: Option<Arc<Authenticator>>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(MetricsState { registry, guard })
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    let checks = health.checks();
    let mut body = String::new();
    for (name, check) in &checks {
        let mark = if check.ok { "+" } else { "-" };
        body.push_str(&format!("[{mark}] {name}: {}\n", check.detail));
    }
    if checks.values().all(|c| c.ok) {
        body.push_str("ready\n");
        (StatusCode::OK, body)
    } else {
        body.push_str("not ready\n");
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// The answer to a scrape `guard` does not let in, if it does not.
async fn refusal(guard: &Authenticator, headers: &HeaderMap) -> Option<Response> {
    let unavailable = |error: AuthError| {
        tracing::warn!(error = %super::error_chain(&error), "cannot check a /metrics scrape");
        (StatusCode::SERVICE_UNAVAILABLE, format!("{error}\n")).into_response()
    };
    let caller = match guard.authenticate(headers).await {
        Ok(caller) => caller,
        Err(error @ AuthError::Unavailable(_)) => return Some(unavailable(error)),
        Err(error) => {
            return Some(
                (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    format!("{error}\n"),
                )
                    .into_response(),
            );
        }
    };
    match guard.allowed_path(&caller, "get", "/metrics").await {
        Ok(true) => None,
        Ok(false) => Some(
            (
                StatusCode::FORBIDDEN,
                format!("{} may not get /metrics\n", caller.username()),
            )
                .into_response(),
        ),
        Err(error) => Some(unavailable(error)),
    }
}

async fn metrics(State(state): State<MetricsState>, headers: HeaderMap) -> Response {
    if let Some(guard) = &state.guard
        && let Some(refusal) = refusal(guard, &headers).await
    {
        return refusal;
    }
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        ),
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            err.to_string(),
        ),
    }
    .into_response()
}

/// Binds `addr` now (so a taken port is reported at start) and serves `router` until `shutdown`.
/// `[::]` (what `:port` parses to) is dual-stack, as [`proxy_core::socket::bind_listener`] says.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = proxy_core::socket::bind_listener(addr, 1024)
        .map_err(|cause| Error::Serve { addr, cause })?;
    let handle = tokio::spawn(async move {
        let result = axum::serve(listener, router)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(err) = result {
            tracing::error!(%addr, error = %err, "operations server failed");
        }
    });
    Ok(handle)
}

/// The TLS handshake of the operations server.
struct Tls(tokio_rustls::TlsAcceptor);

impl ApiTransport for Tls {
    type Stream = tokio_rustls::server::TlsStream<TcpStream>;

    async fn handshake(&self, tcp: TcpStream) -> std::io::Result<Self::Stream> {
        self.0.accept(tcp).await
    }
}

/// As [`serve`], over TLS with `tls` (a scraper's bearer token must not cross the network in
/// the clear), and bounded as a binary's REST API is: a client has ten seconds for its
/// handshake and its request's headers, and at most 64 connections are open at once.
pub async fn serve_tls(
    addr: SocketAddr,
    router: Router,
    tls: Arc<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = proxy_core::socket::bind_listener(addr, 1024)
        .map_err(|cause| Error::Serve { addr, cause })?;
    let limits = ApiLimits {
        header_read_timeout: Duration::from_secs(10),
        max_connections: 64,
        busy_body: "",
        drain_timeout: Duration::from_secs(5),
    };
    let transport = Tls(tokio_rustls::TlsAcceptor::from(tls));
    Ok(tokio::spawn(serve_api_with(
        listener, router, limits, shutdown, transport,
    )))
}
