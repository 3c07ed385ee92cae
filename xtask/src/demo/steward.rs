//! steward-tcp-proxy from its chart with the defaults (two replicas, leader election, `pod-ip`
//! mode): `default/kubernetes` points at its Pods, and a client of `https://10.96.0.1` (the
//! `kubernetes` Service, as every in-cluster client uses it) reaches the API server through
//! kube-proxy and steward, counted by steward's own metrics.

use std::time::Duration;

use anyhow::{Context as _, ensure};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ListParams};

use super::{Shown, describe_pods};
use netkit_testenv::e2e::Env;
use netkit_testenv::e2e::steward::{self, Release};
use netkit_testenv::node::{KUBERNETES_SERVICE_IP, check};

/// The chart's default `replicaCount`.
const REPLICAS: usize = 2;
const CONNECTIONS_METRIC: &str = "proxy_connections_total";

pub async fn start(env: &Env<'_>) -> anyhow::Result<Shown> {
    let ns = env.restricted_namespace("demo-steward").await?;
    // The scraper's binding first: the replicas then never see its token unauthorised.
    let release = Release::new(env, &ns).await?;
    steward::install(env, &ns).await?;
    let pods = check::wait_pods_ready(env.plane, &ns, steward::SELECTOR, REPLICAS).await?;
    release
        .wait_published("pod-ip", Duration::from_secs(30))
        .await?;
    let routed = release.wait_routed_through_steward().await?;

    let before = release.metric_sum(CONNECTIONS_METRIC).await?;
    let client = steward::service_client(env).await?;
    let version = client
        .apiserver_version()
        .await
        .with_context(|| format!("GET /version through https://{KUBERNETES_SERVICE_IP}"))?;
    let namespaces = Api::<Namespace>::all(client)
        .list(&ListParams::default())
        .await
        .with_context(|| format!("listing namespaces through https://{KUBERNETES_SERVICE_IP}"))?;
    let after = release.metric_sum(CONNECTIONS_METRIC).await?;
    ensure!(
        after > before,
        "steward's {CONNECTIONS_METRIC} stayed at {before}: the calls to {KUBERNETES_SERVICE_IP} did not go through it"
    );
    let (leader, _) = release.lease().await?;
    let published = release.published().await?;

    let mut facts = describe_pods(env, &ns, steward::SELECTOR).await?;
    facts.push(format!(
        "leader (Lease {ns}/{}): {}",
        steward::RELEASE,
        leader.as_deref().unwrap_or("none")
    ));
    facts.push(format!(
        "default/kubernetes: {}; kube-proxy routed {KUBERNETES_SERVICE_IP}:443 to steward {:.1}s after it was written",
        published.describe(),
        routed.as_secs_f64()
    ));
    facts.push(format!(
        "a client of https://{KUBERNETES_SERVICE_IP}: GET /version -> {}, listed {} namespaces; steward's {CONNECTIONS_METRIC} {before} -> {after}",
        version.git_version,
        namespaces.items.len()
    ));
    let metrics_pod = &pods[0];
    Ok(Shown {
        name: "steward-tcp-proxy",
        facts,
        try_these: vec![
            "kubectl get endpointslice kubernetes -o wide   # the steward Pods".to_owned(),
            format!(
                "kubectl --server https://{KUBERNETES_SERVICE_IP} get namespaces   # through kube-proxy and steward"
            ),
            // The chart's metrics are HTTPS for a token RBAC lets read them (self-signed: -k).
            format!(
                "curl -sk -H \"Authorization: Bearer $(kubectl -n {ns} create token {})\" https://{}:{}/metrics | grep ^{CONNECTIONS_METRIC}   # {}",
                steward::SCRAPER,
                metrics_pod.1,
                steward::METRICS_PORT,
                metrics_pod.0
            ),
        ],
    })
}
