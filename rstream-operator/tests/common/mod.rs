//! Helpers of the operator's integration tests: the shared control plane with the CRDs and the
//! manager's ClusterRole, identities, objects and waits.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use k8s_reconcile::testing::{ControlPlane, Identity};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt as _};
use prometheus_client::registry::Registry;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::manager::{self, ManagerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

pub const MANAGER_SA: &str = "rstream-operator";
static SETUP: OnceCell<()> = OnceCell::const_new();

fn crate_file(path: &str) -> String {
    let full = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("reading {}: {e}", full.display()))
}

/// The manager's ClusterRole, exactly as `config/rbac/role.yaml` declares it.
pub fn manager_cluster_role() -> ClusterRole {
    serde_yaml_ng::from_str(&crate_file("config/rbac/role.yaml")).unwrap()
}

/// The leader-election Role of `config/rbac/leader_election_role.yaml`.
pub fn leader_election_role() -> Role {
    serde_yaml_ng::from_str(&crate_file("config/rbac/leader_election_role.yaml")).unwrap()
}

/// The shared control plane with the CRDs and the manager ClusterRole installed.
pub async fn plane() -> &'static ControlPlane {
    let plane = ControlPlane::shared().await.unwrap();
    SETUP.get_or_init(|| prepare(plane)).await;
    plane
}

/// Installs the CRDs and the manager's ClusterRole into `plane`.
pub async fn prepare(plane: &ControlPlane) {
    plane.install_crds(&rstream_operator::crds()).await.unwrap();
    let roles: Api<ClusterRole> = Api::all(plane.client().await.unwrap());
    let role = manager_cluster_role();
    roles
        .patch(
            &role.name_any(),
            &PatchParams::apply("tests").force(),
            &Patch::Apply(&role),
        )
        .await
        .unwrap();
}

/// Runs the manager in this process as `client` (its ServiceAccount), scoped to `ns`.
pub async fn start_manager(client: Client, ns: &str) -> CancellationToken {
    start_manager_with(client, ns, None).await
}

/// Like [`start_manager`], with leader election (Lease namespace and identity) when given.
pub async fn start_manager_with(
    client: Client,
    ns: &str,
    leader_election: Option<(String, String)>,
) -> CancellationToken {
    let shutdown = CancellationToken::new();
    let options = ManagerOptions {
        agent_image: "example.test/rstream-operator:dev".into(),
        leader_election,
        resync: Duration::from_secs(300),
        concurrency: 4,
        namespace: Some(ns.to_owned()),
    };
    let metrics = ControllerMetrics::register(&mut Registry::default());
    tokio::spawn(manager::run(
        client,
        options,
        Health::new(),
        metrics,
        shutdown.clone(),
    ));
    shutdown
}

/// The manager's identity in `ns`: a ServiceAccount bound only to the ClusterRole (and, when
/// `leader_election`, to the leader-election Role in `ns`).
pub async fn manager_identity(plane: &ControlPlane, ns: &str, leader_election: bool) -> Identity {
    let admin = plane.client().await.unwrap();
    let identity = Identity::service_account(ns, MANAGER_SA);
    // Creates the ServiceAccount.
    plane.client_as(&identity).await.unwrap();
    let role = manager_cluster_role();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("rstream-operator-{ns}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role.name_any()},
        "subjects": [{"kind": "ServiceAccount", "name": MANAGER_SA, "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    if leader_election {
        let mut role = leader_election_role();
        role.metadata.namespace = Some(ns.to_owned());
        Api::<Role>::namespaced(admin.clone(), ns)
            .create(&PostParams::default(), &role)
            .await
            .unwrap();
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "rstream-operator-leader-election"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role.name_any()},
            "subjects": [{"kind": "ServiceAccount", "name": MANAGER_SA, "namespace": ns}],
        }))
        .unwrap();
        Api::<RoleBinding>::namespaced(admin, ns)
            .create(&PostParams::default(), &binding)
            .await
            .unwrap();
    }
    identity
}

/// Requests by `user` the API server answered with 403.
pub async fn forbidden_requests(plane: &ControlPlane, user: &str) -> Vec<String> {
    // writes_by waits until every request answered so far is in the audit log.
    plane.writes_by(user).await.unwrap();
    plane
        .audit_events()
        .unwrap()
        .into_iter()
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect()
}

pub fn sa_user(ns: &str, name: &str) -> String {
    format!("system:serviceaccount:{ns}:{name}")
}

/// Polls `check` every 100 ms until it returns `Some`, or panics after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(status, reason, message)` of a tunnel condition.
pub fn condition(t: &RstreamTunnel, type_: &str) -> Option<(String, String, String)> {
    t.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until the tunnel's condition has `status` and `reason`; returns the tunnel.
pub async fn wait_condition(
    api: &Api<RstreamTunnel>,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
    timeout: Duration,
) -> RstreamTunnel {
    let deadline = Instant::now() + timeout;
    loop {
        let t = api.get(name).await.ok();
        if let Some(t) = &t
            && let Some((s, r, _)) = condition(t, type_)
            && s == status
            && r == reason
        {
            return t.clone();
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {name}: {type_}={status}/{reason}; last status: {:?}",
            t.and_then(|t| t.status)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn secret(name: &str, data: &[(&str, &str)]) -> Secret {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "stringData": data.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect::<std::collections::BTreeMap<_, _>>(),
    }))
    .unwrap()
}

pub fn service(name: &str, ports: serde_json::Value) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"ports": ports},
    }))
    .unwrap()
}

pub fn connection(name: &str, spec: serde_json::Value) -> RstreamConnection {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

pub fn tunnel(name: &str, spec: serde_json::Value) -> RstreamTunnel {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamTunnel",
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

pub async fn create<K>(client: &Client, ns: &str, obj: &K) -> K
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), obj)
        .await
        .unwrap()
}

/// An HTTP/1.1 server on loopback answering every request with `body`.
pub async fn http_server(body: &'static str) -> std::net::SocketAddr {
    proxy_core::testing::http_server([127, 0, 0, 1].into(), body)
        .await
        .unwrap()
}

/// Sends `GET /` to `addr` and returns the whole response.
pub async fn http_get(addr: std::net::SocketAddr) -> std::io::Result<String> {
    proxy_core::testing::http_get(addr, "/").await
}

/// A free loopback port.
pub fn free_port() -> u16 {
    proxy_core::testing::free_port().unwrap()
}

/// The status code of `GET http://addr/path`, or 0 when nothing answers.
pub async fn http_status(addr: &str, path: &str) -> u16 {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return 0;
    }
    let mut out = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await;
    out.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}
