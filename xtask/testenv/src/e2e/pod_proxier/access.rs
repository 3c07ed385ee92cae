//! Who may use what: /metrics by RBAC, and a V1 mapping's entry port bound to its requester's address.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use crate::e2e::pod_proxier_api::tcp_echo;
use crate::e2e::{Env, token};
use crate::node::check;

use super::{HEALTH_PORT, METRICS_PORT, RELEASE, SELECTOR};

/// The ServiceAccount (in the chart's namespace) bound to the chart's metrics-reader role.
pub(super) const SCRAPER: &str = "scraper";
/// The [`METRICS_ACCESS`] scenario on the Pod at `ip`: `/metrics` over HTTPS refuses no token
/// (401) and `denied`'s (403), then answers a [`SCRAPER`] bound to `<release>-metrics-reader`
/// (200, waited for while RBAC settles); `/readyz` answers over plain HTTP without a token.
pub(super) async fn metrics_access(
    env: &Env<'_>,
    ns: &str,
    ip: &str,
    denied: &str,
) -> anyhow::Result<String> {
    let metrics: SocketAddr = format!("{ip}:{METRICS_PORT}").parse()?;
    let (anonymous, body) = crate::e2e::https_get(metrics, "/metrics", None).await?;
    if anonymous != 401 {
        bail!("no token: {anonymous} {}", body.trim());
    }
    let (forbidden, body) = crate::e2e::https_get(metrics, "/metrics", Some(denied)).await?;
    if forbidden != 403 {
        bail!(
            "a ServiceAccount without the role: {forbidden} {}",
            body.trim()
        );
    }
    crate::e2e::bind_metrics_reader(env, ns, SCRAPER, &format!("{RELEASE}-metrics-reader")).await?;
    let scraper = token(env, ns, SCRAPER).await?;
    let bound = Instant::now();
    let families = loop {
        let (status, body) = crate::e2e::https_get(metrics, "/metrics", Some(&scraper)).await?;
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
        let text = match crate::e2e::https_get(metrics, "/metrics", Some(token)).await {
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
pub(super) async fn other_source_refused(
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
pub(super) async fn echo_until(
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
