//! steward-tcp-proxy as a process against a real kube-apiserver started with
//! `--endpoint-reconciler-type=none` (and one with the default reconciler, for the fight).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_reconcile::testing::{ControlPlane, Identity, eventually};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use tokio::sync::{Mutex, OnceCell};

const BIN: &str = env!("CARGO_BIN_EXE_steward-tcp-proxy");

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

fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn apiserver_addr(plane: &ControlPlane) -> String {
    plane.server_url().trim_start_matches("https://").to_owned()
}

/// A steward-tcp-proxy child process, killed on drop.
struct Proxy {
    child: Child,
    listen: SocketAddr,
    health: SocketAddr,
    metrics: SocketAddr,
    log: PathBuf,
}

impl Proxy {
    fn start(kubeconfig: &Path, upstream: &str, extra: &[&str]) -> Self {
        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let health = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
        let log = tempfile::Builder::new()
            .prefix("steward-log-")
            .tempfile()
            .unwrap()
            .into_temp_path()
            .keep()
            .unwrap();
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(BIN)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--upstream-addr={upstream}"))
            .arg(format!("--listen-addr={listen}"))
            .arg(format!("--health-addr={health}"))
            .arg(format!("--metrics-addr={metrics}"))
            .args(extra)
            .env_remove("KUBECONFIG")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .unwrap();
        Self {
            child,
            listen,
            health,
            metrics,
            log,
        }
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn get(&self, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        let code = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
        Some((code, body))
    }

    async fn readyz(&self) -> Option<(u16, String)> {
        self.get(self.health, "/readyz").await
    }

    async fn metrics_text(&self) -> String {
        self.get(self.metrics, "/metrics")
            .await
            .map(|r| r.1)
            .unwrap_or_default()
    }

    fn terminate(&self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Whether the exposition has exactly this sample line.
fn metric_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

async fn create_proxy_service(client: &kube::Client, ns: &str) -> Service {
    let svc: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "proxy", "namespace": ns},
        "spec": {"ports": [{"name": "https", "port": 6443, "targetPort": 16443}]},
    }))
    .unwrap();
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap()
}

/// The addresses and port of `default/kubernetes` as the slice says.
async fn published(client: &kube::Client) -> Option<(Vec<String>, i32)> {
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await
        .unwrap()?;
    let addresses = slice
        .endpoints
        .unwrap_or_default()
        .into_iter()
        .flat_map(|e| e.addresses)
        .collect();
    let port = slice.ports.unwrap_or_default().first()?.port?;
    Some((addresses, port))
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

    // Manual edits are repaired through the watch, well under a second each.
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
        eventually("drift repaired", Duration::from_secs(1), || async {
            published(&client).await.as_ref() == Some(&expected)
        })
        .await;
        repairs.push(edited.elapsed());
    }
    repairs.sort();
    eprintln!("drift repair latencies: {repairs:?}");
    assert!(repairs[4] < Duration::from_secs(1), "{repairs:?}");

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
    let deadline = Instant::now() + Duration::from_secs(2);
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

/// An admin client whose server URL is the proxy.
async fn client_through(plane: &ControlPlane, proxy: SocketAddr) -> kube::Client {
    let text = std::fs::read_to_string(plane.kubeconfig_path()).unwrap();
    let kubeconfig = kube::config::Kubeconfig::from_yaml(&text).unwrap();
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    config.cluster_url = format!("https://{proxy}").parse().unwrap();
    kube::Client::try_from(config).unwrap()
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
    let logs = proxy.logs();
    assert!(
        !logs.to_lowercase().contains("forbidden"),
        "the chart's RBAC is missing something:\n{logs}"
    );
}

fn helm_template(ns: &str, upstream: &str) -> String {
    let helm = k8s_reconcile::testing::helm().unwrap();
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("chart");
    let output = Command::new(helm)
        .args(["template", "steward-tcp-proxy"])
        .arg(&chart)
        .args(["--namespace", ns])
        .arg(format!("--set=upstreamAddr={upstream}"))
        .args(["--set=serviceName=proxy", "--set=endpointMode=cluster-ip"])
        .args(["--show-only", "templates/serviceaccount.yaml"])
        .args(["--show-only", "templates/rbac.yaml"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[tokio::test]
async fn sigterm_drops_readiness_and_drains_a_long_watch() {
    let plane = plane().await;
    let ns = plane.create_namespace("steward-drain").await.unwrap();
    let mut proxy = Proxy::start(
        plane.kubeconfig_path(),
        &apiserver_addr(plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
            "--drain-timeout=3s",
        ],
    );
    eventually("listening", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(proxy.listen).await.is_ok()
    })
    .await;
    let through = client_through(plane, proxy.listen).await;
    let configmaps: Api<ConfigMap> = Api::namespaced(through, &ns);
    let mut events = configmaps
        .watch(&WatchParams::default().timeout(60), "0")
        .await
        .unwrap()
        .boxed();

    let signalled = Instant::now();
    proxy.terminate();
    eventually(
        "not ready while draining",
        Duration::from_secs(2),
        || async {
            proxy
                .readyz()
                .await
                .is_some_and(|(code, body)| code == 503 && body.contains("shutting down"))
        },
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
    // A broken replacement is refused; the last good certificate stays.
    std::fs::write(&cert_path, "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        tls_probe(&ca, proxy.listen, &[b"http/1.1"], None)
            .await
            .1
            .contains("second")
    );
    assert!(proxy.logs().contains("refused"), "{}", proxy.logs());
}

/// A test CA for the proxy's serving certificate.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl Ca {
    fn new() -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "steward test CA");
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A serving certificate for 127.0.0.1 whose common name is `name`.
    fn leaf(&self, name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
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
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile::certs(&mut ca.pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
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
