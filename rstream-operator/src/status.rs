//! Status writes shared by the manager and the agent: a JSON merge patch of the whole status on the
//! status subresource, guarded by the `resourceVersion` that was read (so two writers never lose each
//! other's conditions), retried on conflict, and skipped when nothing changes.

use std::fmt::Debug;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::conditions::{ConditionUpdate, Status, set_condition};
use kube::api::{Api, Patch, PatchParams};
use kube::core::object::HasStatus;
use kube::{Resource, ResourceExt as _};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Condition types.
pub mod types {
    /// Spec valid and connection usable.
    pub const ACCEPTED: &str = "Accepted";
    /// Service and port found.
    pub const RESOLVED: &str = "Resolved";
    /// Agent Deployment available.
    pub const AGENT_READY: &str = "AgentReady";
    /// Tunnel online (agent).
    pub const TUNNEL_READY: &str = "TunnelReady";
    /// Aggregate readiness.
    pub const READY: &str = "Ready";
}

/// Condition reasons (those of the original operator).
pub mod reasons {
    /// Accepted=True.
    pub const ACCEPTED: &str = "Accepted";
    /// Spec invalid.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// Connection, its Secret or its engine resolution failed.
    pub const CONNECTION_MISSING: &str = "ConnectionMissing";
    /// A referenced Secret or key is missing (RstreamConnection).
    pub const SECRET_MISSING: &str = "SecretMissing";
    /// Resolved=True.
    pub const RESOLVED: &str = "Resolved";
    /// Target Service missing.
    pub const SERVICE_MISSING: &str = "ServiceMissing";
    /// Target Service port missing or of the wrong protocol.
    pub const SERVICE_PORT_MISSING: &str = "ServicePortMissing";
    /// AgentReady=True.
    pub const DEPLOYMENT_AVAILABLE: &str = "DeploymentAvailable";
    /// AgentReady=False.
    pub const DEPLOYMENT_PENDING: &str = "DeploymentPending";
    /// TunnelReady=False while connecting.
    pub const TUNNEL_CONNECTING: &str = "TunnelConnecting";
    /// TunnelReady=True.
    pub const TUNNEL_ONLINE: &str = "TunnelOnline";
    /// TunnelReady=False after a failure.
    pub const TUNNEL_DISCONNECTED: &str = "TunnelDisconnected";
    /// Ready=True.
    pub const READY: &str = "Ready";
    /// Ready=False until the Deployment is available.
    pub const WAITING_FOR_DEPLOYMENT: &str = "WaitingForDeployment";
    /// The manager could not apply the agent's objects (the message says why, e.g. a missing
    /// RBAC verb); it retries with backoff.
    pub const CHILDREN_NOT_APPLIED: &str = "ChildrenNotApplied";
    /// Ready=False until the tunnel is online.
    pub const WAITING_FOR_TUNNEL: &str = "WaitingForTunnel";
    /// Ready=False while deleting.
    pub const FINALIZING: &str = "Finalizing";
}

/// How many times a conflicting status write is retried.
const ATTEMPTS: usize = 8;

/// Reads the object, lets `mutate` change a copy of its status and writes it back when it changed.
/// Returns whether a write happened; a missing object is not an error (`Ok(false)`).
pub async fn update_status<K, S, F>(
    api: &Api<K>,
    name: &str,
    mut mutate: F,
) -> Result<bool, kube::Error>
where
    K: Resource + HasStatus<Status = S> + Clone + DeserializeOwned + Debug,
    S: Default + Clone + PartialEq + Serialize,
    F: FnMut(&K, &mut S),
{
    let mut last_conflict = None;
    for _ in 0..ATTEMPTS {
        let Some(live) = api.get_opt(name).await? else {
            return Ok(false);
        };
        let current = live.status().cloned().unwrap_or_default();
        let mut desired = current.clone();
        mutate(&live, &mut desired);
        if desired == current {
            return Ok(false);
        }
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": live.resource_version()},
            "status": desired,
        });
        match api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => last_conflict = Some(kube::Error::Api(s)),
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Err(last_conflict
        .unwrap_or_else(|| kube::Error::Service("status update kept conflicting".into())))
}

/// Sets one condition in an optional list, stamped with `generation`.
pub fn set(
    conditions: &mut Option<Vec<Condition>>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    generation: Option<i64>,
) {
    let list = conditions.get_or_insert_with(Vec::new);
    set_condition(
        list,
        ConditionUpdate::new(type_, Status::from(status), reason)
            .message(message)
            .observed_generation(generation),
        Timestamp::now(),
    );
}

/// The condition of type `type_`.
pub fn find<'a>(conditions: &'a Option<Vec<Condition>>, type_: &str) -> Option<&'a Condition> {
    conditions
        .as_deref()
        .and_then(|c| k8s_reconcile::conditions::find(c, type_))
}

/// Whether the condition `type_` is `True`.
pub fn is_true(conditions: &Option<Vec<Condition>>, type_: &str) -> bool {
    find(conditions, type_).is_some_and(|c| c.status == "True")
}
