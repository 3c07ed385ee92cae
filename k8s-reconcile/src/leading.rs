//! Work that only the Lease holder does: [`run_while_leading`] campaigns, runs one term of work
//! per leadership and stops it before the Lease can pass to anyone else.
//!
//! [`ControllerBuilder::leader_election`](crate::ControllerBuilder::leader_election) is built on
//! it; a binary whose leader work is not one controller (a sweeper, a reconciler over a whole
//! set of objects) calls it directly.

use std::future::Future;

use kube::Client;
use tokio_util::sync::CancellationToken;

use crate::Error;
use crate::leader::{LeaderElector, LeaseConfig};
use crate::metrics::ControllerMetrics;
use crate::ops::Health;

/// Readiness check that shows the leadership state.
pub const LEADERSHIP_CHECK: &str = "leadership";

/// Where leadership is reported: the `leadership` readiness check (always passing: followers
/// are ready too, they only wait) and the leader gauge of `name`.
#[derive(Clone, Debug)]
pub struct Leadership {
    /// The name in the leader gauge (the controller's name).
    pub name: String,
    /// Readiness checks.
    pub health: Health,
    /// The leader gauge, when metrics are kept.
    pub metrics: Option<ControllerMetrics>,
}

impl Leadership {
    fn report(&self, state: &str, leading: bool) {
        self.health.set(LEADERSHIP_CHECK, true, state);
        if let Some(metrics) = &self.metrics {
            metrics.set_leader(&self.name, leading);
        }
    }
}

/// Campaigns for `lease` until `shutdown` and, for each term this replica leads, runs
/// `term(stop)`: `stop` is cancelled when the Lease is lost or on shutdown, and the next term (or
/// the release of the Lease) waits until that term's work has returned, so two replicas never
/// work at once.
pub async fn run_while_leading<F, Fut>(
    client: Client,
    lease: LeaseConfig,
    leadership: &Leadership,
    shutdown: CancellationToken,
    mut term: F,
) -> Result<(), Error>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let elector = LeaderElector::new(client, lease)?;
    let mut state = elector.subscribe();
    let elector_token = shutdown.child_token();
    let elector_task = tokio::spawn(elector.run(elector_token.clone()));
    loop {
        // Wait to lead (or to be told to stop).
        loop {
            let current = state.borrow_and_update().clone();
            leadership.report(&format!("{current:?}"), current.is_leader());
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
        // Lead until the Lease is lost or shutdown.
        let stop = shutdown.child_token();
        let work = tokio::spawn(term(stop.clone()));
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
        stop.cancel();
        if let Err(err) = work.await {
            tracing::error!(name = %leadership.name, error = %err, "leader work panicked");
        }
        leadership.report("term ended", false);
        if shutdown.is_cancelled() {
            // Release the Lease only after the term's work has finished.
            elector_token.cancel();
            let _ = elector_task.await;
            return Ok(());
        }
        tracing::warn!(name = %leadership.name, "lost the Lease; leader work stopped");
    }
}
