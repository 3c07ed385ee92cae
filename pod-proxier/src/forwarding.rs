//! Forwarding, on every replica: the local view of the PortMapping objects, and the loop that
//! keeps the data plane equal to them.
//!
//! Every replica runs this loop, so every replica forwards the same way. Expiry is enforced here
//! on a timer at the exact deadline, independently of the leader deleting the object later, so a
//! TTL holds within milliseconds even while the API server is slow.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::watch_set::WatchBackoff;
use kube::ResourceExt as _;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::access::EntryAccess;
use crate::crd::{MappingKind, PortMapping};
use crate::dataplane::{DataPlane, DesiredPorts, PortRoute};
use crate::metrics::Metrics;
use crate::settings::MappingPolicy;
use crate::ttl::Deadline;

/// The versions of the mappings the data plane currently forwards for, by object name.
pub type AppliedVersions = HashMap<String, String>;

/// What the API handlers read: the informer cache and what the data plane has applied.
#[derive(Clone)]
pub struct Mappings {
    store: Store<PortMapping>,
    applied: watch::Receiver<AppliedVersions>,
}

impl Mappings {
    /// Every mapping in the cache (expired ones included until the leader removes them).
    pub fn all(&self) -> Vec<Arc<PortMapping>> {
        self.store.state()
    }

    /// The mapping named `name`, if cached.
    pub fn get(&self, name: &str) -> Option<Arc<PortMapping>> {
        self.store.find(|m| m.name_any() == name)
    }

    /// Waits until the data plane forwards for `name` at `resource_version` (or, with `None`,
    /// no longer forwards for `name`); false after `timeout`.
    pub async fn wait_applied(
        &self,
        name: &str,
        resource_version: Option<&str>,
        timeout: Duration,
    ) -> bool {
        let mut applied = self.applied.clone();
        let done = |versions: &AppliedVersions| match resource_version {
            Some(rv) => versions.get(name).map(String::as_str) == Some(rv),
            None => !versions.contains_key(name),
        };
        tokio::time::timeout(timeout, applied.wait_for(done))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

/// Builds the desired data plane state from the cached mappings at `now` (V2 routes are
/// health-checked when `health_checks`). Returns the desired ports, the applied versions, and
/// the next deadline (for the timer).
pub fn desired_state(
    policy: &MappingPolicy,
    health_checks: bool,
    mappings: &[Arc<PortMapping>],
    now: Timestamp,
) -> (DesiredPorts, AppliedVersions, Option<Deadline>) {
    let mut desired = DesiredPorts::new();
    let mut applied = AppliedVersions::new();
    let mut next_deadline: Option<Deadline> = None;
    if let Some(v1) = &policy.v1 {
        for port in v1.entry_ports.all() {
            desired.insert(port, PortRoute::idle());
        }
    }
    let checked = policy.entry_access == EntryAccess::Requester;
    for mapping in mappings {
        let name = mapping.name_any();
        let port = match u16::try_from(mapping.spec.entry_port) {
            Ok(port) => port,
            Err(_) => continue,
        };
        let in_scope = match mapping.spec.kind {
            MappingKind::Pod => policy
                .v1
                .as_ref()
                .is_some_and(|v1| v1.entry_ports.contains(port)),
            MappingKind::Service => policy
                .v2
                .as_ref()
                .is_some_and(|v2| v2.port_range.contains(port)),
        };
        if !in_scope || !policy.namespace_allowed(&mapping.spec.target.namespace) {
            continue;
        }
        if mapping.is_expired(now) {
            continue;
        }
        if let Some(deadline) = mapping.spec.expires_at {
            next_deadline = Some(next_deadline.map_or(deadline, |d| d.min(deadline)));
        }
        let route = PortRoute {
            name: name.clone(),
            upstreams: mapping.spec.upstreams.clone(),
            health_checked: mapping.spec.kind == MappingKind::Service && health_checks,
            close_connections: mapping.spec.close_connections,
            // A V1 mapping without recorded sources (made under --entry-access=any) admits
            // nobody: closed, not open, when access is checked.
            allowed_sources: (checked && mapping.spec.kind == MappingKind::Pod)
                .then(|| mapping.spec.allowed_sources.clone().unwrap_or_default()),
        };
        desired.insert(port, route);
        applied.insert(name, mapping.resource_version().unwrap_or_default());
    }
    (desired, applied, next_deadline)
}

/// Starts the informer over the PortMappings of the state namespace and the loop that programs
/// the data plane (see [`desired_state`]). Returns the view for the API and the task.
pub fn spawn_sync_loop(
    api: Api<PortMapping>,
    policy: MappingPolicy,
    health_checks: bool,
    plane: Arc<DataPlane>,
    metrics: Metrics,
    health: k8s_reconcile::ops::Health,
    shutdown: CancellationToken,
) -> (Mappings, tokio::task::JoinHandle<()>) {
    let (store, writer) = reflector::store();
    let (applied_tx, applied_rx) = watch::channel(AppliedVersions::new());
    let view = Mappings {
        store: store.clone(),
        applied: applied_rx,
    };
    health.set(
        "mappings-synced",
        false,
        "waiting for the first list of PortMappings",
    );
    let task = tokio::spawn(async move {
        let events = reflector::reflector(
            writer,
            watcher::watcher(api, watcher::Config::default()).backoff(WatchBackoff::default()),
        );
        let mut events = std::pin::pin!(events);
        let mut synced = false;
        let mut next_deadline: Option<Deadline> = None;
        // Also re-applies periodically: repairs drift in an external data plane (HAProxy restarted).
        let mut repair = tokio::time::interval(Duration::from_secs(10));
        repair.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let sleep_for = next_deadline
                .map(|d| d.remaining(Timestamp::now()))
                .unwrap_or(Duration::from_secs(3600));
            let dirty = tokio::select! {
                () = shutdown.cancelled() => break,
                event = events.next() => match event {
                    Some(Ok(Event::InitDone)) => {
                        synced = true;
                        health.set("mappings-synced", true, "PortMappings listed");
                        true
                    }
                    Some(Ok(Event::Apply(_) | Event::Delete(_))) => true,
                    Some(Ok(Event::Init | Event::InitApply(_))) => false,
                    Some(Err(err)) => {
                        tracing::warn!(error = %err, "watching PortMappings");
                        false
                    }
                    None => break,
                },
                () = tokio::time::sleep(sleep_for) => true,
                _ = repair.tick() => true,
            };
            if !dirty || !synced {
                continue;
            }
            let now = Timestamp::now();
            let state = store.state();
            let (desired, applied, deadline) = desired_state(&policy, health_checks, &state, now);
            next_deadline = deadline;
            let errors = plane.sync(&desired).await;
            for error in &errors {
                metrics.listener_errors.inc();
                tracing::error!(port = error.port, error = %error.message, "cannot program entry port");
            }
            metrics.set_mapping_counts(&state, now);
            applied_tx.send_if_modified(|current| {
                if *current == applied {
                    false
                } else {
                    *current = applied;
                    true
                }
            });
        }
    });
    (view, task)
}
