//! What a round makes and waits for: the tunnels and their prerequisites, the manager process, its children and a quiet API server.

use std::collections::HashSet;
use std::fmt::Debug;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ControlPlane;
use anyhow::{Context as _, bail};
use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ListParams, PostParams};
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use serde::de::DeserializeOwned;

use crate::bench::{heaptrack, system};

use super::{CHILD_KINDS, CREATE_CONCURRENCY, MANAGER, MANAGER_USER, POLL, QUIET, Sizes};

/// The token Secret, the RstreamConnection (a direct engine address: nothing has to listen there
/// for the manager to create children) and the target Service with its named port.
pub(super) async fn create_prerequisites(
    client: &kube::Client,
    namespace: &str,
) -> anyhow::Result<()> {
    let params = PostParams::default();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "creds"},
        "stringData": {"token": "bench-token"},
    }))?;
    Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&params, &secret)
        .await?;
    let engine = SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?));
    let connection: RstreamConnection = serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamConnection",
        "metadata": {"name": "default"},
        "spec": {"engine": engine.to_string(), "tokenSecretRef": {"name": "creds", "key": "token"}},
    }))?;
    Api::<RstreamConnection>::namespaced(client.clone(), namespace)
        .create(&params, &connection)
        .await?;
    let service: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"ports": [{"name": "http", "port": 8080}]},
    }))?;
    Api::<Service>::namespaced(client.clone(), namespace)
        .create(&params, &service)
        .await?;
    Ok(())
}

fn tunnel_name(i: usize) -> String {
    format!("tunnel-{i:04}")
}

pub(super) async fn create_tunnels(
    client: &kube::Client,
    namespace: &str,
    count: usize,
) -> anyhow::Result<()> {
    let api: Api<RstreamTunnel> = Api::namespaced(client.clone(), namespace);
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                let tunnel: RstreamTunnel = serde_json::from_value(serde_json::json!({
                    "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": "RstreamTunnel",
                    "metadata": {"name": tunnel_name(i)},
                    "spec": {"target": {"service": {"name": "web", "port": "http"}}},
                }))?;
                api.create(&PostParams::default(), &tunnel)
                    .await
                    .with_context(|| format!("creating {}", tunnel_name(i)))?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(CREATE_CONCURRENCY)
        .try_collect()
        .await
}

pub(super) fn start_manager(
    binary: &Path,
    kubeconfig: &Path,
    namespace: &str,
    sizes: &Sizes,
    log_dir: &Path,
    heap: Option<&Path>,
) -> anyhow::Result<system::Service> {
    let address = || -> anyhow::Result<String> {
        Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?)).to_string())
    };
    let mut cmd = std::process::Command::new(binary);
    cmd.env("KUBECONFIG", kubeconfig)
        .env_remove("RUST_LOG")
        .arg(format!("--namespace={namespace}"))
        .arg(format!("--metrics-bind-address={}", address()?))
        .arg(format!("--health-probe-bind-address={}", address()?))
        .arg(format!("--resync-period={}s", sizes.resync.as_secs()))
        .arg("--log-format=text")
        .arg("--log-level=warn");
    if let Some(raw) = heap {
        heaptrack::record_into(&mut cmd, raw);
    }
    system::Service::spawn(MANAGER, cmd, log_dir)
}

/// Polls until every tunnel has all of its children; fails if the manager exits or time runs out.
pub(super) async fn wait_children(
    client: &kube::Client,
    namespace: &str,
    sizes: &Sizes,
    manager: &mut system::Service,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + sizes.converge_timeout;
    loop {
        let complete = complete_tunnels(client, namespace).await?;
        if complete >= sizes.tunnels {
            return Ok(());
        }
        manager.check_running()?;
        if Instant::now() > deadline {
            bail!(
                "only {complete} of {} tunnels had all children after {:?}",
                sizes.tunnels,
                sizes.converge_timeout
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// How many tunnels have all five children (by their `rstream.io/tunnel-name` label).
async fn complete_tunnels(client: &kube::Client, namespace: &str) -> anyhow::Result<usize> {
    let kinds = [
        tunnels_with::<ConfigMap>(client, namespace).await?,
        tunnels_with::<ServiceAccount>(client, namespace).await?,
        tunnels_with::<Role>(client, namespace).await?,
        tunnels_with::<RoleBinding>(client, namespace).await?,
        tunnels_with::<Deployment>(client, namespace).await?,
    ];
    debug_assert_eq!(kinds.len(), CHILD_KINDS);
    let [first, rest @ ..] = &kinds;
    Ok(first
        .iter()
        .filter(|name| rest.iter().all(|kind| kind.contains(*name)))
        .count())
}

/// The tunnels that have a child of kind `K`.
async fn tunnels_with<K>(client: &kube::Client, namespace: &str) -> anyhow::Result<HashSet<String>>
where
    K: kube::Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let selector = format!(
        "app.kubernetes.io/managed-by={}",
        rstream_operator::names::MANAGED_BY
    );
    let list = Api::<K>::namespaced(client.clone(), namespace)
        .list_metadata(&ListParams::default().labels(&selector))
        .await
        .with_context(|| format!("listing {}", K::plural(&())))?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|item| item.metadata.labels?.remove("rstream.io/tunnel-name"))
        .collect())
}

/// Waits until the manager's write count has not moved for [`QUIET`]; returns that count.
pub(super) async fn wait_quiet(
    plane: &ControlPlane,
    timeout: Duration,
    manager: &mut system::Service,
) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    let mut last = plane.writes_by(MANAGER_USER).await?.len();
    loop {
        tokio::time::sleep(QUIET).await;
        manager.check_running()?;
        let now = plane.writes_by(MANAGER_USER).await?.len();
        if now == last {
            return Ok(now);
        }
        if Instant::now() > deadline {
            bail!("the manager still writes after {timeout:?} ({now} writes so far)");
        }
        last = now;
    }
}

/// The peak resident memory of a process in KiB (`VmHWM` of `/proc/<pid>/status`).
pub(super) fn peak_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let value = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .with_context(|| format!("no VmHWM in /proc/{pid}/status"))?;
    value
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .context("parsing VmHWM")
}
