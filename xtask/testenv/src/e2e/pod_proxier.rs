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
use k8s_openapi::api::core::v1::{Pod, Secret, Service, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::pod_proxier_api::{API_TLS, api_tls, exchange, http, tcp_echo};
use super::{ChartReport, Env, RestartWatch, token};
use crate::node::{NODE_IP, check};

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

/// `helm upgrade --reuse-values` to `podProxier.backend=haproxy` (V2 back to its endpoints
/// target) with the image [`crate::node_images::haproxy_image`] built; requires the new Pod to
/// run pod-proxier with `--backend=haproxy` and a Ready `haproxy` container, then a new V1
/// mapping of the profiled Pod and the V2 mapping of [`CLUSTER_IP_SERVICE`] each to echo 64 KiB
/// intact through the chart's Service (the entry ports are HAProxy's listeners now), and no
/// container of that Pod restarted. Ok is the detail.
async fn haproxy_backend(
    env: &Env<'_>,
    ns: &str,
    work: &str,
    proxier_ip: &str,
    token: &str,
) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let (repository, tag) = env.image("haproxy")?;
    let image = format!(
        "haproxy.image.repository={repository},haproxy.image.tag={tag},haproxy.image.pullPolicy=Never"
    );
    let sets = [
        (
            "--set",
            "podProxier.backend=haproxy,podProxier.v2Target=endpoints",
        ),
        ("--set", image.as_str()),
    ];
    let took = env.upgrade_reusing(RELEASE, ns, &sets, true).await?;
    let pod_spec = env.pod_template(ns, RELEASE).await?;
    let args = (pod_spec.containers.iter())
        .find(|c| c.name == "pod-proxier")
        .and_then(|c| c.args.clone())
        .unwrap_or_default();
    let image = (pod_spec.containers.iter())
        .find(|c| c.name == "haproxy")
        .and_then(|c| c.image.clone());
    if !args.iter().any(|a| a == "--backend=haproxy") || image.is_none() {
        bail!(
            "after the upgrade the Pod template has pod-proxier args {args:?} and haproxy image {image:?}"
        );
    }
    // The rolled Pod: both containers Ready (the relay's readiness needs the Runtime API).
    let pods = check::wait_pods_ready(env.plane, ns, SELECTOR, 1).await?;
    let pod = Api::<Pod>::namespaced(client.clone(), ns)
        .get(&pods[0].0)
        .await?;
    let statuses = (pod.status.and_then(|s| s.container_statuses)).unwrap_or_default();
    let ready: Vec<String> = (statuses.iter())
        .map(|c| format!("{} ready={} restarts={}", c.name, c.ready, c.restart_count))
        .collect();
    // pod-proxier and its sidecar start together: neither may crash waiting for the other.
    let restarted = statuses.iter().any(|c| c.restart_count != 0);
    if !ready.iter().any(|c| c.starts_with("haproxy ready=true")) {
        bail!("pod-proxier Pod {}: containers {ready:?}", pods[0].0);
    }

    let api: SocketAddr = format!("{proxier_ip}:{API_PORT}").parse()?;
    let profiled = check::wait_pods_ready(env.plane, work, "app=profiled", 1)
        .await?
        .remove(0);
    let body = json!({ "pod_name": format!("{work}/{}", profiled.0), "time": 120 }).to_string();
    // The new Pod serves the API once it leads.
    let deadline = Instant::now() + Duration::from_secs(60);
    let v1 = loop {
        let got = http(api, "POST", "/api/v1/mapping", Some(token), Some(&body)).await;
        match got {
            Ok((200, answer)) => break answer,
            other if Instant::now() > deadline => bail!("POST /api/v1/mapping: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let entry: SocketAddr = format!("{proxier_ip}:{ENTRY_PORT}").parse()?;
    let v1_echo = echo_until(entry, 64 * 1024, Duration::from_secs(30)).await?;

    let deadline = Instant::now() + Duration::from_secs(60);
    let v2_port = loop {
        let got = http(
            api,
            "GET",
            &format!("/api/v2/mapping?service={work}/{CLUSTER_IP_SERVICE}"),
            Some(token),
            None,
        )
        .await;
        match got {
            Ok((200, answer)) if answer["data"]["entry_port"].as_i64().is_some() => {
                break answer["data"]["entry_port"].as_i64().unwrap_or_default();
            }
            other if Instant::now() > deadline => {
                bail!("GET the V2 mapping of {work}/{CLUSTER_IP_SERVICE}: {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let v2: SocketAddr = format!("{proxier_ip}:{v2_port}").parse()?;
    let v2_echo = echo_until(v2, 64 * 1024, Duration::from_secs(30)).await?;
    let detail = format!(
        "helm upgrade in {took:.1?}; haproxy image {}; Pod {}: {}; V1 {work}/{} -> upstreams {}: 64 KiB echo through {entry} intact in {:.1?} (try {}); V2 {work}/{CLUSTER_IP_SERVICE} port {v2_port}: 64 KiB echo through {v2} intact in {:.1?} (try {})",
        image.unwrap_or_default(),
        pods[0].0,
        ready.join(", "),
        profiled.0,
        v1["data"]["upstreams"],
        v1_echo.0,
        v1_echo.1,
        v2_echo.0,
        v2_echo.1,
    );
    if restarted {
        bail!("a container of the pod-proxier Pod restarted: {detail}");
    }
    Ok(detail)
}

/// The ServiceAccount (in the chart's namespace) bound to the chart's metrics-reader role.
const SCRAPER: &str = "scraper";
/// The [`METRICS_ACCESS`] scenario on the Pod at `ip`: `/metrics` over HTTPS refuses no token
/// (401) and `denied`'s (403), then answers a [`SCRAPER`] bound to `<release>-metrics-reader`
/// (200, waited for while RBAC settles); `/readyz` answers over plain HTTP without a token.
async fn metrics_access(env: &Env<'_>, ns: &str, ip: &str, denied: &str) -> anyhow::Result<String> {
    let metrics: SocketAddr = format!("{ip}:{METRICS_PORT}").parse()?;
    let (anonymous, body) = super::https_get(metrics, "/metrics", None).await?;
    if anonymous != 401 {
        bail!("no token: {anonymous} {}", body.trim());
    }
    let (forbidden, body) = super::https_get(metrics, "/metrics", Some(denied)).await?;
    if forbidden != 403 {
        bail!(
            "a ServiceAccount without the role: {forbidden} {}",
            body.trim()
        );
    }
    super::bind_metrics_reader(env, ns, SCRAPER, &format!("{RELEASE}-metrics-reader")).await?;
    let scraper = token(env, ns, SCRAPER).await?;
    let bound = Instant::now();
    let families = loop {
        let (status, body) = super::https_get(metrics, "/metrics", Some(&scraper)).await?;
        if status == 200 {
            break body.lines().filter(|l| l.starts_with("# TYPE ")).count();
        }
        // Generous: the binding reaches the API server's authorizer within a moment.
        if bound.elapsed() > Duration::from_secs(30) {
            bail!(
                "the bound {SCRAPER} still got {status} after 30 s: {}",
                body.trim()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let ready = check::http_get(format!("{ip}:{HEALTH_PORT}").parse()?, "/readyz")
        .await
        .map_err(|e| anyhow::anyhow!("plain GET /readyz on {HEALTH_PORT}: {e}"))?;
    Ok(format!(
        "https://{metrics}/metrics: no token 401, bystander 403, {SCRAPER} 200 ({families} \
         families, {:.1?} after the binding); http://{ip}:{HEALTH_PORT}/readyz 200 {:?}",
        bound.elapsed(),
        ready.trim()
    ))
}

/// The sum of `podproxier_entry_source_refused_total` over the pod-proxier Pods of `ns`, read
/// with `token` (a [`SCRAPER`]'s).
async fn source_refusals(env: &Env<'_>, ns: &str, token: &str) -> anyhow::Result<u64> {
    let mut total = 0;
    for (_, ip) in check::wait_pods_ready(env.plane, ns, SELECTOR, 1).await? {
        let metrics = format!("{ip}:{METRICS_PORT}").parse()?;
        let text = match super::https_get(metrics, "/metrics", Some(token)).await {
            Ok((200, body)) => body,
            Ok((status, body)) => bail!("pod-proxier /metrics: {status} {}", body.trim()),
            Err(e) => return Err(e.context("pod-proxier /metrics")),
        };
        total += text
            .lines()
            .filter(|l| l.starts_with("podproxier_entry_source_refused_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum::<u64>();
    }
    Ok(total)
}

/// A testbox Job in `work` (a Pod address, not the requester's) tries the V1 entry port: it
/// must fail, the refusal must be counted, and the requester must still relay.
async fn other_source_refused(
    env: &Env<'_>,
    ns: &str,
    work: &str,
    entry: SocketAddr,
    scraper: &str,
) -> anyhow::Result<String> {
    use k8s_openapi::api::batch::v1::Job;
    let before = source_refusals(env, ns, scraper).await?;
    let name = "entry-other-source";
    let target = entry.to_string();
    let mut job = check::job(
        name,
        crate::node::TESTBOX_IMAGE,
        &[
            "/testbox",
            "tcp-check",
            &target,
            "--bytes",
            "4096",
            "--timeout-seconds",
            "10",
        ],
    );
    job["spec"]["activeDeadlineSeconds"] = json!(60);
    let jobs: Api<Job> = Api::namespaced(env.plane.client().await?, work);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
        .await?;
    let outcome = check::wait_job_logs(env.plane, work, name).await;
    let _ = jobs.delete(name, &DeleteParams::background()).await;
    if let Ok(logs) = outcome {
        bail!("a client Pod relayed through {entry}, another source than the requester's: {logs}");
    }
    let after = source_refusals(env, ns, scraper).await?;
    if after <= before {
        bail!(
            "the client Pod failed, but podproxier_entry_source_refused_total stayed {before}: {outcome:?}"
        );
    }
    let echoed = tcp_echo(entry, 4096).await;
    let echoed = echoed.map_err(|e| anyhow::anyhow!("the requester no longer relays: {e:#}"))?;
    Ok(format!(
        "client Pod refused ({}), refusals {before} -> {after}; the requester's 4 KiB echo intact in {echoed:.1?}",
        outcome
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
            .lines()
            .next()
            .unwrap_or_default()
    ))
}

/// [`tcp_echo`] of `len` bytes through `addr`, retried until it succeeds or `limit` passes;
/// returns its time and the tries it took.
async fn echo_until(
    addr: SocketAddr,
    len: usize,
    limit: Duration,
) -> anyhow::Result<(Duration, u32)> {
    let deadline = Instant::now() + limit;
    let mut tries = 0u32;
    loop {
        tries += 1;
        match tcp_echo(addr, len).await {
            Ok(took) => return Ok((took, tries)),
            Err(e) if Instant::now() > deadline => {
                bail!("{len} bytes through {addr} ({tries} tries): {e:#}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// The Service of the cluster-ip scenario: the `web` Pods' echo port as a `debug` port.
const CLUSTER_IP_SERVICE: &str = "echo-by-ip";
/// Its port, which is not the Pods' (9000): only the Service's rules map one to the other.
const CLUSTER_IP_PORT: u16 = 7000;

/// `helm upgrade --reuse-values` with `podProxier.v2Target=cluster-ip`, waits for the
/// replacement Pod to run with `--v2-target cluster-ip`, creates [`CLUSTER_IP_SERVICE`] and
/// requires its V2 mapping's upstreams to be exactly its ClusterIP and port, then 64 KiB through
/// the mapping's entry port on the chart's Service and back intact. Ok is the detail.
async fn cluster_ip_target(
    env: &Env<'_>,
    ns: &str,
    work: &str,
    proxier_ip: &str,
    token: &str,
) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let sets = [("--set", "podProxier.v2Target=cluster-ip")];
    let took = env.upgrade_reusing(RELEASE, ns, &sets, true).await?;
    let args = (env.pod_template(ns, RELEASE).await?.containers.into_iter())
        .find(|c| c.name == "pod-proxier")
        .and_then(|c| c.args)
        .unwrap_or_default();
    let target = (args.iter())
        .position(|a| a == "--v2-target")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .or_else(|| args.iter().find_map(|a| a.strip_prefix("--v2-target=")));
    if target != Some("cluster-ip") {
        bail!("after the upgrade pod-proxier runs with {args:?}, not --v2-target=cluster-ip");
    }
    let services: Api<Service> = Api::namespaced(client.clone(), work);
    services
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": { "name": CLUSTER_IP_SERVICE },
                "spec": { "selector": { "app": "web" },
                          "ports": [{ "name": "debug", "port": CLUSTER_IP_PORT, "targetPort": 9000 }] },
            }))?,
        )
        .await?;
    let service_ip = services
        .get(CLUSTER_IP_SERVICE)
        .await?
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the Service has no ClusterIP")?;
    let want = format!("{service_ip}:{CLUSTER_IP_PORT}");
    let api: SocketAddr = format!("{proxier_ip}:{API_PORT}").parse()?;
    // The replacement Pod serves once it holds the leader Lease; the mapping follows the Service.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (entry_port, upstreams) = loop {
        let got = http(
            api,
            "GET",
            &format!("/api/v2/mapping?service={work}/{CLUSTER_IP_SERVICE}"),
            Some(token),
            None,
        )
        .await;
        let last = match got {
            Ok((200, answer)) => match answer["data"]["entry_port"].as_i64() {
                Some(port) if answer["data"]["upstreams"] == json!([want]) => {
                    break (port, answer["data"]["upstreams"].clone());
                }
                _ => format!("200 {answer}"),
            },
            Ok((status, answer)) => format!("{status} {answer}"),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!(
                "pod-proxier args {args:?}: no V2 mapping of {work}/{CLUSTER_IP_SERVICE} with upstreams [{want}] within 60 s; last: {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let entry: SocketAddr = format!("{proxier_ip}:{entry_port}").parse()?;
    let (echoed, tries) = echo_until(entry, 64 * 1024, Duration::from_secs(30)).await?;
    Ok(format!(
        "helm upgrade in {took:.1?}; pod-proxier runs with --v2-target={}; {work}/{CLUSTER_IP_SERVICE} -> entry port {entry_port}, upstreams {upstreams}; 64 KiB echo through {entry} intact in {echoed:.1?} (try {tries})",
        target.unwrap_or("(absent)")
    ))
}

/// `helm install` of the chart as the e2e runs it: the embedded backend, auth by the Kubernetes
/// API, V1 and V2 on, its Service as a NodePort, mappings allowed in `work` only; returns helm's
/// output.
pub async fn install(env: &Env<'_>, ns: &str, work: &str) -> anyhow::Result<String> {
    let (repository, tag) = env.image("pod-proxier")?;
    let values = [
        format!("image.repository={repository},image.tag={tag}"),
        // hostNetwork is off and the Service on by default; NodePort for the host's clients.
        "service.type=NodePort".to_owned(),
        "podProxier.enableV1=true,podProxier.enableV2=true".to_owned(),
        format!("podProxier.portRangeStart={V2_START},podProxier.portRangeEnd={V2_END}"),
        format!("podProxier.allowedNamespaces={{{work}}}"),
        // `helm test` over HTTPS with the chart's CA (mounted at /etc/pod-proxier/ca).
        "tests.caArgs={--ca-file,/etc/pod-proxier/ca/ca.crt}".to_owned(),
    ];
    let output = env.install_chart(RELEASE, ns, &values).await?;
    let ca = chart_ca(env, ns).await?;
    let name = format!("{RELEASE}.{ns}.svc");
    let client = api_tls(&ca, &name)?;
    *API_TLS.write().unwrap_or_else(|p| p.into_inner()) = Some(client);
    Ok(output)
}

/// The `ca.crt` of the chart's generated TLS Secret (`<release>-tls`), waited for briefly.
pub async fn chart_ca(env: &Env<'_>, ns: &str) -> anyhow::Result<Vec<u8>> {
    let secrets: Api<Secret> = Api::namespaced(env.plane.client().await?, ns);
    let name = format!("{RELEASE}-tls");
    let secret = secrets
        .get(&name)
        .await
        .with_context(|| format!("the chart's TLS Secret {ns}/{name}"))?;
    let ca = (secret.data.as_ref())
        .and_then(|d| d.get("ca.crt"))
        .with_context(|| format!("{ns}/{name} has no ca.crt"))?;
    Ok(ca.0.clone())
}

/// The [`TLS_DEFAULT`] scenario: GET /health with the chart's CA is 200; with a CA of our own
/// the handshake fails (certificate unknown); plain HTTP gets no HTTP answer. Ok is the detail.
async fn tls_default(api: SocketAddr, ns: &str) -> anyhow::Result<String> {
    let with_ca = API_TLS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .context("install() read no CA")?;
    let (status, _) = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        Some(with_ca),
    )
    .await
    .context("GET /health with the chart's CA")?;
    if status != 200 {
        bail!("GET /health with the chart's CA: status {status}");
    }
    let mut other = rcgen::CertificateParams::default();
    other.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let other_ca = other.self_signed(&rcgen::KeyPair::generate()?)?.pem();
    let without = api_tls(other_ca.as_bytes(), &format!("{RELEASE}.{ns}.svc"))?;
    let refused = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        Some(without),
    )
    .await;
    let refusal = match refused {
        Ok((status, _)) => bail!("a client without the chart's CA got status {status}"),
        Err(e) => format!("{e:#}"),
    };
    if !refusal.contains("certificate") {
        bail!("a client without the chart's CA failed, but not on the certificate: {refusal}");
    }
    let plain = exchange(
        api,
        "GET",
        "/health",
        None,
        None,
        Duration::from_secs(10),
        None,
    )
    .await;
    if let Ok((status, _)) = plain {
        bail!("plain HTTP to the TLS API got status {status}");
    }
    Ok(format!(
        "GET https://{RELEASE}.{ns}.svc:{API_PORT}/health (dialled {api}) with the chart's CA: 200; with another CA: {refusal}; plain HTTP: no answer"
    ))
}

/// Waits until `addr` (a new Service's port) accepts connections: kube-proxy applies a new
/// Service within a second or two.
pub async fn wait_routed(addr: SocketAddr) -> anyhow::Result<()> {
    let routable = Instant::now();
    while tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr))
        .await
        .map_or(true, |r| r.is_err())
    {
        if routable.elapsed() > Duration::from_secs(30) {
            bail!("the pod-proxier Service {addr} is not routed within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// `debugger` may only `create pods/portforward` (and `get services` for V2) in `ns`;
/// `bystander` may do nothing.
pub async fn debugger_accounts(env: &Env<'_>, ns: &str) -> anyhow::Result<()> {
    let client = env.plane.client().await?;
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    for name in ["debugger", "bystander"] {
        accounts
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({ "metadata": { "name": name } }))?,
            )
            .await?;
    }
    let roles: Api<k8s_openapi::api::rbac::v1::Role> = Api::namespaced(client.clone(), ns);
    roles
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "port-forward" },
                "rules": [
                    { "apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"] },
                    { "apiGroups": [""], "resources": ["services"], "verbs": ["get"] },
                ],
            }))?,
        )
        .await?;
    let bindings: Api<k8s_openapi::api::rbac::v1::RoleBinding> = Api::namespaced(client, ns);
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": { "name": "port-forward" },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "port-forward" },
                "subjects": [{ "kind": "ServiceAccount", "name": "debugger", "namespace": ns }],
            }))?,
        )
        .await?;
    Ok(())
}

/// `GET /api/v2/mapping` of `ns/web`: the status and the answer.
async fn web_v2_mapping(api: SocketAddr, token: &str, ns: &str) -> anyhow::Result<(u16, Value)> {
    http(
        api,
        "GET",
        &format!("/api/v2/mapping?service={ns}/web"),
        Some(token),
        None,
    )
    .await
}

/// The V2 mapping of `ns/web`, (name, entry port), waited for (bounded).
async fn v2_port(api: SocketAddr, token: &str, ns: &str) -> anyhow::Result<(String, i64)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, answer) = web_v2_mapping(api, token, ns).await?;
        if status == 200
            && let Some(port) = answer["data"]["entry_port"].as_i64()
        {
            let name = answer["data"]["name"]
                .as_str()
                .with_context(|| format!("the V2 mapping of {ns}/web has no name: {answer}"))?;
            return Ok((name.to_owned(), port));
        }
        if Instant::now() > deadline {
            bail!("no V2 port for {ns}/web: {status} {answer}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long the `web` Pods keep serving once deleted: kubelet runs this preStop sleep before
/// it sends SIGTERM, so a deleted Pod answers while Terminating, as a Pod draining its clients
/// does.
const WEB_SERVES_WHILE_TERMINATING_S: i64 = 150;

/// The `web` workload: the testbox over 2 replicas, each serving for
/// [`WEB_SERVES_WHILE_TERMINATING_S`] after its deletion.
fn web_deployment() -> Value {
    let mut web = check::testbox_deployment("web", 2);
    let spec = &mut web["spec"]["template"]["spec"];
    spec["terminationGracePeriodSeconds"] = json!(WEB_SERVES_WHILE_TERMINATING_S + 30);
    spec["containers"][0]["lifecycle"] =
        json!({ "preStop": { "sleep": { "seconds": WEB_SERVES_WHILE_TERMINATING_S } } });
    web
}

/// Deletes `victim` (a `web` Pod, name and IP), which keeps serving while Terminating, and
/// requires: its endpoint leaves `ns/web`'s slices as ready (not ready, or gone) and pod-proxier's
/// V2 mapping drops its address, each within 60 s; then 60 GETs through `v2`, none answered by
/// the victim, at least 50 answered; and the victim, asked directly, still answers with its
/// name afterwards (so a route to it would have been answered, not refused). Ok is the detail.
async fn deleted_pod_gets_nothing(
    env: &Env<'_>,
    api: SocketAddr,
    token: &str,
    ns: &str,
    v2: SocketAddr,
    victim: &(String, String),
) -> anyhow::Result<String> {
    let (name, ip) = victim;
    let client = env.plane.client().await?;
    let direct: SocketAddr = format!("{ip}:8080").parse()?;
    let before = check::http_get(direct, "/")
        .await
        .map_err(|e| anyhow::anyhow!("{name} at {direct} before its deletion: {e}"))?;
    if !before.contains(name.as_str()) {
        bail!("{direct} answered {before:?}, not as {name}");
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    pods.delete(name, &DeleteParams::default()).await?;
    let deleted = Instant::now();
    let limit = Duration::from_secs(60);

    // Its endpoint leaves the Service's slice: not ready (it is Terminating), or gone.
    let slices: Api<k8s_openapi::api::discovery::v1::EndpointSlice> =
        Api::namespaced(client.clone(), ns);
    loop {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?;
        let ready = (list.items.iter())
            .flat_map(|s| s.endpoints.iter().flatten())
            .any(|e| {
                e.target_ref.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                    && e.conditions.as_ref().and_then(|c| c.ready) != Some(false)
            });
        if !ready {
            break;
        }
        if deleted.elapsed() > limit {
            bail!("{name} was deleted and is still a ready endpoint of {ns}/web after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let left = deleted.elapsed();

    // pod-proxier's V2 mapping drops its address (the state the relay is programmed from).
    let upstream = format!("{ip}:8080");
    let mut last = Value::Null;
    let dropped = loop {
        let (status, answer) = web_v2_mapping(api, token, ns).await?;
        let upstreams = answer["data"]["upstreams"].as_array().cloned();
        if status == 200
            && let Some(upstreams) = upstreams
            && !upstreams
                .iter()
                .any(|u| u.as_str() == Some(upstream.as_str()))
        {
            break Some(deleted.elapsed());
        }
        last = answer;
        if deleted.elapsed() > left + limit {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };

    // No connection reaches it, though it still serves.
    let mut by_pod = std::collections::BTreeMap::<String, usize>::new();
    let mut failed = Vec::new();
    for _ in 0..60 {
        match check::http_get(v2, "/").await {
            Ok(body) => {
                let pod = serde_json::from_str::<Value>(&body)
                    .ok()
                    .and_then(|v| v["pod"].as_str().map(str::to_owned))
                    .unwrap_or_else(|| format!("(unnamed: {body:?})"));
                *by_pod.entry(pod).or_default() += 1;
            }
            Err(e) => failed.push(e),
        }
    }
    let still_serving = check::http_get(direct, "/").await;
    let terminating = pods
        .get_opt(name)
        .await?
        .is_some_and(|p| p.metadata.deletion_timestamp.is_some());
    let answered: usize = by_pod.values().sum();
    let to_victim = by_pod.get(name.as_str()).copied().unwrap_or(0);
    let detail = format!(
        "{name} ({ip}) deleted: not a ready endpoint after {left:.1?}; pod-proxier's V2 mapping without {upstream} {}; then 60 GETs through {v2}: answered by {by_pod:?}{}; {name} asked directly afterwards: {} (Terminating: {terminating})",
        dropped.map_or_else(
            || format!("never within {limit:?} (last answer {last})"),
            |d| format!("after {d:.1?}")
        ),
        if failed.is_empty() {
            String::new()
        } else {
            format!(", {} failed (first: {})", failed.len(), failed[0])
        },
        match &still_serving {
            Ok(body) if body.contains(name.as_str()) => "answered as itself".to_owned(),
            Ok(body) => format!("answered {body:?}"),
            Err(e) => format!("no answer ({e})"),
        },
    );
    let alive = still_serving
        .as_ref()
        .is_ok_and(|b| b.contains(name.as_str()));
    if dropped.is_none() || to_victim != 0 || answered < 50 || !alive || !terminating {
        bail!("{detail}");
    }
    Ok(detail)
}

/// One mapping as the API lists it: (name, entry port, remaining seconds; V2 has none).
type Listed = (String, i64, Option<i64>);

/// Every mapping the caller sees, V1 and V2; an answer without a list, or a mapping without a
/// name or entry port, is an error (never an empty list).
async fn mappings(api: SocketAddr, token: &str) -> anyhow::Result<Vec<Listed>> {
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    for path in ["/api/v1/mappings", "/api/v2/mappings"] {
        let answer = loop {
            let got = http(api, "GET", path, Some(token), None).await;
            if let Ok((200, answer)) = got {
                break answer;
            }
            if Instant::now() > deadline {
                bail!("GET {path}: {got:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let list = answer["data"]
            .as_array()
            .with_context(|| format!("GET {path}: no list in {answer}"))?;
        for m in list {
            out.push((
                m["name"]
                    .as_str()
                    .with_context(|| format!("GET {path}: a mapping without a name: {m}"))?
                    .to_owned(),
                m["entry_port"]
                    .as_i64()
                    .with_context(|| format!("GET {path}: a mapping without an entry port: {m}"))?,
                m["remaining_seconds"].as_i64(),
            ));
        }
    }
    out.sort();
    Ok(out)
}

/// Whether `after` (listed `elapsed` after `before`) restored every `expected` (name, entry
/// port): each is in both lists with that port, and a V1 mapping's remaining time did not grow
/// nor drop by more than the time that passed (2 s of rounding allowed); a V2 mapping has none.
fn judge_restore(
    expected: &[(String, i64)],
    before: &[Listed],
    after: &[Listed],
    elapsed: Duration,
) -> Result<String, String> {
    if expected.is_empty() {
        return Err("nothing expected: the scenario made no mapping".to_owned());
    }
    let passed = i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX);
    let mut kept = Vec::new();
    for (name, port) in expected {
        let find = |list: &[Listed]| list.iter().find(|(n, _, _)| n == name).cloned();
        let Some((_, port_before, ttl_before)) = find(before) else {
            return Err(format!("{name} was not listed before the restart"));
        };
        let Some((_, port_after, ttl_after)) = find(after) else {
            return Err(format!("{name} is missing after the restart"));
        };
        if port_before != *port || port_after != *port {
            return Err(format!(
                "{name}: entry port {port} expected, {port_before} before and {port_after} after"
            ));
        }
        match (ttl_before, ttl_after) {
            (None, None) => kept.push(format!("{name} on {port}")),
            (Some(b), Some(a)) if a <= b && a + passed + 2 >= b => {
                kept.push(format!(
                    "{name} on {port}, {b} s left -> {a} s after {passed} s"
                ));
            }
            (b, a) => {
                return Err(format!(
                    "{name}: remaining time {b:?} s before, {a:?} s after, {passed} s later"
                ));
            }
        }
    }
    Ok(format!("restored: {}", kept.join("; ")))
}

/// How the entry port met one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Probe {
    /// A short echo went through intact.
    Answered,
    /// The connection was refused: nothing listens on the port.
    Refused,
    /// The connection was accepted and closed before any byte came back: how pod-proxier's
    /// embedded data plane refuses on a port it keeps (the V1 entry port) with no route.
    Closed,
    /// Anything else (a timeout, a reset, bytes lost): proves neither.
    Other(String),
}

impl Probe {
    /// Refused either way: nothing forwards the port.
    fn refusal(&self) -> bool {
        matches!(self, Self::Refused | Self::Closed)
    }
}

/// One probe, its start and end measured from the moment the mapping was requested.
#[derive(Debug, Clone)]
struct Probed {
    started: Duration,
    ended: Duration,
    outcome: Probe,
}

/// A mapping's TTL in the expiry scenario: long enough that a busy machine probes the port
/// before the deadline.
const EXPIRY_TTL: Duration = Duration::from_secs(10);
/// How long after its deadline the entry port must refuse connections: generous, so a busy
/// machine never fails it; the lateness is reported.
const EXPIRY_BOUND: Duration = Duration::from_secs(10);
/// Refusals in a row, and for how long, that prove the port closed (not a blip).
const REFUSALS: usize = 3;
const REFUSED_FOR: Duration = Duration::from_millis(500);

/// Maps `pod` for [`EXPIRY_TTL`] and probes the entry port until it has refused for a while
/// (bounded); returns what [`judge_expiry`] says.
async fn expiry(
    api: SocketAddr,
    entry: SocketAddr,
    token: &str,
    pod: &str,
) -> anyhow::Result<String> {
    let body = json!({ "pod_name": pod, "time": EXPIRY_TTL.as_secs() }).to_string();
    let sent = Instant::now();
    let (status, answer) = http(api, "POST", "/api/v1/mapping", Some(token), Some(&body)).await?;
    let received = sent.elapsed();
    if status != 200 {
        bail!("POST {status}: {answer}");
    }
    let data = &answer["data"];
    let ttl = data["ttl_seconds"].as_u64();
    let remaining = data["remaining_seconds"].as_i64();
    if ttl != Some(EXPIRY_TTL.as_secs())
        || remaining.is_none_or(|r| r < 1 || r > ttl.map_or(0, |t| t.cast_signed()))
        || data["expires_at"].as_str().is_none()
    {
        bail!(
            "the answer does not confirm a {EXPIRY_TTL:?} mapping (ttl_seconds, remaining_seconds, expires_at): {answer}"
        );
    }
    // The server set the deadline to its clock plus the TTL while handling the request.
    let window = (EXPIRY_TTL, received + EXPIRY_TTL);
    let stop_by = window.1 + EXPIRY_BOUND + Duration::from_secs(5);
    let mut probes: Vec<Probed> = Vec::new();
    while sent.elapsed() < stop_by {
        let started = sent.elapsed();
        let outcome = probe(entry).await;
        probes.push(Probed {
            started,
            ended: sent.elapsed(),
            outcome,
        });
        let refused: Vec<&Probed> = probes
            .iter()
            .rev()
            .take_while(|p| p.outcome.refusal())
            .collect();
        if refused.len() >= REFUSALS
            && refused[0]
                .started
                .saturating_sub(refused[refused.len() - 1].started)
                >= REFUSED_FOR
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    judge_expiry(window, &probes).map_err(|e| anyhow::anyhow!("{e}"))
}

/// One connection to `addr`: a 16-byte echo, a refusal (refused, or closed before any byte came
/// back), or something else.
async fn probe(addr: SocketAddr) -> Probe {
    use std::io::ErrorKind;
    let stream =
        match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
            .await
        {
            Err(_) => return Probe::Other("connect timed out after 2 s".to_owned()),
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionRefused => return Probe::Refused,
            Ok(Err(e)) => return Probe::Other(format!("connect: {e}")),
            Ok(Ok(stream)) => stream,
        };
    let data: Vec<u8> = (0..16u8).collect();
    let exchange = async {
        let (mut read, mut write) = stream.into_split();
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            write.write_all(&sent).await?;
            write.shutdown().await
        });
        let mut back = Vec::new();
        let read = read.read_to_end(&mut back).await;
        (read, back, writer.await)
    };
    let closed = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::ConnectionAborted
        )
    };
    match tokio::time::timeout(Duration::from_secs(2), exchange).await {
        Err(_) => Probe::Other("no echo within 2 s".to_owned()),
        Ok((Ok(_), back, Ok(Ok(())))) if back == data => Probe::Answered,
        // Closed before a single byte came back.
        Ok((Ok(_), back, _)) if back.is_empty() => Probe::Closed,
        Ok((Err(e), back, _)) if back.is_empty() && closed(&e) => Probe::Closed,
        Ok((read, back, written)) => Probe::Other(format!(
            "{} of 16 bytes back ({read:?}, write {written:?})",
            back.len()
        )),
    }
}

/// Whether `probes` prove the expiry: the port answered in a probe that ended before the
/// earliest possible deadline (`window.0`), and no probe that ended before it was refused (an
/// early expiry); then it refused, the first refusal no later than [`EXPIRY_BOUND`] after the
/// latest possible deadline (`window.1`), and every later probe was refused ([`REFUSALS`] at
/// least, over [`REFUSED_FOR`]); a refusal is [`Probe::Refused`] or [`Probe::Closed`]. A
/// timeout or a lost byte counts as neither answer nor refusal.
fn judge_expiry(window: (Duration, Duration), probes: &[Probed]) -> Result<String, String> {
    let secs = |d: Duration| format!("{:.2}s", d.as_secs_f64());
    let others: Vec<&Probed> = probes
        .iter()
        .filter(|p| matches!(p.outcome, Probe::Other(_)))
        .collect();
    let others_note = match others.first() {
        Some(Probed {
            started,
            outcome: Probe::Other(why),
            ..
        }) => format!(
            "; {} probes neither answered nor refused (first at {}: {why})",
            others.len(),
            secs(*started)
        ),
        _ => String::new(),
    };
    let last_answer = probes
        .iter()
        .filter(|p| p.outcome == Probe::Answered && p.ended <= window.0)
        .map(|p| p.started)
        .max();
    let Some(last_answer) = last_answer else {
        return Err(format!(
            "the entry port never answered before the deadline ({} to {}){others_note}",
            secs(window.0),
            secs(window.1)
        ));
    };
    if let Some(early) = probes
        .iter()
        .find(|p| p.outcome.refusal() && p.ended < window.0)
    {
        return Err(format!(
            "the entry port refused at {} to {}, before the deadline {}: an early expiry{others_note}",
            secs(early.started),
            secs(early.ended),
            secs(window.0)
        ));
    }
    let Some(first) = probes.iter().position(|p| p.outcome.refusal()) else {
        return Err(format!(
            "the entry port was never refused (deadline {} to {}, probed until {}){others_note}",
            secs(window.0),
            secs(window.1),
            secs(probes.last().map_or(Duration::ZERO, |p| p.ended))
        ));
    };
    let refused_at = probes[first].started;
    if probes[first].ended > window.1 + EXPIRY_BOUND {
        return Err(format!(
            "the entry port first refused at {}, {} after the latest deadline {} (bound {EXPIRY_BOUND:?}){others_note}",
            secs(probes[first].ended),
            secs(probes[first].ended - window.1),
            secs(window.1)
        ));
    }
    let rest = &probes[first..];
    if let Some(p) = rest.iter().find(|p| !p.outcome.refusal()) {
        return Err(format!(
            "refused at {}, then {:?} at {}{others_note}",
            secs(refused_at),
            p.outcome,
            secs(p.started)
        ));
    }
    let span = rest.last().map_or(Duration::ZERO, |p| p.started) - refused_at;
    if rest.len() < REFUSALS || span < REFUSED_FOR {
        return Err(format!(
            "only {} refusals over {} after {} (want {REFUSALS} over {REFUSED_FOR:?}){others_note}",
            rest.len(),
            secs(span),
            secs(refused_at)
        ));
    }
    Ok(format!(
        "deadline {} to {} after the POST; {} answers, the last at {}; refused from {}, {} after the latest deadline ({} refusals over {}: {} refused, {} closed before any byte){others_note}",
        secs(window.0),
        secs(window.1),
        probes
            .iter()
            .filter(|p| p.outcome == Probe::Answered)
            .count(),
        secs(last_answer),
        secs(refused_at),
        secs(refused_at.saturating_sub(window.1)),
        rest.len(),
        secs(span),
        rest.iter().filter(|p| p.outcome == Probe::Refused).count(),
        rest.iter().filter(|p| p.outcome == Probe::Closed).count()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Probes every 100 ms from 0 to `until_ms`: answered before `closes_ms`, refused after.
    fn probes(closes_ms: u64, until_ms: u64) -> Vec<Probed> {
        (0..until_ms / 100)
            .map(|i| Probed {
                started: ms(i * 100),
                ended: ms(i * 100 + 20),
                outcome: if i * 100 < closes_ms {
                    Probe::Answered
                } else {
                    Probe::Refused
                },
            })
            .collect()
    }

    const WINDOW: (Duration, Duration) = (Duration::from_secs(3), Duration::from_millis(3050));

    #[test]
    fn expiry_on_time_passes() {
        let verdict = judge_expiry(WINDOW, &probes(3_200, 4_000));
        assert!(verdict.is_ok(), "{verdict:?}");
    }

    #[test]
    fn no_expiry_fails() {
        let verdict = judge_expiry(WINDOW, &probes(u64::MAX, 9_000));
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("never refused")),
            "{verdict:?}"
        );
    }

    #[test]
    fn a_failed_echo_is_not_a_refusal() {
        // The old check took any failed echo for "closed": here a timeout at 0.5 s, and no
        // expiry at all.
        let mut p = probes(u64::MAX, 9_000);
        p[5].outcome = Probe::Other("connect timed out after 2 s".to_owned());
        let verdict = judge_expiry(WINDOW, &p);
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("never refused") && e.contains("timed out")),
            "{verdict:?}"
        );
    }

    #[test]
    fn refusing_before_the_deadline_fails() {
        let verdict = judge_expiry(WINDOW, &probes(1_000, 4_000));
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("early expiry")),
            "{verdict:?}"
        );
        // A refusal in a probe that started before the deadline and ended after it is not
        // early: the port may have closed at the deadline, within the probe.
        let mut p = probes(3_000, 4_000);
        p[29].ended = ms(3_010);
        p[29].outcome = Probe::Refused;
        let verdict = judge_expiry(WINDOW, &p);
        assert!(verdict.is_ok(), "{verdict:?}");
        // The port that never answered proves nothing either (a wrong port).
        let verdict = judge_expiry(WINDOW, &probes(0, 4_000));
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("never answered")),
            "{verdict:?}"
        );
    }

    #[test]
    fn closed_before_any_byte_is_a_refusal_but_a_partial_echo_is_not() {
        let mut p = probes(3_200, 4_000);
        for probe in p.iter_mut().filter(|p| p.outcome == Probe::Refused) {
            probe.outcome = Probe::Closed;
        }
        let verdict = judge_expiry(WINDOW, &p);
        assert!(verdict.is_ok(), "{verdict:?}");
        for probe in p.iter_mut().filter(|p| p.outcome == Probe::Closed) {
            probe.outcome = Probe::Other("8 of 16 bytes back".to_owned());
        }
        let verdict = judge_expiry(WINDOW, &p);
        assert!(
            verdict.as_ref().is_err_and(|e| e.contains("never refused")),
            "{verdict:?}"
        );
    }

    #[test]
    fn refusing_late_or_flapping_fails() {
        // 10.45 s after the latest deadline: more than the generous bound.
        let verdict = judge_expiry(WINDOW, &probes(13_500, 15_000));
        assert!(
            verdict
                .as_ref()
                .is_err_and(|e| e.contains("after the latest deadline")),
            "{verdict:?}"
        );
        // 1.25 s late passes: a busy machine is not a failure.
        let verdict = judge_expiry(WINDOW, &probes(4_300, 6_000));
        assert!(verdict.is_ok(), "{verdict:?}");
        let mut p = probes(3_200, 4_000);
        p[35].outcome = Probe::Answered;
        assert!(judge_expiry(WINDOW, &p).is_err());
        // One refusal and nothing after it does not prove the port closed.
        assert!(judge_expiry(WINDOW, &probes(3_200, 3_400)).is_err());
    }

    fn listed(name: &str, port: i64, ttl: Option<i64>) -> Listed {
        (name.to_owned(), port, ttl)
    }

    #[test]
    fn restore_requires_each_mapping_by_name_and_port() {
        let expected = [
            ("v1-entry-8849".to_owned(), 8849),
            ("v2-web".to_owned(), 9000),
        ];
        let before = [
            listed("v1-entry-8849", 8849, Some(100)),
            listed("v2-web", 9000, None),
        ];
        let after = [
            listed("v1-entry-8849", 8849, Some(95)),
            listed("v2-web", 9000, None),
        ];
        let verdict = judge_restore(&expected, &before, &after, Duration::from_secs(5));
        assert!(verdict.is_ok(), "{verdict:?}");
        // Nothing restored: the old `all` over an empty list passed here.
        assert!(judge_restore(&expected, &before, &[], Duration::from_secs(5)).is_err());
        assert!(judge_restore(&expected, &[], &[], Duration::from_secs(5)).is_err());
        assert!(judge_restore(&[], &before, &after, Duration::from_secs(5)).is_err());
        // Another port, a TTL started afresh, or one that lost more than the time passed.
        let moved = [
            listed("v1-entry-8849", 8849, Some(95)),
            listed("v2-web", 9001, None),
        ];
        assert!(judge_restore(&expected, &before, &moved, Duration::from_secs(5)).is_err());
        let reset = [
            listed("v1-entry-8849", 8849, Some(120)),
            listed("v2-web", 9000, None),
        ];
        assert!(judge_restore(&expected, &before, &reset, Duration::from_secs(5)).is_err());
        let lost = [
            listed("v1-entry-8849", 8849, Some(50)),
            listed("v2-web", 9000, None),
        ];
        assert!(judge_restore(&expected, &before, &lost, Duration::from_secs(5)).is_err());
    }
}
