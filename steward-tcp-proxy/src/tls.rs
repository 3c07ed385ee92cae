//! TLS-termination mode: the original's optional mode, with its gaps closed.
//!
//! * The serving certificate is re-read when its files change (rotation without restart); a
//!   broken new pair is refused with an error log and the old one stays in use
//!   ([`ReloadingCert`], shared with pod-proxier through proxy-core).
//! * The upstream is verified against `--upstream-ca-file` (or the system roots) unless
//!   `--upstream-insecure` is given explicitly.
//! * ALPN is mirrored: the upstream is offered exactly what the client offered, and the client gets
//!   what the upstream chose, so HTTP/2 survives the hop.
//! * The TLS handshake is bounded by the connect timeout.
//!
//! Client certificates cannot pass a TLS-terminating hop; use passthrough (the default) for that.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use proxy_core::accept::{AcceptError, Accepted, StreamAcceptor};
use proxy_core::relay::{RelayConfig, Route};
use proxy_core::tls::AcceptAnyCert;
pub use proxy_core::tls::ReloadingCert;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::{LazyConfigAcceptor, TlsConnector};

/// Errors of the TLS set-up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        cause: std::io::Error,
    },
    /// A file's PEM text holds no usable certificate, key or trust root.
    #[error("{path}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        #[source]
        cause: proxy_core::tls::PemError,
    },
    /// rustls refused the configuration.
    #[error("rustls refused the TLS configuration")]
    Rustls(#[from] rustls::Error),
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|cause| TlsError::Read {
        path: path.to_owned(),
        cause,
    })
}

/// The client configuration of the upstream leg (ALPN is set per connection).
pub fn upstream_client_config(
    ca_file: Option<&Path>,
    insecure: bool,
) -> Result<rustls::ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    if insecure {
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert::new(provider)))
            .with_no_client_auth());
    }
    let roots = match ca_file {
        Some(path) => proxy_core::tls::trust_roots(Some(&read(path)?)),
        None => proxy_core::tls::trust_roots(None),
    }
    .map_err(|cause| TlsError::Pem {
        path: ca_file.map_or_else(|| PathBuf::from("system trust roots"), Path::to_owned),
        cause,
    })?;
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// The server configuration for one connection: our certificate, and the ALPN protocol the
/// upstream chose (if any).
pub fn server_config(
    cert: Arc<ReloadingCert>,
    alpn: Option<Vec<u8>>,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut config = ReloadingCert::server_config(&cert)?;
    config.alpn_protocols = alpn.into_iter().collect();
    Ok(config)
}

/// TLS termination as proxy-core's accept layer: client hello, upstream TLS with the client's ALPN
/// offer, our handshake with the upstream's choice; proxy-core then relays the two streams.
#[derive(Debug)]
pub struct TerminatingAcceptor {
    /// Our serving certificate.
    pub cert: Arc<ReloadingCert>,
    /// The upstream leg's client configuration (without ALPN).
    pub client: Arc<rustls::ClientConfig>,
    /// The server name to verify the upstream as.
    pub upstream_name: ServerName<'static>,
}

impl StreamAcceptor for TerminatingAcceptor {
    fn accept<'a>(
        &'a self,
        client: TcpStream,
        route: &'a Route,
        config: &'a RelayConfig,
    ) -> BoxFuture<'a, Result<Accepted, AcceptError>> {
        Box::pin(async move {
            fn handshake(
                stage: &str,
                cause: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
            ) -> AcceptError {
                AcceptError::Handshake {
                    stage: stage.to_owned(),
                    cause: cause.into(),
                }
            }
            let _ = client.set_nodelay(true);
            let start = LazyConfigAcceptor::new(rustls::server::Acceptor::default(), client)
                .await
                .map_err(|e| handshake("client hello", e))?;
            let offered: Vec<Vec<u8>> = start
                .client_hello()
                .alpn()
                .map(|protocols| protocols.map(<[u8]>::to_vec).collect())
                .unwrap_or_default();
            let upstream_tcp = route.upstream.connect(config.connect_timeout).await?;
            let _ = upstream_tcp.set_nodelay(true);
            let mut client_config = (*self.client).clone();
            client_config.alpn_protocols = offered;
            let upstream = TlsConnector::from(Arc::new(client_config))
                .connect(self.upstream_name.clone(), upstream_tcp)
                .await
                .map_err(|e| handshake("TLS to the upstream", e))?;
            let chosen = upstream.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
            let server = server_config(Arc::clone(&self.cert), chosen)
                .map_err(|e| handshake("server configuration", e))?;
            let client = start
                .into_stream(Arc::new(server))
                .await
                .map_err(|e| handshake("client handshake", e))?;
            Ok(Accepted {
                client: Box::new(client),
                upstream: Box::new(upstream),
            })
        })
    }
}
