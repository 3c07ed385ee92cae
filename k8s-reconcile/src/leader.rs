//! Leader election on a `coordination.k8s.io/v1` Lease, with client-go's semantics.
//!
//! * A candidate takes the Lease when it is free, released, or unchanged for a whole lease duration
//!   as observed on the candidate's own clock (so clock skew between replicas does not matter).
//! * The leader renews every retry period and **steps down by itself** when it could not renew for
//!   the renew deadline, which is shorter than the lease duration: it stops acting before anyone
//!   else may start, so at most one replica leads at any time.
//! * One attempt takes at most [`LeaseConfig::attempt_limit`]: a request that hangs on a dead
//!   connection is dropped with it and the next attempt dials again at once, so a lost API server
//!   endpoint delays a successor by seconds, not by the renew deadline.
//! * On shutdown the leader releases the Lease (empty holder), so a successor takes over at its next
//!   retry instead of waiting for expiry.
//! * Every write carries the `resourceVersion` it read, so two candidates never both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Where and how to hold the Lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (e.g. the pod name); must be unique among candidates.
    pub identity: String,
    /// How long a Lease stays valid without renewal (default 15 s).
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it steps down (default 10 s).
    pub renew_deadline: Duration,
    /// How often candidates retry and the leader renews (default 2 s).
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// A config with client-go's default timings.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// The longest one attempt (a read and a write of the Lease) may take: a third of the renew
    /// deadline, so a leader whose requests hang gets at least three tries, each on a new
    /// connection, before it steps down.
    pub fn attempt_limit(&self) -> Duration {
        self.renew_deadline / 3
    }

    /// Checks `retry_period < renew_deadline < lease_duration`, whole seconds for the lease, and
    /// non-empty names.
    pub fn validate(&self) -> Result<(), Error> {
        let problem = if self.namespace.is_empty() || self.name.is_empty() {
            Some("the Lease namespace and name must not be empty")
        } else if self.identity.is_empty() {
            Some("the identity must not be empty")
        } else if self.retry_period.is_zero() {
            Some("the retry period must be positive")
        } else if self.renew_deadline <= self.retry_period {
            Some("the renew deadline must be longer than the retry period")
        } else if self.lease_duration <= self.renew_deadline {
            Some("the lease duration must be longer than the renew deadline")
        } else if self.lease_duration.as_secs() == 0 || self.lease_duration.subsec_nanos() != 0 {
            Some("the lease duration must be a whole number of seconds")
        } else {
            None
        };
        match problem {
            Some(p) => Err(Error::InvalidConfig(format!("leader election: {p}"))),
            None => Ok(()),
        }
    }
}

/// What this replica knows about leadership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaderState {
    /// No attempt has completed yet.
    Unknown,
    /// This replica holds the Lease.
    Leader,
    /// Another replica holds it (or nobody does right now).
    Follower {
        /// The current holder, if any.
        holder: Option<String>,
    },
}

impl LeaderState {
    /// Whether this replica leads.
    pub fn is_leader(&self) -> bool {
        matches!(self, Self::Leader)
    }
}

/// Runs the election; see the [module docs](self).
#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    state: watch::Sender<LeaderState>,
}

/// What the candidate last saw of the Lease, and when (on its own clock).
struct Observation {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    resource_version: Option<String>,
    at: Instant,
}

impl LeaderElector {
    /// An elector for `config` (validated).
    pub fn new(client: Client, config: LeaseConfig) -> Result<Self, Error> {
        config.validate()?;
        let api = Api::namespaced(client, &config.namespace);
        let (state, _) = watch::channel(LeaderState::Unknown);
        Ok(Self { api, config, state })
    }

    /// A receiver of state changes.
    pub fn subscribe(&self) -> watch::Receiver<LeaderState> {
        self.state.subscribe()
    }

    /// Campaigns and renews until `shutdown` is cancelled, then releases the Lease if held.
    pub async fn run(self, shutdown: CancellationToken) {
        let mut observed: Option<Observation> = None;
        let mut last_renew: Option<Instant> = None;
        loop {
            // A leader must know it failed before its renew deadline passes, even if the API call
            // hangs: bound the attempt by what is left of the deadline. And by a third of it, so
            // a request stuck on a dead connection (an API server endpoint behind a lost node)
            // costs one short attempt, not the whole deadline: hyper drops the connection with the
            // request and the next attempt, started at once, dials again.
            let left = match last_renew {
                Some(at) => self.config.renew_deadline.saturating_sub(at.elapsed()),
                None => self.config.renew_deadline,
            };
            let budget = left.min(self.config.attempt_limit());
            let attempt =
                tokio::time::timeout(budget, self.try_acquire_or_renew(&mut observed)).await;
            let timed_out = attempt.is_err();
            let attempt = attempt.unwrap_or_else(|_| {
                Err(Error::Timeout(format!(
                    "leader election attempt took longer than {budget:?}"
                )))
            });
            match attempt {
                Ok(true) => {
                    last_renew = Some(Instant::now());
                    self.publish(LeaderState::Leader);
                }
                Ok(false) => {
                    last_renew = None;
                    let holder = observed.as_ref().and_then(|o| o.holder.clone());
                    self.publish(LeaderState::Follower { holder });
                }
                Err(err) => {
                    tracing::warn!(lease = %self.config.name, error = %crate::error::chain(&err), "leader election attempt failed");
                    // A leader that cannot renew steps down before its Lease can expire elsewhere.
                    let lost =
                        last_renew.is_some_and(|at| at.elapsed() >= self.config.renew_deadline);
                    if lost {
                        last_renew = None;
                        self.publish(LeaderState::Follower { holder: None });
                    }
                }
            }
            // An attempt that timed out has already waited its share; the next goes at once.
            let pause = if timed_out {
                Duration::ZERO
            } else {
                self.config.retry_period
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        if self.state.borrow().is_leader() {
            self.publish(LeaderState::Follower { holder: None });
            if let Err(err) = self.release().await {
                tracing::warn!(lease = %self.config.name, error = %crate::error::chain(&err), "could not release the Lease");
            }
        }
    }

    fn publish(&self, state: LeaderState) {
        self.state.send_if_modified(|current| {
            if *current == state {
                return false;
            }
            match &state {
                LeaderState::Leader => {
                    tracing::info!(lease = %self.config.name, identity = %self.config.identity, "became leader")
                }
                LeaderState::Follower { holder } if current.is_leader() => {
                    tracing::info!(lease = %self.config.name, holder = ?holder, "stopped leading")
                }
                _ => {}
            }
            *current = state;
            true
        });
    }

    /// One campaign step: `Ok(true)` when this replica holds the Lease afterwards.
    async fn try_acquire_or_renew(
        &self,
        observed: &mut Option<Observation>,
    ) -> Result<bool, Error> {
        let now = MicroTime(Timestamp::now());
        let Some(lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(Error::Kube)?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.config.name.clone()),
                    namespace: Some(self.config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.held_spec(now.clone(), Some(now), 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(err) => Err(Error::Kube(err)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let changed = observed.as_ref().is_none_or(|o| {
            o.holder != holder
                || o.renew_time != spec.renew_time
                || o.resource_version != lease.metadata.resource_version
        });
        if changed {
            *observed = Some(Observation {
                holder: holder.clone(),
                renew_time: spec.renew_time.clone(),
                resource_version: lease.metadata.resource_version.clone(),
                at: Instant::now(),
            });
        }
        let ours = holder.as_deref() == Some(self.config.identity.as_str());
        let duration = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        let expired = observed
            .as_ref()
            .is_some_and(|o| o.at.elapsed() >= duration);
        if !ours && holder.is_some() && !expired {
            return Ok(false);
        }
        let transitions = spec.lease_transitions.unwrap_or(0);
        let new_spec = if ours {
            self.held_spec(
                spec.acquire_time.clone().unwrap_or(now.clone()),
                Some(now),
                transitions,
            )
        } else {
            self.held_spec(now.clone(), Some(now), transitions.saturating_add(1))
        };
        let mut updated = lease;
        updated.spec = Some(new_spec);
        // replace() sends the resourceVersion we read: a concurrent writer makes this fail with 409.
        match self
            .api
            .replace(&self.config.name, &PostParams::default(), &updated)
            .await
        {
            Ok(written) => {
                *observed = Some(Observation {
                    holder: Some(self.config.identity.clone()),
                    renew_time: written.spec.and_then(|s| s.renew_time),
                    resource_version: written.metadata.resource_version,
                    at: Instant::now(),
                });
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(err) => Err(Error::Kube(err)),
        }
    }

    fn held_spec(
        &self,
        acquire: MicroTime,
        renew: Option<MicroTime>,
        transitions: i32,
    ) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.config.identity.clone()),
            lease_duration_seconds: i32::try_from(self.config.lease_duration.as_secs()).ok(),
            acquire_time: Some(acquire),
            renew_time: renew,
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Gives the Lease up: no holder and a one-second duration, as client-go does.
    async fn release(&self) -> Result<(), Error> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.config.name)
            .await
            .map_err(Error::Kube)?
        else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
            .map_err(Error::Kube)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_must_nest() {
        let ok = LeaseConfig::new("ns", "lease", "me");
        assert!(ok.validate().is_ok());
        let mut bad = ok.clone();
        bad.renew_deadline = bad.lease_duration;
        assert!(bad.validate().is_err());
        let mut bad = ok.clone();
        bad.retry_period = bad.renew_deadline;
        assert!(bad.validate().is_err());
        let mut bad = ok.clone();
        bad.lease_duration = Duration::from_millis(15_500);
        assert!(bad.validate().is_err());
        let mut bad = ok;
        bad.identity.clear();
        assert!(bad.validate().is_err());
    }
}
