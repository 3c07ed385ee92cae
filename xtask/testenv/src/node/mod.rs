//! A real node for the test control plane: containerd, kubelet and kube-proxy in a network
//! namespace of their own, kube-controller-manager and kube-scheduler beside the API server, and
//! CoreDNS as the cluster's `kube-dns` (start one with [`ControlPlaneBuilder::node`]).
//!
//! With a node, Pods really run: the scheduler binds them, kubelet starts them under runc with the
//! Pod's security context, probes them and reports their status; the controller-manager runs
//! Deployments, ReplicaSets, Jobs, EndpointSlices, ServiceAccounts and the garbage collector;
//! kube-proxy routes ClusterIPs and NodePorts; the ServiceAccount admission plugin gives Pods real
//! projected tokens. Images are never pulled: [`Node::import_image`] loads a `docker load`
//! tarball into containerd, and Pods use `imagePullPolicy: Never` or `IfNotPresent`.
//!
//! # Layout
//! * `network`: the node's namespace, its link to the host, routes, guard rules, the cut of the
//!   link to the API server ([`Node::cut_apiserver_link`]) and the one teardown script (run on
//!   drop, and by a guardian if the test binary dies first);
//! * `config`: configuration files of containerd, the CNI bridge, kubelet and kube-proxy;
//! * `dns`: the CoreDNS objects;
//! * [`check`]: what a working node must do, step by step (`cargo xtask cluster --node --check`).
//!
//! # Requirements
//! Root on Linux with network namespaces, veth, bridge and nftables; `containerd`, `runc`, `ctr`,
//! the CNI plugins in `/usr/lib/cni`, `iptables`, `nft`, `ip`, `nsenter` and `conntrack` (Debian's
//! packages); kubelet, kube-proxy, kube-controller-manager, kube-scheduler and the node images
//! from `cargo xtask envtest --node`. What is missing is named in one line
//! ([`TestingError::NodeUnavailable`]); nothing is skipped silently.
//!
//! [`ControlPlaneBuilder::node`]: super::ControlPlaneBuilder::node

pub mod check;
mod config;
mod dns;
mod network;
mod requirements;

use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node as NodeObject;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::ApiResource;

pub use network::MAX_NODES;
pub(crate) use network::NodeNetwork;
pub use network::{
    CLUSTER_CIDR, DNS_SERVICE_IP, HOST_IP, KUBERNETES_SERVICE_IP, MACHINE_LOCK, NETNS, NODE_IP,
    POD_CIDR, SERVICE_CIDR,
};
use network::{Slot, io, write};
pub(crate) use requirements::NodeAssets;

use super::process::{ServerProcess, free_port, log_tail};
use super::{ControlPlane, TestingError};

/// The node's name (and kubelet's `--hostname-override`).
pub const NODE_NAME: &str = "kube-netkit-node";
/// The sandbox image containerd runs for every Pod (imported when the node starts).
pub const PAUSE_IMAGE: &str = "localhost/kube-netkit/pause:1";
/// The test workload image (HTTP/TCP/UDP echo server and in-cluster clients), imported when the
/// node starts.
pub const TESTBOX_IMAGE: &str = "localhost/kube-netkit/testbox:1";
/// CoreDNS, built from its Go module and imported when the node starts.
pub const COREDNS_IMAGE: &str = "localhost/kube-netkit/coredns:v1.15.0";

/// A running node; see the [module docs](self). Dropping it stops its processes and removes
/// everything it made on the machine.
pub struct Node {
    // Stopped in reverse order of start, before the network is torn down.
    processes: Vec<ServerProcess>,
    slot: Slot,
    dir: PathBuf,
    // The cluster's list of process ids, which its teardown script kills.
    pids: PathBuf,
    containerd_socket: PathBuf,
    timings: Vec<(String, Duration)>,
    // The cluster's network, held by its first node (dropped last, after the other nodes).
    network: Option<NodeNetwork>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("name", &self.slot.name())
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// The node's name ([`NODE_NAME`] for the first node, then `-2`, `-3`, ...).
    pub fn name(&self) -> String {
        self.slot.name()
    }

    /// The node's `InternalIP`, where NodePorts listen (reachable from the host).
    pub fn internal_ip(&self) -> IpAddr {
        IpAddr::V4(self.slot.node_ip())
    }

    /// The node's Pod subnet.
    pub fn pod_cidr(&self) -> String {
        self.slot.pod_cidr()
    }

    /// The directory holding the node's configuration, logs and containerd state.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long each start-up step took, in order.
    pub fn timings(&self) -> &[(String, Duration)] {
        &self.timings
    }

    /// The process ids of containerd, kube-controller-manager, kube-scheduler, kubelet and
    /// kube-proxy.
    pub fn pids(&self) -> Vec<u32> {
        self.processes.iter().map(ServerProcess::pid).collect()
    }

    /// Loads a `docker load` / OCI tarball (e.g. from `cargo xtask image`) into the node's
    /// containerd, where kubelet finds it without pulling.
    pub fn import_image(&self, tarball: &Path) -> Result<(), TestingError> {
        let output = Command::new("ctr")
            .arg("--address")
            .arg(&self.containerd_socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(tarball)
            .output()
            .map_err(|source| io("running ctr images import", source))?;
        if output.status.success() {
            return Ok(());
        }
        Err(TestingError::NodeUnavailable(format!(
            "importing {}: {}",
            tarball.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )))
    }

    /// Cuts the node off from the API server listening on `apiserver_port` (the port of
    /// [`ControlPlane::server_url`]): every packet between the node's namespace (kubelet,
    /// kube-proxy, Pods) and that port is dropped, as by a broken link, until
    /// [`Node::restore_apiserver_link`]. Nothing else on the node link is touched, so the host
    /// still reaches Pods, ClusterIPs and NodePorts. The node's teardown removes a cut left in
    /// place.
    pub fn cut_apiserver_link(&self, apiserver_port: u16) -> Result<(), TestingError> {
        network::cut_apiserver_link(self.slot, &self.dir, apiserver_port)
    }

    /// Ends the cut of [`Node::cut_apiserver_link`].
    pub fn restore_apiserver_link(&self) -> Result<(), TestingError> {
        network::restore_apiserver_link(self.slot)
    }

    /// Loses the node, as a machine that dies does (not a graceful drain): its kubelet, kube-proxy
    /// and containerd are killed and its link to the host goes down, so nothing reaches its Pods
    /// (whose processes keep running, cut off) and the node stops reporting. The first node
    /// cannot be lost: it runs the cluster's controller-manager and scheduler.
    ///
    /// Takes `&self` so that a test can lose a node while it holds the plane borrowed; the
    /// processes are killed by signal and reaped when the node is dropped.
    pub fn lose(&self) -> Result<(), TestingError> {
        if self.slot.index == 0 {
            return Err(TestingError::Config(
                "the first node runs the controller-manager and scheduler; lose another one"
                    .to_owned(),
            ));
        }
        for process in self.processes.iter().rev() {
            process.signal(rustix::process::Signal::KILL);
        }
        network::cut_node_link(self.slot)
    }

    /// The last lines of each node component's log.
    pub fn log_tails(&self, lines: usize) -> String {
        self.processes
            .iter()
            .map(|p| format!("--- {} ---\n{}", p.name, log_tail(&p.log, lines)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn first_exited(&mut self) -> Option<String> {
        self.processes.iter_mut().find_map(ServerProcess::exited)
    }

    fn spawn(
        &mut self,
        name: &'static str,
        program: &Path,
        args: Vec<String>,
        in_node_netns: bool,
    ) -> Result<(), TestingError> {
        let dir = self.dir.clone();
        let process = if in_node_netns {
            // nsenter enters only the network namespace and then execs: same pid, host mounts.
            let mut all = vec![
                format!("--net={}", self.slot.netns_path().display()),
                "--".to_owned(),
                program.display().to_string(),
            ];
            all.extend(args);
            ServerProcess::spawn(name, Path::new("nsenter"), &all, &dir)?
        } else {
            ServerProcess::spawn(name, program, &args, &dir)?
        };
        // The teardown script kills what this file lists, also when this process is gone.
        let pids = self.pids.clone();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&pids)
            .and_then(|mut f| writeln!(f, "{}", process.pid()))
            .map_err(|source| io(&format!("writing {}", pids.display()), source))?;
        self.processes.push(process);
        Ok(())
    }

    fn step(&mut self, what: &str, started: Instant) {
        self.timings.push((what.to_owned(), started.elapsed()));
    }

    /// Starts the node's components against `plane` and waits until the Node is `Ready` and
    /// CoreDNS serves. With `bootstrap_endpoints` (an API server without its endpoint
    /// reconciler), `default/kubernetes` is first pointed at the API server, as a hosted control
    /// plane's operator does, so Pods reach it; whoever publishes endpoints later takes over.
    ///
    /// Node `index` of `nodes`: the first one holds the cluster's `network` (pass `Some`) and also
    /// runs the controller-manager, the scheduler and CoreDNS; the others only their containerd,
    /// kubelet and kube-proxy (pass `None`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start(
        plane: &ControlPlane,
        network: Option<NodeNetwork>,
        cluster_dir: &Path,
        (index, nodes): (usize, usize),
        assets: &NodeAssets,
        timeout: Duration,
        bootstrap_endpoints: bool,
    ) -> Result<Self, TestingError> {
        let slot = Slot { index };
        let dir = slot.dir(cluster_dir);
        let mut node = Self {
            processes: Vec::new(),
            slot,
            pids: cluster_dir.join("pids"),
            containerd_socket: slot.containerd_socket(cluster_dir),
            dir,
            timings: Vec::new(),
            network,
        };
        let deadline = Instant::now() + timeout;
        match node
            .start_components(plane, assets, deadline, bootstrap_endpoints, nodes)
            .await
        {
            Ok(()) => Ok(node),
            Err(err) => {
                let logs = node.log_tails(15);
                Err(TestingError::Start(format!(
                    "the node did not start: {err}\n{logs}"
                )))
            }
        }
    }

    async fn start_components(
        &mut self,
        plane: &ControlPlane,
        assets: &NodeAssets,
        deadline: Instant,
        bootstrap_endpoints: bool,
        node_count: usize,
    ) -> Result<(), TestingError> {
        let dir = self.dir.clone();
        let slot = self.slot;
        let first = slot.index == 0;
        if first && bootstrap_endpoints {
            write_kubernetes_endpoints(plane).await?;
        }
        let started = Instant::now();
        for sub in ["containerd", "cni", "pod-logs", "kubelet"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(|source| io(&format!("creating {sub}"), source))?;
        }
        create_cgroup_root(&slot.cgroup_root())?;
        write(&dir.join("containerd.toml"), &config::containerd(&dir))?;
        write(
            &dir.join("cni").join("10-kube-netkit.conflist"),
            &config::cni(&dir, slot),
        )?;

        let containerd_config = dir.join("containerd.toml");
        self.spawn(
            "containerd",
            Path::new("containerd"),
            vec![
                "--config".to_owned(),
                containerd_config.display().to_string(),
            ],
            true,
        )?;
        self.wait_for("containerd", deadline, |node| {
            Command::new("ctr")
                .arg("--address")
                .arg(&node.containerd_socket)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .await?;
        for image in &assets.images {
            self.import_image(image)?;
        }
        self.step("containerd started, node images imported", started);

        // Identities: each component is who it is in a kubeadm cluster, so the default RBAC of
        // the API server applies to it unchanged.
        let pki = &plane.pki;
        let kcm_kubeconfig =
            plane.write_cert_kubeconfig(&dir, "system:kube-controller-manager", None)?;
        let scheduler_kubeconfig =
            plane.write_cert_kubeconfig(&dir, "system:kube-scheduler", None)?;
        let name = slot.name();
        let node_ip = slot.node_ip();
        let kubelet_kubeconfig = plane.write_cert_kubeconfig(
            &dir,
            &format!("system:node:{name}"),
            Some("system:nodes"),
        )?;
        let proxy_kubeconfig = plane.write_cert_kubeconfig(&dir, "system:kube-proxy", None)?;
        let serving = pki.serving_cert(&name, IpAddr::V4(node_ip))?;
        write(&dir.join("kubelet.crt"), &serving.cert)?;
        write(&dir.join("kubelet.key"), &serving.key)?;
        let client_ca = plane.dir.join("client-ca.crt");
        let serving_ca = plane.dir.join("serving-ca.crt");
        write(&serving_ca, &pki.serving_ca)?;

        if first {
            let kcm = |kubeconfig: &Path, port: u16| {
                let k = kubeconfig.display();
                vec![
                    format!("--kubeconfig={k}"),
                    format!("--authentication-kubeconfig={k}"),
                    format!("--authorization-kubeconfig={k}"),
                    "--bind-address=127.0.0.1".to_owned(),
                    format!("--secure-port={port}"),
                    "--leader-elect=false".to_owned(),
                ]
            };
            let mut kcm_args = kcm(&kcm_kubeconfig, free_port()?);
            kcm_args.extend([
                "--controllers=*".to_owned(),
                "--use-service-account-credentials=true".to_owned(),
                format!(
                    "--service-account-private-key-file={}",
                    plane.dir.join("sa.key").display()
                ),
                format!("--root-ca-file={}", serving_ca.display()),
                format!("--cert-dir={}", dir.join("kcm").display()),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--allocate-node-cidrs=false".to_owned(),
            ]);
            if node_count > 1 {
                // A lost node turns NotReady (and its Pods unready) within seconds, not 50 s.
                kcm_args.push("--node-monitor-grace-period=20s".to_owned());
            }
            self.spawn(
                "kube-controller-manager",
                &assets.kube_controller_manager,
                kcm_args,
                false,
            )?;
            let scheduler_args = kcm(&scheduler_kubeconfig, free_port()?);
            self.spawn(
                "kube-scheduler",
                &assets.kube_scheduler,
                scheduler_args,
                false,
            )?;
        }

        write(
            &dir.join("kubelet.yaml"),
            &config::kubelet(&dir, &client_ca, slot),
        )?;
        let kubelet_args = vec![
            format!("--config={}", dir.join("kubelet.yaml").display()),
            format!("--kubeconfig={}", kubelet_kubeconfig.display()),
            format!("--root-dir={}", dir.join("kubelet").display()),
            format!("--hostname-override={name}"),
            format!("--node-ip={node_ip}"),
            "--v=1".to_owned(),
        ];
        self.spawn("kubelet", &assets.kubelet, kubelet_args, true)?;
        write(
            &dir.join("kube-proxy.yaml"),
            &config::kube_proxy(&proxy_kubeconfig, slot),
        )?;
        let proxy_args = vec![format!(
            "--config={}",
            dir.join("kube-proxy.yaml").display()
        )];
        self.spawn("kube-proxy", &assets.kube_proxy, proxy_args, true)?;

        let nodes: Api<NodeObject> = Api::all(plane.client().await?);
        self.wait_until("the Node to be Ready", deadline, || async {
            nodes.get_opt(&name).await.ok().flatten().is_some_and(|n| {
                n.status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
            })
        })
        .await?;
        self.step("node Ready", started);

        if first {
            self.start_dns(plane, deadline).await?;
            self.step("CoreDNS Ready", started);
        }
        Ok(())
    }

    async fn start_dns(
        &mut self,
        plane: &ControlPlane,
        deadline: Instant,
    ) -> Result<(), TestingError> {
        let client = plane.client().await?;
        let params = PatchParams::apply("kube-netkit-node").force();
        for object in dns::objects() {
            let object: DynamicObject =
                serde_json::from_value(object).map_err(|cause| TestingError::Decode {
                    what: "a CoreDNS object".to_owned(),
                    cause,
                })?;
            let types = object
                .types
                .clone()
                .ok_or_else(|| TestingError::Config("CoreDNS object without a kind".to_owned()))?;
            let (group, version) = types
                .api_version
                .split_once('/')
                .unwrap_or(("", types.api_version.as_str()));
            let plural = format!("{}s", types.kind.to_ascii_lowercase());
            let resource = ApiResource {
                group: group.to_owned(),
                version: version.to_owned(),
                api_version: types.api_version.clone(),
                kind: types.kind.clone(),
                plural,
            };
            let name = object.metadata.name.clone().unwrap_or_default();
            let api: Api<DynamicObject> = match object.metadata.namespace.as_deref() {
                Some(ns) => Api::namespaced_with(client.clone(), ns, &resource),
                None => Api::all_with(client.clone(), &resource),
            };
            api.patch(&name, &params, &Patch::Apply(&object))
                .await
                .map_err(|source| TestingError::Kube {
                    context: format!("applying CoreDNS {} {name}", types.kind),
                    cause: source,
                })?;
        }
        let deployments: Api<Deployment> = Api::namespaced(client, "kube-system");
        self.wait_until("CoreDNS to be available", deadline, || async {
            deployments
                .get_opt("coredns")
                .await
                .ok()
                .flatten()
                .and_then(|d| d.status)
                .and_then(|s| s.available_replicas)
                .is_some_and(|n| n >= 1)
        })
        .await
    }

    async fn wait_for(
        &mut self,
        what: &str,
        deadline: Instant,
        check: impl Fn(&Self) -> bool,
    ) -> Result<(), TestingError> {
        loop {
            if check(self) {
                return Ok(());
            }
            self.check_alive_until(what, deadline)?;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_until<F, Fut>(
        &mut self,
        what: &str,
        deadline: Instant,
        mut check: F,
    ) -> Result<(), TestingError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        loop {
            if check().await {
                return Ok(());
            }
            self.check_alive_until(what, deadline)?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn check_alive_until(&mut self, what: &str, deadline: Instant) -> Result<(), TestingError> {
        if let Some(exit) = self.first_exited() {
            return Err(TestingError::Start(exit));
        }
        if Instant::now() >= deadline {
            return Err(TestingError::Start(format!("timed out waiting for {what}")));
        }
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for process in self.processes.iter_mut().rev() {
            process.stop();
        }
        if let Some(network) = self.network.as_mut() {
            network.tear_down();
        }
    }
}

/// Points `default/kubernetes` (Endpoints and EndpointSlice) at the API server's address on the
/// node link, as kube-apiserver's own reconciler would.
async fn write_kubernetes_endpoints(plane: &ControlPlane) -> Result<(), TestingError> {
    use k8s_openapi::api::core::v1::Endpoints;
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let port: u16 = plane
        .server_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| TestingError::Config(format!("no port in {}", plane.server_url())))?;
    let client = plane.client().await?;
    let params = PatchParams::apply("kube-netkit-testing-bootstrap").force();
    let ip = HOST_IP.to_string();
    let endpoints: Endpoints = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": { "name": "kubernetes", "labels": { "endpointslice.kubernetes.io/skip-mirror": "true" } },
        "subsets": [{ "addresses": [{ "ip": ip }], "ports": [{ "name": "https", "port": port, "protocol": "TCP" }] }],
    }))
    .map_err(|cause| TestingError::Decode {
        what: "the kubernetes Endpoints".to_owned(),
        cause,
    })?;
    let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": "kubernetes", "labels": { "kubernetes.io/service-name": "kubernetes" } },
        "addressType": "IPv4",
        "endpoints": [{ "addresses": [ip], "conditions": { "ready": true } }],
        "ports": [{ "name": "https", "port": port, "protocol": "TCP" }],
    }))
    .map_err(|cause| TestingError::Decode {
        what: "the kubernetes EndpointSlice".to_owned(),
        cause,
    })?;
    let kube_err = |source| TestingError::Kube {
        context: "writing the kubernetes endpoints".to_owned(),
        cause: source,
    };
    Api::<Endpoints>::namespaced(client.clone(), "default")
        .patch("kubernetes", &params, &Patch::Apply(&endpoints))
        .await
        .map_err(kube_err)?;
    Api::<EndpointSlice>::namespaced(client, "default")
        .patch("kubernetes", &params, &Patch::Apply(&slice))
        .await
        .map_err(kube_err)?;
    Ok(())
}

/// kubelet's `cgroupRoot` must exist in every hierarchy before it starts; a new cpuset cgroup
/// starts with no CPUs or memory nodes, so those are copied from the parent.
fn create_cgroup_root(root: &str) -> Result<(), TestingError> {
    let base = Path::new("/sys/fs/cgroup");
    let entries = std::fs::read_dir(base).map_err(|source| io("reading /sys/fs/cgroup", source))?;
    for entry in entries.filter_map(Result::ok) {
        let hierarchy = entry.path();
        if entry.file_name() == "unified" || !hierarchy.join("cgroup.procs").is_file() {
            continue;
        }
        let dir = hierarchy.join(root);
        std::fs::create_dir_all(&dir)
            .map_err(|source| io(&format!("creating {}", dir.display()), source))?;
        if entry.file_name() == "cpuset" {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let value = std::fs::read_to_string(hierarchy.join(file))
                    .map_err(|source| io(&format!("reading {file}"), source))?;
                std::fs::write(dir.join(file), value.trim())
                    .map_err(|source| io(&format!("writing {file}"), source))?;
            }
        }
    }
    Ok(())
}
