//! The relay's limits and upstream settings, run on the binary: `--max-connections`,
//! `--idle-timeout`, `--connect-timeout` and `--upstream-sni`. Each is also run with the value
//! that would let the claim slip (noted per test), to be sure the check can fail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use netkit_testenv::{ControlPlane, eventually};
use support::{Ca, Proxy};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpSocket, TcpStream};

/// steward relaying to `upstream` with `extra` flags, once ready; it publishes nothing (no
/// such Service).
async fn relay(upstream: &str, extra: &[&str]) -> Proxy {
    let proxy = relay_unready(upstream, extra).await;
    eventually("steward is ready", Duration::from_secs(30), || async {
        proxy.readyz().await.is_some_and(|(code, _)| code == 200)
    })
    .await;
    proxy
}

/// The same, once listening: readiness includes dialling the upstream.
async fn relay_unready(upstream: &str, extra: &[&str]) -> Proxy {
    let plane = ControlPlane::shared().await.unwrap();
    let mut args = vec!["--service-namespace=default", "--service-name=absent"];
    args.extend_from_slice(extra);
    let proxy = Proxy::start(plane.kubeconfig_path(), upstream, &args);
    // The health server comes up before the relay's listener: wait for the line steward logs
    // once the listener is bound (a probe connection would take a slot of the relay's own).
    eventually("steward listens", Duration::from_secs(30), || async {
        proxy.readyz().await.is_some() && proxy.logs().contains("relaying")
    })
    .await;
    proxy
}

/// One echo round trip; false on any error, reset, early end or a 10 s silence (a relay that
/// admitted nothing never answers; a busy machine answers late).
async fn echoes(stream: &mut TcpStream) -> bool {
    if stream.write_all(b"ping\n").await.is_err() {
        return false;
    }
    let mut back = [0; 5];
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut back)).await;
    matches!(read, Ok(Ok(_))) && &back == b"ping\n"
}

/// How long until the peer ends the connection (EOF or reset), if within `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0; 16];
    match tokio::time::timeout(limit, stream.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => Some(started.elapsed()),
        Ok(Ok(_)) | Err(_) => None,
    }
}

#[tokio::test]
async fn max_connections_rejects_the_one_over_and_admits_again_after_a_close() {
    let echo = netkit_testenv::fixtures::echo_server().await.unwrap();
    // With --max-connections=3 the third connection would be admitted and this test fails.
    let proxy = relay(&echo.to_string(), &["--max-connections=2"]).await;
    let mut first = TcpStream::connect(proxy.listen).await.unwrap();
    let mut second = TcpStream::connect(proxy.listen).await.unwrap();
    assert!(echoes(&mut first).await && echoes(&mut second).await);

    // Refused with a reset, which can arrive before `connect` even returns.
    let third = match TcpStream::connect(proxy.listen).await {
        Ok(mut third) => echoes(&mut third).await,
        Err(_) => false,
    };
    assert!(
        !third,
        "a third connection was relayed under --max-connections=2"
    );
    let metrics = proxy.metrics_text().await;
    let rejected = metrics
        .lines()
        .find(|l| l.starts_with("proxy_connections_rejected_total{"))
        .unwrap_or_else(|| panic!("no rejection counted:\n{metrics}"));
    assert!(rejected.ends_with(" 1"), "{rejected}");

    // A slot freed is a slot taken again.
    drop(first);
    eventually(
        "a new connection is relayed",
        Duration::from_secs(30),
        || async {
            // A refusal's reset can beat `connect` back, as above.
            match TcpStream::connect(proxy.listen).await {
                Ok(mut again) => echoes(&mut again).await,
                Err(_) => false,
            }
        },
    )
    .await;
    assert!(echoes(&mut second).await, "the held connection after");
}

#[tokio::test]
async fn idle_timeout_closes_a_quiet_connection_and_spares_a_talking_one() {
    let echo = netkit_testenv::fixtures::echo_server().await.unwrap();
    // With --idle-timeout=0 (never) the quiet connection stays and this test fails. 3 s: the
    // talking connection's pauses (300 ms) stay far below it even on a busy machine.
    let proxy = relay(&echo.to_string(), &["--idle-timeout=3s"]).await;
    let mut quiet = TcpStream::connect(proxy.listen).await.unwrap();
    let mut talking = TcpStream::connect(proxy.listen).await.unwrap();
    assert!(echoes(&mut quiet).await && echoes(&mut talking).await);

    // The talking one sends every 300 ms for 9 s (three idle timeouts): never idle for 3 s.
    let talker = tokio::spawn(async move {
        let until = Instant::now() + Duration::from_secs(9);
        while Instant::now() < until {
            if !echoes(&mut talking).await {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        true
    });
    let closed = closed_within(&mut quiet, Duration::from_secs(30)).await;
    eprintln!("the quiet connection was closed after {closed:?}");
    let closed = closed.expect("a connection idle for 30 s is still open under --idle-timeout=3s");
    // Not before the timer (a busy machine only makes it later; 30 s above tells "never").
    assert!(
        closed >= Duration::from_millis(2900),
        "closed after {closed:?}"
    );
    assert!(
        talker.await.unwrap(),
        "a connection in use was closed:\n{}",
        proxy.logs()
    );
}

#[tokio::test]
async fn connect_timeout_gives_up_on_an_upstream_that_never_answers() {
    // An upstream whose SYNs go unanswered, on loopback: a listener that never accepts, its
    // accept queue filled, so the kernel drops further SYNs.
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let silent = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    loop {
        // A loopback connect answers in microseconds; a second of silence is a dropped SYN.
        match tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(silent)).await {
            Ok(Ok(stream)) => fillers.push(stream),
            Ok(Err(err)) => panic!("filling the accept queue: {err}"),
            Err(_) => break,
        }
        assert!(fillers.len() < 16, "the accept queue does not fill");
    }

    // With --connect-timeout=2m the client waits past 30 s and this test fails. steward is not
    // ready here: its readiness dials the upstream too (with the same timeout).
    let proxy = relay_unready(&silent.to_string(), &["--connect-timeout=1s"]).await;
    let mut client = TcpStream::connect(proxy.listen).await.unwrap();
    let _ = client.write_all(b"hello\n").await;
    let closed = closed_within(&mut client, Duration::from_secs(30)).await;
    eprintln!("the client was let go {closed:?} after connecting");
    let closed = closed.unwrap_or_else(|| {
        panic!(
            "still waiting 30 s for an upstream under --connect-timeout=1s:\n{}",
            proxy.logs()
        )
    });
    assert!(
        closed >= Duration::from_millis(900),
        "closed after {closed:?}"
    );
    let metrics = proxy.metrics_text().await;
    let timeouts = metrics
        .lines()
        .find(|l| l.starts_with("proxy_connect_timeouts_total{"))
        .unwrap_or_else(|| panic!("no connect timeout counted:\n{metrics}"));
    assert!(timeouts.ends_with(" 1"), "{timeouts}");
    drop(listener);
}

/// A TLS server for `upstream.test` that answers each connection with the server name (SNI)
/// its client sent.
async fn sni_echo(ca: &Ca) -> SocketAddr {
    let (cert, key) = ca.leaf_for("upstream.test", "upstream");
    let certs = proxy_core::tls::certificates_from_pem(cert.as_bytes()).unwrap();
    let key = proxy_core::tls::private_key_from_pem(key.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let sni = tls.get_ref().1.server_name().unwrap_or("-").to_owned();
                    let _ = tls.write_all(format!("sni={sni}\n").as_bytes()).await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    addr
}

/// Connects with TLS to steward (its serving certificate is for 127.0.0.1) and reads one line.
async fn line_through_tls(ca: &Ca, addr: SocketAddr) -> std::io::Result<String> {
    let roots = proxy_core::tls::trust_roots(Some(ca.pem.as_bytes())).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    let mut line = String::new();
    BufReader::new(tls).read_line(&mut line).await?;
    Ok(line)
}

#[tokio::test]
async fn upstream_sni_names_the_upstream_in_the_handshake_and_its_verification() {
    let ca = Ca::new();
    let upstream = sni_echo(&ca).await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = ca.leaf("steward");
    let files = [
        ("tls.crt", cert),
        ("tls.key", key),
        ("ca.crt", ca.pem.clone()),
    ];
    for (name, text) in &files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    let flag = |name: &str, file: &str| format!("--{name}={}", dir.path().join(file).display());
    let tls = [
        flag("tls-cert-file", "tls.crt"),
        flag("tls-key-file", "tls.key"),
        flag("upstream-ca-file", "ca.crt"),
    ];
    let mut args: Vec<&str> = tls.iter().map(String::as_str).collect();
    args.push("--upstream-sni=upstream.test");
    // The upstream is dialled by IP; its certificate names only upstream.test.
    let proxy = relay(&upstream.to_string(), &args).await;
    let line = line_through_tls(&ca, proxy.listen).await;
    eprintln!("through steward with --upstream-sni: {line:?}");
    assert_eq!(
        line.as_ref().ok().map(String::as_str),
        Some("sni=upstream.test\n"),
        "{line:?}\n{}",
        proxy.logs()
    );
    drop(proxy);

    // Without it, steward names the upstream by its IP: no SNI is sent and the certificate
    // does not match, so nothing comes through. The same check then fails.
    let proxy = relay(
        &upstream.to_string(),
        &tls.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let line = line_through_tls(&ca, proxy.listen).await;
    eprintln!("through steward without --upstream-sni: {line:?}");
    assert!(
        line.as_ref().map_or(true, |l| l.is_empty()),
        "an upstream named by IP was trusted: {line:?}"
    );
}
