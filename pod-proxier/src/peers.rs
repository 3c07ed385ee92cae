//! Every replica checks the others: a peer lost with its node is marked not Ready within
//! seconds, so pod-proxier's Service stops sending clients to it long before the node controller
//! would (node-monitor-grace-period, 20–50 s).
//!
//! The replicas are the Pods of `--peer-selector` in the state namespace. Each replica watches
//! them, dials the health port of every other Ready one with [`k8s_reconcile::peers`], and when
//! a peer fails its checks it writes the peer Pod's `Ready` condition `False`, as the node
//! controller does once it gives up on a node. The EndpointSlice controller then takes the Pod
//! out of the Service and kube-proxy stops routing to it.
//!
//! Every replica does it, not only the leader: the leader may be the replica that was lost.
//! Two guards keep a healthy replica in service:
//! * a peer that never answered this replica is never marked (a NetworkPolicy that closes the
//!   health port between replicas changes nothing);
//! * a peer that is alive after all (a partition between replicas only) is marked `Ready` again
//!   by its own kubelet, which restores the conditions it owns within its status sync (about
//!   10 s).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::peers::{PeerCheck, PeerMetrics};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::settings::PeerSettings;

/// The reason written on a peer's `Ready` condition.
pub const REASON: &str = "PeerUnreachable";

/// Metrics of the peer check.
#[derive(Debug, Clone)]
pub struct PeersMetrics {
    check: PeerMetrics,
    marked: Counter,
}

impl PeersMetrics {
    /// Registers `podproxier_peers_down`, `podproxier_peer_check_failures_total` and
    /// `podproxier_peers_marked_unready_total`.
    pub fn register(registry: &mut Registry) -> Self {
        let registry = registry.sub_registry_with_prefix("podproxier");
        let marked = Counter::default();
        registry.register(
            "peers_marked_unready",
            "Peer Pods this replica marked not Ready after they failed their peer checks",
            marked.clone(),
        );
        Self {
            check: PeerMetrics::register(registry),
            marked,
        }
    }
}

/// Checks the peers that `pods` sees (its namespace, `settings.selector`) until `stop`;
/// `own_name` is this replica's Pod, never checked.
pub async fn run(
    pods: Api<Pod>,
    settings: PeerSettings,
    own_name: String,
    metrics: PeersMetrics,
    stop: CancellationToken,
) {
    let check = PeerCheck::new(settings.check, metrics.check.clone());
    // Held for as long as this runs, so the check keeps running.
    let mut changes = check.changes();
    tokio::spawn(check.clone().run(stop.clone()));
    let (store, writer) = reflector::store();
    let config = watcher::Config::default().labels(&settings.selector);
    let mut events = Box::pin(
        reflector::reflector(writer, watcher(pods.clone(), config))
            .default_backoff()
            .applied_objects(),
    );
    let mut ticks = tokio::time::interval(settings.check.interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tracing::info!(selector = %settings.selector, port = settings.check.port, interval = ?settings.check.interval, failures = settings.check.failures.get(), "peer check: dialling the other replicas' health ports");
    let mut patched = Patched::default();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            event = events.next() => match event {
                Some(Ok(_)) => continue,
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "watching the peer Pods");
                    continue;
                }
                None => return,
            },
            _ = ticks.tick() => check.track(ready_peers(&store, &own_name)),
            changed = changes.changed() => if changed.is_err() { return },
        }
        for ip in check.down() {
            mark_unready(&pods, &store, ip, &own_name, &metrics.marked, &mut patched).await;
        }
        patched.forget_gone(&store);
    }
}

/// The addresses of the peers that are Ready (the ones a Service routes to).
fn ready_peers(store: &Store<Pod>, own_name: &str) -> BTreeSet<IpAddr> {
    store
        .state()
        .iter()
        .filter(|pod| pod.metadata.name.as_deref() != Some(own_name))
        .filter(|pod| pod.metadata.deletion_timestamp.is_none() && is_ready(pod))
        .filter_map(|pod| pod.status.as_ref()?.pod_ip.as_deref()?.parse().ok())
        .collect()
}

fn is_ready(pod: &Pod) -> bool {
    let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
    conditions.is_some_and(|conditions| {
        conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// The resource version of each Pod this replica marked, as the store showed it then: until the
/// watch delivers the marked Pod, the store still shows it Ready, and it must not be patched
/// twice. A newer version that is Ready again (its kubelet restored it) is marked anew.
#[derive(Default)]
struct Patched(BTreeMap<String, String>);

impl Patched {
    fn is_pending(&self, name: &str, version: Option<&str>) -> bool {
        version.is_some() && self.0.get(name).map(String::as_str) == version
    }

    fn forget_gone(&mut self, store: &Store<Pod>) {
        if self.0.is_empty() {
            return;
        }
        let names: BTreeSet<String> = store
            .state()
            .iter()
            .filter_map(|pod| pod.metadata.name.clone())
            .collect();
        self.0.retain(|name, _| names.contains(name));
    }
}

/// Writes `Ready=False` on the Ready peer Pod at `ip`, if there still is one.
async fn mark_unready(
    pods: &Api<Pod>,
    store: &Store<Pod>,
    ip: IpAddr,
    own_name: &str,
    marked: &Counter,
    patched: &mut Patched,
) {
    let ip_text = ip.to_string();
    let Some(pod) = store.state().into_iter().find(|pod| {
        is_ready(pod)
            && pod.status.as_ref().and_then(|s| s.pod_ip.as_deref()) == Some(ip_text.as_str())
    }) else {
        return;
    };
    let Some(name) = pod.metadata.name.clone() else {
        return;
    };
    let version = pod.metadata.resource_version.clone();
    if patched.is_pending(&name, version.as_deref()) {
        return;
    }
    // A strategic merge on the conditions' key, `type`: the other conditions stay.
    let patch = json!({ "status": { "conditions": [{
        "type": "Ready",
        "status": "False",
        "reason": REASON,
        "message": format!("pod-proxier replica {own_name} could not reach this replica's health port"),
        "lastTransitionTime": Timestamp::now().to_string(),
    }]}});
    match pods
        .patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
        .await
    {
        Ok(_) => {
            if let Some(version) = version {
                patched.0.insert(name.clone(), version);
            }
            marked.inc();
            tracing::warn!(peer = %name, %ip, "peer unreachable: marked its Pod not Ready, so the Service stops routing to it");
        }
        Err(err) => {
            tracing::warn!(peer = %name, %ip, error = %err, "cannot mark the unreachable peer's Pod not Ready")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Patched;

    #[test]
    fn a_marked_pod_is_not_marked_again_until_a_newer_version_shows_it_ready() {
        let mut patched = Patched::default();
        assert!(!patched.is_pending("lost", Some("10")));
        patched.0.insert("lost".to_owned(), "10".to_owned());
        assert!(
            patched.is_pending("lost", Some("10")),
            "the store has not caught up"
        );
        assert!(
            !patched.is_pending("lost", Some("12")),
            "Ready again: its kubelet restored it"
        );
        assert!(!patched.is_pending("other", Some("10")));
        assert!(!patched.is_pending("lost", None));
    }
}
