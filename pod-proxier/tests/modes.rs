//! pod-proxier's other modes on a real kube-apiserver: `--auth none`, two active replicas
//! serving the same mappings, and `--v2-target cluster-ip`.
//!
//! The control plane's Service range is on loopback (127.100.0.0/24), so a ClusterIP answers on
//! this host and `--v2-target cluster-ip` relays without a node. On a node, kube-proxy carries a
//! ClusterIP to a Pod; here the server standing in for the Service listens on the ClusterIP
//! itself, so what is tested is pod-proxier's part: which address it publishes and relays to.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use netkit_testenv::ControlPlane;
use pod_proxier::crd::PortMapping;
use serde_json::json;
use support::{Env, Proxier, backend, eventually, free_range, greeting, own_plane};
use tokio::sync::OnceCell;

const SERVICE_RANGE: &str = "127.100.0.0/24";

/// One control plane for this binary, with Services on loopback.
async fn plane() -> &'static ControlPlane {
    static PLANE: OnceCell<&'static ControlPlane> = OnceCell::const_new();
    PLANE
        .get_or_init(|| async {
            own_plane(&[&format!("--service-cluster-ip-range={SERVICE_RANGE}")]).await
        })
        .await
}

/// Service `name` in `ns` with ClusterIP `ip` and a port named `debug`, and a server on
/// `ip:port` greeting with `name` (the Service's port and the server's are the same).
async fn cluster_ip_service(env: &Env, ns: &str, name: &str, ip: &str) -> SocketAddr {
    let server = backend(ip, name).await;
    let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "ports": [{"name": "debug", "port": server.port()}]}}))
    .unwrap();
    Api::<Service>::namespaced(env.admin.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    server
}

/// The entry port pod-proxier published for Service `name`'s port `debug`.
async fn published_port(env: &Env, ns: &str, name: &str) -> PortMapping {
    let mapping = format!("svc.{ns}.{name}.debug");
    eventually(
        &format!("{mapping} is published"),
        Duration::from_secs(30),
        || async { env.mappings().get_opt(&mapping).await.unwrap().is_some() },
    )
    .await;
    env.mappings().get(&mapping).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_none_serves_callers_without_a_token_but_keeps_the_namespace_limits() {
    let env = Env::on(plane().await, "auth-none", 1).await;
    let ns = env.targets[0].clone();
    let a = env
        .pod_with_backend(&ns, "pod-a", "127.0.0.71", "open-pod")
        .await;
    let outside = env
        .plane
        .create_namespace("auth-none-outside")
        .await
        .unwrap();
    env.pod(
        &outside,
        "pod-x",
        "127.0.0.71",
        Some(("jprofiler-port", a.port())),
    )
    .await;
    let px = Proxier::start(&env, &["--enable-v1", "--auth", "none"]).await;
    assert!(
        px.logs().contains("--auth=none: the API is open to anyone"),
        "{}",
        px.logs()
    );

    // No token at all: mapped, forwarded, readable.
    px.map(None, &format!("{ns}/pod-a"), 60).await;
    assert_eq!(greeting(px.entry).await.as_deref(), Some("open-pod"));
    let (status, body) = px
        .call(
            "GET",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            None,
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let stored = env.mappings().list(&Default::default()).await.unwrap();
    let requested_by = stored.items[0]
        .spec
        .requested_by
        .clone()
        .unwrap_or_default();
    assert!(
        requested_by.contains("--auth=none"),
        "recorded as {requested_by:?}"
    );
    // A namespace outside --allowed-namespaces stays out: --auth none opens the API, not the
    // cluster.
    let (status, body) = px
        .call(
            "POST",
            "/api/v1/mapping",
            None,
            Some(json!({"pod_name": format!("{outside}/pod-x"), "time": 60})),
        )
        .await;
    assert_ne!(status, 200, "{body}");
    assert_eq!(greeting(px.entry).await.as_deref(), Some("open-pod"));
    // It made no TokenReview or SubjectAccessReview: nothing was checked.
    let reviews: Vec<_> = env
        .plane
        .requests_by(&px.user)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| {
            e.object_ref.as_ref().is_some_and(|o| {
                o.resource == "tokenreviews" || o.resource == "subjectaccessreviews"
            })
        })
        .map(|e| e.request_uri)
        .collect();
    assert!(reviews.is_empty(), "{reviews:?}");
    px.assert_never_forbidden().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_ip_target_relays_to_the_service_ip_not_its_endpoints() {
    let env = Env::on(plane().await, "cluster-ip", 1).await;
    let ns = env.targets[0].clone();
    let (start, end) = free_range(3);
    let px = Proxier::start(
        &env,
        &[
            "--enable-v2",
            "--v2-target",
            "cluster-ip",
            "--port-range-start",
            &start.to_string(),
            "--port-range-end",
            &end.to_string(),
            "--off-check",
        ],
    )
    .await;
    let server = cluster_ip_service(&env, &ns, "svc-a", "127.100.0.71").await;
    // An endpoint elsewhere: the cluster-ip target must not use it.
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "svc-a-1", "namespace": ns,
            "labels": {"kubernetes.io/service-name": "svc-a"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.9.9.9"], "conditions": {"ready": true}}],
        "ports": [{"name": "debug", "port": 9999, "protocol": "TCP"}]}))
    .unwrap();
    Api::<EndpointSlice>::namespaced(env.admin.clone(), &ns)
        .create(&PostParams::default(), &slice)
        .await
        .unwrap();
    // A headless Service has no ClusterIP to send to: not published.
    let headless: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "headless", "namespace": ns},
        "spec": {"clusterIP": "None", "ports": [{"name": "debug", "port": 80}]}}))
    .unwrap();
    Api::<Service>::namespaced(env.admin.clone(), &ns)
        .create(&PostParams::default(), &headless)
        .await
        .unwrap();

    let mapping = published_port(&env, &ns, "svc-a").await;
    assert_eq!(mapping.spec.upstreams, vec![server]);
    let entry = SocketAddr::from((
        [127, 0, 0, 1],
        u16::try_from(mapping.spec.entry_port).unwrap(),
    ));
    eventually(
        "the Service port answers",
        Duration::from_secs(30),
        || async { greeting(entry).await.as_deref() == Some("svc-a") },
    )
    .await;
    // svc-a was published after headless was created: had headless qualified, it would be
    // there by now.
    let names: Vec<_> = env
        .mappings()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|m| m.metadata.name)
        .collect();
    assert_eq!(names, vec![format!("svc.{ns}.svc-a.debug")]);
    px.assert_never_forbidden().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_active_replicas_serve_the_same_mappings() {
    let env = Env::on(plane().await, "replicas", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.72", "pod-a")
        .await;
    let (start, end) = free_range(3);
    let mut first = Proxier::start(
        &env,
        &[
            "--enable-v1",
            "--enable-v2",
            "--v2-target",
            "cluster-ip",
            "--port-range-start",
            &start.to_string(),
            "--port-range-end",
            &end.to_string(),
            "--off-check",
        ],
    )
    .await;
    let leader = format!("replica-{}", env.state_ns);
    let leases: Api<Lease> = Api::namespaced(env.admin.clone(), &env.state_ns);
    let holder = || async {
        leases
            .get_opt("pod-proxier")
            .await
            .unwrap()
            .and_then(|l| l.spec?.holder_identity)
    };
    eventually(
        "the first replica leads",
        Duration::from_secs(30),
        || async { holder().await.as_deref() == Some(leader.as_str()) },
    )
    .await;
    let second = first.replica("127.0.0.2", "second").await;
    cluster_ip_service(&env, &ns, "svc-a", "127.100.0.72").await;
    let port = u16::try_from(published_port(&env, &ns, "svc-a").await.spec.entry_port).unwrap();
    let v2 = |ip: [u8; 4]| SocketAddr::from((ip, port));

    // Both relay the V2 port the leader allocated.
    for (who, entry) in [
        ("first", v2([127, 0, 0, 1])),
        ("second", v2([127, 0, 0, 2])),
    ] {
        eventually(
            &format!("the {who} replica relays the Service port"),
            Duration::from_secs(30),
            || async { greeting(entry).await.as_deref() == Some("svc-a") },
        )
        .await;
    }
    // A mapping made through the follower's API is relayed by both.
    let token = env.debugger(&ns).await;
    second.map(Some(&token), &format!("{ns}/pod-a"), 600).await;
    for (who, entry) in [("first", first.entry), ("second", second.entry)] {
        eventually(
            &format!("the {who} replica relays the V1 mapping"),
            Duration::from_secs(30),
            || async { greeting(entry).await.as_deref() == Some("pod-a") },
        )
        .await;
    }
    // Deleted through the leader's API: both stop.
    let (status, body) = first
        .call(
            "DELETE",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    for (who, entry) in [("first", first.entry), ("second", second.entry)] {
        eventually(
            &format!("the {who} replica stops relaying the deleted mapping"),
            Duration::from_secs(30),
            || async { greeting(entry).await.is_none() },
        )
        .await;
    }

    // The leader dies: the follower keeps relaying, takes the Lease once it runs out, and
    // publishes a Service made meanwhile.
    first.kill9();
    assert_eq!(greeting(v2([127, 0, 0, 2])).await.as_deref(), Some("svc-a"));
    cluster_ip_service(&env, &ns, "svc-b", "127.100.0.73").await;
    eventually(
        "the second replica leads",
        Duration::from_secs(30),
        || async { holder().await.as_deref() == Some("second") },
    )
    .await;
    let port_b = u16::try_from(published_port(&env, &ns, "svc-b").await.spec.entry_port).unwrap();
    eventually(
        "the new leader relays svc-b",
        Duration::from_secs(30),
        || async {
            greeting(SocketAddr::from(([127, 0, 0, 2], port_b)))
                .await
                .as_deref()
                == Some("svc-b")
        },
    )
    .await;
    assert_eq!(greeting(v2([127, 0, 0, 2])).await.as_deref(), Some("svc-a"));
    second.assert_never_forbidden().await;
}
