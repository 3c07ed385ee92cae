//! V2: every TCP port named `--port-name` of the Services in the allowed namespaces gets its own
//! entry port from the range, recorded as a PortMapping `svc.<ns>.<service>.<port-name>`.
//!
//! The allocation is stable: the PortMapping keeps the port across restarts and Service updates,
//! and it is released (and quarantined for a while before reuse) only when the Service, the
//! port, its name or the namespace's admission goes away. A full range is reported as a Warning
//! Event on the Service, a metric and a log line, and retried on every change.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_reconcile::apply::delete_unchanged;
use k8s_reconcile::endpointslice::{SERVICE_NAME_LABEL, ready_endpoints};
use k8s_reconcile::watch_set::WatchSet;
use k8s_reconcile::{Applier, Context};
use kube::ResourceExt as _;
use kube::api::Api;
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;

use crate::config::V2Target;
use crate::crd::{CONTROLLER, MappingKind, MappingTarget, PortMapping, PortMappingSpec};
use crate::forwarding::Mappings;
use crate::metrics::Metrics;
use crate::settings::{Settings, V2Policy};
use crate::ttl::now_millis;

/// How long a released port is avoided, so a client of the old Service does not land on a new
/// one at once.
const QUARANTINE_MILLIS: i64 = 60_000;
/// Changes arriving within this window are reconciled together.
const DEBOUNCE: Duration = Duration::from_millis(50);

/// One Service port that should be published.
#[derive(Debug, Clone)]
struct Wanted {
    service: Arc<Service>,
    port_name: String,
    port: i32,
    upstreams: Vec<SocketAddr>,
}

/// The PortMapping name of a Service port.
pub fn mapping_name(namespace: &str, service: &str, port_name: &str) -> String {
    format!("svc.{namespace}.{service}.{port_name}")
}

/// What the V2 reconciler reads and writes.
#[derive(Clone)]
pub struct V2Inputs {
    /// Flags.
    pub settings: Arc<Settings>,
    /// Client with pod-proxier's own identity.
    pub client: kube::Client,
    /// PortMappings of the state namespace.
    pub api: Api<PortMapping>,
    /// The cache of PortMappings.
    pub mappings: Mappings,
    /// Metrics.
    pub metrics: Metrics,
}

/// The V2 reconciler, run by the leader.
pub struct V2Reconciler {
    work: V2Inputs,
    /// What to publish, where.
    policy: V2Policy,
    applier: Applier,
    events: Context,
    services: BTreeMap<String, Store<Service>>,
    slices: BTreeMap<String, Store<EndpointSlice>>,
    /// Released ports and when.
    quarantine: HashMap<u16, i64>,
    /// Service ports already reported as unallocatable (reported again once allocated).
    exhausted: HashSet<String>,
    /// Our own writes the cache may not show yet: a second pass right after an allocation must
    /// not allocate again.
    written: HashMap<String, Arc<PortMapping>>,
    /// Our own deletions the cache may not show yet.
    deleted: HashSet<String>,
}

fn version(mapping: &PortMapping) -> u64 {
    mapping
        .resource_version()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl V2Reconciler {
    /// A reconciler publishing what `policy` says.
    pub fn new(work: V2Inputs, policy: V2Policy) -> Self {
        let client = work.client.clone();
        Self {
            policy,
            applier: Applier::new(client.clone(), CONTROLLER),
            events: Context::new(client, CONTROLLER, CONTROLLER),
            work,
            services: BTreeMap::new(),
            slices: BTreeMap::new(),
            quarantine: HashMap::new(),
            exhausted: HashSet::new(),
            written: HashMap::new(),
            deleted: HashSet::new(),
        }
    }

    /// Watches Services (and EndpointSlices) of every allowed namespace and reconciles on every
    /// change and every resync period, until `stop`.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut watches = WatchSet::new(self.policy.resync, DEBOUNCE);
        let settings = Arc::clone(&self.work.settings);
        for namespace in &settings.policy.allowed_namespaces {
            let client = self.work.client.clone();
            let services = watches.watch(
                Api::<Service>::namespaced(client.clone(), namespace),
                watcher::Config::default(),
            );
            self.services.insert(namespace.clone(), services);
            if self.policy.target == V2Target::Endpoints {
                let slices = watches.watch(
                    Api::<EndpointSlice>::namespaced(client, namespace),
                    watcher::Config::default(),
                );
                self.slices.insert(namespace.clone(), slices);
            }
        }
        while watches.next_pass(&stop).await {
            self.reconcile().await;
        }
    }

    fn upstreams(&self, service: &Service, port_name: &str, port: i32) -> Vec<SocketAddr> {
        let namespace = service.namespace().unwrap_or_default();
        let mut upstreams = Vec::new();
        match self.policy.target {
            V2Target::ClusterIp => {
                let ips = service.spec.as_ref().and_then(|s| s.cluster_ip.clone());
                if let (Some(text), Ok(port)) = (ips, u16::try_from(port)) {
                    // The Service's edge: the API server validates ClusterIPs, so this is said
                    // rather than dropped should one ever not be an address.
                    match text.parse::<IpAddr>() {
                        Ok(ip) => upstreams.push(SocketAddr::new(ip, port)),
                        Err(err) => tracing::error!(
                            service = %format!("{namespace}/{}", service.name_any()),
                            cluster_ip = %text,
                            error = %err,
                            "the Service's ClusterIP is not an IP address: its port has no upstream"
                        ),
                    }
                }
            }
            V2Target::Endpoints => {
                let Some(store) = self.slices.get(&namespace) else {
                    return upstreams;
                };
                let name = service.name_any();
                let slices: Vec<_> = store
                    .state()
                    .into_iter()
                    .filter(|slice| slice.labels().get(SERVICE_NAME_LABEL) == Some(&name))
                    .collect();
                let ready = ready_endpoints(slices.iter().map(AsRef::as_ref), Some(port_name));
                upstreams.extend(ready.into_iter().map(|e| SocketAddr::new(e.ip, e.port)));
            }
        }
        // In the order of their text, as when they were strings: existing PortMappings compare
        // equal and are not rewritten.
        upstreams.sort_by_cached_key(ToString::to_string);
        upstreams.dedup();
        upstreams
    }

    fn wanted(&self) -> BTreeMap<String, Wanted> {
        let policy = &self.policy;
        let mut wanted = BTreeMap::new();
        for (namespace, store) in &self.services {
            for service in store.state() {
                let Some(spec) = service.spec.as_ref() else {
                    continue;
                };
                if spec.type_.as_deref() == Some("ExternalName") {
                    continue;
                }
                if policy.target == V2Target::ClusterIp
                    && matches!(spec.cluster_ip.as_deref(), None | Some("" | "None"))
                {
                    continue;
                }
                for port in spec.ports.iter().flatten() {
                    let tcp = port.protocol.as_deref().is_none_or(|p| p == "TCP");
                    if !tcp || port.name.as_deref() != Some(policy.port_name.as_str()) {
                        continue;
                    }
                    let name = mapping_name(namespace, &service.name_any(), &policy.port_name);
                    wanted.insert(
                        name,
                        Wanted {
                            upstreams: self.upstreams(&service, &policy.port_name, port.port),
                            service: Arc::clone(&service),
                            port_name: policy.port_name.clone(),
                            port: port.port,
                        },
                    );
                }
            }
        }
        wanted
    }

    fn mapping(&self, name: &str, wanted: &Wanted, entry_port: u16) -> PortMapping {
        PortMapping::owned(
            name,
            &self.work.settings.cluster.state_namespace,
            PortMappingSpec {
                kind: MappingKind::Service,
                target: MappingTarget {
                    namespace: wanted.service.namespace().unwrap_or_default(),
                    name: wanted.service.name_any(),
                    port_name: Some(wanted.port_name.clone()),
                    port: Some(wanted.port),
                },
                entry_port: i32::from(entry_port),
                upstreams: wanted.upstreams.clone(),
                expires_at: None,
                close_connections: false,
                requested_by: None,
                requested_from: None,
                allowed_sources: None,
            },
        )
    }

    /// One full pass: release what is no longer wanted, update and allocate the rest.
    async fn reconcile(&mut self) {
        let range = self.policy.port_range;
        let (start, end) = (range.start(), range.end());
        let now = now_millis();
        let wanted = self.wanted();
        let mut existing: BTreeMap<String, Arc<PortMapping>> = self
            .work
            .mappings
            .all()
            .into_iter()
            .filter(|m| m.spec.kind == MappingKind::Service)
            .map(|m| (m.name_any(), m))
            .collect();
        self.deleted.retain(|name| existing.remove(name).is_some());
        self.written.retain(|name, ours| match existing.get(name) {
            Some(cached) if version(cached) >= version(ours) => false,
            _ => {
                existing.insert(name.clone(), Arc::clone(ours));
                true
            }
        });
        let mut used: HashSet<u16> = HashSet::new();
        for (name, mapping) in &existing {
            let port = u16::try_from(mapping.spec.entry_port).ok();
            let keep = wanted.contains_key(name)
                && port.is_some_and(|p| range.contains(p))
                && !port.is_some_and(|p| used.contains(&p));
            if keep {
                if let Some(port) = port {
                    used.insert(port);
                }
                continue;
            }
            let params = delete_unchanged(mapping.resource_version());
            match self.work.api.delete(name, &params).await {
                Ok(_) => {
                    self.deleted.insert(name.clone());
                    self.written.remove(name);
                    tracing::info!(mapping = %name, entry_port = mapping.spec.entry_port, "Service port unpublished, entry port released");
                    if let Some(port) = port {
                        self.quarantine.insert(port, now);
                    }
                }
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => tracing::warn!(mapping = %name, error = %err, "releasing a V2 port"),
            }
        }
        self.quarantine
            .retain(|_, at| now - *at < QUARANTINE_MILLIS);
        self.exhausted.retain(|key| wanted.contains_key(key));
        for (name, want) in &wanted {
            if let Some(current) = existing
                .get(name)
                .filter(|m| u16::try_from(m.spec.entry_port).is_ok_and(|p| used.contains(&p)))
            {
                let Ok(port) = u16::try_from(current.spec.entry_port) else {
                    continue;
                };
                let desired = self.mapping(name, want, port);
                if desired.spec != current.spec {
                    match self.applier.apply(&desired).await {
                        Ok(applied) => {
                            self.written
                                .insert(name.clone(), Arc::new(applied.into_inner()));
                        }
                        Err(err) => {
                            tracing::warn!(mapping = %name, error = %err, "updating a V2 mapping")
                        }
                    }
                }
                continue;
            }
            let Some(port) = self.allocate(&used, now) else {
                self.work.metrics.v2_port_exhausted.inc();
                if self.exhausted.insert(name.clone()) {
                    let note = format!(
                        "no free port in the range {start}-{end} for port {:?}; it is published once a port is released or the range is widened",
                        want.port_name
                    );
                    tracing::error!(service = %format!("{}/{}", want.service.namespace().unwrap_or_default(), want.service.name_any()), %note, "V2 port range exhausted");
                    self.events
                        .publish_event(want.service.as_ref(), true, "PortRangeExhausted", &note)
                        .await;
                }
                continue;
            };
            let desired = self.mapping(name, want, port);
            match self.applier.apply(&desired).await {
                Ok(applied) => {
                    self.written
                        .insert(name.clone(), Arc::new(applied.into_inner()));
                    used.insert(port);
                    self.exhausted.remove(name);
                    tracing::info!(mapping = %name, entry_port = port, upstreams = ?want.upstreams, "Service port published");
                    self.events
                        .publish_event(
                            want.service.as_ref(),
                            false,
                            "PortPublished",
                            &format!("port {:?} published on entry port {port}", want.port_name),
                        )
                        .await;
                }
                Err(err) => {
                    tracing::warn!(mapping = %name, error = %err, "publishing a Service port")
                }
            }
        }
        let size = i64::from(end - start) + 1;
        let used_count = i64::try_from(used.len()).unwrap_or(size);
        self.work.metrics.v2_ports_free.set(size - used_count);
    }

    /// The lowest free port not quarantined, else the longest-quarantined free port.
    fn allocate(&self, used: &HashSet<u16>, now: i64) -> Option<u16> {
        let range = self.policy.port_range;
        let free = (range.start()..=range.end()).filter(|p| !used.contains(p));
        let mut oldest: Option<(i64, u16)> = None;
        for port in free {
            match self.quarantine.get(&port) {
                Some(at) if now - *at < QUARANTINE_MILLIS => {
                    if oldest.is_none_or(|(t, _)| *at < t) {
                        oldest = Some((*at, port));
                    }
                }
                _ => return Some(port),
            }
        }
        oldest.map(|(_, port)| port)
    }
}
