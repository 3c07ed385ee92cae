//! The HTTP CONNECT connector against a real HTTP proxy (Debian's tinyproxy, started per test)
//! and against scripted proxies for the byte-exact edges of the answer.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use netkit_testenv::fixtures::{Tinyproxy, TinyproxyConfig, echo_server};
use prometheus_client::registry::Registry;
use proxy_core::ConnectError;
use proxy_core::http_connect::{HttpConnectError, HttpProxy};
use proxy_core::metrics::PrometheusObserver;
use proxy_core::relay::Route;
use proxy_core::server::{ListenerConfig, ProxyServer};
use proxy_core::upstream::{TargetAddr, Upstream};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};

const TIMEOUT: Duration = Duration::from_secs(10);

async fn tinyproxy(basic_auth: Option<(&str, &str)>, connect_ports: &[u16]) -> Tinyproxy {
    Tinyproxy::start(&TinyproxyConfig {
        basic_auth: basic_auth.map(|(u, p)| (u.to_owned(), p.to_owned())),
        connect_ports: connect_ports.to_vec(),
    })
    .await
    .unwrap()
}

fn proxy(url: &str) -> HttpProxy {
    url.parse().unwrap()
}

/// Writes `data` while reading it back, then half-closes and waits for the far end to close:
/// returns what came back. (tinyproxy closes the whole tunnel on a client's FIN, so the echo has
/// to be complete before it.)
async fn echo_through(stream: TcpStream, data: &[u8]) -> Vec<u8> {
    let (mut read, mut write) = stream.into_split();
    let sent = data.to_vec();
    let writer = tokio::spawn(async move {
        write.write_all(&sent).await.unwrap();
        write
    });
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(TIMEOUT, read.read_exact(&mut back))
        .await
        .expect("the echo comes back in time")
        .unwrap();
    let mut write = writer.await.unwrap();
    write.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(TIMEOUT, read.read_to_end(&mut rest))
        .await
        .expect("the tunnel ends after our half-close")
        .unwrap();
    back.extend(rest);
    back
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

#[tokio::test]
async fn tunnels_through_tinyproxy_byte_exact_and_ends_on_half_close() {
    let echo = echo_server().await.unwrap();
    let tiny = tinyproxy(None, &[echo.port()]).await;
    let stream = proxy(&tiny.url())
        .connect(&TargetAddr::Socket(echo), TIMEOUT)
        .await
        .unwrap();
    let data = pattern(4 << 20);
    let back = echo_through(stream, &data).await;
    assert_eq!(back.len(), data.len(), "{}", tiny.logs());
    assert!(back == data, "bytes changed on the way");
}

#[tokio::test]
async fn bytes_the_target_sends_first_are_kept() {
    // A target that speaks first: its banner may arrive in the same segment as the proxy's 200.
    let banner = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let target = banner.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = banner.accept().await {
            let _ = socket.write_all(b"SSH-2.0-banner\r\n").await;
        }
    });
    let tiny = tinyproxy(None, &[target.port()]).await;
    let mut stream = proxy(&tiny.url())
        .connect(&TargetAddr::Socket(target), TIMEOUT)
        .await
        .unwrap();
    let mut got = [0u8; 16];
    stream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"SSH-2.0-banner\r\n");
}

#[tokio::test]
async fn credentials_are_sent_and_their_absence_is_a_typed_407() {
    let echo = echo_server().await.unwrap();
    let tiny = tinyproxy(Some(("alice", "s3cret")), &[echo.port()]).await;
    let target = TargetAddr::Socket(echo);
    let addr = tiny.addr();

    let err = proxy(&tiny.url())
        .connect(&target, TIMEOUT)
        .await
        .unwrap_err();
    match &err {
        HttpConnectError::CredentialsRequired {
            status_line,
            credentials_sent: false,
            ..
        } => assert!(status_line.contains("407"), "{status_line}"),
        other => panic!("expected a 407, got {other:?}"),
    }
    assert!(err.to_string().contains("requires credentials"), "{err}");

    let err = proxy(&format!("http://alice:wrong@{addr}"))
        .connect(&target, TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            HttpConnectError::CredentialsRequired {
                credentials_sent: true,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("refused the ones given"), "{err}");

    let stream = proxy(&format!("http://alice:s3cret@{addr}"))
        .connect(&target, TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        echo_through(stream, b"with credentials").await,
        b"with credentials"
    );
}

#[tokio::test]
async fn a_refused_target_is_a_clear_error() {
    let echo = echo_server().await.unwrap();
    // CONNECT is allowed to another port only: tinyproxy answers 403.
    let other = echo.port().wrapping_add(1).max(1);
    let tiny = tinyproxy(None, &[other]).await;
    let err = proxy(&tiny.url())
        .connect(&TargetAddr::Socket(echo), TIMEOUT)
        .await
        .unwrap_err();
    match &err {
        HttpConnectError::Refused {
            status_line,
            target,
            ..
        } => {
            assert!(status_line.contains("403"), "{status_line}");
            assert_eq!(target, &echo.to_string());
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("refused CONNECT") && text.contains("403"),
        "{text}"
    );
}

#[tokio::test]
async fn an_unreachable_proxy_is_a_connect_error() {
    let nowhere = netkit_testenv::fixtures::free_addr().unwrap();
    let err = proxy(&format!("http://{nowhere}"))
        .connect(&"127.0.0.1:1".parse().unwrap(), TIMEOUT)
        .await
        .unwrap_err();
    assert!(matches!(err, HttpConnectError::Connect { .. }), "{err:?}");
    assert!(
        err.to_string().contains("cannot reach the HTTP proxy"),
        "{err}"
    );
}

#[tokio::test]
async fn a_relay_route_reaches_its_upstream_through_tinyproxy() {
    let echo = echo_server().await.unwrap();
    let tiny = tinyproxy(None, &[echo.port()]).await;
    let upstream = Upstream::from(echo)
        .via_http_proxy(proxy(&tiny.url()))
        .unwrap();
    assert_eq!(upstream.describe(), format!("{echo} via {}", tiny.url()));
    let mut registry = Registry::default();
    let observer = Arc::new(PrometheusObserver::register(&mut registry));
    let server = ProxyServer::new(common::server_config(), observer).unwrap();
    let front = server
        .add_listener(ListenerConfig::new(
            SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            Route::new("via-proxy", upstream),
        ))
        .unwrap();
    let data = pattern(1 << 20);
    let back = echo_through(TcpStream::connect(front).await.unwrap(), &data).await;
    assert!(back == data, "bytes changed through relay and proxy");

    // A refusing proxy is a typed connect error of the upstream.
    let refusing = tinyproxy(None, &[echo.port().wrapping_add(1).max(1)]).await;
    let upstream = Upstream::from(echo)
        .via_http_proxy(proxy(&refusing.url()))
        .unwrap();
    let err = upstream.connect(TIMEOUT).await.unwrap_err();
    assert!(
        matches!(&err, ConnectError::HttpProxy { cause } if matches!(**cause, HttpConnectError::Refused { .. })),
        "{err:?}"
    );
    server.shutdown(Duration::from_secs(1)).await;
}

/// A scripted proxy: answers `answer` in pieces (a pause between each), then echoes.
async fn scripted(pieces: Vec<Vec<u8>>) -> SocketAddr {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let pieces = pieces.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut chunk = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&chunk[..n]),
                    }
                }
                for piece in pieces {
                    if socket.write_all(&piece).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_answer_split_anywhere_is_read_exactly_to_its_end() {
    // The blank line straddles two segments, and the target's first bytes follow in the second.
    let addr = scripted(vec![
        b"HTTP/1.1 200 Connection established\r\nVia: test\r\n\r".to_vec(),
        b"\nfirst".to_vec(),
    ])
    .await;
    let mut stream = proxy(&format!("http://{addr}"))
        .connect(&"example.invalid:443".parse().unwrap(), TIMEOUT)
        .await
        .unwrap();
    let mut got = [0u8; 5];
    stream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"first");
    stream.write_all(b"echo").await.unwrap();
    let mut got = [0u8; 4];
    stream.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"echo");
}

#[tokio::test]
async fn oversized_or_non_http_answers_are_refused() {
    let huge = scripted(vec![
        b"HTTP/1.1 200 OK\r\n".to_vec(),
        format!("X-Padding: {}\r\n", "a".repeat(20_000)).into_bytes(),
    ])
    .await;
    let err = proxy(&format!("http://{huge}"))
        .connect(&"example.invalid:443".parse().unwrap(), TIMEOUT)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("longer than 16384 bytes"), "{err}");

    let ssh = scripted(vec![b"SSH-2.0-OpenSSH\r\n\r\n".to_vec()]).await;
    let err = proxy(&format!("http://{ssh}"))
        .connect(&"example.invalid:443".parse().unwrap(), TIMEOUT)
        .await
        .unwrap_err();
    assert!(
        matches!(err, HttpConnectError::BadResponse { .. }),
        "{err:?}"
    );

    // A proxy that accepts and never answers is bounded by the timeout.
    let mute = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
    let mute_addr = mute.local_addr().unwrap();
    let err = proxy(&format!("http://{mute_addr}"))
        .connect(
            &"example.invalid:443".parse().unwrap(),
            Duration::from_millis(300),
        )
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    drop(mute);
}
