//! Loopback plumbing: free ports, a tiny HTTP server posing as a workload, a tiny HTTP client and
//! readiness probes.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// How long one HTTP exchange may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);

/// A free port on 127.0.0.1, as a socket address (the small race with other programs is accepted,
/// as the tests do).
pub fn free_addr() -> anyhow::Result<SocketAddr> {
    proxy_core::testing::free_addr().context("finding a free port on 127.0.0.1")
}

/// An HTTP/1.1 server on `ip` (any port) answering every request with `body`; it lives as long as
/// the runtime.
pub async fn http_server(ip: IpAddr, body: String) -> anyhow::Result<SocketAddr> {
    proxy_core::testing::http_server(ip, body)
        .await
        .with_context(|| format!("binding a demo server on {ip}"))
}

/// An HTTP response: the status line and the body.
pub struct Response {
    pub status_line: String,
    pub status: u16,
    pub body: String,
}

/// One HTTP/1.1 request over a fresh connection, bounded in time.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    json_body: Option<&serde_json::Value>,
) -> anyhow::Result<Response> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        let body = json_body.map(ToString::to_string).unwrap_or_default();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if json_body.is_some() {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        anyhow::Ok(String::from_utf8_lossy(&raw).into_owned())
    };
    let text = tokio::time::timeout(EXCHANGE_TIMEOUT, exchange)
        .await
        .with_context(|| format!("no answer from {addr} within {EXCHANGE_TIMEOUT:?}"))?
        .with_context(|| format!("{method} http://{addr}{path}"))?;
    parse_response(&text).with_context(|| format!("{method} http://{addr}{path}"))
}

fn parse_response(text: &str) -> anyhow::Result<Response> {
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let status_line = head.lines().next().unwrap_or_default().to_owned();
    let Some(status) = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
    else {
        bail!("not an HTTP response: {text:?}");
    };
    Ok(Response {
        status_line,
        status,
        body: body.to_owned(),
    })
}

/// Whether `GET http://addr/path` answers 200.
pub async fn answers_ok(addr: SocketAddr, path: &str) -> bool {
    http(addr, "GET", path, None)
        .await
        .is_ok_and(|response| response.status == 200)
}
