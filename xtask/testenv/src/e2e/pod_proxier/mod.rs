//! pod-proxier on the node: the chart (embedded backend, auth on, TLS on by default with the CA
//! it generates, V1 and V2, its Service as a NodePort), a V1 mapping posted with a ServiceAccount token that may only port-forward, V2
//! Service ports reaching every Pod, a restart that restores the mappings, and expiry; then, by
//! `helm upgrade`, V2 to the Services' ClusterIPs through kube-proxy, and the HAProxy backend
//! (Debian's HAProxy as the sidecar) relaying V1 and V2 mappings.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use super::pod_proxier_api::{http, tcp_echo};
use super::{ChartReport, Env, RestartWatch, token};
use crate::node::{NODE_IP, check};

mod access;
mod lifecycle;
mod setup;
mod upgrades;
mod v2;

use access::{SCRAPER, metrics_access, other_source_refused};
use lifecycle::{expiry, judge_restore, mappings};
use setup::tls_default;
pub use setup::{chart_ca, debugger_accounts, install, install_with, wait_routed};
use upgrades::{cluster_ip_target, haproxy_backend};
use v2::{deleted_pod_gets_nothing, v2_port, web_deployment};

/// The chart's release name in the e2e.
pub const RELEASE: &str = "pod-proxier";
/// The label selector of the chart's Pods.
pub const SELECTOR: &str = "app.kubernetes.io/name=pod-proxier";
/// pod-proxier's REST API port.
pub const API_PORT: u16 = 3343;
/// The first entry port of pod-proxier's mappings.
pub const ENTRY_PORT: u16 = 8849;
/// The chart's `ports.metricsPort` (HTTPS with a token: `metricsSecure` is on by default).
const METRICS_PORT: u16 = 8443;
/// The chart's `ports.healthPort`.
const HEALTH_PORT: u16 = 8081;
const V2_START: u16 = 9000;
const V2_END: u16 = 9004;

const TLS_DEFAULT: &str =
    "TLS on by default: a client with the chart's CA is answered, one without it is refused";
const V1_MAPS: &str = "V1: a ServiceAccount bound only to create pods/portforward maps a Pod's jprofiler-port; bytes through the Service's entry port reach the Pod and come back; a caller without the binding gets 403";
const ENTRY_ACCESS: &str = "V1 access bound to the requester: a client Pod (another source address) is closed at the mapping's entry port and counted in podproxier_entry_source_refused_total, while the requester's address still relays";
const METRICS_ACCESS: &str = "/metrics secure by default: HTTPS answers 401 without a token, 403 to a ServiceAccount RBAC does not let get /metrics, 200 to one bound to the chart's metrics-reader ClusterRole; /readyz stays open over plain HTTP";
const METRICS: &str = "the pod-proxier Pod's /metrics has process_*, its build info, the mappings, the relay's and leader election's families";
const NODE_PORT: &str = "chart Service as NodePort on this node carries a mapping";
const V2_BOTH_PODS: &str =
    "V2: a Service over a 2-replica Deployment gets a stable port; connections reach both Pods";
const V2_SCALED: &str = "V2: scaled to 3, the new Pod receives traffic";
const V2_DELETED_POD: &str = "V2: a deleted Pod that still serves while Terminating gets no connection once its endpoint left the slice";
const RESTORED: &str = "pod-proxier Pod deleted: the replacement restores every mapping with the same ports and remaining TTL";
const EXPIRY: &str = "expiry: the entry port answers until the deadline (no refusal before it), then refuses connections (refused, or closed before any byte) within 10 s of it";
const V2_CLUSTER_IP: &str = "V2 with podProxier.v2Target=cluster-ip (helm upgrade): a new Service's debug port is published with the Service's ClusterIP as its upstream; bytes echo through kube-proxy's rules";
const HAPROXY_BACKEND: &str = "podProxier.backend=haproxy (helm upgrade, HAProxy from Debian's package as the sidecar, driven by its Runtime API): a V1 mapping and a V2 mapping relay bytes through HAProxy";
/// Every scenario a whole run of this chart records, in order: `cargo xtask e2e` fails a run
/// that misses one or records one not listed here.
pub fn expected_scenarios() -> Vec<String> {
    [
        TLS_DEFAULT,
        METRICS_ACCESS,
        V1_MAPS,
        ENTRY_ACCESS,
        METRICS,
        NODE_PORT,
        V2_BOTH_PODS,
        V2_SCALED,
        V2_DELETED_POD,
        RESTORED,
        super::partition::POD_PROXIER_CUT,
        EXPIRY,
        super::HELM_TEST_SCENARIO,
        V2_CLUSTER_IP,
        HAPROXY_BACKEND,
    ]
    .map(str::to_owned)
    .into()
}

/// Installs the chart and runs its scenarios.
pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new("pod-proxier");
    let mut watch = None;
    let outcome = scenarios(env, &mut report, &mut watch).await;
    super::finish_chart(report, outcome, watch).await
}

async fn scenarios(
    env: &Env<'_>,
    report: &mut ChartReport,
    watch: &mut Option<RestartWatch>,
) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("pod-proxier").await?;
    let work = env.restricted_namespace("debuggee").await?;
    report.namespace = format!("{ns}, {work}");
    *watch = Some(RestartWatch::start(env.plane, &[&ns, &work]).await?);
    let client = env.plane.client().await?;

    // The workloads first: the allowed namespace must exist before the chart binds in it.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &work);
    let mut profiled = check::testbox_deployment("profiled", 1);
    profiled["spec"]["template"]["spec"]["containers"][0]["ports"][1]["name"] =
        json!("jprofiler-port");
    deployments
        .create(&PostParams::default(), &serde_json::from_value(profiled)?)
        .await?;
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(web_deployment())?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client.clone(), &work);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": { "name": "web" },
                "spec": { "selector": { "app": "web" },
                          "ports": [{ "name": "debug", "port": 80, "targetPort": 8080 }] },
            }))?,
        )
        .await?;
    debugger_accounts(env, &work).await?;

    let started = Instant::now();
    let installed = install(env, &ns, &work).await?;
    check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
    report.install_to_ready_ms = Some(started.elapsed().as_millis());
    check::wait_pods_ready(env.plane, &work, "app=profiled", 1).await?;
    let web_pods = check::wait_pods_ready(env.plane, &work, "app=web", 2).await?;

    let svc: Service = Api::namespaced(client.clone(), &ns).get(RELEASE).await?;
    let spec = svc.spec.context("the pod-proxier Service has no spec")?;
    let cluster_ip = spec.cluster_ip.context("no ClusterIP")?;
    let node_port = |name: &str| {
        spec.ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| p.node_port)
            .and_then(|p| u16::try_from(p).ok())
    };
    let api: SocketAddr = format!("{cluster_ip}:{API_PORT}").parse()?;
    let entry: SocketAddr = format!("{cluster_ip}:{ENTRY_PORT}").parse()?;
    let entry_node = SocketAddr::new(
        NODE_IP.into(),
        node_port("entry").context("the entry port has no nodePort")?,
    );
    wait_routed(api).await?;

    // TLS by default: the chart's generated CA verifies the API; a client trusting another CA
    // fails the handshake, and plain HTTP gets no answer.
    let started = Instant::now();
    let outcome = tls_default(api, &ns).await;
    report.record(
        TLS_DEFAULT,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    let allowed = token(env, &work, "debugger").await?;
    let denied = token(env, &work, "bystander").await?;

    // Who may read /metrics: the chart's secure default, with a scraper bound to its role.
    let started = Instant::now();
    let pod_ip = check::wait_pods_ready(env.plane, &ns, SELECTOR, 1)
        .await?
        .remove(0)
        .1;
    let outcome = metrics_access(env, &ns, &pod_ip, &denied).await;
    report.record(
        METRICS_ACCESS,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
    let scraper = token(env, &ns, SCRAPER).await?;

    let profiled_pod = check::wait_pods_ready(env.plane, &work, "app=profiled", 1)
        .await?
        .remove(0);

    // V1 with auth: the port-forward-only account maps the Pod; bytes go through the Service.
    let started = Instant::now();
    let body = json!({ "pod_name": format!("{work}/{}", profiled_pod.0), "time": 120 }).to_string();
    let (status, answer) =
        http(api, "POST", "/api/v1/mapping", Some(&allowed), Some(&body)).await?;
    let entry_port = answer["data"]["entry_port"].as_i64().unwrap_or(0);
    let v1_name = answer["data"]["name"].as_str().map(str::to_owned);
    let echoed = tcp_echo(entry, 64 * 1024).await;
    let (denied_status, denied_answer) =
        http(api, "POST", "/api/v1/mapping", Some(&denied), Some(&body)).await?;
    report.record(
        V1_MAPS,
        status == 200
            && entry_port == i64::from(ENTRY_PORT)
            && echoed.is_ok()
            && denied_status == 403,
        started,
        format!(
            "POST {status} entry_port {entry_port} upstreams {}; 64 KiB echo through {entry}: {}; without the binding: {denied_status} {}",
            answer["data"]["upstreams"],
            echoed.as_ref().map(|d| format!("intact in {d:.1?}")).unwrap_or_else(|e| format!("{e:#}")),
            denied_answer["msg"]
        ),
    );

    // The mapping admits its requester's address only: a Pod's client (another source) is
    // closed at accept and counted; the requester still relays.
    let started = Instant::now();
    let outcome = other_source_refused(env, &ns, &work, entry, &scraper).await;
    report.record(
        ENTRY_ACCESS,
        outcome.is_ok(),
        started,
        match outcome {
            Ok(detail) => format!(
                "requested_from {}; {detail}",
                answer["data"]["requested_from"]
            ),
            Err(e) => format!("{e:#}"),
        },
    );

    // pod-proxier's /metrics after relaying that mapping, under the names dashboards use.
    for (_, ip) in check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await? {
        super::record_metric_names(
            report,
            METRICS,
            &super::Scrape::Secure {
                addr: format!("{ip}:{METRICS_PORT}").parse()?,
                token: scraper.clone(),
            },
            "pod-proxier",
            &[
                "podproxier_mappings",
                "proxy_connections",
                "leader_election_master_status",
            ],
        )
        .await;
    }

    // The chart's Service as a NodePort carries the same mapping.
    let started = Instant::now();
    let echoed = tcp_echo(entry_node, 4096).await;
    report.record(
        NODE_PORT,
        echoed.is_ok(),
        started,
        format!(
            "4 KiB echo through {entry_node}: {}",
            echoed
                .as_ref()
                .map(|d| format!("intact in {d:.1?}"))
                .unwrap_or_else(|e| format!("{e:#}"))
        ),
    );

    // V2: the Service's port named debug gets a stable entry port that reaches every Pod.
    let started = Instant::now();
    let (v2_name, v2_entry) = v2_port(api, &allowed, &work).await?;
    let v2: SocketAddr = format!("{cluster_ip}:{v2_entry}").parse()?;
    let want: BTreeSet<String> = web_pods.iter().map(|(n, _)| n.clone()).collect();
    let seen = check::reach_all(v2, &want).await;
    report.record(
        V2_BOTH_PODS,
        seen.is_ok(),
        started,
        format!(
            "service {work}/web -> entry port {v2_entry}; reached {}",
            seen.as_ref()
                .map(|s| s.iter().cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_else(|e| e.to_string())
        ),
    );
    let started = Instant::now();
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(&json!({ "spec": { "replicas": 3 } })),
        )
        .await?;
    let web_pods = check::wait_pods_ready(env.plane, &work, "app=web", 3).await?;
    let want3: BTreeSet<String> = web_pods.iter().map(|(n, _)| n.clone()).collect();
    let seen = check::reach_all(v2, &want3).await;
    report.record(
        V2_SCALED,
        seen.is_ok(),
        started,
        format!(
            "reached {}",
            seen.as_ref()
                .map(|s| s.iter().cloned().collect::<Vec<_>>().join(", "))
                .unwrap_or_else(|e| e.to_string())
        ),
    );
    let started = Instant::now();
    let outcome = deleted_pod_gets_nothing(env, api, &allowed, &work, v2, &web_pods[0]).await;
    report.record(
        V2_DELETED_POD,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // A restart restores every mapping with its port and remaining TTL: the V1 mapping and the
    // V2 mapping made above, by name and port, must be there before and after.
    let started = Instant::now();
    let expected = [
        (
            v1_name.context("the V1 POST answered no mapping name")?,
            i64::from(ENTRY_PORT),
        ),
        (v2_name, v2_entry),
    ];
    let before = mappings(api, &allowed).await?;
    let old_pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(SELECTOR))
        .await?;
    for pod in &old_pods {
        Api::<Pod>::namespaced(client.clone(), &ns)
            .delete(
                pod.metadata.name.as_deref().unwrap_or_default(),
                &DeleteParams::default(),
            )
            .await?;
    }
    let old: BTreeSet<String> = old_pods
        .items
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
        if ready.iter().all(|(n, _)| !old.contains(n)) {
            break;
        }
        if Instant::now() > deadline {
            bail!("no replacement pod-proxier Pod");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = mappings(api, &allowed).await?;
    let (_, v2_after) = v2_port(api, &allowed, &work).await?;
    let echoed = tcp_echo(entry, 4096).await;
    let restored = judge_restore(&expected, &before, &after, started.elapsed());
    report.record(
        RESTORED,
        restored.is_ok() && v2_after == v2_entry && echoed.is_ok(),
        started,
        format!(
            "{}; before {before:?}; after {after:?}; V2 port {v2_entry} -> {v2_after}; V1 echo after: {}",
            restored.unwrap_or_else(|e| e),
            echoed.as_ref().map(|_| "ok".to_owned()).unwrap_or_else(|e| format!("{e:#}"))
        ),
    );

    // The node cut off from the API server: what is mapped keeps relaying.
    let served = super::partition::Served {
        api,
        token: &allowed,
        entry,
        pod: format!("{work}/{}", profiled_pod.0),
        v2,
    };
    super::partition::pod_proxier(env, report, &served).await;

    // Expiry: the entry port answers until the mapping's deadline, then refuses (generously
    // bounded; the lateness is reported, its precision is a bench's figure).
    let started = Instant::now();
    let outcome = expiry(api, entry, &allowed, &format!("{work}/{}", profiled_pod.0)).await;
    report.record(
        EXPIRY,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // The chart as users meet it: NOTES.txt says what to check next; `helm test` passes.
    super::helm_test_scenario(env, report, RELEASE, &ns, &installed, "/health").await;

    // V2 to the ClusterIP: after `helm upgrade` with podProxier.v2Target=cluster-ip, a new
    // Service's debug port is published with its ClusterIP as the upstream, and bytes reach the
    // workload through kube-proxy's rules.
    let started = Instant::now();
    let outcome = cluster_ip_target(env, &ns, &work, &cluster_ip, &allowed).await;
    report.record(
        V2_CLUSTER_IP,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );

    // The HAProxy backend: `helm upgrade` to podProxier.backend=haproxy with the node's HAProxy
    // image; V1 and V2 mappings relay bytes through the sidecar.
    let started = Instant::now();
    let outcome = haproxy_backend(env, &ns, &work, &cluster_ip, &allowed).await;
    report.record(
        HAPROXY_BACKEND,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
    Ok(())
}
