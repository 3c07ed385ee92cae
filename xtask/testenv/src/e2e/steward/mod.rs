//! steward-tcp-proxy on the node: the chart with its defaults (2 replicas, leader election), the
//! `default/kubernetes` endpoints it writes, an in-cluster client through it, both endpoint
//! modes, leader failover with a repair, and a rolling upgrade under load.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::bail;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

use super::partition::STEWARD_CUT;
use super::{ChartReport, Env, RestartWatch};
use crate::node::KUBERNETES_SERVICE_IP;

mod clients;
mod cluster_ip;
mod partitioned;
mod release;
mod rolling;

pub use clients::service_client;
use clients::{in_cluster_client, rbac_for_lister, summary, tcp_connect};
use cluster_ip::{ClusterIpRun, cluster_ip_verdict, kubernetes_nat_rules};
use partitioned::partition;
pub use release::{Published, Release, SCRAPER};
use rolling::rolling_upgrade;

/// The chart's release name in the e2e.
pub const RELEASE: &str = "steward-tcp-proxy";
/// The label selector of the chart's Pods.
pub const SELECTOR: &str = "app.kubernetes.io/name=steward-tcp-proxy";
const LISTEN_PORT: u16 = 6443;
/// The chart's default `healthPort` (`/healthz`, `/readyz`).
const HEALTH_PORT: u16 = 8080;
/// The chart's `metricsPort` (HTTPS with a token: `metricsSecure` is on by default).
pub const METRICS_PORT: u16 = 9090;

const PUBLISHES: &str = "chart defaults: default/kubernetes points at the ready steward Pods (pod-ip) once the leader can publish";
const IN_CLUSTER_CLIENT: &str = "in-cluster client (KUBERNETES_SERVICE_HOST) lists namespaces and holds a 4 s watch through steward; steward's metrics count it";
const CLUSTER_IP_MODE: &str = "endpointMode=cluster-ip: steward publishes its ClusterIP, and kube-proxy does not route a ClusterIP used as an endpoint (as steward's README says): no client through kubernetes.default reaches steward";
const POD_IP_AGAIN: &str =
    "endpointMode=pod-ip (chart default) again: a Pod's client through kubernetes.default";
const LEADER_DELETED: &str =
    "leader Pod deleted: the other replica takes over and repairs a manual EndpointSlice edit";
const ROLLING_UPGRADE: &str = "helm upgrade rolls both Pods while a client GETs every 50 ms and holds a watch (through 10.96.0.1:443)";
/// The chart's replicas (its default), each of whose `/metrics` is checked.
const REPLICAS: usize = 2;

fn metrics_scenario(replica: usize) -> String {
    format!(
        "steward replica {replica} of {REPLICAS}: /metrics has process_*, its build info and leader election's family"
    )
}

/// Every scenario a whole run of this chart records, in order: `cargo xtask e2e` fails a run
/// that misses one or records one not listed here.
pub fn expected_scenarios() -> Vec<String> {
    let mut names: Vec<String> = [PUBLISHES, IN_CLUSTER_CLIENT].map(str::to_owned).into();
    names.extend((1..=REPLICAS).map(metrics_scenario));
    names.extend(
        [
            CLUSTER_IP_MODE,
            POD_IP_AGAIN,
            LEADER_DELETED,
            ROLLING_UPGRADE,
            STEWARD_CUT,
            super::HELM_TEST_SCENARIO,
        ]
        .map(str::to_owned),
    );
    names
}

/// Installs the chart and runs its scenarios.
pub async fn run(env: &Env<'_>) -> ChartReport {
    let mut report = ChartReport::new("steward-tcp-proxy");
    let mut watch = None;
    let outcome = scenarios(env, &mut report, &mut watch).await;
    super::finish_chart(report, outcome, watch).await
}

async fn scenarios(
    env: &Env<'_>,
    report: &mut ChartReport,
    watch: &mut Option<RestartWatch>,
) -> anyhow::Result<()> {
    let ns = env.restricted_namespace("steward").await?;
    report.namespace = ns.clone();
    *watch = Some(RestartWatch::start(env.plane, &[&ns]).await?);
    let client = env.plane.client().await?;
    let cluster = Release::new(env, &ns).await?;

    // 1. Install with the chart's defaults; the leader's first write is timed against the moment
    //    the Lease names it and the moment its first Pod is Ready. The time is reported, not
    //    bounded (a busy machine stretches it; `cargo xtask bench steward` holds the goal): the
    //    check is that the state is reached within a generous deadline.
    let started = Instant::now();
    let installed = install(env, &ns).await?;
    let mut leader_seen: Option<(Instant, String)> = None;
    let mut first_ready: Option<Instant> = None;
    let mut correct: Option<Instant> = None;
    let mut all_ready: Option<Instant> = None;
    let limit = Duration::from_secs(180);
    let publish_limit = Duration::from_secs(30);
    // Until both Pods are Ready and the endpoints are correct, or the leader has had
    // `publish_limit` to publish since it could.
    let waiting = |all_ready: Option<Instant>,
                   correct: Option<Instant>,
                   leader_seen: &Option<(Instant, String)>,
                   first_ready: Option<Instant>| {
        let could_publish = leader_seen
            .as_ref()
            .zip(first_ready)
            .map(|((leader_at, _), first_ready)| (*leader_at).max(first_ready));
        all_ready.is_none()
            || (correct.is_none() && could_publish.is_none_or(|at| at.elapsed() < publish_limit))
    };
    while started.elapsed() < limit && waiting(all_ready, correct, &leader_seen, first_ready) {
        let now = Instant::now();
        if leader_seen.is_none()
            && let (Some(holder), _) = cluster.lease().await?
        {
            leader_seen = Some((now, holder));
        }
        let ready = cluster.ready_pods().await?;
        if first_ready.is_none() && !ready.is_empty() {
            first_ready = Some(now);
        }
        if all_ready.is_none() && ready.len() == 2 {
            all_ready = Some(now);
        }
        let published = cluster.published().await?;
        if correct.is_none() && published.both_equal(&cluster.expected("pod-ip").await?) {
            correct = Some(now);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let Some(all_ready) = all_ready else {
        bail!("the two steward Pods were not Ready within {limit:?}");
    };
    report.install_to_ready_ms = Some(all_ready.duration_since(started).as_millis());
    let Some((leader_at, leader)) = leader_seen else {
        bail!("no leader in the Lease within {limit:?}");
    };
    let Some(first_ready) = first_ready else {
        bail!("no steward Pod Ready within {limit:?}");
    };
    // In pod-ip mode the leader can only publish Pods that are Ready, so the clock starts at
    // the later of the two.
    let start = leader_at.max(first_ready);
    let after = correct.map(|c| c.saturating_duration_since(start));
    let published = cluster.published().await?;
    let want = cluster.expected("pod-ip").await?;
    report.record(
        PUBLISHES,
        after.is_some_and(|after| after <= publish_limit),
        started,
        format!(
            "leader {leader} seen at +{:.2}s, first Pod Ready at +{:.2}s, Endpoints and EndpointSlice {}; now {} (the ready Pods: {})",
            leader_at.duration_since(started).as_secs_f64(),
            first_ready.duration_since(started).as_secs_f64(),
            match (correct, after) {
                (Some(correct), Some(after)) => format!(
                    "correct at +{:.2}s ({} ms after the leader could publish)",
                    correct.duration_since(started).as_secs_f64(),
                    after.as_millis()
                ),
                _ => format!("NOT correct within {publish_limit:?} of the leader being able to publish"),
            },
            published.describe(),
            want.iter()
                .map(|(ip, port)| format!("{ip}:{port}"))
                .collect::<Vec<_>>()
                .join(","),
        ),
    );
    let settle = cluster
        .wait_published("pod-ip", Duration::from_secs(30))
        .await;
    if let Err(err) = settle {
        bail!("after both Pods were Ready: {err:#}");
    }

    // 2. An in-cluster client lists and watches through steward; steward's metrics count it.
    rbac_for_lister(env, &ns).await?;
    let started = Instant::now();
    let routed = cluster.wait_routed_through_steward().await;
    let before = cluster.metric_sum("proxy_connections_total").await?;
    let bytes_before = cluster.metric_sum("proxy_bytes_total").await?;
    let outcome = in_cluster_client(env, &ns, "lister-pod-ip", 4, Duration::from_secs(60)).await;
    let after_conns = cluster.metric_sum("proxy_connections_total").await?;
    let bytes_after = cluster.metric_sum("proxy_bytes_total").await?;
    let ok = outcome.as_ref().is_ok_and(|l| l.contains("kube result=ok"))
        && after_conns > before
        && bytes_after > bytes_before;
    let routed = match routed {
        Ok(took) => format!(
            "kube-proxy routed 10.96.0.1:443 to steward {:.2}s after the endpoints were written",
            took.as_secs_f64()
        ),
        Err(err) => format!("{err:#}"),
    };
    report.record(
        IN_CLUSTER_CLIENT,
        ok,
        started,
        format!(
            "{routed}; testbox: {}; steward proxy_connections_total {before} -> {after_conns}, proxy_bytes_total {bytes_before} -> {bytes_after}",
            summary(&outcome)
        ),
    );

    // Every replica's /metrics, leader and follower, under the names dashboards use. The relay's
    // families show only on a replica that relayed (a labelled family has no series before its
    // first connection); the sums above already read them by name.
    for (replica, (_, ip)) in cluster.ready_pods().await?.into_iter().enumerate() {
        super::record_metric_names(
            report,
            &metrics_scenario(replica + 1),
            &cluster.scrape(&ip)?,
            "steward-tcp-proxy",
            &["leader_election_master_status"],
        )
        .await;
    }

    // 3. The other endpoint mode: does kube-proxy route a ClusterIP used as an endpoint?
    let started = Instant::now();
    env.upgrade_reusing(RELEASE, &ns, &[("--set", "endpointMode=cluster-ip")], false)
        .await?;
    cluster.wait_rolled_out(Duration::from_secs(150)).await?;
    let took = cluster
        .wait_published("cluster-ip", Duration::from_secs(30))
        .await;
    let published = cluster.published().await?;
    // Any connection that reaches steward while its ClusterIP is the endpoint shows here.
    let conns_before = cluster.metric_sum("proxy_connections_total").await?;
    let outcome =
        in_cluster_client(env, &ns, "lister-cluster-ip", 0, Duration::from_secs(20)).await;
    let host_tcp = tcp_connect(SocketAddr::new(KUBERNETES_SERVICE_IP.into(), 443)).await;
    let conns_after = cluster.metric_sum("proxy_connections_total").await?;
    let verdict = cluster_ip_verdict(&ClusterIpRun {
        published: took.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")),
        client: outcome
            .as_ref()
            .map(String::clone)
            .map_err(|e| format!("{e:#}")),
        host_tcp: host_tcp.clone(),
        conns: (conns_before, conns_after),
    });
    report.record(
        CLUSTER_IP_MODE,
        verdict.is_ok(),
        started,
        format!(
            "{}; {}; in-cluster client: {}; TCP connect from the host to {KUBERNETES_SERVICE_IP}:443: {host_tcp}; steward proxy_connections_total {conns_before} -> {conns_after}",
            verdict.unwrap_or_else(|e| e),
            published.describe(),
            summary(&outcome),
        ),
    );
    let started = Instant::now();
    env.upgrade_reusing(RELEASE, &ns, &[("--set", "endpointMode=pod-ip")], false)
        .await?;
    cluster.wait_rolled_out(Duration::from_secs(150)).await?;
    cluster
        .wait_published("pod-ip", Duration::from_secs(30))
        .await?;
    // kube-proxy applies the slice on its own schedule; a Job started before that would meet the
    // rules of the ClusterIP mode (unroutable), so wait for routing as scenario 2 does.
    let routed = cluster.wait_routed_through_steward().await;
    let outcome =
        in_cluster_client(env, &ns, "lister-pod-ip-again", 0, Duration::from_secs(60)).await;
    let routed = match routed {
        Ok(took) => format!(
            "kube-proxy routed 10.96.0.1:443 to steward {:.2}s after the endpoints were written",
            took.as_secs_f64()
        ),
        Err(err) => format!("{err:#}; kube-proxy's rules: {}", kubernetes_nat_rules()),
    };
    report.record(
        POD_IP_AGAIN,
        outcome.as_ref().is_ok_and(|l| l.contains("kube result=ok")),
        started,
        format!(
            "{}; {routed}; in-cluster client: {}",
            cluster.published().await?.describe(),
            summary(&outcome)
        ),
    );

    // 4. Delete the leader Pod; once the other replica holds the Lease, edit the slice by
    //    hand: the new leader repairs it (the time is reported; the bench holds the goal). (Edited before the
    //    takeover, the old leader may still repair it during its shutdown delay, legitimately,
    //    as it still holds the Lease: that would not show the takeover.)
    let started = Instant::now();
    let (Some(old_leader), duration) = cluster.lease().await? else {
        bail!("no leader in the Lease");
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    pods.delete(&old_leader, &DeleteParams::default()).await?;
    let limit = Duration::from_secs(u64::try_from(duration.max(1)).unwrap_or(15) + 30);
    let mut takeover: Option<(Duration, String)> = None;
    while started.elapsed() < limit && takeover.is_none() {
        if let (Some(holder), _) = cluster.lease().await?
            && holder != old_leader
        {
            takeover = Some((started.elapsed(), holder));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The edit waits until the Deployment has replaced the deleted Pod and the new leader has
    // published the ready Pods: a repair seen below then answers the edit, not a reconcile the
    // Pod change caused anyway.
    if takeover.is_some() {
        cluster.wait_rolled_out(Duration::from_secs(120)).await?;
        cluster
            .wait_published("pod-ip", Duration::from_secs(30))
            .await?;
    }
    let bogus = "10.244.0.250";
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(&json!({ "endpoints": [{ "addresses": [bogus], "conditions": { "ready": true } }] })),
        )
        .await?;
    let edited = Instant::now();
    // (when, the Lease holder then, what was published): repaired means equal to the ready
    // steward Pods again, not merely rid of the bogus address.
    let mut repaired: Option<(Duration, Option<String>, String)> = None;
    while takeover.is_some() && edited.elapsed() < limit && repaired.is_none() {
        let (holder, _) = cluster.lease().await?;
        let published = cluster.published().await?;
        let want = cluster.expected("pod-ip").await?;
        if published.both_equal(&want) && !published.slices.iter().any(|(ip, _)| ip == bogus) {
            repaired = Some((edited.elapsed(), holder, published.describe()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let new_leader = takeover.as_ref().map(|(_, h)| h.clone());
    // The repair is the new leader's: it held the Lease when the repair was seen.
    let by_new_leader = repaired
        .as_ref()
        .is_some_and(|(_, holder, _)| holder.is_some() && *holder == new_leader);
    let ok = takeover.is_some() && by_new_leader && repaired.is_some();
    report.record(
        LEADER_DELETED,
        ok,
        started,
        format!(
            "lease duration {duration} s; old leader {old_leader}; new leader {}; manual edit repaired after {}",
            takeover
                .as_ref()
                .map(|(t, h)| format!("{h} at +{:.2}s", t.as_secs_f64()))
                .unwrap_or_else(|| "none".to_owned()),
            repaired
                .as_ref()
                .map(|(r, holder, now)| format!(
                    "{:.2}s, the Lease then held by {}; now {now}",
                    r.as_secs_f64(),
                    holder.as_deref().unwrap_or("nobody")
                ))
                .unwrap_or_else(|| "never".to_owned()),
        ),
    );
    cluster.wait_rolled_out(Duration::from_secs(120)).await?;
    cluster
        .wait_published("pod-ip", Duration::from_secs(30))
        .await?;

    // 5. helm upgrade rolls both Pods while a client GETs every 50 ms and holds a watch, both
    //    through kubernetes.default (kube-proxy, then steward).
    let started = Instant::now();
    let outcome = rolling_upgrade(env, &cluster).await?;
    report.record(
        ROLLING_UPGRADE,
        outcome.failed == 0 && outcome.watch_saw_probe,
        started,
        outcome.describe(),
    );

    // 6. The node cut off from the API server for 30 s; steward converges when it returns.
    partition(env, report, &cluster).await;

    // 7. The chart as users meet it: NOTES.txt says what to check next; `helm test` passes.
    //    It runs once the release serves again, as a user would run it: right after the cut,
    //    /readyz still reports the upstream check that failed during it.
    cluster.wait_serving(Duration::from_secs(60)).await?;
    super::helm_test_scenario(env, report, RELEASE, &ns, &installed, "/readyz").await;
    Ok(())
}

/// `helm install` of the chart with its defaults (2 replicas, leader election, `pod-ip` mode),
/// the release image, and the API server as Pods reach it for upstream; returns helm's output.
pub async fn install(env: &Env<'_>, ns: &str) -> anyhow::Result<String> {
    install_with(env, ns, &[]).await
}

/// [`install`] with more `--set` values (`extra`).
pub async fn install_with(env: &Env<'_>, ns: &str, extra: &[String]) -> anyhow::Result<String> {
    let (repository, tag) = env.image("steward-tcp-proxy")?;
    let mut values = vec![
        format!("upstreamAddr={}", env.apiserver),
        format!("image.repository={repository},image.tag={tag}"),
    ];
    values.extend_from_slice(extra);
    env.install_chart(RELEASE, ns, &values).await
}
