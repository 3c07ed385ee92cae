//! V1: a pod mapped to the entry port for a TTL.

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{Env, Proxier, backend, backend_on, eventually, greeting};

fn millis_until(expires_at: &str) -> i64 {
    let deadline: Timestamp = expires_at.parse().unwrap();
    deadline.as_millisecond() - Timestamp::now().as_millisecond()
}

async fn echo(stream: &mut TcpStream, text: &str) -> bool {
    if stream.write_all(text.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = vec![0u8; text.len()];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut buf)).await,
        Ok(Ok(_))
    ) && buf == text.as_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_maps_replaces_extends_expires_and_deletes() {
    let env = Env::new("v1", 1).await;
    let ns = env.targets[0].clone();
    let a = backend("127.0.0.11", "pod-a").await;
    let b = backend("127.0.0.12", "pod-b").await;
    env.pod(
        &ns,
        "pod-a",
        "127.0.0.11",
        Some(("jprofiler-port", a.port())),
    )
    .await;
    env.pod(
        &ns,
        "pod-b",
        "127.0.0.12",
        Some(("jprofiler-port", b.port())),
    )
    .await;
    let px = Proxier::start(&env, &["--enable-v1"]).await;
    let token = env.debugger(&ns).await;

    // Nothing mapped: the entry port refuses (the original served its own API there).
    assert_eq!(greeting(px.entry).await, None);

    // Map pod-a: live as soon as the call returns, to the named container port.
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-a"), "time": 60})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["code"], 10000);
    assert_eq!(body["msg"], "operation succeeded");
    assert_eq!(body["data"]["entry_port"], px.entry.port());
    assert_eq!(body["data"]["upstreams"], json!([a.to_string()]));
    assert_eq!(body["data"]["port_name"], "jprofiler-port");
    let left = millis_until(body["data"]["expires_at"].as_str().unwrap());
    assert!((58_000..=60_000).contains(&left), "{left}");
    assert_eq!(greeting(px.entry).await.as_deref(), Some("pod-a"));

    // The mapping is a PortMapping in the cluster.
    let cr = env
        .mappings()
        .get(&format!("v1-entry-{}", px.entry.port()))
        .await
        .unwrap();
    assert_eq!(cr.spec.target.name, "pod-a");
    assert_eq!(cr.spec.upstreams, vec![a]);
    let cr_name = format!("v1-entry-{}", px.entry.port());
    eventually(
        "the leader reports the mapping Active",
        Duration::from_secs(5),
        || async {
            let cr = env.mappings().get(&cr_name).await.unwrap();
            cr.status.and_then(|s| s.phase).as_deref() == Some("Active")
        },
    )
    .await;

    // A connection through pod-a survives its replacement by pod-b.
    let mut held = TcpStream::connect(px.entry).await.unwrap();
    let mut line = [0u8; 6];
    held.read_exact(&mut line).await.unwrap();
    assert_eq!(&line, b"pod-a\n");
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "time": 2})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["replaced"], format!("{ns}/pod-a"));
    assert_eq!(greeting(px.entry).await.as_deref(), Some("pod-b"));
    assert!(
        echo(&mut held, "still-a").await,
        "the established connection was cut"
    );

    // GET: pod-b mapped, pod-a exists but is not mapped, pod-z does not exist (original's 40004).
    let (status, body) = px
        .call(
            "GET",
            &format!("/api/v1/mapping?pod_name={ns}/pod-b"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(
        (status, body["data"]["mapped"].clone()),
        (200, json!(true)),
        "{body}"
    );
    let (status, body) = px
        .call(
            "GET",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(
        (status, body["data"]["mapped"].clone()),
        (200, json!(false)),
        "{body}"
    );
    let (status, body) = px
        .call(
            "GET",
            &format!("/api/v1/mapping?pod_name={ns}/pod-z"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(
        (status, body["code"].clone(), body["msg"].clone()),
        (404, json!(40004), json!("Not found the pod."))
    );
    let (status, body) = px.call("GET", "/api/v1/mappings", Some(&token), None).await;
    assert_eq!(status, 200);
    assert_eq!(body["data"].as_array().unwrap().len(), 1);
    assert_eq!(body["data"][0]["pod_name"], format!("{ns}/pod-b"));

    // Posting again for the same pod extends it.
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "time": 3})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["replaced"], json!(null));
    let expires_at = body["data"]["expires_at"].as_str().unwrap().to_owned();
    let left = millis_until(&expires_at);
    assert!((2_500..=3_000).contains(&left), "{left}");

    // Still mapped shortly before the deadline; refused within 1 s after it.
    tokio::time::sleep(Duration::from_millis(
        u64::try_from(millis_until(&expires_at) - 400).unwrap(),
    ))
    .await;
    assert_eq!(greeting(px.entry).await.as_deref(), Some("pod-b"));
    eventually("the mapping expires", Duration::from_secs(3), || async {
        greeting(px.entry).await.is_none()
    })
    .await;
    let late = -millis_until(&expires_at);
    assert!(late < 1000, "expired {late} ms after the deadline");
    // The held connection was not cut by the expiry either (it was opened under pod-a).
    assert!(echo(&mut held, "after-expiry").await);
    // The leader removes the expired object.
    let name = format!("v1-entry-{}", px.entry.port());
    eventually(
        "the expired PortMapping is deleted",
        Duration::from_secs(5),
        || async { env.mappings().get_opt(&name).await.unwrap().is_none() },
    )
    .await;

    // A pod without a named port is reached on --default-map-port.
    let c = backend_on("127.0.0.13", px.entry.port(), "pod-c").await;
    env.pod(&ns, "pod-c", "127.0.0.13", None).await;
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-c"), "time": 60})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["upstreams"], json!([c.to_string()]));
    assert_eq!(greeting(px.entry).await.as_deref(), Some("pod-c"));

    // DELETE ends it at once, closing established connections when asked.
    let mut held_c = TcpStream::connect(px.entry).await.unwrap();
    let mut line = [0u8; 6];
    held_c.read_exact(&mut line).await.unwrap();
    let started = Instant::now();
    let (status, body) = px
        .call(
            "DELETE",
            &format!("/api/v1/mapping?pod_name={ns}/pod-c&close_connections=true"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greeting(px.entry).await, None);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(
        !echo(&mut held_c, "cut").await,
        "close_connections=true left the connection open"
    );
    assert!(env.mappings().get_opt(&name).await.unwrap().is_none());
    let (status, body) = px
        .call(
            "DELETE",
            &format!("/api/v1/mapping?pod_name={ns}/pod-c"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!((status, body["code"].clone()), (404, json!(40004)));

    // The bench helper: a mapping carries its first byte within a second of the POST.
    let body = json!({"pod_name": format!("{ns}/pod-a"), "time": 60}).to_string();
    let latency = proxy_core::testing::post_to_first_byte(
        px.api,
        "/api/v1/mapping",
        &body,
        Some(&token),
        px.entry,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert!(latency < Duration::from_secs(1), "{latency:?}");
    eprintln!("POST to first byte: {latency:?}");
    px.assert_never_forbidden().await;
}
