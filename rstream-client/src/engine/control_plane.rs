//! [`LocalControlPlane`]: a small HTTP server answering the control-plane resolve endpoint.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::Result;

use super::lock;

/// A recorded control-plane request: path and `Authorization` header.
pub type RecordedRequest = (String, Option<String>);

/// A minimal control plane on loopback (plain HTTP) answering
/// `GET /api/projects/tunnels/resolve/{endpoint}` with configured project JSON.
pub struct LocalControlPlane {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<RecordedRequest>>>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for LocalControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalControlPlane")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Builder of a [`LocalControlPlane`].
#[derive(Debug, Default)]
pub struct LocalControlPlaneBuilder {
    token: Option<String>,
    projects: HashMap<String, serde_json::Value>,
    redirects: HashMap<String, String>,
}

impl LocalControlPlaneBuilder {
    /// Requires `Authorization: Bearer <token>` (401 otherwise).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }
    /// Answers the endpoint with this project object.
    pub fn project(mut self, endpoint: impl Into<String>, project: serde_json::Value) -> Self {
        self.projects.insert(endpoint.into(), project);
        self
    }
    /// Answers the endpoint with `302 Found` to `location` (clients must not follow it).
    pub fn redirect(mut self, endpoint: impl Into<String>, location: impl Into<String>) -> Self {
        self.redirects.insert(endpoint.into(), location.into());
        self
    }

    /// Starts the server on `127.0.0.1:0`.
    pub async fn start(self) -> Result<LocalControlPlane> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let cp = LocalControlPlane {
            addr,
            requests: Arc::new(Mutex::new(Vec::new())),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
        };
        let config = Arc::new(self);
        let requests = cp.requests.clone();
        let shutdown = cp.shutdown.clone();
        let tracker = cp.tracker.clone();
        cp.tracker.spawn(async move {
            loop {
                let tcp = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = listener.accept() => match r { Ok((tcp, _)) => tcp, Err(_) => continue },
                };
                let config = config.clone();
                let requests = requests.clone();
                let shutdown = shutdown.clone();
                tracker.spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let response = answer(&config, &requests, &req);
                            async move { Ok::<_, std::convert::Infallible>(response) }
                        },
                    );
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service);
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        Ok(cp)
    }
}

fn answer(
    config: &LocalControlPlaneBuilder,
    requests: &Mutex<Vec<(String, Option<String>)>>,
    req: &http::Request<hyper::body::Incoming>,
) -> http::Response<Full<Bytes>> {
    let auth = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let path = req.uri().path().to_owned();
    lock(requests).push((path.clone(), auth.clone()));
    let respond = |status: u16, body: String| {
        let mut r = http::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() =
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
    };
    if let Some(token) = &config.token
        && auth.as_deref() != Some(format!("Bearer {token}").as_str())
    {
        return respond(401, r#"{"error":"unauthorized"}"#.into());
    }
    let Some(encoded) = path.strip_prefix("/api/projects/tunnels/resolve/") else {
        return respond(404, r#"{"error":"not found"}"#.into());
    };
    let endpoint = percent_decode(encoded);
    if let Some(location) = config.redirects.get(&endpoint) {
        let mut r = respond(302, String::new());
        if let Ok(v) = http::HeaderValue::from_str(location) {
            r.headers_mut().insert(http::header::LOCATION, v);
        }
        return r;
    }
    match config.projects.get(&endpoint) {
        Some(project) => respond(200, project.to_string()),
        None => respond(404, r#"{"error":"project not found"}"#.into()),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl LocalControlPlane {
    /// A builder.
    pub fn builder() -> LocalControlPlaneBuilder {
        LocalControlPlaneBuilder::default()
    }

    /// The API URL (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received: path and `Authorization` header.
    pub fn requests(&self) -> Vec<(String, Option<String>)> {
        lock(&self.requests).clone()
    }

    /// Stops the server.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}
