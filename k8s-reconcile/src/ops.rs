//! Operations endpoints every binary serves: `/healthz`, `/readyz`, `/metrics`; and shutdown on
//! SIGTERM.
//!
//! [`Health`] is a set of named readiness checks (e.g. `informers-synced`, `leadership`,
//! `upstream`); `/readyz` answers 200 only while all pass and lists each with its detail, so an
//! operator sees *why* a pod is not ready. `/healthz` answers 200 while the process serves at all.
//! The server itself ([`router`], [`serve`]) comes with the `app` feature; [`Health`] and
//! [`shutdown_on_signals`] need nothing beyond tokio. With it also come [`health_router`] (open
//! to anyone, as the kubelet's probes carry no token), [`metrics_router`] (optionally behind a
//! TokenReview and a SubjectAccessReview) and [`serve_tls`].

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use tokio_util::sync::CancellationToken;

use crate::Error;
#[cfg(feature = "app")]
#[cfg_attr(docsrs, doc(cfg(feature = "app")))]
pub use server::{health_router, metrics_router, router, serve, serve_tls};

/// One readiness check's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Whether it passes.
    pub ok: bool,
    /// Why (shown by `/readyz`).
    pub detail: String,
}

/// Named readiness checks, shared between the parts of a binary.
///
/// [`Health::scoped`] gives a part its own names (`tunnels/leadership`) in the same set, so
/// `/readyz` sees every part's checks at once.
#[derive(Debug, Clone, Default)]
pub struct Health {
    checks: Arc<RwLock<BTreeMap<String, Check>>>,
    /// Prefix of this view's names, `""` or ending in `/`.
    scope: Arc<str>,
}

impl Health {
    /// An empty set (ready until a check is added).
    pub fn new() -> Self {
        Self::default()
    }

    /// A view of the same set whose checks are named `<prefix>/<name>`; its [`Health::ready`],
    /// [`Health::checks`] and [`Health::check`] see only those (under their short names).
    #[must_use]
    pub fn scoped(&self, prefix: &str) -> Self {
        Self {
            checks: Arc::clone(&self.checks),
            scope: format!("{}{prefix}/", self.scope).into(),
        }
    }

    /// Sets the state of check `name`.
    pub fn set(&self, name: &str, ok: bool, detail: impl Into<String>) {
        if let Ok(mut checks) = self.checks.write() {
            checks.insert(
                format!("{}{name}", self.scope),
                Check {
                    ok,
                    detail: detail.into(),
                },
            );
        }
    }

    /// Whether every check (of this view) passes.
    pub fn ready(&self) -> bool {
        self.checks
            .read()
            .map(|c| {
                c.iter()
                    .filter(|(name, _)| name.starts_with(&*self.scope))
                    .all(|(_, check)| check.ok)
            })
            .unwrap_or(false)
    }

    /// A copy of every check (of this view).
    pub fn checks(&self) -> BTreeMap<String, Check> {
        let Ok(checks) = self.checks.read() else {
            return BTreeMap::new();
        };
        checks
            .iter()
            .filter_map(|(name, check)| {
                let short = name.strip_prefix(&*self.scope)?;
                Some((short.to_owned(), check.clone()))
            })
            .collect()
    }

    /// The state of one check.
    pub fn check(&self, name: &str) -> Option<Check> {
        let key = format!("{}{name}", self.scope);
        self.checks.read().ok()?.get(&key).cloned()
    }
}

/// A token cancelled on the first SIGTERM or SIGINT.
pub fn shutdown_on_signals() -> Result<CancellationToken, Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate()).map_err(Error::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(Error::Signal)?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        cancel.cancel();
    });
    Ok(token)
}

/// The operations HTTP server (feature `app`).
#[cfg(feature = "app")]
mod server {
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

    use super::Health;
    use crate::Error;
    use crate::app::rest::{ApiLimits, ApiTransport, serve_api_with};
    use crate::auth::{AuthError, Authenticator};

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
            tracing::warn!(error = %crate::app::error_chain(&error), "cannot check a /metrics scrape");
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_check_passes() {
        let health = Health::new();
        assert!(health.ready());
        health.set("informers-synced", false, "waiting");
        health.set("leadership", true, "leader");
        assert!(!health.ready());
        health.set("informers-synced", true, "synced");
        assert!(health.ready());
        assert_eq!(
            health.check("leadership").map(|c| c.detail),
            Some("leader".to_owned())
        );
    }

    #[test]
    fn a_scoped_view_names_its_checks_and_the_whole_set_sees_them() {
        let health = Health::new();
        let tunnels = health.scoped("tunnels");
        tunnels.set("leadership", false, "follower");
        health.set("upstream", true, "dialable");
        assert!(!tunnels.ready());
        assert!(!health.ready());
        assert_eq!(
            health.check("tunnels/leadership").map(|c| c.detail),
            Some("follower".to_owned())
        );
        assert_eq!(
            tunnels.checks().keys().collect::<Vec<_>>(),
            ["leadership"],
            "a view sees only its own checks"
        );
        let other = health.scoped("connections");
        assert!(other.ready(), "an empty view is ready");
        tunnels.set("leadership", true, "leader");
        assert!(health.ready());
    }
}
