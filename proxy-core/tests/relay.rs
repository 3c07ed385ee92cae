//! One relayed connection over real loopback sockets: integrity, half-close, resets, timeouts,
//! counters, PROXY protocol, generic streams.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures::future::BoxFuture;
use proxy_core::ConnectError;
use proxy_core::copy::{CopyMode, Direction, RelayCounters};
use proxy_core::proxy_protocol::{ProxyHeader, parse_v2};
use proxy_core::relay::{Ending, RelayConfig, Route, relay_streams};
use proxy_core::upstream::{Connector, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

fn config(mode: CopyMode) -> RelayConfig {
    RelayConfig::default()
        .with_copy_mode(mode)
        .with_connect_timeout(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfer_is_byte_exact_on_both_paths() {
    let echo = echo_server().await;
    for mode in MODES {
        let payload = Arc::new(random_payload(8 * 1024 * 1024 + random_len(4096)));
        let relay = relay_once(Route::new("echo", echo.addr), config(mode)).await;
        let echoed = echo_roundtrip(relay.client, Arc::clone(&payload), None)
            .await
            .unwrap();
        assert_eq!(echoed, Checksum::of(&payload), "{mode:?}");
        let summary = relay.task.await.unwrap().unwrap();
        assert_eq!(summary.ending, Ending::Completed, "{mode:?}");
        assert_eq!(summary.to_upstream, payload.len() as u64);
        assert_eq!(summary.to_client, payload.len() as u64);
        assert_eq!(summary.copy_mode, mode);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_from_client_lets_upstream_keep_sending() {
    for mode in MODES {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let route = Route::new("half", upstream.local_addr().unwrap());
        let backend = tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await.unwrap();
            let mut request = Vec::new();
            conn.read_to_end(&mut request).await.unwrap(); // returns only once FIN arrived
            conn.write_all(b"answer after your FIN").await.unwrap();
            conn.shutdown().await.unwrap();
            request
        });
        let mut relay = relay_once(route, config(mode)).await;
        relay.client.write_all(b"request").await.unwrap();
        relay.client.shutdown().await.unwrap();
        let mut answer = Vec::new();
        relay.client.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"answer after your FIN", "{mode:?}");
        assert_eq!(backend.await.unwrap(), b"request");
        assert_eq!(relay.task.await.unwrap().unwrap().ending, Ending::Completed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_from_upstream_lets_client_keep_sending() {
    for mode in MODES {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let route = Route::new("half", upstream.local_addr().unwrap());
        let backend = tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await.unwrap();
            conn.write_all(b"banner").await.unwrap();
            conn.shutdown().await.unwrap();
            let mut late = Vec::new();
            conn.read_to_end(&mut late).await.unwrap();
            late
        });
        let mut relay = relay_once(route, config(mode)).await;
        let mut banner = Vec::new();
        relay.client.read_to_end(&mut banner).await.unwrap(); // the FIN reached the client
        assert_eq!(banner, b"banner");
        relay
            .client
            .write_all(b"sent after the upstream's FIN")
            .await
            .unwrap();
        relay.client.shutdown().await.unwrap();
        assert_eq!(
            backend.await.unwrap(),
            b"sent after the upstream's FIN",
            "{mode:?}"
        );
        let summary = relay.task.await.unwrap().unwrap();
        assert_eq!(summary.ending, Ending::Completed);
        assert_eq!((summary.to_client, summary.to_upstream), (6, 29));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_mid_stream_is_passed_on_as_reset() {
    for mode in MODES {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let route = Route::new("reset", upstream.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut conn, _) = upstream.accept().await.unwrap();
            conn.write_all(b"partial").await.unwrap();
            let mut go = [0u8; 2];
            conn.read_exact(&mut go).await.unwrap();
            conn.set_zero_linger().unwrap();
            drop(conn); // RST
        });
        let mut relay = relay_once(route, config(mode)).await;
        let mut partial = [0u8; 7];
        relay.client.read_exact(&mut partial).await.unwrap();
        assert_eq!(&partial, b"partial");
        relay.client.write_all(b"go").await.unwrap();
        let mut rest = [0u8; 16];
        let after = relay.client.read(&mut rest).await;
        assert!(
            matches!(&after, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "{mode:?}: client should see the reset, got {after:?}"
        );
        let summary = relay.task.await.unwrap().unwrap();
        assert!(
            matches!(summary.ending, Ending::Reset { .. }),
            "{mode:?}: {:?}",
            summary.ending
        );
        assert_eq!((summary.to_client, summary.to_upstream), (7, 2));
    }
}

#[tokio::test]
async fn refused_upstream_is_a_connect_error() {
    let route = Route::new("refused", closed_port().await);
    let mut relay = relay_once(route, config(CopyMode::Auto)).await;
    let result = relay.task.await.unwrap();
    assert!(
        matches!(result, Err(ConnectError::Io { ref cause, .. }) if cause.kind() == io::ErrorKind::ConnectionRefused),
        "{result:?}"
    );
    assert!(closes_within(&mut relay.client, Duration::from_secs(30)).await);
}

/// A connector whose connect never completes, like a SYN to a black hole, without sending
/// anything anywhere.
#[derive(Debug)]
struct BlackHole;

impl Connector for BlackHole {
    fn connect(&self) -> BoxFuture<'_, io::Result<TcpStream>> {
        Box::pin(std::future::pending())
    }
}

#[tokio::test(start_paused = true)]
async fn connect_timeout_fires_when_the_upstream_never_answers() {
    let route = Route::new("black-hole", Upstream::Connector(Arc::new(BlackHole)));
    let started = tokio::time::Instant::now();
    let relay = relay_once(
        route,
        config(CopyMode::Auto).with_connect_timeout(Duration::from_secs(7)),
    )
    .await;
    let result = relay.task.await.unwrap();
    assert!(
        matches!(result, Err(ConnectError::Timeout { after, .. }) if after == Duration::from_secs(7)),
        "{result:?}"
    );
    assert_eq!(started.elapsed(), Duration::from_secs(7));
}

#[tokio::test(start_paused = true)]
async fn idle_timeout_closes_quiet_connections_only() {
    let echo = echo_server().await;
    for mode in MODES {
        let config = config(mode).with_idle_timeout(Some(Duration::from_secs(30)));
        let mut relay = relay_once(Route::new("idle", echo.addr), config).await;
        // Active for 100 s, one message every 20 s: never idle for 30 s.
        for _ in 0..5 {
            relay.client.write_all(b"ping").await.unwrap();
            let mut pong = [0u8; 4];
            relay.client.read_exact(&mut pong).await.unwrap();
            tokio::time::sleep(Duration::from_secs(20)).await;
        }
        assert!(!relay.task.is_finished(), "{mode:?}: closed while active");
        let summary = relay.task.await.unwrap().unwrap();
        assert_eq!(summary.ending, Ending::IdleTimeout, "{mode:?}");
        // Last byte at 80 s, so idle expires at 110 s.
        assert_eq!(
            summary.duration.as_secs(),
            110,
            "{mode:?}: {:?}",
            summary.duration
        );
        assert!(closes_within(&mut relay.client, Duration::from_secs(30)).await);
    }
}

#[tokio::test(start_paused = true)]
async fn max_lifetime_closes_busy_connections() {
    let echo = echo_server().await;
    let config = config(CopyMode::Auto).with_max_lifetime(Some(Duration::from_secs(60)));
    let mut relay = relay_once(Route::new("lifetime", echo.addr), config).await;
    while !relay.task.is_finished() {
        if relay.client.write_all(b"busy").await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let summary = relay.task.await.unwrap().unwrap();
    assert_eq!(summary.ending, Ending::MaxLifetime);
    assert_eq!(summary.duration, Duration::from_secs(60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_are_live_on_both_paths() {
    let echo = echo_server().await;
    for mode in MODES {
        let mut relay = relay_once(Route::new("live", echo.addr), config(mode)).await;
        let chunk = random_payload(256 * 1024);
        let mut back = vec![0u8; chunk.len()];
        for round in 1..=3u64 {
            relay.client.write_all(&chunk).await.unwrap();
            relay.client.read_exact(&mut back).await.unwrap();
            assert_eq!(back, chunk);
            // The connection is still open: the counters must show the bytes while it is. The
            // relay adds a chunk after its write returns, which can be just after the client has
            // read it, so give the count a moment to land.
            let expected = round * chunk.len() as u64;
            for direction in [Direction::ToUpstream, Direction::ToClient] {
                let counted = counted_soon(&relay.counters, direction, expected).await;
                assert_eq!(counted, expected, "{mode:?} {direction:?}");
            }
            assert!(!relay.task.is_finished());
        }
        relay.cancel.cancel();
        assert_eq!(relay.task.await.unwrap().unwrap().ending, Ending::Cancelled);
    }
}

/// The counter's value once it reaches `expected`, or its value after 30 s.
async fn counted_soon(counters: &RelayCounters, direction: Direction, expected: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let counted = counters.get(direction);
        if counted >= expected || tokio::time::Instant::now() >= deadline {
            return counted;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test]
async fn proxy_protocol_header_carries_the_client_address() {
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let route = Route::new("pp", upstream.local_addr().unwrap()).with_proxy_protocol(true);
    let backend = tokio::spawn(async move {
        let (mut conn, _) = upstream.accept().await.unwrap();
        let mut received = Vec::new();
        conn.read_to_end(&mut received).await.unwrap();
        received
    });
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let front_addr = front.local_addr().unwrap();
    let mut client = TcpStream::connect(front_addr).await.unwrap();
    let client_addr = client.local_addr().unwrap();
    let (accepted, _) = front.accept().await.unwrap();
    let relay = tokio::spawn(async move {
        let counters = RelayCounters::new();
        proxy_core::relay::proxy(
            accepted,
            &route,
            &RelayConfig::default(),
            &counters,
            &CancellationToken::new(),
        )
        .await
    });
    client.write_all(b"payload").await.unwrap();
    client.shutdown().await.unwrap();
    let received = backend.await.unwrap();
    let (header, used) = parse_v2(&received).unwrap().unwrap();
    assert_eq!(
        header,
        ProxyHeader::Proxy {
            source: client_addr,
            destination: front_addr
        }
    );
    assert_eq!(&received[used..], b"payload");
    drop(client);
    let summary = relay.await.unwrap().unwrap();
    assert_eq!(
        summary.to_upstream, 7,
        "the header is not counted as client bytes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generic_stream_relay_is_byte_exact_and_half_closes() {
    let echo = echo_server().await;
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = front.accept().await.unwrap();
    let upstream = TcpStream::connect(echo.addr).await.unwrap();
    let relay = tokio::spawn(async move {
        let counters = RelayCounters::new();
        // Box the streams so only the generic AsyncRead + AsyncWrite path can be used.
        let accepted: Box<dyn StreamLike> = Box::new(accepted);
        let upstream: Box<dyn StreamLike> = Box::new(upstream);
        relay_streams(
            accepted,
            upstream,
            &RelayConfig::default(),
            &counters,
            &CancellationToken::new(),
        )
        .await
    });
    let payload = Arc::new(random_payload(3 * 1024 * 1024 + random_len(1000)));
    let echoed = echo_roundtrip(client, Arc::clone(&payload), None)
        .await
        .unwrap();
    assert_eq!(echoed, Checksum::of(&payload));
    let summary = relay.await.unwrap();
    assert_eq!(summary.ending, Ending::Completed);
    assert_eq!(summary.copy_mode, CopyMode::Buffered);
    assert_eq!(summary.to_client, payload.len() as u64);
}

trait StreamLike: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> StreamLike for T {}

#[tokio::test]
async fn huge_timeouts_never_expire_and_never_overflow() {
    let echo = echo_server().await;
    let config = config(CopyMode::Auto)
        .with_idle_timeout(Some(Duration::MAX))
        .with_max_lifetime(Some(Duration::MAX));
    let mut relay = relay_once(Route::new("forever", echo.addr), config).await;
    relay.client.write_all(b"still here").await.unwrap();
    relay.client.shutdown().await.unwrap();
    let mut back = Vec::new();
    relay.client.read_to_end(&mut back).await.unwrap();
    assert_eq!(back, b"still here");
    assert_eq!(relay.task.await.unwrap().unwrap().ending, Ending::Completed);
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_last_bytes_and_the_fin_reach_the_client_in_one_segment() {
    for mode in MODES {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let route = Route::new("last", upstream.local_addr().unwrap());
        let mut relay = relay_once(route, config(mode)).await;
        relay.client.write_all(b"P").await.unwrap();
        let (accepted, _) = upstream.accept().await.unwrap();
        let segments = segments_of_an_answer_with_fin(&mut relay.client, accepted).await;
        assert_eq!(
            segments, 1,
            "{mode:?}: the last byte and the FIN came in one segment, not in {segments}"
        );
        relay.client.shutdown().await.unwrap();
        assert_eq!(relay.task.await.unwrap().unwrap().ending, Ending::Completed);
    }
}
