//! The hand-over channel of the agents of one tunnel: the `HandOver` condition of their
//! RstreamTunnel's status, which every agent may already read and write (its Role: `get` on the
//! tunnel, `patch` on its status). A standby reads it between its slow requests for the
//! hostname, about as often as a leader-election candidate reads its Lease; the leaving holder
//! reads it every [`READY_POLL`](super::holder) for at most a few seconds.
//!
//! `HandOver=True` `HolderLeaving`: the holder is leaving; `HandOver=True` `StandbyTakingOver`: a
//! standby is ready and asking fast; `HandOver=False` `HandedOver`: the new holder holds the
//! tunnel (written with its online report).

use k8s_reconcile::conditions::{self, Conditions};
use kube::api::Api;
use netkit_runtime::error_chain;

use super::holder::HandOver;
use crate::api::{RstreamTunnel, RstreamTunnelStatus};
use crate::status;

/// The condition type.
pub(crate) const HAND_OVER: &str = "HandOver";
/// The holder is leaving.
const HOLDER_LEAVING: &str = "HolderLeaving";
/// A standby is ready to take the tunnel.
const STANDBY_TAKING_OVER: &str = "StandbyTakingOver";
/// The hand-over is done.
pub(crate) const HANDED_OVER: &str = "HandedOver";

/// The hand-over through the tunnel's status, as agent pod `pod`.
pub(crate) struct StatusHandOver {
    pub(crate) api: Api<RstreamTunnel>,
    pub(crate) tunnel: String,
    pub(crate) pod: String,
}

impl StatusHandOver {
    /// The `HandOver` condition's status and reason, if the tunnel can be read.
    async fn read(&self) -> Option<(String, String)> {
        match self.api.get(&self.tunnel).await {
            Ok(t) => {
                let list = t.status.and_then(|s| s.conditions).unwrap_or_default();
                conditions::find(&list, HAND_OVER).map(|c| (c.status.clone(), c.reason.clone()))
            }
            Err(error) => {
                tracing::warn!(component = "handover", error = %error_chain(&error), "cannot read the hand-over");
                None
            }
        }
    }

    async fn write(&self, only_under_way: bool, reason: &str, message: String) {
        let written =
            status::update_status(&self.api, &self.tunnel, |t, s: &mut RstreamTunnelStatus| {
                let list = s.conditions.as_deref().unwrap_or_default();
                if only_under_way && !conditions::is_true(list, HAND_OVER) {
                    return;
                }
                Conditions::of(&mut s.conditions, t.metadata.generation).set(
                    HAND_OVER,
                    true,
                    reason,
                    message.clone(),
                );
            })
            .await;
        if let Err(error) = written {
            tracing::warn!(component = "handover", error = %error_chain(&error), reason, "cannot write the hand-over");
        }
    }
}

impl HandOver for StatusHandOver {
    async fn announce(&self) {
        let message = format!(
            "Agent pod {} is leaving; a standby takes the tunnel over.",
            self.pod
        );
        self.write(false, HOLDER_LEAVING, message).await;
    }

    async fn taken_up(&self) -> bool {
        self.read()
            .await
            .is_some_and(|(status, reason)| status == "True" && reason == STANDBY_TAKING_OVER)
    }

    async fn leaving(&self) -> bool {
        self.read()
            .await
            .is_some_and(|(status, _)| status == "True")
    }

    async fn take_up(&self) {
        let message = format!("Agent pod {} is taking the tunnel over.", self.pod);
        // Only while under way: a hand-over already done is not reopened.
        self.write(true, STANDBY_TAKING_OVER, message).await;
    }
}
