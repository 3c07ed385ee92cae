//! Accept workers: a listening socket per worker thread (`SO_REUSEPORT`), connections relayed
//! on the thread that accepted them, and every socket closed by a drain.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use proxy_core::metrics::{RelayObserver, RouteLabels};
use proxy_core::relay::Route;
use proxy_core::server::{ListenerConfig, ProxyServer};
use tokio::net::TcpStream;

/// Counts the connections each thread opened: the observer is called on the connection's
/// task, so the thread's name says which runtime relays it.
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

/// Listening TCP sockets on `port` in this network namespace (`/proc/net/tcp`, state `0A`).
fn listening_sockets(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let wanted = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.get(1).is_some_and(|local| local.ends_with(&wanted))
                && fields.get(3) == Some(&"0A")
        })
        .count()
}

#[tokio::test(flavor = "current_thread")]
async fn each_worker_accepts_on_its_own_socket_and_relays_what_it_accepted() {
    let echo = echo_server().await;
    let observer = Arc::new(ThreadsObserver::default());
    let config = server_config().with_accept_workers(NonZeroUsize::new(2));
    let server = ProxyServer::new(config, observer.clone()).unwrap();
    let bind: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(bind, Route::new("echo", echo.addr)))
        .unwrap();
    assert_eq!(listening_sockets(addr.port()), 2, "one socket per worker");

    // The kernel picks a socket by the connection's address hash: with 64 source ports, both
    // get some (all on one would be a 1 in 2^63 event).
    let payload = Arc::new(random_payload(64 << 10));
    for _ in 0..64 {
        let client = TcpStream::connect(addr).await.unwrap();
        let sum = echo_roundtrip(client, Arc::clone(&payload), None)
            .await
            .unwrap();
        assert_eq!(sum, Checksum::of(&payload));
    }
    let opened_on = observer.opened_on.lock().unwrap().clone();
    assert_eq!(opened_on.values().sum::<usize>(), 64, "{opened_on:?}");
    assert_eq!(
        opened_on.keys().collect::<Vec<_>>(),
        ["proxy-worker-0", "proxy-worker-1"],
        "every connection on a worker, both workers used: {opened_on:?}"
    );

    let report = server
        .remove_listener(addr, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(report.forced, 0);
    assert_eq!(
        listening_sockets(addr.port()),
        0,
        "a drain closes every worker's socket"
    );
    assert!(TcpStream::connect(addr).await.is_err());
    server.shutdown(Duration::from_secs(1)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn listeners_with_workers_keep_their_port_to_themselves_within_the_server() {
    let echo = echo_server().await;
    let config = server_config().with_accept_workers(NonZeroUsize::new(2));
    let server = ProxyServer::new(config, Arc::new(proxy_core::metrics::NoopObserver)).unwrap();
    let route = Route::new("echo", echo.addr);
    let bind: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(bind, route.clone()))
        .unwrap();
    // SO_REUSEPORT would let a second group bind the same address, or the wildcard on the
    // same port: the server refuses both.
    let wildcard = SocketAddr::from(([0, 0, 0, 0], addr.port()));
    for taken in [addr, wildcard] {
        assert!(matches!(
            server.add_listener(ListenerConfig::new(taken, route.clone())),
            Err(proxy_core::ServerError::ListenerExists(existing)) if existing == addr
        ));
    }
    assert_eq!(listening_sockets(addr.port()), 2);
    server.shutdown(Duration::from_secs(1)).await;
}
