//! Byte-exact integrity through the server at 1, 100 and 1 000 concurrent connections, on both
//! copy paths, with random payloads checked by checksum.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proxy_core::copy::CopyMode;
use proxy_core::relay::{Ending, RelayConfig, Route};
use proxy_core::server::{ListenerConfig, ProxyServer};
use tokio::net::TcpStream;

async fn concurrent_transfers(mode: CopyMode) {
    raise_fd_limit();
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = ProxyServer::new(server_config(), observer.clone()).unwrap();
    let relay = RelayConfig::default().with_copy_mode(mode);
    let route = Route::new("echo", echo.addr);
    let addr = server
        .add_listener(ListenerConfig::new("127.0.0.1:0".parse().unwrap(), route).with_relay(relay))
        .unwrap();

    let mut expected_bytes = 0u64;
    let mut expected_connections = 0;
    // (connections, largest payload): total volume stays around 30 MiB per step.
    for (connections, max_len) in [(1, 16 << 20), (100, 256 << 10), (1000, 32 << 10)] {
        let mut transfers = Vec::with_capacity(connections);
        for _ in 0..connections {
            let payload = Arc::new(random_payload(random_len(max_len)));
            expected_bytes += payload.len() as u64;
            let client = TcpStream::connect(addr).await.unwrap();
            let expected = Checksum::of(&payload);
            transfers.push(tokio::spawn(async move {
                let echoed = echo_roundtrip(client, payload, None).await.unwrap();
                assert_eq!(echoed, expected, "{mode:?}: payload altered");
            }));
        }
        for transfer in transfers {
            transfer.await.unwrap();
        }
        expected_connections += connections;
        eventually(Duration::from_secs(30), "every connection closed", || {
            CountingObserver::get(&observer.closed) == expected_connections
        })
        .await;
    }
    assert!(
        observer.endings().iter().all(|e| *e == Ending::Completed),
        "{mode:?}"
    );
    // Every byte was reported to the observer, in both directions.
    let reported =
        |counter: &std::sync::atomic::AtomicU64| counter.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(reported(&observer.bytes_to_upstream), expected_bytes);
    assert_eq!(reported(&observer.bytes_to_client), expected_bytes);
    assert_eq!(server.shutdown(Duration::from_secs(1)).await.forced, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_are_byte_exact_with_buffered_copy() {
    concurrent_transfers(CopyMode::Buffered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_are_byte_exact_with_splice() {
    concurrent_transfers(CopyMode::Splice).await;
}
