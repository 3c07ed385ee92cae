//! `--backend haproxy`: the same V1 traffic through a real HAProxy, configured by the crate's
//! `haproxy-config` and driven through its Runtime API without reloads.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{Env, Proxier, assert_deadline_within, backend, eventually, greeting};

/// HAProxy's own view of itself, from `show info` on its Runtime API: its pid and when it
/// started (now less its uptime, in whole seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Running {
    pid: u32,
    started_at: i64,
}

async fn show_info(socket: &std::path::Path) -> Running {
    let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
    stream.write_all(b"show info\n").await.unwrap();
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_string(&mut text))
        .await
        .expect("show info: no answer within 30 s")
        .unwrap();
    let field = |name: &str| -> i64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
            .unwrap_or_else(|| panic!("show info has no {name}: {text}"))
            .trim()
            .parse()
            .unwrap()
    };
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    Running {
        pid: u32::try_from(field("Pid")).unwrap(),
        started_at: now - field("Uptime_sec"),
    }
}

struct Haproxy(Child);

impl Drop for Haproxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn haproxy_binary() -> Option<&'static str> {
    [
        "/usr/sbin/haproxy",
        "/usr/bin/haproxy",
        "/usr/local/sbin/haproxy",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn haproxy_backend_carries_v1_traffic_without_reloads() {
    let binary = haproxy_binary().expect("HAProxy is required: apt-get install -y haproxy");
    let env = Env::new("hap", 1).await;
    let ns = env.targets[0].clone();
    let a = backend("127.0.0.61", "hap-a").await;
    let b = backend("127.0.0.62", "hap-b").await;
    env.pod(
        &ns,
        "pod-a",
        "127.0.0.61",
        Some(("jprofiler-port", a.port())),
    )
    .await;
    env.pod(
        &ns,
        "pod-b",
        "127.0.0.62",
        Some(("jprofiler-port", b.port())),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("admin.sock");
    let api_addr = format!("unix://{}", socket.display());
    let mut px = Proxier::prepare(
        &env,
        &[
            "--enable-v1",
            "--backend",
            "haproxy",
            "--api-addr",
            &api_addr,
        ],
    );
    let config = dir.path().join("haproxy.cfg");
    std::fs::write(&config, px.haproxy_config()).unwrap();
    let log = std::fs::File::create(dir.path().join("haproxy.log")).unwrap();
    let _haproxy = Haproxy(
        Command::new(binary)
            .args(["-db", "-f"])
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    eventually(
        "HAProxy's socket appears",
        Duration::from_secs(30),
        || async { socket.exists() },
    )
    .await;
    px.spawn().await;
    let mut haproxy = _haproxy;
    let first = show_info(&socket).await;
    assert_eq!(
        first.pid,
        haproxy.0.id(),
        "the Runtime API is not the HAProxy this test started"
    );
    let token = env.debugger(&ns).await;

    // Idle: HAProxy's backend is empty, the connection is closed.
    assert_eq!(greeting(px.entry).await, None);
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-a"), "time": 60})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hap-a"));
    // Only the requester's address is admitted: HAProxy's ACL rejects another source at
    // connection, and pod-proxier counts it from HAProxy's denied connections.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let refused = match other.connect(px.entry).await {
        Err(_) => true,
        Ok(mut stream) => {
            let mut byte = [0u8; 1];
            matches!(
                tokio::time::timeout(Duration::from_secs(10), stream.read(&mut byte)).await,
                Ok(Ok(0) | Err(_))
            )
        }
    };
    assert!(refused, "a client from 127.0.0.2 reached the mapping");
    let metric = format!(
        "podproxier_entry_source_refused_total{{entry_port=\"{}\"}} 1",
        px.entry.port()
    );
    eventually(
        "HAProxy's refusal is counted",
        Duration::from_secs(30),
        || async {
            crate::support::get_text(px.metrics, "/metrics")
                .await
                .is_ok_and(|(_, text)| text.lines().any(|l| l == metric))
        },
    )
    .await;
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hap-a"));

    // Replacing keeps the established connection.
    let mut held = TcpStream::connect(px.entry).await.unwrap();
    let mut line = [0u8; 6];
    held.read_exact(&mut line).await.unwrap();
    assert_eq!(&line, b"hap-a\n");
    let sent = k8s_openapi::jiff::Timestamp::now();
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "time": 5})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let expires_at = body["data"]["expires_at"].as_str().unwrap().to_owned();
    assert_deadline_within(
        &expires_at,
        sent,
        k8s_openapi::jiff::Timestamp::now(),
        Duration::from_secs(5),
    );
    // Probed from now on, while the rest is checked: seen mapped before the deadline, refused
    // after it, neither early nor far too late.
    let expiry = {
        let entry = px.entry;
        tokio::spawn(
            async move { crate::support::expect_expiry(entry, "hap-b", &expires_at).await },
        )
    };
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hap-b"));
    held.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    held.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");
    expiry.await.unwrap();

    // Delete works too, and HAProxy was never restarted or reloaded.
    let (status, _) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-a"), "time": 60})),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hap-a"));
    let (status, _) = px
        .call(
            "DELETE",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(greeting(px.entry).await, None);
    // The same HAProxy process throughout: still running, and by its own account the same pid
    // started at the same time (a restart or a reload, even one that keeps the pid, restarts
    // the uptime; a reload to a new process answers with another pid).
    assert!(
        matches!(haproxy.0.try_wait(), Ok(None)),
        "the HAProxy this test started has exited"
    );
    let last = show_info(&socket).await;
    assert!(
        last.pid == first.pid && (last.started_at - first.started_at).abs() <= 2,
        "HAProxy was restarted or reloaded: {first:?} at the start, {last:?} at the end"
    );
    let haproxy_log = std::fs::read_to_string(dir.path().join("haproxy.log")).unwrap();
    assert!(!haproxy_log.contains("Reexecuting"), "{haproxy_log}");
    px.assert_never_forbidden().await;
}
