//! The Rust client against LocalEngine over loopback TLS.
#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use netkit_testenv::fixtures::FreezableRelay;
use rstream_client::engine::{EngineAuth, LocalControlPlane, LocalEngine};
use rstream_client::frame::FrameError;
use rstream_client::proto::ErrorCode;
use rstream_client::resolve::ControlPlaneOptions;
use rstream_client::tunnel::{TlsMode, TunnelOptions, TunnelProtocol};
use rstream_client::{Client, ClientBuilder, ControlChannel, EngineErrorCode, Error, forward};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[tokio::test]
async fn handshake_details_and_acknowledged_heartbeats() {
    let engine = engine().await;
    let client = builder(&engine)
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap();
    let control = client.connect().await.unwrap();
    assert_eq!(
        control.liveness_timeout(),
        Some(Duration::from_secs(3)),
        "engine grants 3x the interval"
    );
    let details = control.server_details().unwrap();
    assert_eq!(details.agent.as_deref(), Some("local-engine"));
    assert!(control.client_id().starts_with("cli_"));
    let sent = &engine.client_details()[0];
    assert_eq!(sent.agent.as_deref(), Some("rstream-rust"));
    assert_eq!(sent.protocol_version.as_deref(), Some("1.4.5"));
    assert_eq!(sent.token.as_deref(), Some(TOKEN));
    assert_eq!(sent.os.as_deref(), Some(std::env::consts::OS));
    assert_eq!(sent.arch.as_deref(), Some(std::env::consts::ARCH));
    // First heartbeat at once, then every second; each acknowledged.
    assert!(eventually(3, || control.heartbeats_acknowledged() >= 2).await);
    assert!(engine.heartbeats_received() >= 2);
    control.close().await.unwrap();
    assert!(control.is_closed());
    assert!(control.wait_closed().await.is_ok());
    assert!(eventually(2, || engine.control_channels() == 0).await);
    engine.shutdown().await;
}

#[tokio::test]
async fn legacy_mode_without_heartbeats() {
    let engine = engine().await;
    let control = builder(&engine)
        .heartbeat_interval(None)
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap();
    assert_eq!(control.liveness_timeout(), None);
    assert!(engine.client_details().len() == 1);
    // With heartbeats on, the first goes at once and the next 1 s later (the test above): a
    // window of 1.5 s would hold two.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(engine.heartbeats_received(), 0);
    assert!(!control.is_closed());
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn wrong_token_is_unauthorized_and_not_retryable() {
    let engine = engine().await;
    let err = builder(&engine)
        .token("wrong")
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap_err();
    assert_eq!(
        err.engine_code(),
        Some(EngineErrorCode::Unauthorized),
        "{err}"
    );
    assert!(!err.retryable());
    engine.shutdown().await;
}

/// A rotation as an operator does it: the engine accepts the old and the new token, then
/// revokes the old one: the channel logged in with it is closed at once, a channel with the new
/// one stays, and a new login with the old one is refused. Every login is recorded.
#[tokio::test]
async fn a_revoked_token_closes_its_channels_and_is_refused() {
    let engine = LocalEngine::builder()
        .auth(EngineAuth::Tokens(vec!["old".into()]))
        .start()
        .await
        .unwrap();
    let with = |token: &str| builder(&engine).token(token).build().unwrap();
    let old = with("old").connect().await.unwrap();
    let refused = with("new").connect().await.unwrap_err();
    assert_eq!(refused.engine_code(), Some(EngineErrorCode::Unauthorized));
    engine.set_auth(EngineAuth::Tokens(vec!["old".into(), "new".into()]));
    let new = with("new").connect().await.unwrap();
    // Both accepted: nobody is closed.
    assert!(!old.is_closed() && !new.is_closed());
    assert_eq!(engine.control_channels(), 2);

    let revoked = Instant::now();
    engine.set_auth(EngineAuth::Tokens(vec!["new".into()]));
    tokio::time::timeout(Duration::from_secs(30), old.wait_closed())
        .await
        .expect("the channel of the revoked token still open 30 s after the revocation")
        .ok();
    eprintln!(
        "the revoked token's channel closed {:?} after the revocation",
        revoked.elapsed()
    );
    assert!(
        eventually(30, || engine.control_channels() == 1).await,
        "{:?}",
        engine.control_logins()
    );
    assert!(!new.is_closed(), "the new token's channel was closed too");
    let err = with("old").connect().await.unwrap_err();
    assert_eq!(
        err.engine_code(),
        Some(EngineErrorCode::Unauthorized),
        "{err}"
    );

    let logins: Vec<_> = engine
        .control_logins()
        .into_iter()
        .map(|l| (l.token.unwrap_or_default(), l.accepted, l.open))
        .collect();
    let owned = |t: &str, a, o| (t.to_owned(), a, o);
    assert_eq!(
        logins,
        [
            owned("old", true, false),
            owned("new", false, false),
            owned("new", true, true),
            owned("old", false, false),
        ]
    );
    assert!(
        engine.control_logins()[2]
            .client_id
            .as_deref()
            .is_some_and(|id| id == new.client_id())
    );
    new.close().await.unwrap();
    engine.shutdown().await;
}

/// An identity written as JSON and read back serves the same certificate: a client trusting the
/// first engine's CA connects to a second engine started with it (as a restarted process would).
#[tokio::test]
async fn an_identity_read_back_from_json_serves_the_same_certificate() {
    let first = engine().await;
    let json = first.identity().to_json();
    let trusted = first.client_tls();
    let addr = first.addr();
    first.shutdown().await;
    let identity = rstream_client::engine::EngineIdentity::from_json(&json).unwrap();
    let second = LocalEngine::builder()
        .bind(addr)
        .identity(identity)
        .token(TOKEN)
        .start()
        .await
        .unwrap();
    let control = builder(&second)
        .tls(trusted)
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap();
    control.close().await.unwrap();
    assert!(rstream_client::engine::EngineIdentity::from_json("{}").is_err());
    second.shutdown().await;
}

#[tokio::test]
async fn expired_token_is_reported_before_connecting() {
    use base64::Engine as _;
    let engine = engine().await;
    let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let expired = format!(
        "{}.{}.sig",
        b(r#"{"alg":"ES512"}"#),
        b(r#"{"type":"pat","exp":1700000000}"#)
    );
    let err = builder(&engine).token(expired).build().unwrap_err();
    assert!(matches!(err, Error::TokenExpired), "{err}");
    assert!(
        engine.client_details().is_empty(),
        "nothing reached the engine"
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn published_tcp_and_tls_tunnels_relay_bytes_exactly() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let target = echo_server().await;
    for (opts, suffix) in [
        (TunnelOptions::tcp().label("app", "echo"), "(tcp)"),
        (
            TunnelOptions::tls()
                .tls_mode(TlsMode::Passthrough)
                .name("tls-echo"),
            "(tls)",
        ),
    ] {
        let mut tunnel = control.create_tunnel(opts).await.unwrap();
        let ingress = engine.ingress_addr(tunnel.id()).unwrap();
        assert_eq!(
            tunnel.forwarding_address().unwrap(),
            format!("127.0.0.1:{} {suffix}", ingress.port())
        );
        assert!(tunnel.properties().creation_date.is_some());
        let fwd =
            tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
        let data = random_bytes(1 << 20);
        let back = within(20, roundtrip(ingress, &data)).await;
        assert_eq!(back.len(), data.len());
        assert!(back == data, "echo differs");
        // Several concurrent streams.
        let mut set = tokio::task::JoinSet::new();
        for i in 0..8u8 {
            set.spawn(async move {
                let data = vec![i; 10_000 + usize::from(i)];
                assert_eq!(roundtrip(ingress, &data).await, data);
            });
        }
        within(20, async {
            while let Some(r) = set.join_next().await {
                r.unwrap();
            }
        })
        .await;
        fwd.abort();
    }
    let labels = &engine.tunnel_requests()[0].labels;
    assert_eq!(labels.get("app").map(String::as_str), Some("echo"));
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn http_tunnel_serves_a_request() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control
        .create_tunnel(TunnelOptions::http().name("web"))
        .await
        .unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    assert_eq!(
        tunnel.forwarding_address().unwrap(),
        format!("https://127.0.0.1:{}", ingress.port())
    );
    let target = http_server("hello from target").await;
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
    let response = within(
        10,
        roundtrip(ingress, b"GET / HTTP/1.1\r\nHost: web\r\n\r\n"),
    )
    .await;
    let text = String::from_utf8(response).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    assert!(text.ends_with("hello from target"), "{text}");
    fwd.abort();
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn accepted_stream_carries_source_ip_and_stream_id() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let mut down = TcpStream::connect(ingress).await.unwrap();
    down.write_all(b"hi").await.unwrap();
    let mut stream = within(5, tunnel.accept()).await.unwrap();
    assert_eq!(stream.remote_ip(), Some("127.0.0.1".parse().unwrap()));
    assert_eq!(stream.tunnel_id(), Some(tunnel.id()));
    assert!(stream.stream_id().is_some_and(|s| s.len() >= 24));
    let mut buf = [0u8; 2];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hi");
    // Delivery is confirmed to the engine with a ProxyConnRsp without error.
    assert!(
        eventually(2, || engine
            .proxy_conn_rsps()
            .iter()
            .any(|r| r.error.is_none()))
        .await
    );
    // The proxy leg authenticated with the per-stream secret, not the user token.
    let leg = engine.client_details().into_iter().last().unwrap();
    assert_ne!(leg.token.as_deref(), Some(TOKEN));
    assert!(leg.token.is_some());
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn private_dial_by_name_and_id() {
    let engine = engine().await;
    let owner = client(&engine).connect().await.unwrap();
    let mut tunnel = owner
        .create_tunnel(TunnelOptions::private("db"))
        .await
        .unwrap();
    assert_eq!(
        tunnel.forwarding_address().unwrap(),
        "rstrm://db (unpublished)"
    );
    assert_eq!(engine.ingress_addr(tunnel.id()), None);
    let id = tunnel.id().to_owned();
    let target = echo_server().await;
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
    let dialer = client(&engine);
    for (name, zero_rtt) in [("db", true), (id.as_str(), false)] {
        let mut s = within(5, dialer.dial_with(name, zero_rtt)).await.unwrap();
        assert_eq!(s.stream_id().is_some(), !zero_rtt);
        let data = random_bytes(100_000);
        s.write_all(&data).await.unwrap();
        s.shutdown().await.unwrap();
        let mut back = Vec::new();
        within(10, s.read_to_end(&mut back)).await.unwrap();
        assert!(back == data);
    }
    fwd.abort();
    owner.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn dial_of_a_missing_tunnel() {
    let engine = engine().await;
    let c = client(&engine);
    let err = c.dial_with("nope", false).await.unwrap_err();
    assert_eq!(
        err.engine_code(),
        Some(EngineErrorCode::TunnelNotFound),
        "{err}"
    );
    // Zero-RTT: the failure shows as the connection closing.
    let mut s = c.dial_with("nope", true).await.unwrap();
    let mut buf = Vec::new();
    let n = within(5, s.read_to_end(&mut buf)).await.unwrap_or(0);
    assert_eq!(n, 0);
    assert!(matches!(c.dial("  ").await, Err(Error::InvalidTunnel(_))));
    engine.shutdown().await;
}

#[tokio::test]
async fn bytes_coalesced_with_response_frames_are_delivered() {
    let engine = engine().await;
    let c = builder(&engine).zero_rtt(false).build().unwrap();
    let owner = c.connect().await.unwrap();
    let mut tunnel = owner.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();

    // ProxyRsp + payload in one write: the owner's stream must yield the payload first.
    *engine.faults().coalesce_proxy_rsp.lock().unwrap() =
        Some(bytes::Bytes::from_static(b"early|"));
    let mut down = TcpStream::connect(ingress).await.unwrap();
    down.write_all(b"late").await.unwrap();
    let mut s = within(5, tunnel.accept()).await.unwrap();
    let mut buf = [0u8; 10];
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"early|late");

    // StreamRsp + payload in one write on a private dial.
    let mut priv_tunnel = owner
        .create_tunnel(TunnelOptions::private("p"))
        .await
        .unwrap();
    *engine.faults().coalesce_stream_rsp.lock().unwrap() =
        Some(bytes::Bytes::from_static(b"head|"));
    let dial = tokio::spawn({
        let c = c.clone();
        async move { c.dial_with("p", false).await }
    });
    let mut owner_side = within(5, priv_tunnel.accept()).await.unwrap();
    let mut dialer = dial.await.unwrap().unwrap();
    owner_side.write_all(b"body").await.unwrap();
    let mut buf = [0u8; 9];
    dialer.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"head|body");
    owner.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn tunnel_close_solicited_and_unsolicited() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut a = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let mut b = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    assert_eq!(engine.tunnels().len(), 2);
    // Concurrent closes share one request.
    let (r1, r2) = tokio::join!(a.close(), control.close_tunnel(a.id()));
    r1.unwrap();
    r2.unwrap();
    assert!(matches!(
        within(2, a.accept()).await,
        Err(Error::TunnelClosed)
    ));
    assert!(a.close().await.is_ok(), "closing twice is fine");
    assert!(engine.close_tunnel(b.id()).await);
    assert!(matches!(
        within(2, b.accept()).await,
        Err(Error::TunnelClosed)
    ));
    assert!(b.is_closed());
    assert!(engine.tunnels().is_empty());
    assert!(!control.is_closed(), "the channel survives tunnel closes");
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn concurrent_creates_and_owner_departure() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut set = tokio::task::JoinSet::new();
    for i in 0..24 {
        let control = control.clone();
        set.spawn(async move {
            control
                .create_tunnel(TunnelOptions::private(format!("t{i}")))
                .await
        });
    }
    let mut ids = std::collections::HashSet::new();
    while let Some(r) = set.join_next().await {
        ids.insert(r.unwrap().unwrap().id().to_owned());
    }
    assert_eq!(ids.len(), 24);
    assert_eq!(engine.tunnels().len(), 24);
    control.close().await.unwrap();
    assert!(
        eventually(2, || engine.tunnels().is_empty()).await,
        "the engine drops the owner's tunnels"
    );
    assert!(matches!(
        control.create_tunnel(TunnelOptions::tcp()).await,
        Err(Error::ControlClosed)
    ));
    engine.shutdown().await;
}

#[tokio::test]
async fn engine_error_replies_are_typed() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    *engine.faults().open_tunnel_error.lock().unwrap() =
        Some((ErrorCode::FeatureNotAvailable, "plan".into()));
    let err = control
        .create_tunnel(TunnelOptions::tcp())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Engine { code: EngineErrorCode::FeatureNotAvailable, message } if message == "plan")
    );
    assert!(!err.retryable());
    *engine.faults().open_tunnel_error.lock().unwrap() = None;
    // Engine-side validation: a duplicate stable hostname is transient.
    let _a = control
        .create_tunnel(TunnelOptions::http().hostname("r1-app.t.example.io"))
        .await
        .unwrap();
    let err = control
        .create_tunnel(TunnelOptions::http().hostname("r1-app.t.example.io"))
        .await
        .unwrap_err();
    assert_eq!(err.engine_code(), Some(EngineErrorCode::InvalidRequest));
    assert!(err.retryable(), "hostname in use is transient");
    *engine.faults().open_control_error.lock().unwrap() =
        Some((ErrorCode::CapacityExhausted, "full".into()));
    let err = client(&engine).connect().await.unwrap_err();
    assert_eq!(err.engine_code(), Some(EngineErrorCode::CapacityExhausted));
    assert!(err.retryable());
    *engine.faults().stream_error.lock().unwrap() =
        Some((ErrorCode::FeatureNotAvailable, "no private".into()));
    let err = client(&engine).dial_with("x", false).await.unwrap_err();
    assert_eq!(
        err.engine_code(),
        Some(EngineErrorCode::FeatureNotAvailable)
    );
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn invalid_options_never_reach_the_engine() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    assert!(matches!(
        control
            .create_tunnel(TunnelOptions::tcp().publish(false))
            .await,
        Err(Error::InvalidTunnelOptions(_))
    ));
    assert!(matches!(
        control
            .create_tunnel(TunnelOptions::new().protocol(TunnelProtocol::Quic))
            .await,
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        control
            .create_tunnel(TunnelOptions::private("x").trusted_ips(["10.0.0.0/8"]))
            .await,
        Err(Error::InvalidTunnelOptions(_))
    ));
    assert!(engine.tunnel_requests().is_empty());
    // A requested TCP port is honoured.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = control
        .create_tunnel(TunnelOptions::tcp().port(u32::from(free)))
        .await
        .unwrap();
    assert_eq!(t.properties().port, Some(u32::from(free)));
    assert_eq!(engine.ingress_addr(t.id()).unwrap().port(), free);
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn accepted_stream_survives_control_channel_loss() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let mut down = TcpStream::connect(ingress).await.unwrap();
    down.write_all(b"one").await.unwrap();
    let mut stream = within(5, tunnel.accept()).await.unwrap();
    let mut buf = [0u8; 3];
    stream.read_exact(&mut buf).await.unwrap();

    engine.drop_control_channels();
    let err = within(5, control.wait_closed()).await.unwrap_err();
    assert!(err.retryable(), "{err}");
    assert!(matches!(within(2, tunnel.accept()).await, Err(e) if e.retryable()));

    // The data connection is independent of the control channel.
    down.write_all(b"two").await.unwrap();
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"two");
    stream.write_all(b"back").await.unwrap();
    let mut back = [0u8; 4];
    down.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"back");
    engine.shutdown().await;
}

#[tokio::test]
async fn missing_heartbeat_acks_are_detected_within_the_negotiated_timeout() {
    let engine = LocalEngine::builder()
        .token(TOKEN)
        .liveness_timeout(Duration::from_millis(1500))
        .start()
        .await
        .unwrap();
    let control = heartbeating(builder(&engine)).await;
    assert_eq!(
        control.liveness_timeout(),
        Some(Duration::from_millis(1500))
    );
    assert!(eventually(2, || control.heartbeats_acknowledged() >= 1).await);
    engine
        .faults()
        .stop_acking_heartbeats
        .store(true, Ordering::SeqCst);
    let started = Instant::now();
    let err = within(5, control.wait_closed()).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        matches!(err, Error::ControlLiveness(d) if d == Duration::from_millis(1500)),
        "{err}"
    );
    // The error names the liveness timeout: that is what detected it. How soon is a latency
    // figure, reported here, not bounded (a busy machine delays timers).
    eprintln!(
        "liveness loss detected {elapsed:?} after the acknowledgements stopped (timeout 1.5 s)"
    );
    assert!(err.retryable());
    engine.shutdown().await;
}

/// A control channel of `builder`'s client that sends a heartbeat every second.
async fn heartbeating(builder: ClientBuilder) -> ControlChannel {
    builder
        .heartbeat_interval(Some(Duration::from_secs(1)))
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_silent_client_is_closed_after_the_liveness_timeout_and_frees_its_hostname() {
    let engine = engine().await;
    let relay = FreezableRelay::start(engine.addr()).await.unwrap();
    let control = heartbeating(builder(&engine).engine(relay.addr().to_string())).await;
    let hostname = "lost.t.example.io";
    let _tunnel = control
        .create_tunnel(TunnelOptions::http().hostname(hostname))
        .await
        .unwrap();
    // Heartbeats keep the channel open well past the 3 s timeout.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(engine.control_channels(), 1);
    assert_eq!(engine.silent_channels_closed(), 0);
    relay.freeze_open_connections();
    let started = Instant::now();
    assert!(eventually(20, || engine.control_channels() == 0).await);
    eprintln!(
        "the engine closed the silent channel {:?} after the freeze (timeout 3 s)",
        started.elapsed()
    );
    assert_eq!(engine.silent_channels_closed(), 1);
    // Its hostname is free: another client takes it.
    let other = client(&engine).connect().await.unwrap();
    other
        .create_tunnel(TunnelOptions::http().hostname(hostname))
        .await
        .unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn stalled_engine_is_detected() {
    let engine = LocalEngine::builder()
        .token(TOKEN)
        .liveness_timeout(Duration::from_millis(1200))
        .start()
        .await
        .unwrap();
    let control = heartbeating(builder(&engine)).await;
    engine.faults().stall_control.store(true, Ordering::SeqCst);
    let err = within(5, control.wait_closed()).await.unwrap_err();
    assert!(matches!(err, Error::ControlLiveness(_)), "{err}");
    engine.shutdown().await;
}

#[tokio::test]
async fn malformed_and_oversized_frames_are_protocol_errors() {
    let engine = engine().await;
    let c = client(&engine);
    let control = c.connect().await.unwrap();
    engine.send_malformed_frame();
    let err = within(5, control.wait_closed()).await.unwrap_err();
    assert!(matches!(err, Error::Frame(FrameError::Decode(_))), "{err}");
    assert!(!err.retryable());

    let control = c.connect().await.unwrap();
    engine.send_oversized_frame();
    let err = within(5, control.wait_closed()).await.unwrap_err();
    assert!(
        matches!(err, Error::Frame(FrameError::TooLarge { len: 65_536 })),
        "{err}"
    );

    // An ack for a heartbeat never sent ("from the future") is a protocol violation.
    let control = c.connect().await.unwrap();
    engine.send_raw(bytes::Bytes::from_static(&[
        0, 0, 0, 4, 0x7a, 0x02, 0x10, 0x63,
    ]));
    let err = within(5, control.wait_closed()).await.unwrap_err();
    assert!(matches!(err, Error::Protocol(_)), "{err}");

    // Unknown and empty messages are ignored; a server message is logged. The engine writes
    // them before its answer to the tunnel request that follows, so once that answer has come
    // back the client has read both: the channel still works and the message is in the log.
    let log = LogCapture::default();
    let _guard = tracing::subscriber::set_default(log.clone());
    let control = c.connect().await.unwrap();
    engine.send_raw(bytes::Bytes::from_static(&[
        0, 0, 0, 0, 0, 0, 0, 3, 0x9a, 0x06, 0x00,
    ]));
    engine.send_server_message("maintenance soon");
    let tunnel = within(
        5,
        control.create_tunnel(TunnelOptions::private("after-unknown")),
    )
    .await
    .unwrap();
    assert!(!control.is_closed());
    let lines = log.lines();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("engine message") && l.contains("maintenance soon")),
        "the server message is not in the log: {lines:?}"
    );
    tunnel.close().await.unwrap();
    control.close().await.unwrap();
    engine.shutdown().await;
}

/// A `tracing` subscriber that keeps every event's fields as one line, for tests that check
/// what the client logs (set with `tracing::subscriber::set_default` on a current-thread test,
/// where the client's tasks run too).
#[derive(Clone, Default)]
struct LogCapture(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl LogCapture {
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

impl tracing::Subscriber for LogCapture {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!("{}={value:?} ", field.name()));
            }
        }
        let mut line = Line(format!("{} ", event.metadata().level()));
        event.record(&mut line);
        self.0.lock().unwrap().push(line.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test]
async fn wrong_alpn_is_rejected_both_ways() {
    // An engine that does not speak rstrm/1.
    let h2_only = LocalEngine::builder()
        .alpn(vec![b"h2".to_vec()])
        .start()
        .await
        .unwrap();
    let err = client(&h2_only).connect().await.unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
    // The TLS alert is the cause, not part of the message.
    let chain = error_chain(&err);
    assert!(
        chain.to_lowercase().contains("application protocol") || chain.contains("alert"),
        "{chain}"
    );
    h2_only.shutdown().await;

    // A client offering another ALPN to a real engine.
    let engine = engine().await;
    let mut cfg = (*rstream_client::tls::client_config(&engine.client_tls()).unwrap()).clone();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(engine.addr()).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let r = tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        .connect(name, tcp)
        .await;
    assert!(r.is_err(), "the engine must refuse a foreign ALPN");
    engine.shutdown().await;
}

#[tokio::test]
async fn mtls_is_the_alternative_to_a_token() {
    let engine = LocalEngine::builder()
        .require_client_certificates(true)
        .auth(EngineAuth::NoToken)
        .start()
        .await
        .unwrap();
    let identity = engine.identity().issue_client_identity("agent-1").unwrap();
    let base = || {
        Client::builder()
            .engine(engine.engine_address())
            .operation_timeout(Duration::from_secs(5))
    };
    let with_cert = base()
        .tls(engine.client_tls().client_identity(identity.clone()))
        .build()
        .unwrap();
    let control = with_cert.connect().await.unwrap();
    assert_eq!(
        engine.client_details()[0].token,
        None,
        "no token is sent with mTLS"
    );
    control.close().await.unwrap();
    assert!(
        base()
            .tls(engine.client_tls())
            .build()
            .unwrap()
            .connect()
            .await
            .is_err(),
        "no certificate"
    );
    let both = base()
        .token("t")
        .tls(engine.client_tls().client_identity(identity))
        .build();
    assert!(matches!(both, Err(Error::AuthConflict)));
    engine.shutdown().await;
}

#[tokio::test]
async fn project_endpoint_resolution_through_the_control_plane() {
    let engine = engine().await;
    let port = engine.addr().port();
    // "127" + "0.0.1" rebuilds 127.0.0.1 with valid DNS labels.
    let project = serde_json::json!({"id": "p1", "endpoint": "127", "domain": "0.0.1", "enginePort": port,
        "routing": "global", "regionalEndpoints": [
            {"provider": "local", "region": "lo-1", "domain": "0.0.1", "enginePort": port}]});
    let cp = LocalControlPlane::builder()
        .token(TOKEN)
        .project("my proj", project)
        .redirect("moved", "http://127.0.0.1:1/elsewhere")
        .start()
        .await
        .unwrap();
    let base = |endpoint: &str| {
        Client::builder()
            .project_endpoint(endpoint)
            .control_plane(
                ControlPlaneOptions::new(cp.url())
                    .header("X-Team", "netkit")
                    .unwrap(),
            )
            .token(TOKEN)
            .tls(engine.client_tls())
    };
    let c = base("my proj").build().unwrap();
    assert_eq!(
        c.resolve_engine().await.unwrap().to_string(),
        engine.engine_address()
    );
    let control = c.connect().await.unwrap();
    control.close().await.unwrap();
    let (path, auth) = cp.requests()[0].clone();
    assert_eq!(path, "/api/projects/tunnels/resolve/my%20proj");
    assert_eq!(auth.as_deref(), Some(format!("Bearer {TOKEN}").as_str()));

    assert_eq!(
        base("my proj")
            .region("LO-1")
            .build()
            .unwrap()
            .resolve_engine()
            .await
            .unwrap()
            .port(),
        port
    );
    let err = base("my proj")
        .region("eu-9")
        .build()
        .unwrap()
        .resolve_engine()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::RegionUnavailable { available, .. } if available == &["lo-1"]),
        "{err}"
    );
    let err = base("moved")
        .build()
        .unwrap()
        .resolve_engine()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::ApiHttp { status: 302, .. }),
        "redirects are not followed: {err}"
    );
    let err = base("missing")
        .build()
        .unwrap()
        .resolve_engine()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ApiHttp { status: 404, .. }), "{err}");
    let err = base("my proj")
        .token("bad")
        .build()
        .unwrap()
        .resolve_engine()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ApiHttp { status: 401, .. }), "{err}");
    assert_eq!(
        cp.requests().len(),
        7,
        "one request per resolution, none for the redirect target"
    );
    cp.shutdown().await;
    engine.shutdown().await;
}

#[tokio::test]
async fn inbound_request_floods_are_bounded() {
    let engine = engine().await;
    // Without zero-RTT the engine's refusal of the unknown streams reaches the client.
    let c = builder(&engine)
        .zero_rtt(false)
        .max_concurrent_dials(1)
        .max_queued_streams(2)
        .build()
        .unwrap();
    let control = c.connect().await.unwrap();
    let tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    *engine.faults().stall_tls_handshake.lock().unwrap() = Some(Duration::from_millis(300));
    engine.flood_proxy_conn_reqs(tunnel.id(), 20);
    assert!(
        eventually(15, || engine.proxy_conn_rsps().len() == 20).await,
        "every request is answered"
    );
    let rsps = engine.proxy_conn_rsps();
    let full = rsps
        .iter()
        .filter(|r| {
            r.error.as_ref().and_then(|e| e.message.as_deref())
                == Some("proxy connection queue is full")
        })
        .count();
    assert!(full >= 10, "most of the burst is refused, got {full}");
    assert!(
        rsps.iter().all(|r| r.error.is_some()),
        "streams unknown to the engine all fail"
    );
    assert!(!control.is_closed(), "the control channel survives a flood");
    *engine.faults().stall_tls_handshake.lock().unwrap() = None;
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn redirected_proxy_endpoint_is_dialed() {
    let engine = LocalEngine::builder()
        .token(TOKEN)
        .redirect_proxy_legs(true)
        .start()
        .await
        .unwrap();
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let target = echo_server().await;
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
    assert_eq!(
        within(10, roundtrip(ingress, b"redirected")).await,
        b"redirected"
    );
    assert_eq!(engine.redirected_legs(), 1);
    fwd.abort();
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test(flavor = "current_thread")]
async fn no_task_or_connection_leaks_after_shutdown() {
    let metrics = tokio::runtime::Handle::current().metrics();
    let baseline = metrics.num_alive_tasks();
    let engine = engine().await;
    let c = client(&engine);
    let control = c.connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let target = echo_server().await;
    let after_echo = metrics.num_alive_tasks();
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
    for _ in 0..5 {
        assert_eq!(within(10, roundtrip(ingress, b"abc")).await, b"abc");
    }
    let mut s = c.dial_with("missing", true).await.unwrap();
    let _ = s.read(&mut [0u8; 1]).await;
    drop(s);
    control.close().await.unwrap();
    within(5, fwd).await.unwrap().unwrap();
    assert!(
        eventually(5, || engine.open_connections() == 0).await,
        "engine still sees {} connections",
        engine.open_connections()
    );
    engine.shutdown().await;
    // Only the echo server's accept loop remains.
    assert!(
        eventually(5, || metrics.num_alive_tasks()
            <= after_echo.max(baseline + 1))
        .await,
        "alive tasks: {} (baseline {baseline}, with echo {after_echo})",
        metrics.num_alive_tasks()
    );
}

#[tokio::test]
async fn a_proxy_dial_that_times_out_is_retried_once() {
    let engine = engine().await;
    let client = builder(&engine)
        .connect_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let control = client.connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let target = echo_server().await;
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });

    // The first data dial hangs in its TLS handshake; the second attempt carries the stream.
    engine
        .faults()
        .hang_next_tls_handshakes
        .store(1, Ordering::SeqCst);
    assert_eq!(within(20, roundtrip(ingress, b"retried")).await, b"retried");
    assert_eq!(
        engine
            .faults()
            .hang_next_tls_handshakes
            .load(Ordering::SeqCst),
        0
    );

    // Two timeouts in a row: the stream fails and the engine hears why.
    engine
        .faults()
        .hang_next_tls_handshakes
        .store(2, Ordering::SeqCst);
    let before = engine.proxy_conn_rsps().len();
    let lost = within(20, async {
        let mut down = TcpStream::connect(ingress).await.unwrap();
        let _ = down.write_all(b"lost").await;
        let mut back = Vec::new();
        down.read_to_end(&mut back).await.map(|_| back)
    })
    .await;
    // The engine ends the downstream connection (a reset or an empty close): no echo.
    assert!(
        lost.as_ref().map_or(true, Vec::is_empty),
        "no echo without a data connection: {lost:?}"
    );
    assert!(
        eventually(5, || engine
            .proxy_conn_rsps()
            .iter()
            .skip(before)
            .any(|r| r.error.is_some()))
        .await
    );
    assert_eq!(
        engine
            .faults()
            .hang_next_tls_handshakes
            .load(Ordering::SeqCst),
        0,
        "exactly two attempts"
    );
    fwd.abort();
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn upstream_tls_reaches_the_engine_with_its_deprecated_twin() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let tunnel = control
        .create_tunnel(TunnelOptions::http().upstream_tls(true))
        .await
        .unwrap();
    let sent = &engine.tunnel_requests()[0];
    assert_eq!(sent.upstream_tls, Some(true));
    assert_eq!(sent.http_use_tls, Some(true));
    tunnel.close().await.unwrap();
    control.close().await.unwrap();
    engine.shutdown().await;
}

/// Run by `client_from_env_reads_the_process_environment` in a child process whose environment
/// it sets (this process's environment cannot be changed safely).
#[tokio::test]
#[ignore = "run by client_from_env_reads_the_process_environment"]
async fn client_from_env_child() {
    let engine = std::env::var("RSTREAM_ENGINE").unwrap();
    let client = Client::from_env().unwrap();
    assert_eq!(client.resolve_engine().await.unwrap().to_string(), engine);
    // The token came from RSTREAM_AUTHENTICATION_TOKEN: a direct client without one is refused
    // by the engine, this one is not (its CA is not trusted, so the TLS handshake is what fails).
    let err = client.connect().await.unwrap_err();
    assert!(
        matches!(err, Error::Connect { .. }),
        "a TLS failure, not a configuration one: {err:?}"
    );
}

#[tokio::test]
async fn client_from_env_reads_the_process_environment() {
    let engine = engine().await;
    let exe = std::env::current_exe().unwrap();
    let mut command = std::process::Command::new(exe);
    command
        .args(["--exact", "client_from_env_child", "--ignored"])
        .env("RSTREAM_ENGINE", engine.engine_address())
        .env("RSTREAM_AUTHENTICATION_TOKEN", TOKEN);
    for name in rstream_client::client::ENV_VARS {
        if !name.starts_with("RSTREAM_ENGINE") && *name != "RSTREAM_AUTHENTICATION_TOKEN" {
            command.env_remove(name);
        }
    }
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");

    // A QUIC transport in the environment is refused before anything is dialled.
    let lookup = |name: &str| (name == "RSTREAM_TUNNEL_TRANSPORT").then(|| "quic".to_owned());
    assert!(matches!(
        rstream_client::ClientBuilder::from_vars(lookup),
        Err(Error::Unsupported(_))
    ));
    engine.shutdown().await;
}

#[tokio::test]
async fn local_address_and_ip_family_shape_engine_connections() {
    let engine = engine().await;
    let control = client(&engine).connect().await.unwrap();
    let mut tunnel = control
        .create_tunnel(TunnelOptions::private("shaped"))
        .await
        .unwrap();
    // A dialer bound to 127.0.0.2: the engine sees that source.
    let dialer = builder(&engine)
        .ip_family(rstream_client::IpFamily::V4)
        .local_address("127.0.0.2".parse().unwrap())
        .build()
        .unwrap();
    let mut down = dialer.dial("shaped").await.unwrap();
    down.write_all(b"hi").await.unwrap();
    let mut stream = within(5, tunnel.accept()).await.unwrap();
    assert_eq!(stream.remote_ip(), Some("127.0.0.2".parse().unwrap()));
    let mut buf = [0u8; 2];
    stream.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"hi");

    // The engine has only an IPv4 address: IPv6 only finds nothing to dial.
    let err = builder(&engine)
        .ip_family(rstream_client::IpFamily::V6)
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Connect { .. }) && error_chain(&err).contains("no V6 address"),
        "{err:?}"
    );
    // A local address of the other family is a configuration error.
    let err = builder(&engine)
        .ip_family(rstream_client::IpFamily::V6)
        .local_address("127.0.0.1".parse().unwrap())
        .build()
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err:?}");
    control.close().await.unwrap();
    engine.shutdown().await;
}

/// `err` and its causes, as a binary prints them: a message leaves its cause to `source()`.
fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(current) = cause {
        text.push_str(": ");
        text.push_str(&current.to_string());
        cause = current.source();
    }
    text
}
