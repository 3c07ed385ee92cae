//! Reaching an upstream through an HTTP proxy with `CONNECT` (RFC 9110 §9.3.6), as clients
//! honouring `HTTPS_PROXY` do.
//!
//! [`HttpProxy`] is a parsed proxy URL, `http://[user:password@]host[:port]`. Its
//! [`connect`](HttpProxy::connect) opens a TCP connection to the proxy, asks it for a tunnel to
//! the target (with `Proxy-Authorization: Basic` when the URL has credentials) and returns the
//! connection once the proxy answers 2xx: from then on it is a plain byte stream to the target,
//! so the relay copies it like any other upstream (the splice path included). Any other answer is
//! an [`HttpConnectError`] carrying the proxy's status line; 407 (and 401, which some proxies
//! send instead) is
//! [`CredentialsRequired`](HttpConnectError::CredentialsRequired).
//!
//! The proxy's answer is read with `MSG_PEEK` up to the end of its header, so bytes the target
//! sends right after the tunnel opens (a server that speaks first) stay in the socket for the
//! caller. The header is capped at [`MAX_RESPONSE_HEAD`] bytes.
//!
//! [`proxy_from_env`] picks the proxy the usual environment variables choose for a target
//! (`HTTPS_PROXY`, `NO_PROXY`, with the rules of Go's `http.ProxyFromEnvironment`).
//!
//! A relay uses it through [`Upstream::HttpConnect`](crate::upstream::Upstream::HttpConnect); any
//! other client (a tunnel agent dialling its engine) calls [`HttpProxy::connect`] directly.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use proxy_core::http_connect::HttpProxy;
//!
//! let proxy: HttpProxy = "http://user:secret@proxy.internal:3128".parse()?;
//! let target = "api.example.com:6443".parse()?;
//! let stream = proxy.connect(&target, Duration::from_secs(10)).await?;
//! # drop(stream); Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

pub use crate::error::HttpConnectError;
use crate::source::Cidr;
use crate::target::TargetAddr;

/// Largest response header accepted from a proxy.
pub const MAX_RESPONSE_HEAD: usize = 16 * 1024;

/// An HTTP proxy that tunnels with `CONNECT`.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpProxy {
    address: TargetAddr,
    /// The `Basic` credentials, already base64-encoded; never printed.
    authorization: Option<String>,
    /// Extra request headers sent with each `CONNECT`; values never printed.
    headers: Vec<(String, String)>,
}

impl fmt::Debug for HttpProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpProxy")
            .field("address", &self.address)
            .field("credentials", &self.authorization.is_some())
            .field(
                "headers",
                &self.headers.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl fmt::Display for HttpProxy {
    /// `http://host:port`, without the credentials.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.address)
    }
}

impl FromStr for HttpProxy {
    type Err = HttpConnectError;

    /// Parses `http://[user:password@]host[:port][/]`. Without a scheme, `http://` is assumed
    /// (as Go's `http.ProxyFromEnvironment` does); without a port, 80. User and password may be
    /// percent-encoded.
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let invalid = |reason| HttpConnectError::InvalidProxyUrl {
            input: redact(input),
            reason,
        };
        let rest = match input.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => rest,
            Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => {
                return Err(invalid(
                    "https:// proxies (TLS to the proxy) are not supported; use http://",
                ));
            }
            Some(_) => return Err(invalid("the scheme must be http://")),
            None => input,
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains(['/', '?', '#']) {
            return Err(invalid("a proxy URL has no path, query or fragment"));
        }
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((userinfo, hostport)) => (Some(userinfo), hostport),
            None => (None, rest),
        };
        let authorization = match userinfo {
            None => None,
            Some(userinfo) => {
                let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
                let user = percent_decode(user).ok_or_else(|| invalid("bad %-escape in user"))?;
                let password =
                    percent_decode(password).ok_or_else(|| invalid("bad %-escape in password"))?;
                if user.is_empty() {
                    return Err(invalid("empty user name before '@'"));
                }
                Some(base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
            }
        };
        // Without a port, http's 80.
        let has_port = match hostport.rsplit_once(':') {
            Some((host, port)) => {
                !port.is_empty()
                    && port.bytes().all(|b| b.is_ascii_digit())
                    && (!host.starts_with('[') || host.ends_with(']'))
            }
            None => false,
        };
        let with_port = if has_port {
            hostport.to_owned()
        } else {
            format!("{hostport}:80")
        };
        let address = with_port.parse::<TargetAddr>().map_err(|_| {
            invalid("the host is not an IP address or DNS name, or the port is bad")
        })?;
        Ok(Self {
            address,
            authorization,
            headers: Vec::new(),
        })
    }
}

impl HttpProxy {
    /// A proxy at `address`, without credentials.
    pub fn new(address: TargetAddr) -> Self {
        Self {
            address,
            authorization: None,
            headers: Vec::new(),
        }
    }

    /// Also sends `name: value` with each `CONNECT` (a proxy that wants a tenant or routing
    /// header). The name must be an HTTP token and not one the request sets itself (`Host`,
    /// `Proxy-Authorization`); the value must not hold CR, LF or NUL.
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, HttpConnectError> {
        let invalid = |reason| HttpConnectError::InvalidHeader {
            name: name.to_owned(),
            reason,
        };
        let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
        if name.is_empty() || !name.bytes().all(token) {
            return Err(invalid("the name is not an HTTP token"));
        }
        if name.eq_ignore_ascii_case("host") || name.eq_ignore_ascii_case("proxy-authorization") {
            return Err(invalid(
                "set by the CONNECT request itself (credentials go in the proxy URL)",
            ));
        }
        if value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
            return Err(invalid("the value holds CR, LF or NUL"));
        }
        self.headers
            .push((name.to_owned(), value.trim().to_owned()));
        Ok(self)
    }

    /// Sends `Proxy-Authorization: Basic` with these credentials.
    #[must_use]
    pub fn with_basic_auth(mut self, user: &str, password: &str) -> Self {
        self.authorization =
            Some(base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")));
        self
    }

    /// The proxy's address.
    pub fn address(&self) -> &TargetAddr {
        &self.address
    }

    /// Whether credentials are sent.
    pub fn has_credentials(&self) -> bool {
        self.authorization.is_some()
    }

    /// Connects to the proxy and opens a tunnel to `target`; `timeout` bounds the whole (dial,
    /// request and answer). The returned stream carries the target's bytes.
    pub async fn connect(
        &self,
        target: &TargetAddr,
        timeout: Duration,
    ) -> Result<TcpStream, HttpConnectError> {
        let attempt =
            async {
                let mut stream = self.address.connect(timeout).await.map_err(|cause| {
                    HttpConnectError::Connect {
                        proxy: self.to_string(),
                        cause,
                    }
                })?;
                self.handshake(&mut stream, target).await?;
                Ok(stream)
            };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(HttpConnectError::Timeout {
                    proxy: self.to_string(),
                    target: target.to_string(),
                    after: timeout,
                })
            })
    }

    /// Sends `CONNECT target` on `stream`, already connected to the proxy, and reads the answer.
    /// On success, nothing after the answer's header has been read from `stream`.
    pub async fn handshake(
        &self,
        stream: &mut TcpStream,
        target: &TargetAddr,
    ) -> Result<(), HttpConnectError> {
        let io_error = |cause| HttpConnectError::Io {
            proxy: self.to_string(),
            cause,
        };
        let mut request = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
        if let Some(credentials) = &self.authorization {
            request.push_str(&format!("Proxy-Authorization: Basic {credentials}\r\n"));
        }
        for (name, value) in &self.headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(io_error)?;
        let head = read_head(stream).await.map_err(|problem| match problem {
            HeadProblem::Io(cause) => io_error(cause),
            HeadProblem::Closed => HttpConnectError::BadResponse {
                proxy: self.to_string(),
                reason: "the proxy closed the connection before answering".to_owned(),
            },
            HeadProblem::TooLarge => HttpConnectError::BadResponse {
                proxy: self.to_string(),
                reason: format!("answer header longer than {MAX_RESPONSE_HEAD} bytes"),
            },
        })?;
        let status_line = head
            .lines()
            .next()
            .unwrap_or_default()
            .trim_end()
            .to_owned();
        let code = parse_status(&status_line).ok_or_else(|| HttpConnectError::BadResponse {
            proxy: self.to_string(),
            reason: format!("not an HTTP status line: {status_line:?}"),
        })?;
        match code {
            200..=299 => Ok(()),
            // 401 too: tinyproxy 1.11 answers a CONNECT without credentials with it.
            401 | 407 => Err(HttpConnectError::CredentialsRequired {
                proxy: self.to_string(),
                status_line,
                credentials_sent: self.authorization.is_some(),
            }),
            _ => Err(HttpConnectError::Refused {
                proxy: self.to_string(),
                target: target.to_string(),
                status_line,
            }),
        }
    }
}

/// The proxy `HTTPS_PROXY` (or `https_proxy`) names for `target`, unless `NO_PROXY` (or
/// `no_proxy`) exempts it; see [`proxy_for`] for the rules.
pub fn proxy_from_env(target: &TargetAddr) -> Result<Option<HttpProxy>, HttpConnectError> {
    let first = |names: [&str; 2]| {
        names
            .iter()
            .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    };
    proxy_for(
        target,
        first(["HTTPS_PROXY", "https_proxy"]).as_deref(),
        first(["NO_PROXY", "no_proxy"]).as_deref(),
    )
}

/// The proxy to reach `target` through, given the values of `HTTPS_PROXY` and `NO_PROXY`, with
/// the rules of Go's `http.ProxyFromEnvironment` (what Kubernetes clients follow):
///
/// * `localhost` and loopback addresses never go through a proxy;
/// * `NO_PROXY` is a comma-separated list: `*` exempts everything; an IP address or a CIDR
///   range (`10.0.0.0/8`) exempts those addresses; a name (`example.com`) exempts itself and its
///   subdomains, and with a leading `.` or `*.` only its subdomains; an entry may end in `:port`
///   to exempt that port only.
pub fn proxy_for(
    target: &TargetAddr,
    https_proxy: Option<&str>,
    no_proxy: Option<&str>,
) -> Result<Option<HttpProxy>, HttpConnectError> {
    let Some(url) = https_proxy.map(str::trim).filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    let (host, port) = match target {
        TargetAddr::Socket(addr) => (addr.ip().to_string(), addr.port()),
        TargetAddr::Host { host, port } => (host.to_ascii_lowercase(), *port),
    };
    let host = host.trim_end_matches('.');
    let ip = host.parse::<IpAddr>().ok();
    if host == "localhost" || ip.is_some_and(|ip| ip.is_loopback()) {
        return Ok(None);
    }
    let exempt = no_proxy
        .unwrap_or_default()
        .split(',')
        .map(|entry| entry.trim().to_ascii_lowercase())
        .filter(|entry| !entry.is_empty())
        .any(|entry| no_proxy_matches(&entry, host, ip, port));
    if exempt {
        return Ok(None);
    }
    url.parse().map(Some)
}

/// Whether one `NO_PROXY` entry (lowercase) exempts `host:port`.
fn no_proxy_matches(entry: &str, host: &str, ip: Option<IpAddr>, port: u16) -> bool {
    if entry == "*" {
        return true;
    }
    if entry.contains('/') {
        return entry
            .parse::<Cidr>()
            .is_ok_and(|net| ip.is_some_and(|ip| net.contains(ip)));
    }
    // An optional `:port`; an IPv6 literal takes one only in brackets (`[::1]:443`).
    let (name, entry_port) = if let Some(rest) = entry.strip_prefix('[') {
        match rest.split_once(']') {
            Some((name, "")) => (name, None),
            Some((name, tail)) => match tail.strip_prefix(':').map(str::parse::<u16>) {
                Some(Ok(p)) => (name, Some(p)),
                _ => return false,
            },
            None => return false,
        }
    } else if entry.matches(':').count() == 1 {
        match entry.split_once(':').map(|(n, p)| (n, p.parse::<u16>())) {
            Some((name, Ok(p))) => (name, Some(p)),
            _ => return false,
        }
    } else {
        (entry, None)
    };
    if entry_port.is_some_and(|p| p != port) {
        return false;
    }
    if let Ok(entry_ip) = name.parse::<IpAddr>() {
        return ip == Some(entry_ip);
    }
    let name = name.strip_prefix('*').unwrap_or(name);
    match name.strip_prefix('.') {
        Some(suffix) => host.ends_with(&format!(".{suffix}")),
        None => host == name || host.ends_with(&format!(".{name}")),
    }
}

/// `HTTP/1.x NNN reason` -> NNN.
fn parse_status(line: &str) -> Option<u16> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/1.") {
        return None;
    }
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    code.parse().ok()
}

enum HeadProblem {
    Io(io::Error),
    Closed,
    TooLarge,
}

/// Reads the answer's header, up to and including the blank line, and not one byte more: each
/// round peeks at what has arrived and consumes only what belongs to the header.
async fn read_head(stream: &mut TcpStream) -> Result<String, HeadProblem> {
    let mut head: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; MAX_RESPONSE_HEAD];
    loop {
        let room = MAX_RESPONSE_HEAD - head.len();
        if room == 0 {
            return Err(HeadProblem::TooLarge);
        }
        let seen = stream
            .peek(&mut buf[..room])
            .await
            .map_err(HeadProblem::Io)?;
        if seen == 0 {
            return Err(HeadProblem::Closed);
        }
        // The terminator may straddle what we already hold and what just arrived.
        let from = head.len().saturating_sub(3);
        let mut joined = head[from..].to_vec();
        joined.extend_from_slice(&buf[..seen]);
        let take = match joined.windows(4).position(|w| w == b"\r\n\r\n") {
            Some(at) => at + 4 - (head.len() - from),
            None => seen,
        };
        let mut part = vec![0u8; take];
        stream
            .read_exact(&mut part)
            .await
            .map_err(HeadProblem::Io)?;
        head.extend_from_slice(&part);
        if head.ends_with(b"\r\n\r\n") {
            return Ok(String::from_utf8_lossy(&head).into_owned());
        }
    }
}

/// Decodes `%XX` escapes; `None` for a broken escape or a result that is not UTF-8.
fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The URL with any password replaced, for error messages.
fn redact(input: &str) -> String {
    let (scheme, rest) = match input.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), input),
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}{user}:***@{host}")
        }
        None => input.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proxy_urls() {
        let proxy: HttpProxy = "http://proxy.internal:3128".parse().unwrap();
        assert_eq!(proxy.to_string(), "http://proxy.internal:3128");
        assert!(!proxy.has_credentials());
        let proxy: HttpProxy = "proxy.internal:3128/".parse().unwrap();
        assert_eq!(proxy.to_string(), "http://proxy.internal:3128");
        let proxy: HttpProxy = "HTTP://10.0.0.1".parse().unwrap();
        assert_eq!(proxy.to_string(), "http://10.0.0.1:80");
        let proxy: HttpProxy = "http://[::1]:8888".parse().unwrap();
        assert_eq!(proxy.to_string(), "http://[::1]:8888");
        let proxy: HttpProxy = "http://[::1]".parse().unwrap();
        assert_eq!(proxy.to_string(), "http://[::1]:80");

        let proxy: HttpProxy = "http://us%40er:p%3Ass@proxy:3128".parse().unwrap();
        assert_eq!(
            proxy.authorization.as_deref(),
            Some(
                base64::engine::general_purpose::STANDARD
                    .encode("us@er:p:ss")
                    .as_str()
            )
        );
        // Credentials never show in Display or Debug.
        assert!(!format!("{proxy} {proxy:?}").contains("p:ss"));
        assert_eq!(
            HttpProxy::new("h:1".parse().unwrap()).with_basic_auth("a", "b"),
            "http://a:b@h:1".parse().unwrap()
        );
    }

    #[test]
    fn refuses_unusable_urls_without_printing_the_password() {
        for bad in [
            "",
            "https://proxy:3128",
            "socks5://proxy:1080",
            "http://proxy:3128/path",
            "http://proxy:99999",
            "http://bad host:1",
            "http://:secret@proxy:1",
            "http://u:%zz@proxy:1",
        ] {
            assert!(
                bad.parse::<HttpProxy>().is_err(),
                "{bad:?} should be refused"
            );
        }
        let err = "https://user:hunter2@proxy:3128"
            .parse::<HttpProxy>()
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("https:// proxies"), "{err}");
    }

    #[test]
    fn the_environment_picks_the_proxy_like_go() {
        let url = Some("http://proxy:3128");
        let target = |t: &str| t.parse::<TargetAddr>().unwrap();
        let via = |t: &str, no_proxy: Option<&str>| {
            proxy_for(&target(t), url, no_proxy)
                .unwrap()
                .map(|p| p.to_string())
        };
        let proxied = Some("http://proxy:3128".to_owned());
        assert_eq!(via("api.example.com:6443", None), proxied);
        assert_eq!(
            proxy_for(&target("api.example.com:6443"), None, None).unwrap(),
            None
        );
        // Loopback and localhost never go through a proxy.
        for local in ["127.0.0.1:6443", "[::1]:6443", "localhost:6443"] {
            assert_eq!(via(local, None), None, "{local}");
        }
        let no_proxy =
            Some(" .svc , example.com,10.0.0.0/8, 192.168.1.5 ,[fd00::1]:443, other.org:80");
        for exempt in [
            "kubernetes.default.svc:443",
            "example.com:6443",
            "api.example.com:6443",
            "10.1.2.3:6443",
            "192.168.1.5:1",
            "[fd00::1]:443",
            "other.org:80",
        ] {
            assert_eq!(via(exempt, no_proxy), None, "{exempt}");
        }
        for proxied_target in [
            "svc:443",            // `.svc` exempts subdomains only
            "notexample.com:443", // a suffix match needs a dot
            "11.0.0.1:6443",
            "192.168.1.6:1",
            "[fd00::1]:6443", // other port
            "other.org:443",  // other port
        ] {
            assert_eq!(via(proxied_target, no_proxy), proxied, "{proxied_target}");
        }
        assert_eq!(via("anything.example:1", Some("*")), None);
        assert_eq!(via("a.b.example:1", Some("*.b.example")), None);
        assert_eq!(via("b.example:1", Some("*.b.example")), proxied);
        assert!(proxy_for(&target("x.example:1"), Some("socks5://p:1"), None).is_err());
    }

    #[test]
    fn status_lines() {
        assert_eq!(
            parse_status("HTTP/1.1 200 Connection established"),
            Some(200)
        );
        assert_eq!(
            parse_status("HTTP/1.0 407 Proxy Authentication Required"),
            Some(407)
        );
        assert_eq!(parse_status("HTTP/1.1 204"), Some(204));
        for bad in [
            "",
            "SSH-2.0-OpenSSH",
            "HTTP/1.1 2000 x",
            "HTTP/2 200",
            "HTTP/1.1 abc",
        ] {
            assert_eq!(parse_status(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn extra_headers_are_checked() {
        let proxy = HttpProxy::new("h:1".parse().unwrap());
        for (name, value) in [
            ("", "v"),
            ("X Team", "v"),
            ("Host", "v"),
            ("proxy-authorization", "v"),
            ("X-Team", "a\r\nInjected: 1"),
        ] {
            assert!(
                matches!(
                    proxy.clone().with_header(name, value),
                    Err(HttpConnectError::InvalidHeader { .. })
                ),
                "{name:?}: {value:?}"
            );
        }
        let proxy = proxy.with_header("X-Team", " blue ").unwrap();
        assert!(!format!("{proxy:?}").contains("blue"));
    }

    #[tokio::test]
    async fn extra_headers_are_sent() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.ends_with(b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                assert!(n > 0, "the client closed before the end of its request");
                request.extend_from_slice(&buf[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8(request).unwrap()
        });
        let proxy = HttpProxy::new(addr.into())
            .with_header("X-Team", "blue")
            .unwrap();
        let target = "example.test:443".parse().unwrap();
        proxy
            .connect(&target, Duration::from_secs(30))
            .await
            .unwrap();
        let request = seen.await.unwrap();
        assert!(request.starts_with("CONNECT example.test:443 HTTP/1.1\r\n"));
        assert!(request.contains("\r\nX-Team: blue\r\n"), "{request}");
    }
}
