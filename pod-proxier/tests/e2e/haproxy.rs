//! `--backend haproxy`: the same V1 traffic through a real HAProxy, configured by the crate's
//! `haproxy-config` and driven through its Runtime API without reloads.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{Env, Proxier, backend, eventually, greeting};

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
        Duration::from_secs(10),
        || async { socket.exists() },
    )
    .await;
    px.spawn().await;
    let haproxy_pid = _haproxy.0.id();
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

    // Replacing keeps the established connection.
    let mut held = TcpStream::connect(px.entry).await.unwrap();
    let mut line = [0u8; 6];
    held.read_exact(&mut line).await.unwrap();
    assert_eq!(&line, b"hap-a\n");
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "time": 2})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hap-b"));
    held.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    held.read_exact(&mut echo).await.unwrap();
    assert_eq!(&echo, b"ping");

    // Expiry empties the backend within a second of the deadline.
    let expires_at: k8s_openapi::jiff::Timestamp = body["data"]["expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    eventually("the mapping expires", Duration::from_secs(4), || async {
        greeting(px.entry).await.is_none()
    })
    .await;
    let late = k8s_openapi::jiff::Timestamp::now().as_millisecond() - expires_at.as_millisecond();
    assert!(late < 1000, "expired {late} ms late");

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
    assert_eq!(_haproxy.0.id(), haproxy_pid);
    let haproxy_log = std::fs::read_to_string(dir.path().join("haproxy.log")).unwrap();
    assert!(!haproxy_log.contains("Reexecuting"), "{haproxy_log}");
    px.assert_never_forbidden().await;
}
