//! The scenarios run after a `helm upgrade`: V2 to a Service's ClusterIP, and the HAProxy backend.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::e2e::Env;
use crate::e2e::pod_proxier_api::http;
use crate::node::check;

use super::access::echo_until;
use super::{API_PORT, ENTRY_PORT, RELEASE, SELECTOR};

/// `helm upgrade --reuse-values` to `podProxier.backend=haproxy` (V2 back to its endpoints
/// target) with the image [`crate::node_images::haproxy_image`] built; requires the new Pod to
/// run pod-proxier with `--backend=haproxy` and a Ready `haproxy` container, then a new V1
/// mapping of the profiled Pod and the V2 mapping of [`CLUSTER_IP_SERVICE`] each to echo 64 KiB
/// intact through the chart's Service (the entry ports are HAProxy's listeners now), and no
/// container of that Pod restarted. Ok is the detail.
pub(super) async fn haproxy_backend(
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

/// The Service of the cluster-ip scenario: the `web` Pods' echo port as a `debug` port.
const CLUSTER_IP_SERVICE: &str = "echo-by-ip";
/// Its port, which is not the Pods' (9000): only the Service's rules map one to the other.
const CLUSTER_IP_PORT: u16 = 7000;

/// `helm upgrade --reuse-values` with `podProxier.v2Target=cluster-ip`, waits for the
/// replacement Pod to run with `--v2-target cluster-ip`, creates [`CLUSTER_IP_SERVICE`] and
/// requires its V2 mapping's upstreams to be exactly its ClusterIP and port, then 64 KiB through
/// the mapping's entry port on the chart's Service and back intact. Ok is the detail.
pub(super) async fn cluster_ip_target(
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
