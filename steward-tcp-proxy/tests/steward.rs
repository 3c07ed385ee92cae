//! steward-tcp-proxy as a process against a real kube-apiserver started with
//! `--endpoint-reconciler-type=none` (and one with the default reconciler, for the fight).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_reconcile::testing::{ControlPlane, Identity, eventually};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::{Mutex, OnceCell};

mod support;

use support::*;

/// The plane every test but the fight shares: no built-in endpoint reconciler.
static PLANE: OnceCell<ControlPlane> = OnceCell::const_new();
/// Tests that write `default/kubernetes` take turns.
static KUBERNETES_ENDPOINTS: Mutex<()> = Mutex::const_new(());

async fn plane() -> &'static ControlPlane {
    PLANE
        .get_or_init(|| async {
            ControlPlane::builder()
                .apiserver_arg("--endpoint-reconciler-type=none")
                .start()
                .await
                .unwrap()
        })
        .await
}

#[tokio::test]
async fn cluster_ip_mode_points_kubernetes_at_the_service_and_repairs_drift() {
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-cip").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();

    // A stale extra slice of the kubernetes Service, which kube-proxy would merge in.
    let stale: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes-stale", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.99"]}],
        "ports": [{"name": "https", "port": 443, "protocol": "TCP"}],
    }))
    .unwrap();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let _ = slices.create(&PostParams::default(), &stale).await;

    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--service-port=6443",
        ],
    );
    let expected = (vec![cluster_ip.clone()], 6443);
    eventually(
        "slice points at the proxy ClusterIP",
        Duration::from_secs(15),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    let slice = slices.get("kubernetes").await.unwrap();
    assert_eq!(slice.address_type, "IPv4");
    assert_eq!(
        slice.labels()["endpointslice.kubernetes.io/managed-by"],
        "steward-tcp-proxy"
    );
    assert_eq!(slice.labels()["kubernetes.io/service-name"], "kubernetes");
    let port = &slice.ports.unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.protocol.as_deref()),
        (Some("https"), Some("TCP"))
    );
    eventually("stale slice removed", Duration::from_secs(5), || async {
        slices.get_opt("kubernetes-stale").await.unwrap().is_none()
    })
    .await;
    let endpoints_api = Api::<Endpoints>::namespaced(client.clone(), "default");
    eventually("Endpoints written", Duration::from_secs(5), || async {
        endpoints_api.get_opt("kubernetes").await.unwrap().is_some()
    })
    .await;
    let endpoints = endpoints_api.get("kubernetes").await.unwrap();
    assert_eq!(
        endpoints.labels()["endpointslice.kubernetes.io/skip-mirror"],
        "true"
    );
    let subset = &endpoints.subsets.unwrap()[0];
    assert_eq!(subset.addresses.as_ref().unwrap()[0].ip, cluster_ip);
    assert_eq!(subset.ports.as_ref().unwrap()[0].port, 6443);

    // Manual edits are repaired through the watch. Typically well under a second each (the
    // figure is for benches); the bound here is generous for a busy machine: 5 s.
    let mut repairs = Vec::new();
    for i in 0..5 {
        let tampered =
            serde_json::json!({"endpoints": [{"addresses": [format!("10.0.0.{}", 50 + i)]}]});
        let edited = Instant::now();
        slices
            .patch(
                "kubernetes",
                &PatchParams::default(),
                &Patch::Merge(&tampered),
            )
            .await
            .unwrap();
        eventually("drift repaired", Duration::from_secs(5), || async {
            published(&client).await.as_ref() == Some(&expected)
        })
        .await;
        repairs.push(edited.elapsed());
    }
    repairs.sort();
    eprintln!("drift repair latencies: {repairs:?}");
    assert!(repairs[4] < Duration::from_secs(5), "{repairs:?}");

    // Ready: upstream dialable and endpoints correct.
    eventually("ready", Duration::from_secs(5), || async {
        proxy.readyz().await.is_some_and(|(code, _)| code == 200)
    })
    .await;
    let (_, body) = proxy.readyz().await.unwrap();
    assert!(body.contains("[+] endpoints"), "{body}");
    assert!(body.contains("[+] upstream"), "{body}");
    let metrics = proxy.metrics_text().await;
    assert!(
        metric_line(&metrics, "steward_endpoint_repairs_total 5"),
        "{metrics}"
    );
    assert!(
        metric_line(&metrics, "steward_endpoint_fight 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn pod_ip_mode_publishes_the_ready_proxy_endpoints() {
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-pod").await.unwrap();
    create_proxy_service(&client, &ns).await;
    let own_slice = |ready_last: bool| -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "proxy-abc", "namespace": ns,
                         "labels": {"kubernetes.io/service-name": "proxy"}},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.0.3"], "conditions": {"ready": true}},
                {"addresses": ["10.244.0.2"], "conditions": {"ready": true}},
                {"addresses": ["10.244.0.4"], "conditions": {"ready": ready_last}},
            ],
            "ports": [{"name": "https", "port": 16443, "protocol": "TCP"}],
        }))
        .unwrap()
    };
    let own: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    own.create(&PostParams::default(), &own_slice(false))
        .await
        .unwrap();

    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[&format!("--service-namespace={ns}"), "--service-name=proxy"],
    );
    // Addresses are data here: nothing is ever sent to them.
    let expected = (
        vec!["10.244.0.2".to_owned(), "10.244.0.3".to_owned()],
        16443,
    );
    eventually(
        "slice lists the ready proxy pods",
        Duration::from_secs(15),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;

    // A proxy pod becoming ready is published at once (the proxy's own slices are watched).
    own.replace("proxy-abc", &PostParams::default(), &{
        let mut s = own_slice(true);
        s.metadata.resource_version = own
            .get("proxy-abc")
            .await
            .unwrap()
            .metadata
            .resource_version;
        s
    })
    .await
    .unwrap();
    let expected = (
        vec![
            "10.244.0.2".to_owned(),
            "10.244.0.3".to_owned(),
            "10.244.0.4".to_owned(),
        ],
        16443,
    );
    // A generous bound (the speed is a bench's figure).
    let deadline = Instant::now() + Duration::from_secs(10);
    while published(&client).await.as_ref() != Some(&expected) {
        assert!(
            Instant::now() < deadline,
            "new ready pod not published: {:?}\n{}",
            published(&client).await,
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn api_calls_and_watches_pass_through_the_relay() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-relay").await.unwrap();
    // Nothing here writes default/kubernetes (no proxy Service exists in this namespace).
    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            // One event loop relays, reconciles and serves metrics here.
            "--threads=1",
        ],
    );
    eventually("listening", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;
    let through = client_through(plane, proxy.listen).await;

    // TLS passes through: the client verifies the API server's own certificate (CA and SAN
    // 127.0.0.1) and authenticates with its client certificate, end to end.
    let info = through.apiserver_version().await.unwrap();
    assert_eq!(info.git_version, "v1.37.2");
    let namespaces = Api::<Namespace>::all(through.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));

    let configmaps: Api<ConfigMap> = Api::namespaced(through.clone(), &ns);
    let mut events = configmaps
        .watch(&WatchParams::default().timeout(30), "0")
        .await
        .unwrap()
        .boxed();
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("through-the-proxy".into());
    Api::<ConfigMap>::namespaced(plane.client().await.unwrap(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(
        next_added(&mut events, Duration::from_secs(10)).await,
        "through-the-proxy"
    );
    let metrics = proxy.metrics_text().await;
    assert!(metrics.contains("proxy_connections_total"), "{metrics}");
}

/// The name of the next object added on a watch (bookmarks are skipped).
async fn next_added(
    events: &mut (impl futures::Stream<Item = Result<WatchEvent<ConfigMap>, kube::Error>> + Unpin),
    timeout: Duration,
) -> String {
    tokio::time::timeout(timeout, async {
        loop {
            match events
                .try_next()
                .await
                .unwrap()
                .expect("the watch stays open")
            {
                WatchEvent::Added(cm) => return cm.name_any(),
                WatchEvent::Bookmark(_) => continue,
                other => panic!("unexpected watch event {other:?}"),
            }
        }
    })
    .await
    .expect("an ADDED event in time")
}

#[tokio::test]
async fn runs_under_the_charts_rbac_alone() {
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-rbac").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();

    // Render the chart's RBAC exactly as a user would install it, and bind nothing else.
    let rendered = helm_template(&ns, &apiserver_addr(plane));
    let mut applied = 0;
    for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
        let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
        let kind = value["kind"].as_str().unwrap_or_default().to_owned();
        let namespace = value["metadata"]["namespace"]
            .as_str()
            .unwrap_or(&ns)
            .to_owned();
        let params = PatchParams::apply("test").force();
        let name = value["metadata"]["name"].as_str().unwrap().to_owned();
        match kind.as_str() {
            "Role" => {
                let role: Role = serde_json::from_value(value).unwrap();
                Api::<Role>::namespaced(client.clone(), &namespace)
                    .patch(&name, &params, &Patch::Apply(&role))
                    .await
                    .unwrap();
            }
            "RoleBinding" => {
                let binding: RoleBinding = serde_json::from_value(value).unwrap();
                Api::<RoleBinding>::namespaced(client.clone(), &namespace)
                    .patch(&name, &params, &Patch::Apply(&binding))
                    .await
                    .unwrap();
            }
            "ServiceAccount" => {}
            other => panic!("unexpected {other} in the RBAC templates"),
        }
        applied += 1;
    }
    assert_eq!(applied, 5, "ServiceAccount, 2 Roles, 2 RoleBindings");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--leader-elect",
            "--identity=rbac-test",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually(
        "slice written under the chart's RBAC",
        Duration::from_secs(20),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    // The Lease was taken, and a drift is still repaired (watch permissions work).
    let lease = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns)
        .get("proxy")
        .await
        .unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("rbac-test")
    );
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": ["10.0.0.77"]}]})),
        )
        .await
        .unwrap();
    eventually(
        "drift repaired under RBAC",
        Duration::from_secs(2),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Counted where no refusal can hide: the API server's audit log for steward's user.
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let requests = plane.requests_by(&user).await.unwrap();
    let forbidden: Vec<_> = requests
        .iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(!requests.is_empty(), "no request by {user} audited");
    assert!(
        forbidden.is_empty(),
        "the chart's RBAC is missing something: {forbidden:?}\n{}",
        proxy.logs()
    );
}

fn helm_template(ns: &str, upstream: &str) -> String {
    let helm = k8s_reconcile::testing::helm().unwrap();
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("chart");
    proxy_core::testing::stdout_of(
        Command::new(helm)
            .args(["template", "steward-tcp-proxy"])
            .arg(&chart)
            .args(["--namespace", ns])
            .arg(format!("--set=upstreamAddr={upstream}"))
            .args(["--set=serviceName=proxy", "--set=endpointMode=cluster-ip"])
            .args(["--show-only", "templates/serviceaccount.yaml"])
            .args(["--show-only", "templates/rbac.yaml"]),
    )
    .unwrap()
}

type ConfigMapEvents = futures::stream::BoxStream<'static, kube::Result<WatchEvent<ConfigMap>>>;

/// Starts steward with `drain_flags`, opens a ConfigMap watch through it, sends SIGTERM and waits
/// for `/readyz` to say it is shutting down; returns the proxy, the namespace, the watch and
/// when the signal went.
async fn watch_then_terminate(
    plane: &'static ControlPlane,
    prefix: &str,
    drain_flags: &[&str],
) -> (Proxy, String, ConfigMapEvents, Instant) {
    let ns = plane.create_namespace(prefix).await.unwrap();
    let namespace_flag = format!("--service-namespace={ns}");
    let mut flags = vec![namespace_flag.as_str(), "--service-name=absent"];
    flags.extend_from_slice(drain_flags);
    let proxy = Proxy::start(plane.kubeconfig_path(), &apiserver_addr(plane), &flags);
    eventually("listening", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;
    let through = client_through(plane, proxy.listen).await;
    let events = Api::<ConfigMap>::namespaced(through, &ns)
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .unwrap()
        .boxed();

    let signalled = Instant::now();
    proxy.terminate();
    eventually(
        "not ready after SIGTERM",
        Duration::from_secs(2),
        || async {
            proxy
                .readyz()
                .await
                .is_some_and(|(code, body)| code == 503 && body.contains("shutting down"))
        },
    )
    .await;
    (proxy, ns, events, signalled)
}

#[tokio::test]
async fn sigterm_drops_readiness_and_drains_a_long_watch() {
    let plane = plane().await;
    // The deadline alone: a quiet watch stays open until it.
    let (mut proxy, ns, mut events, signalled) = watch_then_terminate(
        plane,
        "steward-drain",
        &["--drain-timeout=3s", "--drain-idle=0", "--threads=1"],
    )
    .await;
    // The running watch keeps delivering during the drain window...
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some("during-drain".into());
    Api::<ConfigMap>::namespaced(plane.client().await.unwrap(), &ns)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    assert_eq!(
        next_added(&mut events, Duration::from_secs(2)).await,
        "during-drain"
    );
    // ...and new connections are refused.
    assert!(tokio::net::TcpStream::connect(proxy.listen).await.is_err());
    // At the deadline the watch is cut and the process exits cleanly.
    let ended = tokio::time::timeout(Duration::from_secs(6), async {
        while let Ok(Some(_)) = events.try_next().await {}
    })
    .await;
    assert!(ended.is_ok(), "the watch outlived the drain deadline");
    let drained = signalled.elapsed();
    assert!(
        drained >= Duration::from_millis(2500),
        "cut before the deadline: {drained:?}"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = proxy.child.wait();
        (status, proxy)
    })
    .await
    .unwrap()
    .0
    .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test]
async fn sigterm_keeps_accepting_for_the_shutdown_delay_then_closes_quiet_connections_early() {
    let plane = plane().await;
    let (mut proxy, ns, mut events, signalled) = watch_then_terminate(
        plane,
        "steward-delay",
        &[
            "--shutdown-delay=2s",
            "--drain-timeout=30s",
            "--drain-idle=50ms",
        ],
    )
    .await;
    // During the delay a new client, as kube-proxy may still send one, is served.
    let late = client_through(plane, proxy.listen).await;
    Api::<ConfigMap>::namespaced(late, &ns)
        .list(&ListParams::default())
        .await
        .expect("a new connection during the shutdown delay is relayed");
    // After it, the quiet watch is closed at once, long before the 30 s deadline, and the
    // process exits cleanly.
    let ended = tokio::time::timeout(Duration::from_secs(8), async {
        while let Ok(Some(_)) = events.try_next().await {}
    })
    .await;
    let closed = signalled.elapsed();
    assert!(ended.is_ok(), "the quiet watch was kept until the deadline");
    assert!(
        closed >= Duration::from_millis(1900),
        "closed during the shutdown delay: {closed:?}"
    );
    let status = tokio::task::spawn_blocking(move || {
        let status = proxy.child.wait();
        (status, proxy)
    })
    .await
    .unwrap()
    .0
    .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(15),
        "the drain waited for the deadline: {:?}",
        signalled.elapsed()
    );
}

#[tokio::test]
async fn a_fight_with_the_builtin_reconciler_is_reported_and_bounded() {
    // A control plane of its own, with kube-apiserver's default (lease) endpoint reconciler.
    let plane = ControlPlane::builder().start().await.unwrap();
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-fight").await.unwrap();
    create_proxy_service(&client, &ns).await;
    let user = "steward-fighter";
    let kubeconfig = plane
        .kubeconfig_as(&Identity::User {
            name: user.into(),
            group: Some("system:masters".into()),
        })
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(&plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while !metric_line(&proxy.metrics_text().await, "steward_endpoint_fight 1") {
        assert!(
            Instant::now() < deadline,
            "no fight detected:\n{}\n{}",
            proxy.metrics_text().await,
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (code, body) = proxy.readyz().await.unwrap();
        if code == 503 && body.contains("endpoint-reconciler-type=none") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz does not report the fight: {code} {body}\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let events = Api::<Event>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("EndpointsFight")
                && e.type_.as_deref() == Some("Warning")),
        "{events:?}"
    );
    // Once fighting, rewrites are spaced out: over the next 25 s the built-in reconciler
    // rewrites ~3 times, but we write at most one round (slice + Endpoints) per back-off step.
    let before = plane.writes_by(user).await.unwrap().len();
    tokio::time::sleep(Duration::from_secs(25)).await;
    let during = plane.writes_by(user).await.unwrap().len() - before;
    eprintln!("writes during 25 s of fight: {during}");
    assert!(during <= 4, "{during} writes in 25 s: not backing off");
    let logs = proxy.logs();
    assert!(
        logs.contains("another controller keeps rewriting"),
        "{logs}"
    );
}

#[tokio::test]
async fn tls_termination_verifies_upstream_mirrors_alpn_and_reloads_certificates() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-tls").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new();
    let (cert, key) = ca.leaf("first");
    let cert_path = dir.path().join("tls.crt");
    let key_path = dir.path().join("tls.key");
    std::fs::write(&cert_path, &cert).unwrap();
    std::fs::write(&key_path, &key).unwrap();
    let upstream_ca = dir.path().join("upstream-ca.crt");
    std::fs::write(&upstream_ca, plane.ca_pem()).unwrap();
    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            &format!("--tls-cert-file={}", cert_path.display()),
            &format!("--tls-key-file={}", key_path.display()),
            &format!("--upstream-ca-file={}", upstream_ca.display()),
        ],
    );
    eventually("listening", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;

    // ALPN: offered h2 and http/1.1, the API server picks h2, and so do we.
    let (alpn, served) = tls_probe(&ca, proxy.listen, &[b"h2", b"http/1.1"], None).await;
    assert_eq!(alpn.as_deref(), Some(&b"h2"[..]));
    assert!(
        served.contains("first"),
        "the served certificate is not ours"
    );
    // HTTP/1.1 through both TLS legs reaches the API server (anonymous /version is allowed).
    let (alpn, body) = tls_probe(&ca, proxy.listen, &[b"http/1.1"], Some("/version")).await;
    assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert!(body.contains("v1.37.2"), "{body}");

    // Rotation: new files are served to new connections without a restart.
    let (cert, key) = ca.leaf("second");
    std::fs::write(&key_path, &key).unwrap();
    std::fs::write(&cert_path, &cert).unwrap();
    eventually(
        "rotated certificate served",
        Duration::from_secs(12),
        || async {
            tls_probe(&ca, proxy.listen, &[b"http/1.1"], None)
                .await
                .1
                .contains("second")
        },
    )
    .await;
    // A broken replacement is refused (waited for in the log, bounded); the last good
    // certificate stays.
    let log_from = proxy.logs().len();
    std::fs::write(&cert_path, "not a certificate").unwrap();
    eventually(
        "the broken certificate refused",
        Duration::from_secs(20),
        || async { proxy.logs()[log_from..].contains("refused") },
    )
    .await;
    // The log says why, not only which file.
    let refusal = proxy.logs()[log_from..].to_owned();
    assert!(
        refusal.contains("no PEM certificate found"),
        "the refusal does not say why: {refusal}"
    );
    assert!(
        tls_probe(&ca, proxy.listen, &[b"http/1.1"], None)
            .await
            .1
            .contains("second")
    );
}

/// Connects with TLS, offering `alpn`; returns the chosen protocol and either the served
/// certificate's subject (no path) or the HTTP response to `GET path`.
async fn tls_probe(
    ca: &Ca,
    addr: SocketAddr,
    alpn: &[&[u8]],
    path: Option<&str>,
) -> (Option<Vec<u8>>, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let roots = proxy_core::tls::trust_roots(Some(ca.pem.as_bytes())).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    let (_, session) = tls.get_ref();
    let chosen = session.alpn_protocol().map(<[u8]>::to_vec);
    let subject = session
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| String::from_utf8_lossy(c.as_ref()).into_owned())
        .unwrap_or_default();
    let Some(path) = path else {
        return (chosen, subject);
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = tls.read_to_end(&mut response).await;
    (chosen, String::from_utf8_lossy(&response).into_owned())
}

#[test]
fn bad_flags_exit_with_status_2_and_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--upstream-addr=nohost"], "host:port"),
        (
            &["--upstream-addr=h:1", "--reconcile-interval=30"],
            "missing unit",
        ),
        (
            &["--upstream-addr=h:1", "--service-name=Bad_Name"],
            "not a valid Service name",
        ),
        (
            &["--upstream-addr=h:1", "--endpoint-mode=node-ip"],
            "node-ip",
        ),
        (
            &["--upstream-addr=h:1", "--tls-cert-file=/x.pem"],
            "--tls-key-file",
        ),
        (&[], "--upstream-addr"),
    ];
    for (args, message) in cases {
        let output = Command::new(BIN)
            .args(*args)
            .env_remove("UPSTREAM_ADDR")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert!(help.status.success());
}

/// Sends a plain HTTP request to `addr`, a relay in front of the (TLS) API server, and returns
/// the answer: the API server's "HTTP request to an HTTPS server" proves the bytes got there.
async fn plain_http_through(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn colon_port_listens_on_both_families_and_boolean_flags_take_gos_forms() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-dual").await.unwrap();
    let (listen, health, metrics) = (free_port(), free_port(), free_port());
    let texts = [
        format!(":{listen}"),
        format!(":{health}"),
        format!(":{metrics}"),
    ];
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            // Go's boolean forms, as the original's callers pass them.
            "--leader-elect=false",
            "--upstream-insecure=false",
        ],
        &[("STEWARD_LEADER_ELECT", "True")],
        Some([&texts[0], &texts[1], &texts[2]]),
    );
    let v6 = |port| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let v4 = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    eventually("listening", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(v4(listen)).await.is_ok()
    })
    .await;
    // The relay, over IPv6 only and over IPv4, reaches the API server.
    for addr in [v6(listen), v4(listen)] {
        let answer = plain_http_through(addr).await;
        assert!(
            answer.contains("HTTP request to an HTTPS server"),
            "through {addr}: {answer}\n{}",
            proxy.logs()
        );
    }
    // The operations servers too.
    for (port, path) in [(health, "/healthz"), (metrics, "/metrics")] {
        for addr in [v6(port), v4(port)] {
            eventually(
                &format!("{path} on {addr}"),
                Duration::from_secs(5),
                || async {
                    proxy
                        .get(addr, path)
                        .await
                        .is_some_and(|(code, _)| code == 200)
                },
            )
            .await;
        }
    }
    // --leader-elect=false beat the environment's True: no Lease is taken.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(
        plane.client().await.unwrap(),
        &ns,
    )
    .list(&ListParams::default())
    .await
    .unwrap();
    assert!(leases.items.is_empty(), "{:?}", leases.items);
}

#[test]
fn a_bad_boolean_is_a_usage_error_naming_the_value() {
    let out = Command::new(BIN)
        .args(["--upstream-addr=h:1", "--leader-elect=maybe"])
        .env_remove("STEWARD_LEADER_ELECT")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--leader-elect") && stderr.contains("\"maybe\" is not a boolean"),
        "{stderr}"
    );
    // The environment variable takes Go's spellings too: `T` is true, and asks for TLS mode.
    let out = Command::new(BIN)
        .arg("--upstream-addr=h:1")
        .env("STEWARD_UPSTREAM_INSECURE", "T")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--upstream-insecure needs TLS-termination mode"),
        "{stderr}"
    );
}

fn apiserver_port(plane: &ControlPlane) -> u16 {
    apiserver_addr(plane)
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap()
}

#[tokio::test]
async fn the_upstream_is_reached_through_an_http_proxy() {
    use proxy_core::testing::{Tinyproxy, TinyproxyConfig};
    let plane = plane().await;
    let ns = plane.create_namespace("steward-egress").await.unwrap();
    let port = apiserver_port(plane);
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("steward".into(), "s3cret".into())),
        connect_ports: vec![port],
    })
    .await
    .unwrap();
    let args = [
        &format!("--service-namespace={ns}")[..],
        "--service-name=absent",
    ];
    // Credentials from the environment variable of --upstream-proxy (percent-encoding decoded).
    let url = format!("http://steward:s3c%72et@{}", tiny.addr());
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &args,
        &[("STEWARD_UPSTREAM_PROXY", &url)],
        None,
    );
    eventually(
        "ready through the proxy",
        Duration::from_secs(20),
        || async {
            proxy.readyz().await.is_some_and(|(code, body)| {
                code == 200 && body.contains(&format!("via {}", tiny.url()))
            })
        },
    )
    .await;
    let through = client_through(plane, proxy.listen).await;
    let namespaces = Api::<Namespace>::all(through)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));
    let logs = tiny.logs();
    assert!(
        logs.contains(&format!("CONNECT 127.0.0.1:{port}")),
        "tinyproxy saw no tunnel:\n{logs}"
    );
    let logs = proxy.logs();
    assert!(logs.contains("through the HTTP proxy"), "{logs}");
    assert!(
        !logs.contains("s3cret") && !logs.contains("s3c%72et"),
        "{logs}"
    );
    drop(proxy);

    // Without the credentials, with wrong ones, and towards a port the proxy refuses: /readyz
    // names the problem, and no password reaches the logs.
    let refusing = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: None,
        connect_ports: vec![port.wrapping_add(1).max(1)],
    })
    .await
    .unwrap();
    for (url, expected) in [
        (tiny.url(), "requires credentials"),
        (
            format!("http://steward:wr0ng@{}", tiny.addr()),
            "refused the ones given",
        ),
        (refusing.url(), "refused CONNECT"),
    ] {
        let proxy = Proxy::start(
            plane.kubeconfig_path(),
            &apiserver_addr(plane),
            &[&args[..], &[&format!("--upstream-proxy={url}")]].concat(),
        );
        eventually(
            &format!("/readyz says {expected:?}"),
            Duration::from_secs(20),
            || async {
                proxy
                    .readyz()
                    .await
                    .is_some_and(|(code, body)| code == 503 && body.contains(expected))
            },
        )
        .await;
        let logs = proxy.logs();
        assert!(!logs.contains("wr0ng"), "{logs}");
    }
}

#[tokio::test]
async fn https_proxy_and_no_proxy_are_honoured_for_the_upstream() {
    use proxy_core::testing::{Tinyproxy, TinyproxyConfig};
    let plane = plane().await;
    let ns = plane.create_namespace("steward-env-proxy").await.unwrap();
    let port = apiserver_port(plane);
    let tiny = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: Some(("steward".into(), "s3cret".into())),
        connect_ports: vec![port],
    })
    .await
    .unwrap();
    // Loopback addresses and `localhost` never go through a proxy (Go's rule), so the upstream
    // is named `127.1`: a host name to these rules, which the proxy resolves to 127.0.0.1.
    let upstream = format!("127.1:{port}");
    let args = [
        &format!("--service-namespace={ns}")[..],
        "--service-name=absent",
    ];
    let url = format!("http://steward:s3cret@{}", tiny.addr());
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &upstream,
        &args,
        &[
            ("HTTPS_PROXY", &url),
            ("NO_PROXY", "example.com,10.0.0.0/8"),
        ],
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = proxy.readyz().await;
        if ready.as_ref().is_some_and(|(code, body)| {
            *code == 200 && body.contains(&format!("{upstream} via {}", tiny.url()))
        }) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready through HTTPS_PROXY: {ready:?}\n{}",
            proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let namespaces = Api::<Namespace>::all(client_through(plane, proxy.listen).await)
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(namespaces.items.iter().any(|n| n.name_any() == ns));
    let logs = tiny.logs();
    assert!(
        logs.contains(&format!("CONNECT 127.1:{port}")),
        "tinyproxy saw no tunnel:\n{logs}"
    );
    drop(proxy);

    // NO_PROXY exempts the upstream: the (refusing) proxy is not used. The lowercase names work
    // as well.
    let refusing = Tinyproxy::start(&TinyproxyConfig {
        basic_auth: None,
        connect_ports: vec![port.wrapping_add(1).max(1)],
    })
    .await
    .unwrap();
    let proxy = Proxy::start_with(
        plane.kubeconfig_path(),
        &upstream,
        &args,
        // 127.0.0.1 for steward's own Kubernetes client, which honours them too.
        &[
            ("https_proxy", &refusing.url()),
            ("no_proxy", "127.1,127.0.0.1"),
        ],
        None,
    );
    eventually("ready directly", Duration::from_secs(20), || async {
        proxy.readyz().await.is_some_and(|(code, body)| {
            code == 200 && body.contains(&format!("{upstream} dialable"))
        })
    })
    .await;
    let (_, body) = proxy.readyz().await.unwrap();
    assert!(!body.contains(" via "), "{body}");
}

/// The original's ClusterRole (Steward's `steward:tcp-proxy`): EndpointSlices, Services, Leases
/// and core Events, but no Endpoints and no `events.k8s.io`.
fn originals_cluster_role(name: &str) -> k8s_openapi::api::rbac::v1::ClusterRole {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name},
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["get", "list", "watch", "create", "update", "patch"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }))
    .unwrap()
}

#[tokio::test]
async fn under_the_originals_narrower_cluster_role_the_slice_is_managed_without_403s() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-narrow").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
    let role_name = format!("steward-tcp-proxy-{ns}");
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &originals_cluster_role(&role_name))
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "steward-tcp-proxy", "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--reconcile-interval=1s",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually(
        "slice written under the narrow role",
        Duration::from_secs(20),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    // Drift is still repaired, several times over (and the 1 s resync reconciles all along).
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    for n in 0..3 {
        slices
            .patch(
                "kubernetes",
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": [format!("10.0.0.{}", 80 + n)]}]})),
            )
            .await
            .unwrap();
        eventually(
            "drift repaired under the narrow role",
            Duration::from_secs(5),
            || async { published(&client).await.as_ref() == Some(&expected) },
        )
        .await;
    }
    // A window of several reconciles, counted (bounded), not a guessed sleep.
    wait_reconciles(&proxy, 3).await;

    // Ready, and /readyz and the metric name what is missing.
    let (code, body) = proxy.readyz().await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains(r#"missing permission patch endpoints "kubernetes" in namespace "default""#),
        "{body}"
    );
    let metrics = proxy.metrics_text().await;
    for line in [
        r#"steward_missing_permission{verb="patch",resource="endpoints",namespace="default"} 1"#,
        &format!(
            r#"steward_missing_permission{{verb="create",resource="events.events.k8s.io",namespace="{ns}"}} 1"#
        ),
    ] {
        assert!(metric_line(&metrics, line), "{line} not in\n{metrics}");
    }
    // One warning per missing permission, however many reconciles ran.
    let logs = proxy.logs();
    let warnings = logs
        .matches(r#"missing RBAC permission: patch endpoints "kubernetes""#)
        .count();
    assert_eq!(warnings, 1, "{logs}");
    // And the API server refused steward nothing: what is missing was asked, not tried.
    plane.writes_by(&user).await.unwrap(); // waits until the audit log has caught up
    let forbidden: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(forbidden.len() <= 1, "403s for steward: {forbidden:?}");
    eprintln!("forbidden requests by steward under the narrow role: {forbidden:?}");
}

#[tokio::test]
async fn a_forbidden_endpoints_write_closes_the_gate_after_one_403() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let plane = plane().await;
    let _turn = KUBERNETES_ENDPOINTS.lock().await;
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-403").await.unwrap();
    let svc = create_proxy_service(&client, &ns).await;
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
    // The original's role plus get/patch/list/watch of the kubernetes Endpoints, but not create:
    // asking says the write is allowed, and with the object gone the write is a create, refused.
    let role_name = format!("steward-tcp-proxy-{ns}");
    let mut role = originals_cluster_role(&role_name);
    role.rules.get_or_insert_default().push(
        serde_json::from_value(serde_json::json!({
            "apiGroups": [""], "resources": ["endpoints"], "resourceNames": ["kubernetes"],
            "verbs": ["get", "patch", "list", "watch"],
        }))
        .unwrap(),
    );
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": "steward-tcp-proxy", "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let _ = Api::<Endpoints>::namespaced(client.clone(), "default")
        .delete("kubernetes", &Default::default())
        .await;
    let user = format!("system:serviceaccount:{ns}:steward-tcp-proxy");
    let kubeconfig = plane
        .kubeconfig_as(&Identity::service_account(&ns, "steward-tcp-proxy"))
        .await
        .unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--reconcile-interval=1s",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually("slice written", Duration::from_secs(20), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;
    // Many reconciles (1 s resync, and a drift repair).
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": ["10.0.0.90"]}]})),
        )
        .await
        .unwrap();
    eventually("drift repaired", Duration::from_secs(5), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;
    wait_reconciles(&proxy, 4).await;
    let (code, body) = proxy.readyz().await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(
        body.contains(r#"missing permission create endpoints "kubernetes" in namespace "default""#),
        "{body}"
    );
    plane.writes_by(&user).await.unwrap();
    let forbidden: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert_eq!(
        forbidden.len(),
        1,
        "one refused write, then none: {forbidden:?}"
    );
    let logs = proxy.logs();
    assert_eq!(
        logs.matches("missing RBAC permission: create endpoints")
            .count(),
        1,
        "{logs}"
    );
}

/// steward's successful reconciles so far, from its metrics.
async fn reconciles(proxy: &Proxy) -> u64 {
    proxy
        .metrics_text()
        .await
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && l.starts_with("controller_runtime_reconcile_total{")
                && l.contains(r#"result="success""#)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Waits (at most 30 s) until steward has reconciled `n` more times: the window of a "however
/// many reconciles ran" check, counted instead of slept.
async fn wait_reconciles(proxy: &Proxy, n: u64) {
    let from = reconciles(proxy).await;
    let started = Instant::now();
    loop {
        let now = reconciles(proxy).await;
        if now >= from + n {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "only {} of {n} reconciles in 30 s (controller_runtime_reconcile_total {from} -> {now})",
            now - from
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
