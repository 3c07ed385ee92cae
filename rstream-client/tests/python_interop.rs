//! Interop with the official Python SDK (`rstreamlabs-rstream`), the real peer: it talks to our
//! LocalEngine, and our Rust client talks to tunnels it owns (and the reverse).
//!
//! The test creates a virtualenv outside the repository (default
//! `~/.cache/kube-netkit/python/rstream-<version>`, override with `NETKIT_PYTHON_VENV`) and installs the
//! pinned SDK there when missing (needs PyPI once). There is no skip: without Python 3 and its
//! `venv` module (the README's prerequisites) the test fails, saying what it needs.
#![cfg(feature = "engine")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::*;
use netkit_testenv::fixtures::{cache_dir, python_venv};
use rstream_client::forward;
use rstream_client::tunnel::{HttpVersion, TunnelOptions};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdout, Command};

/// The pinned SDK release.
const SDK_VERSION: &str = "0.7.0";

/// The venv with the pinned SDK (`NETKIT_PYTHON_VENV`, or the project's cache); its python.
fn ensure_sdk() -> PathBuf {
    let dir = std::env::var_os("NETKIT_PYTHON_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir("python").join(format!("rstream-{SDK_VERSION}")));
    python_venv(&dir, &[("rstreamlabs-rstream", SDK_VERSION)]).unwrap_or_else(|e| {
        panic!(
            "preparing the Python SDK in {} (needs `python3` with its `venv` module on PATH, \
                 and PyPI once): {e}",
            dir.display()
        )
    })
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/interop.py")
}

fn python_command(python: &Path, mode: &str, cfg: &Value) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(script()).arg(mode).arg(cfg.to_string());
    for (key, _) in std::env::vars() {
        if key.starts_with("RSTREAM_") {
            cmd.env_remove(key);
        }
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    cmd
}

async fn next_json(lines: &mut tokio::io::Lines<BufReader<ChildStdout>>) -> Value {
    let line = within(60, lines.next_line())
        .await
        .unwrap()
        .expect("python ended without output");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line {line:?}: {e}"))
}

/// Echo over a connection without half-closing early (the Python SDK's forwarder closes the whole
/// stream when one direction ends, so a half-close would race the echo).
async fn echo_exact(addr: std::net::SocketAddr, data: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    exchange(&mut s, data).await
}

async fn exchange<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    data: &[u8],
) -> Vec<u8> {
    let (mut r, mut w) = tokio::io::split(s);
    let mut back = vec![0u8; data.len()];
    let (wr, rd) = tokio::join!(w.write_all(data), r.read_exact(&mut back));
    wr.unwrap();
    rd.unwrap();
    back
}

async fn http_get(addr: std::net::SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /hello HTTP/1.1\r\nHost: interop\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8(out).unwrap()
}

fn port_of(v: &Value) -> u16 {
    u16::try_from(v["port"].as_u64().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_interop() {
    let python = tokio::task::spawn_blocking(ensure_sdk).await.unwrap();
    let engine = engine().await;
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), engine.ca_pem()).unwrap();
    let echo = echo_server().await;
    let web = http_server("hello from the interop target").await;
    let base = json!({"engine": engine.engine_address(), "ca_file": ca.path(), "token": TOKEN});

    // 1. The Python SDK owns a published TCP tunnel, an HTTP tunnel and a private tunnel.
    let mut cfg = base.clone();
    cfg["tcp_target"] = json!(echo.to_string());
    cfg["http_target"] = json!(web.to_string());
    cfg["private_target"] = json!(echo.to_string());
    cfg["private_name"] = json!("py-private");
    let mut owner: Child = python_command(&python, "own", &cfg).spawn().unwrap();
    let mut lines = BufReader::new(owner.stdout.take().unwrap()).lines();
    let info = next_json(&mut lines).await;
    assert_eq!(info["version"], SDK_VERSION);
    assert_eq!(info["server_agent"], "local-engine");

    let tcp = &info["tcp"];
    let ingress = engine.ingress_addr(tcp["id"].as_str().unwrap()).unwrap();
    assert_eq!(port_of(tcp), ingress.port());
    // Python and Rust render the same forwarding address for the same properties.
    let props = engine
        .tunnels()
        .into_iter()
        .find(|p| p.id.as_deref() == tcp["id"].as_str())
        .unwrap();
    assert_eq!(
        tcp["forwarding_address"].as_str().unwrap(),
        rstream_client::tunnel::forwarding_address(&props).unwrap()
    );
    assert_eq!(
        tcp["forwarding_address"],
        format!("127.0.0.1:{} (tcp)", ingress.port())
    );

    let data = random_bytes(1 << 20);
    let back = within(30, echo_exact(ingress, &data)).await;
    assert!(
        back == data,
        "TCP bytes through the Python-owned tunnel differ"
    );
    let mut set = tokio::task::JoinSet::new();
    for i in 0..4u8 {
        set.spawn(async move {
            let d = vec![i; 50_000];
            assert_eq!(echo_exact(ingress, &d).await, d);
        });
    }
    while let Some(r) = within(30, set.join_next()).await {
        r.unwrap();
    }

    let http = &info["http"];
    let http_ingress = engine.ingress_addr(http["id"].as_str().unwrap()).unwrap();
    assert_eq!(
        http["forwarding_address"],
        format!("https://127.0.0.1:{}", http_ingress.port())
    );
    let response = within(30, http_get(http_ingress)).await;
    assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
    assert!(
        response.ends_with("hello from the interop target"),
        "{response}"
    );

    // 2. The Rust client dials the Python-owned private tunnel (by name and by ID, both RTT modes).
    assert_eq!(
        info["private"]["forwarding_address"],
        "rstrm://py-private (unpublished)"
    );
    // Python and the engine share two busy cores with everything else a CI run does: allow the
    // Rust side generous request timeouts.
    let rust = builder(&engine)
        .operation_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    for (target, zero_rtt) in [
        ("py-private", true),
        (info["private"]["id"].as_str().unwrap(), false),
    ] {
        let mut s = within(10, rust.dial_with(target, zero_rtt)).await.unwrap();
        let data = random_bytes(200_000);
        assert!(
            within(30, exchange(&mut s, &data)).await == data,
            "private dial to Python differs"
        );
    }

    // Wire parity: what the Python SDK requested equals what the Rust client requests.
    let rust_control = rust.connect().await.unwrap();
    let _t1 = rust_control
        .create_tunnel(TunnelOptions::tcp().label("sdk", "python"))
        .await
        .unwrap();
    let _t2 = rust_control
        .create_tunnel(
            TunnelOptions::http()
                .name("py-http")
                .http_version(HttpVersion::Http11),
        )
        .await
        .unwrap();
    let _t3 = rust_control
        .create_tunnel(TunnelOptions::private("py-private-2"))
        .await
        .unwrap();
    let requests = engine.tunnel_requests();
    assert_eq!(requests.len(), 6);
    assert_eq!(requests[0], requests[3], "TCP tunnel request differs");
    assert_eq!(requests[1], requests[4], "HTTP tunnel request differs");
    let mut python_private = requests[2].clone();
    python_private.name = Some("py-private-2".into());
    assert_eq!(
        python_private, requests[5],
        "private tunnel request differs"
    );
    let details = engine.client_details();
    let py = &details[0];
    assert_eq!(py.agent.as_deref(), Some("rstream-python-runtime"));
    assert_eq!(py.protocol_version.as_deref(), Some("1.4.5"));
    assert_eq!(py.channel.as_deref(), Some("sdk"));
    let rs = details
        .iter()
        .rev()
        .find(|d| d.agent.as_deref() == Some("rstream-rust"))
        .unwrap();
    assert_eq!(rs.channel, py.channel);
    assert_eq!(rs.protocol_version, py.protocol_version);
    rust_control.close().await.unwrap();

    // The Python SDK heartbeats in negotiated mode and our engine acknowledges them.
    assert!(engine.heartbeats_received() >= 1);
    drop(owner.stdin.take());
    assert_eq!(next_json(&mut lines).await["closed"], true);
    assert!(within(30, owner.wait()).await.unwrap().success());
    assert!(eventually(5, || engine.control_channels() == 0).await);

    // 3. The same scenarios with the Rust client as owner, and the Python SDK dialing it.
    let control = rust.connect().await.unwrap();
    let mut tcp_tunnel = control.create_tunnel(TunnelOptions::tcp()).await.unwrap();
    let mut http_tunnel = control.create_tunnel(TunnelOptions::http()).await.unwrap();
    let mut private = control
        .create_tunnel(TunnelOptions::private("rs-private"))
        .await
        .unwrap();
    let tcp_ingress = engine.ingress_addr(tcp_tunnel.id()).unwrap();
    let http_ingress = engine.ingress_addr(http_tunnel.id()).unwrap();
    let (e1, e2, w1) = (echo.to_string(), echo.to_string(), web.to_string());
    let f1 = tokio::spawn(async move { forward::forward(&mut tcp_tunnel, &e1).await });
    let f2 = tokio::spawn(async move { forward::forward(&mut private, &e2).await });
    let f3 = tokio::spawn(async move { forward::forward(&mut http_tunnel, &w1).await });
    let data = random_bytes(1 << 20);
    assert!(within(30, echo_exact(tcp_ingress, &data)).await == data);
    assert!(
        within(30, http_get(http_ingress))
            .await
            .ends_with("hello from the interop target")
    );

    for zero_rtt in [true, false] {
        let mut cfg = base.clone();
        cfg["tunnel"] = json!("rs-private");
        cfg["size"] = json!(300_000);
        cfg["zero_rtt"] = json!(zero_rtt);
        let mut dialer = python_command(&python, "dial", &cfg).spawn().unwrap();
        let mut lines = BufReader::new(dialer.stdout.take().unwrap()).lines();
        let result = next_json(&mut lines).await;
        assert_eq!(
            result,
            json!({"ok": true, "bytes": 300_000}),
            "python dial (zero_rtt={zero_rtt})"
        );
        assert!(within(30, dialer.wait()).await.unwrap().success());
    }
    control.close().await.unwrap();
    for f in [f1, f2, f3] {
        within(10, f).await.unwrap().unwrap();
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    engine.shutdown().await;
}
