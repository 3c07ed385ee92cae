//! Keeps `default/kubernetes` (EndpointSlices and Endpoints) pointing at this proxy.
//!
//! The reconciled object is the proxy's own Service: its ClusterIP (cluster-ip mode) or the ready
//! addresses of its EndpointSlices (pod-ip mode) are what we publish. Changes to the `kubernetes`
//! slices or Endpoints, and to the proxy's own slices, trigger a reconcile at once, so drift is
//! repaired within a watch round-trip; `--reconcile-interval` is only a resync.
//!
//! When kube-apiserver's own endpoint reconciler is still running (it was not started with
//! `--endpoint-reconciler-type=none`), it rewrites the objects every ~10 s and we would rewrite them
//! back forever. [`FightDetector`] notices repeated repairs, reports the fight (log, Warning Event,
//! metric, `/readyz` detail) and spaces our rewrites out exponentially instead of hot-looping.
//!
//! Under a role without write access to Endpoints (the original's ClusterRole grants only
//! EndpointSlices), the slices are still managed and the Endpoints object is left alone: the
//! missing permission is found by asking ([`k8s_reconcile::permissions`]) at start, or from the first 403,
//! then reported once (log, metric, `/readyz` detail) and re-checked by asking again every
//! [`PERMISSION_RECHECK`], so no reconcile hits a 403 in between.
//!
//! In pod-ip mode a [`PeerCheck`] leaves out replicas that stopped answering, long before the
//! node controller marks their node NotReady (see [`k8s_reconcile::peers`]).

use std::collections::{BTreeSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_reconcile::auth::ResourceAccess;
use k8s_reconcile::endpointslice::{
    EndpointsOptions, EndpointsOutcome, ServiceEndpoint, ServiceEndpoints, ServicePort,
    apply_service_endpoints, desired_endpoints, ready_endpoints,
};
use k8s_reconcile::ops::Health;
use k8s_reconcile::permissions::{self, MissingPermissions};
use k8s_reconcile::{Action, Context, Reconciler};
use kube::ResourceExt as _;
use kube::api::{Api, ListParams};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::cli::EndpointMode;
use k8s_reconcile::peers::PeerCheck;

/// The Service whose endpoints we own.
pub const KUBERNETES_SERVICE: &str = "kubernetes";
/// Its namespace.
pub const KUBERNETES_NAMESPACE: &str = "default";
/// Value of `endpointslice.kubernetes.io/managed-by` on our slices; also our field manager.
pub const MANAGER: &str = "steward-tcp-proxy";
/// Readiness check name.
pub const CHECK: &str = "endpoints";
/// How often a missing permission is asked about again.
pub const PERMISSION_RECHECK: Duration = Duration::from_secs(300);
/// What steward does without write access to the Endpoints object.
pub const NO_ENDPOINTS_WRITE: &str = "the kubernetes Endpoints object is not written (the \
    EndpointSlices still are); asked again every 5m";
/// What steward does without permission to record Events.
pub const NO_EVENTS: &str = "no Events are recorded; warnings go to the log only";
/// What a role without `delete` on EndpointSlices (the original's) costs.
pub const NO_PRUNE: &str = "other EndpointSlices of the kubernetes Service are left in place, \
                            not pruned";

/// What writing the `kubernetes` Endpoints needs (the applier reads, then applies); the write
/// first, as the one a user misses.
pub fn endpoints_write_access() -> [ResourceAccess; 2] {
    [
        ResourceAccess::new("patch", "endpoints", KUBERNETES_NAMESPACE).name(KUBERNETES_SERVICE),
        ResourceAccess::new("get", "endpoints", KUBERNETES_NAMESPACE).name(KUBERNETES_SERVICE),
    ]
}

/// What watching the `kubernetes` Endpoints needs.
pub fn endpoints_watch_access() -> [ResourceAccess; 2] {
    [
        ResourceAccess::new("list", "endpoints", KUBERNETES_NAMESPACE).name(KUBERNETES_SERVICE),
        ResourceAccess::new("watch", "endpoints", KUBERNETES_NAMESPACE).name(KUBERNETES_SERVICE),
    ]
}

/// What pruning stale `kubernetes` EndpointSlices needs (the original's role lacks it).
pub fn slice_prune_access() -> ResourceAccess {
    ResourceAccess::new("delete", "endpointslices", KUBERNETES_NAMESPACE).group("discovery.k8s.io")
}

/// What recording an Event about the proxy Service needs.
pub fn events_access(namespace: &str) -> ResourceAccess {
    ResourceAccess::new("create", "events", namespace).group("events.k8s.io")
}

/// Settings of the endpoints reconciler.
#[derive(Debug, Clone)]
pub struct EndpointsConfig {
    /// Cluster-ip or pod-ip.
    pub mode: EndpointMode,
    /// The port published in cluster-ip mode.
    pub service_port: u16,
}

/// Reconcile failures.
#[derive(Debug, thiserror::Error)]
pub enum EndpointsError {
    /// The proxy Service has no ClusterIP (headless, or not allocated yet).
    #[error("Service {0} has no ClusterIP to publish")]
    NoClusterIp(String),
    /// The framework failed (API calls).
    #[error(transparent)]
    Framework(#[from] k8s_reconcile::Error),
    /// Listing the proxy's own EndpointSlices failed.
    #[error("cannot list the EndpointSlices of Service {service}")]
    ListSlices {
        /// The proxy Service.
        service: String,
        /// The API error.
        #[source]
        cause: kube::Error,
    },
}

/// Metrics of the endpoints reconciler.
#[derive(Debug, Clone, Default)]
pub struct EndpointsMetrics {
    repairs: Counter,
    writes: Counter,
    fight: Gauge,
}

impl EndpointsMetrics {
    /// Registers `steward_endpoint_*` metrics.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "steward_endpoint_writes",
            "Writes of the kubernetes EndpointSlices and Endpoints",
            metrics.writes.clone(),
        );
        registry.register(
            "steward_endpoint_repairs",
            "Writes that undid someone else's change to the kubernetes endpoints",
            metrics.repairs.clone(),
        );
        registry.register(
            "steward_endpoint_fight",
            "Whether another controller (kube-apiserver's endpoint reconciler) keeps rewriting the kubernetes endpoints",
            metrics.fight.clone(),
        );
        metrics
    }
}

/// Field manager of kube-apiserver's own endpoint reconciler.
pub const APISERVER_MANAGER: &str = "kube-apiserver";

/// Who undid our last write, as seen by one reconcile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    /// Nothing was repaired.
    None,
    /// kube-apiserver's endpoint reconciler (a fight from its first repeat).
    Apiserver,
    /// Someone else: a person, a script, another controller.
    Other,
}

/// Detects a fight over the endpoints and spaces out our rewrites while it lasts.
///
/// kube-apiserver's endpoint reconciler rewrites every ~10 s, so three of its changes undone
/// within a minute is a fight. Changes by anyone else are repaired at once (a person's edit, a
/// benchmark) unless they come at hot-loop rates (60 a minute).
#[derive(Debug)]
pub struct FightDetector {
    apiserver: VecDeque<Instant>,
    any: VecDeque<Instant>,
    window: Duration,
    apiserver_threshold: usize,
    any_threshold: usize,
    min_backoff: Duration,
    max_backoff: Duration,
    backoff: Duration,
    next_write: Option<Instant>,
}

impl Default for FightDetector {
    fn default() -> Self {
        Self::new(
            Duration::from_secs(60),
            3,
            60,
            Duration::from_secs(10),
            Duration::from_secs(300),
        )
    }
}

impl FightDetector {
    /// A detector over `window`: `apiserver_threshold` repairs of kube-apiserver's changes, or
    /// `any_threshold` repairs of anyone's, make a fight; then rewrites wait `min_backoff`,
    /// doubling up to `max_backoff`.
    pub fn new(
        window: Duration,
        apiserver_threshold: usize,
        any_threshold: usize,
        min_backoff: Duration,
        max_backoff: Duration,
    ) -> Self {
        Self {
            apiserver: VecDeque::new(),
            any: VecDeque::new(),
            window,
            apiserver_threshold,
            any_threshold,
            min_backoff,
            max_backoff,
            backoff: min_backoff,
            next_write: None,
        }
    }

    /// Whether a fight is going on.
    pub fn fighting(&self) -> bool {
        self.apiserver.len() >= self.apiserver_threshold || self.any.len() >= self.any_threshold
    }

    /// How long to hold off writing, if at all.
    pub fn hold_off(&self, now: Instant) -> Option<Duration> {
        self.next_write
            .filter(|at| *at > now)
            .map(|at| at.duration_since(now))
    }

    /// Records a reconcile; returns true when this repair starts a fight.
    pub fn record(&mut self, drift: Drift, now: Instant) -> bool {
        for queue in [&mut self.apiserver, &mut self.any] {
            while queue
                .front()
                .is_some_and(|t| now.duration_since(*t) > self.window)
            {
                queue.pop_front();
            }
        }
        let was_fighting = self.fighting();
        match drift {
            Drift::None => {}
            Drift::Apiserver => {
                self.apiserver.push_back(now);
                self.any.push_back(now);
            }
            Drift::Other => self.any.push_back(now),
        }
        if self.fighting() {
            if drift != Drift::None {
                self.next_write = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(self.max_backoff);
            }
        } else {
            self.backoff = self.min_backoff;
            self.next_write = None;
        }
        !was_fighting && self.fighting()
    }
}

/// The reconciler; see the [module docs](self).
pub struct EndpointsReconciler {
    config: EndpointsConfig,
    health: Health,
    metrics: EndpointsMetrics,
    fight: Arc<Mutex<FightDetector>>,
    permissions: MissingPermissions,
    /// Set while writing the Endpoints is denied: the denied access and when to ask again.
    endpoints_denied: Mutex<Option<(ResourceAccess, Instant)>>,
    /// The permission Events need, when it is missing.
    events_denied: Option<ResourceAccess>,
    /// Pruning other slices is denied: they are left alone rather than refused one 403 per
    /// reconcile.
    prune_denied: bool,
    /// Pod-ip mode: leaves out replicas that fail their peer checks.
    peer_check: Option<PeerCheck>,
}

impl EndpointsReconciler {
    /// A reconciler reporting to `health` and `metrics`.
    ///
    /// Only the replica that reconciles (the leader) reports the `endpoints` readiness check.
    pub fn new(
        config: EndpointsConfig,
        health: Health,
        metrics: EndpointsMetrics,
        permissions: MissingPermissions,
    ) -> Self {
        Self {
            config,
            health,
            metrics,
            fight: Arc::new(Mutex::new(FightDetector::default())),
            permissions,
            endpoints_denied: Mutex::new(None),
            events_denied: None,
            prune_denied: false,
            peer_check: None,
        }
    }

    /// Tracks the published replicas in `check` and leaves out those it finds down.
    #[must_use]
    pub fn peer_check(mut self, check: Option<PeerCheck>) -> Self {
        self.peer_check = check;
        self
    }

    /// Starts with writing the Endpoints denied (found out by asking at start).
    #[must_use]
    pub fn endpoints_denied(self, denied: Option<ResourceAccess>) -> Self {
        if let Some(access) = &denied {
            self.permissions.deny(access, NO_ENDPOINTS_WRITE);
        }
        if let Ok(mut slot) = self.endpoints_denied.lock() {
            *slot = denied.map(|a| (a, Instant::now() + PERMISSION_RECHECK));
        }
        self
    }

    /// Starts with recording Events denied.
    #[must_use]
    pub fn events_denied(mut self, denied: Option<ResourceAccess>) -> Self {
        if let Some(access) = &denied {
            self.permissions.deny(access, NO_EVENTS);
        }
        self.events_denied = denied;
        self
    }

    /// Starts with deleting EndpointSlices denied: stale slices are then not pruned.
    #[must_use]
    pub fn prune_denied(mut self, denied: Option<ResourceAccess>) -> Self {
        if let Some(access) = &denied {
            self.permissions.deny(access, NO_PRUNE);
        }
        self.prune_denied = denied.is_some();
        self
    }

    /// Writes the `kubernetes` Endpoints unless that is denied; `None` when it was not written.
    async fn write_endpoints(
        &self,
        spec: &ServiceEndpoints,
        ctx: &Context,
        now: Instant,
    ) -> Result<Option<k8s_reconcile::Applied<Endpoints>>, EndpointsError> {
        let denied = self.endpoints_denied.lock().ok().and_then(|d| d.clone());
        if let Some((access, retry_at)) = denied {
            if now < retry_at {
                return Ok(None);
            }
            // Ask rather than try: a refused try is one more 403 for the API server to log.
            let [patch, get] = endpoints_write_access();
            let still =
                permissions::first_denied(ctx.client(), &[access.clone(), patch, get]).await;
            self.set_endpoints_denied(Some(&access), still, now);
            if self
                .endpoints_denied
                .lock()
                .ok()
                .is_some_and(|d| d.is_some())
            {
                return Ok(None);
            }
        }
        match ctx.applier().apply(&desired_endpoints(spec)).await {
            Ok(applied) => Ok(Some(applied)),
            Err(k8s_reconcile::Error::Kube(kube::Error::Api(status))) if status.code == 403 => {
                let [patch, _] = endpoints_write_access();
                let access = permissions::denied_access(&status.message, &patch);
                self.set_endpoints_denied(None, Some(access), now);
                Ok(None)
            }
            Err(err) => Err(err.into()),
        }
    }

    fn set_endpoints_denied(
        &self,
        before: Option<&ResourceAccess>,
        now_denied: Option<ResourceAccess>,
        at: Instant,
    ) {
        if let Some(before) = before
            && now_denied.as_ref() != Some(before)
        {
            self.permissions.grant(before);
        }
        if let Some(access) = &now_denied {
            self.permissions.deny(access, NO_ENDPOINTS_WRITE);
        }
        if let Ok(mut slot) = self.endpoints_denied.lock() {
            *slot = now_denied.map(|a| (a, at + PERMISSION_RECHECK));
        }
    }

    /// What to publish for `service`.
    async fn desired(
        &self,
        service: &Service,
        ctx: &Context,
    ) -> Result<(Vec<ServiceEndpoint>, i32), EndpointsError> {
        let name = format!(
            "{}/{}",
            service.namespace().unwrap_or_default(),
            service.name_any()
        );
        let spec = service.spec.clone().unwrap_or_default();
        match self.config.mode {
            EndpointMode::ClusterIp => {
                let mut ips: Vec<IpAddr> = spec
                    .cluster_ips
                    .unwrap_or_default()
                    .iter()
                    .chain(spec.cluster_ip.iter())
                    .filter_map(|ip| ip.parse().ok())
                    .collect();
                ips.dedup();
                if ips.is_empty() {
                    return Err(EndpointsError::NoClusterIp(name));
                }
                let endpoints = ips.into_iter().map(ServiceEndpoint::ready).collect();
                Ok((endpoints, i32::from(self.config.service_port)))
            }
            EndpointMode::PodIp => {
                let ns = service.namespace().unwrap_or_default();
                let api: Api<EndpointSlice> = Api::namespaced(ctx.client().clone(), &ns);
                let selector = format!("kubernetes.io/service-name={}", service.name_any());
                let slices = api
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .map_err(|cause| EndpointsError::ListSlices {
                        service: name,
                        cause,
                    })?;
                // The Service port that is published: the one numbered --service-port, else the
                // first; its name finds the pod port in the slices.
                let ports = spec.ports.unwrap_or_default();
                let service_port = ports
                    .iter()
                    .find(|p| p.port == i32::from(self.config.service_port))
                    .or(ports.first());
                let port_name = service_port.and_then(|p| p.name.clone());
                let ready = ready_endpoints(&slices.items, port_name.as_deref());
                let port = ready.first().map(|e| i32::from(e.port));
                let mut endpoints: Vec<ServiceEndpoint> = Vec::new();
                for found in ready {
                    if !endpoints.iter().any(|e| e.ip == found.ip) {
                        let mut published = ServiceEndpoint::ready(found.ip);
                        published.node_name = found.node_name;
                        endpoints.push(published);
                    }
                }
                endpoints.sort_by_key(|e| e.ip);
                if let Some(check) = &self.peer_check {
                    // Every ready address is tracked, down or not: a down one is checked on, so
                    // that it comes back as soon as it answers.
                    check.track(endpoints.iter().map(|e| e.ip));
                    endpoints = without_down_peers(endpoints, &check.down());
                }
                Ok((
                    endpoints,
                    port.unwrap_or(i32::from(self.config.service_port)),
                ))
            }
        }
    }
}

impl EndpointsReconciler {
    /// Puts a failed reconcile into `/readyz`. The relay does not need the API server, so an
    /// unreachable or failing API leaves the replica ready (its detail says why the endpoints
    /// are not being kept, and the reconcile retries); only a Service that cannot be published
    /// at all makes it unready.
    fn report_error(&self, what: &str, err: &EndpointsError) {
        let ready = !matches!(err, EndpointsError::NoClusterIp(_));
        self.health.set(
            CHECK,
            ready,
            format!("{what}: {}", netkit_runtime::error_chain(err)),
        );
    }
}

impl Reconciler for EndpointsReconciler {
    type Resource = Service;
    type Error = EndpointsError;

    async fn reconcile(
        &self,
        service: Arc<Service>,
        ctx: &Context,
    ) -> Result<Action, EndpointsError> {
        let (endpoints, port) = match self.desired(&service, ctx).await {
            Ok(desired) => desired,
            Err(err) => {
                self.report_error("reading the desired endpoints", &err);
                return Err(err);
            }
        };
        if endpoints.is_empty() {
            // Like kube-apiserver's own reconciler, never erase the endpoints: an empty slice
            // would cut every in-cluster client off the API server.
            let detail = format!(
                "Service {} has no ready endpoints to publish; leaving the kubernetes endpoints as they are",
                service.name_any()
            );
            tracing::warn!("{detail}");
            // Not a readiness failure: in pod-ip mode no proxy pod is ready before the first one
            // reports ready, so failing here would keep every pod unready forever.
            self.health.set(CHECK, true, detail);
            return Ok(Action::Done);
        }
        let now = Instant::now();
        let hold = self.fight.lock().ok().and_then(|f| f.hold_off(now));
        if let Some(wait) = hold {
            return Ok(Action::RequeueAfter(wait));
        }
        let spec = ServiceEndpoints {
            namespace: KUBERNETES_NAMESPACE.to_owned(),
            service_name: KUBERNETES_SERVICE.to_owned(),
            managed_by: MANAGER.to_owned(),
            endpoints,
            ports: vec![ServicePort::tcp("https", port)],
            owner_references: Vec::new(),
        };
        // The Endpoints object is written apart, so that a role without it still manages slices.
        let options = EndpointsOptions {
            delete_other_slices: !self.prune_denied,
            write_endpoints: false,
        };
        let written = match apply_service_endpoints(ctx.applier(), &spec, options).await {
            Ok(outcome) => match self.write_endpoints(&spec, ctx, now).await {
                Ok(applied) => Ok(with_endpoints(outcome, applied.as_ref())),
                Err(err) => Err(err),
            },
            Err(err) => Err(err.into()),
        };
        let outcome = match written {
            Ok(outcome) => outcome,
            Err(err) => {
                self.report_error("writing the endpoints", &err);
                return Err(err);
            }
        };
        self.metrics.writes.inc_by(outcome.written as u64);
        self.metrics.repairs.inc_by(outcome.repaired as u64);
        let (started, fighting, hold) = match self.fight.lock() {
            Ok(mut fight) => {
                let drift = if outcome.repaired == 0 {
                    Drift::None
                } else if outcome.drifted_by.contains(APISERVER_MANAGER) {
                    Drift::Apiserver
                } else {
                    Drift::Other
                };
                let started = fight.record(drift, now);
                (started, fight.fighting(), fight.hold_off(now))
            }
            Err(_) => (false, false, None),
        };
        self.metrics.fight.set(i64::from(fighting));
        let addresses: Vec<String> = spec.endpoints.iter().map(|e| e.ip.to_string()).collect();
        if started {
            let note = "another controller keeps rewriting the kubernetes endpoints: start \
                        kube-apiserver with --endpoint-reconciler-type=none; backing off";
            tracing::error!(repaired = outcome.repaired, managers = ?outcome.drifted_by, "{note}");
            if self.events_denied.is_none() {
                ctx.publish_event(service.as_ref(), true, "EndpointsFight", note)
                    .await;
            }
        } else if outcome.written > 0 {
            tracing::info!(
                addresses = ?addresses,
                port,
                written = outcome.written,
                deleted = outcome.deleted,
                repaired = outcome.repaired,
                drifted_by = ?outcome.drifted_by,
                "kubernetes endpoints updated"
            );
        }
        if fighting {
            self.health.set(
                CHECK,
                false,
                "fighting with kube-apiserver's endpoint reconciler (needs --endpoint-reconciler-type=none)",
            );
        } else {
            let mut detail = format!("kubernetes -> {}:{port}", addresses.join(","));
            let missing = self.permissions.summary();
            if !missing.is_empty() {
                detail.push_str("; ");
                detail.push_str(&missing);
            }
            self.health.set(CHECK, true, detail);
        }
        Ok(match hold {
            Some(wait) => Action::RequeueAfter(wait),
            None => Action::Done,
        })
    }
}

/// `endpoints` without the `down` ones, unless that leaves none: then all of them, since a
/// peer check that fails everywhere more likely says the check cannot get through (a network
/// policy, a firewall) than that every replica died, and no endpoints would cut every client off.
fn without_down_peers(
    endpoints: Vec<ServiceEndpoint>,
    down: &BTreeSet<IpAddr>,
) -> Vec<ServiceEndpoint> {
    if down.is_empty() {
        return endpoints;
    }
    let (up, left_out): (Vec<_>, Vec<_>) =
        endpoints.into_iter().partition(|e| !down.contains(&e.ip));
    if up.is_empty() && !left_out.is_empty() {
        tracing::warn!(
            down = ?down,
            "every ready replica fails its peer check; publishing them all rather than none"
        );
        return left_out;
    }
    up
}

/// `outcome` with the Endpoints write added.
fn with_endpoints(
    mut outcome: EndpointsOutcome,
    applied: Option<&k8s_reconcile::Applied<Endpoints>>,
) -> EndpointsOutcome {
    if let Some(applied) = applied {
        if applied.written() {
            outcome.written += 1;
        }
        if applied.repaired() {
            outcome.repaired += 1;
            outcome
                .drifted_by
                .extend(applied.drifted_by().iter().cloned());
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector() -> FightDetector {
        FightDetector::new(
            Duration::from_secs(60),
            3,
            10,
            Duration::from_secs(10),
            Duration::from_secs(40),
        )
    }

    #[test]
    fn repeated_apiserver_rewrites_start_a_fight_and_space_out_writes() {
        let mut fight = detector();
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        assert!(!fight.record(Drift::Apiserver, at(0)));
        assert!(!fight.record(Drift::Apiserver, at(10)));
        assert_eq!(fight.hold_off(at(10)), None);
        assert!(fight.record(Drift::Apiserver, at(20)));
        assert!(fight.fighting());
        assert_eq!(fight.hold_off(at(20)), Some(Duration::from_secs(10)));
        // Each further repair doubles the wait, up to the maximum.
        fight.record(Drift::Apiserver, at(30));
        assert_eq!(fight.hold_off(at(30)), Some(Duration::from_secs(20)));
        fight.record(Drift::Apiserver, at(50));
        fight.record(Drift::Apiserver, at(90));
        assert_eq!(fight.hold_off(at(90)), Some(Duration::from_secs(40)));
        // A quiet window ends the fight and resets the backoff.
        fight.record(Drift::None, at(200));
        assert!(!fight.fighting());
        assert_eq!(fight.hold_off(at(200)), None);
    }

    #[test]
    fn other_edits_are_repaired_at_once_unless_they_come_at_hot_loop_rates() {
        let mut fight = detector();
        let t0 = Instant::now();
        for i in 0..9 {
            assert!(!fight.record(Drift::Other, t0 + Duration::from_secs(i)));
            assert_eq!(fight.hold_off(t0 + Duration::from_secs(i)), None);
        }
        assert!(fight.record(Drift::Other, t0 + Duration::from_secs(9)));
    }

    fn endpoint(last: u8) -> ServiceEndpoint {
        ServiceEndpoint::ready(IpAddr::from([10, 244, 0, last]))
    }

    fn ips(endpoints: &[ServiceEndpoint]) -> Vec<IpAddr> {
        endpoints.iter().map(|e| e.ip).collect()
    }

    #[test]
    fn down_peers_are_left_out_but_never_all_of_them() {
        let ready = vec![endpoint(1), endpoint(2), endpoint(3)];
        let down = BTreeSet::from([endpoint(2).ip]);
        let published = without_down_peers(ready.clone(), &down);
        assert_eq!(ips(&published), ips(&[endpoint(1), endpoint(3)]));
        assert_eq!(
            ips(&without_down_peers(ready.clone(), &BTreeSet::new())),
            ips(&ready)
        );
        // Down addresses that are no longer ready do not count.
        let down = BTreeSet::from([endpoint(1).ip, endpoint(9).ip]);
        assert_eq!(
            ips(&without_down_peers(ready.clone(), &down)),
            ips(&ready[1..])
        );
        // Every one down: all are published, never none.
        let down: BTreeSet<_> = ips(&ready).into_iter().collect();
        assert_eq!(ips(&without_down_peers(ready.clone(), &down)), ips(&ready));
        assert!(without_down_peers(Vec::new(), &down).is_empty());
    }

    #[test]
    fn occasional_apiserver_rewrites_are_no_fight() {
        let mut fight = FightDetector::default();
        let t0 = Instant::now();
        for i in 0..5 {
            assert!(!fight.record(Drift::Apiserver, t0 + Duration::from_secs(100 * i)));
        }
        assert!(!fight.fighting());
    }
}
