//! pod-proxier from its chart as the e2e installs it (auth by the Kubernetes API, its Service as a
//! NodePort): a ServiceAccount that may only port-forward maps a workload Pod (V1), and an HTTP
//! request through the Service's entry port, and through its NodePort, is answered by that Pod.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, PostParams};
use serde_json::json;

use super::{Shown, describe_pods};
use netkit_testenv::e2e::Env;
use netkit_testenv::e2e::pod_proxier::{self, API_PORT, ENTRY_PORT};
use netkit_testenv::e2e::pod_proxier_api;
use netkit_testenv::node::{NODE_IP, check};

/// The workload pod-proxier maps.
const WORKLOAD: &str = "profiled";
/// The container port name pod-proxier maps by default (the chart's `jprofilerPortName`).
const PORT_NAME: &str = "jprofiler-port";
/// The ServiceAccount `pod_proxier::debugger_accounts` allows to `create pods/portforward`.
const DEBUGGER: &str = "debugger";
/// Long enough for a demo session; pod-proxier closes the entry port when it expires.
const MAPPING_SECONDS: u64 = 3600;
/// How long the first request through a fresh mapping may keep failing.
const FIRST_ANSWER_LIMIT: Duration = Duration::from_secs(20);

pub async fn start(env: &Env<'_>) -> anyhow::Result<Shown> {
    let ns = env.restricted_namespace("demo-pod-proxier").await?;
    let work = env.restricted_namespace("demo-apps").await?;
    let client = env.plane.client().await?;
    // The testbox's HTTP port carries the mapped name, so a plain curl shows which Pod answers.
    let mut workload = check::testbox_deployment(WORKLOAD, 1);
    workload["spec"]["template"]["spec"]["containers"][0]["ports"][0]["name"] = json!(PORT_NAME);
    Api::<Deployment>::namespaced(client.clone(), &work)
        .create(&PostParams::default(), &serde_json::from_value(workload)?)
        .await
        .context("creating the workload Deployment")?;
    pod_proxier::debugger_accounts(env, &work).await?;
    pod_proxier::install(env, &ns, &work).await?;
    check::wait_pods_ready(env.plane, &ns, pod_proxier::SELECTOR, 1).await?;
    let (pod, pod_ip) = check::wait_pods_ready(env.plane, &work, &format!("app={WORKLOAD}"), 1)
        .await?
        .remove(0);

    let service: Service = Api::namespaced(client, &ns)
        .get(pod_proxier::RELEASE)
        .await
        .context("reading the pod-proxier Service")?;
    let spec = service
        .spec
        .context("the pod-proxier Service has no spec")?;
    let cluster_ip = spec
        .cluster_ip
        .clone()
        .context("the pod-proxier Service has no ClusterIP")?;
    let node_port = spec
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("entry"))
        .and_then(|p| p.node_port)
        .and_then(|p| u16::try_from(p).ok())
        .context("the entry port of the pod-proxier Service has no nodePort")?;
    let api: SocketAddr = format!("{cluster_ip}:{API_PORT}").parse()?;
    let entry: SocketAddr = format!("{cluster_ip}:{ENTRY_PORT}").parse()?;
    let entry_on_node = SocketAddr::new(NODE_IP.into(), node_port);
    pod_proxier::wait_routed(api).await?;

    let token = netkit_testenv::e2e::token(env, &work, DEBUGGER).await?;
    let request = json!({ "pod_name": format!("{work}/{pod}"), "time": MAPPING_SECONDS });
    let (status, answer) = pod_proxier_api::http(
        api,
        "POST",
        "/api/v1/mapping",
        Some(&token),
        Some(&request.to_string()),
    )
    .await?;
    ensure!(
        status == 200,
        "POST /api/v1/mapping as {work}/{DEBUGGER} answered {status}: {answer}"
    );
    let upstreams = &answer["data"]["upstreams"];
    let through_service = answered_by(entry, &pod).await?;
    let through_node_port = answered_by(entry_on_node, &pod).await?;

    let mut facts = describe_pods(env, &ns, pod_proxier::SELECTOR).await?;
    facts.extend(describe_pods(env, &work, &format!("app={WORKLOAD}")).await?);
    facts.push(format!(
        "Service {ns}/{}: API {api}, entry port {entry}, NodePort {entry_on_node}",
        pod_proxier::RELEASE
    ));
    facts.push(format!(
        "POST /api/v1/mapping as ServiceAccount {work}/{DEBUGGER} (may only create pods/portforward): {status}, {MAPPING_SECONDS} s, upstreams {upstreams}"
    ));
    facts.push(format!(
        "GET http://{entry}/ answered by {pod} ({pod_ip}): {through_service}"
    ));
    facts.push(format!(
        "GET http://{entry_on_node}/ answered by {pod}: {through_node_port}"
    ));
    Ok(Shown {
        name: "pod-proxier",
        facts,
        try_these: vec![
            format!("curl http://{entry}/   # the mapped Pod answers"),
            format!("curl http://{entry_on_node}/   # the same, through the NodePort"),
            format!("TOKEN=$(kubectl -n {work} create token {DEBUGGER})"),
            format!(
                "kubectl -n {ns} get secret {release}-tls -o jsonpath='{{.data.ca\\.crt}}' | base64 -d > ca.crt   # the chart's CA",
                release = pod_proxier::RELEASE
            ),
            format!(
                "curl --cacert ca.crt --connect-to ::{api} -H \"Authorization: Bearer $TOKEN\" https://{release}.{ns}.svc:{port}/api/v1/mappings",
                release = pod_proxier::RELEASE,
                port = api.port()
            ),
            "kubectl get portmappings -A   # the mappings, as pod-proxier stores them".to_owned(),
        ],
    })
}

/// GETs `/` from `addr` until the testbox names `pod` as the one answering (a new mapping and a
/// new NodePort take a moment); returns the answer.
async fn answered_by(addr: SocketAddr, pod: &str) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let answer = check::http_get(addr, "/").await;
        let named = answer.as_ref().ok().and_then(|body| {
            serde_json::from_str::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v["pod"].as_str().map(str::to_owned))
        });
        match (&answer, named) {
            (Ok(body), Some(name)) if name == pod => return Ok(body.trim().to_owned()),
            _ if started.elapsed() > FIRST_ANSWER_LIMIT => {
                bail!(
                    "GET http://{addr}/ was not answered by {pod} within {FIRST_ANSWER_LIMIT:?}: {answer:?}"
                )
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
