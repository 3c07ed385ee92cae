//! V2 mappings: a Service's ports reaching its Pods, and a Terminating Pod getting no connection.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::{Value, json};

use crate::e2e::Env;
use crate::e2e::pod_proxier_api::http;
use crate::node::check;

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
pub(super) async fn v2_port(
    api: SocketAddr,
    token: &str,
    ns: &str,
) -> anyhow::Result<(String, i64)> {
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
pub(super) fn web_deployment() -> Value {
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
pub(super) async fn deleted_pod_gets_nothing(
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
