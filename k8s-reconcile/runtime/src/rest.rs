//! What a binary's REST API needs besides its own handlers: a server that holds up against slow
//! and abusive clients ([`serve_api`], or [`serve_api_with`] over TLS or another
//! [`ApiTransport`]), strict query and form fields ([`Fields`]) and a request body read under a
//! size limit ([`read_body`]).
//!
//! The answers stay the binary's: these return errors it turns into its own response bodies.

use std::collections::BTreeSet;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::extract::rejection::BytesRejection;
use axum::{Extension, Router};
use http::StatusCode;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// The limits [`serve_api`] holds every client to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiLimits {
    /// A request's head (request line and headers) must arrive within this time, counted from
    /// the connection's start or, on a kept-alive connection, from the previous answer; else the
    /// connection is closed. This also closes idle kept-alive connections, and bounds a
    /// transport's handshake (TLS) the same way.
    pub header_read_timeout: Duration,
    /// Connections served at once, handshakes included. One more is answered `503` with
    /// `Retry-After` and closed at once, so a flood fails fast instead of queuing behind slow
    /// clients (over TLS it is closed without an answer: there is no session to answer in).
    pub max_connections: usize,
    /// The JSON body of that `503`, in the API's own error format.
    pub busy_body: &'static str,
    /// On shutdown, how long requests in flight may still take before their connections are
    /// closed.
    pub drain_timeout: Duration,
}

/// The whole answer to a connection over [`ApiLimits::max_connections`].
fn busy_answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         connection: close\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Binds `addr` now (so a taken port is reported at start) for [`serve_api`].
pub async fn bind_api(addr: SocketAddr) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|cause| Error::ApiBind { addr, cause })
}

/// How an accepted TCP connection becomes the stream HTTP is spoken over: [`PlainHttp`], or a
/// TLS handshake (the caller brings its own, e.g. a `tokio_rustls::TlsAcceptor` whose
/// configuration reloads its certificate).
///
/// A transport is its handshake; this one logs each connection and speaks plain HTTP, where a
/// TLS transport would return `tokio_rustls::TlsAcceptor::accept(tcp)` (tokio-rustls being a
/// dependency of the caller, not of this crate):
///
/// ```
/// use netkit_runtime::rest::ApiTransport;
/// use tokio::net::TcpStream;
///
/// struct Logged;
///
/// impl ApiTransport for Logged {
///     type Stream = TcpStream;
///     const PLAIN: bool = true;
///     async fn handshake(&self, tcp: TcpStream) -> std::io::Result<Self::Stream> {
///         eprintln!("API connection from {:?}", tcp.peer_addr());
///         Ok(tcp)
///     }
/// }
/// ```
pub trait ApiTransport: Send + Sync + 'static {
    /// The stream HTTP runs over.
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;

    /// Whether HTTP runs on the bare connection, so a connection over the limit can be sent the
    /// plain `503` answer.
    const PLAIN: bool = false;

    /// Runs the transport's handshake on a new connection. It holds one of
    /// [`ApiLimits::max_connections`] and is cut after [`ApiLimits::header_read_timeout`].
    fn handshake(&self, tcp: TcpStream) -> impl Future<Output = io::Result<Self::Stream>> + Send;
}

/// HTTP on the bare TCP connection, no handshake.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainHttp;

impl ApiTransport for PlainHttp {
    type Stream = TcpStream;
    const PLAIN: bool = true;

    async fn handshake(&self, tcp: TcpStream) -> io::Result<TcpStream> {
        Ok(tcp)
    }
}

/// Serves `router` over HTTP/1.1 on `listener` under `limits` until `shutdown`, then lets the
/// requests in flight finish within [`ApiLimits::drain_timeout`]. Plain HTTP: see
/// [`serve_api_with`] for TLS.
///
/// A request's own time limit is the router's business (it knows how to word the answer).
///
/// ```no_run
/// use std::time::Duration;
/// use netkit_runtime::rest::{ApiLimits, bind_api, serve_api};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let shutdown = k8s_reconcile::ops::shutdown_on_signals()?;
/// let listener = bind_api("127.0.0.1:8080".parse()?).await?;
/// let router = axum::Router::new().route("/", axum::routing::get(|| async { "hello\n" }));
/// let limits = ApiLimits {
///     header_read_timeout: Duration::from_secs(5),
///     max_connections: 512,
///     busy_body: r#"{"error":"too many connections; retry in a second"}"#,
///     drain_timeout: Duration::from_secs(10),
/// };
/// serve_api(listener, router, limits, shutdown).await;
/// # Ok(()) }
/// ```
pub async fn serve_api(
    listener: TcpListener,
    router: Router,
    limits: ApiLimits,
    shutdown: CancellationToken,
) {
    serve_api_with(listener, router, limits, shutdown, PlainHttp).await;
}

/// [`serve_api`] over `transport`: each accepted connection goes through its handshake (in its
/// own task, under the connection limit and the header timeout) before HTTP/1.1 is served on
/// the resulting stream. A failed or timed-out handshake closes the connection. Every request
/// carries its client's address: handlers extract it as
/// [`ConnectInfo<SocketAddr>`](axum::extract::ConnectInfo).
pub async fn serve_api_with<T: ApiTransport>(
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
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            if T::PLAIN {
                // A fresh socket's send buffer takes the short answer whole; if not, it just
                // closes.
                let _ = stream.try_write(&busy);
            }
            tracing::debug!(%peer, "API connection refused: too many connections");
            continue;
        };
        // Taken now, before the handshake, so a shutdown waits for (and then closes) this
        // connection too.
        let watcher = graceful.watcher();
        let (transport, http, router) = (Arc::clone(&transport), Arc::clone(&http), router.clone());
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
            // Handlers may ask who is calling (`ConnectInfo<SocketAddr>`), e.g. to bind what a
            // request creates to its client's address.
            let router = router.layer(Extension(ConnectInfo(peer)));
            let connection = watcher.watch(
                http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(router)),
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

/// Why query or form fields, or a request body, are refused. The parser's or axum's error is
/// also the `source()`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// Not `application/x-www-form-urlencoded` text.
    #[error("malformed {what}")]
    Malformed {
        /// `query` or `form`.
        what: String,
        /// The parser's error.
        source: serde_urlencoded::de::Error,
    },
    /// A field that is not expected.
    #[error("unknown {what} parameter {name:?}; expected {expected}")]
    Unknown {
        /// `query` or `form`.
        what: String,
        /// The field.
        name: String,
        /// The fields that are expected, comma-separated.
        expected: String,
    },
    /// A field given twice.
    #[error("{what} parameter {name:?} is given more than once")]
    Repeated {
        /// `query` or `form`.
        what: String,
        /// The field.
        name: String,
    },
    /// A field that must be `true` or `false`.
    #[error("{name} must be true or false, not {value:?}")]
    NotABool {
        /// The field.
        name: String,
        /// What was given.
        value: String,
    },
    /// The body is over the limit.
    #[error("request body is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body could not be read.
    #[error("cannot read the request body")]
    Unreadable {
        /// axum's rejection.
        source: BytesRejection,
    },
}

impl RequestError {
    /// The HTTP status to answer with: `413` for a body over the limit, else `400`.
    pub fn status(&self) -> StatusCode {
        match self {
            RequestError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// Query-string or form fields, each at most once and all among the expected names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fields(Vec<(String, String)>);

impl Fields {
    /// Parses `text` (`a=1&b=2`); `what` (`query`, `form`) names it in errors.
    pub fn parse(text: &str, allowed: &[&str], what: &str) -> Result<Self, RequestError> {
        let pairs: Vec<(String, String)> =
            serde_urlencoded::from_str(text).map_err(|source| RequestError::Malformed {
                what: what.to_owned(),
                source,
            })?;
        let mut seen = BTreeSet::new();
        for (name, _) in &pairs {
            if !allowed.contains(&name.as_str()) {
                return Err(RequestError::Unknown {
                    what: what.to_owned(),
                    name: name.clone(),
                    expected: allowed.join(", "),
                });
            }
            if !seen.insert(name.as_str()) {
                return Err(RequestError::Repeated {
                    what: what.to_owned(),
                    name: name.clone(),
                });
            }
        }
        Ok(Self(pairs))
    }

    /// The value of `name`, if given.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// `name` as a boolean (`true`/`1`, `false`/`0`), `false` when absent.
    pub fn flag(&self, name: &str) -> Result<bool, RequestError> {
        match self.get(name) {
            None | Some("false" | "0") => Ok(false),
            Some("true" | "1") => Ok(true),
            Some(other) => Err(RequestError::NotABool {
                name: name.to_owned(),
                value: other.to_owned(),
            }),
        }
    }
}

/// The body axum read under its `DefaultBodyLimit` of `limit` bytes, or why there is none.
pub fn read_body(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, RequestError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            RequestError::TooLarge { limit }
        } else {
            RequestError::Unreadable { source: rejection }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_strict() {
        let fields = Fields::parse("a=1&b=true", &["a", "b"], "query").unwrap();
        assert_eq!(fields.get("a"), Some("1"));
        assert!(fields.flag("b").unwrap());
        assert!(!fields.flag("c").unwrap());
        for (text, expected) in [
            ("c=1", "unknown query parameter \"c\"; expected a, b"),
            ("a=1&a=2", "query parameter \"a\" is given more than once"),
        ] {
            let err = Fields::parse(text, &["a", "b"], "query").unwrap_err();
            assert_eq!(err.to_string(), expected);
            assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        }
        let fields = Fields::parse("b=yes", &["b"], "form").unwrap();
        assert_eq!(
            fields.flag("b").unwrap_err().to_string(),
            "b must be true or false, not \"yes\""
        );
    }

    /// Everything the server sent until it closed the connection; panics if it is still open
    /// after 30 s (generous: the timeouts below are seconds).
    async fn read_all(stream: &mut tokio::net::TcpStream) -> String {
        use tokio::io::AsyncReadExt as _;
        let mut text = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut text));
        assert!(
            read.await.is_ok(),
            "the server kept the connection open for 30 s"
        );
        String::from_utf8_lossy(&text).into_owned()
    }

    #[tokio::test]
    async fn slow_clients_are_cut_and_a_full_server_says_so() {
        use tokio::io::AsyncWriteExt as _;
        use tokio::net::TcpStream;
        let listener = bind_api("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", axum::routing::get(|| async { "hello" }));
        let limits = ApiLimits {
            // Long enough that a busy machine still sends the third client while both slow ones
            // hold their slots.
            header_read_timeout: Duration::from_secs(3),
            max_connections: 2,
            busy_body: r#"{"error":"busy"}"#,
            drain_timeout: Duration::from_secs(1),
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_api(listener, router, limits, shutdown.clone()));
        let started = std::time::Instant::now();
        let mut slow = Vec::new();
        for _ in 0..2 {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(b"GET / HT").await.unwrap();
            slow.push(stream);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(read_all(&mut third).await.starts_with("HTTP/1.1 503"));
        for stream in &mut slow {
            assert!(!read_all(stream).await.contains("hello"));
            assert!(started.elapsed() >= Duration::from_secs(3));
        }
        let mut normal = TcpStream::connect(addr).await.unwrap();
        normal
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_all(&mut normal).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("hello"),
            "{answer}"
        );
        shutdown.cancel();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn handlers_see_their_clients_address() {
        use tokio::io::AsyncWriteExt as _;
        let listener = bind_api("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route(
            "/",
            axum::routing::get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                peer.to_string()
            }),
        );
        let limits = ApiLimits {
            header_read_timeout: Duration::from_secs(5),
            max_connections: 4,
            busy_body: r#"{"error":"busy"}"#,
            drain_timeout: Duration::from_secs(1),
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_api(listener, router, limits, shutdown.clone()));
        let mut client = TcpStream::connect(addr).await.unwrap();
        let me = client.local_addr().unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_all(&mut client).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with(&me.to_string()),
            "{answer}"
        );
        shutdown.cancel();
        server.await.unwrap();
    }

    /// A handshake of its own: the client first sends `hello\n`.
    struct Hello;

    impl ApiTransport for Hello {
        type Stream = tokio::net::TcpStream;
        async fn handshake(&self, mut tcp: TcpStream) -> io::Result<TcpStream> {
            use tokio::io::AsyncReadExt as _;
            let mut preface = [0u8; 6];
            tcp.read_exact(&mut preface).await?;
            if &preface != b"hello\n" {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "no hello"));
            }
            Ok(tcp)
        }
    }

    #[tokio::test]
    async fn a_transport_handshake_is_bounded_and_counted() {
        use tokio::io::AsyncWriteExt as _;
        let listener = bind_api("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", axum::routing::get(|| async { "hello" }));
        let limits = ApiLimits {
            header_read_timeout: Duration::from_secs(2),
            max_connections: 1,
            busy_body: r#"{"error":"busy"}"#,
            drain_timeout: Duration::from_secs(1),
        };
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_api_with(
            listener,
            router,
            limits,
            shutdown.clone(),
            Hello,
        ));
        // A client that never finishes its handshake holds the only slot, then is cut.
        let started = std::time::Instant::now();
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"hel").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // Over the limit, and not plain HTTP: closed without an answer.
        let mut over = TcpStream::connect(addr).await.unwrap();
        assert_eq!(read_all(&mut over).await, "");
        assert_eq!(read_all(&mut stalled).await, "");
        assert!(started.elapsed() >= Duration::from_secs(2));
        // A wrong handshake is closed; a right one is served.
        let mut wrong = TcpStream::connect(addr).await.unwrap();
        wrong.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        assert_eq!(read_all(&mut wrong).await, "");
        let mut right = TcpStream::connect(addr).await.unwrap();
        right
            .write_all(b"hello\nGET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let answer = read_all(&mut right).await;
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("hello"),
            "{answer}"
        );
        shutdown.cancel();
        server.await.unwrap();
    }

    #[test]
    fn the_busy_answer_is_well_formed() {
        let answer = busy_answer(r#"{"error":"busy"}"#);
        let text = std::str::from_utf8(&answer).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        serde_json::from_str::<serde_json::Value>(body).unwrap();
    }
}
