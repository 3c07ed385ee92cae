//! Agents roll without loss: an HTTP tunnel with `spec.hostname` and its two agents (one holds
//! the hostname, one stands by), a request through the engine's address of the hostname every
//! `PAUSE` (20 ms), and two rollouts of the agent Deployment as users cause them: a Secret rotation
//! (the config hash rolls it) and a restart annotation on its Pod template (what
//! `kubectl rollout restart` writes; an image change rolls the same way). The kubelet stops each
//! old agent with SIGTERM, so every stop of the holder is a planned hand-over. Fails unless the
//! tunnel's `HandOver` condition ends `HandedOver` and every failed request is one the engine
//! found no holder for: a hostname is held by one tunnel at a time (rstream protocol §9.3), so
//! the milliseconds between the old tunnel's close and the new one's open are the protocol's
//! gap; a request lost anywhere else (an agent, the client library, a relay cut short) fails
//! the scenario. Reports, per rollout, its duration, the failed requests and the time from the
//! first failure to the last (the recovery time).
//!
//! Runs as a release of its own (`rstream-rollout`, scoped to its namespace with
//! `watchNamespace`) after the rstream-operator chart's run, with the CRDs that run kept; the
//! engine is a LocalEngine in this process on the host's end of the node link.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use rstream_client::engine::LocalEngine;
use rstream_operator::api::RstreamTunnel;
use serde_json::json;

use super::{ChartReport, Env, RestartWatch};
use crate::node::check;

/// The release; its chart is rstream-operator's.
pub const RELEASE: &str = "rstream-rollout";
const CHART: &str = super::rstream_operator::RELEASE;
const SELECTOR: &str = "app.kubernetes.io/instance=rstream-rollout";
/// The tunnel and its hostname.
const TUNNEL: &str = "web";
const HOSTNAME: &str = "web.rollout.e2e.test";
/// The pause between two requests of the steady stream.
const PAUSE: Duration = Duration::from_millis(20);
/// How long one rollout may take (two agents, each new one ready before an old one goes).
const ROLLOUT_LIMIT: Duration = Duration::from_secs(180);

/// The scenario's name.
pub const AGENTS_ROLL: &str = "agents roll with a planned hand-over: a tunnel with a hostname and 2 agents (one rstream_agent_active 1), a request through the engine's hostname address every 20 ms, the agents rolled twice (Secret rotation, restart annotation): HandOver ends HandedOver, and a failed request is only one the engine found no holder for in the gap between two tunnels (failed requests and recovery time reported)";

/// Every scenario this run records.
pub fn expected_scenarios() -> Vec<String> {
    vec![AGENTS_ROLL.to_owned()]
}

/// Installs the release, runs the scenario, uninstalls.
pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new(RELEASE);
    let outcome = scenario(env, &mut report).await;
    super::finish_chart(report, outcome, None).await
}

async fn scenario(env: &Env<'_>, report: &mut ChartReport) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("rollout").await?;
    report.namespace = ns.clone();
    let watch = RestartWatch::start(env.plane, &[&ns]).await?;
    let started = Instant::now();
    install(env, &ns).await?;
    check::wait_pods_ready(env.plane, &ns, SELECTOR, 1).await?;
    report.install_to_ready_ms = Some(started.elapsed().as_millis());

    let started = Instant::now();
    let outcome = agents_roll(env, &ns).await;
    report.record(
        AGENTS_ROLL,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
    report.restarts = watch.finish().await?;
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
    Ok(())
}

/// The chart, scoped to `ns`; its CRDs only when no earlier release left them.
async fn install(env: &Env<'_>, ns: &str) -> anyhow::Result<()> {
    let (repository, tag) = env.image(CHART)?;
    let crds: Api<CustomResourceDefinition> = Api::all(env.plane.client().await?);
    let present = crds
        .get_opt("rstreamtunnels.tunnels.rstream.io")
        .await?
        .is_some();
    let (chart, version) = env.chart(CHART)?;
    let values = format!(
        "image.repository={repository},image.tag={tag},metrics.secure=false,watchNamespace={ns},crds.install={}",
        !present
    );
    env.helm(&[
        "install",
        RELEASE,
        &chart,
        "--version",
        &version,
        "-n",
        ns,
        "--set",
        &values,
    ])
    .await?;
    Ok(())
}

/// What the steady stream saw.
#[derive(Default)]
struct Seen {
    sent: u32,
    /// When each failed request was sent, and what it got.
    failures: Vec<(Instant, String)>,
}

/// `GET /` through `addr` every [`PAUSE`] until `stop`; a request succeeds when the workload
/// Pod answers.
fn steady_stream(addr: SocketAddr, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen::default();
        while !stop.load(Ordering::SeqCst) {
            seen.sent += 1;
            let at = Instant::now();
            match check::http_get(addr, "/").await {
                Ok(body) if body.contains("\"pod\":\"web-") => {}
                Ok(body) => seen.failures.push((at, format!("unexpected body: {body}"))),
                Err(e) => seen.failures.push((at, e)),
            }
            tokio::time::sleep(PAUSE).await;
        }
        seen
    })
}

/// The `rstream_agent_active` values of `tunnel`'s agents by Pod (Running Pods with an IP only).
pub(super) async fn active_agents(
    client: &kube::Client,
    ns: &str,
    tunnel: &str,
) -> anyhow::Result<Vec<(String, i64)>> {
    let (_, pods) = super::rstream_operator::agent_pods(client, ns, tunnel).await?;
    let port = u16::try_from(rstream_operator::manager::children::HEALTH_PORT)?;
    let mut out = Vec::new();
    for pod in pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let Some(ip) = pod
            .status
            .and_then(|s| s.pod_ip)
            .and_then(|ip| ip.parse().ok())
        else {
            continue;
        };
        let scraped = super::Scrape::Open(SocketAddr::new(ip, port))
            .metrics()
            .await;
        let value = scraped.ok().and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("rstream_agent_active{"))
                .and_then(|l| l.split_whitespace().last())
                .and_then(|v| v.parse().ok())
        });
        if let Some(value) = value {
            out.push((name, value));
        }
    }
    Ok(out)
}

/// Waits until two agents answer and exactly one holds the tunnel; returns its Pod.
async fn one_holder(client: &kube::Client, ns: &str) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let agents = active_agents(client, ns, TUNNEL).await?;
        let holders: Vec<_> = agents.iter().filter(|(_, v)| *v == 1).collect();
        if agents.len() == 2 && holders.len() == 1 {
            return Ok(holders[0].0.clone());
        }
        if started.elapsed() > ROLLOUT_LIMIT {
            bail!("not two agents with one holder within {ROLLOUT_LIMIT:?}: {agents:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until Deployment `name` has rolled past `generation`: observed, every replica updated
/// and available, no old one left.
async fn rolled(
    deployments: &Api<Deployment>,
    name: &str,
    generation: i64,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    loop {
        let d = deployments.get(name).await?;
        let wanted = d.spec.replicas.unwrap_or(1);
        let current = d.metadata.generation.unwrap_or_default();
        let done = d.status.as_ref().is_some_and(|s| {
            current > generation
                && s.observed_generation.unwrap_or_default() >= current
                && s.updated_replicas == Some(wanted)
                && s.available_replicas == Some(wanted)
                && s.replicas == Some(wanted)
        });
        if done {
            return Ok(started.elapsed());
        }
        if started.elapsed() > ROLLOUT_LIMIT {
            bail!(
                "{name} did not roll within {ROLLOUT_LIMIT:?}: generation {current} (before {generation}), status {:?}",
                d.status
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn agents_roll(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    let client = env.plane.client().await?;
    let engine: LocalEngine = super::rstream_operator::start_engine(None).await?;
    let mut spec = super::rstream_operator::http_tunnel_spec();
    spec["hostname"] = json!(HOSTNAME);
    super::rstream_operator::quick_start(&client, ns, &engine, &[(TUNNEL, spec)]).await?;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(client.clone(), ns);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let web = super::rstream_operator::http_tunnel(env, &engine, ns, TUNNEL).await?;
    if !web.passed() {
        bail!("the tunnel does not carry traffic: {}", web.describe());
    }
    let agent = web.agent_deployment.clone();
    let replicas = deployments.get(&agent).await?.spec.replicas;
    if replicas != Some(2) {
        bail!("the agent Deployment runs {replicas:?} replicas, not 2");
    }
    let first_holder = one_holder(&client, ns).await?;
    let public = engine
        .hostname_ingress_addr(HOSTNAME)
        .context("the engine has no address for the hostname")?;
    let misses_before = engine.hostname_misses();

    let stop = Arc::new(AtomicBool::new(false));
    let stream = steady_stream(public, stop.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;
    // (what rolled, when it started, how long it took, the holder after it)
    let mut rollouts: Vec<(&str, Instant, Duration, String)> = Vec::new();

    let generation = deployments
        .get(&agent)
        .await?
        .metadata
        .generation
        .unwrap_or_default();
    let at = Instant::now();
    secrets
        .patch(
            "rstream-credentials",
            &PatchParams::default(),
            &Patch::Merge(json!({ "stringData": { "token": "e2e-rollout-token-2" } })),
        )
        .await?;
    let took = rolled(&deployments, &agent, generation).await?;
    let holder = one_holder(&client, ns).await?;
    rollouts.push(("Secret rotation", at, took, holder));
    tokio::time::sleep(Duration::from_secs(2)).await;

    let generation = deployments
        .get(&agent)
        .await?
        .metadata
        .generation
        .unwrap_or_default();
    let at = Instant::now();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    // What `kubectl rollout restart` writes; a field the operator does not apply, so it stays.
    deployments
        .patch(
            &agent,
            &PatchParams::default(),
            &Patch::Merge(
                json!({ "spec": { "template": { "metadata": { "annotations": {
                    "kubectl.kubernetes.io/restartedAt": format!("e2e-{now}"),
                }}}}}),
            ),
        )
        .await?;
    let took = rolled(&deployments, &agent, generation).await?;
    let holder = one_holder(&client, ns).await?;
    rollouts.push(("restart annotation", at, took, holder));
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    let seen = stream.await?;
    let misses = engine.hostname_misses() - misses_before;

    let t = tunnels.get(TUNNEL).await?;
    let hand_over_condition = t
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "HandOver");
    let handed_over = hand_over_condition
        .as_ref()
        .is_some_and(|c| c.reason == "HandedOver");
    let hand_over = hand_over_condition
        .map(|c| format!("{} {}: {}", c.status, c.reason, c.message))
        .unwrap_or_else(|| "no HandOver condition".to_owned());
    let mut lines = Vec::new();
    for (i, (what, at, took, holder)) in rollouts.iter().enumerate() {
        let until = rollouts.get(i + 1).map(|r| r.1);
        let failed: Vec<_> = (seen.failures.iter())
            .filter(|(f, _)| f >= at && until.is_none_or(|u| *f < u))
            .collect();
        let recovery = match (failed.first(), failed.last()) {
            (Some((first, _)), Some((last, _))) => format!("{:?}", *last - *first + PAUSE),
            _ => "none needed".to_owned(),
        };
        lines.push(format!(
            "{what}: rolled in {took:.1?}, holder then {holder}, {} failed (recovery {recovery}){}",
            failed.len(),
            failed
                .first()
                .map(|(_, e)| format!(", first: {e}"))
                .unwrap_or_default()
        ));
    }
    let detail = format!(
        "first holder {first_holder}; {}; {} of {} requests failed; the engine found no holder for {misses}; {hand_over}",
        lines.join("; "),
        seen.failures.len(),
        seen.sent
    );
    engine.shutdown().await;
    if !handed_over {
        bail!("the last hand-over did not end HandedOver: {detail}");
    }
    let failed = u64::try_from(seen.failures.len()).unwrap_or(u64::MAX);
    if failed > misses {
        bail!("{failed} requests failed but the engine had no holder for only {misses}: {detail}");
    }
    Ok(detail)
}
