//! steward-tcp-proxy on the node: the chart with its defaults (2 replicas, leader election), the
//! `default/kubernetes` endpoints it writes, an in-cluster client through it, both endpoint
//! modes, leader failover with a repair, and a rolling upgrade under load.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::WatchParams;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent};
use serde_json::json;

use super::partition::{CONVERGE_LIMIT, CUT, PROBE_EVERY, STEWARD_CUT};
use super::{ChartReport, Env, RestartWatch, url_port};
use crate::node::{self, KUBERNETES_SERVICE_IP, TESTBOX_IMAGE, check};

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

/// What `default/kubernetes` says: the Endpoints' and the slices' (ip, port) sets.
#[derive(Debug, Default, PartialEq, Eq, Clone)]
pub struct Published {
    endpoints: BTreeSet<(String, i32)>,
    slices: BTreeSet<(String, i32)>,
}

impl Published {
    fn both_equal(&self, want: &BTreeSet<(String, i32)>) -> bool {
        !want.is_empty() && &self.endpoints == want && &self.slices == want
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        let show = |set: &BTreeSet<(String, i32)>| {
            set.iter()
                .map(|(ip, port)| format!("{ip}:{port}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "Endpoints [{}], EndpointSlice [{}]",
            show(&self.endpoints),
            show(&self.slices)
        )
    }
}

/// The chart installed in `ns`, and what it publishes.
pub struct Release {
    /// An admin client.
    pub client: kube::Client,
    /// The release's namespace.
    pub ns: String,
    /// A token of [`SCRAPER`], who may read the secure `/metrics`.
    pub scraper: String,
}

/// The ServiceAccount (in the release's namespace) bound to the chart's metrics-reader role.
pub const SCRAPER: &str = "scraper";

impl Release {
    /// The release in `ns`, with a [`SCRAPER`] bound to the chart's metrics-reader ClusterRole
    /// (the binding may precede the install that creates the role).
    pub async fn new(env: &Env<'_>, ns: &str) -> anyhow::Result<Self> {
        super::bind_metrics_reader(env, ns, SCRAPER, &format!("{RELEASE}-metrics-reader")).await?;
        Ok(Self {
            client: env.plane.client().await?,
            ns: ns.to_owned(),
            scraper: super::token(env, ns, SCRAPER).await?,
        })
    }

    /// How [`SCRAPER`] reads the `/metrics` of the Pod at `ip`.
    pub fn scrape(&self, ip: &str) -> anyhow::Result<super::Scrape> {
        Ok(super::Scrape::Secure {
            addr: format!("{ip}:{METRICS_PORT}").parse()?,
            token: self.scraper.clone(),
        })
    }

    /// What `default/kubernetes` publishes now (Endpoints and EndpointSlice).
    pub async fn published(&self) -> anyhow::Result<Published> {
        let endpoints: Api<Endpoints> = Api::namespaced(self.client.clone(), "default");
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), "default");
        let mut out = Published::default();
        if let Some(e) = endpoints.get_opt("kubernetes").await? {
            for subset in e.subsets.unwrap_or_default() {
                let ports: Vec<i32> = subset
                    .ports
                    .unwrap_or_default()
                    .iter()
                    .map(|p| p.port)
                    .collect();
                for address in subset.addresses.unwrap_or_default() {
                    for port in &ports {
                        out.endpoints.insert((address.ip.clone(), *port));
                    }
                }
            }
        }
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
            .await?;
        for slice in list {
            let ports: Vec<i32> = slice
                .ports
                .unwrap_or_default()
                .iter()
                .filter_map(|p| p.port)
                .collect();
            for endpoint in slice.endpoints.unwrap_or_default() {
                if endpoint
                    .conditions
                    .as_ref()
                    .and_then(|c| c.ready)
                    .is_some_and(|r| !r)
                {
                    continue;
                }
                for address in endpoint.addresses {
                    for port in &ports {
                        out.slices.insert((address.clone(), *port));
                    }
                }
            }
        }
        Ok(out)
    }

    /// (name, IP) of the steward Pods kubelet reports Ready and not being deleted.
    pub async fn ready_pods(&self) -> anyhow::Result<Vec<(String, String)>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        Ok(pods
            .list(&ListParams::default().labels(SELECTOR))
            .await?
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && check::is_ready(p))
            .map(|p| {
                (
                    p.metadata.name.clone().unwrap_or_default(),
                    p.status
                        .as_ref()
                        .and_then(|s| s.pod_ip.clone())
                        .unwrap_or_default(),
                )
            })
            .collect())
    }

    async fn all_pods(&self) -> anyhow::Result<Vec<Pod>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.ns);
        Ok(pods
            .list(&ListParams::default().labels(SELECTOR))
            .await?
            .items)
    }

    /// The leader election Lease's holder and its transitions.
    pub async fn lease(&self) -> anyhow::Result<(Option<String>, i32)> {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let lease = leases.get_opt(RELEASE).await?;
        let spec = lease.and_then(|l| l.spec);
        Ok((
            spec.as_ref().and_then(|s| s.holder_identity.clone()),
            spec.and_then(|s| s.lease_duration_seconds).unwrap_or(0),
        ))
    }

    async fn cluster_ip(&self) -> anyhow::Result<String> {
        let services: Api<Service> = Api::namespaced(self.client.clone(), &self.ns);
        services
            .get(RELEASE)
            .await?
            .spec
            .and_then(|s| s.cluster_ip)
            .context("the steward Service has no ClusterIP")
    }

    /// What the chart's mode says `default/kubernetes` must hold now.
    async fn expected(&self, mode: &str) -> anyhow::Result<BTreeSet<(String, i32)>> {
        Ok(match mode {
            "cluster-ip" => [(self.cluster_ip().await?, i32::from(LISTEN_PORT))].into(),
            _ => self
                .ready_pods()
                .await?
                .into_iter()
                .map(|(_, ip)| (ip, i32::from(LISTEN_PORT)))
                .collect(),
        })
    }

    /// Waits (bounded) until the Deployment has rolled out `replicas` Pods of its latest
    /// template and no other Pod is left.
    async fn wait_rolled_out(&self, limit: Duration) -> anyhow::Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(self.client.clone(), &self.ns);
        let deadline = Instant::now() + limit;
        loop {
            let d = deployments.get(RELEASE).await?;
            let generation = d.metadata.generation.unwrap_or(0);
            let want = d.spec.replicas.unwrap_or(1);
            if let Some(s) = d.status
                && s.observed_generation.unwrap_or(0) >= generation
                && s.updated_replicas.unwrap_or(0) == want
                && s.ready_replicas.unwrap_or(0) == want
                && s.replicas.unwrap_or(0) == want
                && self.all_pods().await?.len() == usize::try_from(want).unwrap_or(0)
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("the steward Deployment did not roll out within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits (bounded) until every steward Pod answers 200 on its own `/readyz` and kubelet
    /// reports it Ready: the state a user runs `helm test` in. After an outage this takes up to
    /// the upstream check's 10 s period plus kubelet's probe period.
    async fn wait_serving(&self, limit: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let mut last = String::new();
        while started.elapsed() < limit {
            let pods = self.all_pods().await?;
            let ready = self.ready_pods().await?;
            let mut answers = Vec::new();
            for (pod, ip) in &ready {
                let addr: SocketAddr = format!("{ip}:{HEALTH_PORT}").parse()?;
                if let Err(e) = check::http_get(addr, "/readyz").await {
                    answers.push(format!("{pod}: {e}"));
                }
            }
            if !pods.is_empty() && ready.len() == pods.len() && answers.is_empty() {
                return Ok(started.elapsed());
            }
            last = format!(
                "{} of {} Pods Ready; /readyz failures {answers:?}",
                ready.len(),
                pods.len()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        bail!("the steward Pods were not all serving within {limit:?}: {last}")
    }

    /// Polls until `default/kubernetes` matches what `mode` says; returns the time it took.
    pub async fn wait_published(&self, mode: &str, limit: Duration) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let mut last = Published::default();
        while started.elapsed() < limit {
            let want = self.expected(mode).await?;
            last = self.published().await?;
            if last.both_equal(&want) {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!(
            "default/kubernetes not as {mode} says within {limit:?}: {}",
            last.describe()
        )
    }

    /// Waits (bounded) until a TCP connection from the host to `10.96.0.1:443` shows up in
    /// steward's metrics: kube-proxy has applied the endpoints steward wrote.
    pub async fn wait_routed_through_steward(&self) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let target = SocketAddr::new(KUBERNETES_SERVICE_IP.into(), 443);
        while started.elapsed() < Duration::from_secs(30) {
            let before = self.metric_sum("proxy_connections_total").await?;
            let _ = tokio::time::timeout(
                Duration::from_millis(500),
                tokio::net::TcpStream::connect(target),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            if self.metric_sum("proxy_connections_total").await? > before {
                return Ok(started.elapsed());
            }
        }
        bail!("connections to {target} never reached steward within 30 s")
    }

    /// Sum of a metric over the ready steward Pods' /metrics.
    pub async fn metric_sum(&self, name: &str) -> anyhow::Result<f64> {
        let mut sum = 0.0;
        for (pod, ip) in self.ready_pods().await? {
            let text = (self.scrape(&ip)?.metrics().await)
                .map_err(|e| anyhow::anyhow!("{pod} /metrics: {e}"))?;
            sum += text
                .lines()
                .filter(|l| l.starts_with(name) && !l.starts_with('#'))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
        }
        Ok(sum)
    }
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
    let (repository, tag) = env.image("steward-tcp-proxy")?;
    let values = [
        format!("upstreamAddr={}", env.apiserver),
        format!("image.repository={repository},image.tag={tag}"),
    ];
    env.install_chart(RELEASE, ns, &values).await
}

async fn rbac_for_lister(env: &Env<'_>, ns: &str) -> anyhow::Result<()> {
    let objects = [
        json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": "lister", "namespace": ns } }),
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": format!("e2e-{ns}-list-namespaces") },
            "rules": [{ "apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"] }] }),
        json!({ "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": format!("e2e-{ns}-list-namespaces") },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": format!("e2e-{ns}-list-namespaces") },
            "subjects": [{ "kind": "ServiceAccount", "name": "lister", "namespace": ns }] }),
    ];
    super::apply_objects(env, objects).await
}

/// Runs `/testbox kube --list namespaces` in a Job with ServiceAccount `lister` and in-cluster
/// config only; returns its log, or an error saying how it failed.
async fn in_cluster_client(
    env: &Env<'_>,
    ns: &str,
    name: &str,
    watch_seconds: u64,
    deadline: Duration,
) -> anyhow::Result<String> {
    let watch = watch_seconds.to_string();
    let mut job = check::job(
        name,
        TESTBOX_IMAGE,
        &[
            "/testbox",
            "kube",
            "--in-cluster",
            "--list",
            "namespaces",
            "--watch-seconds",
            &watch,
        ],
    );
    job["spec"]["activeDeadlineSeconds"] = json!(deadline.as_secs());
    job["spec"]["template"]["spec"]["serviceAccountName"] = json!("lister");
    let jobs: Api<Job> = Api::namespaced(env.plane.client().await?, ns);
    jobs.create(&PostParams::default(), &serde_json::from_value(job)?)
        .await?;
    let logs = check::wait_job_logs(env.plane, ns, name).await;
    let logs = match logs {
        Ok(logs) => Ok(logs),
        Err(err) => {
            // Why the Job failed (its Failed condition's reason, e.g. DeadlineExceeded: the
            // client was still waiting when the Job's deadline ended it).
            let reason = jobs
                .get(name)
                .await
                .ok()
                .and_then(|j| j.status?.conditions)
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Failed" && c.status == "True")
                .and_then(|c| c.reason)
                .unwrap_or_else(|| "no Failed reason".to_owned());
            Err(anyhow::anyhow!("Job {name} failed ({reason}): {err}"))
        }
    };
    let _ = jobs.delete(name, &DeleteParams::background()).await;
    logs
}

/// What the `endpointMode=cluster-ip` scenario saw.
#[derive(Debug)]
struct ClusterIpRun {
    /// `default/kubernetes` held steward's ClusterIP (or why not).
    published: Result<(), String>,
    /// The in-cluster client's log, or how its Job failed.
    client: Result<String, String>,
    /// A TCP connect from the host to `10.96.0.1:443` ([`tcp_connect`]).
    host_tcp: String,
    /// steward's `proxy_connections_total` before and after both clients.
    conns: (f64, f64),
}

/// The expected outcome of `endpointMode=cluster-ip`, today: steward publishes its ClusterIP and
/// kube-proxy does not route a ClusterIP used as an endpoint, so the in-cluster client is still
/// waiting when its Job's deadline ends it, the host's connect does not connect, and no
/// connection reaches steward. Any other outcome fails, naming what changed (kube-proxy now
/// routing it is news: steward's README and this expectation must change with it).
fn cluster_ip_verdict(run: &ClusterIpRun) -> Result<String, String> {
    if let Err(e) = &run.published {
        return Err(format!("steward did not publish its ClusterIP: {e}"));
    }
    let routed = |what: &str| {
        format!(
            "kube-proxy ROUTES a ClusterIP used as an endpoint ({what}): not what steward's README says"
        )
    };
    if run.host_tcp == "connected" {
        return Err(routed("the host's TCP connect to 10.96.0.1:443 connected"));
    }
    if run.conns.1 > run.conns.0 {
        return Err(routed(&format!(
            "steward counted {} new connections",
            run.conns.1 - run.conns.0
        )));
    }
    match &run.client {
        Ok(log) if log.contains("kube result=ok") => {
            Err(routed("the in-cluster client listed namespaces"))
        }
        Ok(log) => Err(format!(
            "the in-cluster client's Job completed without a result: {log}"
        )),
        // Still waiting for its connection when the Job's deadline ended it: not routed.
        Err(e) if e.contains("(DeadlineExceeded)") => Ok(format!(
            "as expected: not routed (the in-cluster client was still connecting at its Job's deadline, the host's connect: {}, no connection reached steward)",
            run.host_tcp
        )),
        // Failed on its own: only a connection error of its own proves the same.
        Err(e) if e.contains("kube: API server") && e.contains("listing namespaces") => {
            Ok(format!(
                "as expected: not routed (the in-cluster client failed to connect, the host's connect: {}, no connection reached steward)",
                run.host_tcp
            ))
        }
        Err(e) => Err(format!(
            "the in-cluster client failed, but not by waiting for a connection: {e}"
        )),
    }
}

/// kube-proxy's NAT rules for `default/kubernetes` in the node's network namespace, for a
/// failure report.
fn kubernetes_nat_rules() -> String {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", node::NETNS, "iptables-save", "-t", "nat"])
        .output();
    match out {
        Ok(out) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("default/kubernetes"))
            .collect::<Vec<_>>()
            .join(" | "),
        Err(err) => format!("iptables-save: {err}"),
    }
}

fn summary(outcome: &anyhow::Result<String>) -> String {
    match outcome {
        Ok(log) => log
            .lines()
            .filter(|l| l.starts_with("kube ") || l.starts_with("event "))
            .collect::<Vec<_>>()
            .join("; "),
        Err(err) => format!(
            "failed: {}",
            format!("{err:#}").chars().take(300).collect::<String>()
        ),
    }
}

async fn tcp_connect(addr: SocketAddr) -> String {
    match tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => "connected".to_owned(),
        Ok(Err(e)) => format!("error {e}"),
        Err(_) => "timed out after 2 s".to_owned(),
    }
}

struct RollOutcome {
    requests: u32,
    failed: u32,
    errors: Vec<String>,
    watch_events: Vec<String>,
    watch_errors: Vec<String>,
    watch_restarts: u32,
    watch_saw_probe: bool,
    rollout: Duration,
    old_pods_gone: Option<Duration>,
    /// The slowest GET (answered or not).
    slowest: Duration,
    /// How long after its creation the watch delivered the last probe.
    last_probe_seen: Option<Duration>,
}

impl RollOutcome {
    fn describe(&self) -> String {
        format!(
            "rollout complete after {:.1}s, old Pods gone after {}; {} GETs, {} failed{}, slowest {} ms; watch: {} events [{}], {} re-watches{}, the last probe seen {}",
            self.rollout.as_secs_f64(),
            self.old_pods_gone
                .map(|d| format!("{:.1}s", d.as_secs_f64()))
                .unwrap_or_else(|| "(not within the limit)".to_owned()),
            self.requests,
            self.failed,
            if self.errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", self.errors.join("; "))
            },
            self.slowest.as_millis(),
            self.watch_events.len(),
            self.watch_events.join(", "),
            self.watch_restarts,
            if self.watch_errors.is_empty() {
                String::new()
            } else {
                format!(", errors: {}", self.watch_errors.join("; "))
            },
            self.last_probe_seen
                .map(|d| format!("{} ms after its creation", d.as_millis()))
                .unwrap_or_else(|| "never (within 30 s)".to_owned()),
        )
    }
}

/// A client of `https://10.96.0.1:443` with the admin's credentials (the serving certificate
/// names that address).
pub async fn service_client(env: &Env<'_>) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(env.plane.kubeconfig_path())?;
    let mut config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.cluster_url = format!("https://{KUBERNETES_SERVICE_IP}:443").parse()?;
    config.read_timeout = Some(Duration::from_secs(300));
    config.connect_timeout = Some(Duration::from_secs(2));
    Ok(kube::Client::try_from(config)?)
}

async fn rolling_upgrade(env: &Env<'_>, cluster: &Release) -> anyhow::Result<RollOutcome> {
    let client = service_client(env).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    cluster.wait_routed_through_steward().await?;
    let version = namespaces
        .list(&ListParams::default())
        .await
        .context("listing namespaces through 10.96.0.1")?
        .metadata
        .resource_version
        .unwrap_or_default();
    let old: BTreeSet<String> = cluster
        .all_pods()
        .await?
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let stop = tokio_util_stop();
    // The probes the watcher has seen so far, so the end can wait for the last one.
    let (seen_tx, mut seen_rx) = tokio::sync::watch::channel(BTreeSet::<String>::new());
    // The watcher: re-watches from the last version after any end or error.
    let watcher = {
        let namespaces = namespaces.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut version = version;
            let mut events = Vec::new();
            let mut errors = Vec::new();
            let mut restarts = 0u32;
            let mut saw_probe = false;
            while !stop.is_stopped() && restarts < 100 {
                let params = WatchParams::default().timeout(120);
                match namespaces.watch(&params, &version).await {
                    Ok(stream) => {
                        let mut stream = std::pin::pin!(stream);
                        loop {
                            let next = tokio::select! {
                                next = stream.next() => next,
                                () = stop.wait() => None,
                            };
                            match next {
                                Some(Ok(
                                    WatchEvent::Added(ns)
                                    | WatchEvent::Modified(ns)
                                    | WatchEvent::Deleted(ns),
                                )) => {
                                    let name = ns.metadata.name.clone().unwrap_or_default();
                                    if name.starts_with("e2e-roll-probe") {
                                        saw_probe = true;
                                        events.push(name.clone());
                                        seen_tx.send_modify(|seen| {
                                            seen.insert(name.clone());
                                        });
                                    }
                                    version = ns.metadata.resource_version.unwrap_or(version);
                                }
                                Some(Ok(WatchEvent::Bookmark(b))) => {
                                    version = b.metadata.resource_version;
                                }
                                Some(Ok(WatchEvent::Error(e))) => {
                                    errors.push(format!("{} {}", e.code, e.message));
                                    break;
                                }
                                Some(Err(e)) => {
                                    errors.push(e.to_string().chars().take(120).collect());
                                    break;
                                }
                                None => break,
                            }
                        }
                    }
                    Err(e) => {
                        errors.push(e.to_string().chars().take(120).collect());
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
                restarts += 1;
            }
            (events, errors, restarts.saturating_sub(1), saw_probe)
        })
    };
    // The GET loop.
    let getter = {
        let client = client.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let api: Api<Namespace> = Api::all(client);
            let mut requests = 0u32;
            let mut failed = 0u32;
            let mut errors: Vec<String> = Vec::new();
            let mut slowest = Duration::ZERO;
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            while !stop.is_stopped() && requests < 10_000 {
                tick.tick().await;
                requests += 1;
                let sent = Instant::now();
                let answer =
                    tokio::time::timeout(Duration::from_secs(30), api.get("default")).await;
                slowest = slowest.max(sent.elapsed());
                match answer {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        failed += 1;
                        if errors.len() < 5 {
                            errors.push(e.to_string().chars().take(120).collect());
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        if errors.len() < 5 {
                            errors.push("timed out after 30 s".to_owned());
                        }
                    }
                }
            }
            (requests, failed, errors, slowest)
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let admin: Api<Namespace> = Api::all(env.plane.client().await?);
    let probe = |n: u32| -> anyhow::Result<Namespace> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": { "name": format!("e2e-roll-probe-{n}") },
        }))?)
    };
    admin.create(&PostParams::default(), &probe(1)?).await?;
    let started = Instant::now();
    let sets = [("--set-string", "podAnnotations.e2e-roll=1")];
    env.upgrade_reusing(RELEASE, &cluster.ns, &sets, false)
        .await?;
    admin.create(&PostParams::default(), &probe(2)?).await?;
    cluster.wait_rolled_out(Duration::from_secs(180)).await?;
    let rollout = started.elapsed();
    admin.create(&PostParams::default(), &probe(3)?).await?;
    let mut old_pods_gone = None;
    let limit = Duration::from_secs(90);
    while started.elapsed() < limit {
        let now: BTreeSet<String> = cluster
            .all_pods()
            .await?
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        if now.is_disjoint(&old) {
            old_pods_gone = Some(started.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster
        .wait_published("pod-ip", Duration::from_secs(30))
        .await?;
    admin.create(&PostParams::default(), &probe(4)?).await?;
    // The watch has its chance at the last probe: wait (bounded) until it saw an event per probe
    // created, or ended; a missing one fails the scenario below.
    let created = Instant::now();
    let last_probe_seen = tokio::time::timeout(
        Duration::from_secs(30),
        seen_rx.wait_for(|seen| seen.contains("e2e-roll-probe-4")),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .map(|_| created.elapsed());
    stop.stop();
    let (requests, failed, errors, slowest) = getter.await?;
    let (watch_events, watch_errors, watch_restarts, _) = watcher.await?;
    for n in 1..=4 {
        let _ = admin
            .delete(&format!("e2e-roll-probe-{n}"), &DeleteParams::default())
            .await;
    }
    let watch_saw_probe = (1..=4).all(|n| {
        watch_events
            .iter()
            .any(|e| e == &format!("e2e-roll-probe-{n}"))
    });
    Ok(RollOutcome {
        requests,
        failed,
        errors,
        watch_events,
        watch_errors,
        watch_restarts,
        watch_saw_probe,
        rollout,
        old_pods_gone,
        slowest,
        last_probe_seen,
    })
}

/// A stop flag tasks can poll or await.
#[derive(Clone)]
struct Stop(std::sync::Arc<tokio::sync::watch::Sender<bool>>);

fn tokio_util_stop() -> Stop {
    Stop(std::sync::Arc::new(tokio::sync::watch::channel(false).0))
}

impl Stop {
    fn stop(&self) {
        self.0.send_replace(true);
    }

    fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    async fn wait(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }
}

/// Cuts the node's link to the API server for [`CUT`] under steward and records
/// [`STEWARD_CUT`].
async fn partition(env: &Env<'_>, report: &mut ChartReport, release: &Release) {
    let started = Instant::now();
    let outcome = partition_converges(env, release).await;
    report.record(
        STEWARD_CUT,
        outcome.is_ok(),
        started,
        outcome.unwrap_or_else(|e| format!("{e:#}")),
    );
}

async fn partition_converges(env: &Env<'_>, release: &Release) -> anyhow::Result<String> {
    let node = env.plane.node().context("the control plane has no node")?;
    let port = url_port(env.plane.server_url())?;
    let through_steward = service_client(env).await?;
    let ask = || async {
        tokio::time::timeout(Duration::from_secs(5), through_steward.apiserver_version())
            .await
            .map_err(|_| anyhow::anyhow!("no answer within 5 s"))?
            .map_err(anyhow::Error::from)
    };
    ask().await.context("through steward before the cut")?;
    node.cut_apiserver_link(port)?;
    let cut_at = Instant::now();
    // During the cut steward has no upstream: a request through it must fail (else the cut did
    // not cut). Pods are read through the host's own link, which the cut leaves alone.
    let during = ask().await;
    let mut ready_counts = Vec::new();
    let mut read = Ok(());
    while cut_at.elapsed() < CUT {
        match release.ready_pods().await {
            Ok(ready) => ready_counts.push(ready.len()),
            Err(e) => {
                read = Err(e);
                break;
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
    node.restore_apiserver_link()?;
    let returned_at = Instant::now();
    read?;
    if let Ok(version) = during {
        anyhow::bail!(
            "during the cut a request through steward was answered ({}): the link was not cut",
            version.git_version
        );
    }
    let mut back = None;
    while back.is_none() && returned_at.elapsed() < CONVERGE_LIMIT {
        match ask().await {
            Ok(_) => back = Some(returned_at.elapsed()),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
    let back = back.with_context(|| {
        format!("no answer through steward within {CONVERGE_LIMIT:?} of the link's return")
    })?;
    release.wait_published("pod-ip", CONVERGE_LIMIT).await?;
    let published = returned_at.elapsed();
    Ok(format!(
        "during the cut a request through 10.96.0.1:443 failed ({}), ready steward Pods every {PROBE_EVERY:?}: {ready_counts:?}; after the link returned: answered through steward after {back:.1?}, default/kubernetes as pod-ip says by {published:.1?}; now {}",
        during.err().map(|e| format!("{e:#}")).unwrap_or_default(),
        release.published().await?.describe()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn not_routed() -> ClusterIpRun {
        ClusterIpRun {
            published: Ok(()),
            client: Err(
                "Job lister-cluster-ip failed (DeadlineExceeded): Job lister-cluster-ip has no Pod"
                    .to_owned(),
            ),
            host_tcp: "timed out after 2 s".to_owned(),
            conns: (0.0, 0.0),
        }
    }

    #[test]
    fn cluster_ip_passes_only_on_the_expected_outcome() {
        let verdict = cluster_ip_verdict(&not_routed());
        assert!(verdict.is_ok(), "{verdict:?}");
        // The client failing by itself while trying to connect proves the same.
        let mut run = not_routed();
        run.client = Err("Job x failed (BackoffLimitExceeded): its log: kube: API server https://10.96.0.1:443\nError: listing namespaces: ... connect timed out".to_owned());
        assert!(cluster_ip_verdict(&run).is_ok());
    }

    #[test]
    fn cluster_ip_fails_when_anything_routes_or_proves_nothing() {
        // Publishing alone passed the old check.
        let mut run = not_routed();
        run.published = Err("default/kubernetes not as cluster-ip says".to_owned());
        assert!(cluster_ip_verdict(&run).is_err());
        // kube-proxy routing it, seen by any of the three.
        let mut run = not_routed();
        run.host_tcp = "connected".to_owned();
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        let mut run = not_routed();
        run.conns = (4.0, 5.0);
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        let mut run = not_routed();
        run.client = Ok("namespace default\nkube result=ok namespaces=9 events=0".to_owned());
        assert!(cluster_ip_verdict(&run).is_err_and(|e| e.contains("ROUTES")));
        // A client that failed for another reason (no image, RBAC) proves nothing about routing.
        let mut run = not_routed();
        run.client = Err(
            "Job x failed (BackoffLimitExceeded): its log: Error: in-cluster config".to_owned(),
        );
        assert!(cluster_ip_verdict(&run).is_err());
    }
}
