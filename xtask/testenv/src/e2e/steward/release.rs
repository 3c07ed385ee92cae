//! A steward release as the scenarios see it: its Pods, its leader and what it published.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams};

use crate::e2e::Env;
use crate::node::{KUBERNETES_SERVICE_IP, check};

use super::{HEALTH_PORT, LISTEN_PORT, METRICS_PORT, RELEASE, SELECTOR};

/// What `default/kubernetes` says: the Endpoints' and the slices' (ip, port) sets.
#[derive(Debug, Default, PartialEq, Eq, Clone)]
pub struct Published {
    endpoints: BTreeSet<(String, i32)>,
    pub(super) slices: BTreeSet<(String, i32)>,
}

impl Published {
    /// Whether `ip` is published in the Endpoints or the EndpointSlice.
    pub fn has_ip(&self, ip: &str) -> bool {
        (self.endpoints.iter().chain(&self.slices)).any(|(published, _)| published == ip)
    }

    pub(super) fn both_equal(&self, want: &BTreeSet<(String, i32)>) -> bool {
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
        crate::e2e::bind_metrics_reader(env, ns, SCRAPER, &format!("{RELEASE}-metrics-reader"))
            .await?;
        Ok(Self {
            client: env.plane.client().await?,
            ns: ns.to_owned(),
            scraper: crate::e2e::token(env, ns, SCRAPER).await?,
        })
    }

    /// How [`SCRAPER`] reads the `/metrics` of the Pod at `ip`.
    pub fn scrape(&self, ip: &str) -> anyhow::Result<crate::e2e::Scrape> {
        Ok(crate::e2e::Scrape::Secure {
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

    pub(super) async fn all_pods(&self) -> anyhow::Result<Vec<Pod>> {
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
    pub(super) async fn expected(&self, mode: &str) -> anyhow::Result<BTreeSet<(String, i32)>> {
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
    pub(super) async fn wait_rolled_out(&self, limit: Duration) -> anyhow::Result<()> {
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
    pub(super) async fn wait_serving(&self, limit: Duration) -> anyhow::Result<Duration> {
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
