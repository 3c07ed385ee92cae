//! The agent configuration file (`config.yaml` in the agent's ConfigMap).
//!
//! The manager renders it; the agent decodes it strictly (unknown keys are rejected) and validates it.
//! The tunnel's option values are rstream-client's types, written as their wire strings.
//! [`TunnelConfig::options`] is the one validation of a tunnel: the manager runs it on what it
//! renders from the RstreamTunnel, the agent (through [`AgentConfig::validate`]) on what it reads.
//! It never holds a secret: the token and proxy credentials come from environment variables filled
//! from Secrets, the mTLS material from mounted files.

use std::collections::BTreeMap;
use std::time::Duration;

use netkit_runtime as app;
use rstream_client::forward::TargetKind;
use rstream_client::tunnel::{HttpVersion, TunnelOptions, TunnelProtocol, TunnelType};
use serde::{Deserialize, Serialize};

use crate::api::{BindSpec, DnsSpec, HttpSpec, IpFamily, TlsSpec, TransportMode};

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The YAML does not decode (syntax, unknown key, wrong type).
    #[error("cannot decode the agent configuration")]
    Decode(#[from] serde_yaml_ng::Error),
    /// A value is missing or impossible.
    #[error("invalid agent configuration: {0}")]
    Invalid(String),
}

/// The longest heartbeat interval: the engine's liveness timeout, three intervals, stays within
/// the protocol's 900 s.
pub const MAX_HEARTBEAT_INTERVAL_SECONDS: u32 = 300;

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}

/// The whole file.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AgentConfig {
    /// How to reach the engine.
    pub connection: ConnectionConfig,
    /// The tunnel to create.
    pub tunnel: TunnelConfig,
    /// Where inbound streams go.
    pub target: TargetConfig,
    /// Status reporting into the RstreamTunnel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesConfig>,
    /// Reconnect backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryConfig>,
}

/// Engine connection.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ConnectionConfig {
    /// Engine `host:port`.
    pub engine: String,
    /// Engine CA bundle (PEM) trusted besides the system roots, with either authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// mTLS files (mTLS auth only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtls: Option<MtlsFiles>,
    /// Network options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<TransportConfig>,
}

/// Mounted mTLS material.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MtlsFiles {
    /// Client certificate chain (PEM).
    pub cert_file: String,
    /// Private key (PEM).
    pub key_file: String,
    /// Engine CA bundle (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
}

/// Network options of engine connections.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TransportConfig {
    /// `auto`, `tls` or `quic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TransportMode>,
    /// Local bind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<BindSpec>,
    /// IP family.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_family: Option<IpFamily>,
    /// DNS options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<DnsSpec>,
    /// Multipath TCP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mptcp: Option<bool>,
    /// Outbound proxy (credentials by env var name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyConfig>,
    /// Deprecated QUIC switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_quic: Option<bool>,
    /// Seconds between control-channel heartbeats (the client's default when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_seconds: Option<u32>,
}

/// Outbound proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ProxyConfig {
    /// Proxy URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    /// Env var holding the user name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username_env: Option<String>,
    /// Env var holding the password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
    /// Extra proxy headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
}

/// The tunnel to create.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TunnelConfig {
    /// rstream tunnel name.
    pub name: String,
    /// Published at the edge.
    pub publish: bool,
    /// `http`, `tls`, `dtls`, `quic` or `tcp`.
    pub protocol: TunnelProtocol,
    /// `bytestream` or `datagram`.
    #[serde(rename = "type")]
    pub type_: TunnelType,
    /// Stable hostname.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// Tunnel labels.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Datagram reliable path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datagram_guaranteed_delivery: Option<bool>,
    /// Cross-region routing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_cross_region_routing: Option<bool>,
    /// Reserved public TCP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_port: Option<u32>,
    /// The upstream speaks TLS.
    #[serde(
        default,
        rename = "upstreamTLS",
        skip_serializing_if = "Option::is_none"
    )]
    pub upstream_tls: Option<bool>,
    /// Allowed source CIDRs.
    #[serde(default, rename = "trustedIPs", skip_serializing_if = "Vec::is_empty")]
    pub trusted_ips: Vec<String>,
    /// Allowed countries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub geoip: Vec<String>,
    /// HTTP options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSpec>,
    /// Edge TLS options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsSpec>,
}

/// An HTTP bytestream tunnel (the RstreamTunnel's defaults) with no name yet.
impl Default for TunnelConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            publish: true,
            protocol: TunnelProtocol::Http,
            type_: TunnelType::Bytestream,
            hostname: None,
            labels: BTreeMap::new(),
            datagram_guaranteed_delivery: None,
            allow_cross_region_routing: None,
            tcp_port: None,
            upstream_tls: None,
            trusted_ips: Vec::new(),
            geoip: Vec::new(),
            http: None,
            tls: None,
        }
    }
}

impl TunnelConfig {
    /// The rstream tunnel options, validated with the client rules (TCP tunnels are published
    /// bytestreams; a private tunnel takes no public option; `upstreamTLS` is also sent as the
    /// deprecated `http_use_tls` for HTTP tunnels by the client). The one check of a tunnel: the
    /// manager's before it renders a configuration, the agent's before it runs one.
    pub fn options(&self) -> Result<TunnelOptions, ConfigError> {
        let bad = |e: rstream_client::Error| invalid(format!("tunnel: {e}"));
        let mut o = TunnelOptions::new()
            .name(self.name.trim())
            .publish(self.publish)
            .protocol(self.protocol)
            .tunnel_type(self.type_);
        o.labels = self.labels.clone();
        o.geoip = self.geoip.clone();
        o.trusted_ips = self.trusted_ips.clone();
        o.hostname = self.hostname.clone().filter(|h| !h.trim().is_empty());
        o.port = self.tcp_port;
        o.upstream_tls = self.upstream_tls;
        o.datagram_guaranteed_delivery = self.datagram_guaranteed_delivery;
        o.allow_cross_region_routing = self.allow_cross_region_routing;
        if let Some(http) = &self.http {
            if self.protocol != TunnelProtocol::Http {
                return Err(invalid("tunnel: the http block requires protocol http"));
            }
            o.http_version = Some(http.version.unwrap_or(HttpVersion::Http11));
            if let Some(auth) = &http.auth {
                o.token_auth = auth.token;
                o.rstream_auth = auth.rstream;
            }
            o.challenge_mode = http.gate.as_ref().and_then(|g| g.challenge);
        }
        if let Some(tls) = &self.tls {
            o.tls_mode = tls.mode;
            o.tls_min_version = tls.min_version;
            o.tls_alpns = tls.alpns.clone().unwrap_or_default();
            o.mtls_auth = tls.mtls;
        }
        if o.datagram_guaranteed_delivery == Some(true) && self.type_ != TunnelType::Datagram {
            return Err(invalid(
                "tunnel: datagramGuaranteedDelivery requires type datagram",
            ));
        }
        o.to_properties().map_err(bad)?;
        Ok(o)
    }
}

/// Forwarding target.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// `svc.ns.svc`.
    pub host: String,
    /// Port, as a string.
    pub port: String,
    /// `TCP` or `UDP`.
    #[serde(default = "default_target_protocol")]
    pub protocol: String,
}

fn default_target_protocol() -> String {
    "TCP".to_owned()
}

/// Status reporting.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubernetesConfig {
    /// Report into the RstreamTunnel.
    #[serde(default)]
    pub enabled: bool,
    /// Its namespace (the pod's namespace env var wins).
    #[serde(default)]
    pub namespace: String,
    /// Its name.
    #[serde(default)]
    pub tunnel_name: String,
    /// Env var with the pod name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name_env: Option<String>,
    /// Env var with the pod namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace_env: Option<String>,
}

/// Reconnect backoff, as Go durations (`1s`, `500ms`, `1m30s`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// First delay (default 1 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<String>,
    /// Largest delay (default 30 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<String>,
}

/// Formats a duration the way Go prints simple ones (`1s`, `500ms`, `30s`).
pub fn format_duration(d: Duration) -> String {
    if d.subsec_millis() == 0 && d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// What [`AgentConfig::validate`] makes of a configuration: the values the agent runs with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Validated {
    /// The tunnel to create, checked with the client rules ([`TunnelConfig::options`]).
    pub tunnel: TunnelOptions,
    /// `(initial, max)` reconnect backoff ([`AgentConfig::retry`]).
    pub retry: (Duration, Duration),
    /// What streams are relayed to: TCP for a bytestream tunnel, UDP for a datagram one.
    pub target: TargetKind,
}

impl AgentConfig {
    /// Decodes (strictly) and validates.
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::decode(text).map(|(config, _)| config)
    }

    /// Decodes (strictly) and validates, keeping what validation made of it.
    pub fn decode(text: &str) -> Result<(Self, Validated), ConfigError> {
        let config: Self = serde_yaml_ng::from_str(text)?;
        let validated = config.validate()?;
        Ok((config, validated))
    }

    /// The YAML the manager writes.
    pub fn to_yaml(&self) -> Result<String, ConfigError> {
        Ok(serde_yaml_ng::to_string(self)?)
    }

    /// Checks the required values, the retry timings, the tunnel options and the target.
    pub fn validate(&self) -> Result<Validated, ConfigError> {
        if self.connection.engine.trim().is_empty() {
            return Err(invalid("connection.engine is required"));
        }
        if let Some(mtls) = &self.connection.mtls
            && (mtls.cert_file.trim().is_empty() || mtls.key_file.trim().is_empty())
        {
            return Err(invalid("connection.mtls needs both certFile and keyFile"));
        }
        if self.tunnel.name.trim().is_empty() {
            return Err(invalid("tunnel.name is required"));
        }
        if self.target.host.trim().is_empty() {
            return Err(invalid("target.host is required"));
        }
        if self.target.port.trim().is_empty() {
            return Err(invalid("target.port is required"));
        }
        if let Some(k) = &self.kubernetes
            && k.enabled
            && (k.namespace.trim().is_empty() || k.tunnel_name.trim().is_empty())
        {
            return Err(invalid(
                "kubernetes.enabled needs kubernetes.namespace and kubernetes.tunnelName",
            ));
        }
        if let Some(seconds) = self
            .connection
            .transport
            .as_ref()
            .and_then(|t| t.heartbeat_interval_seconds)
            && !(1..=MAX_HEARTBEAT_INTERVAL_SECONDS).contains(&seconds)
        {
            return Err(invalid(format!(
                "connection.transport.heartbeatIntervalSeconds is {seconds}: it must be 1 to {MAX_HEARTBEAT_INTERVAL_SECONDS}"
            )));
        }
        let retry = self.retry()?;
        let tunnel = self.tunnel.options()?;
        let datagram = tunnel.tunnel_type == Some(TunnelType::Datagram);
        let target: TargetKind = self
            .target
            .protocol
            .parse()
            .map_err(|e| invalid(format!("{e}")))?;
        if datagram != (target == TargetKind::Udp) {
            return Err(invalid(
                "target.protocol must be UDP for a datagram tunnel, else TCP",
            ));
        }
        Ok(Validated {
            tunnel,
            retry,
            target,
        })
    }

    /// `(initial, max)` backoff: defaults 1 s and 30 s, `initial > 0`, `max >= initial`.
    pub fn retry(&self) -> Result<(Duration, Duration), ConfigError> {
        let retry = self.retry.clone().unwrap_or_default();
        let initial = match &retry.initial {
            Some(s) => app::parse_duration(s).map_err(|e| invalid(e.to_string()))?,
            None => Duration::from_secs(1),
        };
        let max = match &retry.max {
            Some(s) => app::parse_duration(s).map_err(|e| invalid(e.to_string()))?,
            None => Duration::from_secs(30),
        };
        if initial.is_zero() {
            return Err(invalid("retry.initial must be positive"));
        }
        if max < initial {
            return Err(invalid("retry.max must be at least retry.initial"));
        }
        Ok((initial, max))
    }

    /// The `host:port` streams are forwarded to.
    pub fn target_address(&self) -> String {
        format!("{}:{}", self.target.host.trim(), self.target.port.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstream_client::tunnel::{TlsMinVersion, TlsMode};

    fn sample() -> AgentConfig {
        AgentConfig {
            connection: ConnectionConfig {
                engine: "engine.example.com:443".into(),
                ..Default::default()
            },
            tunnel: TunnelConfig {
                name: "demo-web".into(),
                publish: true,
                protocol: TunnelProtocol::Http,
                type_: TunnelType::Bytestream,
                ..Default::default()
            },
            target: TargetConfig {
                host: "web.demo.svc".into(),
                port: "8080".into(),
                protocol: "TCP".into(),
            },
            kubernetes: None,
            retry: None,
        }
    }

    #[test]
    fn round_trips_and_rejects_unknown_keys() {
        let yaml = sample().to_yaml().unwrap();
        assert_eq!(AgentConfig::from_yaml(&yaml).unwrap(), sample());
        let err = AgentConfig::from_yaml(&format!("{yaml}surprise: 1\n")).unwrap_err();
        // serde's reason is the cause, not part of the message.
        let chain = netkit_runtime::error_chain(&err);
        assert!(chain.contains("surprise"), "{chain}");
    }

    #[test]
    fn missing_values_are_named() {
        let mut c = sample();
        c.connection.engine = " ".into();
        assert!(c.validate().unwrap_err().to_string().contains("engine"));
        let mut c = sample();
        c.kubernetes = Some(KubernetesConfig {
            enabled: true,
            ..Default::default()
        });
        assert!(c.validate().unwrap_err().to_string().contains("tunnelName"));
        let mut c = sample();
        c.retry = Some(RetryConfig {
            initial: Some("10s".into()),
            max: Some("1s".into()),
        });
        assert!(c.validate().unwrap_err().to_string().contains("retry.max"));
        for (seconds, valid) in [(0, false), (1, true), (300, true), (301, false)] {
            let mut c = sample();
            c.connection.transport = Some(TransportConfig {
                heartbeat_interval_seconds: Some(seconds),
                ..TransportConfig::default()
            });
            match c.validate() {
                Ok(_) => assert!(valid, "{seconds} s was accepted"),
                Err(e) => {
                    assert!(!valid, "{seconds} s was refused: {e}");
                    assert!(e.to_string().contains("heartbeatIntervalSeconds"), "{e}");
                }
            }
        }
    }

    #[test]
    fn client_rules_apply() {
        let mut c = sample();
        c.tunnel.protocol = TunnelProtocol::Tcp;
        c.tunnel.http = Some(HttpSpec::default());
        assert!(c.validate().is_err());
        let mut c = sample();
        c.tunnel.publish = false;
        c.tunnel.geoip = vec!["FR".into()];
        assert!(c.validate().is_err());
        let mut c = sample();
        c.tunnel.protocol = TunnelProtocol::Tcp;
        c.tunnel.tcp_port = Some(10042);
        let props = c.tunnel.options().unwrap().to_properties().unwrap();
        assert_eq!(props.protocol.as_deref(), Some("tcp"));
    }

    #[test]
    fn datagram_tunnels_forward_to_udp() {
        let mut c = sample();
        c.tunnel.protocol = TunnelProtocol::Dtls;
        c.tunnel.type_ = TunnelType::Datagram;
        c.tunnel.datagram_guaranteed_delivery = Some(true);
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("target.protocol must be UDP"), "{err}");
        c.target.protocol = "UDP".into();
        c.validate().unwrap();
        let props = c.tunnel.options().unwrap().to_properties().unwrap();
        assert_eq!(props.r#type.as_deref(), Some("datagram"));
        assert_eq!(props.datagram_guaranteed_delivery, Some(true));
        c.target.protocol = "SCTP".into();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("TCP or UDP, not 'SCTP'")
        );
        // HTTP/3 and quic tunnels stay refused, naming QUIC.
        let mut c = sample();
        c.tunnel.http = Some(HttpSpec {
            version: Some(HttpVersion::H3),
            ..HttpSpec::default()
        });
        assert!(c.validate().unwrap_err().to_string().contains("QUIC"));
        let mut c = sample();
        c.tunnel.protocol = TunnelProtocol::Quic;
        c.tunnel.type_ = TunnelType::Datagram;
        c.target.protocol = "UDP".into();
        assert!(c.validate().unwrap_err().to_string().contains("QUIC"));
    }

    #[test]
    fn option_values_are_written_and_read_as_their_wire_strings() {
        let mut c = sample();
        c.tunnel.http = Some(HttpSpec {
            version: Some(HttpVersion::H2c),
            ..HttpSpec::default()
        });
        c.tunnel.tls = Some(TlsSpec {
            mode: Some(TlsMode::Terminated),
            min_version: Some(TlsMinVersion::Tls13),
            ..TlsSpec::default()
        });
        let yaml = c.to_yaml().unwrap();
        for line in [
            "  protocol: http",
            "  type: bytestream",
            "    version: h2c",
            "    mode: terminated",
            "    minVersion: tls1.3",
        ] {
            assert!(yaml.lines().any(|l| l == line), "{line} not in\n{yaml}");
        }
        assert_eq!(AgentConfig::from_yaml(&yaml).unwrap(), c);
        let err = AgentConfig::from_yaml(&yaml.replace("protocol: http", "protocol: webtty"))
            .unwrap_err();
        // serde's reason is the cause, printed by the chain.
        let err = netkit_runtime::error_chain(&err);
        assert!(err.contains("webtty") && err.contains("dtls"), "{err}");
    }

    #[test]
    fn go_durations_print_as_go_does() {
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
        assert_eq!(format_duration(Duration::from_secs(30)), "30s");
    }
}
