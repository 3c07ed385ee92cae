//! The work only one replica does: removing expired mappings and allocating V2 ports. The
//! replica holding the Lease does it; the others only forward.

use std::sync::Arc;
use std::time::Duration;

use k8s_reconcile::leader::{LeaderElector, LeaseConfig};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::crd::{MappingKind, PortMapping, PortMappingStatus};
use crate::mappings::{Mappings, expiry_millis, is_expired, now_millis};
use crate::metrics::Metrics;
use crate::v2::V2Reconciler;

/// The controller name in metrics and the Lease.
pub const CONTROLLER: &str = "pod-proxier";

/// Everything the leader needs.
pub struct LeaderWork {
    /// Flags.
    pub settings: Arc<Settings>,
    /// Client with pod-proxier's own identity.
    pub client: kube::Client,
    /// PortMappings of the state namespace.
    pub api: Api<PortMapping>,
    /// The cache.
    pub mappings: Mappings,
    /// Metrics.
    pub metrics: Metrics,
}

/// Campaigns for the Lease and runs the leader's work while holding it, until `shutdown`.
pub async fn run(
    work: Arc<LeaderWork>,
    controller_metrics: ControllerMetrics,
    health: Health,
    shutdown: CancellationToken,
) -> Result<(), k8s_reconcile::Error> {
    let lease = LeaseConfig::new(
        work.settings.state_namespace.clone(),
        work.settings.lease_name.clone(),
        work.settings.identity.clone(),
    );
    let elector = LeaderElector::new(work.client.clone(), lease)?;
    let mut state = elector.subscribe();
    let elector_token = shutdown.child_token();
    let elector_task = tokio::spawn(elector.run(elector_token.clone()));
    // Readiness does not depend on leadership: followers forward traffic and serve the API.
    health.set("leadership", true, "campaigning");
    loop {
        loop {
            let current = state.borrow_and_update().clone();
            health.set("leadership", true, format!("{current:?}"));
            controller_metrics.set_leader(CONTROLLER, current.is_leader());
            if current.is_leader() {
                break;
            }
            tokio::select! {
                () = shutdown.cancelled() => {
                    let _ = elector_task.await;
                    return Ok(());
                }
                changed = state.changed() => if changed.is_err() { return Ok(()) },
            }
        }
        tracing::info!(identity = %work.settings.identity, "leading: removing expired mappings and allocating V2 ports");
        let term = shutdown.child_token();
        let mut tasks = vec![tokio::spawn(sweep_expired(Arc::clone(&work), term.clone()))];
        if work.settings.enable_v2 {
            let reconciler = V2Reconciler::new(Arc::clone(&work));
            tasks.push(tokio::spawn(reconciler.run(term.clone())));
        }
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = state.changed() => {
                    if changed.is_err() || !state.borrow().is_leader() {
                        break;
                    }
                }
            }
        }
        term.cancel();
        for task in tasks {
            let _ = task.await;
        }
        controller_metrics.set_leader(CONTROLLER, false);
        if shutdown.is_cancelled() {
            elector_token.cancel();
            let _ = elector_task.await;
            return Ok(());
        }
        tracing::warn!("lost the leader Lease; only forwarding now");
    }
}

/// The status the leader reports for a live mapping.
pub fn desired_status(mapping: &PortMapping) -> PortMappingStatus {
    let upstreams = &mapping.spec.upstreams;
    let (phase, message) = match (mapping.spec.kind, upstreams.is_empty()) {
        (_, true) => (
            "NoEndpoints",
            "no ready endpoint: the entry port refuses connections".to_owned(),
        ),
        (MappingKind::Pod, false) => (
            "Active",
            format!(
                "forwarding port {} to {} until {}",
                mapping.spec.entry_port,
                upstreams.join(", "),
                mapping.spec.expires_at.as_deref().unwrap_or("-")
            ),
        ),
        (MappingKind::Service, false) => (
            "Active",
            format!(
                "forwarding port {} to {} endpoint(s)",
                mapping.spec.entry_port,
                upstreams.len()
            ),
        ),
    };
    PortMappingStatus {
        phase: Some(phase.to_owned()),
        message: Some(message),
    }
}

/// Deletes expired mappings, each at its deadline (the data plane already stopped forwarding),
/// and keeps the status of the others current.
async fn sweep_expired(work: Arc<LeaderWork>, stop: CancellationToken) {
    loop {
        let now = now_millis();
        let mut next: Option<i64> = None;
        for mapping in work.mappings.all() {
            if !is_expired(&mapping, now) {
                let status = desired_status(&mapping);
                if mapping.status.as_ref() != Some(&status) {
                    let patch = serde_json::json!({"status": status});
                    if let Err(err) = work
                        .api
                        .patch_status(
                            &mapping.name_any(),
                            &PatchParams::default(),
                            &Patch::Merge(&patch),
                        )
                        .await
                    {
                        tracing::warn!(mapping = %mapping.name_any(), error = %err, "updating status");
                    }
                }
            }
            if is_expired(&mapping, now) {
                let params = DeleteParams {
                    // Only this version: a concurrent extension must survive.
                    preconditions: Some(Preconditions {
                        resource_version: mapping.resource_version(),
                        uid: None,
                    }),
                    ..DeleteParams::default()
                };
                match work.api.delete(&mapping.name_any(), &params).await {
                    Ok(_) => {
                        tracing::info!(mapping = %mapping.name_any(), target = %format!("{}/{}", mapping.spec.target.namespace, mapping.spec.target.name), "expired mapping removed")
                    }
                    Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
                    Err(err) => {
                        tracing::warn!(mapping = %mapping.name_any(), error = %err, "removing an expired mapping");
                        next = Some(now + 2000);
                    }
                }
            } else if let Some(deadline) = expiry_millis(&mapping) {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        // Wake at the next deadline, and at least every second to see new mappings.
        let wait = next
            .map(|n| (n - now_millis()).clamp(0, 1000))
            .unwrap_or(1000);
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(u64::try_from(wait).unwrap_or(1000))) => {}
        }
    }
}
