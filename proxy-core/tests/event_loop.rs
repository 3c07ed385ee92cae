//! What only the event-loop data path does (Linux): plain routes relayed on the server's loop
//! thread, other upstreams handed to the runtime per connection, and a source's read interest
//! dropped while its destination is full. Every other server test runs on this path too with
//! `PROXY_CORE_TEST_DATA_PATH=event-loop`.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use proxy_core::metrics::{RelayObserver, RouteLabels};
use proxy_core::relay::Route;
use proxy_core::server::{DataPath, ExistingConnections, ListenerConfig, ProxyServer};
use proxy_core::upstream::{TargetAddr, Upstream};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// Records the thread each connection was opened on: the observer is called where the
/// connection is relayed.
#[derive(Default)]
struct ThreadsObserver {
    opened_on: Mutex<BTreeMap<String, usize>>,
}

impl RelayObserver for ThreadsObserver {
    fn connection_opened(&self, _: &RouteLabels) {
        let thread = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        *self.opened_on.lock().unwrap().entry(thread).or_default() += 1;
    }
}

fn event_loop_server(observer: Arc<dyn RelayObserver>) -> ProxyServer {
    let config = server_config().with_data_path(DataPath::EventLoop);
    ProxyServer::new(config, observer).unwrap()
}

async fn roundtrip(addr: SocketAddr) {
    let payload = Arc::new(random_payload(100_000));
    let client = TcpStream::connect(addr).await.unwrap();
    let sum = echo_roundtrip(client, Arc::clone(&payload), None)
        .await
        .unwrap();
    assert_eq!(sum, Checksum::of(&payload));
}

#[tokio::test(flavor = "current_thread")]
async fn socket_routes_run_on_the_loop_thread_and_other_upstreams_on_the_runtime() {
    let echo = echo_server().await;
    let observer = Arc::new(ThreadsObserver::default());
    let server = event_loop_server(observer.clone());
    let addr = server
        .add_listener(ListenerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            Route::new("echo", echo.addr),
        ))
        .unwrap();
    roundtrip(addr).await;
    assert_eq!(
        observer.opened_on.lock().unwrap().clone(),
        BTreeMap::from([("proxy-worker-0".to_owned(), 1)]),
        "a socket-address route is relayed by the event loop"
    );

    // A host name needs resolving: that connection goes to the runtime this test runs on.
    let by_name = Upstream::Target(TargetAddr::Host {
        host: "localhost".to_owned(),
        port: echo.addr.port(),
    });
    server
        .set_route(
            addr,
            Route::new("by-name", by_name),
            ExistingConnections::Keep,
        )
        .unwrap();
    roundtrip(addr).await;
    let opened_on = observer.opened_on.lock().unwrap().clone();
    assert_eq!(opened_on.values().sum::<usize>(), 2, "{opened_on:?}");
    assert_eq!(
        opened_on.get("proxy-worker-0"),
        Some(&1),
        "the host-name route was relayed off the loop: {opened_on:?}"
    );
    let report = server.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report.forced, 0);
}

/// The epoll registrations of this process that watch for writing but not for reading, from
/// `/proc/self/fdinfo` of every epoll descriptor (`tfd: N events: MASK ...`). Tokio registers
/// every socket for both; only the event loop drops reading.
fn write_only_registrations() -> usize {
    const EPOLLIN: u32 = 0x1;
    const EPOLLOUT: u32 = 0x4;
    let mut count = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy() != "anon_inode:[eventpoll]" {
            continue;
        }
        let fd = entry.file_name();
        let Ok(info) =
            std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.to_string_lossy()))
        else {
            continue;
        };
        for line in info.lines().filter(|line| line.starts_with("tfd:")) {
            let mask = line
                .split_whitespace()
                .skip_while(|word| *word != "events:")
                .nth(1)
                .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                .unwrap_or(0);
            if mask & EPOLLOUT != 0 && mask & EPOLLIN == 0 {
                count += 1;
            }
        }
    }
    count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_upstream_drops_the_clients_read_interest_until_it_drains() {
    // An upstream that accepts and reads nothing until told to.
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let addr = server
        .add_listener(ListenerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            Route::new("stalled", upstream_addr),
        ))
        .unwrap();

    let mut client = TcpStream::connect(addr).await.unwrap();
    let (mut accepted, _) = upstream.accept().await.unwrap();
    let chunk = vec![7u8; 64 << 10];
    let mut sent = 0usize;
    // Write until the client blocks: every buffer on the way is full by then.
    while let Ok(written) =
        tokio::time::timeout(Duration::from_millis(500), client.write(&chunk)).await
    {
        sent += written.unwrap();
    }
    eventually(
        Duration::from_secs(30),
        "the client's registration without read interest",
        || write_only_registrations() == 1,
    )
    .await;

    // Draining the upstream gives it back, and every byte arrives.
    client.shutdown().await.unwrap();
    let mut received = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut accepted, &mut received)
        .await
        .unwrap();
    assert_eq!(received.len(), sent);
    assert!(received.iter().all(|byte| *byte == 7));
    drop(accepted);
    eventually(Duration::from_secs(30), "connection closed", || {
        write_only_registrations() == 0
    })
    .await;
    server.shutdown(Duration::from_secs(5)).await;
}
