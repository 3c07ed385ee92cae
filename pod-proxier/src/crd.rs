//! The `PortMapping` custom resource: one entry port of pod-proxier and where it forwards.
//!
//! Every mapping lives in the cluster, so a restarted replica (even after `kill -9`) restores
//! every mapping with its port and its remaining TTL, and every replica programs the same
//! routes. The leader writes V2 mappings and removes expired ones; API calls write V1 mappings.

use std::net::SocketAddr;

use kube::CustomResource;
use kube::core::crd::CustomResourceExt as _;
use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

use crate::access::Cidr;
use crate::ttl::Deadline;

/// pod-proxier's name as a writer: server-side apply field manager, Event reporter, leader
/// gauge.
pub const CONTROLLER: &str = "pod-proxier";
/// The API group of [`PortMapping`].
pub const GROUP: &str = "podproxier.kube-netkit.io";
/// Label holding the mapping kind (`pod` or `service`), for selecting one kind.
pub const KIND_LABEL: &str = "podproxier.kube-netkit.io/kind";
/// Label holding the target's namespace.
pub const TARGET_NAMESPACE_LABEL: &str = "podproxier.kube-netkit.io/target-namespace";
/// Label holding the target's name.
pub const TARGET_NAME_LABEL: &str = "podproxier.kube-netkit.io/target-name";

/// One entry port and its target.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[kube(
    group = "podproxier.kube-netkit.io",
    version = "v1alpha1",
    kind = "PortMapping",
    plural = "portmappings",
    shortname = "pm",
    namespaced,
    status = "PortMappingStatus",
    printcolumn = r#"{"name":"Kind","type":"string","jsonPath":".spec.kind"}"#,
    printcolumn = r#"{"name":"Namespace-Target","type":"string","jsonPath":".spec.target.namespace"}"#,
    printcolumn = r#"{"name":"Target","type":"string","jsonPath":".spec.target.name"}"#,
    printcolumn = r#"{"name":"Entry","type":"integer","jsonPath":".spec.entryPort"}"#,
    printcolumn = r#"{"name":"Upstreams","type":"string","jsonPath":".spec.upstreams"}"#,
    printcolumn = r#"{"name":"Expires","type":"string","jsonPath":".spec.expiresAt"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PortMappingSpec {
    /// What the entry port forwards to: one Pod (V1) or one Service port (V2).
    pub kind: MappingKind,
    /// The Pod or Service.
    pub target: MappingTarget,
    /// The port pod-proxier listens on for this mapping.
    #[schemars(range(min = 1, max = 65535))]
    pub entry_port: i32,
    /// Where connections go, as `ip:port`; empty means the entry port refuses connections.
    #[serde(default, deserialize_with = "upstreams")]
    pub upstreams: Vec<SocketAddr>,
    /// When the mapping ends (RFC 3339, UTC, millisecond precision); none for V2 mappings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub expires_at: Option<Deadline>,
    /// Close established connections when this mapping takes over the port, and when it ends.
    #[serde(default)]
    pub close_connections: bool,
    /// Who asked for the mapping (the authenticated user), for audit; V1 mappings of another
    /// user are never replaced (unless the entry port is shared).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_by: Option<String>,
    /// The address the request came from (the API client's IP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_from: Option<String>,
    /// The source networks the entry port admits (CIDRs), with `--entry-access=requester`;
    /// absent when the mapping was made under `--entry-access=any`, and then the entry port
    /// admits nobody under `--entry-access=requester` until it is posted again.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "allowed_sources"
    )]
    #[schemars(with = "Option<Vec<String>>")]
    pub allowed_sources: Option<Vec<Cidr>>,
}

/// Reads `allowedSources` like [`upstreams`]: an entry that is not a CIDR is logged and left
/// out (admitting less, never more).
fn allowed_sources<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<Cidr>>, D::Error> {
    let Some(texts) = Option::<Vec<String>>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let mut cidrs = Vec::with_capacity(texts.len());
    for text in texts {
        match text.parse() {
            Ok(cidr) => cidrs.push(cidr),
            Err(err) => {
                tracing::error!(source = %text, error = %err, "a PortMapping's allowed source is not a CIDR: left out");
            }
        }
    }
    Ok(Some(cidrs))
}

/// Reads `upstreams`. The schema (plain strings, kept so existing objects stay valid) lets a
/// hand-edited object hold an entry that is not `ip:port`: it is logged as an error and left
/// out, so the entry port forwards to the others (or refuses, with none), and one bad object
/// does not stop the whole list of PortMappings from being read. pod-proxier itself only writes
/// addresses.
fn upstreams<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<SocketAddr>, D::Error> {
    let texts = Vec::<String>::deserialize(deserializer)?;
    let mut addresses = Vec::with_capacity(texts.len());
    for text in texts {
        match text.parse() {
            Ok(address) => addresses.push(address),
            Err(err) => {
                tracing::error!(upstream = %text, error = %err, "a PortMapping's upstream is not ip:port: left out");
            }
        }
    }
    Ok(addresses)
}

/// The kind of target.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum MappingKind {
    /// A single Pod (V1).
    Pod,
    /// A named port of a Service (V2).
    Service,
}

impl MappingKind {
    /// The value of [`KIND_LABEL`].
    pub fn label(self) -> &'static str {
        match self {
            MappingKind::Pod => "pod",
            MappingKind::Service => "service",
        }
    }
}

/// The Pod or Service a mapping forwards to.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MappingTarget {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The port name that selected it: the container port name (V1; absent when the default
    /// port was used) or the Service port name (V2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_name: Option<String>,
    /// The target port number: the pod port (V1) or the Service port (V2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

/// What the leader last observed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortMappingStatus {
    /// `Active`, `NoEndpoints` or `Expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// A human-readable detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl PortMapping {
    /// Whether the mapping has a deadline that has come at `now`.
    pub fn is_expired(&self, now: k8s_openapi::jiff::Timestamp) -> bool {
        (self.spec.expires_at).is_some_and(|deadline| deadline.has_passed(now))
    }

    /// The mapping `name` in the state namespace, labelled with its kind and target for
    /// selection by `kubectl`.
    pub fn owned(name: &str, state_namespace: &str, spec: PortMappingSpec) -> Self {
        let labels = [
            (KIND_LABEL.to_owned(), spec.kind.label().to_owned()),
            (
                TARGET_NAMESPACE_LABEL.to_owned(),
                spec.target.namespace.clone(),
            ),
            (TARGET_NAME_LABEL.to_owned(), label_value(&spec.target.name)),
        ];
        let mut mapping = PortMapping::new(name, spec);
        mapping.metadata.namespace = Some(state_namespace.to_owned());
        mapping.metadata.labels = Some(labels.into());
        mapping
    }
}

/// The CustomResourceDefinition as YAML, for `kubectl apply`, the chart and kustomize.
pub fn crd_yaml() -> Result<String, serde_yaml_ng::Error> {
    serde_yaml_ng::to_string(&PortMapping::crd())
}

/// A label value for a name (labels are limited to 63 characters).
pub fn label_value(name: &str) -> String {
    if name.len() <= 63 {
        name.to_owned()
    } else {
        name.chars()
            .take(63)
            .collect::<String>()
            .trim_end_matches(['-', '.'])
            .to_owned()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// The YAML shipped in `config/` is the generated one (the chart's template wraps the same
    /// YAML; `cargo xtask crds --check` checks both).
    #[test]
    fn shipped_crd_yaml_is_generated() {
        let generated = crd_yaml().unwrap();
        assert_eq!(
            include_str!("../config/crd/portmappings.yaml"),
            generated,
            "regenerate with `cargo xtask crds`"
        );
    }

    #[test]
    fn upstreams_and_deadline_read_and_write_as_text() {
        let spec = serde_json::json!({
            "kind": "Pod",
            "target": {"namespace": "default", "name": "web-0"},
            "entryPort": 8849,
            "upstreams": ["10.1.2.3:8849", "not an address", "[fd00::1]:80"],
            "expiresAt": "2026-01-02T03:04:05.678Z",
        });
        let spec: PortMappingSpec = serde_json::from_value(spec).unwrap();
        assert_eq!(
            spec.upstreams,
            vec![
                "10.1.2.3:8849".parse::<SocketAddr>().unwrap(),
                "[fd00::1]:80".parse().unwrap()
            ]
        );
        let written = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            written["upstreams"],
            serde_json::json!(["10.1.2.3:8849", "[fd00::1]:80"])
        );
        assert_eq!(written["expiresAt"], "2026-01-02T03:04:05.678Z");
    }

    #[test]
    fn crd_names_and_columns() {
        let crd = PortMapping::crd();
        assert_eq!(crd.spec.group, GROUP);
        assert_eq!(crd.spec.names.plural, "portmappings");
        assert_eq!(crd.spec.scope, "Namespaced");
        let columns = crd.spec.versions[0]
            .additional_printer_columns
            .clone()
            .unwrap();
        assert!(columns.iter().any(|c| c.name == "Entry"));
    }
}
