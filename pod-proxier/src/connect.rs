//! `pod-proxier connect`: forwards a local port to a pod through pod-proxier, like `kubectl
//! port-forward`. It maps the pod through the API (HTTPS with `--ca-file`, a bearer token),
//! re-posts the mapping before its TTL ends while it runs, relays every local connection to the
//! mapping's entry port, and deletes the mapping on Ctrl-C or SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Uri};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Flags of `pod-proxier connect`.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectArgs {
    /// The pod to reach, as NAMESPACE/POD.
    pub pod: String,
    /// pod-proxier's API URL: https, its host and port (the chart's NOTES print it).
    #[arg(long, env = "POD_PROXIER_SERVER")]
    pub server: String,
    /// PEM CA certificate that signed the API's certificate; without it, the system's roots.
    #[arg(long, env = "POD_PROXIER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Bearer token (e.g. `kubectl create token my-sa`); prefer --token-file.
    #[arg(long, env = "POD_PROXIER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// File holding the bearer token (e.g. a projected ServiceAccount token).
    #[arg(long, env = "POD_PROXIER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Local address to listen on; port 0 picks a free port (printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub local: SocketAddr,
    /// Host of the entry ports; default: the host of --server.
    #[arg(long)]
    pub entry_host: Option<String>,
    /// TTL of the mapping in seconds; it is renewed at a third of it while running.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(3..))]
    pub ttl: u64,
}

/// Why `connect` stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// A flag or file is unusable.
    #[error("{0}")]
    Usage(String),
    /// The API could not be reached.
    #[error("pod-proxier API at {server}: {message}")]
    Api {
        /// --server.
        server: String,
        /// What failed.
        message: String,
    },
    /// The API answered with an error.
    #[error("pod-proxier refused {what}: HTTP {status}: {body}")]
    Refused {
        /// The call.
        what: String,
        /// The HTTP status.
        status: u16,
        /// The answer.
        body: String,
    },
    /// The local port.
    #[error("cannot use the local port {addr}")]
    Local {
        /// --local.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The API as `connect` calls it.
struct ApiClient {
    server: Uri,
    authority: String,
    host: String,
    token: Option<String>,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl ApiClient {
    fn new(args: &ConnectArgs) -> Result<Self, ConnectError> {
        let usage = ConnectError::Usage;
        let server: Uri = args
            .server
            .parse()
            .map_err(|e| usage(format!("--server {:?}: {e}", args.server)))?;
        let https = match server.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(usage(
                    "--server must start with https:// (or http://)".into(),
                ));
            }
        };
        let host = server
            .host()
            .ok_or_else(|| usage(format!("--server {:?} has no host", args.server)))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = server.port_u16().unwrap_or(if https { 443 } else { 80 });
        let authority = match host.contains(':') {
            true => format!("[{host}]:{port}"),
            false => format!("{host}:{port}"),
        };
        let token = match (&args.token, &args.token_file) {
            (Some(_), Some(_)) => {
                return Err(usage("give --token or --token-file, not both".into()));
            }
            (Some(token), None) => Some(token.trim().to_owned()),
            (None, Some(path)) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| usage(format!("--token-file {}: {e}", path.display())))?
                    .trim()
                    .to_owned(),
            ),
            (None, None) => None,
        };
        let tls = match https {
            false => None,
            true => {
                let ca = match &args.ca_file {
                    Some(path) => Some(
                        std::fs::read(path)
                            .map_err(|e| usage(format!("--ca-file {}: {e}", path.display())))?,
                    ),
                    None => None,
                };
                let roots = proxy_core::tls::trust_roots(ca.as_deref())
                    .map_err(|e| usage(format!("--ca-file: {e}")))?;
                let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| usage(format!("TLS: {e}")))?
                .with_root_certificates(roots)
                .with_no_client_auth();
                Some(tokio_rustls::TlsConnector::from(Arc::new(config)))
            }
        };
        Ok(Self {
            server,
            authority,
            host,
            token,
            tls,
        })
    }

    fn failed(&self, message: impl ToString) -> ConnectError {
        ConnectError::Api {
            server: self.server.to_string(),
            message: message.to_string(),
        }
    }

    /// One request over a fresh connection; the answer's status and JSON.
    async fn call(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value), ConnectError> {
        let tcp = TcpStream::connect(&self.authority)
            .await
            .map_err(|e| self.failed(e))?;
        let mut request = Request::builder()
            .method(method)
            .uri(path_and_query)
            .header(http::header::HOST, &self.authority);
        if let Some(token) = &self.token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let body = match body {
            Some(body) => {
                request = request.header(http::header::CONTENT_TYPE, "application/json");
                body.to_string()
            }
            None => String::new(),
        };
        let request = request
            .body(Full::new(bytes_from(body)))
            .map_err(|e| self.failed(e))?;
        let response = match &self.tls {
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| self.failed(e))?;
                let stream = tls.connect(name, tcp).await.map_err(|e| self.failed(e))?;
                send(TokioIo::new(stream), request).await
            }
            None => send(TokioIo::new(tcp), request).await,
        }
        .map_err(|e| self.failed(e))?;
        let (status, bytes) = response;
        let value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        Ok((status, value))
    }
}

fn bytes_from(text: String) -> hyper::body::Bytes {
    hyper::body::Bytes::from(text)
}

/// Sends `request` on `io` (HTTP/1.1) and reads the whole answer.
async fn send<I>(
    io: I,
    request: Request<Full<hyper::body::Bytes>>,
) -> Result<(u16, Vec<u8>), String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    use http_body_util::BodyExt as _;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body.to_vec()))
}

/// Runs `connect` until Ctrl-C/SIGTERM (`stop`), then deletes the mapping.
pub async fn run(args: ConnectArgs, stop: CancellationToken) -> Result<(), ConnectError> {
    let (namespace, pod) = crate::names::parse_pod_name(&args.pod)
        .map_err(|e| ConnectError::Usage(format!("{:?}: {e}", args.pod)))?;
    let pod_name = format!("{namespace}/{pod}");
    let api = ApiClient::new(&args)?;
    let listener = TcpListener::bind(args.local)
        .await
        .map_err(|source| ConnectError::Local {
            addr: args.local,
            source,
        })?;
    let local = listener
        .local_addr()
        .map_err(|source| ConnectError::Local {
            addr: args.local,
            source,
        })?;
    let body = json!({"pod_name": pod_name, "time": args.ttl});
    let post = || api.call(Method::POST, "/api/v1/mapping", Some(body.clone()));
    let (status, answer) = post().await?;
    if status != 200 {
        return Err(ConnectError::Refused {
            what: format!("mapping {pod_name}"),
            status,
            body: answer.to_string(),
        });
    }
    let entry_port = answer["data"]["entry_port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| api.failed(format!("answer without entry_port: {answer}")))?;
    let entry_host = args.entry_host.clone().unwrap_or_else(|| api.host.clone());
    let entry = match entry_host.contains(':') {
        true => format!("[{entry_host}]:{entry_port}"),
        false => format!("{entry_host}:{entry_port}"),
    };
    println!("Forwarding from {local} -> {pod_name} (entry {entry}); Ctrl-C to stop");
    let renew_every = Duration::from_secs(args.ttl / 3);
    let mut renew =
        tokio::time::interval_at(tokio::time::Instant::now() + renew_every, renew_every);
    let mut outcome = Ok(());
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = renew.tick() => match post().await {
                Ok((200, answer)) if answer["data"]["entry_port"].as_u64() == Some(u64::from(entry_port)) => {
                    tracing::debug!(%pod_name, "mapping renewed");
                }
                // Busy or raced: retried at the next tick, well within the TTL.
                Ok((status @ (409 | 502 | 503), answer)) => {
                    tracing::warn!(status, %answer, "renewing the mapping failed; retrying");
                }
                Ok((status, answer)) => {
                    outcome = Err(ConnectError::Refused { what: format!("renewing {pod_name}"), status, body: answer.to_string() });
                    break;
                }
                // Retried at the next tick, well within the TTL.
                Err(err) => tracing::warn!(error = %err, "renewing the mapping failed; retrying"),
            },
            accepted = listener.accept() => match accepted {
                Ok((client, peer)) => {
                    let entry = entry.clone();
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        match TcpStream::connect(&entry).await {
                            Ok(mut upstream) => {
                                let mut client = client;
                                tokio::select! {
                                    _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                                    () = stop.cancelled() => {}
                                }
                            }
                            Err(err) => tracing::warn!(%peer, %entry, error = %err, "cannot reach the entry port"),
                        }
                    });
                }
                Err(err) => tracing::warn!(error = %err, "accepting a local connection"),
            },
        }
    }
    let path = format!("/api/v1/mapping?pod_name={pod_name}");
    match api.call(Method::DELETE, &path, None).await {
        Ok((200 | 404, _)) => println!("mapping of {pod_name} deleted"),
        Ok((status, answer)) => {
            eprintln!("deleting the mapping of {pod_name}: HTTP {status}: {answer}");
        }
        Err(err) => eprintln!("deleting the mapping of {pod_name}: {err}"),
    }
    outcome
}
