//! Helpers of the operator's integration tests: the shared control plane with the CRDs and the
//! manager's ClusterRole, identities, objects and waits.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt as _};
use netkit_testenv::{ControlPlane, Identity};
use prometheus_client::registry::Registry;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::manager::{self, ManagerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

mod fixtures;
#[allow(unused_imports, reason = "a test binary may use none of them")]
pub use fixtures::*;

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

/// The image pull Secret the test manager gives every agent (`--agent-image-pull-secrets`).
pub const MANAGER_PULL_SECRET: &str = "registry-of-the-manager";

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
    start_manager_observed(client, ns, leader_election).await.0
}

/// Like [`start_manager_with`], and the manager's readiness checks (`tunnels/leadership` says
/// when a term of the tunnels' controller ended).
pub async fn start_manager_observed(
    client: Client,
    ns: &str,
    leader_election: Option<(String, String)>,
) -> (CancellationToken, Health) {
    start_manager_scoped(client, Some(ns), leader_election).await
}

/// Like [`start_manager_observed`], watching `namespace` or, with `None`, the whole cluster (a
/// test binary of its own then: it reconciles every namespace's objects).
pub async fn start_manager_scoped(
    client: Client,
    namespace: Option<&str>,
    leader_election: Option<(String, String)>,
) -> (CancellationToken, Health) {
    let shutdown = CancellationToken::new();
    let options = ManagerOptions {
        agent_image: "example.test/rstream-operator:dev".into(),
        agent_image_pull_secrets: vec![MANAGER_PULL_SECRET.to_owned()],
        leader_election,
        resync: Duration::from_secs(300),
        concurrency: 4,
        namespace: namespace.map(str::to_owned),
        load_balancer_class: Some(manager::service::LOAD_BALANCER_CLASS.to_owned()),
    };
    let metrics = ControllerMetrics::register(&mut Registry::default());
    let health = Health::new();
    tokio::spawn(manager::run(
        client,
        options,
        health.clone(),
        metrics,
        shutdown.clone(),
    ));
    (shutdown, health)
}

/// The manager's identity in `ns`: a ServiceAccount bound only to the ClusterRole (and, when
/// `leader_election`, to the leader-election Role in `ns`).
pub async fn manager_identity(plane: &ControlPlane, ns: &str, leader_election: bool) -> Identity {
    manager_identity_named(plane, ns, MANAGER_SA, leader_election).await
}

/// Like [`manager_identity`], for ServiceAccount `sa` (a second manager under a name of its
/// own, so the audit log tells the two apart).
pub async fn manager_identity_named(
    plane: &ControlPlane,
    ns: &str,
    sa: &str,
    leader_election: bool,
) -> Identity {
    let admin = plane.client().await.unwrap();
    let identity = Identity::service_account(ns, sa);
    // Creates the ServiceAccount.
    plane.client_as(&identity).await.unwrap();
    let role = manager_cluster_role();
    let binding: ClusterRoleBinding = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{sa}-{ns}")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role.name_any()},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(admin.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    if leader_election {
        let mut role = leader_election_role();
        role.metadata.namespace = Some(ns.to_owned());
        let params = PatchParams::apply("tests").force();
        Api::<Role>::namespaced(admin.clone(), ns)
            .patch(&role.name_any(), &params, &Patch::Apply(&role))
            .await
            .unwrap();
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": format!("{sa}-leader-election")},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role.name_any()},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
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
    netkit_testenv::fixtures::http_server([127, 0, 0, 1].into(), body)
        .await
        .unwrap()
}

/// Sends `GET /` to `addr` and returns the whole response.
pub async fn http_get(addr: std::net::SocketAddr) -> std::io::Result<String> {
    netkit_testenv::fixtures::http_get(addr, "/").await
}

/// A free loopback port.
pub fn free_port() -> u16 {
    netkit_testenv::fixtures::free_port().unwrap()
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

/// The value of `leader_election_master_status{name="<controller>"}` on `http://addr/metrics`, if
/// it answers.
pub async fn leader_gauge(addr: &str, controller: &str) -> Option<i64> {
    let prefix = format!("leader_election_master_status{{name=\"{controller}\"}}");
    gauge(addr, &prefix).await
}

/// The value of the first sample starting with `prefix` (name and labels) on
/// `http://addr/metrics`, if it answers.
pub async fn gauge(addr: &str, prefix: &str) -> Option<i64> {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return None;
    };
    let req = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    s.write_all(req.as_bytes()).await.ok()?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    out.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

/// A child process (the manager or the agent binary) killed on drop, with its log file.
pub struct Process {
    child: Option<netkit_testenv::fixtures::KillOnDrop>,
    /// Where it writes stdout and stderr.
    pub log: std::path::PathBuf,
    /// Its /healthz and /readyz address.
    pub health: String,
    /// Its /metrics address (plain HTTP: the manager runs with `--metrics-secure=false`, as
    /// these tests are not about who may scrape).
    pub metrics: String,
}

impl Process {
    fn spawn(
        cmd: &mut std::process::Command,
        log: std::path::PathBuf,
        health: String,
        metrics: String,
    ) -> Self {
        let file = std::fs::File::create(&log).unwrap();
        cmd.stdout(file.try_clone().unwrap()).stderr(file);
        let child = netkit_testenv::fixtures::KillOnDrop::spawn(cmd).unwrap();
        Self {
            child: Some(child),
            log,
            health,
            metrics,
        }
    }

    /// The manager binary as `kubeconfig`'s identity, with leader election in `ns` under
    /// `identity` (POD_NAME, as its Deployment sets it), plus `extra` flags.
    pub fn manager(
        kubeconfig: &std::path::Path,
        ns: &str,
        identity: &str,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> Self {
        let health = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rstream-operator"));
        cmd.env("KUBECONFIG", kubeconfig)
            .env("POD_NAME", identity)
            .env_remove("RUST_LOG")
            .args([
                "--leader-elect",
                "--leader-election-namespace",
                ns,
                "--metrics-bind-address",
                &metrics,
                "--metrics-secure=false",
                "--health-probe-bind-address",
                &health,
                "--agent-image",
                "example.test/rstream-operator:live",
                "--log-format",
                "text",
            ])
            .args(extra);
        Self::spawn(
            &mut cmd,
            dir.join(format!("manager-{identity}.log")),
            health,
            metrics,
        )
    }

    /// Whether it leads the tunnels' controller (its leader gauge).
    pub async fn leads(&self) -> bool {
        leader_gauge(&self.metrics, manager::TUNNEL_CONTROLLER).await == Some(1)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, no chance to clean up (or release a Lease).
    pub fn kill9(&mut self) {
        drop(self.child.take());
    }

    /// SIGTERM, then waits for the exit; whether it exited successfully.
    pub async fn terminate(&mut self) -> bool {
        match self.child.take() {
            Some(child) => child.terminate(Duration::from_secs(10)).await,
            None => false,
        }
    }
}

/// A live tunnel: LocalEngine as the engine, the tunnel's Secret, connection and target
/// Services in `ns`, loopback HTTP servers standing in for each Service (Service DNS does not
/// resolve here), and the agent run as its Deployment would run it.
pub struct Live {
    pub ns: String,
    pub admin: Client,
    pub tunnels: Api<RstreamTunnel>,
    pub engine: rstream_client::engine::LocalEngine,
    /// `<service>.<ns>.svc:<port>` (what the agent's config names) to the server standing in.
    pub services: std::collections::BTreeMap<String, std::net::SocketAddr>,
    pub dir: tempfile::TempDir,
}

/// The body each stand-in server answers with.
pub fn body_of(service: &str) -> String {
    format!("hello from {service}")
}

impl Live {
    /// The objects of a published HTTP tunnel `web` to Service `targets[0]` (port name `http`),
    /// with the other `targets` as Services too; the manager is not started here.
    pub async fn new(plane: &ControlPlane, ns: &str, targets: &[&'static str]) -> Live {
        let admin = plane.client().await.unwrap();
        let engine = rstream_client::engine::LocalEngine::builder()
            .token("live-token")
            .start()
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("engine-ca.pem"), engine.ca_pem()).unwrap();
        create(
            &admin,
            ns,
            &secret("rstream-credentials", &[("token", "live-token")]),
        )
        .await;
        let mut services = std::collections::BTreeMap::new();
        for (i, name) in targets.iter().enumerate() {
            let port = 8080 + i as u16;
            create(
                &admin,
                ns,
                &service(name, serde_json::json!([{"name": "http", "port": port}])),
            )
            .await;
            let body: &'static str = Box::leak(body_of(name).into_boxed_str());
            services.insert(format!("{name}.{ns}.svc:{port}"), http_server(body).await);
        }
        create(
            &admin,
            ns,
            &connection(
                "default",
                serde_json::json!({
            "engine": engine.engine_address(),
            "tokenSecretRef": {"name": "rstream-credentials", "key": "token"}}),
            ),
        )
        .await;
        create(
            &admin,
            ns,
            &tunnel(
                "web",
                serde_json::json!({
            "target": {"service": {"name": targets[0], "port": "http"}},
            "publish": true, "protocol": "http", "http": {"version": "http/1.1"}}),
            ),
        )
        .await;
        Live {
            ns: ns.to_owned(),
            tunnels: Api::namespaced(admin.clone(), ns),
            admin,
            engine,
            services,
            dir,
        }
    }

    /// The base name of the tunnel's children.
    pub async fn base(&self) -> String {
        let t = self.tunnels.get("web").await.unwrap();
        rstream_operator::names::base_name(&self.ns, "web", t.uid().as_deref())
    }

    /// The agent's Deployment.
    pub async fn deployment(&self) -> k8s_openapi::api::apps::v1::Deployment {
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(self.admin.clone(), &self.ns)
            .get(&self.base().await)
            .await
            .unwrap()
    }

    /// The agent's config as the manager rendered it into the ConfigMap.
    pub async fn agent_config(&self) -> String {
        let cm =
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(self.admin.clone(), &self.ns)
                .get(&format!("{}-config", self.base().await))
                .await
                .unwrap();
        cm.data.unwrap()[rstream_operator::names::CONFIG_KEY].clone()
    }

    /// Starts the agent as the Deployment would run it now: the config of the ConfigMap, the
    /// token of the Secret, the ServiceAccount the manager made; its target is the stand-in
    /// server of the Service its config names (a config naming no known Service panics).
    pub async fn start_agent(&self, plane: &ControlPlane, pod: &str) -> Process {
        use rstream_operator::agent_config::AgentConfig;
        let base = self.base().await;
        let text = self.agent_config().await;
        let config = AgentConfig::from_yaml(&text).unwrap();
        let target = config.target_address();
        let server = *self.services.get(&target).unwrap_or_else(|| {
            panic!("the agent config targets {target}, no Service of this test")
        });
        let config_path = self.dir.path().join(format!("{pod}.yaml"));
        std::fs::write(&config_path, &text).unwrap();
        let kubeconfig = plane
            .kubeconfig_as(&Identity::service_account(&self.ns, &base))
            .await
            .unwrap();
        let health = format!("127.0.0.1:{}", free_port());
        let ca = self.dir.path().join("engine-ca.pem");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_rstream-agent"));
        cmd.env("KUBECONFIG", &kubeconfig)
            .env_remove("RUST_LOG")
            .env(rstream_operator::names::TOKEN_ENV, "live-token")
            .env(rstream_operator::names::POD_NAME_ENV, pod)
            .env(rstream_operator::names::POD_NAMESPACE_ENV, &self.ns)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--health-bind-address={health}"))
            .arg(format!("--target-override={server}"))
            .arg(format!("--ca-file={}", ca.display()));
        // The agent serves /metrics with its health, as before.
        Process::spawn(
            &mut cmd,
            self.dir.path().join(format!("{pod}.log")),
            health.clone(),
            health,
        )
    }

    /// Waits until the tunnel is online from agent `pod`; returns its ingress on the engine.
    pub async fn online(&self, pod: &str) -> std::net::SocketAddr {
        let tunnels = self.tunnels.clone();
        let t = wait_for(
            "the tunnel online from the agent",
            Duration::from_secs(30),
            || {
                let tunnels = tunnels.clone();
                async move {
                    let t = tunnels.get("web").await.ok()?;
                    let (status, reason, message) = condition(&t, "TunnelReady")?;
                    (status == "True" && reason == "TunnelOnline" && message.contains(pod))
                        .then_some(t)
                }
            },
        )
        .await;
        let id = t.status.unwrap().tunnel_id.unwrap();
        self.engine.ingress_addr(&id).unwrap()
    }

    /// No kubelet: reports the agent Deployment available, as its readiness probe would.
    pub async fn report_deployment_available(&self) {
        Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(self.admin.clone(), &self.ns)
            .patch_status(
                &self.base().await,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({
                "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
            )
            .await
            .unwrap();
        wait_condition(
            &self.tunnels,
            "web",
            "Ready",
            "True",
            "Ready",
            Duration::from_secs(60),
        )
        .await;
    }
}

/// The config-hash annotation of a Deployment's Pod template.
pub fn config_hash(d: &k8s_openapi::api::apps::v1::Deployment) -> String {
    d.spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
        .and_then(|a| a.get(rstream_operator::names::CONFIG_HASH_ANNOTATION))
        .cloned()
        .unwrap_or_default()
}

/// `GET /` through `ingress`; the body, or the error.
pub async fn body_through(ingress: std::net::SocketAddr) -> Result<String, String> {
    match tokio::time::timeout(Duration::from_secs(30), http_get(ingress)).await {
        Ok(Ok(r)) if r.starts_with("HTTP/1.1 200") => {
            Ok(r.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
        }
        Ok(Ok(r)) => Err(r),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer in 30 s".to_owned()),
    }
}
