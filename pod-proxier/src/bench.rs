//! Measurement helpers, for `cargo xtask bench pod-proxier` and tests.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Talking to the API or the entry port failed.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The API refused the mapping.
    #[error("the API answered {status}: {body}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The body.
        body: String,
    },
    /// No byte arrived through the entry port in time.
    #[error("no byte through the entry port within {0:?}")]
    Timeout(Duration),
}

/// Time from sending `POST /api/v1/mapping` for `pod_name` until the first byte from the pod
/// arrives through `entry` (the pod must speak first, e.g. a banner). Polls the entry port every
/// millisecond after the API answered.
pub async fn post_to_first_byte(
    api: SocketAddr,
    entry: SocketAddr,
    token: Option<&str>,
    pod_name: &str,
    ttl_seconds: u64,
    timeout: Duration,
) -> Result<Duration, BenchError> {
    let started = Instant::now();
    let body = serde_json::json!({"pod_name": pod_name, "time": ttl_seconds}).to_string();
    let mut request = format!(
        "POST /api/v1/mapping HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    let mut stream = TcpStream::connect(api).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(timeout, stream.read_to_end(&mut answer))
        .await
        .map_err(|_| BenchError::Timeout(timeout))??;
    let text = String::from_utf8_lossy(&answer);
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if status != 200 {
        return Err(BenchError::Refused {
            status,
            body: text.into_owned(),
        });
    }
    let deadline = started + timeout;
    while Instant::now() < deadline {
        if let Ok(mut conn) = TcpStream::connect(entry).await {
            let mut byte = [0u8; 1];
            if let Ok(Ok(1)) =
                tokio::time::timeout(Duration::from_millis(200), conn.read(&mut byte)).await
            {
                return Ok(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Err(BenchError::Timeout(timeout))
}
