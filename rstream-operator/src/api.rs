//! The `tunnels.rstream.io/v1alpha1` API: [`RstreamConnection`] and [`RstreamTunnel`].
//!
//! Field names, defaults, enums and rules follow the original Go operator so existing manifests keep
//! working. Rules spanning several fields are CEL rules (`x-kubernetes-validations`), so the API
//! server itself rejects a bad object with a message naming the rule.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, LocalObjectReference, ResourceRequirements, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The tunnel option values of the API: rstream-client's, so that the spec, the agent
/// configuration and the wire share one set of types.
pub use rstream_client::tunnel::{HttpVersion, TlsMinVersion, TlsMode, TunnelProtocol, TunnelType};

/// API group.
pub const GROUP: &str = "tunnels.rstream.io";
/// API version.
pub const VERSION: &str = "v1alpha1";
/// Default control-plane URL.
pub const DEFAULT_API_URL: &str = "https://rstream.io";
/// Connection used when `connectionRef` is omitted.
pub const DEFAULT_CONNECTION: &str = "default";

fn default_api_url() -> Option<String> {
    Some(DEFAULT_API_URL.to_owned())
}

fn default_true() -> Option<bool> {
    Some(true)
}

fn default_protocol() -> Option<TunnelProtocol> {
    Some(TunnelProtocol::Http)
}

fn default_http_version() -> Option<HttpVersion> {
    Some(HttpVersion::Http11)
}

/// Agents per tunnel unless the spec says otherwise: one active, one standing by.
pub const DEFAULT_AGENT_REPLICAS: i32 = 2;

fn default_replicas() -> Option<i32> {
    Some(DEFAULT_AGENT_REPLICAS)
}

fn default_bind_mode() -> Option<BindMode> {
    Some(BindMode::Address)
}

fn default_ip_family() -> Option<IpFamily> {
    Some(IpFamily::Auto)
}

/// A key of a Secret in the resource's namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretKeyRef {
    /// Secret name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key in the Secret's data.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A header sent to the control plane only (never to agents or engines).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneHeader {
    /// Header name.
    #[schemars(length(min = 1, max = 256))]
    pub name: String,
    /// Secret key holding the header value.
    pub value_secret_ref: SecretKeyRef,
}

/// Client-certificate authentication against the engine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MtlsSpec {
    /// PEM client certificate chain.
    pub cert_secret_ref: SecretKeyRef,
    /// PEM private key.
    pub key_secret_ref: SecretKeyRef,
    /// PEM CA bundle the engine certificate is checked against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
}

/// Agent-to-engine transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TransportMode {
    /// Let the agent choose.
    Auto,
    /// TLS over TCP.
    Tls,
    /// QUIC.
    Quic,
}

/// How the agent picks its local address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BindMode {
    /// Bind to `address`.
    Address,
    /// Bind to `interface`.
    Interface,
}

/// IP family of engine connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum IpFamily {
    /// Any.
    Auto,
    /// IPv4 only.
    Ipv4,
    /// IPv6 only.
    Ipv6,
}

/// Local bind options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct BindSpec {
    /// `address` (default) or `interface`.
    #[serde(default = "default_bind_mode", skip_serializing_if = "Option::is_none")]
    pub mode: Option<BindMode>,
    /// Network interface name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// Local address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
}

/// DNS options of engine connections.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DnsSpec {
    /// DNS server override.
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub override_: Option<String>,
    /// DNS over TLS (not supported by this agent: a connection setting it is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<bool>,
    /// TLS server name of the DNS-over-TLS resolver (used with `tls` only). Never the engine's:
    /// the engine's certificate is checked against the host of its address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Require DNSSEC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dnssec: Option<bool>,
}

/// Outbound proxy of engine connections.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxySpec {
    /// HTTP proxy URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    /// Secret key holding the proxy user name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_secret_ref: Option<SecretKeyRef>,
    /// Secret key holding the proxy password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyRef>,
    /// Extra headers sent to the proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// Agent-to-engine network options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TransportSpec {
    /// `auto`, `tls` or `quic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TransportMode>,
    /// Local bind options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<BindSpec>,
    /// `auto` (default), `ipv4` or `ipv6`.
    #[serde(default = "default_ip_family", skip_serializing_if = "Option::is_none")]
    pub ip_family: Option<IpFamily>,
    /// DNS options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsSpec>,
    /// Multipath TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mptcp: Option<bool>,
    /// Outbound proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySpec>,
    /// Deprecated: use `mode: quic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_quic: Option<bool>,
    /// Seconds between the agent's heartbeats on its control channel (default 5, at most 300).
    /// The engine answers with the channel's liveness timeout (the local engine: three
    /// intervals): an agent whose engine falls silent for that long reconnects, and an engine
    /// that enforces it frees the tunnels of an agent lost with its node that much sooner. Less
    /// is faster failover for more heartbeats.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 300))]
    pub heartbeat_interval_seconds: Option<u32>,
}

/// Shared project, engine and credential settings for the tunnels of a namespace.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tunnels.rstream.io",
    version = "v1alpha1",
    kind = "RstreamConnection",
    plural = "rstreamconnections",
    shortname = "rconn",
    category = "rstream",
    namespaced,
    status = "RstreamConnectionStatus",
    printcolumn = r#"{"name":"Project","type":"string","jsonPath":".status.projectEndpoint"}"#,
    printcolumn = r#"{"name":"Engine","type":"string","jsonPath":".status.engine"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "[has(self.tokenSecretRef), has(self.mtls)].filter(x, x).size() == 1",
     "message": "exactly one of tokenSecretRef or mtls must be set"},
    {"rule": "[has(self.projectEndpoint), has(self.projectID), has(self.engine)].filter(x, x).size() == 1",
     "message": "exactly one of projectEndpoint, projectID or engine must be set"},
    {"rule": "has(self.engine) || has(self.tokenSecretRef)",
     "message": "projectEndpoint and projectID need tokenSecretRef: the control-plane lookup authenticates with the token"},
    {"rule": "!has(self.engine) || !has(self.region)",
     "message": "region cannot be combined with engine"},
    {"rule": "!has(self.engine) || !has(self.controlPlaneHeaders) || size(self.controlPlaneHeaders) == 0",
     "message": "controlPlaneHeaders cannot be combined with engine"},
    {"rule": "!has(self.caSecretRef) || !has(self.mtls) || !has(self.mtls.caSecretRef)",
     "message": "caSecretRef and mtls.caSecretRef both name the engine CA; set one"}
]))]
pub struct RstreamConnectionSpec {
    /// Project endpoint, resolved to an engine through the control plane (preferred hosted path).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub project_endpoint: Option<String>,
    /// Project ID, resolved to an engine through the control plane.
    #[serde(default, rename = "projectID", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub project_id: Option<String>,
    /// Control-plane URL (default `https://rstream.io`).
    #[serde(
        default = "default_api_url",
        rename = "apiURL",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(min = 1))]
    pub api_url: Option<String>,
    /// Region of a global project (`auto` or omitted = the project default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = 64),
        pattern(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
    )]
    pub region: Option<String>,
    /// Headers sent to the control plane only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub control_plane_headers: Option<Vec<ControlPlaneHeader>>,
    /// Direct engine address `host:port` (self-hosted, no control plane).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub engine: Option<String>,
    /// Bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret_ref: Option<SecretKeyRef>,
    /// Client-certificate authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<MtlsSpec>,
    /// PEM CA bundle the engine's certificate is checked against, with either kind of
    /// authentication: a self-hosted engine with a private CA. Added to the system roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyRef>,
    /// Agent-to-engine network options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<TransportSpec>,
    /// Image pull Secrets of the agent Pods of the tunnels using this connection, in each
    /// tunnel's namespace, instead of the manager's `--agent-image-pull-secrets` (an empty list
    /// means none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_image_pull_secrets: Option<Vec<LocalObjectReference>>,
}

/// Observed state of an [`RstreamConnection`]. The resolution fields are cleared when not Ready.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RstreamConnectionStatus {
    /// Generation the status was computed from.
    #[serde(default)]
    pub observed_generation: Option<i64>,
    /// `Ready`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Option<Vec<Condition>>,
    /// Control-plane URL used.
    #[serde(default, rename = "apiURL")]
    pub api_url: Option<String>,
    /// Project ID used.
    #[serde(default, rename = "projectID")]
    pub project_id: Option<String>,
    /// Project endpoint used.
    #[serde(default)]
    pub project_endpoint: Option<String>,
    /// `auto` or the explicit region used.
    #[serde(default)]
    pub region: Option<String>,
    /// Resolved engine address.
    #[serde(default)]
    pub engine: Option<String>,
}

// `http.version` is rstream-client's `HttpVersion`, whose `h2` this API never offered: its schema
// keeps the three values the CRD has always listed. The tunnel's other option values are
// rstream-client's types as they are, schema included (its `schemars` feature).
/// HTTP version of an HTTP tunnel.
#[derive(JsonSchema)]
#[allow(
    dead_code,
    reason = "only the schema of `HttpSpec::version`, never a value"
)]
enum CrdHttpVersion {
    /// HTTP/1.1 (default).
    #[serde(rename = "http/1.1")]
    Http11,
    /// HTTP/2 with prior knowledge.
    #[serde(rename = "h2c")]
    H2c,
    /// HTTP/3 (refused: needs the QUIC transport).
    #[serde(rename = "h3")]
    H3,
}

/// Reference to an [`RstreamConnection`] in the tunnel's namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ConnectionRef {
    /// Connection name (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// The Service a tunnel forwards to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ServiceTarget {
    /// Namespace (default: the tunnel's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub namespace: Option<String>,
    /// Service name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Service port (name or number), not targetPort.
    pub port: IntOrString,
}

/// Tunnel target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TargetSpec {
    /// The Service.
    pub service: ServiceTarget,
}

/// Edge authentication of an HTTP tunnel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HttpAuthSpec {
    /// Require a bearer token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<bool>,
    /// Require an rstream login.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rstream: Option<bool>,
}

/// Browser challenge of an HTTP tunnel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HttpGateSpec {
    /// Show a challenge page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub challenge: Option<bool>,
}

/// HTTP options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HttpSpec {
    /// `http/1.1` (default), `h2c` or `h3`.
    #[serde(
        default = "default_http_version",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<CrdHttpVersion>")]
    pub version: Option<HttpVersion>,
    /// Edge authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<HttpAuthSpec>,
    /// Browser challenge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<HttpGateSpec>,
}

/// Edge TLS options.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TlsSpec {
    /// `terminated` or `passthrough`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TlsMode>,
    /// `tls1.2` or `tls1.3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_version: Option<TlsMinVersion>,
    /// ALPNs accepted at the edge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpns: Option<Vec<String>>,
    /// Require downstream client certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<bool>,
}

/// Customisation of the agent Deployment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentSpec {
    /// Agent image (default: the manager's `--agent-image`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub image: Option<String>,
    /// Agent Pods (default 2). One holds the tunnel, the others stand by and take it over on a
    /// rollout or a lost Pod; with 2 or more a PodDisruptionBudget keeps one. Only a tunnel with a
    /// hostname (published, not `tcp`) can have standbys, since the engine keeps a hostname
    /// exclusive: other tunnels run 1 agent whatever this says.
    #[serde(default = "default_replicas", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub replicas: Option<i32>,
    /// Container resources (default requests cpu 25m / memory 64Mi, limit memory 256Mi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Extra pod labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_labels: Option<BTreeMap<String, String>>,
    /// Extra pod annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_annotations: Option<BTreeMap<String, String>>,
    /// Node selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// Tolerations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
    /// Affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Priority class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
}

/// One managed tunnel to a Kubernetes Service.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "tunnels.rstream.io",
    version = "v1alpha1",
    kind = "RstreamTunnel",
    plural = "rstreamtunnels",
    shortname = "tunnel",
    shortname = "rtun",
    shortname = "rtunnel",
    category = "rstream",
    namespaced,
    status = "RstreamTunnelStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Protocol","type":"string","jsonPath":".spec.protocol"}"#,
    printcolumn = r#"{"name":"Target","type":"string","jsonPath":".status.target"}"#,
    printcolumn = r#"{"name":"Address","type":"string","jsonPath":".status.forwardingAddress"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.tcpPort) || (has(self.protocol) && self.protocol == 'tcp')",
     "message": "tcpPort requires protocol tcp"},
    {"rule": "!has(self.protocol) || self.protocol != 'tcp' || !has(self.publish) || self.publish",
     "message": "protocol tcp requires publish to be true (TCP tunnels are always published)"},
    {"rule": "!has(self.protocol) || self.protocol != 'tcp' || !has(self.type) || self.type == 'bytestream'",
     "message": "protocol tcp requires type bytestream"},
    {"rule": "!has(self.protocol) || self.protocol != 'tcp' || !has(self.hostname)",
     "message": "protocol tcp forbids hostname"},
    {"rule": "!has(self.protocol) || self.protocol != 'tcp' || (!has(self.http) && !has(self.tls))",
     "message": "protocol tcp forbids the http and tls blocks"},
    {"rule": "!has(self.protocol) || self.protocol != 'tcp' || !has(self.datagramGuaranteedDelivery) || !self.datagramGuaranteedDelivery",
     "message": "protocol tcp forbids datagramGuaranteedDelivery"},
    {"rule": "!has(self.http) || !has(self.protocol) || self.protocol == 'http'",
     "message": "the http block requires protocol http"}
]))]
pub struct RstreamTunnelSpec {
    /// The RstreamConnection to use (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection_ref: Option<ConnectionRef>,
    /// The Service to expose.
    pub target: TargetSpec,
    /// rstream tunnel name (default: DNS label of `<namespace>-<name>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub tunnel_name: Option<String>,
    /// Publish the tunnel at the edge (default true).
    #[serde(default = "default_true", skip_serializing_if = "Option::is_none")]
    pub publish: Option<bool>,
    /// Edge protocol (default http).
    #[serde(default = "default_protocol", skip_serializing_if = "Option::is_none")]
    pub protocol: Option<TunnelProtocol>,
    /// Transport type (inferred when omitted).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<TunnelType>,
    /// Datagram reliable path (datagram only; passed to the engine; over TLS datagrams are always
    /// delivered in order).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datagram_guaranteed_delivery: Option<bool>,
    /// Allow a cross-region payload path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_cross_region_routing: Option<bool>,
    /// Stable public hostname (generated when omitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub hostname: Option<String>,
    /// Public TCP port reserved for the project (protocol tcp only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub tcp_port: Option<i32>,
    /// Tunnel labels (the operator adds its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// The upstream Service speaks TLS.
    #[serde(
        default,
        rename = "upstreamTLS",
        skip_serializing_if = "Option::is_none"
    )]
    pub upstream_tls: Option<bool>,
    /// Allowed source CIDRs.
    #[serde(
        default,
        rename = "trustedIPs",
        skip_serializing_if = "Option::is_none"
    )]
    pub trusted_ips: Option<Vec<String>>,
    /// Allowed countries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub geoip: Option<Vec<String>>,
    /// HTTP options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSpec>,
    /// Edge TLS options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
    /// Agent Deployment customisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentSpec>,
}

/// Observed state of an [`RstreamTunnel`], written by the manager and the agent.
///
/// Fields are serialized even when `None` so that a merge patch of the whole status clears them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RstreamTunnelStatus {
    /// Generation the status was computed from.
    #[serde(default)]
    pub observed_generation: Option<i64>,
    /// `Accepted`, `Resolved`, `AgentReady`, `TunnelReady`, `Ready`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Option<Vec<Condition>>,
    /// Engine tunnel ID.
    #[serde(default, rename = "tunnelID")]
    pub tunnel_id: Option<String>,
    /// rstream tunnel name.
    #[serde(default)]
    pub rstream_name: Option<String>,
    /// Public hostname.
    #[serde(default)]
    pub hostname: Option<String>,
    /// Public address, e.g. `https://web.example.test`.
    #[serde(default)]
    pub forwarding_address: Option<String>,
    /// `<svc>.<ns>.svc:<port>`.
    #[serde(default)]
    pub target: Option<String>,
    /// Name of the agent Deployment.
    #[serde(default)]
    pub agent_deployment: Option<String>,
    /// Last error; cleared on success.
    #[serde(default)]
    pub last_error: Option<String>,
}

impl RstreamTunnelSpec {
    /// The effective protocol.
    pub fn protocol(&self) -> TunnelProtocol {
        self.protocol.unwrap_or(TunnelProtocol::Http)
    }

    /// The effective type: explicit, else datagram for dtls, quic and HTTP/3.
    pub fn tunnel_type(&self) -> TunnelType {
        if let Some(t) = self.type_ {
            return t;
        }
        let h3 = self
            .http
            .as_ref()
            .and_then(|h| h.version)
            .is_some_and(|v| v == HttpVersion::H3);
        match self.protocol() {
            TunnelProtocol::Dtls | TunnelProtocol::Quic => TunnelType::Datagram,
            TunnelProtocol::Http if h3 => TunnelType::Datagram,
            _ => TunnelType::Bytestream,
        }
    }

    /// The connection name (default `default`).
    pub fn connection_name(&self) -> &str {
        self.connection_ref
            .as_ref()
            .and_then(|c| c.name.as_deref())
            .filter(|n| !n.is_empty())
            .unwrap_or(DEFAULT_CONNECTION)
    }
}
