//! The workspace's test environment, in three tiers. Not published: no library of the workspace
//! depends on it except as a dev-dependency, so their packages carry only product code.
//!
//! | Tier | What | Needs |
//! |---|---|---|
//! | plain | [`fixtures`]: free ports, echo and HTTP servers, kill-on-drop children, pinned Python environments, tinyproxy | nothing (Python and tinyproxy only for the tests that name them) |
//! | control plane | [`ControlPlane`]: a real kube-apiserver + etcd | `cargo xtask envtest` (Go builds kube-apiserver) |
//! | node | [`node`]: kubelet, containerd, kube-proxy, CoreDNS running Pods | root, `cargo xtask envtest --node` |
//!
//! The crate's layout: [`fixtures`] (plain tier); the crate root with its private `assets`,
//! `audit`, `faults`, `kubeconfig`, `pki` and `process` modules (control-plane tier); [`node`]
//! (node tier, on top of the control plane).
//!
//! This is the Rust counterpart of controller-runtime's envtest: it starts the real binaries on
//! loopback with freshly generated certificates, so a test talks to the genuine API server with its
//! validation, RBAC, server-side apply, watches and CEL rules; nothing is mocked. A bare control
//! plane runs no controller-manager, scheduler or kubelet: no garbage collection, no Pods
//! scheduled. [`ControlPlaneBuilder::node`] adds all of those (see [`node`]): kubelet and
//! containerd run Pods from images built here, kube-proxy routes Services, CoreDNS answers names.
//!
//! * [`ControlPlane::shared`] gives every test of a test binary the same control plane (one start per
//!   binary), [`ControlPlane::shared_with_node`] the same with a node; [`ControlPlane::builder`]
//!   starts a private one, e.g. with extra API server flags.
//! * [`ControlPlane::client`] is an admin (`system:masters`); [`ControlPlane::client_as`] acts as
//!   any [`Identity`], including a ServiceAccount with a real token, so RBAC is tested for real.
//! * [`ControlPlane::kubeconfig_path`] and [`ControlPlane::kubeconfig_as`] write kubeconfig files
//!   for kubectl and for binaries run as child processes.
//! * [`ControlPlane::create_namespace`] gives each test its own namespace.
//!
//! The binaries are found as envtest finds them (see [`Binaries`]); `cargo xtask envtest` installs
//! them. Every process and directory is removed when the test binary ends, however it ends.
//!
//! ```no_run
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use netkit_testenv::ControlPlane;
//! use kube::api::{Api, PostParams};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let plane = ControlPlane::shared().await?;
//! let ns = plane.create_namespace("demo").await?;
//! let api: Api<ConfigMap> = Api::namespaced(plane.client().await?, &ns);
//! let mut cm = ConfigMap::default();
//! cm.metadata.name = Some("settings".into());
//! api.create(&PostParams::default(), &cm).await?;
//! # Ok(()) }
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod assets;
mod audit;
pub mod bench;
pub mod charts;
pub mod debian;
pub mod e2e;
mod faults;
pub mod fixtures;
pub mod images;
mod kubeconfig;
pub mod node;
mod pki;
mod process;
pub mod workspace;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

pub use assets::{
    ASSETS_DIR_ENV, Binaries, ETCD_VERSION, HELM_ENV, HELM_VERSION, KUBERNETES_VERSION,
    default_assets_dir, default_helm_path, helm,
};
use audit::AUDIT_POLICY;
pub use audit::{AuditEvent, AuditObjectRef, AuditStatus, AuditUser};
pub use kubeconfig::Identity;
use pki::{PemPair, Pki};
use process::{Guardian, ServerProcess, free_port, log_tail};

/// Everything that can go wrong while running a test control plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TestingError {
    /// A binary was not found; the message says where it was looked for and how to install it.
    #[error(
        "the tests need `{name}`, which was not found (tried: {}). \
         `cargo xtask envtest` installs kube-apiserver {KUBERNETES_VERSION} and etcd {ETCD_VERSION} \
         (or point KUBEBUILDER_ASSETS at a directory holding both); `cargo xtask helm` installs helm; \
         `cargo xtask test` does all of it",
        tried.join(", ")
    )]
    BinaryMissing {
        /// The binary's file name.
        name: String,
        /// Each place looked at, with why it did not fit.
        tried: Vec<String>,
    },
    /// A file or process operation failed.
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        cause: std::io::Error,
    },
    /// Certificate generation failed.
    #[error("cannot generate certificates")]
    Pki(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A server did not become ready in time, or exited while starting.
    #[error("the test control plane did not start: {0}")]
    Start(String),
    /// A client could not be built from the generated kubeconfig.
    #[error("cannot build a client")]
    Client(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// An object the harness made or was given is unusable (no kind, no port, no token).
    #[error("{0}")]
    Config(String),
    /// A watch the harness waits on failed.
    #[error("watching {what} failed")]
    Watch {
        /// The watched object.
        what: String,
        /// The watcher's error.
        #[source]
        cause: kube::runtime::wait::Error,
    },
    /// An object the harness made does not decode into its type.
    #[error("{what} does not decode")]
    Decode {
        /// The object.
        what: String,
        /// The decoder's error.
        #[source]
        cause: serde_json::Error,
    },
    /// An API call made by the harness failed.
    #[error("{context}")]
    Kube {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        cause: kube::Error,
    },
    /// The machine cannot host a node: the message names every missing piece (root, a host
    /// program, a binary or image) and the command that installs it.
    #[error("no test node on this machine: {0}")]
    NodeUnavailable(String),
    /// A step of [`node::check`] did not hold.
    #[error("node check failed: {0}")]
    Check(String),
    /// A wait (e.g. for a CRD to be established) ran out of time.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
}

/// Options for a private control plane; see [`ControlPlane::builder`].
#[derive(Debug, Clone)]
pub struct ControlPlaneBuilder {
    apiserver_args: Vec<String>,
    start_timeout: Duration,
    nodes: usize,
}

impl ControlPlaneBuilder {
    /// Adds a kube-apiserver flag (`--name=value`). Later flags win over the defaults, since the
    /// API server keeps the last value of a repeated flag. Example:
    /// `--endpoint-reconciler-type=none`.
    pub fn apiserver_arg(mut self, arg: impl Into<String>) -> Self {
        self.apiserver_args.push(arg.into());
        self
    }

    /// How long to wait for both servers to become ready (default 120 s: a loaded 2-core CI
    /// machine that also runs other control planes needs far more than the usual few seconds).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Adds a real node (see [`node`]): the API server then listens on [`node::HOST_IP`] where Pods
    /// reach it, with the Node authorizer, the ServiceAccount and NodeRestriction admission
    /// plugins on and Services in [`node::SERVICE_CIDR`]; the start waits until the Node is
    /// `Ready` and CoreDNS serves. Needs root; see [`node`] for what else.
    pub fn node(mut self) -> Self {
        self.nodes = self.nodes.max(1);
        self
    }

    /// Adds `count` real nodes (1 to [`node::MAX_NODES`]; see [`ControlPlaneBuilder::node`]), each
    /// in its own network namespace with its own containerd, kubelet and kube-proxy and Pod
    /// subnet; the host routes between them. The first one also runs the controller-manager (with
    /// a 20 s node-monitor grace period when there are several), the scheduler and CoreDNS.
    pub fn nodes(mut self, count: usize) -> Self {
        self.nodes = count;
        self
    }

    /// Starts etcd and kube-apiserver (and the node, if asked for) and waits until the API server
    /// serves the `default` namespace.
    pub async fn start(self) -> Result<ControlPlane, TestingError> {
        ControlPlane::start_with(self).await
    }
}

/// A running etcd + kube-apiserver pair; see the [module docs](self).
pub struct ControlPlane {
    dir: PathBuf,
    server: String,
    etcd_url: String,
    pki: Pki,
    kubeconfig: PathBuf,
    namespaces: AtomicUsize,
    // Stopped in reverse order of start: API server first, then etcd.
    processes: Mutex<Vec<ServerProcess>>,
    // One per generation of processes: a restarted server gets its own guardian.
    guardians: Mutex<Vec<Guardian>>,
    // The first node holds the cluster's network and is stopped last.
    nodes: Vec<node::Node>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// How long the servers get to become ready, at start and after a restart.
const START_TIMEOUT: Duration = Duration::from_secs(120);

static SHARED: tokio::sync::OnceCell<ControlPlane> = tokio::sync::OnceCell::const_new();
static SHARED_NODE: tokio::sync::OnceCell<ControlPlane> = tokio::sync::OnceCell::const_new();

impl ControlPlane {
    /// Options for a private control plane.
    pub fn builder() -> ControlPlaneBuilder {
        ControlPlaneBuilder {
            apiserver_args: Vec::new(),
            start_timeout: START_TIMEOUT,
            nodes: 0,
        }
    }

    /// A control plane with a node (see [`ControlPlaneBuilder::node`]) shared by all tests of
    /// this test binary, started on first use; one node per machine at a time.
    pub async fn shared_with_node() -> Result<&'static ControlPlane, TestingError> {
        SHARED_NODE
            .get_or_try_init(|| {
                ControlPlane::builder()
                    .node()
                    .start_timeout(Duration::from_secs(180))
                    .start()
            })
            .await
    }

    /// The node, when the control plane was started with one.
    pub fn node(&self) -> Option<&node::Node> {
        self.nodes.first()
    }

    /// Every node, the first one first.
    pub fn nodes(&self) -> &[node::Node] {
        &self.nodes
    }

    /// The control plane shared by all tests of this test binary, started on first use.
    ///
    /// It lives until the test binary exits; its guardian then removes the processes and files.
    pub async fn shared() -> Result<&'static ControlPlane, TestingError> {
        SHARED
            .get_or_try_init(|| ControlPlane::builder().start())
            .await
    }

    async fn start_with(options: ControlPlaneBuilder) -> Result<Self, TestingError> {
        let binaries = Binaries::locate()?;
        // The node's network comes first: the API server listens on the node link.
        let with_node = options.nodes > 0;
        let node_parts = if with_node {
            let assets = node::NodeAssets::locate()?;
            Some((assets, node::NodeNetwork::create(options.nodes)?))
        } else {
            None
        };
        let dir = tempfile::Builder::new()
            .prefix("kube-netkit-control-plane-")
            .tempdir()
            .map_err(|source| TestingError::Io {
                context: "creating the control plane directory".to_owned(),
                cause: source,
            })?
            .keep();
        let pki = if with_node {
            Pki::generate(&[node::HOST_IP.into(), node::KUBERNETES_SERVICE_IP.into()])?
        } else {
            Pki::generate(&[])?
        };
        let write = |name: &str, contents: &str| -> Result<PathBuf, TestingError> {
            let path = dir.join(name);
            std::fs::write(&path, contents).map_err(|source| TestingError::Io {
                context: format!("writing {}", path.display()),
                cause: source,
            })?;
            Ok(path)
        };
        let serving_cert = write("apiserver.crt", &pki.serving.cert)?;
        let serving_key = write("apiserver.key", &pki.serving.key)?;
        let client_ca = write("client-ca.crt", &pki.client_ca)?;
        let sa_pub = write("sa.pub", &pki.sa_public_key)?;
        let sa_key = write("sa.key", &pki.sa_private_key)?;
        // Every request is audited (metadata only), so tests can count what a component wrote.
        let audit_policy = write("audit-policy.yaml", AUDIT_POLICY)?;
        let audit_log = dir.join("audit.log");

        let etcd_port = free_port()?;
        let etcd_peer_port = free_port()?;
        let api_port = free_port()?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let etcd_peer_url = format!("http://127.0.0.1:{etcd_peer_port}");
        let bind_address = if with_node {
            node::HOST_IP.to_string()
        } else {
            "127.0.0.1".to_owned()
        };
        let server = format!("https://{bind_address}:{api_port}");
        let etcd_data = dir.join("etcd");

        let etcd_args = vec![
            "--name=default".to_owned(),
            format!("--data-dir={}", etcd_data.display()),
            format!("--listen-client-urls={etcd_url}"),
            format!("--advertise-client-urls={etcd_url}"),
            format!("--listen-peer-urls={etcd_peer_url}"),
            format!("--initial-advertise-peer-urls={etcd_peer_url}"),
            format!("--initial-cluster=default={etcd_peer_url}"),
            "--unsafe-no-fsync=true".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        let mut etcd = ServerProcess::spawn("etcd", &binaries.etcd, &etcd_args, &dir)?;

        let mut apiserver_args = vec![
            format!("--etcd-servers={etcd_url}"),
            format!("--cert-dir={}", dir.display()),
            format!("--tls-cert-file={}", serving_cert.display()),
            format!("--tls-private-key-file={}", serving_key.display()),
            format!("--client-ca-file={}", client_ca.display()),
            format!("--secure-port={api_port}"),
            format!("--bind-address={bind_address}"),
            "--allow-privileged=true".to_owned(),
            format!("--service-account-issuer={server}/"),
            format!("--service-account-key-file={}", sa_pub.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            format!("--audit-policy-file={}", audit_policy.display()),
            format!("--audit-log-path={}", audit_log.display()),
            "--audit-log-format=json".to_owned(),
            "--audit-log-mode=blocking".to_owned(),
            "--audit-log-maxsize=0".to_owned(),
        ];
        if with_node {
            let kubelet_client =
                pki.client_cert("kube-apiserver-kubelet-client", Some("system:masters"))?;
            let cert = write("kubelet-client.crt", &kubelet_client.cert)?;
            let key = write("kubelet-client.key", &kubelet_client.key)?;
            apiserver_args.extend([
                format!("--advertise-address={bind_address}"),
                format!("--service-cluster-ip-range={}", node::SERVICE_CIDR),
                "--authorization-mode=Node,RBAC".to_owned(),
                "--enable-admission-plugins=NodeRestriction".to_owned(),
                format!("--kubelet-client-certificate={}", cert.display()),
                format!("--kubelet-client-key={}", key.display()),
                "--kubelet-preferred-address-types=InternalIP".to_owned(),
            ]);
        } else {
            // A bare API server: no controller-manager makes ServiceAccount tokens for Pods.
            apiserver_args.extend([
                "--service-cluster-ip-range=10.0.0.0/24".to_owned(),
                "--authorization-mode=RBAC".to_owned(),
                "--disable-admission-plugins=ServiceAccount".to_owned(),
            ]);
        }
        apiserver_args.extend(options.apiserver_args.iter().cloned());
        let apiserver = match ServerProcess::spawn(
            "kube-apiserver",
            &binaries.kube_apiserver,
            &apiserver_args,
            &dir,
        ) {
            Ok(apiserver) => apiserver,
            Err(err) => {
                etcd.stop();
                return Err(err);
            }
        };
        let processes = vec![etcd, apiserver];
        // From here on the guardian cleans up, however this process ends.
        let pids: Vec<u32> = processes.iter().map(ServerProcess::pid).collect();
        let guardian = Guardian::watch(&dir, &pids)?;

        let kubeconfig = dir.join("kubeconfig.yaml");
        let mut plane = Self {
            kubeconfig: kubeconfig.clone(),
            dir,
            server,
            etcd_url,
            pki,
            namespaces: AtomicUsize::new(0),
            processes: Mutex::new(processes),
            guardians: Mutex::new(vec![guardian]),
            nodes: Vec::new(),
        };
        let admin = plane.admin_kubeconfig_text()?;
        std::fs::write(&kubeconfig, admin).map_err(|source| TestingError::Io {
            context: format!("writing {}", kubeconfig.display()),
            cause: source,
        })?;
        plane.wait_ready(options.start_timeout).await?;
        if let Some((assets, network)) = node_parts {
            // Without the API server's own endpoint reconciler nothing in a Pod could reach it
            // until someone (steward, in its tests) publishes endpoints.
            let reconciler_off = options
                .apiserver_args
                .iter()
                .any(|a| a == "--endpoint-reconciler-type=none");
            let cluster_dir = network.dir.clone();
            let mut network = Some(network);
            for index in 0..options.nodes {
                let node = node::Node::start(
                    &plane,
                    network.take(),
                    &cluster_dir,
                    (index, options.nodes),
                    &assets,
                    options.start_timeout,
                    reconciler_off,
                )
                .await?;
                plane.nodes.push(node);
            }
        }
        Ok(plane)
    }

    async fn wait_ready(&self, timeout: Duration) -> Result<(), TestingError> {
        let deadline = Instant::now() + timeout;
        let client = self.client().await?;
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let mut last_error;
        loop {
            if let Some(exit) = self.first_exited() {
                return Err(TestingError::Start(exit));
            }
            let ready = client
                .request_text(
                    http::Request::get("/readyz")
                        .body(Vec::new())
                        .map_err(|e| TestingError::Start(format!("a /readyz request: {e}")))?,
                )
                .await;
            match ready {
                Ok(_) => match namespaces.get("default").await {
                    Ok(_) => return Ok(()),
                    Err(err) => last_error = format!("namespace default: {err}"),
                },
                Err(err) => last_error = format!("/readyz: {err}"),
            }
            if Instant::now() >= deadline {
                let logs = self.log_tails();
                return Err(TestingError::Start(format!(
                    "not ready after {timeout:?} (last: {last_error})\n{logs}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn first_exited(&self) -> Option<String> {
        let mut processes = self.processes.lock().ok()?;
        processes.iter_mut().find_map(ServerProcess::exited)
    }

    fn log_tails(&self) -> String {
        let Ok(processes) = self.processes.lock() else {
            return String::new();
        };
        processes
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.name, log_tail(&p.log, 20)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The API server URL, `https://127.0.0.1:<port>`.
    pub fn server_url(&self) -> &str {
        &self.server
    }

    /// etcd's client URL, `http://127.0.0.1:<port>`.
    pub fn etcd_url(&self) -> &str {
        &self.etcd_url
    }

    /// PEM of the CA that signed the API server's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.pki.serving_ca
    }

    /// The directory holding certificates, logs, kubeconfigs and etcd's data.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates a fresh namespace `<prefix>-<n>` and returns its name.
    pub async fn create_namespace(&self, prefix: &str) -> Result<String, TestingError> {
        let n = self.namespaces.fetch_add(1, Ordering::Relaxed);
        let name = format!("{prefix}-{n}");
        let mut ns = Namespace::default();
        ns.metadata.name = Some(name.clone());
        let api: Api<Namespace> = Api::all(self.client().await?);
        api.create(&PostParams::default(), &ns)
            .await
            .map_err(|source| TestingError::Kube {
                context: format!("creating namespace {name}"),
                cause: source,
            })?;
        Ok(name)
    }

    /// Applies CRDs (server-side, so this is idempotent) and waits until each is `Established`.
    pub async fn install_crds(
        &self,
        crds: &[CustomResourceDefinition],
    ) -> Result<(), TestingError> {
        let api: Api<CustomResourceDefinition> = Api::all(self.client().await?);
        let params = PatchParams::apply("kube-netkit-testing").force();
        for crd in crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let mut crd = crd.clone();
            crd.metadata.managed_fields = None;
            crd.metadata.resource_version = None;
            api.patch(&name, &params, &Patch::Apply(&crd))
                .await
                .map_err(|source| TestingError::Kube {
                    context: format!("applying CRD {name}"),
                    cause: source,
                })?;
        }
        let timeout = Duration::from_secs(30);
        for crd in crds {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let established = kube::runtime::wait::await_condition(
                api.clone(),
                &name,
                kube::runtime::wait::conditions::is_crd_established(),
            );
            tokio::time::timeout(timeout, established)
                .await
                .map_err(|_| {
                    TestingError::Timeout(timeout, format!("CRD {name} to be Established"))
                })?
                .map_err(|cause| TestingError::Watch {
                    what: format!("CRD {name}"),
                    cause,
                })?;
        }
        Ok(())
    }

    /// Stops both servers now and removes the directory. Dropping a private control plane does the
    /// same.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // The node first: its kubelet must not watch the API server go away and react.
        // The others before the first, which holds the network.
        while let Some(node) = self.nodes.pop() {
            drop(node);
        }
        if let Ok(mut processes) = self.processes.lock() {
            for process in processes.iter_mut().rev() {
                process.stop();
            }
        }
        if let Ok(mut guardians) = self.guardians.lock() {
            for guardian in guardians.iter_mut() {
                guardian.release();
            }
        }
    }
}

/// Polls `check` every 20 ms until it holds.
///
/// # Panics
///
/// Like `assert!`, when `check` still fails after `timeout`; the message names `what`. Meant for
/// tests, where a condition that never holds is the failure being reported.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
