//! A listener's source filter on both data paths: an admitted source relays, any other is
//! closed at accept without a byte or even a connect reaching the upstream, and counted in
//! `proxy_connections_source_refused_total`; the filter changes live.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use prometheus_client::registry::Registry;
use proxy_core::metrics::PrometheusObserver;
use proxy_core::relay::Route;
use proxy_core::server::{DataPath, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::source::{Cidr, SourceFilter};
use proxy_core::upstream::{TargetAddr, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const DEADLINE: Duration = Duration::from_secs(30);

/// The data paths of this system.
fn data_paths() -> Vec<DataPath> {
    let mut paths = vec![DataPath::Tokio];
    if cfg!(target_os = "linux") {
        paths.push(DataPath::EventLoop);
    }
    paths
}

/// An echo upstream that counts the connections it accepted and the bytes it received.
struct CountingUpstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CountingUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn counting_upstream() -> CountingUpstream {
    let listener = loopback_listener();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let received = Arc::new(AtomicUsize::new(0));
    let (count, bytes) = (Arc::clone(&accepted), Arc::clone(&received));
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let bytes = Arc::clone(&bytes);
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            bytes.fetch_add(n, Ordering::SeqCst);
                            if stream.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = stream.shutdown().await;
            });
        }
    });
    CountingUpstream {
        addr,
        accepted,
        received,
        task,
    }
}

/// A client bound to loopback address `source`, connecting to `entry` (a refused client may
/// see the reset already here).
async fn client_from(source: [u8; 4], entry: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::from((source, 0))).unwrap();
    socket.connect(entry).await
}

/// A client from `source` sends `payload`, half-closes and reads: what came back.
async fn exchange(source: [u8; 4], entry: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let mut back = Vec::new();
    let io = async {
        let Ok(mut client) = client_from(source, entry).await else {
            return;
        };
        // The write may fail once the proxy reset a refused client; the read tells.
        if client.write_all(payload).await.is_ok() {
            let _ = client.shutdown().await;
        }
        let _ = client.read_to_end(&mut back).await;
    };
    tokio::time::timeout(DEADLINE, io)
        .await
        .unwrap_or_else(|_| panic!("client from {source:?} neither answered nor closed in 30 s"));
    back
}

fn filter(cidrs: &[&str]) -> SourceFilter {
    cidrs.iter().map(|c| c.parse::<Cidr>().unwrap()).collect()
}

/// The value of `proxy_connections_source_refused_total` of `listener` (0 when absent).
fn refused_metric(registry: &Registry, listener: SocketAddr) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let wanted = format!("proxy_connections_source_refused_total{{listener=\"{listener}\",");
    text.lines()
        .filter(|l| l.starts_with(&wanted))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

fn server(path: DataPath) -> (ProxyServer, Registry) {
    let mut registry = Registry::default();
    let observer = Arc::new(PrometheusObserver::register(&mut registry));
    let config = ServerConfig::default().with_data_path(path);
    (ProxyServer::new(config, observer).unwrap(), registry)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admitted_source_relays_and_another_is_closed_before_reaching_the_upstream() {
    for path in data_paths() {
        let upstream = counting_upstream().await;
        // A socket route is relayed by the event loop itself, a host name by a tokio task
        // (resolution is async): both are checked at accept.
        let routes = [
            Upstream::from(upstream.addr),
            Upstream::Target(TargetAddr::Host {
                host: "localhost".to_owned(),
                port: upstream.addr.port(),
            }),
        ];
        for target in routes {
            let (server, registry) = server(path);
            let entry = server
                .add_listener(
                    ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Route::new("r", target))
                        .with_source_filter(filter(&["127.0.0.1"])),
                )
                .unwrap();
            let (accepted, received) = (
                upstream.accepted.load(Ordering::SeqCst),
                upstream.received.load(Ordering::SeqCst),
            );

            let refused = exchange([127, 0, 0, 2], entry, b"must not pass").await;
            assert!(refused.is_empty(), "{path}: refused client got {refused:?}");
            assert_eq!(refused_metric(&registry, entry), 1, "{path}");

            let payload = random_payload(200_000);
            let back = exchange([127, 0, 0, 1], entry, &payload).await;
            assert!(back == payload, "{path}: admitted client's echo differs");
            // The admitted connection was relayed after the refused one on the same listener:
            // had the refused one been connected, the upstream would count two by now.
            eventually(DEADLINE, "the upstream saw the admitted bytes", || {
                upstream.received.load(Ordering::SeqCst) - received >= payload.len()
            })
            .await;
            assert_eq!(
                upstream.accepted.load(Ordering::SeqCst) - accepted,
                1,
                "{path}: the refused client reached the upstream"
            );
            assert_eq!(
                upstream.received.load(Ordering::SeqCst) - received,
                payload.len(),
                "{path}: bytes of the refused client reached the upstream"
            );
            assert_eq!(refused_metric(&registry, entry), 1, "{path}");
            server.shutdown(Duration::from_secs(5)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_filter_changes_live() {
    for path in data_paths() {
        let echo = echo_server().await;
        let (server, registry) = server(path);
        let entry = server
            .add_listener(
                ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Route::new("r", echo.addr))
                    .with_source_filter(filter(&["127.0.0.1"])),
            )
            .unwrap();
        let passes = |source: [u8; 4]| async move {
            exchange(source, entry, b"ping").await == b"ping".to_vec()
        };
        assert!(passes([127, 0, 0, 1]).await, "{path}");
        assert!(!passes([127, 0, 0, 3]).await, "{path}");

        // An open connection of a source that is no longer admitted is left alone.
        let mut open = client_from([127, 0, 0, 1], entry).await.unwrap();
        open.write_all(b"a").await.unwrap();
        let mut one = [0u8; 1];
        open.read_exact(&mut one).await.unwrap();

        server
            .set_source_filter(entry, Some(filter(&["127.0.0.2/31"])))
            .unwrap();
        assert!(!passes([127, 0, 0, 1]).await, "{path}");
        assert!(passes([127, 0, 0, 3]).await, "{path}");
        open.write_all(b"b").await.unwrap();
        open.read_exact(&mut one).await.unwrap();
        assert_eq!(&one, b"b", "{path}");

        server
            .set_source_filter(entry, Some(SourceFilter::deny_all()))
            .unwrap();
        assert!(!passes([127, 0, 0, 3]).await, "{path}");

        server.set_source_filter(entry, None).unwrap();
        assert!(passes([127, 0, 0, 1]).await, "{path}");
        assert!(passes([127, 0, 0, 4]).await, "{path}");

        assert_eq!(refused_metric(&registry, entry), 3, "{path}");
        let unknown = "127.0.0.1:1".parse().unwrap();
        assert!(server.set_source_filter(unknown, None).is_err());
        drop(open);
        server.shutdown(Duration::from_secs(5)).await;
    }
}
