//! Clients of what pod-proxier serves: its REST API (HTTP/1.0, over TLS with the chart's CA) and
//! TCP echo probes through its entry ports. Used by pod-proxier's scenarios, the partition
//! scenario and the demo.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How [`http()`] reaches the chart's API: TLS verified with the chart's CA, the Service's DNS
/// name as the server name (the address dialled is the ClusterIP). Set by pod-proxier's `install`.
pub(crate) static API_TLS: RwLock<Option<ApiTls>> = RwLock::new(None);

/// A TLS client of the API.
#[derive(Clone)]
pub struct ApiTls {
    config: Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
}

/// A client trusting only `ca_pem`, verifying the server as `name`.
pub fn api_tls(ca_pem: &[u8], name: &str) -> anyhow::Result<ApiTls> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(cert.context("the CA is not PEM")?)?;
    }
    if roots.is_empty() {
        bail!("no certificate in the CA bundle");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(ApiTls {
        config: Arc::new(config),
        name: rustls::pki_types::ServerName::try_from(name.to_owned())?,
    })
}

/// One HTTP/1.0 request to the chart's API (over TLS with the chart's CA once pod-proxier's
/// `install` read it); returns the status and the JSON body. Retries connection errors for a few seconds (a
/// Service whose only Pod is being replaced).
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    http_within(addr, method, path, token, body, Duration::from_secs(10)).await
}

/// [`http()`], waiting up to `limit` for the whole answer.
pub async fn http_within(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    limit: Duration,
) -> anyhow::Result<(u16, Value)> {
    let tls = API_TLS.read().unwrap_or_else(|p| p.into_inner()).clone();
    exchange(addr, method, path, token, body, limit, tls).await
}

/// One HTTP/1.0 request, over TLS with `tls`, else plain.
pub(crate) async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
    limit: Duration,
    tls: Option<ApiTls>,
) -> anyhow::Result<(u16, Value)> {
    let mut request = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(body) = body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    let text = match tls {
        None => {
            let exchange = async {
                let mut stream = tokio::net::TcpStream::connect(addr).await?;
                stream.write_all(request.as_bytes()).await?;
                let mut response = Vec::new();
                stream.read_to_end(&mut response).await?;
                anyhow::Ok(String::from_utf8_lossy(&response).into_owned())
            };
            tokio::time::timeout(limit, exchange)
                .await
                .context("timed out")??
        }
        // rustls on a blocking socket (xtask has no tokio-rustls): a few small requests.
        Some(tls) => tokio::task::spawn_blocking(move || {
            super::tls_exchange(addr, &request, limit, tls.config, tls.name)
        })
        .await
        .context("the TLS request's thread")??,
    };
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// Sends `len` bytes to a TCP echo server at `addr` and checks they come back intact.
pub async fn tcp_echo(addr: SocketAddr, len: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        echo_on(stream, len).await
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .context("timed out")??;
    Ok(started.elapsed())
}

/// Sends `len` bytes on `stream` (an echo) and checks they come back intact (within 10 s).
async fn echo_on(stream: tokio::net::TcpStream, len: usize) -> anyhow::Result<()> {
    let exchange = async {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let (mut read, mut write) = stream.into_split();
        let writer = tokio::spawn(async move {
            write.write_all(&data).await?;
            write.shutdown().await?;
            anyhow::Ok(data)
        });
        let mut back = Vec::new();
        read.read_to_end(&mut back).await?;
        let data = writer.await??;
        if back != data {
            bail!("{} bytes back of {len}, not identical", back.len());
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .context("timed out")?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS server for `name` on loopback answering each connection `HTTP/1.0 200`, on a thread
    /// (rustls on blocking sockets, as the client); returns its address and its CA.
    #[allow(clippy::unwrap_used)]
    fn tls_server(name: &str) -> (SocketAddr, String) {
        let mut ca = rcgen::CertificateParams::default();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let config = Arc::new(config);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            use std::io::{Read as _, Write as _};
            for tcp in listener.incoming().flatten() {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
                let connection = rustls::ServerConnection::new(Arc::clone(&config)).unwrap();
                let mut stream = rustls::StreamOwned::new(connection, tcp);
                let mut head = [0u8; 16];
                if stream.read(&mut head).is_ok() {
                    let _ = stream.write_all(b"HTTP/1.0 200 OK\r\n\r\n{}");
                    stream.conn.send_close_notify();
                    let _ = stream.flush();
                }
            }
        });
        (addr, ca_pem)
    }

    #[tokio::test]
    #[allow(clippy::unwrap_used)]
    async fn the_api_client_trusts_only_the_given_ca() {
        let name = "pod-proxier.ns.svc";
        let (addr, ca) = tls_server(name);
        let trusted = api_tls(ca.as_bytes(), name).unwrap();
        let limit = Duration::from_secs(10);
        let (status, _) = exchange(addr, "GET", "/health", None, None, limit, Some(trusted))
            .await
            .unwrap();
        assert_eq!(status, 200);
        let (_, other_ca) = tls_server(name);
        let other = api_tls(other_ca.as_bytes(), name).unwrap();
        let err = exchange(addr, "GET", "/health", None, None, limit, Some(other))
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("certificate"), "{err:#}");
        assert!(
            exchange(addr, "GET", "/health", None, None, limit, None)
                .await
                .is_err()
        );
    }
}
