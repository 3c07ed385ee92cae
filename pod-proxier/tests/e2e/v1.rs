//! V1: a pod mapped to the entry port for a TTL.

use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{
    Env, Probe, Probed, Proxier, assert_deadline_within, backend, backend_on, eventually,
    expect_expiry, greeting, judge_expiry, probe,
};

async fn echo(stream: &mut TcpStream, text: &str) -> bool {
    if stream.write_all(text.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = vec![0u8; text.len()];
    matches!(
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut buf)).await,
        Ok(Ok(_))
    ) && buf == text.as_bytes()
}

/// Whether the peer closed `stream` (end of stream or a reset within 10 s, whatever we send): a
/// silent connection is not taken for a closed one.
async fn closed(stream: &mut TcpStream) -> bool {
    let _ = stream.write_all(b"cut").await;
    let mut buf = [0u8; 16];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await {
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
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
    let sent = Timestamp::now();
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
    assert_deadline_within(
        body["data"]["expires_at"].as_str().unwrap(),
        sent,
        Timestamp::now(),
        Duration::from_secs(60),
    );
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
        Duration::from_secs(30),
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
    let sent = Timestamp::now();
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&token),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "time": 5})),
        )
        .await;
    let received = Timestamp::now();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"]["replaced"], json!(null));
    let expires_at = body["data"]["expires_at"].as_str().unwrap().to_owned();
    assert_deadline_within(&expires_at, sent, received, Duration::from_secs(5));

    // Seen mapped until the deadline and refused after it: neither early nor far too late.
    expect_expiry(px.entry, "pod-b", &expires_at).await;
    // The held connection was not cut by the expiry either (it was opened under pod-a).
    assert!(echo(&mut held, "after-expiry").await);
    // The leader removes the expired object.
    let name = format!("v1-entry-{}", px.entry.port());
    eventually(
        "the expired PortMapping is deleted",
        Duration::from_secs(30),
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
    // Refused as soon as the DELETE is answered (no wait: the next connection is refused).
    assert_eq!(probe(px.entry).await, Probe::Refused);
    eprintln!(
        "DELETE answered and the port refused {:?} after the call",
        started.elapsed()
    );
    assert!(
        closed(&mut held_c).await,
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

    // The bench helper: a mapping carries its first byte after the POST (the time is a bench
    // figure, printed; the helper's own 30 s limit only bounds a hang).
    let body = json!({"pod_name": format!("{ns}/pod-a"), "time": 60}).to_string();
    let latency = netkit_testenv::fixtures::post_to_first_byte(
        px.api,
        "/api/v1/mapping",
        &body,
        Some(&token),
        px.entry,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    eprintln!("POST to first byte: {latency:?}");
    px.assert_never_forbidden().await;
}

/// The expiry judge on made-up probes: every 100 ms from 3 s before a deadline, each taking
/// 20 ms, answered by "pod" until `ends_ms` (from the deadline), refused after.
fn probes_ending_at(ends_ms: i64, until_ms: i64) -> (Timestamp, Vec<Probed>) {
    let deadline = Timestamp::from_millisecond(1_700_000_000_000).unwrap();
    let at = |ms: i64| Timestamp::from_millisecond(deadline.as_millisecond() + ms).unwrap();
    let probes = (-30..until_ms / 100)
        .map(|i| Probed {
            started: at(i * 100),
            ended: at(i * 100 + 20),
            outcome: if i * 100 < ends_ms {
                Probe::Answered("pod".to_owned())
            } else {
                Probe::Refused
            },
        })
        .collect();
    (deadline, probes)
}

#[test]
fn the_expiry_judge_rejects_early_late_never_and_flapping() {
    let (deadline, on_time) = probes_ending_at(150, 2_000);
    assert_eq!(
        judge_expiry("pod", deadline, &on_time),
        Ok(Duration::from_millis(200))
    );
    // Ended 1.5 s early: refused by probes that ended before the deadline.
    let (deadline, early) = probes_ending_at(-1_500, 2_000);
    let verdict = judge_expiry("pod", deadline, &early);
    assert!(
        verdict.as_ref().is_err_and(|e| e.contains("expired early")),
        "{verdict:?}"
    );
    // Never ended, or only 12 s late.
    let (deadline, never) = probes_ending_at(i64::MAX, 11_000);
    let verdict = judge_expiry("pod", deadline, &never);
    assert!(
        verdict.as_ref().is_err_and(|e| e.contains("never refused")),
        "{verdict:?}"
    );
    let (deadline, late) = probes_ending_at(12_000, 13_000);
    let verdict = judge_expiry("pod", deadline, &late);
    assert!(
        verdict.as_ref().is_err_and(|e| e.contains("too late")),
        "{verdict:?}"
    );
    // Refused, then answered again.
    let (deadline, mut flapping) = probes_ending_at(150, 2_000);
    let last = flapping.len() - 1;
    flapping[last].outcome = Probe::Answered("pod".to_owned());
    assert!(judge_expiry("pod", deadline, &flapping).is_err());
    // Never seen mapped before the deadline proves nothing about an early end.
    let (deadline, late_start) = probes_ending_at(150, 2_000);
    let after: Vec<Probed> = late_start
        .into_iter()
        .filter(|p| p.started >= deadline)
        .collect();
    let verdict = judge_expiry("pod", deadline, &after);
    assert!(
        verdict
            .as_ref()
            .is_err_and(|e| e.contains("never seen mapped")),
        "{verdict:?}"
    );
    // A probe that proves nothing (a timeout) is neither an answer nor a refusal.
    let (deadline, mut unclear) = probes_ending_at(150, 2_000);
    unclear[10].outcome = Probe::Unclear("no byte within 5 s".to_owned());
    assert!(judge_expiry("pod", deadline, &unclear).is_ok());
    // Another Pod answering is no mapping of this one.
    let (deadline, mut other) = probes_ending_at(150, 2_000);
    other[5].outcome = Probe::Answered("intruder".to_owned());
    assert!(judge_expiry("pod", deadline, &other).is_err());
}
