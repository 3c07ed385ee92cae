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
    netkit_testenv::fixtures::echo_server().await.unwrap()
}

/// A minimal HTTP/1.1 server answering every request with `body`.
pub async fn http_server(body: &'static str) -> SocketAddr {
    netkit_testenv::fixtures::http_server([127, 0, 0, 1].into(), body)
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

/// The shortest deadline of [`within`] and [`eventually`]: a correctness test waits for the
/// state, and a slow or busy machine must not fail it (latency figures live in `cargo xtask
/// bench`).
pub const MIN_DEADLINE_SECS: u64 = 30;

/// Awaits `fut`, panicking if it takes longer than `secs` seconds (at least
/// [`MIN_DEADLINE_SECS`]); a wait longer than `secs` is reported on stderr.
pub async fn within<T>(secs: u64, fut: impl std::future::Future<Output = T>) -> T {
    let started = tokio::time::Instant::now();
    let deadline = Duration::from_secs(secs.max(MIN_DEADLINE_SECS));
    let out = tokio::time::timeout(deadline, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out after {deadline:?}"));
    if started.elapsed() > Duration::from_secs(secs) {
        eprintln!(
            "slow: took {:?}, expected within {secs} s",
            started.elapsed()
        );
    }
    out
}

/// Polls `cond` every 20 ms for up to `secs` seconds (at least [`MIN_DEADLINE_SECS`]).
pub async fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs.max(MIN_DEADLINE_SECS));
    while tokio::time::Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cond()
}
