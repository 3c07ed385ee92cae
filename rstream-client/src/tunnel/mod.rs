//! Tunnel options, the client-side validation rules, the forwarding-address display string and
//! stable hostnames.
//!
//! [`TunnelOptions`] is what the application asks for; [`TunnelOptions::to_properties`] validates and
//! normalises it into the wire [`crate::proto::TunnelProperties`] the same way the
//! official SDKs do (TCP tunnels are always published bytestreams, private tunnels take no public-exposure
//! option, a published port needs TCP, datagram tunnels use protocol `dtls`). Datagram tunnels are
//! carried over TLS as length-prefixed records ([`crate::datagram`]); `quic` tunnels and HTTP/3 need
//! the QUIC transport, which this client does not implement, and are rejected as unsupported.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::proto::TunnelProperties;
use crate::resolve::{valid_dns_label, valid_dns_name};

mod vocabulary;

pub use vocabulary::{HttpVersion, TlsMinVersion, TlsMode, TunnelProtocol, TunnelType};

/// What the application asks for when creating a tunnel. Build it with the constructors and chained
/// setters; every `TunnelProperties` option is available.
///
/// ```
/// use rstream_client::tunnel::{TunnelOptions, HttpVersion};
/// let opts = TunnelOptions::http().name("web").http_version(HttpVersion::Http11).token_auth(true);
/// let props = opts.to_properties().unwrap();
/// assert_eq!(props.protocol.as_deref(), Some("http"));
/// assert_eq!(props.r#type.as_deref(), Some("bytestream"));
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct TunnelOptions {
    /// Tunnel name (private dial by name).
    pub name: Option<String>,
    /// Published at the edge (absent = true).
    pub publish: Option<bool>,
    /// Edge protocol.
    pub protocol: Option<TunnelProtocol>,
    /// Transport type (inferred when absent).
    pub tunnel_type: Option<TunnelType>,
    /// Inventory labels.
    pub labels: BTreeMap<String, String>,
    /// Allowed countries.
    pub geoip: Vec<String>,
    /// Allowed source CIDRs.
    pub trusted_ips: Vec<String>,
    /// TLS mode at the edge.
    pub tls_mode: Option<TlsMode>,
    /// ALPNs accepted at the edge.
    pub tls_alpns: Vec<String>,
    /// Minimum TLS version at the edge.
    pub tls_min_version: Option<TlsMinVersion>,
    /// Edge cipher list.
    pub tls_ciphers: Vec<String>,
    /// Require downstream client certificates.
    pub mtls_auth: Option<bool>,
    /// HTTP version of inbound streams.
    pub http_version: Option<HttpVersion>,
    /// The edge requires a bearer token.
    pub token_auth: Option<bool>,
    /// The edge requires an rstream login.
    pub rstream_auth: Option<bool>,
    /// The edge shows a browser challenge.
    pub challenge_mode: Option<bool>,
    /// Stable hostname.
    pub hostname: Option<String>,
    /// Public TCP port (TCP only).
    pub port: Option<u32>,
    /// The local upstream speaks TLS.
    pub upstream_tls: Option<bool>,
    /// Datagram reliable path.
    pub datagram_guaranteed_delivery: Option<bool>,
    /// Allow cross-region payload routing.
    pub allow_cross_region_routing: Option<bool>,
}

impl TunnelOptions {
    /// Empty options (the engine picks the defaults).
    pub fn new() -> Self {
        Self::default()
    }

    /// A published HTTP tunnel.
    pub fn http() -> Self {
        Self::new().protocol(TunnelProtocol::Http)
    }

    /// A published TLS tunnel.
    pub fn tls() -> Self {
        Self::new().protocol(TunnelProtocol::Tls)
    }

    /// A published TCP tunnel.
    pub fn tcp() -> Self {
        Self::new().protocol(TunnelProtocol::Tcp)
    }

    /// A published datagram tunnel (`protocol: dtls`, `type: datagram`); wrap its streams in a
    /// [`DatagramStream`](crate::datagram::DatagramStream).
    pub fn dtls() -> Self {
        Self::new()
            .protocol(TunnelProtocol::Dtls)
            .tunnel_type(TunnelType::Datagram)
    }

    /// A private (unpublished) bytestream tunnel reachable by private dial under `name`.
    pub fn private(name: impl Into<String>) -> Self {
        Self::new().name(name).publish(false)
    }

    /// Sets the name.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }
    /// Sets `publish`.
    pub fn publish(mut self, publish: bool) -> Self {
        self.publish = Some(publish);
        self
    }
    /// Sets the protocol.
    pub fn protocol(mut self, protocol: TunnelProtocol) -> Self {
        self.protocol = Some(protocol);
        self
    }
    /// Sets the type.
    pub fn tunnel_type(mut self, tunnel_type: TunnelType) -> Self {
        self.tunnel_type = Some(tunnel_type);
        self
    }
    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }
    /// Sets the allowed countries.
    pub fn geoip<I: IntoIterator<Item = S>, S: Into<String>>(mut self, countries: I) -> Self {
        self.geoip = countries.into_iter().map(Into::into).collect();
        self
    }
    /// Sets the allowed source CIDRs.
    pub fn trusted_ips<I: IntoIterator<Item = S>, S: Into<String>>(mut self, cidrs: I) -> Self {
        self.trusted_ips = cidrs.into_iter().map(Into::into).collect();
        self
    }
    /// Sets the TLS mode.
    pub fn tls_mode(mut self, mode: TlsMode) -> Self {
        self.tls_mode = Some(mode);
        self
    }
    /// Sets the edge ALPNs.
    pub fn tls_alpns<I: IntoIterator<Item = S>, S: Into<String>>(mut self, alpns: I) -> Self {
        self.tls_alpns = alpns.into_iter().map(Into::into).collect();
        self
    }
    /// Sets the minimum TLS version.
    pub fn tls_min_version(mut self, version: TlsMinVersion) -> Self {
        self.tls_min_version = Some(version);
        self
    }
    /// Sets the edge ciphers.
    pub fn tls_ciphers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, ciphers: I) -> Self {
        self.tls_ciphers = ciphers.into_iter().map(Into::into).collect();
        self
    }
    /// Requires downstream client certificates.
    pub fn mtls_auth(mut self, on: bool) -> Self {
        self.mtls_auth = Some(on);
        self
    }
    /// Sets the HTTP version.
    pub fn http_version(mut self, version: HttpVersion) -> Self {
        self.http_version = Some(version);
        self
    }
    /// Requires a bearer token at the edge.
    pub fn token_auth(mut self, on: bool) -> Self {
        self.token_auth = Some(on);
        self
    }
    /// Requires an rstream login at the edge.
    pub fn rstream_auth(mut self, on: bool) -> Self {
        self.rstream_auth = Some(on);
        self
    }
    /// Shows a browser challenge at the edge.
    pub fn challenge_mode(mut self, on: bool) -> Self {
        self.challenge_mode = Some(on);
        self
    }
    /// Requests a stable hostname.
    pub fn hostname(mut self, hostname: impl Into<String>) -> Self {
        self.hostname = Some(hostname.into());
        self
    }
    /// Requests a reserved public TCP port.
    pub fn port(mut self, port: u32) -> Self {
        self.port = Some(port);
        self
    }
    /// Declares that the upstream speaks TLS.
    pub fn upstream_tls(mut self, on: bool) -> Self {
        self.upstream_tls = Some(on);
        self
    }
    /// Datagram reliable path (datagram tunnels only; passed through to the engine; over TLS every
    /// datagram is delivered in order anyway).
    pub fn datagram_guaranteed_delivery(mut self, on: bool) -> Self {
        self.datagram_guaranteed_delivery = Some(on);
        self
    }
    /// Allows cross-region routing.
    pub fn allow_cross_region_routing(mut self, on: bool) -> Self {
        self.allow_cross_region_routing = Some(on);
        self
    }

    /// Validates the options and builds the wire properties (see the module docs for the rules).
    pub fn to_properties(&self) -> Result<TunnelProperties> {
        let inferred = match (self.protocol, self.http_version) {
            (Some(TunnelProtocol::Dtls | TunnelProtocol::Quic), _) => TunnelType::Datagram,
            (Some(TunnelProtocol::Http), Some(HttpVersion::H3)) => TunnelType::Datagram,
            _ => TunnelType::Bytestream,
        };
        let tunnel_type = self.tunnel_type.unwrap_or(inferred);
        if self.protocol == Some(TunnelProtocol::Quic) {
            return Err(Error::Unsupported(
                "protocol 'quic' needs the QUIC transport, which this client does not implement; \
                 use protocol 'dtls' for a datagram tunnel over TLS"
                    .into(),
            ));
        }
        if self.http_version == Some(HttpVersion::H3) {
            return Err(Error::Unsupported(
                "HTTP/3 tunnels need the QUIC transport, which this client does not implement; \
                 use http/1.1 or h2c"
                    .into(),
            ));
        }
        let mut publish = self.publish;
        if self.protocol == Some(TunnelProtocol::Tcp) {
            publish = Some(true);
        }
        let props = TunnelProperties {
            name: self.name.clone(),
            r#type: Some(tunnel_type.as_str().to_owned()),
            publish,
            protocol: self.protocol.map(|p| p.as_str().to_owned()),
            labels: self.labels.clone(),
            geoip: self.geoip.clone(),
            trusted_ips: self.trusted_ips.clone(),
            tls_mode: self.tls_mode.map(|m| m.as_str().to_owned()),
            tls_alpns: self.tls_alpns.clone(),
            tls_min_version: self.tls_min_version.map(|v| v.as_str().to_owned()),
            tls_ciphers: self.tls_ciphers.clone(),
            mtls_auth: self.mtls_auth,
            http_version: self.http_version.map(|v| v.as_str().to_owned()),
            token_auth: self.token_auth,
            rstream_auth: self.rstream_auth,
            challenge_mode: self.challenge_mode,
            hostname: self.hostname.clone(),
            port: self.port,
            upstream_tls: self.upstream_tls,
            // HTTP tunnels also carry the deprecated field 18, as the operator always sent it:
            // engines older than `upstream_tls` read only that one.
            http_use_tls: self
                .upstream_tls
                .filter(|_| matches!(self.protocol, None | Some(TunnelProtocol::Http))),
            datagram_guaranteed_delivery: self.datagram_guaranteed_delivery,
            allow_cross_region_routing: self.allow_cross_region_routing,
            ..Default::default()
        };
        // Explicit `publish = false` on a TCP tunnel is an error even though we force it to true.
        if self.protocol == Some(TunnelProtocol::Tcp) && self.publish == Some(false) {
            return Err(Error::InvalidTunnelOptions(
                "TCP tunnels must be published".into(),
            ));
        }
        validate_properties(&props).map_err(Error::InvalidTunnelOptions)?;
        Ok(props)
    }
}

/// Checks wire properties against the client-side rules (also used by the local engine).
///
/// Returns a human-readable reason on violation.
pub fn validate_properties(p: &TunnelProperties) -> std::result::Result<(), String> {
    let protocol = p.protocol.as_deref();
    let is_tcp = protocol == Some("tcp");
    if let Some(port) = p.port {
        if !is_tcp {
            return Err("a published port requires protocol 'tcp'".into());
        }
        if !(1..=65_535).contains(&port) {
            return Err("the published TCP port must be between 1 and 65535".into());
        }
    }
    if is_tcp {
        if p.publish == Some(false) {
            return Err("TCP tunnels must be published".into());
        }
        if p.r#type.as_deref().is_some_and(|t| t != "bytestream") {
            return Err("TCP tunnels are bytestream tunnels".into());
        }
        if p.hostname.is_some()
            || p.tls_mode.is_some()
            || !p.tls_alpns.is_empty()
            || p.tls_min_version.is_some()
            || !p.tls_ciphers.is_empty()
            || p.mtls_auth.is_some()
            || p.http_version.is_some()
            || p.upstream_tls.is_some()
            || p.token_auth.is_some()
            || p.rstream_auth.is_some()
            || p.challenge_mode.is_some()
            || p.datagram_guaranteed_delivery.is_some()
        {
            return Err(
                "TCP tunnels do not accept hostname, HTTP, TLS, or edge authentication options"
                    .into(),
            );
        }
    }
    if p.publish == Some(false) {
        let exposure = [
            (!p.geoip.is_empty(), "geoip"),
            (!p.trusted_ips.is_empty(), "trusted IPs"),
            (p.tls_mode.is_some(), "TLS mode"),
            (p.tls_min_version.is_some(), "TLS minimum version"),
            (!p.tls_ciphers.is_empty(), "TLS ciphers"),
            (p.mtls_auth.is_some(), "mTLS"),
            (p.token_auth.is_some(), "token auth"),
            (p.rstream_auth.is_some(), "rstream auth"),
            (p.challenge_mode.is_some(), "challenge mode"),
            (p.hostname.is_some(), "hostname"),
            (p.port.is_some(), "port"),
        ];
        if let Some((_, what)) = exposure.iter().find(|(set, _)| *set) {
            return Err(format!(
                "private tunnels do not accept public-exposure option '{what}'"
            ));
        }
    }
    if p.http_version.is_some() && protocol.is_some() && protocol != Some("http") {
        return Err("HTTP options require protocol 'http'".into());
    }
    let datagram = p.r#type.as_deref() == Some("datagram");
    if datagram && protocol.is_some_and(|p| !matches!(p, "dtls" | "quic")) {
        return Err("datagram tunnels use protocol 'dtls'".into());
    }
    if protocol == Some("dtls") && !datagram {
        return Err("protocol 'dtls' carries datagrams: the type must be 'datagram'".into());
    }
    if p.datagram_guaranteed_delivery == Some(true) && !datagram {
        return Err("guaranteed delivery requires a datagram tunnel".into());
    }
    if let Some(h) = p.hostname.as_deref()
        && !valid_dns_name(&h.trim().to_ascii_lowercase())
    {
        return Err(format!("invalid hostname '{h}'"));
    }
    Ok(())
}

const DEFAULT_PUBLISHED_PORT: u32 = 443;

/// The display string of a tunnel, formatted as the official SDKs do:
/// `https://host` (http), `host:port (tls)`, `host:port (tcp)`, or `rstrm://name (unpublished)`.
///
/// ```
/// use rstream_client::{proto::TunnelProperties, tunnel::forwarding_address};
/// let p = TunnelProperties { protocol: Some("tcp".into()), hostname: Some("test.localhost".into()),
///     port: Some(10042), ..Default::default() };
/// assert_eq!(forwarding_address(&p).unwrap(), "test.localhost:10042 (tcp)");
/// ```
pub fn forwarding_address(p: &TunnelProperties) -> Result<String> {
    let protocol = p.protocol.as_deref();
    let published = match p.hostname.as_deref().filter(|h| !h.trim().is_empty()) {
        Some(hostname) => {
            let port = p
                .port
                .filter(|&port| port != 0)
                .unwrap_or(DEFAULT_PUBLISHED_PORT);
            if matches!(protocol, Some("tls" | "tcp")) || port != DEFAULT_PUBLISHED_PORT {
                Some(format!("{hostname}:{port}"))
            } else {
                Some(hostname.to_owned())
            }
        }
        None => p.host.clone().filter(|h| !h.trim().is_empty()),
    };
    if let Some(host) = published {
        return Ok(match protocol {
            Some("http") => format!("https://{host}"),
            Some(other @ ("tls" | "tcp" | "dtls" | "quic")) => format!("{host} ({other})"),
            _ => host,
        });
    }
    if let Some(name) = p.name.as_deref().filter(|n| !n.is_empty()) {
        return Ok(format!("rstrm://{name} (unpublished)"));
    }
    if let Some(id) = p.id.as_deref().filter(|n| !n.is_empty()) {
        return Ok(format!("rstrm://{id} (unpublished)"));
    }
    Err(Error::InvalidTunnel("no host, name, or ID".into()))
}

/// Generates a stable hostname `<slug>-<project-endpoint>.t.<cluster-domain>` for an engine host
/// `<project-endpoint>.<cluster-domain>` (slug = `r` + 8 random hex characters).
///
/// Returns `None` for IP literals, single-label hosts (`localhost`) and hosts that are not valid DNS
/// names, or when the first label would exceed 63 characters. Generate it once and reuse it for every
/// re-creation of the tunnel.
pub fn generate_stable_hostname(engine_host: &str) -> Option<String> {
    let host = engine_host
        .trim()
        .trim_end_matches('.')
        .to_ascii_lowercase();
    if host.parse::<std::net::IpAddr>().is_ok() || host.starts_with('[') {
        return None;
    }
    let (endpoint, domain) = host.split_once('.')?;
    if !valid_dns_label(endpoint) || !valid_dns_name(domain) {
        return None;
    }
    let max_slug = 63usize.checked_sub(endpoint.len() + 1)?;
    if max_slug < 9 {
        return None;
    }
    let slug = format!("r{:08x}", rand::random::<u32>());
    Some(format!("{slug}-{endpoint}.t.{domain}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn invalid(o: TunnelOptions) -> String {
        match o.to_properties() {
            Err(Error::InvalidTunnelOptions(m)) => m,
            other => panic!("expected invalid options, got {other:?}"),
        }
    }

    #[test]
    fn tcp_rules() {
        let p = TunnelOptions::tcp().to_properties().unwrap();
        assert_eq!(p.publish, Some(true));
        assert_eq!(p.r#type.as_deref(), Some("bytestream"));
        assert!(invalid(TunnelOptions::tcp().publish(false)).contains("published"));
        assert!(invalid(TunnelOptions::tcp().hostname("a.example.com")).contains("TCP"));
        assert!(invalid(TunnelOptions::tcp().token_auth(true)).contains("TCP"));
        assert!(invalid(TunnelOptions::tcp().upstream_tls(true)).contains("TCP"));
        assert!(invalid(TunnelOptions::tcp().port(0)).contains("between"));
        assert!(invalid(TunnelOptions::tcp().port(70_000)).contains("between"));
        assert_eq!(
            TunnelOptions::tcp()
                .port(10042)
                .to_properties()
                .unwrap()
                .port,
            Some(10042)
        );
        assert!(invalid(TunnelOptions::http().port(10042)).contains("requires"));
        assert!(invalid(TunnelOptions::new().port(10042)).contains("requires"));
    }

    #[test]
    fn private_and_http_rules() {
        let p = TunnelOptions::private("db")
            .label("k", "v")
            .to_properties()
            .unwrap();
        assert_eq!(p.publish, Some(false));
        assert_eq!(p.name.as_deref(), Some("db"));
        assert!(invalid(TunnelOptions::private("db").geoip(["FR"])).contains("geoip"));
        assert!(invalid(TunnelOptions::private("db").token_auth(true)).contains("token"));
        assert!(
            invalid(TunnelOptions::private("db").hostname("x.example.com")).contains("hostname")
        );
        assert!(invalid(TunnelOptions::tls().http_version(HttpVersion::H2c)).contains("HTTP"));
        assert!(
            invalid(TunnelOptions::http().datagram_guaranteed_delivery(true)).contains("datagram")
        );
        assert!(invalid(TunnelOptions::http().hostname("bad host")).contains("hostname"));
        let full = TunnelOptions::http()
            .name("web")
            .label("a", "b")
            .geoip(["FR", "DE"])
            .trusted_ips(["10.0.0.0/8"])
            .tls_mode(TlsMode::Terminated)
            .tls_alpns(["h2"])
            .tls_min_version(TlsMinVersion::Tls13)
            .tls_ciphers(["TLS_AES_128_GCM_SHA256"])
            .mtls_auth(false)
            .http_version(HttpVersion::Http11)
            .token_auth(true)
            .rstream_auth(false)
            .challenge_mode(true)
            .hostname("web-abc.t.example.io")
            .upstream_tls(false)
            .allow_cross_region_routing(true)
            .to_properties()
            .unwrap();
        assert_eq!(full.tls_min_version.as_deref(), Some("tls1.3"));
        assert_eq!(full.allow_cross_region_routing, Some(true));
        assert_eq!(full.geoip, ["FR", "DE"]);
    }

    #[test]
    fn upstream_tls_also_sets_the_deprecated_field_for_http() {
        for (options, expected) in [
            (TunnelOptions::http().upstream_tls(true), Some(true)),
            (TunnelOptions::new().upstream_tls(false), Some(false)),
            (TunnelOptions::http(), None),
            (TunnelOptions::tls().upstream_tls(true), None),
        ] {
            let p = options.to_properties().unwrap();
            assert_eq!(p.http_use_tls, expected, "{options:?}");
            assert_eq!(p.upstream_tls, options.upstream_tls, "{options:?}");
        }
    }

    #[test]
    fn quic_and_http3_are_unsupported() {
        for (o, needle) in [
            (TunnelOptions::new().protocol(TunnelProtocol::Quic), "quic"),
            (
                TunnelOptions::new()
                    .protocol(TunnelProtocol::Quic)
                    .tunnel_type(TunnelType::Datagram),
                "quic",
            ),
            (
                TunnelOptions::http().http_version(HttpVersion::H3),
                "HTTP/3",
            ),
        ] {
            match o.to_properties() {
                Err(Error::Unsupported(m)) => {
                    assert!(m.contains(needle) && m.contains("QUIC"), "{m}")
                }
                other => panic!("{o:?}: expected unsupported, got {other:?}"),
            }
        }
    }

    #[test]
    fn datagram_tunnels_over_tls() {
        let p = TunnelOptions::dtls()
            .datagram_guaranteed_delivery(true)
            .to_properties()
            .unwrap();
        assert_eq!(p.protocol.as_deref(), Some("dtls"));
        assert_eq!(p.r#type.as_deref(), Some("datagram"));
        assert_eq!(p.datagram_guaranteed_delivery, Some(true));
        // The type is inferred from dtls.
        let p = TunnelOptions::new()
            .protocol(TunnelProtocol::Dtls)
            .to_properties()
            .unwrap();
        assert_eq!(p.r#type.as_deref(), Some("datagram"));
        let private = TunnelOptions::private("udp")
            .tunnel_type(TunnelType::Datagram)
            .to_properties()
            .unwrap();
        assert_eq!(private.r#type.as_deref(), Some("datagram"));
        assert!(invalid(TunnelOptions::http().tunnel_type(TunnelType::Datagram)).contains("dtls"));
        assert!(
            invalid(TunnelOptions::tcp().tunnel_type(TunnelType::Datagram)).contains("bytestream")
        );
        assert!(
            invalid(TunnelOptions::dtls().tunnel_type(TunnelType::Bytestream)).contains("datagram")
        );
        assert!(invalid(TunnelOptions::dtls().port(10042)).contains("tcp"));
        assert!(invalid(TunnelOptions::dtls().http_version(HttpVersion::H2c)).contains("HTTP"));
    }

    #[test]
    fn forwarding_addresses() {
        let p = |proto: Option<&str>, host: Option<&str>, port: Option<u32>| TunnelProperties {
            protocol: proto.map(Into::into),
            hostname: host.map(Into::into),
            port,
            ..Default::default()
        };
        let f = |x| forwarding_address(&x).unwrap();
        assert_eq!(
            f(p(Some("http"), Some("web.example.test"), None)),
            "https://web.example.test"
        );
        assert_eq!(
            f(p(Some("http"), Some("web.example.test"), Some(8443))),
            "https://web.example.test:8443"
        );
        assert_eq!(
            f(p(Some("tls"), Some("web.example.test"), None)),
            "web.example.test:443 (tls)"
        );
        assert_eq!(
            f(p(Some("tcp"), Some("test.localhost"), Some(10042))),
            "test.localhost:10042 (tcp)"
        );
        assert_eq!(f(p(Some("quic"), Some("q.test"), None)), "q.test (quic)");
        assert_eq!(f(p(None, Some("h.test"), None)), "h.test");
        let legacy = TunnelProperties {
            host: Some("legacy.test".into()),
            protocol: Some("http".into()),
            ..Default::default()
        };
        assert_eq!(f(legacy), "https://legacy.test");
        let named = TunnelProperties {
            name: Some("db".into()),
            id: Some("t1".into()),
            ..Default::default()
        };
        assert_eq!(f(named), "rstrm://db (unpublished)");
        assert_eq!(
            f(TunnelProperties {
                id: Some("t1".into()),
                ..Default::default()
            }),
            "rstrm://t1 (unpublished)"
        );
        assert!(matches!(
            forwarding_address(&TunnelProperties::default()),
            Err(Error::InvalidTunnel(_))
        ));
    }

    #[test]
    fn stable_hostnames() {
        let h = generate_stable_hostname("e7e8a732.aws-eu-west-3-1.c.rstream.io").unwrap();
        let (first, rest) = h.split_once('.').unwrap();
        assert_eq!(rest, "t.aws-eu-west-3-1.c.rstream.io");
        assert!(
            first.starts_with('r') && first.ends_with("-e7e8a732") && first.len() == 9 + 1 + 8,
            "{h}"
        );
        assert_ne!(
            h,
            generate_stable_hostname("e7e8a732.aws-eu-west-3-1.c.rstream.io").unwrap()
        );
        assert_eq!(generate_stable_hostname("localhost"), None);
        assert_eq!(generate_stable_hostname("127.0.0.1"), None);
        assert_eq!(
            generate_stable_hostname(&format!("{}.example.io", "a".repeat(54))),
            None
        );
        assert!(generate_stable_hostname(&format!("{}.example.io", "a".repeat(53))).is_some());
    }
}
