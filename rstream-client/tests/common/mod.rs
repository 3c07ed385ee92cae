#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use rstream_client::engine::LocalEngine;
use rstream_client::{Client, ClientBuilder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const TOKEN: &str = "test-token";

pub async fn engine() -> LocalEngine {
    LocalEngine::builder().token(TOKEN).start().await.unwrap()
}

pub fn builder(engine: &LocalEngine) -> ClientBuilder {
    Client::builder()
        .engine(engine.engine_address())
        .token(TOKEN)
        .tls(engine.client_tls())
        .operation_timeout(Duration::from_secs(5))
        .connect_timeout(Duration::from_secs(5))
}

pub fn client(engine: &LocalEngine) -> Client {
    builder(engine).build().unwrap()
}

/// A TCP echo server; returns its address.
pub async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    addr
}

/// A minimal HTTP/1.1 server answering every request with `body`.
pub async fn http_server(body: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(response.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

pub fn random_bytes(n: usize) -> Vec<u8> {
    (0..n).map(|_| rand::random::<u8>()).collect()
}

/// Sends `data` over a fresh connection to `addr`, half-closes, and returns everything read back.
pub async fn roundtrip(addr: SocketAddr, data: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (mut r, mut w) = s.split();
    let data = data.to_vec();
    let write = async move {
        w.write_all(&data).await.unwrap();
        w.shutdown().await.unwrap();
    };
    let mut out = Vec::new();
    let read = r.read_to_end(&mut out);
    let (_, n) = tokio::join!(write, read);
    n.unwrap();
    out
}

pub async fn within<T>(secs: u64, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), fut)
        .await
        .expect("timed out")
}

/// Polls `cond` every 20 ms for up to `secs` seconds.
pub async fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}
