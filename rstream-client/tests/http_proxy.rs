//! The client reaching LocalEngine and the control plane through a real HTTP proxy (Debian's
//! tinyproxy, started per test; `apt-get install -y tinyproxy`).
#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use common::*;
use netkit_testenv::fixtures::{Tinyproxy, TinyproxyConfig};
use proxy_core::http_connect::HttpConnectError;
use rstream_client::engine::LocalControlPlane;
use rstream_client::resolve::ControlPlaneOptions;
use rstream_client::tunnel::TunnelOptions;
use rstream_client::{Client, Error, HttpProxy, forward};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn tinyproxy(basic_auth: Option<(&str, &str)>, connect_ports: &[u16]) -> Tinyproxy {
    Tinyproxy::start(&TinyproxyConfig {
        basic_auth: basic_auth.map(|(u, p)| (u.to_owned(), p.to_owned())),
        connect_ports: connect_ports.to_vec(),
    })
    .await
    .unwrap()
}

/// Writes `data` and reads as many bytes back, without half-closing (tinyproxy ends the whole
/// tunnel on a FIN).
async fn echo_exact(addr: SocketAddr, data: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let (mut r, mut w) = s.split();
    let mut back = vec![0u8; data.len()];
    let (wrote, read) = tokio::join!(w.write_all(data), r.read_exact(&mut back));
    wrote.unwrap();
    read.unwrap();
    back
}

#[tokio::test]
async fn tunnel_and_streams_go_through_tinyproxy_with_credentials() {
    let engine = engine().await;
    let tiny = tinyproxy(Some(("alice", "s3cret")), &[engine.addr().port()]).await;
    let proxy: HttpProxy = format!("http://alice:s3cret@{}", tiny.addr())
        .parse()
        .unwrap();
    let client = builder(&engine).proxy(proxy).build().unwrap();
    let control = client.connect().await.unwrap();
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let ingress = engine.ingress_addr(tunnel.id()).unwrap();
    let target = echo_server().await;
    let fwd = tokio::spawn(async move { forward::forward(&mut tunnel, &target.to_string()).await });
    let data = random_bytes(256 * 1024);
    let back = within(20, echo_exact(ingress, &data)).await;
    assert!(back == data, "the echo through the tunnel differs");
    // The control channel and the stream's data connection both went through the proxy.
    let connects = tiny
        .logs()
        .matches(&format!("CONNECT {}", engine.engine_address()))
        .count();
    assert!(connects >= 2, "{}", tiny.logs());
    fwd.abort();
    control.close().await.unwrap();
    engine.shutdown().await;
}

#[tokio::test]
async fn control_plane_lookup_goes_through_the_proxy() {
    let engine = engine().await;
    let port = engine.addr().port();
    let project = serde_json::json!({"endpoint": "127", "domain": "0.0.1", "enginePort": port});
    let cp = LocalControlPlane::builder()
        .token(TOKEN)
        .project("proj", project)
        .start()
        .await
        .unwrap();
    let cp_port: u16 = cp.url().rsplit(':').next().unwrap().parse().unwrap();
    // CONNECT is allowed to the control plane only: the lookup must use the proxy.
    let tiny = tinyproxy(None, &[cp_port]).await;
    let proxy: HttpProxy = tiny.url().parse().unwrap();
    let client = Client::builder()
        .project_endpoint("proj")
        .control_plane(ControlPlaneOptions::new(cp.url()).proxy(proxy))
        .token(TOKEN)
        .tls(engine.client_tls())
        .build()
        .unwrap();
    assert_eq!(
        client.resolve_engine().await.unwrap().to_string(),
        engine.engine_address()
    );
    assert_eq!(cp.requests().len(), 1);
    assert!(
        tiny.logs()
            .contains(&format!("CONNECT 127.0.0.1:{cp_port}")),
        "{}",
        tiny.logs()
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn proxy_refusals_are_typed_errors() {
    let engine = engine().await;
    let tiny = tinyproxy(Some(("alice", "s3cret")), &[engine.addr().port()]).await;
    let addr = tiny.addr();
    for (url, sent) in [
        (format!("http://{addr}"), false),
        (format!("http://alice:wrong@{addr}"), true),
    ] {
        let err = builder(&engine)
            .proxy(url.parse().unwrap())
            .build()
            .unwrap()
            .connect()
            .await
            .unwrap_err();
        match &err {
            Error::Proxy { cause } => assert!(
                matches!(
                    cause.as_ref(),
                    HttpConnectError::CredentialsRequired { credentials_sent, .. }
                        if *credentials_sent == sent
                ),
                "{cause:?}"
            ),
            other => panic!("{url}: expected a proxy error, got {other:?}"),
        }
        assert!(err.to_string().contains("requires credentials"), "{err}");
        assert!(!err.retryable(), "credentials do not fix themselves");
    }
    // A proxy that may not reach the engine's port answers 403.
    let refusing = tinyproxy(None, &[engine.addr().port().wrapping_add(1).max(1)]).await;
    let err = builder(&engine)
        .proxy(refusing.url().parse().unwrap())
        .build()
        .unwrap()
        .connect()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Proxy { cause } if matches!(cause.as_ref(), HttpConnectError::Refused { .. })),
        "{err:?}"
    );
    assert!(err.to_string().contains("403"), "{err}");
    assert_eq!(engine.control_channels(), 0);
    engine.shutdown().await;
}

#[tokio::test]
async fn the_local_address_is_used_for_the_proxy_connection() {
    let engine = engine().await;
    let tiny = tinyproxy(None, &[engine.addr().port()]).await;
    let through = |local: &str| {
        builder(&engine)
            .proxy(tiny.url().parse().unwrap())
            .ip_family(rstream_client::IpFamily::V4)
            .local_address(local.parse().unwrap())
            .build()
            .unwrap()
    };
    let control = through("127.0.0.1").connect().await.unwrap();
    control.close().await.unwrap();
    // tinyproxy allows 127.0.0.1 only: from 127.0.0.2 it turns the client away.
    let err = through("127.0.0.2").connect().await.unwrap_err();
    assert!(matches!(err, Error::Proxy { .. }), "{err:?}");
    engine.shutdown().await;
}
