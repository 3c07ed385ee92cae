//! [`ClientBuilder`]: a client's configuration, checked once at `build`.

use super::{
    AGENT, Client, ClientInner, DEFAULT_ACCEPT_QUEUE, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_MAX_CONCURRENT_DIALS, DEFAULT_MAX_QUEUED_STREAMS,
    DEFAULT_OPERATION_TIMEOUT, IpFamily, Target, check_token_expiry,
};
use crate::error::{Error, Result};
use crate::resolve::{self, ControlPlaneOptions, EngineAddress};
use crate::tls::{self, TlsOptions};
use proxy_core::http_connect::HttpProxy;
use std::sync::Arc;
use std::time::Duration;

/// Builder of a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    pub(super) engine: Option<String>,
    pub(super) project_endpoint: Option<String>,
    pub(super) region: Option<String>,
    pub(super) control_plane: ControlPlaneOptions,
    pub(super) token: Option<String>,
    pub(super) tls: TlsOptions,
    pub(super) connect_timeout: Duration,
    pub(super) operation_timeout: Duration,
    pub(super) heartbeat_interval: Option<Duration>,
    pub(super) zero_rtt: bool,
    pub(super) max_concurrent_dials: usize,
    pub(super) max_queued_streams: usize,
    pub(super) accept_queue: usize,
    pub(super) agent: (String, String),
    pub(super) proxy: Option<HttpProxy>,
    pub(super) ip_family: Option<IpFamily>,
    pub(super) local_address: Option<std::net::IpAddr>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            engine: None,
            project_endpoint: None,
            region: None,
            control_plane: ControlPlaneOptions::default(),
            token: None,
            tls: TlsOptions::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            heartbeat_interval: Some(DEFAULT_HEARTBEAT_INTERVAL),
            zero_rtt: true,
            max_concurrent_dials: DEFAULT_MAX_CONCURRENT_DIALS,
            max_queued_streams: DEFAULT_MAX_QUEUED_STREAMS,
            accept_queue: DEFAULT_ACCEPT_QUEUE,
            agent: (AGENT.to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
            proxy: None,
            ip_family: None,
            local_address: None,
        }
    }
}

/// The environment variables [`ClientBuilder::from_env`] reads, as the official SDKs name them.
pub const ENV_VARS: &[&str] = &[
    "RSTREAM_ENGINE",
    "RSTREAM_ENGINE_ADDRESS",
    "RSTREAM_AUTHENTICATION_TOKEN",
    "RSTREAM_API_URL",
    "RSTREAM_REGION",
    "RSTREAM_CONTROL_PLANE_HEADERS",
    "RSTREAM_TUNNEL_TRANSPORT",
    "RSTREAM_QUIC_TRANSPORT",
    "RSTREAM_MTLS_CERT_FILE",
    "RSTREAM_MTLS_KEY_FILE",
];

impl ClientBuilder {
    /// A builder configured from the SDK environment variables ([`ENV_VARS`]); options set on
    /// it afterwards win, as explicit options do in the SDKs:
    ///
    /// * `RSTREAM_ENGINE` (legacy `RSTREAM_ENGINE_ADDRESS`): the engine `host[:port]`;
    /// * `RSTREAM_AUTHENTICATION_TOKEN`: the token;
    /// * `RSTREAM_API_URL`, `RSTREAM_REGION`, `RSTREAM_CONTROL_PLANE_HEADERS` (a JSON object of
    ///   string values): the control plane;
    /// * `RSTREAM_TUNNEL_TRANSPORT`: `auto` or `tls`; `quic` (or the legacy
    ///   `RSTREAM_QUIC_TRANSPORT=1`) is [`Error::Unsupported`];
    /// * `RSTREAM_MTLS_CERT_FILE` and `RSTREAM_MTLS_KEY_FILE`: an mTLS identity (both or neither).
    ///
    /// Empty values count as unset. The SDKs' config file (`~/.rstream/config.yaml`) is not read.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`ClientBuilder::from_env`] with the variables looked up by `lookup` (tests, or a
    /// configuration source other than the process environment).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |name: &str| {
            lookup(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let mut builder = Self::default();
        if let Some(engine) = var("RSTREAM_ENGINE").or_else(|| var("RSTREAM_ENGINE_ADDRESS")) {
            builder = builder.engine(engine);
        }
        if let Some(token) = var("RSTREAM_AUTHENTICATION_TOKEN") {
            builder = builder.token(token);
        }
        if let Some(region) = var("RSTREAM_REGION") {
            builder = builder.region(region);
        }
        let mut control_plane = match var("RSTREAM_API_URL") {
            Some(url) => ControlPlaneOptions::new(url),
            None => ControlPlaneOptions::default(),
        };
        if let Some(json) = var("RSTREAM_CONTROL_PLANE_HEADERS") {
            let bad =
                |why: String| Error::InvalidConfig(format!("RSTREAM_CONTROL_PLANE_HEADERS: {why}"));
            let value: serde_json::Value =
                serde_json::from_str(&json).map_err(|e| bad(format!("not JSON: {e}")))?;
            let object = value
                .as_object()
                .ok_or_else(|| bad("expected a JSON object".to_owned()))?;
            for (name, value) in object {
                let value = value
                    .as_str()
                    .ok_or_else(|| bad(format!("the value of '{name}' is not a string")))?;
                control_plane = control_plane.header(name, value)?;
            }
        }
        builder = builder.control_plane(control_plane);
        match var("RSTREAM_TUNNEL_TRANSPORT").map(|m| m.to_ascii_lowercase()) {
            None => {}
            Some(mode) if mode == "auto" || mode == "tls" => {}
            Some(mode) if mode == "quic" => {
                return Err(Error::Unsupported(
                    "RSTREAM_TUNNEL_TRANSPORT=quic: QUIC transport is not supported by this client"
                        .into(),
                ));
            }
            Some(mode) => {
                return Err(Error::InvalidConfig(format!(
                    "RSTREAM_TUNNEL_TRANSPORT must be auto, tls or quic, not '{mode}'"
                )));
            }
        }
        if let Some(quic) = var("RSTREAM_QUIC_TRANSPORT")
            && matches!(
                quic.to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        {
            return Err(Error::Unsupported(
                "RSTREAM_QUIC_TRANSPORT: QUIC transport is not supported by this client".into(),
            ));
        }
        match (var("RSTREAM_MTLS_CERT_FILE"), var("RSTREAM_MTLS_KEY_FILE")) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                let identity = tls::ClientIdentity::from_files(cert, key)?;
                builder.tls = builder.tls.client_identity(identity);
            }
            _ => {
                return Err(Error::InvalidConfig(
                    "RSTREAM_MTLS_CERT_FILE and RSTREAM_MTLS_KEY_FILE go together".into(),
                ));
            }
        }
        Ok(builder)
    }

    /// Connects directly to this engine (`host[:port]`, default port 443).
    pub fn engine(mut self, engine: impl Into<String>) -> Self {
        self.engine = Some(engine.into());
        self
    }
    /// Resolves the engine from this project endpoint through the control plane.
    pub fn project_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.project_endpoint = Some(endpoint.into());
        self
    }
    /// Selects a regional engine of the project (requires a project endpoint, excludes `engine`).
    pub fn region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }
    /// Control-plane URL and headers (default `https://rstream.io`).
    pub fn control_plane(mut self, control_plane: ControlPlaneOptions) -> Self {
        self.control_plane = control_plane;
        self
    }
    /// Authenticates with this token (mutually exclusive with an mTLS client certificate).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }
    /// TLS options (CA, server name, insecure mode, mTLS identity).
    pub fn tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }
    /// TCP+TLS connect timeout (default 15 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
    /// Timeout of handshake responses, creates and closes (default 30 s).
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }
    /// Heartbeat interval (1 s to 5 min, whole milliseconds; default 5 s); `None` disables heartbeats.
    pub fn heartbeat_interval(mut self, interval: Option<Duration>) -> Self {
        self.heartbeat_interval = interval;
        self
    }
    /// Zero-RTT data connections (default on): no response frame is awaited.
    pub fn zero_rtt(mut self, zero_rtt: bool) -> Self {
        self.zero_rtt = zero_rtt;
        self
    }
    /// Maximum concurrent inbound-stream dials per control channel (default 64).
    pub fn max_concurrent_dials(mut self, n: usize) -> Self {
        self.max_concurrent_dials = n.max(1);
        self
    }
    /// Maximum queued inbound-stream requests; beyond it requests are refused (default 256).
    pub fn max_queued_streams(mut self, n: usize) -> Self {
        self.max_queued_streams = n.max(1);
        self
    }
    /// Per-tunnel queue of delivered streams waiting for `accept` (default 16).
    pub fn accept_queue(mut self, n: usize) -> Self {
        self.accept_queue = n.max(1);
        self
    }
    /// Agent name and version sent in `ClientDetails` (default `rstream-rust` and the crate version).
    pub fn agent(mut self, name: impl Into<String>, version: impl Into<String>) -> Self {
        self.agent = (name.into(), version.into());
        self
    }

    /// Reaches the engine (control channel, data connections, private dials) through this HTTP
    /// proxy with `CONNECT`, and the control plane too unless [`ControlPlaneOptions::proxy`]
    /// names another one.
    pub fn proxy(mut self, proxy: HttpProxy) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Connects only to addresses of this family (the engine's, or the HTTP proxy's when one is
    /// set): a name without such an address is an error. Default: any, in the resolver's order.
    pub fn ip_family(mut self, family: IpFamily) -> Self {
        self.ip_family = Some(family);
        self
    }

    /// Connects from this local address (the engine's or the HTTP proxy's connections). Only
    /// addresses of its family are dialled.
    pub fn local_address(mut self, address: std::net::IpAddr) -> Self {
        self.local_address = Some(address);
        self
    }

    /// Validates the configuration: engine or project endpoint, token vs mTLS, token expiry,
    /// heartbeat range, TLS material.
    pub fn build(mut self) -> Result<Client> {
        if self.token.is_some() && self.tls.has_client_identity() {
            return Err(Error::AuthConflict);
        }
        if let Some(token) = &self.token {
            check_token_expiry(token)?;
        }
        if let Some(interval) = self.heartbeat_interval {
            let ms = interval.as_millis();
            if interval.subsec_nanos() % 1_000_000 != 0 || !(1_000..=300_000).contains(&ms) {
                return Err(Error::InvalidConfig(
                    "heartbeat interval must be between 1 s and 300 s with millisecond precision"
                        .into(),
                ));
            }
        }
        if self.connect_timeout.is_zero() || self.operation_timeout.is_zero() {
            return Err(Error::InvalidConfig("timeouts must be positive".into()));
        }
        if let (Some(family), Some(local)) = (self.ip_family, self.local_address)
            && !family.admits(local)
        {
            return Err(Error::InvalidConfig(format!(
                "the local address {local} is not of the family {family:?}"
            )));
        }
        let region = resolve::normalize_region(self.region.as_deref())?;
        let target = match (&self.engine, &self.project_endpoint) {
            (Some(_), _) if region.is_some() => {
                return Err(Error::InvalidConfig(
                    "region selection cannot be combined with an explicit engine".into(),
                ));
            }
            (Some(engine), _) => Target::Direct(EngineAddress::parse(engine)?),
            (None, Some(endpoint)) if !endpoint.trim().is_empty() => Target::Project {
                endpoint: endpoint.trim().to_owned(),
                region,
            },
            _ if region.is_some() => {
                return Err(Error::InvalidConfig(
                    "region selection requires a project endpoint".into(),
                ));
            }
            _ => return Err(Error::EngineRequired),
        };
        if let Some(proxy) = &self.proxy
            && self.control_plane.proxy.is_none()
        {
            self.control_plane.proxy = Some(proxy.clone());
        }
        let tls_config = tls::client_config(&self.tls)?;
        Ok(Client {
            inner: Arc::new(ClientInner {
                cfg: self,
                target,
                tls_config,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::HashMap;

    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn environment_variables_configure_the_builder() {
        let b = ClientBuilder::from_vars(vars(&[
            ("RSTREAM_ENGINE_ADDRESS", "legacy.example.io"),
            ("RSTREAM_AUTHENTICATION_TOKEN", " tok "),
            ("RSTREAM_API_URL", "https://api.example.io/"),
            ("RSTREAM_CONTROL_PLANE_HEADERS", r#"{"X-Team": "netkit"}"#),
            ("RSTREAM_TUNNEL_TRANSPORT", "TLS"),
            ("RSTREAM_QUIC_TRANSPORT", "0"),
        ]))
        .unwrap();
        assert_eq!(b.engine.as_deref(), Some("legacy.example.io"));
        assert_eq!(b.token.as_deref(), Some("tok"));
        assert_eq!(b.control_plane.api_url(), "https://api.example.io");
        assert_eq!(
            b.control_plane.headers,
            [("X-Team".to_owned(), "netkit".to_owned())]
        );
        // The current name wins over the legacy one; empty values are unset.
        let b = ClientBuilder::from_vars(vars(&[
            ("RSTREAM_ENGINE", "new.example.io:8443"),
            ("RSTREAM_ENGINE_ADDRESS", "legacy.example.io"),
            ("RSTREAM_AUTHENTICATION_TOKEN", ""),
        ]))
        .unwrap();
        assert_eq!(b.engine.as_deref(), Some("new.example.io:8443"));
        assert_eq!(b.token, None);
        // The region needs a project endpoint, as with explicit options.
        let b = ClientBuilder::from_vars(vars(&[("RSTREAM_REGION", "eu-1")])).unwrap();
        assert_eq!(b.region.as_deref(), Some("eu-1"));
        assert!(matches!(b.build(), Err(Error::InvalidConfig(_))));
    }

    #[test]
    fn bad_environment_values_are_refused() {
        for (pairs, quic) in [
            (&[("RSTREAM_TUNNEL_TRANSPORT", "quic")][..], true),
            (&[("RSTREAM_QUIC_TRANSPORT", "1")][..], true),
            (&[("RSTREAM_TUNNEL_TRANSPORT", "udp")][..], false),
            (&[("RSTREAM_CONTROL_PLANE_HEADERS", "[1]")][..], false),
            (&[("RSTREAM_CONTROL_PLANE_HEADERS", "{")][..], false),
            (
                &[("RSTREAM_CONTROL_PLANE_HEADERS", r#"{"a": 1}"#)][..],
                false,
            ),
            (
                &[("RSTREAM_CONTROL_PLANE_HEADERS", r#"{"Authorization": "x"}"#)][..],
                false,
            ),
            (&[("RSTREAM_MTLS_CERT_FILE", "/tmp/cert.pem")][..], false),
        ] {
            match ClientBuilder::from_vars(vars(pairs)) {
                Err(Error::Unsupported(m)) if quic => assert!(m.contains("QUIC"), "{m}"),
                Err(Error::InvalidConfig(m)) if !quic => {
                    assert!(m.contains("RSTREAM_") || m.contains("header"), "{m}")
                }
                other => panic!("{pairs:?}: {other:?}"),
            }
        }
    }
}
