//! Engine addresses and control-plane resolution.
//!
//! * [`EngineAddress`] parses and validates `host[:port]` (default port 443, IPv6 in brackets).
//! * [`resolve_engine`] asks the control plane (`GET {api}/api/projects/tunnels/resolve/{endpoint}` with
//!   a bearer token, redirects never followed) and derives the engine address with
//!   [`engine_from_project`], applying the region rules.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use proxy_core::http_connect::HttpProxy;
use proxy_core::upstream::TargetAddr;
use serde_json::Value;
use tokio::net::TcpStream;

use crate::error::{Error, Result};
use crate::tls::{self, TlsOptions};

/// Default control-plane URL.
pub const DEFAULT_API_URL: &str = "https://rstream.io";
/// Default engine port.
pub const DEFAULT_ENGINE_PORT: u16 = 443;
const API_TIMEOUT: Duration = Duration::from_secs(15);
const MAX_BODY: usize = 1024 * 1024;

/// A validated engine address: a lowercase DNS name or an IP literal, and a port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EngineAddress {
    host: String,
    port: u16,
}

impl EngineAddress {
    /// Parses `host[:port]`. The port defaults to 443; IPv6 literals are written `[::1]:9443`.
    /// Schemes, paths, user info and whitespace are rejected; hostnames must be ASCII DNS names
    /// (IDNA conversion is not performed: pass the punycode form).
    pub fn parse(input: &str) -> Result<Self> {
        let s = input.trim();
        let bad = |why: &str| Error::InvalidEngine(format!("'{input}': {why}"));
        if s.is_empty() {
            return Err(bad("empty"));
        }
        if s.contains("://")
            || s.chars()
                .any(|c| matches!(c, '/' | '?' | '#' | '@' | '\\') || c.is_whitespace())
        {
            return Err(bad("must be host[:port] without scheme or path"));
        }
        let parse_port = |p: &str| -> Result<u16> {
            match p.parse::<u16>() {
                Ok(port) if port != 0 => Ok(port),
                _ => Err(bad("port must be an integer between 1 and 65535")),
            }
        };
        if let Some(rest) = s.strip_prefix('[') {
            let (host, after) = rest
                .split_once(']')
                .ok_or_else(|| bad("unterminated '['"))?;
            let ip: Ipv6Addr = host.parse().map_err(|_| bad("invalid IPv6 literal"))?;
            let port = match after {
                "" => DEFAULT_ENGINE_PORT,
                p => parse_port(
                    p.strip_prefix(':')
                        .ok_or_else(|| bad("garbage after ']'"))?,
                )?,
            };
            return Ok(Self {
                host: ip.to_string(),
                port,
            });
        }
        let (host, port) = match s.split_once(':') {
            Some((h, p)) => {
                if p.contains(':') {
                    return Err(bad("IPv6 literals must be written in brackets"));
                }
                (h, parse_port(p)?)
            }
            None => (s, DEFAULT_ENGINE_PORT),
        };
        if host.parse::<IpAddr>().is_ok() {
            return Ok(Self {
                host: host.to_owned(),
                port,
            });
        }
        let host = host.to_ascii_lowercase();
        if !valid_dns_name(&host) {
            return Err(bad("invalid hostname"));
        }
        Ok(Self { host, port })
    }

    /// The host (DNS name or IP literal, without brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether the host is an IP literal.
    pub fn is_ip(&self) -> bool {
        self.host.parse::<IpAddr>().is_ok()
    }

    /// `host:port` suitable for `TcpStream::connect`.
    pub(crate) fn connect_target(&self) -> (String, u16) {
        (self.host.clone(), self.port)
    }

    /// The address as proxy-core's dialers take it.
    pub(crate) fn target_addr(&self) -> TargetAddr {
        match self.host.parse::<IpAddr>() {
            Ok(ip) => TargetAddr::Socket((ip, self.port).into()),
            Err(_) => TargetAddr::Host {
                host: self.host.clone(),
                port: self.port,
            },
        }
    }
}

impl fmt::Display for EngineAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl std::str::FromStr for EngineAddress {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

pub(crate) fn valid_dns_label(label: &str) -> bool {
    let b = label.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

pub(crate) fn valid_dns_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 253 && name.split('.').all(valid_dns_label)
}

/// Normalises a region: trimmed, lowercased; empty or `auto` means "no region".
pub fn normalize_region(region: Option<&str>) -> Result<Option<String>> {
    let Some(r) = region.map(|r| r.trim().to_ascii_lowercase()) else {
        return Ok(None);
    };
    if r.is_empty() || r == "auto" {
        return Ok(None);
    }
    let b = r.as_bytes();
    let inner_ok =
        |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'_' | b'-');
    let edge_ok = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    if b.len() > 64 || !b.iter().all(inner_ok) || !edge_ok(&b[0]) || !edge_ok(&b[b.len() - 1]) {
        return Err(Error::InvalidRegion(r));
    }
    Ok(Some(r))
}

/// Control-plane options: the API URL and extra headers sent only to the control plane.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    pub(crate) api_url: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) proxy: Option<HttpProxy>,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self {
            api_url: DEFAULT_API_URL.to_owned(),
            headers: Vec::new(),
            proxy: None,
        }
    }
}

const RESERVED_HEADERS: &[&str] = &[
    "authorization",
    "connection",
    "content-length",
    "cookie",
    "forwarded",
    "host",
    "keep-alive",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

impl ControlPlaneOptions {
    /// Uses `api_url` (trailing slashes are trimmed). `http://` is allowed for local control planes.
    pub fn new(api_url: impl Into<String>) -> Self {
        Self {
            api_url: api_url.into().trim_end_matches('/').to_owned(),
            headers: Vec::new(),
            proxy: None,
        }
    }

    /// Reaches the control plane through this HTTP proxy (`CONNECT`, for `http://` API URLs
    /// too). [`ClientBuilder::proxy`](crate::ClientBuilder::proxy) sets it when this is unset.
    pub fn proxy(mut self, proxy: HttpProxy) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Adds a header sent to the control plane only. Reserved names (`authorization`, `host`,
    /// hop-by-hop headers, `x-forwarded-*`, ...), CR/LF in values and duplicate names are rejected.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let value = value.into();
        let lower = name.to_ascii_lowercase();
        if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("x-forwarded-") {
            return Err(Error::InvalidConfig(format!(
                "control-plane header '{name}' is reserved"
            )));
        }
        if value.contains(['\r', '\n']) || http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(Error::InvalidConfig(format!(
                "invalid control-plane header '{name}'"
            )));
        }
        if self
            .headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case(&name))
        {
            return Err(Error::InvalidConfig(format!(
                "duplicate control-plane header '{name}'"
            )));
        }
        self.headers.push((name, value));
        Ok(self)
    }

    /// The API URL.
    pub fn api_url(&self) -> &str {
        &self.api_url
    }
}

/// Percent-encodes one path segment (everything but RFC 3986 unreserved characters).
pub(crate) fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Resolves a project endpoint to an engine address through the control plane.
///
/// `tls` supplies the trust roots for an `https` API URL (its client certificate is not used).
pub async fn resolve_engine(
    control_plane: &ControlPlaneOptions,
    project_endpoint: &str,
    region: Option<&str>,
    token: Option<&str>,
    tls: &TlsOptions,
) -> Result<EngineAddress> {
    let endpoint = project_endpoint.trim();
    if endpoint.is_empty() {
        return Err(Error::EngineRequired);
    }
    let token = token.ok_or_else(|| {
        Error::InvalidConfig("a token is required to resolve a project endpoint".into())
    })?;
    let region = normalize_region(region)?;
    let path = format!("/api/projects/tunnels/resolve/{}", encode_segment(endpoint));
    let project = get_json(control_plane, &path, token, tls).await?;
    engine_from_project(&project, region.as_deref())
}

/// Resolves a project ID (`GET {apiUrl}/api/projects/tunnels/{id}`) to an engine address through
/// the control plane, with the same rules as [`resolve_engine`].
pub async fn resolve_engine_by_project_id(
    control_plane: &ControlPlaneOptions,
    project_id: &str,
    region: Option<&str>,
    token: Option<&str>,
    tls: &TlsOptions,
) -> Result<EngineAddress> {
    let id = project_id.trim();
    if id.is_empty() {
        return Err(Error::EngineRequired);
    }
    let token = token.ok_or_else(|| {
        Error::InvalidConfig("a token is required to resolve a project ID".into())
    })?;
    let region = normalize_region(region)?;
    let path = format!("/api/projects/tunnels/{}", encode_segment(id));
    let project = get_json(control_plane, &path, token, tls).await?;
    engine_from_project(&project, region.as_deref())
}

async fn get_json(
    cp: &ControlPlaneOptions,
    path: &str,
    token: &str,
    tls_options: &TlsOptions,
) -> Result<Value> {
    let base: http::Uri = cp
        .api_url
        .parse()
        .map_err(|e| Error::InvalidConfig(format!("invalid API URL '{}': {e}", cp.api_url)))?;
    let https = match base.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => {
            return Err(Error::InvalidConfig(format!(
                "API URL '{}' must be http(s)",
                cp.api_url
            )));
        }
    };
    let host = base
        .host()
        .ok_or_else(|| Error::InvalidConfig("API URL has no host".into()))?
        .to_owned();
    let port = base.port_u16().unwrap_or(if https { 443 } else { 80 });
    let prefix = base.path().trim_end_matches('/');
    let uri = format!("{prefix}{path}");
    let authority = base
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_else(|| host.clone());

    let mut request = http::Request::get(uri)
        .header(http::header::HOST, authority)
        .header(http::header::AUTHORIZATION, format!("Bearer {token}"))
        .header(http::header::ACCEPT, "application/json")
        .header(
            http::header::USER_AGENT,
            format!("rstream-rust/{}", env!("CARGO_PKG_VERSION")),
        );
    for (name, value) in &cp.headers {
        request = request.header(name.as_str(), value.as_str());
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .map_err(|e| Error::InvalidConfig(format!("cannot build the API request: {e}")))?;

    let addr = format!("{host}:{port}");
    let fut = async {
        let bare_host = host.trim_start_matches('[').trim_end_matches(']');
        let tcp = match &cp.proxy {
            Some(proxy) => {
                let target = match bare_host.parse::<IpAddr>() {
                    Ok(ip) => TargetAddr::Socket((ip, port).into()),
                    Err(_) => TargetAddr::Host {
                        host: bare_host.to_owned(),
                        port,
                    },
                };
                proxy
                    .connect(&target, API_TIMEOUT)
                    .await
                    .map_err(Error::proxy)?
            }
            None => TcpStream::connect((bare_host, port))
                .await
                .map_err(|e| Error::connect(&addr, e))?,
        };
        let response = if https {
            let mut opts = tls_options.clone();
            opts.client_identity = None;
            let config = tls::client_config_with_alpn(&opts, &[b"http/1.1"])?;
            let name = tls::server_name(&host)?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await
                .map_err(|e| Error::connect(&addr, e))?;
            send(stream, request).await?
        } else {
            send(tcp, request).await?
        };
        Ok::<_, Error>(response)
    };
    let (status, body) = tokio::time::timeout(API_TIMEOUT, fut)
        .await
        .map_err(|_| Error::Timeout("control-plane request".into()))??;
    if !(200..300).contains(&status) {
        let mut text = String::from_utf8_lossy(&body).into_owned();
        text.truncate(1024);
        return Err(Error::ApiHttp { status, body: text });
    }
    let value: Value = serde_json::from_slice(&body)
        .map_err(|e| invalid_response_from("not JSON".to_owned(), e))?;
    if !value.is_object() {
        return Err(invalid_response("expected a JSON object"));
    }
    Ok(value)
}

async fn send<IO>(io: IO, request: http::Request<Empty<Bytes>>) -> Result<(u16, Bytes)>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| Error::Io(std::sync::Arc::new(std::io::Error::other(e))))?;
    let conn_task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let result = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| Error::Io(std::sync::Arc::new(std::io::Error::other(e))))?;
        let status = response.status().as_u16();
        let body = Limited::new(response.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| invalid_response_from("cannot read the body".to_owned(), e))?
            .to_bytes();
        Ok((status, body))
    }
    .await;
    conn_task.abort();
    result
}

/// A control-plane answer that is unusable for `reason`, with no underlying error.
fn invalid_response(reason: impl Into<String>) -> Error {
    Error::ApiInvalidResponse {
        reason: reason.into(),
        cause: None,
    }
}

/// A control-plane answer that is unusable because of `cause` (kept as the `source()`).
fn invalid_response_from(
    reason: String,
    cause: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> Error {
    Error::ApiInvalidResponse {
        reason,
        cause: Some(std::sync::Arc::from(cause.into())),
    }
}

/// The project's engine address does not parse.
fn unusable_engine(cause: Error) -> Error {
    Error::EngineResolution {
        reason: "the project's engine address cannot be used".to_owned(),
        cause: Some(std::sync::Arc::new(cause)),
    }
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key)
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

fn port_field(v: &Value, key: &str) -> Result<Option<u16>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(p) => match p.as_i64() {
            Some(n) if n <= 0 => Ok(None),
            Some(n) => u16::try_from(n)
                .map(Some)
                .map_err(|_| invalid_response(format!("'{key}' is out of range"))),
            None => Err(invalid_response(format!("'{key}' is not an integer"))),
        },
    }
}

/// Derives the engine address from a control-plane project object.
///
/// Without a region: `{endpoint}.{domain}:{enginePort}` (443 when the port is missing), falling back to the
/// deprecated `url`. With a region: exactly one `regionalEndpoints` entry must match (case-insensitively);
/// projects with `routing == "regional"` do not allow region selection.
pub fn engine_from_project(project: &Value, region: Option<&str>) -> Result<EngineAddress> {
    let region = normalize_region(region)?;
    let endpoint = str_field(project, "endpoint");
    if let Some(region) = region {
        if str_field(project, "routing").or_else(|| str_field(project, "placement"))
            == Some("regional")
        {
            return Err(Error::InvalidRegion(
                "region selection is only available for global projects".into(),
            ));
        }
        let endpoint = endpoint.ok_or_else(|| invalid_response("missing 'endpoint'"))?;
        let entries = match project.get("regionalEndpoints") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a.clone(),
            Some(_) => {
                return Err(invalid_response("'regionalEndpoints' is not an array"));
            }
        };
        let mut available = Vec::new();
        let mut matches = Vec::new();
        for entry in &entries {
            let (Some(_), Some(r), Some(domain), Some(port)) = (
                str_field(entry, "provider"),
                str_field(entry, "region"),
                str_field(entry, "domain"),
                port_field(entry, "enginePort")?,
            ) else {
                return Err(invalid_response("invalid 'regionalEndpoints' entry"));
            };
            let r = r.to_ascii_lowercase();
            if r == region {
                matches.push((domain.to_owned(), port));
            }
            if !available.contains(&r) {
                available.push(r);
            }
        }
        available.sort();
        return match matches.as_slice() {
            [] => Err(Error::RegionUnavailable { region, available }),
            [(domain, port)] => EngineAddress::parse(&format!("{endpoint}.{domain}:{port}"))
                .map_err(unusable_engine),
            _ => Err(Error::RegionAmbiguous(region)),
        };
    }
    if let (Some(endpoint), Some(domain)) = (endpoint, str_field(project, "domain")) {
        let port = port_field(project, "enginePort")?.unwrap_or(DEFAULT_ENGINE_PORT);
        return EngineAddress::parse(&format!("{endpoint}.{domain}:{port}"))
            .map_err(unusable_engine);
    }
    if let Some(url) = str_field(project, "url") {
        return EngineAddress::parse(url).map_err(unusable_engine);
    }
    Err(Error::EngineResolution {
        reason: "the project has no endpoint/domain and no url".into(),
        cause: None,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn engine_address_parsing() {
        let a = EngineAddress::parse("E7E8a732.aws-eu-west-3-1.c.rstream.io:8443").unwrap();
        assert_eq!(a.to_string(), "e7e8a732.aws-eu-west-3-1.c.rstream.io:8443");
        assert_eq!(EngineAddress::parse("localhost").unwrap().port(), 443);
        assert_eq!(
            EngineAddress::parse("[::1]:9443").unwrap().to_string(),
            "[::1]:9443"
        );
        assert_eq!(
            EngineAddress::parse("127.0.0.1:9").unwrap().host(),
            "127.0.0.1"
        );
        for bad in [
            "",
            "https://x",
            "a/b",
            "a b",
            "u@h",
            "h:0",
            "h:70000",
            "::1",
            "-a.com",
            "a..b",
            "é.com",
            "[::1",
            "h:x",
        ] {
            assert!(
                matches!(EngineAddress::parse(bad), Err(Error::InvalidEngine(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn regions_and_segments() {
        assert_eq!(normalize_region(Some(" AUTO ")).unwrap(), None);
        assert_eq!(
            normalize_region(Some("EU-West")).unwrap().as_deref(),
            Some("eu-west")
        );
        assert!(normalize_region(Some("-eu")).is_err());
        assert!(normalize_region(Some("eu west")).is_err());
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn project_derivation() {
        let p = json!({"endpoint": "abc", "domain": "c.example.io", "enginePort": 8443, "routing": "global",
            "regionalEndpoints": [
                {"provider": "aws", "region": "EU-1", "domain": "eu.example.io", "enginePort": 9443},
                {"provider": "aws", "region": "us-1", "domain": "us.example.io", "enginePort": 443},
                {"provider": "gcp", "region": "us-1", "domain": "us2.example.io", "enginePort": 443}]});
        assert_eq!(
            engine_from_project(&p, None).unwrap().to_string(),
            "abc.c.example.io:8443"
        );
        assert_eq!(
            engine_from_project(&p, Some("eu-1")).unwrap().to_string(),
            "abc.eu.example.io:9443"
        );
        assert!(matches!(
            engine_from_project(&p, Some("us-1")),
            Err(Error::RegionAmbiguous(_))
        ));
        match engine_from_project(&p, Some("ap-1")) {
            Err(Error::RegionUnavailable { available, .. }) => {
                assert_eq!(available, ["eu-1", "us-1"])
            }
            other => panic!("{other:?}"),
        }
        let regional = json!({"endpoint": "abc", "domain": "d.io", "routing": "regional"});
        assert!(matches!(
            engine_from_project(&regional, Some("eu")),
            Err(Error::InvalidRegion(_))
        ));
        assert_eq!(engine_from_project(&regional, None).unwrap().port(), 443);
        let legacy = json!({"url": "old.example.io"});
        assert_eq!(
            engine_from_project(&legacy, None).unwrap().to_string(),
            "old.example.io:443"
        );
        assert!(matches!(
            engine_from_project(&json!({}), None),
            Err(Error::EngineResolution { .. })
        ));
        let bad_entry = json!({"endpoint": "abc", "regionalEndpoints": [{"region": "eu"}]});
        assert!(matches!(
            engine_from_project(&bad_entry, Some("eu")),
            Err(Error::ApiInvalidResponse { .. })
        ));
    }

    #[test]
    fn reserved_headers_rejected() {
        let cp = ControlPlaneOptions::new("https://api.example/");
        assert_eq!(cp.api_url(), "https://api.example");
        assert!(cp.clone().header("Authorization", "x").is_err());
        assert!(cp.clone().header("X-Forwarded-For", "x").is_err());
        assert!(cp.clone().header("X-Team", "a\r\nb").is_err());
        assert!(
            cp.clone()
                .header("X-Team", "a")
                .unwrap()
                .header("x-team", "b")
                .is_err()
        );
    }
}
