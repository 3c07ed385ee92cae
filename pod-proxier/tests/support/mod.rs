//! The test fixture shared by pod-proxier's integration tests (`chaos`, `modes`, `dataplane`
//! and the `e2e` binary): the real control plane with the PortMapping CRD (shared, or a test's
//! own to break), the chart's RBAC bound to pod-proxier's ServiceAccount, the binary as a child
//! process started with flags and waited for, loopback backends posing as pods, and a tiny HTTP
//! client.
#![allow(dead_code, unused_imports, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::{Client, CustomResourceExt as _};
use netkit_testenv::{ControlPlane, Identity};
use pod_proxier::crd::PortMapping;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::OnceCell;

/// The rules of the chart, in its three scopes.
#[derive(Deserialize)]
pub struct ChartRules {
    pub cluster: Vec<PolicyRule>,
    pub state: Vec<PolicyRule>,
    pub target: Vec<PolicyRule>,
}

pub fn chart_rules() -> ChartRules {
    serde_yaml_ng::from_str(include_str!("../../chart/files/rbac-rules.yaml")).unwrap()
}

static CRD: OnceCell<()> = OnceCell::const_new();

/// The control plane shared by the tests of a binary, with the PortMapping CRD.
pub async fn plane() -> &'static ControlPlane {
    let plane = ControlPlane::shared().await.unwrap();
    CRD.get_or_init(|| async {
        plane.install_crds(&[PortMapping::crd()]).await.unwrap();
    })
    .await;
    plane
}

/// A control plane of its own, with the PortMapping CRD and `apiserver_args`: for a test that
/// breaks it (stops, freezes, restarts) or needs other API server flags. It lives until the
/// test binary exits.
pub async fn own_plane(apiserver_args: &[&str]) -> &'static ControlPlane {
    let builder = apiserver_args
        .iter()
        .fold(ControlPlane::builder(), |builder, arg| {
            builder.apiserver_arg(*arg)
        });
    let plane = builder.start().await.unwrap();
    plane.install_crds(&[PortMapping::crd()]).await.unwrap();
    Box::leak(Box::new(plane))
}

/// `--enable-v1 --enable-v2` with a V2 range of `count` free ports and `--off-check`: what most
/// scenarios run with, before their own flags.
pub fn v1_v2_flags(count: u16) -> Vec<String> {
    let (start, end) = free_range(count);
    [
        "--enable-v1",
        "--enable-v2",
        "--port-range-start",
        &start.to_string(),
        "--port-range-end",
        &end.to_string(),
        "--off-check",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// One test's world: a state namespace for pod-proxier and target namespaces it may serve.
pub struct Env {
    pub plane: &'static ControlPlane,
    pub admin: Client,
    pub state_ns: String,
    pub targets: Vec<String>,
    /// kubeconfig of the `pod-proxier` ServiceAccount bound to the chart's rules only.
    pub kubeconfig: PathBuf,
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_owned()),
        namespace: namespace.map(str::to_owned),
        ..ObjectMeta::default()
    }
}

fn sa_subject(namespace: &str, name: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".to_owned(),
        name: name.to_owned(),
        namespace: Some(namespace.to_owned()),
        ..Subject::default()
    }]
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: Some("rbac.authorization.k8s.io".to_owned()),
        kind: kind.to_owned(),
        name: name.to_owned(),
    }
}

async fn apply<K>(api: &Api<K>, name: &str, object: &K)
where
    K: kube::Resource + serde::Serialize + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    api.patch(
        name,
        &PatchParams::apply("pod-proxier-tests").force(),
        &Patch::Apply(object),
    )
    .await
    .unwrap();
}

impl Env {
    /// A state namespace and `target_count` target namespaces, with the chart's RBAC bound.
    pub async fn new(prefix: &str, target_count: usize) -> Env {
        Self::on(plane().await, prefix, target_count).await
    }

    /// Like [`Env::new`], on `plane` (with the PortMapping CRD installed).
    pub async fn on(plane: &'static ControlPlane, prefix: &str, target_count: usize) -> Env {
        let admin = plane.client().await.unwrap();
        let state_ns = plane
            .create_namespace(&format!("{prefix}-state"))
            .await
            .unwrap();
        let mut targets = Vec::new();
        for i in 0..target_count {
            targets.push(
                plane
                    .create_namespace(&format!("{prefix}-t{i}"))
                    .await
                    .unwrap(),
            );
        }
        let rules = chart_rules();
        let sa = "pod-proxier";
        // Cluster scope.
        let cluster_role = format!("pod-proxier-cluster-{state_ns}");
        let mut cr = ClusterRole {
            metadata: meta(&cluster_role, None),
            rules: Some(rules.cluster.clone()),
            ..ClusterRole::default()
        };
        cr.metadata.name = Some(cluster_role.clone());
        apply(
            &Api::all(admin.clone()),
            &cluster_role,
            &with_kind(cr, "ClusterRole"),
        )
        .await;
        let crb = ClusterRoleBinding {
            metadata: meta(&cluster_role, None),
            role_ref: role_ref("ClusterRole", &cluster_role),
            subjects: Some(sa_subject(&state_ns, sa)),
        };
        apply(
            &Api::all(admin.clone()),
            &cluster_role,
            &with_kind(crb, "ClusterRoleBinding"),
        )
        .await;
        // State namespace.
        let role = Role {
            metadata: meta("pod-proxier", Some(&state_ns)),
            rules: Some(rules.state.clone()),
        };
        apply(
            &Api::namespaced(admin.clone(), &state_ns),
            "pod-proxier",
            &with_kind(role, "Role"),
        )
        .await;
        let rb = RoleBinding {
            metadata: meta("pod-proxier", Some(&state_ns)),
            role_ref: role_ref("Role", "pod-proxier"),
            subjects: Some(sa_subject(&state_ns, sa)),
        };
        apply(
            &Api::namespaced(admin.clone(), &state_ns),
            "pod-proxier",
            &with_kind(rb, "RoleBinding"),
        )
        .await;
        // Target namespaces.
        let target_role = format!("pod-proxier-target-{state_ns}");
        let tr = ClusterRole {
            metadata: meta(&target_role, None),
            rules: Some(rules.target.clone()),
            ..ClusterRole::default()
        };
        apply(
            &Api::all(admin.clone()),
            &target_role,
            &with_kind(tr, "ClusterRole"),
        )
        .await;
        for ns in &targets {
            let rb = RoleBinding {
                metadata: meta("pod-proxier", Some(ns)),
                role_ref: role_ref("ClusterRole", &target_role),
                subjects: Some(sa_subject(&state_ns, sa)),
            };
            apply(
                &Api::namespaced(admin.clone(), ns),
                "pod-proxier",
                &with_kind(rb, "RoleBinding"),
            )
            .await;
        }
        let kubeconfig = plane
            .kubeconfig_as(&Identity::service_account(&state_ns, sa))
            .await
            .unwrap();
        Env {
            plane,
            admin,
            state_ns,
            targets,
            kubeconfig,
        }
    }

    /// A token of a new ServiceAccount `name` in `namespace`, granted `rules` there.
    pub async fn caller(&self, namespace: &str, name: &str, rules: Vec<PolicyRule>) -> String {
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin.clone(), namespace);
        let sa = ServiceAccount {
            metadata: meta(name, Some(namespace)),
            ..ServiceAccount::default()
        };
        match sas.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("{e}"),
        }
        if !rules.is_empty() {
            let role = Role {
                metadata: meta(name, Some(namespace)),
                rules: Some(rules),
            };
            apply(
                &Api::namespaced(self.admin.clone(), namespace),
                name,
                &with_kind(role, "Role"),
            )
            .await;
            let rb = RoleBinding {
                metadata: meta(name, Some(namespace)),
                role_ref: role_ref("Role", name),
                subjects: Some(sa_subject(namespace, name)),
            };
            apply(
                &Api::namespaced(self.admin.clone(), namespace),
                name,
                &with_kind(rb, "RoleBinding"),
            )
            .await;
        }
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        sas.create_token_request(name, &PostParams::default(), &request)
            .await
            .unwrap()
            .status
            .unwrap()
            .token
            .unwrap()
    }

    /// A caller allowed to port-forward to pods and get Services in `namespace`.
    pub async fn debugger(&self, namespace: &str) -> String {
        self.caller(
            namespace,
            "debugger",
            vec![port_forward_rule(), get_services_rule()],
        )
        .await
    }

    /// A Running pod with `ip` and, optionally, a container port named `port_name`.
    pub async fn pod(
        &self,
        namespace: &str,
        name: &str,
        ip: &str,
        named_port: Option<(&str, u16)>,
    ) {
        let ports: Vec<Value> = named_port
            .map(|(n, p)| vec![json!({"name": n, "containerPort": p})])
            .unwrap_or_default();
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "app", "image": "example", "ports": ports}]}
        }))
        .unwrap();
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        pods.create(&PostParams::default(), &pod).await.unwrap();
        if !ip.is_empty() {
            self.set_pod_ip(namespace, name, ip).await;
        }
    }

    pub async fn set_pod_ip(&self, namespace: &str, name: &str, ip: &str) {
        let pods: Api<Pod> = Api::namespaced(self.admin.clone(), namespace);
        let status = json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
        pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }

    /// A Running pod `name` at `ip` whose container port `jprofiler-port` is a new server on
    /// `ip` greeting with `tag`; returns the server's address.
    pub async fn pod_with_backend(
        &self,
        namespace: &str,
        name: &str,
        ip: &str,
        tag: &str,
    ) -> SocketAddr {
        let server = backend(ip, tag).await;
        self.pod(namespace, name, ip, Some(("jprofiler-port", server.port())))
            .await;
        server
    }

    pub fn mappings(&self) -> Api<PortMapping> {
        Api::namespaced(self.admin.clone(), &self.state_ns)
    }
}

fn with_kind<K: serde::Serialize + serde::de::DeserializeOwned>(object: K, kind: &str) -> K {
    let mut value = serde_json::to_value(&object).unwrap();
    value["apiVersion"] = json!("rbac.authorization.k8s.io/v1");
    value["kind"] = json!(kind);
    serde_json::from_value(value).unwrap()
}

pub fn port_forward_rule() -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec!["pods/portforward".to_owned()]),
        verbs: vec!["create".to_owned()],
        ..PolicyRule::default()
    }
}

pub fn get_services_rule() -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![String::new()]),
        resources: Some(vec!["services".to_owned()]),
        verbs: vec!["get".to_owned()],
        ..PolicyRule::default()
    }
}

/// A free loopback port (from the ephemeral range; the V2 ranges stay below it).
pub fn free_port() -> u16 {
    netkit_testenv::fixtures::free_port().unwrap()
}

/// `count` consecutive ports free on 127.0.0.1.
pub fn free_range(count: u16) -> (u16, u16) {
    netkit_testenv::fixtures::free_port_range(count).unwrap()
}

/// The pod-proxier binary as a child process.
pub struct Proxier {
    child: Option<Child>,
    pub api: SocketAddr,
    pub entry: SocketAddr,
    pub metrics: SocketAddr,
    pub log: PathBuf,
    args: Vec<String>,
    /// The binary's user name at the API server.
    pub user: String,
    plane: &'static ControlPlane,
}

impl Proxier {
    /// Starts pod-proxier with the env's ServiceAccount, on loopback, plus `extra` flags, and
    /// waits until it is ready.
    pub async fn start<S: AsRef<str>>(env: &Env, extra: &[S]) -> Proxier {
        let mut proxier = Self::prepare(env, extra);
        proxier.spawn().await;
        proxier
    }

    /// The configuration `pod-proxier haproxy-config` prints for these flags.
    pub fn haproxy_config(&self) -> String {
        netkit_testenv::fixtures::stdout_of(
            Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
                .arg("haproxy-config")
                .args(&self.args),
        )
        .unwrap()
    }

    /// Like [`Self::start`], without starting.
    pub fn prepare<S: AsRef<str>>(env: &Env, extra: &[S]) -> Proxier {
        let api = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let entry = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut args: Vec<String> = vec![
            "--kubeconfig".into(),
            env.kubeconfig.display().to_string(),
            "--state-namespace".into(),
            env.state_ns.clone(),
            "--identity".into(),
            format!("replica-{}", env.state_ns),
            "--listen-addr".into(),
            "127.0.0.1".into(),
            "--api-listen-addr".into(),
            "127.0.0.1".into(),
            "--listen-port".into(),
            api.port().to_string(),
            "--default-map-port".into(),
            entry.port().to_string(),
            // Health and metrics on one plain-HTTP address: these tests read /metrics as
            // anyone (who may read it is tested in k8s-reconcile's tests/secure_metrics.rs).
            "--health-addr".into(),
            metrics.to_string(),
            "--metrics-addr".into(),
            metrics.to_string(),
            "--metrics-secure=false".into(),
            "--allowed-namespaces".into(),
            env.targets.join(","),
            "--log-level".into(),
            "info,pod_proxier=debug".into(),
            "--drain-timeout".into(),
            "1s".into(),
        ];
        args.extend(extra.iter().map(|s| s.as_ref().to_owned()));
        // The scenarios written for the original's single V1 port run in its compatibility mode;
        // tests/access.rs runs the port range.
        if !args.iter().any(|a| a.starts_with("--v1-")) {
            args.push("--v1-shared-port".into());
        }
        // The tests speak plain HTTP to the API unless they bring a certificate (tests/tls.rs).
        if !args.iter().any(|a| a.starts_with("--tls-")) {
            args.push("--plain-http".into());
        }
        let log = env
            .plane
            .dir()
            .join(format!("pod-proxier-{}.log", env.state_ns));
        Proxier {
            child: None,
            api,
            entry,
            metrics,
            log,
            args,
            user: format!("system:serviceaccount:{}:pod-proxier", env.state_ns),
            plane: env.plane,
        }
    }

    pub async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_pod-proxier"))
            .args(&self.args)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.wait_ready().await;
    }

    async fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("pod-proxier exited with {status}:\n{}", self.logs());
            }
            if let Ok((200, _)) = get_text(self.metrics, "/readyz").await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pod-proxier not ready:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A second replica with the same flags, bound on `ip` instead of 127.0.0.1 (same ports),
    /// under another identity.
    pub async fn replica(&self, ip: &str, identity: &str) -> Proxier {
        let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut args = self.args.clone();
        let mut i = 0;
        while i < args.len() {
            match args[i].as_str() {
                "--listen-addr" | "--api-listen-addr" => args[i + 1] = ip.to_owned(),
                "--health-addr" | "--metrics-addr" => args[i + 1] = metrics.to_string(),
                "--identity" => args[i + 1] = identity.to_owned(),
                _ => {}
            }
            i += 1;
        }
        let ip: IpAddr = ip.parse().unwrap();
        let log = self.log.with_extension(format!("{identity}.log"));
        let mut replica = Proxier {
            child: None,
            api: SocketAddr::new(ip, self.api.port()),
            entry: SocketAddr::new(ip, self.entry.port()),
            metrics,
            log,
            args,
            user: self.user.clone(),
            plane: self.plane,
        };
        replica.spawn().await;
        replica
    }

    /// Whether the process still runs (it never exited or was restarted by anyone).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGKILL, no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        let pid = child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        child.wait().unwrap()
    }

    /// Starts again with the same flags and ports.
    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn().await;
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The binary's requests the API server answered 403, from its audit log (the binary's own
    /// log could leave one out); panics if the binary made no request at all.
    pub async fn forbidden(&self) -> Vec<String> {
        let requests = self.plane.requests_by(&self.user).await.unwrap();
        assert!(!requests.is_empty(), "no request by {} audited", self.user);
        requests
            .iter()
            .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
            .map(|e| format!("{} {}", e.verb, e.request_uri))
            .collect()
    }

    /// Least privilege, proven: the API server never answered the binary 403.
    pub async fn assert_never_forbidden(&self) {
        let forbidden = self.forbidden().await;
        assert!(
            forbidden.is_empty(),
            "the API server refused pod-proxier: {forbidden:?}"
        );
    }

    /// Maps `pod` (`namespace/name`) for `ttl_seconds` as `token` (none with `--auth none`)
    /// through the V1 API, as a scenario's set-up: panics unless the answer is 200. Returns the
    /// answer.
    pub async fn map(&self, token: Option<&str>, pod: &str, ttl_seconds: u64) -> Value {
        let request = json!({"pod_name": pod, "time": ttl_seconds});
        let (status, body) = self
            .call("POST", "/api/v1/mapping", token, Some(request))
            .await;
        assert_eq!(status, 200, "{body}");
        body
    }

    pub async fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        request(
            self.api,
            method,
            path,
            token,
            body.as_ref().map(|_| "application/json"),
            body.as_deref().unwrap_or("").as_bytes(),
        )
        .await
    }
}

impl Drop for Proxier {
    fn drop(&mut self) {
        self.kill9();
        // The control plane's directory goes away with the test binary; keep logs on request.
        if let Ok(dir) = std::env::var("POD_PROXIER_TEST_LOGS")
            && let Some(name) = self.log.file_name()
        {
            let _ = std::fs::create_dir_all(&dir);
            let _ = std::fs::copy(&self.log, std::path::Path::new(&dir).join(name));
        }
    }
}

/// One HTTP/1.1 request over a fresh connection; the body parsed as JSON when it is.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> (u16, Value) {
    let (status, text) = raw_request(addr, method, path, token, content_type, body)
        .await
        .unwrap();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

pub async fn get_text(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    raw_request(addr, "GET", path, None, None, b"").await
}

pub async fn raw_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    content_type: Option<&str>,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(ct) = content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    head.push_str("\r\n");
    // The server may answer (e.g. 413) and close before reading everything.
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body).await;
    let mut response = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut response)).await;
    if read.is_err() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer",
        ));
    }
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {text:?}")))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// A "pod": a loopback server on `ip` that greets with `tag` and then echoes.
pub async fn backend(ip: &str, tag: &str) -> SocketAddr {
    backend_on(ip, 0, tag).await
}

pub async fn backend_on(ip: &str, port: u16, tag: &str) -> SocketAddr {
    let ip: IpAddr = ip.parse().unwrap();
    let listener = TcpListener::bind((ip, port)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let greeting = format!("{tag}\n");
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let greeting = greeting.clone();
            tokio::spawn(async move {
                if conn.write_all(greeting.as_bytes()).await.is_err() {
                    return;
                }
                let (mut r, mut w) = conn.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// The greeting of whoever answers on `addr`, or `None` if the connection is refused or closed
/// without one.
pub async fn greeting(addr: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match stream.read(&mut byte).await {
                Ok(0) | Err(_) => return,
                Ok(_) if byte[0] == b'\n' => return,
                Ok(_) => buf.push(byte[0]),
            }
        }
    })
    .await;
    if read.is_err() || buf.is_empty() {
        return None;
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// What a client bound to `source` gets from `entry`: the greeting, or `None` when it is
/// refused or closed before any byte. Fails the test if neither happens in 30 s.
pub async fn greeting_from(source: &str, entry: SocketAddr) -> Option<String> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(source.parse().unwrap(), 0))
        .unwrap();
    let mut stream = socket.connect(entry).await.ok()?;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte).await {
                Ok(0) | Err(_) => return,
                Ok(_) if byte[0] == b'\n' => return,
                Ok(_) => buf.push(byte[0]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "{entry} neither answered nor closed in 30 s");
    (!buf.is_empty()).then(|| String::from_utf8_lossy(&buf).into_owned())
}

pub use netkit_testenv::eventually;

/// How a port met one connection: the greeting of whoever answered, a refusal (refused, or
/// closed before any byte), or neither (a timeout: proves nothing either way).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    Answered(String),
    Refused,
    Unclear(String),
}

/// One connection to `addr`, read up to the greeting's newline (within 5 s).
pub async fn probe(addr: SocketAddr) -> Probe {
    use std::io::ErrorKind;
    let mut stream =
        match tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr)).await {
            Err(_) => return Probe::Unclear("connect timed out after 5 s".to_owned()),
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => return Probe::Refused,
            Ok(Err(e)) => return Probe::Unclear(format!("connect: {e}")),
            Ok(Ok(stream)) => stream,
        };
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stream.read(&mut byte).await {
                Ok(0) => return Ok(()),
                Err(e) => return Err(e),
                Ok(_) if byte[0] == b'\n' => return Ok(()),
                Ok(_) => buf.push(byte[0]),
            }
        }
    })
    .await;
    match read {
        Err(_) if buf.is_empty() => Probe::Unclear("no byte within 5 s".to_owned()),
        Ok(Ok(())) if buf.is_empty() => Probe::Refused,
        Ok(Err(e))
            if buf.is_empty()
                && matches!(
                    e.kind(),
                    ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted
                        | ErrorKind::BrokenPipe
                ) =>
        {
            Probe::Refused
        }
        Ok(Ok(())) => Probe::Answered(String::from_utf8_lossy(&buf).into_owned()),
        other => Probe::Unclear(format!(
            "{other:?} after {:?}",
            String::from_utf8_lossy(&buf)
        )),
    }
}

/// How late an expiry may be before the check fails: generous, so a busy machine never fails
/// it (the precision of expiry is `cargo xtask bench`'s figure, not a test's).
pub const EXPIRY_LATE_LIMIT: Duration = Duration::from_secs(10);

/// One [`probe`] with the wall-clock times it started and ended.
#[derive(Debug, Clone)]
pub struct Probed {
    pub started: k8s_openapi::jiff::Timestamp,
    pub ended: k8s_openapi::jiff::Timestamp,
    pub outcome: Probe,
}

/// Whether `probes` (in order, of a port mapped to `tag` until `deadline`) prove an expiry that
/// is neither early nor far too late: some probe answered `tag` and ended before the deadline;
/// no probe that ended before the deadline was refused (an early expiry) and none answered
/// another greeting; a refusal started no later than [`EXPIRY_LATE_LIMIT`] after the deadline;
/// every probe after the first refusal that ended past the deadline was refused too, at least
/// three. Ok is the lateness: from the deadline to the start of that first refusal (the probe
/// before it answered or proved nothing, so the mapping ended between the two).
pub fn judge_expiry(
    tag: &str,
    deadline: k8s_openapi::jiff::Timestamp,
    probes: &[Probed],
) -> Result<Duration, String> {
    let ms = |t: k8s_openapi::jiff::Timestamp| t.as_millisecond() - deadline.as_millisecond();
    let unclear = probes
        .iter()
        .filter(|p| matches!(p.outcome, Probe::Unclear(_)))
        .count();
    let note = format!("{} probes, {unclear} unclear", probes.len());
    if let Some(p) = probes
        .iter()
        .find(|p| matches!(&p.outcome, Probe::Answered(g) if g != tag))
    {
        return Err(format!(
            "answered {:?} at {} ms from the deadline, not {tag:?} ({note})",
            p.outcome,
            ms(p.started)
        ));
    }
    if !probes
        .iter()
        .any(|p| p.ended < deadline && p.outcome == Probe::Answered(tag.to_owned()))
    {
        return Err(format!(
            "never seen mapped before the deadline: nothing proves it did not end early ({note})"
        ));
    }
    if let Some(p) = probes
        .iter()
        .find(|p| p.ended < deadline && p.outcome == Probe::Refused)
    {
        return Err(format!(
            "expired early: a probe from {} ms to {} ms (before the deadline) was refused ({note})",
            ms(p.started),
            ms(p.ended)
        ));
    }
    let Some(first) = probes
        .iter()
        .position(|p| p.ended >= deadline && p.outcome == Probe::Refused)
    else {
        return Err(format!(
            "never refused: probed until {} ms after the deadline ({note})",
            probes.last().map_or(0, |p| ms(p.ended))
        ));
    };
    let late = ms(probes[first].started).max(0);
    let limit = i64::try_from(EXPIRY_LATE_LIMIT.as_millis()).unwrap_or(i64::MAX);
    if late > limit {
        return Err(format!(
            "expired too late: first refused {late} ms after the deadline (limit {EXPIRY_LATE_LIMIT:?}; {note})"
        ));
    }
    let rest = &probes[first..];
    if let Some(p) = rest.iter().find(|p| p.outcome != Probe::Refused) {
        return Err(format!(
            "refused from {late} ms after the deadline, then {:?} at {} ms ({note})",
            p.outcome,
            ms(p.started)
        ));
    }
    if rest.len() < 3 {
        return Err(format!(
            "only {} refusals after the expiry ({note})",
            rest.len()
        ));
    }
    Ok(Duration::from_millis(u64::try_from(late).unwrap_or(0)))
}

/// Probes `addr` (mapped to a server greeting `tag` until `deadline`) from now on, every 50 ms,
/// until it has been refused three times in a row past the deadline or [`EXPIRY_LATE_LIMIT`]
/// has passed since the deadline; panics unless [`judge_expiry`] accepts. Call it while the
/// mapping is still live: it must be seen mapped before the deadline. Prints and returns the
/// lateness.
pub async fn expect_expiry(addr: SocketAddr, tag: &str, deadline: &str) -> Duration {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let deadline: Timestamp = deadline.parse().unwrap();
    let stop = deadline
        .checked_add(SignedDuration::try_from(EXPIRY_LATE_LIMIT + Duration::from_secs(1)).unwrap())
        .unwrap();
    let mut probes: Vec<Probed> = Vec::new();
    loop {
        let started = Timestamp::now();
        let outcome = probe(addr).await;
        let ended = Timestamp::now();
        probes.push(Probed {
            started,
            ended,
            outcome,
        });
        let refused_after = probes
            .iter()
            .rev()
            .take_while(|p| p.outcome == Probe::Refused && p.ended >= deadline)
            .count();
        if refused_after >= 3 || ended > stop {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match judge_expiry(tag, deadline, &probes) {
        Ok(late) => {
            eprintln!(
                "{addr} ({tag}) expired {late:?} after its deadline ({} probes)",
                probes.len()
            );
            late
        }
        Err(e) => panic!("the mapping of {addr} to {tag}: {e}"),
    }
}

/// That `expires_at` (the API's answer to a request sent at `sent` and answered at `received`)
/// is `ttl` after the server's clock while it handled the request (millisecond precision,
/// truncated): between `sent + ttl` (less 1 ms) and `received + ttl`.
pub fn assert_deadline_within(
    expires_at: &str,
    sent: k8s_openapi::jiff::Timestamp,
    received: k8s_openapi::jiff::Timestamp,
    ttl: Duration,
) {
    let deadline: k8s_openapi::jiff::Timestamp = expires_at.parse().unwrap();
    let ttl = i64::try_from(ttl.as_millis()).unwrap();
    let (low, high) = (
        sent.as_millisecond() + ttl - 1,
        received.as_millisecond() + ttl,
    );
    assert!(
        (low..=high).contains(&deadline.as_millisecond()),
        "expires_at {expires_at} is not {ttl} ms after the request (sent {sent}, answered {received})"
    );
}
