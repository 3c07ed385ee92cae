//! V1: one entry port (`--default-map-port`) forwards to one pod for a TTL.
//!
//! The mapping is the PortMapping `v1-entry-<port>` in the state namespace. Posting again
//! replaces the target (a second mapping replaces the first) or, for the same pod, sets a new
//! deadline; expiry makes the entry port refuse connections again.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_reconcile::apply::delete_unchanged;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use serde_json::json;

use crate::config::Settings;
use crate::crd::{CONTROLLER, MappingKind, MappingTarget, PortMapping, PortMappingSpec};
use crate::error::{ApiError, CODE_ERROR, CODE_NOT_FOUND};
use crate::forwarding::Mappings;
use crate::ttl::{expiry_millis, format_millis, is_expired, now_millis};

/// TTL used when a request gives none (the original's form default; its JSON default was 0).
pub const DEFAULT_TTL_SECONDS: u64 = 60;

/// How long a write waits for the local data plane before answering.
const APPLY_WAIT: Duration = Duration::from_secs(3);

/// A mapping as the API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct MappingView {
    /// The PortMapping's name.
    pub name: String,
    /// `pod` or `service`.
    pub kind: &'static str,
    /// `namespace/pod` (V1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// `namespace/service` (V2).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    /// The port name that selected the target port, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port_name: Option<String>,
    /// The target port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target_port: Option<i32>,
    /// The port to connect to.
    pub entry_port: i32,
    /// Where connections go.
    pub upstreams: Vec<String>,
    /// When the mapping ends (V1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// Seconds left (V1), rounded up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remaining_seconds: Option<i64>,
    /// Whether established connections are closed when the mapping changes or ends.
    pub close_connections: bool,
    /// Who created it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
}

impl MappingView {
    /// The view of `mapping` at `now`.
    pub fn of(mapping: &PortMapping, now: i64) -> Self {
        let spec = &mapping.spec;
        let qualified = format!("{}/{}", spec.target.namespace, spec.target.name);
        let deadline = expiry_millis(mapping);
        Self {
            name: mapping.name_any(),
            kind: spec.kind.label(),
            pod_name: (spec.kind == MappingKind::Pod).then(|| qualified.clone()),
            service: (spec.kind == MappingKind::Service).then_some(qualified),
            port_name: spec.target.port_name.clone(),
            target_port: spec.target.port,
            entry_port: spec.entry_port,
            upstreams: spec.upstreams.clone(),
            expires_at: deadline.map(format_millis),
            remaining_seconds: deadline.map(|d| ((d - now).max(0) + 999) / 1000),
            close_connections: spec.close_connections,
            requested_by: spec.requested_by.clone(),
        }
    }
}

/// The V1 operations.
pub struct V1 {
    settings: Arc<Settings>,
    client: kube::Client,
    api: Api<PortMapping>,
    mappings: Mappings,
}

impl V1 {
    /// V1 over the mappings of the state namespace.
    pub fn new(
        settings: Arc<Settings>,
        client: kube::Client,
        api: Api<PortMapping>,
        mappings: Mappings,
    ) -> Self {
        Self {
            settings,
            client,
            api,
            mappings,
        }
    }

    /// The PortMapping name of the V1 entry port.
    pub fn mapping_name(&self) -> String {
        format!("v1-entry-{}", self.settings.entry_port)
    }

    /// The current, unexpired V1 mapping.
    pub fn current(&self) -> Option<Arc<PortMapping>> {
        self.mappings
            .get(&self.mapping_name())
            .filter(|m| !is_expired(m, now_millis()))
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
    ) -> Result<serde_json::Value, ApiError> {
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
            .find(|p| p.name.as_deref() == Some(self.settings.v1_port_name.as_str()))
            .map(|p| p.container_port);
        let (port_name, target_port) = match named_port {
            Some(port) => (Some(self.settings.v1_port_name.clone()), port),
            None => (None, i32::from(self.settings.entry_port)),
        };
        let target = std::net::SocketAddr::new(ip, u16::try_from(target_port).unwrap_or(0));
        let ttl_millis = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let expires_at = now_millis().saturating_add(ttl_millis);
        let previous = self.current();
        let name = self.mapping_name();
        let mapping = PortMapping::owned(
            &name,
            &self.settings.state_namespace,
            PortMappingSpec {
                kind: MappingKind::Pod,
                target: MappingTarget {
                    namespace: namespace.to_owned(),
                    name: pod_name.to_owned(),
                    port_name,
                    port: Some(target_port),
                },
                entry_port: i32::from(self.settings.entry_port),
                upstreams: vec![target.to_string()],
                expires_at: Some(format_millis(expires_at)),
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
        tracing::info!(pod = %qualified, %target, entry_port = self.settings.entry_port, ttl_seconds = ttl.as_secs(), user = requested_by, "pod mapped");
        let mut view = serde_json::to_value(MappingView::of(&written, now_millis()))
            .unwrap_or_else(|_| json!({}));
        if let Some(map) = view.as_object_mut() {
            map.insert("replaced".to_owned(), json!(replaced));
            map.insert("ttl_seconds".to_owned(), json!(ttl.as_secs()));
            map.insert("extended".to_owned(), json!(extended));
        }
        Ok(view)
    }

    /// The mapping of `namespace/pod`, if it is the current one.
    fn mapping_of(&self, namespace: &str, pod_name: &str) -> Option<Arc<PortMapping>> {
        self.current()
            .filter(|m| m.spec.target.namespace == namespace && m.spec.target.name == pod_name)
    }

    /// Whether the pod exists, and its mapping if it is mapped.
    pub async fn query(
        &self,
        namespace: &str,
        pod_name: &str,
    ) -> Result<serde_json::Value, ApiError> {
        let qualified = format!("{namespace}/{pod_name}");
        if self.pod(namespace, pod_name).await?.is_none() {
            return Err(ApiError::NotFound {
                msg: "Not found the pod.".to_owned(),
                code: CODE_NOT_FOUND,
                data: Some(qualified),
            });
        }
        Ok(match self.mapping_of(namespace, pod_name) {
            Some(mapping) => {
                let mut view = serde_json::to_value(MappingView::of(&mapping, now_millis()))
                    .unwrap_or_else(|_| json!({}));
                if let Some(map) = view.as_object_mut() {
                    map.insert("mapped".to_owned(), json!(true));
                }
                view
            }
            None => json!({"pod_name": qualified, "mapped": false}),
        })
    }

    /// Ends the mapping of `namespace/pod` now.
    pub async fn unmap(
        &self,
        namespace: &str,
        pod_name: &str,
        close_connections: bool,
    ) -> Result<serde_json::Value, ApiError> {
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
        Ok(json!({"pod_name": qualified, "entry_port": self.settings.entry_port, "mapped": false}))
    }
}

/// The answer to an unmap whose mapping now targets another pod.
fn conflict(qualified: &str) -> ApiError {
    ApiError::Conflict(format!(
        "the mapping of {qualified} changed meanwhile; read it again"
    ))
}
