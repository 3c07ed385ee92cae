//! After 10 000 relayed connections the process holds as many descriptors as before: no
//! socket or pipe leaks, on either copy path. In its own test binary, since it counts the
//! descriptors of the whole process.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proxy_core::copy::CopyMode;
use proxy_core::relay::{Ending, RelayConfig, Route};
use proxy_core::server::{ListenerConfig, ProxyServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

async fn one_exchange(addr: std::net::SocketAddr) {
    let mut client = TcpStream::connect(addr).await.unwrap();
    client.write_all(b"0123456789abcdef").await.unwrap();
    client.shutdown().await.unwrap();
    let mut back = Vec::new();
    client.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"0123456789abcdef");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_connections_leave_no_descriptor_behind() {
    raise_fd_limit();
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = ProxyServer::new(server_config(), observer.clone()).unwrap();
    let mut listeners = Vec::new();
    for mode in [CopyMode::Splice, CopyMode::Buffered] {
        let relay = RelayConfig::default().with_copy_mode(mode);
        let config = ListenerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            Route::new("echo", echo.addr),
        )
        .with_relay(relay);
        listeners.push(server.add_listener(config).unwrap());
    }
    // Warm up both paths so lazily created runtime resources exist before the baseline.
    for addr in &listeners {
        one_exchange(*addr).await;
    }
    eventually(Duration::from_secs(30), "warm-up closed", || {
        CountingObserver::get(&observer.closed) == 2
    })
    .await;
    let baseline = open_fds();

    const TOTAL: usize = 10_000;
    const WAVE: usize = 250;
    for wave in 0..TOTAL / WAVE {
        let exchanges: Vec<_> = (0..WAVE)
            .map(|i| tokio::spawn(one_exchange(listeners[(wave * WAVE + i) % 2])))
            .collect();
        for exchange in exchanges {
            exchange.await.unwrap();
        }
    }
    eventually(Duration::from_secs(30), "every connection closed", || {
        CountingObserver::get(&observer.closed) == TOTAL + 2
    })
    .await;
    assert!(observer.endings().iter().all(|e| *e == Ending::Completed));
    // The echo server's sockets close asynchronously too; give them a moment.
    let mut now = open_fds();
    for _ in 0..100 {
        if now <= baseline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        now = open_fds();
    }
    assert_eq!(now, baseline, "descriptors leaked");
    server.shutdown(Duration::from_secs(1)).await;
}
