//! Condition types and reasons of both resources, and status writes shared by the manager and the
//! agent ([`update_status`]: guarded by the `resourceVersion` read, so two writers never lose each
//! other's conditions).

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

/// Condition messages written by both the manager and the agent.
pub mod messages {
    /// Accepted=True.
    pub const SPEC_VALID: &str = "The tunnel spec is valid.";
    /// Resolved=True.
    pub const RESOLVED: &str = "The Service, port, connection and Secret keys exist.";
    /// AgentReady=True.
    pub const AGENT_AVAILABLE: &str = "The agent Deployment is available.";
    /// AgentReady=False, and Ready=False until it is.
    pub const AGENT_PENDING: &str = "Waiting for the agent Deployment to become available.";
    /// TunnelReady=False while connecting.
    pub const CONNECTING: &str = "Tunnel agent is connecting to rstream.";
    /// Ready=False until the tunnel is online.
    pub const WAITING_FOR_TUNNEL: &str = "Waiting for the rstream tunnel to come online.";
    /// Ready=False after the tunnel went down.
    pub const RECONNECTING: &str = "Waiting for the rstream tunnel to reconnect.";
    /// Ready=True.
    pub const READY: &str = "The tunnel is ready.";
    /// Ready=False while deleting.
    pub const FINALIZING: &str = "Deleting the agent and its objects.";
}

/// Status writes with conflict retries, from the framework.
pub use k8s_reconcile::apply::{update_status, update_status_from};
