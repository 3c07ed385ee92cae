//! The client: configuration, engine resolution, the control channel (handshake, heartbeats,
//! liveness, tunnels, inbound streams) and private dials.
//!
//! A [`Client`] is cheap to clone and holds only configuration. [`Client::connect`] opens a
//! [`ControlChannel`] (one TLS connection) on which tunnels are created; each inbound stream and each
//! private dial ([`Client::dial`]) is a separate TLS connection. The control channel never reconnects
//! by itself: see [`crate::supervisor`] for that.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use tokio::net::TcpStream;
use tokio::time::timeout;
use tracing::debug;

use crate::error::{Error, Result};
use crate::frame::{FrameReader, write_frame};
use crate::proto::{self, Message, message::Payload};
use crate::resolve::{self, EngineAddress};
use crate::stream::{ClientTls, PrefixedIo, RstreamStream};
use crate::tls;

mod builder;
mod control;
mod shared;
mod tasks;

pub use builder::{ClientBuilder, ENV_VARS};
pub use control::{ControlChannel, Tunnel};

/// The IP family engine connections may use ([`ClientBuilder::ip_family`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum IpFamily {
    /// IPv4 addresses only.
    V4,
    /// IPv6 addresses only.
    V6,
}

impl IpFamily {
    fn admits(self, ip: std::net::IpAddr) -> bool {
        match self {
            IpFamily::V4 => ip.is_ipv4(),
            IpFamily::V6 => ip.is_ipv6(),
        }
    }
}

/// Opens TCP to `target` (`host:port`, IPv6 in brackets), trying the resolved addresses in order, keeping only those of
/// `family` and of `local`'s family, and binding to `local` when given.
async fn dial_tcp(
    target: &str,
    family: Option<IpFamily>,
    local: Option<std::net::IpAddr>,
) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in tokio::net::lookup_host(target).await? {
        let fits = |ip: std::net::IpAddr| ip.is_ipv4() == addr.is_ipv4();
        if family.is_some_and(|f| !f.admits(addr.ip())) || local.is_some_and(|l| !fits(l)) {
            continue;
        }
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        if let Some(local) = local {
            socket.bind(std::net::SocketAddr::new(local, 0))?;
        }
        match socket.connect(addr).await {
            Ok(stream) => return Ok(stream),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        let wanted = match (family, local) {
            (Some(f), _) => format!("{f:?}"),
            (None, Some(l)) if l.is_ipv4() => "V4 (the local address's)".to_owned(),
            _ => "V6 (the local address's)".to_owned(),
        };
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{target} has no {wanted} address"),
        )
    }))
}

/// Default TCP+TLS connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// Default timeout of each handshake response, create and close.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Default heartbeat interval.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(5);
/// Largest liveness timeout an engine may negotiate.
pub const MAX_HEARTBEAT_TIMEOUT_MS: u32 = 900_000;
/// Default number of concurrent inbound-stream dials per control channel.
pub const DEFAULT_MAX_CONCURRENT_DIALS: usize = 64;
/// Default number of queued `ProxyConnReq` waiting for a dial slot.
pub const DEFAULT_MAX_QUEUED_STREAMS: usize = 256;
const DEFAULT_ACCEPT_QUEUE: usize = 16;
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);
const AGENT: &str = "rstream-rust";

/// Returns [`Error::TokenExpired`] if `token` is a JWT whose payload has a numeric `exp` in the past.
/// The signature is not verified; tokens that are not JWTs are accepted unchanged.
pub fn check_token_expiry(token: &str) -> Result<()> {
    let mut parts = token.split('.');
    let (Some(_), Some(payload)) = (parts.next(), parts.next()) else {
        return Ok(());
    };
    let Ok(bytes) =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(payload.trim_end_matches('='))
    else {
        return Ok(());
    };
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
        return Ok(());
    };
    let Some(exp) = value.get("exp").and_then(serde_json::Value::as_f64) else {
        return Ok(());
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    if exp <= now {
        Err(Error::TokenExpired)
    } else {
        Ok(())
    }
}

#[derive(Clone, Debug)]
enum Target {
    Direct(EngineAddress),
    Project {
        endpoint: String,
        region: Option<String>,
    },
}

struct ClientInner {
    cfg: ClientBuilder,
    target: Target,
    tls_config: Arc<rustls::ClientConfig>,
}

/// An rstream client. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> rstream_client::Result<()> {
/// use rstream_client::{Client, tunnel::TunnelOptions};
/// let client = Client::builder().engine("engine.example.io:443").token("...").build()?;
/// let control = client.connect().await?;
/// let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await?;
/// println!("{}", tunnel.forwarding_address()?);
/// while let Ok(stream) = tunnel.accept().await {
///     // each stream is an AsyncRead + AsyncWrite byte pipe
///     drop(stream);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("target", &self.inner.target)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A builder with the SDK defaults.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// A client configured from the SDK environment variables (`RSTREAM_ENGINE`,
    /// `RSTREAM_AUTHENTICATION_TOKEN`, ...: see [`ClientBuilder::from_env`]).
    pub fn from_env() -> Result<Client> {
        ClientBuilder::from_env()?.build()
    }

    /// The engine address: the configured one, or the one resolved through the control plane.
    pub async fn resolve_engine(&self) -> Result<EngineAddress> {
        match &self.inner.target {
            Target::Direct(addr) => Ok(addr.clone()),
            Target::Project { endpoint, region } => {
                resolve::resolve_engine(
                    &self.inner.cfg.control_plane,
                    endpoint,
                    region.as_deref(),
                    self.inner.cfg.token.as_deref(),
                    &self.inner.cfg.tls,
                )
                .await
            }
        }
    }

    fn client_details(&self, token: Option<String>) -> proto::ClientDetails {
        proto::ClientDetails {
            agent: Some(self.inner.cfg.agent.0.clone()),
            channel: Some("sdk".to_owned()),
            version: Some(self.inner.cfg.agent.1.clone()),
            os: Some(std::env::consts::OS.to_owned()),
            arch: Some(std::env::consts::ARCH.to_owned()),
            token,
            protocol_version: Some(proto::PROTOCOL_VERSION.to_owned()),
        }
    }

    async fn connect_tls(
        &self,
        addr: &EngineAddress,
        allow_name_override: bool,
    ) -> Result<ClientTls> {
        let name = match (&self.inner.cfg.tls.server_name, allow_name_override) {
            (Some(name), true) => tls::server_name(name)?,
            _ => tls::server_name(addr.host())?,
        };
        let label = addr.to_string();
        let fut = async {
            let cfg = &self.inner.cfg;
            let shaped = cfg.ip_family.is_some() || cfg.local_address.is_some();
            let tcp = match &cfg.proxy {
                Some(proxy) if shaped => {
                    // The family and the source address shape the connection to the proxy.
                    let proxy_addr = proxy.address().to_string();
                    let mut tcp = dial_tcp(&proxy_addr, cfg.ip_family, cfg.local_address)
                        .await
                        .map_err(|e| Error::connect(proxy.to_string(), e))?;
                    proxy
                        .handshake(&mut tcp, &addr.target_addr())
                        .await
                        .map_err(Error::proxy)?;
                    tcp
                }
                Some(proxy) => proxy
                    .connect(&addr.target_addr(), cfg.connect_timeout)
                    .await
                    .map_err(Error::proxy)?,
                None if shaped => dial_tcp(&label, cfg.ip_family, cfg.local_address)
                    .await
                    .map_err(|e| Error::connect(&label, e))?,
                None => TcpStream::connect(addr.connect_target())
                    .await
                    .map_err(|e| Error::connect(&label, e))?,
            };
            let _ = tcp.set_nodelay(true);
            tokio_rustls::TlsConnector::from(self.inner.tls_config.clone())
                .connect(name, tcp)
                .await
                .map_err(|e| Error::connect(&label, e))
        };
        let stream = timeout(self.inner.cfg.connect_timeout, fut)
            .await
            .map_err(|_| Error::Timeout(format!("connecting to {label}")))??;
        match stream.get_ref().1.alpn_protocol() {
            Some(p) if p != tls::ALPN => Err(Error::Protocol(format!(
                "engine {label} negotiated ALPN '{}' instead of rstrm/1",
                String::from_utf8_lossy(p)
            ))),
            _ => Ok(stream),
        }
    }

    async fn read_response(
        &self,
        reader: &mut FrameReader<ClientTls>,
        what: &str,
    ) -> Result<Message> {
        timeout(self.inner.cfg.operation_timeout, reader.read_frame())
            .await
            .map_err(|_| Error::Timeout(format!("waiting for {what}")))?
    }

    /// Opens a control channel: TLS, `OpenControlChannelReq`, liveness negotiation, then the read loop,
    /// heartbeats and the inbound-stream dispatcher run in background tasks.
    pub async fn connect(&self) -> Result<ControlChannel> {
        let engine = self.resolve_engine().await?;
        let tls = self.connect_tls(&engine, true).await?;
        let mut reader = FrameReader::new(tls);
        let interval_ms = self
            .inner
            .cfg
            .heartbeat_interval
            .map(|i| i.as_millis() as u32);
        let request = Payload::OpenControlChannelReq(proto::OpenControlChannelReq {
            client_details: Some(self.client_details(self.inner.cfg.token.clone())),
            liveness: interval_ms.map(|ms| proto::ControlChannelLiveness {
                heartbeat_interval_ms: ms,
                heartbeat_timeout_ms: 0,
            }),
        });
        write_frame(reader.get_mut(), &request.into()).await?;
        let response = self
            .read_response(&mut reader, "the control channel response")
            .await?;
        let ok = match response.payload {
            Some(Payload::OpenControlChannelRsp(rsp)) => match rsp.payload {
                Some(proto::open_control_channel_rsp::Payload::Ok(ok)) => ok,
                Some(proto::open_control_channel_rsp::Payload::Error(e)) => {
                    return Err(Error::from_proto(&e));
                }
                None => {
                    return Err(Error::Protocol(
                        "engine returned an empty OpenControlChannelRsp".into(),
                    ));
                }
            },
            other => {
                return Err(Error::Protocol(format!(
                    "engine did not return OpenControlChannelRsp (got {})",
                    other.as_ref().map_or("empty", Payload::name)
                )));
            }
        };
        let liveness = match (ok.liveness, interval_ms) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::Protocol(
                    "engine returned an invalid liveness policy".into(),
                ));
            }
            (Some(l), Some(ms)) => {
                if l.heartbeat_interval_ms != ms
                    || l.heartbeat_timeout_ms < l.heartbeat_interval_ms
                    || l.heartbeat_timeout_ms > MAX_HEARTBEAT_TIMEOUT_MS
                {
                    return Err(Error::Protocol(
                        "engine returned an invalid liveness policy".into(),
                    ));
                }
                Some(Duration::from_millis(u64::from(l.heartbeat_timeout_ms)))
            }
        };
        debug!(engine = %engine, client_id = %ok.client_id, ?liveness, "control channel open");
        Ok(ControlChannel::start(
            self.clone(),
            engine,
            reader,
            ok.client_id,
            ok.server_details,
            liveness,
        ))
    }

    /// Opens a private stream to a tunnel by ID or name (`StreamReq`), with the configured zero-RTT mode.
    pub async fn dial(&self, tunnel_id_or_name: &str) -> Result<RstreamStream> {
        self.dial_with(tunnel_id_or_name, self.inner.cfg.zero_rtt)
            .await
    }

    /// Like [`Client::dial`] with an explicit zero-RTT mode. Without zero-RTT the engine's `StreamRsp`
    /// is awaited, so a missing tunnel is reported as engine error 3000.
    pub async fn dial_with(
        &self,
        tunnel_id_or_name: &str,
        zero_rtt: bool,
    ) -> Result<RstreamStream> {
        let target = tunnel_id_or_name.trim();
        if target.is_empty() {
            return Err(Error::InvalidTunnel(
                "a tunnel ID or name is required".into(),
            ));
        }
        let engine = self.resolve_engine().await?;
        let tls = self.connect_tls(&engine, true).await?;
        let mut reader = FrameReader::new(tls);
        let request = Payload::StreamReq(proto::StreamReq {
            client_details: Some(self.client_details(self.inner.cfg.token.clone())),
            tunnel_id_name: target.to_owned(),
            zero_rtt: Some(zero_rtt),
            datagram_channel: None,
        });
        write_frame(reader.get_mut(), &request.into()).await?;
        let mut stream_id = None;
        if !zero_rtt {
            let response = self
                .read_response(&mut reader, "the private stream response")
                .await?;
            match response.payload {
                Some(Payload::StreamRsp(rsp)) => match rsp.payload {
                    Some(proto::stream_rsp::Payload::StreamId(id)) => stream_id = Some(id),
                    Some(proto::stream_rsp::Payload::Error(e)) => {
                        return Err(Error::from_proto(&e));
                    }
                    None => {
                        return Err(Error::Protocol("engine returned an empty StreamRsp".into()));
                    }
                },
                other => {
                    return Err(Error::Protocol(format!(
                        "engine did not return StreamRsp (got {})",
                        other.as_ref().map_or("empty", Payload::name)
                    )));
                }
            }
        }
        let (io, leftover) = reader.into_parts();
        Ok(RstreamStream::new(
            PrefixedIo::new(leftover, io),
            stream_id,
            None,
            None,
        ))
    }

    /// Generates a stable hostname for published tunnels from the engine host (see
    /// [`crate::tunnel::generate_stable_hostname`]); `None` for IP literals and single-label hosts.
    pub async fn generate_stable_hostname(&self) -> Result<Option<String>> {
        Ok(crate::tunnel::generate_stable_hostname(
            self.resolve_engine().await?.host(),
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::shared::uuid_v4;
    use super::*;
    use crate::tls::TlsOptions;

    fn jwt(payload: &str) -> String {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        format!("{}.{}.sig", b(r#"{"alg":"none"}"#), b(payload))
    }

    #[test]
    fn token_expiry() {
        assert!(matches!(
            check_token_expiry(&jwt(r#"{"exp": 1000}"#)),
            Err(Error::TokenExpired)
        ));
        assert!(check_token_expiry(&jwt(r#"{"exp": 99999999999}"#)).is_ok());
        assert!(check_token_expiry(&jwt(r#"{"sub": "x"}"#)).is_ok());
        assert!(check_token_expiry("opaque-token").is_ok());
        assert!(check_token_expiry("a.!!!.c").is_ok());
        let err = Client::builder()
            .engine("127.0.0.1:1")
            .token(jwt(r#"{"exp": 1}"#))
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::TokenExpired));
    }

    #[test]
    fn builder_rules() {
        let insecure = TlsOptions::new().insecure_skip_verify(true);
        let b = || Client::builder().tls(insecure.clone());
        assert!(matches!(b().build(), Err(Error::EngineRequired)));
        assert!(matches!(
            b().engine("h:1").region("eu").build(),
            Err(Error::InvalidConfig(_))
        ));
        assert!(matches!(
            b().region("eu").build(),
            Err(Error::InvalidConfig(_))
        ));
        assert!(matches!(
            b().engine("https://h").build(),
            Err(Error::InvalidEngine(_))
        ));
        assert!(matches!(
            b().engine("h:1")
                .heartbeat_interval(Some(Duration::from_millis(500)))
                .build(),
            Err(Error::InvalidConfig(_))
        ));
        assert!(b().engine("h:1").heartbeat_interval(None).build().is_ok());
        assert!(b().project_endpoint("abc").region("eu").build().is_ok());
        let u = uuid_v4();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
    }
}
