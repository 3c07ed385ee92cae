//! Condition types and reasons of both resources, and status writes shared by the manager and the
//! agent ([`update_status`]: guarded by the `resourceVersion` read, so two writers never lose each
//! other's conditions).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::conditions::{ConditionUpdate, Status, set_condition};

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

/// Status writes with conflict retries, from the framework.
pub use k8s_reconcile::apply::update_status;

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
