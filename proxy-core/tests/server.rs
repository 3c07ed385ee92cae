//! The server over real loopback sockets: drain, live route swaps, limits, upstream sets,
//! metrics and configuration errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use prometheus_client::registry::Registry;
use proxy_core::copy::CopyMode;
use proxy_core::metrics::{NoopObserver, PrometheusObserver};
use proxy_core::relay::{Ending, RelayConfig, Route};
use proxy_core::server::{ExistingConnections, ListenerConfig, PortRange, ProxyServer};
use proxy_core::upstream::{HealthCheck, TargetAddr, Upstream, UpstreamSet};
use proxy_core::{ConfigError, ConnectError, ServerError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn loopback() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

fn server_with(observer: Arc<CountingObserver>) -> ProxyServer {
    let config = server_config().with_report_interval(Duration::from_millis(50));
    ProxyServer::new(config, observer).unwrap()
}

async fn ping(stream: &mut TcpStream) {
    stream.write_all(b"ping").await.unwrap();
    let mut pong = [0u8; 4];
    stream.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"ping");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_lets_a_running_transfer_finish_and_stops_accepting() {
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = server_with(observer.clone());
    let addr = server
        .add_listener(ListenerConfig::new(
            loopback(),
            Route::new("echo", echo.addr),
        ))
        .unwrap();

    // Over 3 s of transfer: 32 chunks of 64 KiB, 100 ms apart (a busy machine still reaches
    // the checks below while it runs).
    let payload = Arc::new(random_payload(2 << 20));
    let client = TcpStream::connect(addr).await.unwrap();
    let transfer = tokio::spawn(echo_roundtrip(
        client,
        Arc::clone(&payload),
        Some(Duration::from_millis(100)),
    ));
    eventually(Duration::from_secs(30), "transfer under way", || {
        observer.bytes_to_client.load(Ordering::SeqCst) > 0
    })
    .await;

    let drain = {
        let server = server.clone();
        tokio::spawn(async move { server.remove_listener(addr, Duration::from_secs(20)).await })
    };
    eventually(Duration::from_secs(30), "listener gone", || {
        server.listeners().is_empty()
    })
    .await;
    // The listening socket closes as its accept loop ends: polled, not a guessed sleep. Polled
    // by binding its address (refused while it listens), not by connecting: a connection that
    // arrives before the loop has stopped accepting is accepted and relayed, as it should be,
    // and would count in the drain report.
    let removed = tokio::time::Instant::now();
    while std::net::TcpListener::bind(addr).is_err() {
        assert!(
            removed.elapsed() < Duration::from_secs(30),
            "the draining listener's socket is still open after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "a drained listener must not accept"
    );
    assert!(
        !transfer.is_finished(),
        "the transfer should still be running during the drain"
    );

    assert_eq!(transfer.await.unwrap().unwrap(), Checksum::of(&payload));
    let report = drain.await.unwrap().unwrap();
    assert_eq!((report.finished, report.forced), (1, 0));
    assert_eq!(observer.endings(), vec![Ending::Completed]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_connections_still_open_at_the_deadline() {
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = server_with(observer.clone());
    let addr = server
        .add_listener(ListenerConfig::new(
            loopback(),
            Route::new("echo", echo.addr),
        ))
        .unwrap();
    let mut idle_client = TcpStream::connect(addr).await.unwrap();
    ping(&mut idle_client).await;

    let started = tokio::time::Instant::now();
    let report = server.shutdown(Duration::from_millis(300)).await;
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!((report.finished, report.forced), (0, 1));
    assert!(closes_within(&mut idle_client, Duration::from_secs(30)).await);
    assert_eq!(observer.endings(), vec![Ending::Cancelled]);
    assert!(matches!(
        server.add_listener(ListenerConfig::new(
            loopback(),
            Route::new("late", echo.addr)
        )),
        Err(ServerError::ShuttingDown)
    ));
}

/// Answers each 4-byte request with the same bytes after `delay`.
async fn slow_echo(delay: Duration) -> SocketAddr {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4];
                while stream.read_exact(&mut request).await.is_ok() {
                    tokio::time::sleep(delay).await;
                    if stream.write_all(&request).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_closes_answered_idle_connections_and_waits_for_pending_answers() {
    // The pending answer comes 2 s into the drain: an idle connection closes long before that
    // (drain idle 20 ms), even on a busy machine; the drain deadline is a minute away.
    let answer_delay = Duration::from_secs(2);
    let upstream = slow_echo(answer_delay).await;
    let observer = Arc::new(CountingObserver::default());
    let config = server_config()
        .with_report_interval(Duration::from_millis(50))
        .with_drain_idle(Duration::from_millis(20));
    let server = ProxyServer::new(config, observer).unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(
            loopback(),
            Route::new("slow", upstream),
        ))
        .unwrap();

    // `answered` got its reply before the drain; `waiting` asks just before it starts.
    let mut answered = TcpStream::connect(addr).await.unwrap();
    ping(&mut answered).await;
    let mut waiting = TcpStream::connect(addr).await.unwrap();
    waiting.write_all(b"wait").await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;

    let started = tokio::time::Instant::now();
    let drain = tokio::spawn(async move { server.shutdown(Duration::from_secs(60)).await });
    // The pending reply is awaited on its own, so each moment is taken as it happens.
    let waiter = tokio::spawn(async move {
        let mut reply = [0u8; 4];
        waiting.read_exact(&mut reply).await.unwrap();
        (reply, started.elapsed(), waiting)
    });
    assert!(
        closes_within(&mut answered, Duration::from_secs(30)).await,
        "an answered, idle connection closes in the drain"
    );
    let answered_closed = started.elapsed();
    let (reply, reply_came, mut waiting) = waiter.await.unwrap();
    eprintln!(
        "answered closed {answered_closed:?}, the pending reply came {reply_came:?} into the drain"
    );
    assert_eq!(
        &reply, b"wait",
        "a pending answer still arrives during the drain"
    );
    assert!(
        answered_closed < reply_came,
        "the idle connection was kept until the pending answer came"
    );
    assert!(closes_within(&mut waiting, Duration::from_secs(30)).await);
    let report = drain.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the drain ends when the connections are idle, not at the deadline"
    );
    assert_eq!((report.closed_idle, report.forced), (2, 0));
}

#[test]
fn a_zero_drain_idle_is_refused() {
    let config = server_config().with_drain_idle(Duration::ZERO);
    assert!(matches!(
        ProxyServer::new(config, Arc::new(NoopObserver)),
        Err(ConfigError::Zero { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_swap_under_load_loses_no_byte_and_sends_new_connections_to_the_new_target() {
    let (old, new) = (echo_server().await, echo_server().await);
    let server = server_with(Arc::new(CountingObserver::default()));
    let relay = RelayConfig::default().with_copy_mode(CopyMode::Auto);
    let addr = server
        .add_listener(
            ListenerConfig::new(loopback(), Route::new("old", old.addr)).with_relay(relay),
        )
        .unwrap();

    // Payloads and checksums first: hashing is slow in debug builds.
    let payloads: Vec<_> = (0..20)
        .map(|_| {
            let payload = random_payload(1 << 20);
            (Checksum::of(&payload), Arc::new(payload))
        })
        .collect();
    let mut transfers = Vec::new();
    for (expected, payload) in payloads {
        let client = TcpStream::connect(addr).await.unwrap();
        // 16 chunks 200 ms apart: each transfer runs for over 3 s, so a busy machine still
        // swaps the route while all run.
        let transfer = tokio::spawn(echo_roundtrip(
            client,
            payload,
            Some(Duration::from_millis(200)),
        ));
        transfers.push((transfer, expected));
    }
    eventually(
        Duration::from_secs(30),
        "all connections reached the old target",
        || old.accepted.load(Ordering::SeqCst) == 20,
    )
    .await;

    server
        .set_route(addr, Route::new("new", new.addr), ExistingConnections::Keep)
        .unwrap();
    assert_eq!(server.listeners()[0].route, "new");
    let running = transfers.iter().filter(|(t, _)| !t.is_finished()).count();
    assert_eq!(
        running, 20,
        "the swap must happen while every transfer runs"
    );
    for _ in 0..5 {
        let mut client = TcpStream::connect(addr).await.unwrap();
        ping(&mut client).await;
    }
    for (transfer, expected) in transfers {
        assert_eq!(transfer.await.unwrap().unwrap(), expected);
    }
    assert_eq!(new.accepted.load(Ordering::SeqCst), 5);
    assert_eq!(old.accepted.load(Ordering::SeqCst), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_swap_can_close_existing_connections() {
    let (old, new) = (echo_server().await, echo_server().await);
    let server = server_with(Arc::new(CountingObserver::default()));
    let addr = server
        .add_listener(ListenerConfig::new(loopback(), Route::new("old", old.addr)))
        .unwrap();
    let mut existing = TcpStream::connect(addr).await.unwrap();
    ping(&mut existing).await;

    server
        .set_route(
            addr,
            Route::new("new", new.addr),
            ExistingConnections::Close,
        )
        .unwrap();
    assert!(closes_within(&mut existing, Duration::from_secs(30)).await);
    let mut fresh = TcpStream::connect(addr).await.unwrap();
    ping(&mut fresh).await;
    assert_eq!(new.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_limit_rejects_the_excess_and_frees_slots() {
    let echo = echo_server().await;
    let observer = Arc::new(CountingObserver::default());
    let server = server_with(observer.clone());
    let config = ListenerConfig::new(loopback(), Route::new("echo", echo.addr))
        .with_max_connections(Some(2));
    let addr = server.add_listener(config).unwrap();

    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    ping(&mut first).await;
    ping(&mut second).await;
    // The reset may arrive before the connect call returns.
    if let Ok(mut third) = TcpStream::connect(addr).await {
        assert!(
            closes_within(&mut third, Duration::from_secs(30)).await,
            "over the limit"
        );
    }
    eventually(Duration::from_secs(30), "rejection counted", || {
        CountingObserver::get(&observer.rejected) == 1
    })
    .await;
    assert_eq!(CountingObserver::get(&observer.rejected), 1);
    assert_eq!(server.listeners()[0].active_connections, 2);

    drop(first);
    eventually(Duration::from_secs(30), "slot freed", || {
        server.listeners()[0].active_connections == 1
    })
    .await;
    let mut fourth = TcpStream::connect(addr).await.unwrap();
    ping(&mut fourth).await;
    ping(&mut second).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_upstream_closes_the_client_and_is_counted_in_prometheus() {
    let mut registry = Registry::default();
    let metrics = Arc::new(PrometheusObserver::register(&mut registry));
    let server = ProxyServer::new(server_config(), metrics).unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(
            loopback(),
            Route::new("down", closed_port().await),
        ))
        .unwrap();
    for _ in 0..3 {
        let mut client = TcpStream::connect(addr).await.unwrap();
        assert!(closes_within(&mut client, Duration::from_secs(30)).await);
    }
    // The listener survives: retarget it and it serves.
    let echo = echo_server().await;
    server
        .set_route(addr, Route::new("up", echo.addr), ExistingConnections::Keep)
        .unwrap();
    let mut client = TcpStream::connect(addr).await.unwrap();
    ping(&mut client).await;
    drop(client);
    server.shutdown(Duration::from_secs(2)).await;

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let labels = |route: &str| format!(r#"listener="{addr}",route="{route}""#);
    for line in [
        format!("proxy_connect_errors_total{{{}}} 3", labels("down")),
        format!(
            r#"proxy_connections_closed_total{{{},ending="connect_failed"}} 3"#,
            labels("down")
        ),
        format!("proxy_connections_total{{{}}} 1", labels("up")),
        format!("proxy_connections_active{{{}}} 0", labels("up")),
        format!(
            r#"proxy_bytes_total{{{},direction="to_client"}} 4"#,
            labels("up")
        ),
        format!(
            r#"proxy_bytes_total{{{},direction="to_upstream"}} 4"#,
            labels("up")
        ),
    ] {
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
    assert!(
        !text.contains("proxy_connect_timeouts_total{"),
        "no timeout happened:\n{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn connect_timeout_is_counted_and_closes_the_client() {
    // A listener whose accept queue is never drained still completes handshakes in the kernel,
    // so a real "no answer" needs a connector that never completes.
    #[derive(Debug)]
    struct Never;
    impl proxy_core::upstream::Connector for Never {
        fn connect(&self) -> futures::future::BoxFuture<'_, std::io::Result<TcpStream>> {
            Box::pin(std::future::pending())
        }
    }
    let observer = Arc::new(CountingObserver::default());
    let server = server_with(observer.clone());
    let relay = RelayConfig::default().with_connect_timeout(Duration::from_secs(3));
    let route = Route::new("never", Upstream::Connector(Arc::new(Never)));
    let addr = server
        .add_listener(ListenerConfig::new(loopback(), route).with_relay(relay))
        .unwrap();
    let started = tokio::time::Instant::now();
    let mut client = TcpStream::connect(addr).await.unwrap();
    assert!(closes_within(&mut client, Duration::from_secs(30)).await);
    assert!(started.elapsed() >= Duration::from_secs(3));
    eventually(Duration::from_secs(30), "closed", || {
        CountingObserver::get(&observer.closed) == 1
    })
    .await;
    assert_eq!(CountingObserver::get(&observer.connect_timeouts), 1);
    assert_eq!(observer.endings(), vec![Ending::ConnectFailed]);
}

/// A backend that writes its name and closes.
async fn named_backend(name: u8) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let _ = conn.write_all(&[name]).await;
        }
    });
    (addr, task)
}

async fn name_of(addr: SocketAddr) -> u8 {
    let mut client = TcpStream::connect(addr).await.unwrap();
    let mut name = [0u8; 1];
    client.read_exact(&mut name).await.unwrap();
    name[0]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_set_round_robins_and_fails_over() {
    let (a, _ta) = named_backend(b'a').await;
    let (b, _tb) = named_backend(b'b').await;
    let down = closed_port().await;
    let set = UpstreamSet::new(vec![a.into(), down.into(), b.into()]).unwrap();
    let server = ProxyServer::new(server_config(), Arc::new(NoopObserver)).unwrap();
    let addr = server
        .add_listener(ListenerConfig::new(
            loopback(),
            Route::new("set", Arc::new(set)),
        ))
        .unwrap();
    let mut names = Vec::new();
    for _ in 0..6 {
        names.push(name_of(addr).await);
    }
    // Round-robin starts at a, down, b, a, down, b; "down" fails over to the next (b).
    assert_eq!(names, b"abbabb");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_mark_targets_down_and_up_and_report_none_healthy() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = listener.local_addr().unwrap();
    drop(listener);
    let check =
        HealthCheck::new(Duration::from_millis(20), Duration::from_millis(500), 2, 2).unwrap();
    let set = Arc::new(
        UpstreamSet::new(vec![TargetAddr::Socket(target)])
            .unwrap()
            .with_health_check(check)
            .unwrap(),
    );
    assert!(set.status()[0].healthy, "targets start healthy");

    let cancel = tokio_util::sync::CancellationToken::new();
    let checks = set.spawn_health_checks(cancel.clone()).unwrap();
    eventually(Duration::from_secs(30), "target marked down", || {
        !set.status()[0].healthy
    })
    .await;
    let error = set.connect(Duration::from_secs(1)).await.unwrap_err();
    assert!(
        matches!(error, ConnectError::NoHealthyTarget { targets: 1 }),
        "{error:?}"
    );

    let revived = TcpListener::bind(target).await.unwrap();
    eventually(Duration::from_secs(30), "target marked up", || {
        set.status()[0].healthy
    })
    .await;
    let (_stream, used) = set.connect(Duration::from_secs(1)).await.unwrap();
    assert_eq!(used, TargetAddr::Socket(target));
    drop(revived);
    cancel.cancel();
    checks.await.unwrap();
}

#[tokio::test]
async fn listeners_are_added_listed_and_removed() {
    let echo = echo_server().await;
    let server = ProxyServer::new(server_config(), Arc::new(NoopObserver)).unwrap();
    let a = server
        .add_listener(ListenerConfig::new(loopback(), Route::new("a", echo.addr)))
        .unwrap();
    let b = server
        .add_listener(ListenerConfig::new(loopback(), Route::new("b", echo.addr)))
        .unwrap();
    let mut listed: Vec<_> = server
        .listeners()
        .into_iter()
        .map(|l| (l.local_addr, l.route))
        .collect();
    listed.sort();
    let mut expected = vec![(a, "a".to_owned()), (b, "b".to_owned())];
    expected.sort();
    assert_eq!(listed, expected);
    assert!(matches!(
        server.add_listener(ListenerConfig::new(a, Route::new("dup", echo.addr))),
        Err(ServerError::ListenerExists(addr)) if addr == a
    ));

    let mut client = TcpStream::connect(a).await.unwrap();
    ping(&mut client).await;
    let connections = server.connections(a).unwrap();
    assert_eq!(connections.len(), 1);
    assert_eq!(
        connections[0].counters.to_client(),
        4,
        "live counters visible from outside"
    );
    drop(client);

    server
        .remove_listener(a, Duration::from_secs(1))
        .await
        .unwrap();
    assert!(
        TcpStream::connect(a).await.is_err(),
        "port closed after removal"
    );
    assert!(matches!(
        server.remove_listener(a, Duration::ZERO).await,
        Err(ServerError::UnknownListener(_))
    ));
    // The freed port can be bound again at once.
    let again = server
        .add_listener(ListenerConfig::new(a, Route::new("again", echo.addr)))
        .unwrap();
    assert_eq!(again, a);
}

#[tokio::test]
async fn listener_in_range_takes_the_first_free_port() {
    let echo = echo_server().await;
    let server = ProxyServer::new(server_config(), Arc::new(NoopObserver)).unwrap();
    // Find two adjacent free ports and occupy the first.
    let (taken, range) = loop {
        let probe = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = probe.local_addr().unwrap().port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).await.is_ok() {
            break (probe, PortRange::new(port, port + 1).unwrap());
        }
    };
    let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let config = ListenerConfig::new(loopback(), Route::new("r", echo.addr));
    let addr = server
        .add_listener_in_range(ip, range, config.clone())
        .unwrap();
    assert_eq!(addr.port(), range.end());
    assert!(matches!(
        server.add_listener_in_range(ip, range, config),
        Err(ServerError::NoFreePort { .. })
    ));
    drop(taken);
}

#[tokio::test]
async fn impossible_configurations_are_typed_errors() {
    let server = ProxyServer::new(server_config(), Arc::new(NoopObserver)).unwrap();
    let route = Route::new("r", closed_port().await);
    let zero_limit = ListenerConfig::new(loopback(), route.clone()).with_max_connections(Some(0));
    assert!(matches!(
        server.add_listener(zero_limit),
        Err(ServerError::Config(ConfigError::Zero {
            what: "max connections"
        }))
    ));
    let zero_timeout = ListenerConfig::new(loopback(), route)
        .with_relay(RelayConfig::default().with_connect_timeout(Duration::ZERO));
    assert!(matches!(
        server.add_listener(zero_timeout),
        Err(ServerError::Config(ConfigError::Zero { .. }))
    ));
    assert!(matches!(
        "10.0.0.1".parse::<Upstream>(),
        Err(ConfigError::InvalidAddress { .. })
    ));
    assert!(matches!(
        "9100-9000".parse::<PortRange>(),
        Err(ConfigError::ReversedPortRange { .. })
    ));
    assert!(server.listeners().is_empty());
}
