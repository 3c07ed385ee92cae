//! Expiry, done by the Lease holder: expired mappings are deleted at their deadline (every
//! replica already stopped forwarding for them), and live ones get a current status.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::apply::delete_unchanged;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use tokio_util::sync::CancellationToken;

use crate::crd::{MappingKind, PortMapping, PortMappingStatus};
use crate::forwarding::Mappings;
use crate::ttl::Deadline;

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
                upstreams
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
                mapping
                    .spec
                    .expires_at
                    .map_or_else(|| "-".to_owned(), |d| d.to_string())
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

/// A merge patch of a PortMapping's status.
#[derive(Debug, serde::Serialize)]
struct StatusPatch<'a> {
    status: &'a PortMappingStatus,
}

/// The first wait after the API refused a status write, doubled up to [`STATUS_RETRY_MAX`].
const STATUS_RETRY_FIRST: Duration = Duration::from_secs(1);
const STATUS_RETRY_MAX: Duration = Duration::from_secs(60);

/// Deletes expired mappings, each at its deadline (the data plane already stopped forwarding),
/// and keeps the status of the others current.
pub async fn sweep_expired(api: Api<PortMapping>, mappings: Mappings, stop: CancellationToken) {
    // The status written for each version of a mapping: while the cache lags (a broken watch),
    // the same version is not patched again every second.
    let mut written: HashMap<String, (Option<String>, PortMappingStatus)> = HashMap::new();
    // Status writes the API refused (a verb taken out of the Role, say): when to try again,
    // backing off from 1 s to a minute instead of asking every second.
    let mut refused: HashMap<String, (Instant, Duration)> = HashMap::new();
    loop {
        let now = Timestamp::now();
        let mut next: Option<Deadline> = None;
        let all = mappings.all();
        written.retain(|name, _| all.iter().any(|m| &m.name_any() == name));
        refused.retain(|name, _| all.iter().any(|m| &m.name_any() == name));
        for mapping in all {
            let name = mapping.name_any();
            if !mapping.is_expired(now) {
                let status = desired_status(&mapping);
                let version = (mapping.resource_version(), status.clone());
                let stale = mapping.status.as_ref() != Some(&status);
                let due = refused
                    .get(&name)
                    .is_none_or(|(at, _)| Instant::now() >= *at);
                if stale && due && written.get(&name) != Some(&version) {
                    let patch = StatusPatch { status: &status };
                    match api
                        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {
                            written.insert(name.clone(), version);
                            refused.remove(&name);
                        }
                        Err(err) => {
                            let backoff =
                                refused.get(&name).map_or(STATUS_RETRY_FIRST, |(_, b)| {
                                    (*b * 2).min(STATUS_RETRY_MAX)
                                });
                            tracing::warn!(mapping = %name, error = %err, retry_in = ?backoff, "updating status");
                            refused.insert(name.clone(), (Instant::now() + backoff, backoff));
                        }
                    }
                }
            }
            if mapping.is_expired(now) {
                // Only this version: a concurrent extension must survive.
                let params = delete_unchanged(mapping.resource_version());
                match api.delete(&mapping.name_any(), &params).await {
                    Ok(_) => {
                        tracing::info!(mapping = %mapping.name_any(), target = %format!("{}/{}", mapping.spec.target.namespace, mapping.spec.target.name), "expired mapping removed")
                    }
                    Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {}
                    Err(err) => {
                        tracing::warn!(mapping = %mapping.name_any(), error = %err, "removing an expired mapping");
                        next = Some(Deadline::after(now, Duration::from_secs(2)));
                    }
                }
            } else if let Some(deadline) = mapping.spec.expires_at {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        // Wake at the next deadline, and at least every second to see new mappings.
        let most = Duration::from_secs(1);
        let wait = next.map_or(most, |n| n.remaining(Timestamp::now()).min(most));
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}
