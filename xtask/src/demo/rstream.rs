//! rstream-operator with `LocalEngine` (in this process) as the engine: the manager reconciles an
//! `RstreamTunnel` into an agent Deployment, and the agent runs here as a process from the
//! manager's ConfigMap, as `end_to_end_with_both_binaries_and_local_engine` in
//! `rstream-operator/tests/operator.rs` does (no kubelet, no Service DNS).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service};
use k8s_reconcile::testing::Identity;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt as _};
use rstream_client::engine::LocalEngine;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use rstream_operator::names;

use super::processes::Processes;
use super::{Cluster, NAMESPACE, Shown, net};

const TOKEN: &str = "demo-token";
const TUNNEL: &str = "web";
const AGENT_POD: &str = "web-agent-0";
const WAIT: Duration = Duration::from_secs(30);

/// The engine the connection points at, on loopback, accepting only [`TOKEN`].
pub async fn start_engine() -> anyhow::Result<LocalEngine> {
    LocalEngine::builder()
        .token(TOKEN)
        .start()
        .await
        .context("starting LocalEngine")
}

pub async fn start(
    cluster: &Cluster<'_>,
    processes: &mut Processes,
    engine: &LocalEngine,
    workdir: &Path,
) -> anyhow::Result<Shown> {
    cluster
        .plane
        .install_crds(&rstream_operator::crds())
        .await
        .context("installing the rstream CRDs")?;
    let greeting = "hello through rstream".to_owned();
    let backend = net::http_server(IpAddr::V4(Ipv4Addr::LOCALHOST), greeting.clone()).await?;
    create_objects(&cluster.admin, engine).await?;
    start_manager(cluster, processes).await?;

    let tunnels: Api<RstreamTunnel> = Api::namespaced(cluster.admin.clone(), NAMESPACE);
    let waiting = wait_condition(
        processes,
        &tunnels,
        "Ready",
        "False",
        "WaitingForDeployment",
    )
    .await?;
    let base = names::base_name(NAMESPACE, TUNNEL, waiting.uid().as_deref());
    start_agent(cluster, processes, engine, workdir, &base, backend).await?;
    wait_condition(processes, &tunnels, "TunnelReady", "True", "TunnelOnline").await?;
    report_deployment_available(&cluster.admin, &base).await?;
    let ready = wait_condition(processes, &tunnels, "Ready", "True", "Ready").await?;

    let status = ready.status.unwrap_or_default();
    let forwarding = status.forwarding_address.unwrap_or_default();
    let tunnel_id = status.tunnel_id.unwrap_or_default();
    let ingress = engine
        .ingress_addr(&tunnel_id)
        .with_context(|| format!("the engine has no ingress for tunnel {tunnel_id}"))?;
    let response = net::http(ingress, "GET", "/", None)
        .await
        .context("sending a request to the tunnel's published address")?;
    ensure!(
        response.body == greeting,
        "the tunnel answered {:?}, not the server's greeting",
        response.body
    );
    Ok(Shown {
        name: "rstream-operator",
        facts: vec![
            format!(
                "RstreamTunnel {NAMESPACE}/{TUNNEL} is Ready: tunnel {tunnel_id} via LocalEngine {} (in this process)",
                engine.addr()
            ),
            format!(
                "the manager made Deployment {NAMESPACE}/{base}; its agent runs here, forwarding to {backend}"
            ),
            format!(
                "forwarding address {forwarding}; GET http://{ingress}/ -> {} {:?}",
                response.status_line, response.body
            ),
        ],
        try_these: vec![
            "kubectl get rstreamtunnels -A".to_owned(),
            format!("kubectl -n {NAMESPACE} get deployment {base} -o wide"),
            format!("curl http://{ingress}/   # LocalEngine publishes plain HTTP"),
        ],
    })
}

/// The token Secret, the Service the tunnel targets, the connection and the tunnel.
async fn create_objects(admin: &Client, engine: &LocalEngine) -> anyhow::Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "rstream-credentials"}, "stringData": {"token": TOKEN}}))?;
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "http-server"},
        "spec": {"ports": [{"name": "http", "port": 8080}]}}))?;
    let connection: RstreamConnection = serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
        "metadata": {"name": "default"},
        "spec": {"engine": engine.engine_address(),
                 "tokenSecretRef": {"name": "rstream-credentials", "key": "token"}}}))?;
    let tunnel: RstreamTunnel = serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamTunnel",
        "metadata": {"name": TUNNEL},
        "spec": {"target": {"service": {"name": "http-server", "port": "http"}},
                 "publish": true, "protocol": "http", "http": {"version": "http/1.1"}}}))?;
    create(admin, &secret).await?;
    create(admin, &service).await?;
    create(admin, &connection).await?;
    create(admin, &tunnel).await?;
    Ok(())
}

async fn create<K>(admin: &Client, object: &K) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    Api::<K>::namespaced(admin.clone(), NAMESPACE)
        .create(&PostParams::default(), object)
        .await
        .with_context(|| format!("creating {} {}", K::kind(&()), object.name_any()))?;
    Ok(())
}

/// The manager, watching the demo namespace, with leader election as in a cluster.
async fn start_manager(cluster: &Cluster<'_>, processes: &mut Processes) -> anyhow::Result<()> {
    let health = net::free_addr()?;
    processes.spawn(
        "rstream-operator",
        Command::new(cluster.binaries.get("rstream-operator")?)
            .env("KUBECONFIG", cluster.plane.kubeconfig_path())
            .env_remove("RUST_LOG")
            .args(["--namespace", NAMESPACE, "--leader-elect"])
            .args(["--leader-election-namespace", NAMESPACE])
            .args(["--metrics-bind-address", "0"])
            .args(["--health-probe-bind-address", &health.to_string()])
            .args(["--agent-image", "example.test/rstream-operator:demo"])
            .args(["--log-format", "text"]),
    )?;
    processes
        .wait_for("rstream-operator /readyz", WAIT, || async {
            Ok(net::answers_ok(health, "/readyz").await.then_some(()))
        })
        .await
}

/// Runs the agent as its Deployment would: config from the manager's ConfigMap, the token, the
/// ServiceAccount the manager made; its target (Service DNS does not resolve here) overridden.
async fn start_agent(
    cluster: &Cluster<'_>,
    processes: &mut Processes,
    engine: &LocalEngine,
    workdir: &Path,
    base: &str,
    backend: SocketAddr,
) -> anyhow::Result<()> {
    let config_map = Api::<ConfigMap>::namespaced(cluster.admin.clone(), NAMESPACE)
        .get(&format!("{base}-config"))
        .await
        .context("reading the agent's ConfigMap")?;
    let config = config_map
        .data
        .and_then(|mut data| data.remove(names::CONFIG_KEY))
        .with_context(|| format!("the agent's ConfigMap has no {}", names::CONFIG_KEY))?;
    let config_path = workdir.join("rstream-agent-config.yaml");
    std::fs::write(&config_path, config)?;
    let ca_path = workdir.join("engine-ca.pem");
    std::fs::write(&ca_path, engine.ca_pem())?;
    let kubeconfig = cluster
        .plane
        .kubeconfig_as(&Identity::service_account(NAMESPACE, base))
        .await
        .context("a kubeconfig for the agent's ServiceAccount")?;
    let health = net::free_addr()?;
    processes.spawn(
        "rstream-agent",
        Command::new(cluster.binaries.get("rstream-agent")?)
            .env("KUBECONFIG", kubeconfig)
            .env_remove("RUST_LOG")
            .env(names::TOKEN_ENV, TOKEN)
            .env(names::POD_NAME_ENV, AGENT_POD)
            .env(names::POD_NAMESPACE_ENV, NAMESPACE)
            .arg(format!("--config={}", config_path.display()))
            .arg(format!("--health-bind-address={health}"))
            .arg(format!("--target-override={backend}"))
            .arg(format!("--ca-file={}", ca_path.display()))
            .args(["--log-format", "text"]),
    )?;
    Ok(())
}

/// No kubelet: report the agent Deployment available, as its readiness probe would.
async fn report_deployment_available(admin: &Client, base: &str) -> anyhow::Result<()> {
    let status = serde_json::json!({
        "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}});
    Api::<Deployment>::namespaced(admin.clone(), NAMESPACE)
        .patch_status(base, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .context("reporting the agent Deployment available")?;
    Ok(())
}

/// Waits until the tunnel's condition `kind` has `status` and `reason`; returns the tunnel.
async fn wait_condition(
    processes: &mut Processes,
    tunnels: &Api<RstreamTunnel>,
    kind: &str,
    status: &str,
    reason: &str,
) -> anyhow::Result<RstreamTunnel> {
    let what = format!("RstreamTunnel {TUNNEL}: {kind}={status} ({reason})");
    processes
        .wait_for(&what, WAIT, || async {
            let tunnel = tunnels.get_opt(TUNNEL).await?;
            Ok(tunnel.filter(|t| has_condition(t, kind, status, reason)))
        })
        .await
}

fn has_condition(tunnel: &RstreamTunnel, kind: &str, status: &str, reason: &str) -> bool {
    tunnel
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == kind && c.status == status && c.reason == reason)
}
