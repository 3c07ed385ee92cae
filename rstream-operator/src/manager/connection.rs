//! The RstreamConnection controller: checks the Secrets, resolves the engine, reports `Ready`.

use std::sync::Arc;
use std::time::Duration;

use k8s_reconcile::conditions::Conditions;
use k8s_reconcile::{Action, Context, Reconciler};
use kube::ResourceExt as _;
use kube::api::Api;

use super::ManagerError;
use super::resolve::{ResolveError, resolve};
use crate::api::{RstreamConnection, RstreamConnectionStatus};
use crate::status::{self, reasons, types};

/// Retry delay of a connection whose control-plane lookup failed (it may be transient).
const RETRY_UNRESOLVED: Duration = Duration::from_secs(60);

/// Reconciles RstreamConnections.
#[derive(Debug, Default)]
pub struct ConnectionReconciler;

impl Reconciler for ConnectionReconciler {
    type Resource = RstreamConnection;
    type Error = ManagerError;

    async fn reconcile(
        &self,
        connection: Arc<RstreamConnection>,
        ctx: &Context,
    ) -> Result<Action, ManagerError> {
        let namespace = connection.namespace().unwrap_or_default();
        let generation = connection.metadata.generation;
        let api: Api<RstreamConnection> = Api::namespaced(ctx.client().clone(), &namespace);
        let outcome = resolve(ctx.client(), connection.as_ref().clone()).await;
        let (action, result) = match outcome {
            Ok(resolved) => (Action::Done, Ok(resolved)),
            Err(ResolveError::Kube(e)) => return Err(e.into()),
            Err(e @ ResolveError::SecretMissing(_)) => {
                (Action::Done, Err((reasons::SECRET_MISSING, e.to_string())))
            }
            // Only an edit of the spec changes this: no timed retry.
            Err(e @ ResolveError::InvalidSpec(_)) => {
                (Action::Done, Err((reasons::INVALID_SPEC, e.to_string())))
            }
            Err(e) => (
                Action::RequeueAfter(RETRY_UNRESOLVED),
                Err((reasons::INVALID_SPEC, e.to_string())),
            ),
        };
        status::update_status_from(&api, &connection, |_, s: &mut RstreamConnectionStatus| {
            s.observed_generation = generation;
            let mut conditions = Conditions::of(&mut s.conditions, generation);
            match &result {
                Err((reason, message)) => {
                    conditions.set(types::READY, false, reason, message.clone());
                    (s.api_url, s.project_id, s.project_endpoint) = Default::default();
                    (s.region, s.engine) = Default::default();
                }
                Ok(r) => {
                    conditions.set(
                        types::READY,
                        true,
                        reasons::READY,
                        "Connection settings are ready.",
                    );
                    // Project fields are shown only when the control plane resolved them.
                    let by_api = |v: &Option<String>| v.clone().filter(|_| r.api_url.is_some());
                    s.api_url = r.api_url.clone();
                    s.project_id = by_api(&r.connection.spec.project_id);
                    s.project_endpoint = by_api(&r.connection.spec.project_endpoint);
                    s.region = r.region.clone();
                    s.engine = Some(r.engine.to_string());
                }
            }
        })
        .await?;
        Ok(action)
    }
}
