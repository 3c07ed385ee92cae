#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::Duration;

use rstream_client::engine::LocalEngine;
use rstream_client::{Client, ClientBuilder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
    proxy_core::testing::echo_server().await.unwrap()
}

/// A minimal HTTP/1.1 server answering every request with `body`.
pub async fn http_server(body: &'static str) -> SocketAddr {
    proxy_core::testing::http_server([127, 0, 0, 1].into(), body)
        .await
        .unwrap()
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
