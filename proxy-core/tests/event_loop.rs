//! What only the event-loop data path does (Linux): plain routes relayed on the server's loop
//! thread, other upstreams handed to the runtime per connection, a source's read interest
//! dropped while its destination is full, a client watched for writing only once it is full,
//! and a FIN read with the last bytes. Every other
//! server test runs on this path too with `PROXY_CORE_TEST_DATA_PATH=event-loop`.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use proxy_core::metrics::{RelayObserver, RouteLabels};
use proxy_core::proxy_protocol::{ProxyHeader, parse_v2};
use proxy_core::relay::{Ending, RelayConfig, Route};
use proxy_core::server::{DataPath, ExistingConnections, ListenerConfig, ProxyServer};
use proxy_core::upstream::{TargetAddr, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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

/// A listener of `server` on a free loopback port with `route`; its address.
fn listen(server: &ProxyServer, route: Route) -> SocketAddr {
    server
        .add_listener(ListenerConfig::new("127.0.0.1:0".parse().unwrap(), route))
        .unwrap()
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
    let addr = listen(&server, Route::new("echo", echo.addr));
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

const EPOLLIN: u32 = 0x1;
const EPOLLOUT: u32 = 0x4;

/// The event mask descriptor `fd` is registered with in one of this process's epoll
/// descriptors, from their `/proc/self/fdinfo` (`tfd: N events: MASK ...`).
fn epoll_mask_of(fd: &str) -> Option<u32> {
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if target.to_string_lossy() != "anon_inode:[eventpoll]" {
            continue;
        }
        let path = format!("/proc/self/fdinfo/{}", entry.file_name().to_string_lossy());
        let Ok(info) = std::fs::read_to_string(path) else {
            continue;
        };
        for line in info.lines().filter(|line| line.starts_with("tfd:")) {
            let mut words = line.split_whitespace();
            if words.nth(1) != Some(fd) {
                continue;
            }
            return words
                .skip_while(|word| *word != "events:")
                .nth(1)
                .and_then(|hex| u32::from_str_radix(hex, 16).ok());
        }
    }
    None
}

/// The epoll event mask this process registered the socket `local` ↔ `remote` with (IPv4): its
/// inode from `/proc/net/tcp`, its descriptor from `/proc/self/fd`, its mask from the epoll
/// descriptors' `fdinfo`.
fn registered_mask(local: SocketAddr, remote: SocketAddr) -> Option<u32> {
    let hex = |addr: SocketAddr| match addr {
        SocketAddr::V4(v4) => format!(
            "{:08X}:{:04X}",
            u32::from_ne_bytes(v4.ip().octets()),
            v4.port()
        ),
        SocketAddr::V6(_) => unreachable!("IPv4 only"),
    };
    let (local, remote) = (hex(local), hex(remote));
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let inode = table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&local.as_str()) && fields.get(2) == Some(&remote.as_str()))
            .then(|| fields.get(9).map(|inode| inode.to_string()))
            .flatten()
    })?;
    let socket = format!("socket:[{inode}]");
    let fd = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .find(|entry| {
            std::fs::read_link(entry.path()).is_ok_and(|target| target.to_string_lossy() == socket)
        })?
        .file_name()
        .to_string_lossy()
        .into_owned();
    epoll_mask_of(&fd)
}

/// Writes `byte`s to `stream` until a write stays pending for half a second (every buffer on
/// the way is full); returns how many it wrote.
async fn write_until_blocked(stream: &mut TcpStream, byte: u8) -> usize {
    let chunk = vec![byte; 64 << 10];
    let mut sent = 0;
    while let Ok(written) =
        tokio::time::timeout(Duration::from_millis(500), stream.write(&chunk)).await
    {
        sent += written.unwrap();
    }
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_upstream_drops_the_clients_read_interest_until_the_client_runs_dry() {
    // An upstream that accepts and reads nothing until told to.
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let addr = listen(&server, Route::new("stalled", upstream_addr));

    let mut client = TcpStream::connect(addr).await.unwrap();
    // The relay's socket of this client: local `addr`, remote the client's address.
    let relay_leg = (addr, client.local_addr().unwrap());
    let (mut accepted, _) = upstream.accept().await.unwrap();
    // Write until the client blocks: every buffer on the way is full by then.
    let sent = write_until_blocked(&mut client, 7).await;
    eventually(
        Duration::from_secs(30),
        "the client's registration without read interest",
        || registered_mask(relay_leg.0, relay_leg.1).is_some_and(|mask| mask & EPOLLIN == 0),
    )
    .await;

    // Draining the upstream lets every byte through; once the client's bytes run out, read
    // interest comes back (not before: while the client still has bytes, no event is needed).
    let mut received = vec![0u8; sent];
    tokio::time::timeout(Duration::from_secs(30), accepted.read_exact(&mut received))
        .await
        .expect("the held bytes arrive")
        .unwrap();
    assert!(received.iter().all(|byte| *byte == 7));
    eventually(
        Duration::from_secs(30),
        "read interest back once the client ran dry",
        || registered_mask(relay_leg.0, relay_leg.1).is_some_and(|mask| mask & EPOLLIN != 0),
    )
    .await;
    // And it works: bytes the client sends now wake the loop and arrive, then its FIN.
    client.write_all(b"more").await.unwrap();
    client.shutdown().await.unwrap();
    let rest = read_to_end_within_30s(&mut accepted, "the later bytes and the FIN").await;
    assert_eq!(rest, b"more");
    drop(accepted);
    eventually(Duration::from_secs(30), "connection closed", || {
        registered_mask(relay_leg.0, relay_leg.1).is_none()
    })
    .await;
    server.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_header_comes_first_with_the_clients_addresses() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let route = Route::new("pp", upstream.local_addr().unwrap()).with_proxy_protocol(true);
    let addr = listen(&server, route);
    let mut client = TcpStream::connect(addr).await.unwrap();
    client.write_all(b"hello").await.unwrap();
    let (mut accepted, _) = upstream.accept().await.unwrap();
    // An IPv4 header is 28 bytes; the client's bytes follow it.
    let mut received = [0u8; 28 + 5];
    tokio::time::timeout(Duration::from_secs(30), accepted.read_exact(&mut received))
        .await
        .expect("header and bytes within 30 s")
        .unwrap();
    let (header, used) = parse_v2(&received).unwrap().unwrap();
    assert_eq!(
        header,
        ProxyHeader::Proxy {
            source: client.local_addr().unwrap(),
            destination: addr,
        }
    );
    assert_eq!(&received[used..], b"hello");
    server.shutdown(Duration::from_secs(1)).await;
}

async fn ending_of(relay: RelayConfig, upstream: SocketAddr, keep_sending: bool) -> Ending {
    let observer = Arc::new(CountingObserver::default());
    let server = event_loop_server(observer.clone());
    let addr = server
        .add_listener(
            ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Route::new("t", upstream))
                .with_relay(relay),
        )
        .unwrap();
    let mut client = TcpStream::connect(addr).await.unwrap();
    if keep_sending {
        let mut buf = [0u8; 64];
        let sender = async {
            // Echoed back and read, so neither direction is ever idle for long.
            while client.write_all(b"tick").await.is_ok()
                && matches!(client.read(&mut buf).await, Ok(n) if n > 0)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), sender)
            .await
            .expect("closed within 30 s");
    } else {
        assert!(closes_within(&mut client, Duration::from_secs(30)).await);
    }
    eventually(Duration::from_secs(30), "connection closed", || {
        CountingObserver::get(&observer.closed) == 1
    })
    .await;
    server.shutdown(Duration::from_secs(1)).await;
    observer.endings()[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_and_lifetime_close_connections_from_the_timer_wheel() {
    let echo = echo_server().await;
    let idle = RelayConfig::default().with_idle_timeout(Some(Duration::from_millis(300)));
    assert_eq!(ending_of(idle, echo.addr, false).await, Ending::IdleTimeout);
    // Busy the whole time: the idle timeout is pushed back, the lifetime is not. The idle
    // timeout is generous here so a busy machine's scheduling stall cannot end it first.
    let lifetime = RelayConfig::default()
        .with_idle_timeout(Some(Duration::from_secs(1)))
        .with_max_lifetime(Some(Duration::from_secs(3)));
    assert_eq!(
        ending_of(lifetime, echo.addr, true).await,
        Ending::MaxLifetime
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_that_never_completes_times_out() {
    // A listener that never accepts: with a backlog of 0 its queue takes one connection, and
    // the relay's SYN is dropped.
    let full = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    full.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    full.listen(0).unwrap();
    let full_addr = full.local_addr().unwrap().as_socket().unwrap();
    let _queued = std::net::TcpStream::connect(full_addr).unwrap();
    let observer = Arc::new(CountingObserver::default());
    let server = event_loop_server(observer.clone());
    let relay = RelayConfig::default().with_connect_timeout(Duration::from_millis(300));
    let addr = server
        .add_listener(
            ListenerConfig::new(
                "127.0.0.1:0".parse().unwrap(),
                Route::new("full", full_addr),
            )
            .with_relay(relay),
        )
        .unwrap();
    let mut client = TcpStream::connect(addr).await.unwrap();
    assert!(closes_within(&mut client, Duration::from_secs(30)).await);
    eventually(Duration::from_secs(30), "connection closed", || {
        CountingObserver::get(&observer.closed) == 1
    })
    .await;
    assert_eq!(CountingObserver::get(&observer.connect_timeouts), 1);
    assert_eq!(observer.endings(), [Ending::ConnectFailed]);
    server.shutdown(Duration::from_secs(1)).await;
}

/// A FIN that comes with the last bytes ends the stream without another read: every byte before
/// it still arrives, in both directions, also when the bytes before came in several pieces.
#[tokio::test(flavor = "current_thread")]
async fn bytes_that_come_with_the_fin_arrive_whole_and_end_the_stream() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let answer = random_payload(5 * 3_000);
    let answering = {
        let answer = answer.clone();
        tokio::spawn(async move {
            let (mut socket, _) = upstream.accept().await.unwrap();
            let mut request = Vec::new();
            socket.read_to_end(&mut request).await.unwrap();
            // Pieces apart, so the relay reads short before the FIN comes; the last one and
            // the FIN leave together.
            for piece in answer.chunks(3_000) {
                socket.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            socket.shutdown().await.unwrap();
            request
        })
    };
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let addr = listen(&server, Route::new("t", upstream_addr));
    let mut client = TcpStream::connect(addr).await.unwrap();
    client.write_all(b"request").await.unwrap();
    client.shutdown().await.unwrap();
    let received = read_to_end_within_30s(&mut client, "the end of the answer").await;
    assert_eq!(received.len(), answer.len());
    assert!(received == answer, "the answer arrived changed");
    assert_eq!(answering.await.unwrap(), b"request");
    server.shutdown(Duration::from_secs(1)).await;
}

/// A client is watched for writing only once a write to it found its send buffer full (until
/// then its ACKs and the ACK of a FIN wake nobody); from then on, its reading lets the held
/// bytes go on, to the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_is_watched_for_writing_only_once_it_is_full() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let addr = listen(&server, Route::new("download", upstream_addr));

    let mut client = TcpStream::connect(addr).await.unwrap();
    let (mut accepted, _) = upstream.accept().await.unwrap();
    // One exchange each way: the relay has connected and written to both legs.
    let mut word = [0u8; 5];
    client.write_all(b"hello").await.unwrap();
    accepted.read_exact(&mut word).await.unwrap();
    accepted.write_all(b"world").await.unwrap();
    client.read_exact(&mut word).await.unwrap();
    assert_eq!(&word, b"world");
    // The relay's socket of this client: local `addr`, remote the client's address.
    let relay_leg = (addr, client.local_addr().unwrap());
    let mask = registered_mask(relay_leg.0, relay_leg.1).expect("the client's registration");
    assert_eq!(
        (mask & EPOLLIN, mask & EPOLLOUT),
        (EPOLLIN, 0),
        "the client is registered for reading only"
    );

    // The upstream writes until it blocks: the client reads nothing, so every buffer on the
    // way is full by then.
    let sent = write_until_blocked(&mut accepted, 9).await;
    eventually(
        Duration::from_secs(30),
        "the full client registered for writing too",
        || registered_mask(relay_leg.0, relay_leg.1).is_some_and(|mask| mask & EPOLLOUT != 0),
    )
    .await;

    // Reading now wakes the loop for the held bytes: all of them arrive, then the FIN.
    accepted.shutdown().await.unwrap();
    let received = read_to_end_within_30s(&mut client, "the held bytes and the FIN").await;
    assert_eq!(received.len(), sent);
    assert!(received.iter().all(|byte| *byte == 9));
    server.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn the_last_bytes_and_the_fin_reach_the_client_in_one_segment() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = event_loop_server(Arc::new(CountingObserver::default()));
    let addr = listen(&server, Route::new("last", upstream.local_addr().unwrap()));
    let mut client = TcpStream::connect(addr).await.unwrap();
    client.write_all(b"P").await.unwrap();
    let (accepted, _) = upstream.accept().await.unwrap();
    let segments = segments_of_an_answer_with_fin(&mut client, accepted).await;
    assert_eq!(
        segments, 1,
        "the last byte and the FIN came in one segment, not in {segments}"
    );
}
