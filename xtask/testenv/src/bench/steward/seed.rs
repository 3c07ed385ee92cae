//! The seed's reconciler re-created: get, compare, update on a fixed ticker.

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};

use super::{SEED_MANAGER, SEED_POLL, SERVICE_PORT};

/// The seed's reconciler, re-created for the bench (see `shared/reference/steward-tcp-proxy.md`
/// section 3.2): once at start, then on a fixed ticker with no jitter and no watch. A failed pass
/// (e.g. a Conflict) waits for the next tick, as the seed's did.
pub(super) struct SeedPoller {
    task: tokio::task::JoinHandle<()>,
    reconciles: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl SeedPoller {
    pub(super) fn start(client: kube::Client, namespace: &str) -> Self {
        let namespace = namespace.to_owned();
        let reconciles = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = reconciles.clone();
        let task = tokio::spawn(async move {
            let mut ticker = tokio::time::interval(SEED_POLL);
            // Go's ticker drops ticks a slow receiver missed.
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                ticker.tick().await;
                if let Err(error) = seed_reconcile(&client, &namespace).await {
                    eprintln!("steward: seed poller: {error:#} (retried at the next tick)");
                }
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        Self { task, reconciles }
    }

    /// Stops the poller; returns how many passes it made.
    pub(super) fn stop(self) -> usize {
        self.task.abort();
        self.reconciles.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One pass of the seed: get the ClusterIP, get the slice, create it or update it in place when
/// the match check fails.
async fn seed_reconcile(client: &kube::Client, namespace: &str) -> anyhow::Result<()> {
    let service = Api::<Service>::namespaced(client.clone(), namespace)
        .get("proxy")
        .await?;
    let cluster_ip = service
        .spec
        .and_then(|spec| spec.cluster_ip)
        .filter(|ip| !ip.is_empty() && ip != "None")
        .context("the proxy Service has no ClusterIP")?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let endpoints = serde_json::json!([{
        "addresses": [cluster_ip],
        "conditions": {"ready": true, "serving": true, "terminating": false},
    }]);
    let ports = serde_json::json!([{"name": "https", "port": SERVICE_PORT, "protocol": "TCP"}]);
    let Some(mut slice) = slices.get_opt("kubernetes").await? else {
        let slice: EndpointSlice = serde_json::from_value(serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes", "labels": {
                "kubernetes.io/service-name": "kubernetes",
                "endpointslice.kubernetes.io/managed-by": SEED_MANAGER,
            }},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports,
        }))?;
        slices.create(&PostParams::default(), &slice).await?;
        return Ok(());
    };
    if seed_matches(&slice, &cluster_ip) {
        return Ok(());
    }
    slice.endpoints = serde_json::from_value(endpoints)?;
    slice.ports = serde_json::from_value(ports)?;
    slice.metadata.labels.get_or_insert_default().insert(
        "endpointslice.kubernetes.io/managed-by".to_owned(),
        SEED_MANAGER.to_owned(),
    );
    slices
        .replace("kubernetes", &PostParams::default(), &slice)
        .await?;
    Ok(())
}

/// The seed's match check: one endpoint, one address equal to the ClusterIP, one port equal to
/// the service port; everything else is ignored.
fn seed_matches(slice: &EndpointSlice, cluster_ip: &str) -> bool {
    let [endpoint] = slice.endpoints.as_deref().unwrap_or_default() else {
        return false;
    };
    let [port] = slice.ports.as_deref().unwrap_or_default() else {
        return false;
    };
    endpoint.addresses.len() == 1
        && endpoint.addresses[0] == cluster_ip
        && port.port == Some(SERVICE_PORT)
}
