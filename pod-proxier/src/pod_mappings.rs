//! V1: one entry port (`--default-map-port`) forwards to one pod for a TTL.
//!
//! The mapping is the PortMapping `v1-entry-<port>` in the state namespace. Posting again
//! replaces the target (a second mapping replaces the first) or, for the same pod, sets a new
//! deadline; expiry makes the entry port refuse connections again.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::apply::delete_unchanged;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use serde_json::json;

use crate::crd::{CONTROLLER, MappingKind, MappingTarget, PortMapping, PortMappingSpec};
use crate::error::{ApiError, CODE_ERROR, CODE_NOT_FOUND};
use crate::forwarding::Mappings;
use crate::settings::V1Policy;
use crate::ttl::{Deadline, is_expired};

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

/// The V1 operations.
pub struct V1 {
    policy: V1Policy,
    state_namespace: String,
    client: kube::Client,
    api: Api<PortMapping>,
    mappings: Mappings,
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

    /// The PortMapping name of the V1 entry port.
    pub fn mapping_name(&self) -> String {
        format!("v1-entry-{}", self.policy.entry_port)
    }

    /// The current, unexpired V1 mapping.
    pub fn current(&self) -> Option<Arc<PortMapping>> {
        self.mappings
            .get(&self.mapping_name())
            .filter(|m| !is_expired(m, Timestamp::now()))
    }

    async fn pod(&self, namespace: &str, name: &str) -> Result<Option<Pod>, ApiError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        Ok(pods.get_opt(name).await?)
    }

    /// Maps `namespace/pod` to the entry port for `ttl`, replacing any other mapping or
    /// setting a new deadline for the same pod.
    pub async fn map(
        &self,
        namespace: &str,
        pod_name: &str,
        ttl: Duration,
        close_connections: bool,
        requested_by: &str,
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
            None => (None, i32::from(self.policy.entry_port)),
        };
        let target = SocketAddr::new(ip, u16::try_from(target_port).unwrap_or(0));
        let expires_at = Deadline::after(Timestamp::now(), ttl);
        let previous = self.current();
        let name = self.mapping_name();
        let mapping = PortMapping::owned(
            &name,
            &self.state_namespace,
            PortMappingSpec {
                kind: MappingKind::Pod,
                target: MappingTarget {
                    namespace: namespace.to_owned(),
                    name: pod_name.to_owned(),
                    port_name,
                    port: Some(target_port),
                },
                entry_port: i32::from(self.policy.entry_port),
                upstreams: vec![target],
                expires_at: Some(expires_at),
                close_connections,
                requested_by: Some(requested_by.to_owned()),
            },
        );
        let written = self
            .api
            .patch(
                &name,
                &PatchParams::apply(CONTROLLER).force(),
                &Patch::Apply(&mapping),
            )
            .await?;
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
        tracing::info!(pod = %qualified, %target, entry_port = self.policy.entry_port, ttl_seconds = ttl.as_secs(), user = requested_by, "pod mapped");
        Ok(MappingView::of(&written, Timestamp::now()).posted(replaced, ttl, extended))
    }

    /// The mapping of `namespace/pod`, if it is the current one.
    fn mapping_of(&self, namespace: &str, pod_name: &str) -> Option<Arc<PortMapping>> {
        self.current()
            .filter(|m| m.spec.target.namespace == namespace && m.spec.target.name == pod_name)
    }

    /// Whether the pod exists, and its mapping if it is mapped.
    pub async fn query(&self, namespace: &str, pod_name: &str) -> Result<PodMapping, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        if self.pod(namespace, pod_name).await?.is_none() {
            return Err(ApiError::NotFound {
                msg: "Not found the pod.".to_owned(),
                code: CODE_NOT_FOUND,
                data: Some(qualified),
            });
        }
        Ok(match self.mapping_of(namespace, pod_name) {
            Some(mapping) => PodMapping::Mapped(Box::new(
                MappingView::of(&mapping, Timestamp::now()).queried(),
            )),
            None => PodMapping::Unmapped(Unmapped {
                entry_port: None,
                mapped: false,
                pod_name: qualified,
            }),
        })
    }

    /// Ends the mapping of `namespace/pod` now.
    pub async fn unmap(
        &self,
        namespace: &str,
        pod_name: &str,
        close_connections: bool,
    ) -> Result<Unmapped, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        let Some(mapping) = self.mapping_of(namespace, pod_name) else {
            return Err(ApiError::NotFound {
                msg: format!("pod {qualified} is not mapped"),
                code: CODE_NOT_FOUND,
                data: Some(qualified),
            });
        };
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
        // pointed at another pod. A conflict only from a write that kept the target (a status
        // update, a new deadline) is retried with the fresh version.
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
                                && fresh.spec.target.name == pod_name =>
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
        tracing::info!(pod = %qualified, "pod unmapped");
        Ok(Unmapped {
            entry_port: Some(self.policy.entry_port),
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
            r#"{"code":10000,"data":{"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","extended":false,"kind":"pod","name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"replaced":null,"requested_by":"alice","target_port":8849,"ttl_seconds":60,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
        );
        assert_eq!(
            posted(Some("default/old")),
            r#"{"code":10000,"data":{"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","extended":false,"kind":"pod","name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"replaced":"default/old","requested_by":"alice","target_port":8849,"ttl_seconds":60,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
        );
        let queried =
            PodMapping::Mapped(Box::new(MappingView::of(&pod_mapping(), now()).queried()));
        assert_eq!(
            body(error::ok(queried)),
            r#"{"code":10000,"data":{"close_connections":true,"entry_port":8849,"expires_at":"2023-11-14T22:13:20.123Z","kind":"pod","mapped":true,"name":"v1-entry-8849","pod_name":"default/web-0","port_name":"jprofiler-port","remaining_seconds":60,"requested_by":"alice","target_port":8849,"upstreams":["10.1.2.3:8849","[fd00::1]:8849"]},"msg":"operation succeeded"}"#
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
