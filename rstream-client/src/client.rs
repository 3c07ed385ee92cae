//! The client: configuration, engine resolution, the control channel (handshake, heartbeats,
//! liveness, tunnels, inbound streams) and private dials.
//!
//! A [`Client`] is cheap to clone and holds only configuration. [`Client::connect`] opens a
//! [`ControlChannel`] (one TLS connection) on which tunnels are created; each inbound stream and each
//! private dial ([`Client::dial`]) is a separate TLS connection. The control channel never reconnects
//! by itself: see [`crate::supervisor`] for that.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::Engine as _;
use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::frame::{FrameError, FrameReader, write_frame};
use crate::proto::{self, Message, message::Payload};
use crate::resolve::{self, ControlPlaneOptions, EngineAddress};
use crate::stream::{ClientTls, PrefixedIo, RstreamStream};
use crate::tls::{self, TlsOptions};
use crate::tunnel::{TunnelOptions, forwarding_address};

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

/// Builder of a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    engine: Option<String>,
    project_endpoint: Option<String>,
    region: Option<String>,
    control_plane: ControlPlaneOptions,
    token: Option<String>,
    tls: TlsOptions,
    connect_timeout: Duration,
    operation_timeout: Duration,
    heartbeat_interval: Option<Duration>,
    zero_rtt: bool,
    max_concurrent_dials: usize,
    max_queued_streams: usize,
    accept_queue: usize,
    agent: (String, String),
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
        }
    }
}

impl ClientBuilder {
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

    /// Validates the configuration: engine or project endpoint, token vs mTLS, token expiry,
    /// heartbeat range, TLS material.
    pub fn build(self) -> Result<Client> {
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
            let tcp = TcpStream::connect(addr.connect_target())
                .await
                .map_err(|e| Error::connect(&label, e))?;
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

/// Closes the control channel when the last user handle (channel or tunnel) is dropped.
#[derive(Debug)]
struct Lifetime(CancellationToken);

impl Drop for Lifetime {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

type CreateResult = Result<(
    proto::TunnelProperties,
    mpsc::Receiver<RstreamStream>,
    CancellationToken,
)>;

struct TunnelSlot {
    tx: mpsc::Sender<RstreamStream>,
    closed: CancellationToken,
}

#[derive(Default)]
struct State {
    pending_creates: HashMap<String, oneshot::Sender<CreateResult>>,
    pending_closes: HashMap<String, Vec<oneshot::Sender<Result<()>>>>,
    tunnels: HashMap<String, TunnelSlot>,
    last_sent: u64,
    last_ack: u64,
    closing: bool,
    finished: bool,
    error: Option<Error>,
}

struct Shared {
    client: Client,
    engine: EngineAddress,
    out: mpsc::Sender<Message>,
    state: Mutex<State>,
    /// The control channel is finished (all background tasks stop).
    closed: CancellationToken,
    /// Streams already handed to forwarders must close too (explicit close, protocol error).
    hard_close: CancellationToken,
    done: watch::Sender<bool>,
    client_id: String,
    server_details: Option<proto::ServerDetails>,
    liveness: Option<Duration>,
    tracker: TaskTracker,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the state itself stays consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish(&self, error: Option<Error>) {
        let preserve = matches!(
            &error,
            Some(Error::Io(_) | Error::ControlLiveness(_) | Error::Timeout(_))
                | Some(Error::Frame(
                    FrameError::Closed | FrameError::Truncated { .. }
                ))
        );
        let (creates, closes, tunnels) = {
            let mut st = self.lock();
            if st.finished {
                return;
            }
            st.finished = true;
            st.error = error.clone();
            (
                std::mem::take(&mut st.pending_creates),
                std::mem::take(&mut st.pending_closes),
                std::mem::take(&mut st.tunnels),
            )
        };
        match &error {
            Some(e) => warn!(error = %e, "control channel failed"),
            None => debug!("control channel closed"),
        }
        let reason = error.unwrap_or(Error::ControlClosed);
        for (_, tx) in creates {
            let _ = tx.send(Err(reason.clone()));
        }
        for tx in closes.into_values().flatten() {
            let _ = tx.send(Err(reason.clone()));
        }
        for slot in tunnels.into_values() {
            slot.closed.cancel();
        }
        if !preserve {
            self.hard_close.cancel();
        }
        self.closed.cancel();
        let _ = self.done.send(true);
    }

    fn close_error(&self) -> Error {
        self.lock().error.clone().unwrap_or(Error::ControlClosed)
    }

    async fn send(&self, message: Message) -> Result<()> {
        if self.closed.is_cancelled() {
            return Err(self.close_error());
        }
        self.out.send(message).await.map_err(|_| self.close_error())
    }

    async fn proxy_conn_rsp(&self, stream_id: String, error: Option<proto::Error>) {
        let _ = self
            .send(Payload::ProxyConnRsp(proto::ProxyConnRsp { stream_id, error }).into())
            .await;
    }
}

/// An open control channel. Cloning is cheap; the channel closes when [`ControlChannel::close`] is called
/// or when the last clone and the last [`Tunnel`] are dropped.
#[derive(Clone)]
pub struct ControlChannel {
    shared: Arc<Shared>,
    life: Arc<Lifetime>,
}

impl std::fmt::Debug for ControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlChannel")
            .field("engine", &self.shared.engine)
            .field("client_id", &self.shared.client_id)
            .finish_non_exhaustive()
    }
}

impl ControlChannel {
    fn start(
        client: Client,
        engine: EngineAddress,
        reader: FrameReader<ClientTls>,
        client_id: String,
        server_details: Option<proto::ServerDetails>,
        liveness: Option<Duration>,
    ) -> Self {
        let cfg = &client.inner.cfg;
        let heartbeat = cfg.heartbeat_interval;
        let max_dials = cfg.max_concurrent_dials;
        let max_queued = cfg.max_queued_streams;
        let (out_tx, out_rx) = mpsc::channel(256);
        let (proxy_tx, proxy_rx) = mpsc::channel(max_queued);
        let (done, _) = watch::channel(false);
        let closed = CancellationToken::new();
        let shared = Arc::new(Shared {
            client,
            engine,
            out: out_tx,
            state: Mutex::new(State::default()),
            closed: closed.clone(),
            hard_close: CancellationToken::new(),
            done,
            client_id,
            server_details,
            liveness,
            tracker: TaskTracker::new(),
        });
        // Leftover bytes after the handshake frame are kept: they are the next frames.
        let (tls, leftover) = reader.into_parts();
        let (rd, wr) = tokio::io::split(PrefixedIo::new(leftover, tls));
        let life = Arc::new(Lifetime(closed.clone()));
        shared
            .tracker
            .spawn(writer_task(shared.clone(), wr, out_rx));
        shared
            .tracker
            .spawn(reader_task(shared.clone(), FrameReader::new(rd), proxy_tx));
        if let Some(interval) = heartbeat {
            shared
                .tracker
                .spawn(heartbeat_task(shared.clone(), interval));
        }
        shared.tracker.spawn(dispatcher_task(
            shared.clone(),
            proxy_rx,
            Arc::new(Semaphore::new(max_dials)),
        ));
        shared.tracker.close();
        Self { shared, life }
    }

    /// The engine this channel is connected to.
    pub fn engine(&self) -> &EngineAddress {
        &self.shared.engine
    }

    /// The engine-assigned client ID.
    pub fn client_id(&self) -> &str {
        &self.shared.client_id
    }

    /// The engine details from the handshake.
    pub fn server_details(&self) -> Option<&proto::ServerDetails> {
        self.shared.server_details.as_ref()
    }

    /// The negotiated liveness timeout; `None` in legacy heartbeat mode.
    pub fn liveness_timeout(&self) -> Option<Duration> {
        self.shared.liveness
    }

    /// The highest heartbeat sequence acknowledged by the engine.
    pub fn heartbeats_acknowledged(&self) -> u64 {
        self.shared.lock().last_ack
    }

    /// Whether the channel is finished.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.is_cancelled()
    }

    /// Waits until the channel is finished: `Ok` after a clean close, otherwise the failure.
    pub async fn wait_closed(&self) -> Result<()> {
        let mut rx = self.shared.done.subscribe();
        let _ = rx.wait_for(|done| *done).await;
        match self.shared.lock().error.clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Creates a tunnel. Options are validated before anything is sent.
    pub async fn create_tunnel(&self, options: TunnelOptions) -> Result<Tunnel> {
        let properties = options.to_properties()?;
        let request_id = uuid_v4();
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.shared.lock();
            if st.finished || st.closing {
                return Err(st.error.clone().unwrap_or(Error::ControlClosed));
            }
            st.pending_creates.insert(request_id.clone(), tx);
        }
        let req = Payload::OpenTunnelReq(proto::OpenTunnelReq {
            request_id: request_id.clone(),
            tunnel_properties: Some(properties),
        });
        if let Err(e) = self.shared.send(req.into()).await {
            self.shared.lock().pending_creates.remove(&request_id);
            return Err(e);
        }
        match timeout(self.shared.client.inner.cfg.operation_timeout, rx).await {
            Ok(Ok(Ok((props, rx, closed)))) => {
                let id = props.id.clone().unwrap_or_default();
                Ok(Tunnel {
                    shared: self.shared.clone(),
                    _life: self.life.clone(),
                    id,
                    props,
                    rx,
                    closed,
                })
            }
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(self.shared.close_error()),
            Err(_) => {
                self.shared.lock().pending_creates.remove(&request_id);
                Err(Error::Timeout(
                    "waiting for the tunnel creation response".into(),
                ))
            }
        }
    }

    /// Closes a tunnel by ID. Concurrent closes of the same tunnel share one request; closing an unknown
    /// or already closed tunnel succeeds.
    pub async fn close_tunnel(&self, tunnel_id: &str) -> Result<()> {
        close_tunnel(&self.shared, tunnel_id).await
    }

    /// Closes the channel: `CloseControlChannelReq`, wait for the reply or EOF (operation timeout), then
    /// stop every background task. Streams handed to forwarders are closed too.
    pub async fn close(&self) -> Result<()> {
        let finished = {
            let mut st = self.shared.lock();
            st.closing = true;
            st.finished
        };
        if finished {
            self.shared.tracker.wait().await;
            return Ok(());
        }
        let sent = self
            .shared
            .send(Payload::CloseControlChannelReq(proto::CloseControlChannelReq {}).into())
            .await;
        let mut rx = self.shared.done.subscribe();
        let waited = if sent.is_ok() {
            timeout(
                self.shared.client.inner.cfg.operation_timeout,
                rx.wait_for(|d| *d),
            )
            .await
            .is_ok()
        } else {
            true
        };
        self.shared.finish(None);
        self.shared.hard_close.cancel();
        self.shared.tracker.wait().await;
        if waited {
            Ok(())
        } else {
            Err(Error::Timeout(
                "waiting for the control channel close response".into(),
            ))
        }
    }
}

async fn close_tunnel(shared: &Shared, tunnel_id: &str) -> Result<()> {
    let (tx, rx) = oneshot::channel();
    let first = {
        let mut st = shared.lock();
        if !st.tunnels.contains_key(tunnel_id) {
            return Ok(());
        }
        let waiters = st.pending_closes.entry(tunnel_id.to_owned()).or_default();
        waiters.push(tx);
        waiters.len() == 1
    };
    if first {
        shared
            .send(
                Payload::CloseTunnelReq(proto::CloseTunnelReq {
                    tunnel_id: tunnel_id.to_owned(),
                })
                .into(),
            )
            .await?;
    }
    match timeout(shared.client.inner.cfg.operation_timeout, rx).await {
        Ok(Ok(result)) => result,
        Ok(Err(_)) => Err(shared.close_error()),
        Err(_) => {
            shared.lock().pending_closes.remove(tunnel_id);
            Err(Error::Timeout(
                "waiting for the tunnel close response".into(),
            ))
        }
    }
}

/// A tunnel created on a [`ControlChannel`]: accept its inbound streams with [`Tunnel::accept`].
pub struct Tunnel {
    shared: Arc<Shared>,
    _life: Arc<Lifetime>,
    id: String,
    props: proto::TunnelProperties,
    rx: mpsc::Receiver<RstreamStream>,
    closed: CancellationToken,
}

impl std::fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnel")
            .field("id", &self.id)
            .field("properties", &self.props)
            .finish_non_exhaustive()
    }
}

impl Tunnel {
    /// The engine-assigned tunnel ID.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The properties returned by the engine.
    pub fn properties(&self) -> &proto::TunnelProperties {
        &self.props
    }

    /// The display address (`https://host`, `host:port (tcp)`, `rstrm://name (unpublished)`, ...).
    pub fn forwarding_address(&self) -> Result<String> {
        forwarding_address(&self.props)
    }

    /// Whether the tunnel is closed (closed by us or the engine, or its control channel ended).
    pub fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Waits for the next inbound stream. Fails with [`Error::TunnelClosed`] once the tunnel is closed, or
    /// with the control channel's failure.
    pub async fn accept(&mut self) -> Result<RstreamStream> {
        tokio::select! {
            biased;
            _ = self.closed.cancelled() => Err(self.close_reason()),
            stream = self.rx.recv() => stream.ok_or_else(|| self.close_reason()),
        }
    }

    fn close_reason(&self) -> Error {
        match self.shared.lock().error.clone() {
            Some(e) if self.shared.closed.is_cancelled() => e,
            _ => Error::TunnelClosed,
        }
    }

    /// Closes the tunnel on the engine.
    pub async fn close(&self) -> Result<()> {
        close_tunnel(&self.shared, &self.id).await
    }

    /// A token cancelled when streams handed to forwarders must be closed (explicit control close or
    /// protocol error; not on a transport loss, when accepted streams survive).
    pub fn hard_close_token(&self) -> CancellationToken {
        self.shared.hard_close.clone()
    }

    /// The control channel this tunnel belongs to.
    pub fn control(&self) -> ControlChannel {
        ControlChannel {
            shared: self.shared.clone(),
            life: self._life.clone(),
        }
    }
}

fn uuid_v4() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

type ControlIo = PrefixedIo<ClientTls>;

async fn writer_task(
    shared: Arc<Shared>,
    mut wr: WriteHalf<ControlIo>,
    mut rx: mpsc::Receiver<Message>,
) {
    let op_timeout = shared.client.inner.cfg.operation_timeout;
    loop {
        let message = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => break,
            m = rx.recv() => match m { Some(m) => m, None => break },
        };
        match timeout(op_timeout, write_frame(&mut wr, &message)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                shared.finish(Some(e));
                break;
            }
            Err(_) => {
                shared.finish(Some(Error::Timeout("writing a control frame".into())));
                break;
            }
        }
    }
    let _ = timeout(Duration::from_millis(200), wr.shutdown()).await;
}

async fn reader_task(
    shared: Arc<Shared>,
    mut reader: FrameReader<ReadHalf<ControlIo>>,
    proxy_tx: mpsc::Sender<proto::ProxyConnReq>,
) {
    let far = Instant::now() + Duration::from_secs(86_400 * 365);
    let deadline = |l: Option<Duration>| l.map_or(far, |d| Instant::now() + d);
    let mut next = deadline(shared.liveness);
    loop {
        let frame = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => return,
            _ = sleep_until(next), if shared.liveness.is_some() => {
                shared.finish(Some(Error::ControlLiveness(shared.liveness.unwrap_or_default())));
                return;
            }
            f = reader.read_frame() => f,
        };
        match frame {
            Ok(message) => {
                next = deadline(shared.liveness);
                if let Err(e) = handle_message(&shared, message, &proxy_tx).await {
                    shared.finish(Some(e));
                    return;
                }
            }
            Err(e) => {
                let closing = shared.lock().closing;
                shared.finish(
                    if closing && matches!(e, Error::Frame(FrameError::Closed)) {
                        None
                    } else {
                        Some(e)
                    },
                );
                return;
            }
        }
    }
}

async fn handle_message(
    shared: &Arc<Shared>,
    message: Message,
    proxy_tx: &mpsc::Sender<proto::ProxyConnReq>,
) -> Result<()> {
    let Some(payload) = message.payload else {
        return Ok(());
    };
    match payload {
        Payload::OpenTunnelRsp(rsp) => handle_open_tunnel_rsp(shared, rsp).await,
        Payload::CloseTunnelRsp(rsp) => {
            let (slot, waiters) = {
                let mut st = shared.lock();
                (
                    st.tunnels.remove(&rsp.tunnel_id),
                    st.pending_closes.remove(&rsp.tunnel_id),
                )
            };
            match &slot {
                Some(slot) => slot.closed.cancel(),
                None => debug!(tunnel_id = %rsp.tunnel_id, "close for an unknown tunnel"),
            }
            for tx in waiters.into_iter().flatten() {
                let _ = tx.send(Ok(()));
            }
            Ok(())
        }
        Payload::ProxyConnReq(req) => {
            handle_proxy_conn_req(shared, req, proxy_tx).await;
            Ok(())
        }
        Payload::Heartbeat(hb) => {
            let heartbeats = shared.client.inner.cfg.heartbeat_interval.is_some();
            let mut st = shared.lock();
            if !heartbeats {
                return Err(Error::Protocol(
                    "engine sent a heartbeat while heartbeats are disabled".into(),
                ));
            }
            if shared.liveness.is_none() {
                if hb.sequence != 0 || hb.acknowledgement != 0 {
                    return Err(Error::Protocol(
                        "engine returned an invalid heartbeat (legacy mode)".into(),
                    ));
                }
                return Ok(());
            }
            if hb.sequence != 0
                || hb.acknowledgement == 0
                || hb.acknowledgement <= st.last_ack
                || hb.acknowledgement > st.last_sent
            {
                return Err(Error::Protocol(format!(
                    "engine returned an invalid heartbeat (sequence {}, acknowledgement {}, last ack {}, last sent {})",
                    hb.sequence, hb.acknowledgement, st.last_ack, st.last_sent
                )));
            }
            st.last_ack = hb.acknowledgement;
            Ok(())
        }
        Payload::CloseControlChannelRsp(_) => {
            shared.finish(None);
            Ok(())
        }
        Payload::ServerMessage(m) => {
            info!(message = %m.message, "engine message");
            Ok(())
        }
        other => {
            debug!(kind = other.name(), "ignoring control message");
            Ok(())
        }
    }
}

async fn handle_open_tunnel_rsp(shared: &Arc<Shared>, rsp: proto::OpenTunnelRsp) -> Result<()> {
    let pending = shared.lock().pending_creates.remove(&rsp.request_id);
    let result: CreateResult = match rsp.payload {
        Some(proto::open_tunnel_rsp::Payload::Error(e)) => Err(Error::from_proto(&e)),
        None => Err(Error::Protocol(
            "engine returned an empty OpenTunnelRsp".into(),
        )),
        Some(proto::open_tunnel_rsp::Payload::TunnelProperties(props)) => {
            match props.id.clone().filter(|id| !id.is_empty()) {
                None => Err(Error::Protocol("engine did not return a tunnel ID".into())),
                Some(id) => {
                    let (tx, rx) = mpsc::channel(shared.client.inner.cfg.accept_queue);
                    let closed = CancellationToken::new();
                    if pending.is_none() {
                        // Nobody waits for this tunnel any more (timed out): do not leave it open.
                        warn!(tunnel_id = %id, "tunnel created for an abandoned request; closing it");
                        shared
                            .send(
                                Payload::CloseTunnelReq(proto::CloseTunnelReq { tunnel_id: id })
                                    .into(),
                            )
                            .await?;
                        return Ok(());
                    }
                    shared.lock().tunnels.insert(
                        id,
                        TunnelSlot {
                            tx,
                            closed: closed.clone(),
                        },
                    );
                    Ok((props, rx, closed))
                }
            }
        }
    };
    if let Some(pending) = pending
        && let Err(Ok((props, _, closed))) = pending.send(result)
    {
        // The creator went away between the lookup and now.
        closed.cancel();
        if let Some(id) = props.id {
            shared.lock().tunnels.remove(&id);
            shared
                .send(Payload::CloseTunnelReq(proto::CloseTunnelReq { tunnel_id: id }).into())
                .await?;
        }
    }
    Ok(())
}

async fn handle_proxy_conn_req(
    shared: &Arc<Shared>,
    req: proto::ProxyConnReq,
    proxy_tx: &mpsc::Sender<proto::ProxyConnReq>,
) {
    if req.stream_id.is_empty() {
        warn!(tunnel_id = %req.tunnel_id, "ignoring a proxy connection request without stream ID");
        return;
    }
    let known = shared.lock().tunnels.contains_key(&req.tunnel_id);
    let refuse = |code: proto::ErrorCode, text: &str| Some(proto::Error::new(code, text));
    let error = if !known {
        refuse(
            proto::ErrorCode::InvalidStream,
            "Tunnel is not open on this client.",
        )
    } else if req.proxy_endpoint.is_some()
        && (req
            .proxy_endpoint
            .as_deref()
            .is_some_and(|e| e.trim().is_empty())
            || req.secret.as_deref().is_none_or(|s| s.trim().is_empty()))
    {
        refuse(
            proto::ErrorCode::InvalidStream,
            "redirected proxy connection requires a non-empty endpoint and stream credential",
        )
    } else {
        let stream_id = req.stream_id.clone();
        match proxy_tx.try_send(req) {
            Ok(()) => return,
            Err(mpsc::error::TrySendError::Full(_)) => {
                warn!(%stream_id, "inbound stream queue is full; refusing");
                shared
                    .proxy_conn_rsp(
                        stream_id,
                        refuse(
                            proto::ErrorCode::ServiceUnavailable,
                            "proxy connection queue is full",
                        ),
                    )
                    .await;
                return;
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    };
    shared.proxy_conn_rsp(req.stream_id, error).await;
}

async fn heartbeat_task(shared: Arc<Shared>, interval: Duration) {
    let negotiated = shared.liveness.is_some();
    let bound = shared
        .liveness
        .unwrap_or(shared.client.inner.cfg.operation_timeout);
    loop {
        let sequence = if negotiated {
            let mut st = shared.lock();
            match st.last_sent.checked_add(1) {
                Some(n) => {
                    st.last_sent = n;
                    n
                }
                None => {
                    drop(st);
                    shared.finish(Some(Error::Protocol("heartbeat sequence overflow".into())));
                    return;
                }
            }
        } else {
            0
        };
        let hb = Payload::Heartbeat(proto::Heartbeat {
            sequence,
            acknowledgement: 0,
        });
        tokio::select! {
            biased;
            _ = shared.closed.cancelled() => return,
            r = timeout(bound, shared.out.send(hb.into())) => match r {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    shared.finish(Some(Error::Timeout("sending a heartbeat".into())));
                    return;
                }
            },
        }
        tokio::select! {
            _ = shared.closed.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

async fn dispatcher_task(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<proto::ProxyConnReq>,
    slots: Arc<Semaphore>,
) {
    loop {
        let req = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => return,
            r = rx.recv() => match r { Some(r) => r, None => return },
        };
        let permit = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => return,
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let task_shared = shared.clone();
        // Tracked: `close` waits for in-flight dials, which stop as soon as the channel is finished.
        shared.tracker.spawn(async move {
            let _permit = permit;
            let stream_id = req.stream_id.clone();
            let outcome = tokio::select! {
                biased;
                _ = task_shared.closed.cancelled() => return,
                r = open_proxy_stream(&task_shared, req) => r,
            };
            let error = outcome.err().map(|e| {
                debug!(%stream_id, error = %e, "inbound stream failed");
                proto::Error::new(proto::ErrorCode::InvalidStream, e.to_string())
            });
            task_shared.proxy_conn_rsp(stream_id, error).await;
        });
    }
}

async fn open_proxy_stream(shared: &Arc<Shared>, req: proto::ProxyConnReq) -> Result<()> {
    let client = &shared.client;
    let (target, allow_override) = match req.proxy_endpoint.as_deref() {
        Some(ep) => {
            let addr = EngineAddress::parse(ep)?;
            let same = addr == shared.engine;
            (addr, same)
        }
        None => (shared.engine.clone(), true),
    };
    let tls = client.connect_tls(&target, allow_override).await?;
    let zero_rtt = client.inner.cfg.zero_rtt;
    let mut reader = FrameReader::new(tls);
    let request = Payload::ProxyReq(proto::ProxyReq {
        client_details: Some(client.client_details(req.secret.clone())),
        stream_id: req.stream_id.clone(),
        zero_rtt: Some(zero_rtt),
    });
    write_frame(reader.get_mut(), &request.into()).await?;
    if !zero_rtt {
        let response = client
            .read_response(&mut reader, "the proxy stream response")
            .await?;
        match response.payload {
            Some(Payload::ProxyRsp(rsp)) => {
                if let Some(e) = rsp.error {
                    return Err(Error::from_proto(&e));
                }
            }
            other => {
                return Err(Error::Protocol(format!(
                    "engine did not return ProxyRsp (got {})",
                    other.as_ref().map_or("empty", Payload::name)
                )));
            }
        }
    }
    let (io, leftover) = reader.into_parts();
    let remote_ip = req.source_ip.as_ref().and_then(proto::IpAddress::to_ip);
    let stream = RstreamStream::new(
        PrefixedIo::new(leftover, io),
        Some(req.stream_id.clone()),
        Some(req.tunnel_id.clone()),
        remote_ip,
    );
    let tx = shared
        .lock()
        .tunnels
        .get(&req.tunnel_id)
        .map(|slot| slot.tx.clone());
    let tx = tx.ok_or_else(|| Error::Dial("Tunnel is closed.".into()))?;
    match tx.send_timeout(stream, DELIVERY_TIMEOUT).await {
        Ok(()) => Ok(()),
        Err(mpsc::error::SendTimeoutError::Closed(_)) => {
            Err(Error::Dial("Tunnel is closed.".into()))
        }
        Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
            Err(Error::Dial("tunnel connection queue remained full".into()))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

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
