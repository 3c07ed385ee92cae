//! rstream-operator on the node: the chart with its CRDs under Pod Security `restricted`, the
//! manager Ready by its own probe, its metrics through the chart's Service; the seed's Quick Start
//! against a LocalEngine run here on the host's end of the node link (a self-hosted engine with a
//! private CA, given to the agent by Secret reference, run as a process of its own by the
//! `local_engine` example and enforcing tokens): HTTP and TCP tunnels, token rotation (the old
//! token revoked in the engine), an agent Pod killed, the engine SIGKILLed under a live stream and
//! started again, deletion; NOTES.txt and `helm test`; a
//! `helm upgrade` to a next chart version whose CRD adds a field (served after the upgrade, the
//! existing object kept); an uninstall that leaves no Pod but keeps the CRDs and their objects
//! (`crds.keep`).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use rstream_operator::api::{RstreamConnection, RstreamTunnel};
use serde_json::json;

use super::{ChartReport, Env, RestartWatch};
use crate::node::check;

mod engine;
mod faults;
mod quick_start;
mod rotation;
mod service_lb;
mod traffic;
mod tunnels;
mod upgrade;

pub use engine::{EngineProcess, EngineView, Login, start_engine};
use faults::LIVE_END_LIMIT;
pub use quick_start::{HttpTunnel, http_tunnel, quick_start, quick_start_with_transport};
use tunnels::tunnel_scenarios;
use upgrade::{NEW_FIELD, SURVIVOR, crd_upgrade};

/// The chart's release name in the e2e.
pub const RELEASE: &str = "rstream-operator";
/// The label selector of the chart's Pods.
pub const SELECTOR: &str = "app.kubernetes.io/instance=rstream-operator";
const CRDS: [&str; 2] = [
    "rstreamconnections.tunnels.rstream.io",
    "rstreamtunnels.tunnels.rstream.io",
];

// The scenarios this chart records, by name (`expected_scenarios` lists them for the run).
pub(crate) const INSTALLED: &str = "chart installed with its CRDs; the manager Ready by its own probe under Pod Security restricted";
pub(crate) const MANAGER_METRICS: &str = "the manager's /metrics through the chart's metrics Service (what the optional ServiceMonitor scrapes) has process_*, the build info, controller-runtime's names and no retired ones";
pub(crate) const HTTP_TUNNEL: &str = "HTTP tunnel (Quick Start): agent Available by its probe, tunnel Ready, a request through the engine reaches the workload Pod via the Service name";
pub(crate) const TCP_TUNNEL: &str =
    "TCP tunnel carries 64 MiB to the workload's echo port and back, intact";
pub(crate) const SERVICE_LB: &str = "a Service of type LoadBalancer with the operator's loadBalancerClass: its status.loadBalancer.ingress gets the tunnel's public address, a request there reaches the workload Pod; the Service deleted: the garbage collector deletes its tunnel";
pub(crate) const AGENT_METRICS: &str = "the echo tunnel's agent Pod /metrics has process_*, its build info and the tunnel and stream metrics";
pub(crate) const TOKEN_ROTATED: &str = "token rotated in the Secret, then the old one revoked in the engine: both agents log in again with the new token (the engine's record of each login), a login with the old token is refused, the agent Deployment rolled (config hash), both tunnels carry traffic";
pub(crate) const AGENT_KILLED: &str = "the echo tunnel's agent Pod killed (grace 0) while Ready: a new agent Pod, the tunnel Ready again with a new tunnel id, 1 MiB through it";
pub(crate) const ENGINE_KILLED: &str = "engine process SIGKILLed: web TunnelReady=False and Ready=False while it is down; started again on the same address: the agents open new control connections with the token in force, both tunnels Ready again and carry traffic (recovery time reported)";
pub(crate) const TUNNEL_DELETED: &str =
    "RstreamTunnel deleted: agent Pods, ServiceAccount, Role, RoleBinding and ConfigMap gone";
pub(crate) const CRD_UPGRADE: &str = "helm upgrade to the next chart version, whose RstreamConnection CRD adds an optional spec field: the field is served after the upgrade (pruned before), the existing RstreamConnection survives";
pub(crate) const UNINSTALLED: &str = "helm uninstall with crds.keep (the default): the manager Pod gone; the CRDs and the RstreamConnection stay";

/// The live-stream outage scenario's name (it names `LIVE_END_LIMIT`).
pub fn engine_killed_live() -> String {
    format!(
        "engine process SIGKILLed under a live stream through echo: the client sees the stream end (EOF or error) within {LIVE_END_LIMIT:?}; echo Ready=False with a reason while down; engine back: echo Ready, a new stream echoes bytes"
    )
}

/// Every scenario a whole run of this chart records, in order: `cargo xtask e2e` fails a run
/// that misses one or records one not listed here.
pub fn expected_scenarios() -> Vec<String> {
    let mut names: Vec<String> = [
        INSTALLED,
        MANAGER_METRICS,
        HTTP_TUNNEL,
        TCP_TUNNEL,
        SERVICE_LB,
        AGENT_METRICS,
        TOKEN_ROTATED,
        AGENT_KILLED,
        ENGINE_KILLED,
    ]
    .map(str::to_owned)
    .into();
    names.push(engine_killed_live());
    names.extend(
        [
            TUNNEL_DELETED,
            super::HELM_TEST_SCENARIO,
            CRD_UPGRADE,
            UNINSTALLED,
        ]
        .map(str::to_owned),
    );
    names
}

/// Installs the chart and runs its scenarios.
pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new("rstream-operator");
    // Its restart watch is finished inside the scenarios (the agents' namespace is made there).
    let outcome = scenarios(env, &mut report).await;
    super::finish_chart(report, outcome, None).await
}

async fn scenarios(env: &Env<'_>, report: &mut ChartReport) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("rstream").await?;
    report.namespace = ns.clone();
    // Restart counts across the whole run: the agents are deleted before the end.
    let watch = RestartWatch::start(env.plane, &[&ns]).await?;
    let client = env.plane.client().await?;

    let started = Instant::now();
    let installed = install(env, &ns).await?;
    let pods = check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
    report.install_to_ready_ms = Some(started.elapsed().as_millis());
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut served = Vec::new();
    for name in CRDS {
        let crd = crds.get(name).await?;
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        served.push(format!(
            "{name} {}",
            if established {
                "Established"
            } else {
                "not established"
            }
        ));
    }
    report.record(
        INSTALLED,
        served.iter().all(|s| s.ends_with(" Established")),
        started,
        format!(
            "manager {} ({}); {}",
            pods[0].0,
            pods[0].1,
            served.join(", ")
        ),
    );

    let svc: Service = Api::namespaced(client.clone(), &ns)
        .get(&format!("{RELEASE}-metrics"))
        .await?;
    let ip = svc
        .spec
        .and_then(|s| s.cluster_ip)
        .context("no ClusterIP")?;
    let addr: SocketAddr = format!("{ip}:8080").parse()?;
    super::record_metric_names(
        report,
        MANAGER_METRICS,
        &super::Scrape::Open(addr),
        "rstream-operator",
        &["leader_election_master_status"],
    )
    .await;

    if let Err(err) = tunnel_scenarios(env, report, &ns).await {
        report.record(
            "tunnel scenarios",
            false,
            Instant::now(),
            format!("stopped: {err:#}"),
        );
    }

    super::helm_test_scenario(env, report, RELEASE, &ns, &installed, "/readyz").await;

    // A release that adds a CRD field: `helm upgrade` must apply the new schema.
    let started = Instant::now();
    let outcome = crd_upgrade(env, &ns).await;
    report.record(
        CRD_UPGRADE,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    report.restarts = watch.finish().await?;
    let started = Instant::now();
    env.helm(&[
        "uninstall",
        RELEASE,
        "-n",
        &ns,
        "--wait",
        "--timeout",
        "90s",
    ])
    .await?;
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(90);
    // A failed `helm test` Pod stays (its hook is deleted on success only) and carries the
    // release's labels: it is not the manager.
    while pods_api
        .list(&ListParams::default().labels(SELECTOR))
        .await?
        .items
        .iter()
        .any(|pod| {
            pod.metadata
                .annotations
                .as_ref()
                .is_none_or(|a| !a.contains_key("helm.sh/hook"))
        })
    {
        if Instant::now() > deadline {
            bail!("the manager Pod outlived the uninstall by 90 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Helm deletes at once what it deletes: a CRD not kept is gone or terminating by now.
    let mut kept = Vec::new();
    let mut lost = Vec::new();
    for name in CRDS {
        match crds.get_opt(name).await? {
            Some(crd) if crd.metadata.deletion_timestamp.is_none() => kept.push(name),
            Some(_) => lost.push(format!("{name} terminating")),
            None => lost.push(format!("{name} deleted")),
        }
    }
    let conns: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<RstreamConnection>(&()),
    );
    let survivor = match conns.get_opt(SURVIVOR).await {
        Ok(Some(c)) => format!(
            "RstreamConnection {SURVIVOR} still there ({NEW_FIELD}={})",
            c.data["spec"][NEW_FIELD]
        ),
        Ok(None) => {
            lost.push(format!("RstreamConnection {SURVIVOR} deleted"));
            String::new()
        }
        Err(err) => {
            lost.push(format!("RstreamConnection {SURVIVOR}: {err}"));
            String::new()
        }
    };
    report.record(
        UNINSTALLED,
        lost.is_empty(),
        started,
        if lost.is_empty() {
            format!("no Pod; CRDs kept: {}; {survivor}", kept.join(", "))
        } else {
            format!("lost: {}", lost.join(", "))
        },
    );
    Ok(())
}

/// A tunnel's condition `(status, reason, message)`.
pub(super) fn condition(t: &RstreamTunnel, type_: &str) -> Option<(String, String, String)> {
    t.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Waits until `name`'s condition `type_` has `status`; returns the tunnel, or the last status.
pub async fn wait_condition(
    tunnels: &Api<RstreamTunnel>,
    name: &str,
    type_: &str,
    status: &str,
    limit: Duration,
) -> anyhow::Result<RstreamTunnel> {
    let started = Instant::now();
    loop {
        let t = tunnels.get(name).await?;
        if condition(&t, type_).is_some_and(|(s, _, _)| s == status) {
            return Ok(t);
        }
        if started.elapsed() > limit {
            bail!(
                "{name}: {type_} not {status} within {limit:?}; conditions: {:?}",
                t.status.and_then(|s| s.conditions).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The IP of a running agent Pod of tunnel `tunnel`.
async fn agent_pod_ip(
    client: &kube::Client,
    ns: &str,
    tunnel: &str,
) -> anyhow::Result<std::net::IpAddr> {
    let (deployment, pods) = agent_pods(client, ns, tunnel).await?;
    pods.into_iter()
        .filter_map(|p| p.status?.pod_ip)
        .find_map(|ip| ip.parse().ok())
        .with_context(|| format!("no agent Pod of {deployment} has an IP"))
}

/// The agent Deployment of tunnel `tunnel` (from its status) and the Pods its selector matches.
pub(super) async fn agent_pods(
    client: &kube::Client,
    ns: &str,
    tunnel: &str,
) -> anyhow::Result<(String, Vec<Pod>)> {
    let status = Api::<RstreamTunnel>::namespaced(client.clone(), ns)
        .get(tunnel)
        .await?
        .status
        .context("the tunnel has no status")?;
    let deployment = status
        .agent_deployment
        .context("no agent Deployment in the status")?;
    let labels = Api::<Deployment>::namespaced(client.clone(), ns)
        .get(&deployment)
        .await?
        .spec
        .selector
        .match_labels
        .context("the agent Deployment has no selector")?;
    let selector: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods = Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&selector.join(",")))
        .await?;
    Ok((deployment, pods.items))
}

/// Waits until the Deployment `name` is `Available`; false if it is not within `limit`.
async fn wait_available(
    deployments: &Api<Deployment>,
    name: &str,
    limit: Duration,
) -> anyhow::Result<bool> {
    let started = Instant::now();
    loop {
        let available = deployments
            .get(name)
            .await?
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| {
                c.type_.as_deref() == Some("Available") && c.status.as_deref() == Some("True")
            });
        if available || started.elapsed() > limit {
            return Ok(available);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `helm install` of the chart with the release image (its CRDs included); returns helm's
/// output.
pub async fn install(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    install_with(env, ns, &[]).await
}

/// [`install`] with more `--set` values (`extra`).
pub async fn install_with(env: &Env<'_>, ns: &str, extra: &[String]) -> anyhow::Result<String> {
    let (repository, tag) = env.image("rstream-operator")?;
    // The scenarios scrape /metrics as plain HTTP: they are not about who may scrape (the
    // secure default is covered by k8s-reconcile's tests/secure_metrics.rs).
    let mut values = vec![format!(
        "image.repository={repository},image.tag={tag},metrics.secure=false"
    )];
    values.extend_from_slice(extra);
    env.install_chart(RELEASE, ns, &values).await
}

/// The Quick Start's HTTP tunnel: port `http` of Service `web`, published.
pub fn http_tunnel_spec() -> serde_json::Value {
    json!({ "target": { "service": { "name": "web", "port": "http" } },
            "publish": true, "protocol": "http", "http": { "version": "http/1.1" } })
}

/// A TCP tunnel to the workload's echo port, published.
pub fn tcp_tunnel_spec() -> serde_json::Value {
    json!({ "target": { "service": { "name": "web", "port": "tcp-echo" } },
            "publish": true, "protocol": "tcp" })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_scenario_list_names_each_scenario_once() {
        let names = super::expected_scenarios();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{names:#?}");
        assert_eq!(names.len(), 14);
    }
}
