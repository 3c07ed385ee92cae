//! Access bound to the requester, on a real kube-apiserver: each user's V1 mapping gets its own
//! entry port of `--v1-port-range`, which admits only the requester's address (a client from
//! another loopback address is closed at accept and counted); a request asking for sources
//! outside `--allowed-source-cidrs` is refused and changes nothing; `pod-proxier connect`
//! creates, renews and deletes its mapping.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::{
    Env, Proxier, eventually, free_port, free_range, get_text, greeting, greeting_from,
    port_forward_rule,
};

/// The value of `podproxier_entry_source_refused_total` for `port` (0 when absent).
async fn refused(px: &Proxier, port: u16) -> u64 {
    let (_, text) = get_text(px.metrics, "/metrics").await.unwrap();
    let wanted = format!("podproxier_entry_source_refused_total{{entry_port=\"{port}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&wanted))
        .map_or(0, |v| v.trim().parse().unwrap())
}

fn entry_of(answer: &Value) -> u16 {
    u16::try_from(answer["data"]["entry_port"].as_u64().unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_user_gets_an_own_port_that_admits_only_the_requesters_address() {
    let env = Env::new("access", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.81", "pod-a")
        .await;
    env.pod_with_backend(&ns, "pod-b", "127.0.0.82", "pod-b")
        .await;
    let alice = env.caller(&ns, "alice", vec![port_forward_rule()]).await;
    let bob = env.caller(&ns, "bob", vec![port_forward_rule()]).await;
    let carol = env.caller(&ns, "carol", vec![port_forward_rule()]).await;
    let (start, end) = free_range(2);
    let range = format!("{start}-{end}");
    let px = Proxier::start(
        &env,
        &[
            "--enable-v1",
            "--v1-port-range",
            &range,
            "--allowed-source-cidrs",
            "127.0.0.0/28",
        ],
    )
    .await;

    // Alice's mapping records who and from where, and admits her address only.
    let a = px.map(Some(&alice), &format!("{ns}/pod-a"), 600).await;
    let data = &a["data"];
    assert!(
        data["requested_by"].as_str().unwrap().ends_with(":alice"),
        "{a}"
    );
    assert_eq!(data["requested_from"], "127.0.0.1", "{a}");
    assert_eq!(data["allowed_sources"], json!(["127.0.0.1/32"]), "{a}");
    let port_a = entry_of(&a);
    let entry_a = SocketAddr::from(([127, 0, 0, 1], port_a));
    assert_eq!(
        greeting_from("127.0.0.1", entry_a).await.as_deref(),
        Some("pod-a")
    );
    assert_eq!(refused(&px, port_a).await, 0);
    // Another source address: closed at accept, never relayed, counted.
    assert_eq!(greeting_from("127.0.0.2", entry_a).await, None);
    assert_eq!(refused(&px, port_a).await, 1);
    assert_eq!(
        greeting_from("127.0.0.1", entry_a).await.as_deref(),
        Some("pod-a")
    );
    let (status, listed) = px.call("GET", "/api/v1/mappings", Some(&alice), None).await;
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["data"][0]["requested_from"], "127.0.0.1", "{listed}");

    // Sources outside --allowed-source-cidrs: refused, and nothing changes.
    let before = env.mappings().list(&Default::default()).await.unwrap();
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&bob),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "sources": ["0.0.0.0/0"]})),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body["msg"]
            .as_str()
            .unwrap()
            .contains("--allowed-source-cidrs"),
        "{body}"
    );
    let after = env.mappings().list(&Default::default()).await.unwrap();
    let versions = |l: &kube::api::ObjectList<pod_proxier::crd::PortMapping>| {
        l.items
            .iter()
            .map(|m| (m.metadata.name.clone(), m.metadata.resource_version.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(versions(&before), versions(&after));

    // Bob gets the other port, with a source inside the policy; Alice's stays hers.
    let (status, b) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&bob),
            Some(json!({"pod_name": format!("{ns}/pod-b"), "sources": ["127.0.0.2"]})),
        )
        .await;
    assert_eq!(status, 200, "{b}");
    let port_b = entry_of(&b);
    assert_ne!(port_a, port_b);
    assert_eq!(b["data"]["replaced"], Value::Null, "{b}");
    let entry_b = SocketAddr::from(([127, 0, 0, 1], port_b));
    assert_eq!(
        greeting_from("127.0.0.2", entry_b).await.as_deref(),
        Some("pod-b")
    );
    assert_eq!(greeting_from("127.0.0.1", entry_b).await, None);
    assert_eq!(
        greeting_from("127.0.0.1", entry_a).await.as_deref(),
        Some("pod-a")
    );
    // Bob posting again replaces his own mapping only, on his port.
    let again = px.map(Some(&bob), &format!("{ns}/pod-a"), 600).await;
    assert_eq!(entry_of(&again), port_b);
    assert_eq!(again["data"]["replaced"], format!("{ns}/pod-b"), "{again}");
    // Carol, who may port-forward too, cannot delete another user's mapping.
    let (status, body) = px
        .call(
            "DELETE",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            Some(&carol),
            None,
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        greeting_from("127.0.0.1", entry_a).await.as_deref(),
        Some("pod-a")
    );
    // A third user finds the range full: 409, nobody's mapping replaced.
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&carol),
            Some(json!({"pod_name": format!("{ns}/pod-a")})),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(
        greeting_from("127.0.0.1", entry_a).await.as_deref(),
        Some("pod-a")
    );
    let stored = env.mappings().list(&Default::default()).await.unwrap();
    assert_eq!(stored.items.len(), 2);
    px.assert_never_forbidden().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_maps_renews_relays_and_deletes_on_sigterm() {
    let env = Env::new("connect", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-c", "127.0.0.83", "pod-c")
        .await;
    let token = env.caller(&ns, "dev", vec![port_forward_rule()]).await;
    let (start, end) = free_range(2);
    let px = Proxier::start(
        &env,
        &["--enable-v1", "--v1-port-range", &format!("{start}-{end}")],
    )
    .await;
    let local = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
        .args([
            "connect",
            &format!("{ns}/pod-c"),
            "--server",
            &format!("http://{}", px.api),
            "--local",
            &local.to_string(),
            "--ttl",
            "3",
        ])
        .env("POD_PROXIER_TOKEN", &token)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mappings = env.mappings();
    eventually(
        "connect created its mapping",
        Duration::from_secs(30),
        || async {
            !mappings
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .is_empty()
        },
    )
    .await;
    let first = mappings.list(&Default::default()).await.unwrap().items[0].clone();
    eventually(
        "the local port relays to the pod",
        Duration::from_secs(30),
        || async { greeting(local).await.as_deref() == Some("pod-c") },
    )
    .await;
    // A TTL of 3 s is renewed every second: the deadline moves on and the mapping outlives it.
    eventually(
        "connect renewed the mapping",
        Duration::from_secs(30),
        || async {
            let now = mappings
                .get_opt(&first.metadata.name.clone().unwrap())
                .await
                .unwrap();
            now.is_some_and(|m| m.spec.expires_at != first.spec.expires_at)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(greeting(local).await.as_deref(), Some("pod-c"));
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "connect exited with {status}");
    // Deleted at exit, not left to expire (the leader would remove it only after the TTL).
    let left = mappings.list(&Default::default()).await.unwrap().items;
    assert!(left.is_empty(), "{left:?}");
}
