//! V1: an entry port forwards to one pod for a TTL.
//!
//! The mapping of entry port `p` is the PortMapping `v1-entry-<p>` in the state namespace. Each
//! requester (the authenticated user) gets a port of `--v1-port-range` of their own: posting
//! again replaces their own mapping (or, for the same pod, sets a new deadline), never another
//! user's; a full range is a conflict. With `--v1-shared-port` there is the original's single
//! port, which any new mapping takes over. Expiry makes the entry port refuse connections again.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::apply::delete_unchanged;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::Serialize;
use serde_json::json;

use crate::access::Cidr;
use crate::crd::{CONTROLLER, MappingKind, MappingTarget, PortMapping, PortMappingSpec};
use crate::error::{ApiError, CODE_ERROR, CODE_NOT_FOUND};
use crate::forwarding::Mappings;
use crate::settings::{V1Policy, V1Ports};
use crate::ttl::Deadline;

/// TTL used when a request gives none (the original's form default; its JSON default was 0).
pub const DEFAULT_TTL_SECONDS: u64 = 60;

/// How long a write waits for the local data plane before answering.
const APPLY_WAIT: Duration = Duration::from_secs(3);

/// A mapping as the API shows it: the OpenAPI schema `Mapping`, with the answer-specific fields
/// (`extended`, `replaced`, `ttl_seconds` of a POST, `mapped` of a GET) absent elsewhere.
///
/// The fields are in alphabetical order on purpose: the answers used to be `serde_json` maps,
/// which write their keys sorted, and this keeps the bytes on the wire the same.
#[derive(Debug, Clone, Serialize)]
pub struct MappingView {
    /// The source networks the entry port admits (V1 with `--entry-access=requester`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allowed_sources: Option<Vec<Cidr>>,
    /// Whether established connections are closed when the mapping changes or ends.
    pub close_connections: bool,
    /// The port to connect to.
    pub entry_port: i32,
    /// When the mapping ends (V1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Deadline>,
    /// POST only: the pod was mapped already and got a new deadline.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extended: Option<bool>,
    /// `pod` or `service`.
    pub kind: &'static str,
    /// GET of one pod only: always true (an unmapped pod answers [`Unmapped`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mapped: Option<bool>,
    /// The PortMapping's name.
    pub name: String,
    /// `namespace/pod` (V1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// The port name that selected the target port, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_name: Option<String>,
    /// Seconds left (V1), rounded up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_seconds: Option<i64>,
    /// POST only: the pod this mapping replaced, `null` when it replaced none (the outer
    /// `None` leaves the key out).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced: Option<Option<String>>,
    /// Who created it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
    /// The address it was requested from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested_from: Option<String>,
    /// `namespace/service` (V2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// The target port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_port: Option<i32>,
    /// POST only: the TTL asked for, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// Where connections go.
    pub upstreams: Vec<SocketAddr>,
}

impl MappingView {
    /// The view of `mapping` at `now`.
    pub fn of(mapping: &PortMapping, now: Timestamp) -> Self {
        let spec = &mapping.spec;
        let qualified = format!("{}/{}", spec.target.namespace, spec.target.name);
        let deadline = spec.expires_at;
        Self {
            allowed_sources: spec.allowed_sources.clone(),
            close_connections: spec.close_connections,
            entry_port: spec.entry_port,
            expires_at: deadline,
            extended: None,
            kind: spec.kind.label(),
            mapped: None,
            name: mapping.name_any(),
            pod_name: (spec.kind == MappingKind::Pod).then(|| qualified.clone()),
            port_name: spec.target.port_name.clone(),
            remaining_seconds: deadline.map(|d| d.remaining_seconds(now)),
            replaced: None,
            requested_by: spec.requested_by.clone(),
            requested_from: spec.requested_from.clone(),
            service: (spec.kind == MappingKind::Service).then_some(qualified),
            target_port: spec.target.port,
            ttl_seconds: None,
            upstreams: spec.upstreams.clone(),
        }
    }

    /// The answer to a POST: what it replaced, the TTL asked for, and whether it only set a
    /// new deadline.
    pub fn posted(self, replaced: Option<String>, ttl: Duration, extended: bool) -> Self {
        Self {
            replaced: Some(replaced),
            ttl_seconds: Some(ttl.as_secs()),
            extended: Some(extended),
            ..self
        }
    }

    /// The answer to a GET of a mapped pod.
    pub fn queried(self) -> Self {
        Self {
            mapped: Some(true),
            ..self
        }
    }
}

/// The answer about a pod without a mapping: a GET (no `entry_port`) or a DELETE. Fields in
/// alphabetical order, as on the wire (see [`MappingView`]).
#[derive(Debug, Clone, Serialize)]
pub struct Unmapped {
    /// The V1 entry port it was mapped to (DELETE only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry_port: Option<u16>,
    /// Always false.
    pub mapped: bool,
    /// `namespace/pod`.
    pub pod_name: String,
}

/// The answer to a GET of one pod.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum PodMapping {
    /// Mapped: the mapping, with `mapped: true`.
    Mapped(Box<MappingView>),
    /// Not mapped.
    Unmapped(Unmapped),
}

/// Who asks for a V1 mapping, and whom its entry port admits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requester {
    /// The authenticated user.
    pub user: String,
    /// The API client's address.
    pub from: IpAddr,
    /// The sources the entry port admits; `None` under `--entry-access=any`.
    pub sources: Option<Vec<Cidr>>,
}

/// The V1 operations.
pub struct V1 {
    policy: V1Policy,
    state_namespace: String,
    client: kube::Client,
    api: Api<PortMapping>,
    mappings: Mappings,
}

/// The PortMapping name of V1 entry port `port`.
pub fn mapping_name(port: u16) -> String {
    format!("v1-entry-{port}")
}

/// Where a new mapping is written.
enum Slot {
    /// Server-side apply on this name, over the object at this version (`None`: whatever is
    /// there, the shared port's takeover).
    Apply(String, Option<String>),
    /// Create this name; taken meanwhile is a conflict.
    Create(String),
}

impl V1 {
    /// V1 over the mappings of `state_namespace`.
    pub fn new(
        policy: V1Policy,
        state_namespace: String,
        client: kube::Client,
        api: Api<PortMapping>,
        mappings: Mappings,
    ) -> Self {
        Self {
            policy,
            state_namespace,
            client,
            api,
            mappings,
        }
    }

    /// The unexpired V1 mappings, by entry port.
    pub fn current(&self) -> Vec<Arc<PortMapping>> {
        let now = Timestamp::now();
        let mut current: Vec<_> = self
            .mappings
            .all()
            .into_iter()
            .filter(|m| m.spec.kind == MappingKind::Pod && !m.is_expired(now))
            .filter(|m| {
                u16::try_from(m.spec.entry_port).is_ok_and(|p| {
                    self.policy.entry_ports.contains(p) && m.name_any() == mapping_name(p)
                })
            })
            .collect();
        current.sort_by_key(|m| m.spec.entry_port);
        current
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, ApiError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        Ok(pods.get_opt(name).await?)
    }

    /// The mapping `requester` already has (range: their own; shared: the current one).
    fn previous(&self, requester: &Requester) -> Option<Arc<PortMapping>> {
        let current = self.current();
        match self.policy.entry_ports {
            V1Ports::Shared(_) => current.into_iter().next(),
            V1Ports::Range(_) => current
                .into_iter()
                .find(|m| m.spec.requested_by.as_deref() == Some(requester.user.as_str())),
        }
    }

    /// The slots a new mapping may take, in order: the shared port, the requester's own port,
    /// or the free ports of the range.
    fn slots(&self, previous: Option<&PortMapping>) -> Vec<Slot> {
        match (self.policy.entry_ports, previous) {
            (V1Ports::Shared(port), _) => vec![Slot::Apply(mapping_name(port), None)],
            (V1Ports::Range(_), Some(own)) => {
                vec![Slot::Apply(own.name_any(), own.resource_version())]
            }
            (V1Ports::Range(range), None) => {
                let now = Timestamp::now();
                let cached = self.mappings.all();
                (range.start()..=range.end())
                    .filter_map(|port| {
                        let name = mapping_name(port);
                        match cached.iter().find(|m| m.name_any() == name) {
                            None => Some(Slot::Create(name)),
                            // Expired, not yet removed by the leader: taken over, unless it
                            // changed meanwhile.
                            Some(m) if m.is_expired(now) => {
                                Some(Slot::Apply(name, m.resource_version()))
                            }
                            Some(_) => None,
                        }
                    })
                    .collect()
            }
        }
    }

    /// Maps `namespace/pod` for `ttl` on an entry port of `requester`'s: their own port (or the
    /// shared one), setting a new deadline for the same pod or replacing their previous pod.
    pub async fn map(
        &self,
        namespace: &str,
        pod_name: &str,
        ttl: Duration,
        close_connections: bool,
        requester: &Requester,
    ) -> Result<MappingView, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        let pod = self
            .pod(namespace, pod_name)
            .await?
            .ok_or_else(|| ApiError::NotFound {
                msg: format!("pod {qualified} not found"),
                code: CODE_ERROR,
                data: Some(qualified.clone()),
            })?;
        if pod.metadata.deletion_timestamp.is_some() {
            return Err(ApiError::Conflict(format!(
                "pod {qualified} is terminating and cannot be mapped"
            )));
        }
        let status = pod.status.clone().unwrap_or_default();
        let phase = status.phase.clone().unwrap_or_else(|| "Unknown".to_owned());
        let ip = status.pod_ip.clone().filter(|ip| !ip.is_empty());
        let Some(ip) = ip else {
            return Err(ApiError::Conflict(format!(
                "pod {qualified} has no IP yet (phase {phase}); map it once it runs"
            )));
        };
        if phase != "Running" {
            return Err(ApiError::Conflict(format!(
                "pod {qualified} is {phase}, not Running; only running pods can be mapped"
            )));
        }
        let ip: std::net::IpAddr = ip.parse().map_err(|_| {
            ApiError::Conflict(format!("pod {qualified} has an unusable IP {ip:?}"))
        })?;
        let named_port = pod
            .spec
            .as_ref()
            .into_iter()
            .flat_map(|spec| spec.containers.iter())
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(self.policy.port_name.as_str()))
            .map(|p| p.container_port);
        let (port_name, target_port) = match named_port {
            Some(port) => (Some(self.policy.port_name.clone()), port),
            None => (None, i32::from(self.policy.pod_port)),
        };
        let target = SocketAddr::new(ip, u16::try_from(target_port).unwrap_or(0));
        let expires_at = Deadline::after(Timestamp::now(), ttl);
        let previous = self.previous(requester);
        let spec = |entry_port: u16| PortMappingSpec {
            kind: MappingKind::Pod,
            target: MappingTarget {
                namespace: namespace.to_owned(),
                name: pod_name.to_owned(),
                port_name: port_name.clone(),
                port: Some(target_port),
            },
            entry_port: i32::from(entry_port),
            upstreams: vec![target],
            expires_at: Some(expires_at),
            close_connections,
            requested_by: Some(requester.user.clone()),
            requested_from: Some(requester.from.to_string()),
            allowed_sources: requester.sources.clone(),
        };
        let mut written = None;
        let mut slots: std::collections::VecDeque<Slot> = self.slots(previous.as_deref()).into();
        let mut retries = 0;
        while let Some(slot) = slots.pop_front() {
            let name = match &slot {
                Slot::Apply(name, _) | Slot::Create(name) => name.clone(),
            };
            let Some(port) = name
                .strip_prefix("v1-entry-")
                .and_then(|p| p.parse::<u16>().ok())
            else {
                continue;
            };
            let mut mapping = PortMapping::owned(&name, &self.state_namespace, spec(port));
            let result = match slot {
                Slot::Apply(_, version) => {
                    mapping.metadata.resource_version = version;
                    self.api
                        .patch(
                            &name,
                            &PatchParams::apply(CONTROLLER).force(),
                            &Patch::Apply(&mapping),
                        )
                        .await
                }
                Slot::Create(_) => {
                    let params = PostParams {
                        field_manager: Some(CONTROLLER.to_owned()),
                        ..PostParams::default()
                    };
                    self.api.create(&params, &mapping).await
                }
            };
            match result {
                Ok(object) => {
                    written = Some(object);
                    break;
                }
                // Taken meanwhile (another caller, another replica): the next port.
                Err(kube::Error::Api(status))
                    if status.code == 409 && previous.is_none() && self.is_range() =>
                {
                    continue;
                }
                // The requester's own mapping changed meanwhile: a status update or a renewal
                // elsewhere is retried with its fresh version, anything else is a conflict.
                Err(kube::Error::Api(status)) if status.code == 409 && retries < 3 => {
                    retries += 1;
                    let fresh = self.api.get_opt(&name).await?;
                    match fresh {
                        Some(fresh)
                            if fresh.spec.requested_by.as_deref()
                                == Some(requester.user.as_str())
                                || !self.is_range() =>
                        {
                            slots.push_front(Slot::Apply(name.clone(), fresh.resource_version()));
                        }
                        _ => {
                            return Err(ApiError::Conflict(format!(
                                "your mapping on entry port {port} ended meanwhile; post again"
                            )));
                        }
                    }
                }
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    return Err(ApiError::Conflict(format!(
                        "your mapping changed meanwhile (another request?); post again: {}",
                        status.message
                    )));
                }
                Err(err) => return Err(err.into()),
            }
        }
        let Some(written) = written else {
            return Err(ApiError::Conflict(format!(
                "every V1 entry port ({}) is in use by another user's mapping; try again when \
                 one ends (mappings end at their TTL), or ask for a larger --v1-port-range",
                self.policy.entry_ports
            )));
        };
        let name = written.name_any();
        let version = written.resource_version();
        if !self
            .mappings
            .wait_applied(&name, version.as_deref(), APPLY_WAIT)
            .await
        {
            tracing::warn!(mapping = %name, "data plane did not confirm the mapping in time");
        }
        let same_pod = |p: &PortMapping| {
            p.spec.target.namespace == namespace && p.spec.target.name == pod_name
        };
        let extended = previous.as_deref().is_some_and(same_pod);
        let replaced = previous
            .filter(|p| !same_pod(p))
            .map(|p| format!("{}/{}", p.spec.target.namespace, p.spec.target.name));
        tracing::info!(pod = %qualified, %target, entry_port = written.spec.entry_port, ttl_seconds = ttl.as_secs(), user = %requester.user, from = %requester.from, sources = ?requester.sources, "pod mapped");
        Ok(MappingView::of(&written, Timestamp::now()).posted(replaced, ttl, extended))
    }

    fn is_range(&self) -> bool {
        matches!(self.policy.entry_ports, V1Ports::Range(_))
    }

    /// The mappings of `namespace/pod`, `user`'s own first.
    fn mappings_of(&self, namespace: &str, pod_name: &str, user: &str) -> Vec<Arc<PortMapping>> {
        let mut found: Vec<_> = self
            .current()
            .into_iter()
            .filter(|m| m.spec.target.namespace == namespace && m.spec.target.name == pod_name)
            .collect();
        found.sort_by_key(|m| m.spec.requested_by.as_deref() != Some(user));
        found
    }

    /// Whether the pod exists, and its mapping if it is mapped (`user`'s own, else another's).
    pub async fn query(
        &self,
        namespace: &str,
        pod_name: &str,
        user: &str,
    ) -> Result<PodMapping, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        if self.pod(namespace, pod_name).await?.is_none() {
            return Err(ApiError::NotFound {
                msg: "Not found the pod.".to_owned(),
                code: CODE_NOT_FOUND,
                data: Some(qualified),
            });
        }
        Ok(
            match self
                .mappings_of(namespace, pod_name, user)
                .into_iter()
                .next()
            {
                Some(mapping) => PodMapping::Mapped(Box::new(
                    MappingView::of(&mapping, Timestamp::now()).queried(),
                )),
                None => PodMapping::Unmapped(Unmapped {
                    entry_port: None,
                    mapped: false,
                    pod_name: qualified,
                }),
            },
        )
    }

    /// Ends `user`'s mapping of `namespace/pod` now (with a shared port: the mapping of that
    /// pod, whoever made it, as the original).
    pub async fn unmap(
        &self,
        namespace: &str,
        pod_name: &str,
        close_connections: bool,
        user: &str,
    ) -> Result<Unmapped, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        let found = self.mappings_of(namespace, pod_name, user);
        let mine =
            |m: &PortMapping| !self.is_range() || m.spec.requested_by.as_deref() == Some(user);
        let Some(mapping) = found.iter().find(|m| mine(m)).cloned() else {
            return Err(match found.first() {
                Some(other) => ApiError::OutOfScope(format!(
                    "pod {qualified} is mapped on entry port {} by {}, not by you; only they can \
                     delete that mapping (it ends at its TTL)",
                    other.spec.entry_port,
                    other.spec.requested_by.as_deref().unwrap_or("another user")
                )),
                None => ApiError::NotFound {
                    msg: format!("pod {qualified} is not mapped"),
                    code: CODE_NOT_FOUND,
                    data: Some(qualified),
                },
            });
        };
        let owner = mapping.spec.requested_by.clone();
        let name = mapping.name_any();
        let mut version = mapping.resource_version();
        if close_connections && !mapping.spec.close_connections {
            // Recorded on the object first, so every replica closes them, not only this one.
            let patch = json!({"spec": {"closeConnections": true}});
            let patched = self
                .api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            version = patched.resource_version();
            self.mappings
                .wait_applied(&name, version.as_deref(), APPLY_WAIT)
                .await;
        }
        // The precondition keeps an unmap from deleting a mapping that another caller has just
        // pointed at another pod. A conflict only from a write that kept the target and the
        // requester (a status update, a new deadline) is retried with the fresh version.
        let mut attempts = 0;
        loop {
            match self.api.delete(&name, &delete_unchanged(version)).await {
                Ok(_) => break,
                Err(kube::Error::Api(status)) if status.code == 404 => break,
                Err(kube::Error::Api(status)) if status.code == 409 && attempts < 3 => {
                    attempts += 1;
                    let fresh = self.api.get_opt(&name).await?;
                    match fresh {
                        None => break,
                        Some(fresh)
                            if fresh.spec.target.namespace == namespace
                                && fresh.spec.target.name == pod_name
                                && fresh.spec.requested_by == owner =>
                        {
                            version = fresh.resource_version();
                        }
                        Some(_) => return Err(conflict(&qualified)),
                    }
                }
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    return Err(conflict(&qualified));
                }
                Err(err) => return Err(err.into()),
            }
        }
        self.mappings.wait_applied(&name, None, APPLY_WAIT).await;
        tracing::info!(pod = %qualified, entry_port = mapping.spec.entry_port, "pod unmapped");
        Ok(Unmapped {
            entry_port: u16::try_from(mapping.spec.entry_port).ok(),
            mapped: false,
            pod_name: qualified,
        })
    }
}

/// The answer to an unmap whose mapping now targets another pod.
fn conflict(qualified: &str) -> ApiError {
    ApiError::Conflict(format!(
        "the mapping of {qualified} changed meanwhile; read it again"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use axum::response::{IntoResponse as _, Response};

    use crate::error::{self, CODE_NOT_FOUND};

    /// The bytes of an answer's body.
    fn body(response: Response) -> String {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let bytes = runtime
            .block_on(axum::body::to_bytes(response.into_body(), 1 << 20))
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    /// 59.5 s before the deadline of [`pod_mapping`].
    fn now() -> Timestamp {
        Timestamp::from_millisecond(1_700_000_000_123 - 59_500).unwrap()
    }

    fn pod_mapping() -> PortMapping {
        PortMapping::owned(
            "v1-entry-8849",
            "state",
            PortMappingSpec {
                kind: MappingKind::Pod,
                target: MappingTarget {
                    namespace: "default".into(),
                    name: "web-0".into(),
                    port_name: Some("jprofiler-port".into()),
                    port: Some(8849),
                },
                entry_port: 8849,
                upstreams: vec![
                    "10.1.2.3:8849".parse().unwrap(),
                    "[fd00::1]:8849".parse().unwrap(),
                ],
                expires_at: Some(Deadline::after(
                    Timestamp::UNIX_EPOCH,
                    Duration::from_millis(1_700_000_000_123),
                )),
                close_connections: true,
                requested_by: Some("alice".into()),
                requested_from: Some("192.0.2.7".into()),
                allowed_sources: Some(vec!["192.0.2.7".parse().unwrap()]),
            },
        )
    }

    fn service_mapping() -> PortMapping {
        PortMapping::owned(
            "svc.default.svc.debug",
            "state",
            PortMappingSpec {
                kind: MappingKind::Service,
                target: MappingTarget {
                    namespace: "default".into(),
                    name: "svc".into(),
                    port_name: Some("debug".into()),
                    port: Some(80),
                },
                entry_port: 9000,
                upstreams: vec![],
                expires_at: None,
                close_connections: false,
                requested_by: None,
                requested_from: None,
                allowed_sources: None,
            },
        )
    }

    /// Every kind of answer, byte for byte as the API wrote it when the answers were
    /// `serde_json::Value` maps with keys patched in (sorted keys, `replaced: null`).
    #[test]
    fn answers_keep_their_bytes_on_the_wire() {
        let ttl = Duration::from_secs(60);
        let posted = |replaced: Option<&str>| {
            let view = MappingView::of(&pod_mapping(), now());
            body(error::ok(view.posted(
                replaced.map(str::to_owned),
                ttl,
                false,
            )))
        };
        assert_eq!(
            posted(None),
            r#"{"code":10000,"data":{"allowed_sources":["192.0.2.7/32"],"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","extended":false,"kind":"pod","name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"replaced":null,"requested_by":"alice","requested_from":"192.0.2.7","target_port":8849,"ttl_seconds":60,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
        );
        assert_eq!(
            posted(Some("default/old")),
            r#"{"code":10000,"data":{"allowed_sources":["192.0.2.7/32"],"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","extended":false,"kind":"pod","name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"replaced":"default/old","requested_by":"alice","requested_from":"192.0.2.7","target_port":8849,"ttl_seconds":60,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
        );
        let queried =
            PodMapping::Mapped(Box::new(MappingView::of(&pod_mapping(), now()).queried()));
        assert_eq!(
            body(error::ok(queried)),
            r#"{"code":10000,"data":{"allowed_sources":["192.0.2.7/32"],"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","kind":"pod","mapped":true,"name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"requested_by":"alice","requested_from":"192.0.2.7","target_port":8849,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
        );
        let unmapped = PodMapping::Unmapped(Unmapped {
            entry_port: None,
            mapped: false,
            pod_name: "default/web-0".into(),
        });
        assert_eq!(
            body(error::ok(unmapped)),
            r#"{"code":10000,"data":{"mapped":false,"pod_name":"default/web-0"},"msg":"operation succeeded"}"#
        );
        let deleted = Unmapped {
            entry_port: Some(8849),
            mapped: false,
            pod_name: "default/web-0".into(),
        };
        assert_eq!(
            body(error::ok(deleted)),
            r#"{"code":10000,"data":{"entry_port":8849,"mapped":false,"pod_name":"default/web-0"},"msg":"operation succeeded"}"#
        );
        let service = MappingView::of(&service_mapping(), now());
        assert_eq!(
            body(error::ok(vec![service.clone()])),
            r#"{"code":10000,"data":[{"close_connections":false,"entry_port":9000,"kind":"service","name":"svc.default.svc.debug","port_name":"debug","service":"default/svc","target_port":80,"upstreams":[]}],"msg":"operation succeeded"}"#
        );
        assert_eq!(
            body(error::ok(service)),
            r#"{"code":10000,"data":{"close_connections":false,"entry_port":9000,"kind":"service","name":"svc.default.svc.debug","port_name":"debug","service":"default/svc","target_port":80,"upstreams":[]},"msg":"operation succeeded"}"#
        );
        assert_eq!(
            body(error::ok("pong")),
            r#"{"code":10000,"data":"pong","msg":"operation succeeded"}"#
        );
        let not_found = ApiError::NotFound {
            msg: "x".into(),
            code: CODE_NOT_FOUND,
            data: Some("a/b".into()),
        };
        assert_eq!(
            body(not_found.into_response()),
            r#"{"code":40004,"data":"a/b","msg":"x"}"#
        );
        assert_eq!(
            body(ApiError::BadRequest("bad".into()).into_response()),
            r#"{"code":10001,"msg":"bad"}"#
        );
    }
}
