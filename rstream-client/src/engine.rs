//! `LocalEngine`: an in-process rstream engine for tests, examples and demos (feature `engine`).
//!
//! It speaks protocol 1.4.5 over TLS (a fresh rcgen CA and a server certificate for `localhost`,
//! `127.0.0.1` and `::1`, ALPN `rstrm/1`) on a loopback port:
//!
//! * control channels with token checks, protocol-version checks, liveness negotiation and heartbeat
//!   acknowledgements;
//! * tunnels with IDs `tun_<n>`, validated with the client rules; duplicate stable hostnames are
//!   refused with "Hostname is already in use.";
//! * **published ingress**: every published tunnel (tcp, tls or http) gets its own plain TCP listener on
//!   `127.0.0.1` (a requested free TCP `port` is honoured). Each downstream connection becomes a
//!   `ProxyConnReq` to the owner and is spliced, raw bytes both ways. HTTP tunnels are not terminated:
//!   a test sends a plain HTTP request to [`LocalEngine::ingress_addr`]. The reply's `hostname` is
//!   `127.0.0.1` (or the requested stable hostname) and `port` the listener port;
//! * private dials (`StreamReq`) by tunnel ID or name;
//! * the owner's tunnels are dropped when its control channel ends; [`LocalEngine::close_tunnel`] sends an
//!   unsolicited `CloseTunnelRsp`;
//! * fault injection through [`Faults`] and the action methods (drop control channels, stall, malformed
//!   or oversized frames, error replies, no heartbeat acks, stalled data handshakes, request floods);
//! * restartable on the same port with the same identity ([`LocalEngineBuilder::bind`] +
//!   [`LocalEngineBuilder::identity`]);
//! * [`LocalControlPlane`]: a small HTTP server answering the control-plane resolve endpoint.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> rstream_client::Result<()> {
//! use rstream_client::{engine::LocalEngine, tunnel::TunnelOptions, Client};
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! let engine = LocalEngine::builder().token("secret").start().await?;
//! let client = Client::builder()
//!     .engine(engine.engine_address())
//!     .token("secret")
//!     .tls(engine.client_tls())
//!     .build()?;
//! let control = client.connect().await?;
//! let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await?;
//! let ingress = engine.ingress_addr(tunnel.id()).expect("published");
//!
//! let mut downstream = tokio::net::TcpStream::connect(ingress).await?;
//! downstream.write_all(b"ping").await?;
//! let mut stream = tunnel.accept().await?;
//! let mut buf = [0u8; 4];
//! stream.read_exact(&mut buf).await?;
//! assert_eq!(&buf, b"ping");
//! control.close().await?;
//! engine.shutdown().await;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::io::{AsyncWriteExt, WriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::timeout;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::error::{Error, HOSTNAME_IN_USE, Result};
use crate::frame::{self, FrameReader};
use crate::proto::{self, ErrorCode, Message, message::Payload};
use crate::stream::PrefixedIo;
use crate::tls::{self, ClientIdentity, TlsOptions};

const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_PROXY_TIMEOUT: Duration = Duration::from_secs(10);

fn other(e: impl std::fmt::Display) -> Error {
    Error::InvalidConfig(e.to_string())
}

fn ca_params() -> rcgen::CertificateParams {
    let mut params = rcgen::CertificateParams::default();
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "rstream local engine CA");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// The engine's TLS identity: a CA and a server certificate it signed. Keep it to restart an engine
/// with the same certificate, and to issue mTLS client certificates.
#[derive(Clone)]
pub struct EngineIdentity {
    ca_pem: String,
    ca_der: CertificateDer<'static>,
    ca_key_der: Vec<u8>,
    cert_chain: Vec<CertificateDer<'static>>,
    key_der: Vec<u8>,
}

impl std::fmt::Debug for EngineIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineIdentity").finish_non_exhaustive()
    }
}

impl EngineIdentity {
    /// Generates a CA and a server certificate for `localhost`, `127.0.0.1` and `::1`.
    pub fn generate() -> Result<Self> {
        let ca_key = rcgen::KeyPair::generate().map_err(other)?;
        let ca_key_der = ca_key.serialize_der();
        let ca = rcgen::CertifiedIssuer::self_signed(ca_params(), ca_key).map_err(other)?;
        let mut params = rcgen::CertificateParams::new(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
            "::1".to_owned(),
        ])
        .map_err(other)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "localhost");
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let cert = params.signed_by(&key, &ca).map_err(other)?;
        Ok(Self {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            ca_key_der,
            cert_chain: vec![cert.der().clone()],
            key_der: key.serialize_der(),
        })
    }

    /// The CA certificate (PEM) that clients must trust.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// Client TLS options trusting this identity's CA.
    pub fn client_tls(&self) -> TlsOptions {
        TlsOptions::new().ca_pem(self.ca_pem.as_bytes().to_vec())
    }

    /// Issues a client certificate signed by the CA, for mTLS engines.
    pub fn issue_client_identity(&self, common_name: &str) -> Result<ClientIdentity> {
        let ca_key = rcgen::KeyPair::try_from(self.ca_key_der.as_slice()).map_err(other)?;
        let issuer = rcgen::Issuer::new(ca_params(), ca_key);
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(other)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        params.use_authority_key_identifier_extension = true;
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().map_err(other)?;
        let cert = params.signed_by(&key, &issuer).map_err(other)?;
        Ok(ClientIdentity::from_der(
            vec![cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        ))
    }

    fn server_config(
        &self,
        require_client_cert: bool,
        alpn: &[Vec<u8>],
    ) -> Result<Arc<rustls::ServerConfig>> {
        let provider = tls::provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(other)?;
        let builder = if require_client_cert {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.ca_der.clone()).map_err(other)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(other)?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()));
        let mut config = builder
            .with_single_cert(self.cert_chain.clone(), key)
            .map_err(other)?;
        config.alpn_protocols = alpn.to_vec();
        Ok(Arc::new(config))
    }
}

/// How the engine authenticates control channels and private dials.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineAuth {
    /// Any token, or none.
    #[default]
    AnyToken,
    /// Exactly this token.
    Token(String),
    /// No token must be sent (mTLS or unauthenticated engines).
    NoToken,
}

/// Runtime fault-injection switches. Change them at any time through [`LocalEngine::faults`].
#[derive(Debug, Default)]
pub struct Faults {
    /// Stop acknowledging heartbeats.
    pub stop_acking_heartbeats: AtomicBool,
    /// Stop reading and answering control frames (the client sees silence).
    pub stall_control: AtomicBool,
    /// Reply to `OpenControlChannelReq` with this error.
    pub open_control_error: Mutex<Option<(ErrorCode, String)>>,
    /// Reply to `OpenTunnelReq` with this error.
    pub open_tunnel_error: Mutex<Option<(ErrorCode, String)>>,
    /// Reply to `StreamReq` with this error (when the dialer awaits a response).
    pub stream_error: Mutex<Option<(ErrorCode, String)>>,
    /// Delay the TLS handshake of every new connection by this much.
    pub stall_tls_handshake: Mutex<Option<Duration>>,
    /// Send these bytes in the same write as the next `ProxyRsp` to an owner (one shot).
    pub coalesce_proxy_rsp: Mutex<Option<Bytes>>,
    /// Send these bytes in the same write as the next `StreamRsp` to a dialer (one shot).
    pub coalesce_stream_rsp: Mutex<Option<Bytes>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Clone, Debug)]
enum Command {
    DropControls,
    Raw(Bytes),
    ServerMessage(String),
    Flood { tunnel_id: String, count: usize },
}

enum Out {
    Msg(Box<Message>),
    Raw(Bytes),
}

type EngineIo = PrefixedIo<TlsStream<TcpStream>>;

struct ProxyLeg {
    io: EngineIo,
}

struct PendingStream {
    secret: String,
    leg: oneshot::Sender<ProxyLeg>,
    owner: u64,
}

struct EngineTunnel {
    props: proto::TunnelProperties,
    owner: u64,
    ingress: Option<(SocketAddr, CancellationToken)>,
}

struct ControlHandle {
    tx: mpsc::Sender<Out>,
}

#[derive(Default)]
struct EState {
    tunnels: HashMap<String, EngineTunnel>,
    pending: HashMap<String, PendingStream>,
    controls: HashMap<u64, ControlHandle>,
}

struct Config {
    auth: EngineAuth,
    liveness_timeout: Option<Duration>,
    proxy_timeout: Duration,
}

struct EngineShared {
    cfg: Config,
    faults: Faults,
    state: Mutex<EState>,
    commands: broadcast::Sender<Command>,
    open_connections: AtomicUsize,
    heartbeats: AtomicU64,
    redirected_legs: AtomicU64,
    next_id: AtomicU64,
    proxy_conn_rsps: Mutex<Vec<proto::ProxyConnRsp>>,
    client_details: Mutex<Vec<proto::ClientDetails>>,
    tunnel_requests: Mutex<Vec<proto::TunnelProperties>>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    proxy_endpoint: Mutex<Option<String>>,
}

impl EngineShared {
    fn state(&self) -> MutexGuard<'_, EState> {
        lock(&self.state)
    }
    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }
    fn check_token(
        &self,
        details: Option<&proto::ClientDetails>,
    ) -> std::result::Result<(), proto::Error> {
        let token = details.and_then(|d| d.token.as_deref());
        let ok = match &self.cfg.auth {
            EngineAuth::AnyToken => true,
            EngineAuth::Token(expected) => token == Some(expected.as_str()),
            EngineAuth::NoToken => token.is_none(),
        };
        if ok {
            Ok(())
        } else {
            Err(proto::Error::new(
                ErrorCode::Unauthorized,
                "Invalid authentication token.",
            ))
        }
    }
}

struct ConnGuard(Arc<EngineShared>);

impl ConnGuard {
    fn new(shared: &Arc<EngineShared>) -> Self {
        shared.open_connections.fetch_add(1, Ordering::SeqCst);
        Self(shared.clone())
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.0.open_connections.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Builder of a [`LocalEngine`].
#[derive(Debug)]
pub struct LocalEngineBuilder {
    bind: SocketAddr,
    identity: Option<EngineIdentity>,
    auth: EngineAuth,
    require_client_cert: bool,
    alpn: Vec<Vec<u8>>,
    liveness_timeout: Option<Duration>,
    proxy_timeout: Duration,
    redirect_proxy_legs: bool,
}

impl Default for LocalEngineBuilder {
    fn default() -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            identity: None,
            auth: EngineAuth::AnyToken,
            require_client_cert: false,
            alpn: vec![tls::ALPN.to_vec()],
            liveness_timeout: None,
            proxy_timeout: DEFAULT_PROXY_TIMEOUT,
            redirect_proxy_legs: false,
        }
    }
}

impl LocalEngineBuilder {
    /// Listens on this address (default `127.0.0.1:0`). Use the previous engine's address to restart it.
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = addr;
        self
    }
    /// Reuses a TLS identity (e.g. the one of a previous engine).
    pub fn identity(mut self, identity: EngineIdentity) -> Self {
        self.identity = Some(identity);
        self
    }
    /// Requires exactly this token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.auth = EngineAuth::Token(token.into());
        self
    }
    /// Sets the authentication policy.
    pub fn auth(mut self, auth: EngineAuth) -> Self {
        self.auth = auth;
        self
    }
    /// Requires TLS client certificates signed by the identity's CA (mTLS).
    pub fn require_client_certificates(mut self, on: bool) -> Self {
        self.require_client_cert = on;
        self
    }
    /// ALPN protocols offered by the listener (default `rstrm/1`; change it to test ALPN mismatches).
    pub fn alpn(mut self, alpn: Vec<Vec<u8>>) -> Self {
        self.alpn = alpn;
        self
    }
    /// Liveness timeout granted to clients that request heartbeats (default 3 × their interval).
    pub fn liveness_timeout(mut self, timeout: Duration) -> Self {
        self.liveness_timeout = Some(timeout);
        self
    }
    /// How long a stream waits for the owner's `ProxyReq` (default 10 s).
    pub fn proxy_timeout(mut self, timeout: Duration) -> Self {
        self.proxy_timeout = timeout;
        self
    }
    /// Sends `proxy_endpoint` in every `ProxyConnReq`, pointing at a second listener of this engine
    /// (named `localhost:<port>`), to exercise redirected proxy dials.
    pub fn redirect_proxy_legs(mut self, on: bool) -> Self {
        self.redirect_proxy_legs = on;
        self
    }

    /// Starts the engine.
    pub async fn start(self) -> Result<LocalEngine> {
        let identity = match self.identity {
            Some(id) => id,
            None => EngineIdentity::generate()?,
        };
        let server_config = identity.server_config(self.require_client_cert, &self.alpn)?;
        let listener = bind_reuse(self.bind)?;
        let addr = listener.local_addr()?;
        let (commands, _) = broadcast::channel(1024);
        let shared = Arc::new(EngineShared {
            cfg: Config {
                auth: self.auth,
                liveness_timeout: self.liveness_timeout,
                proxy_timeout: self.proxy_timeout,
            },
            faults: Faults::default(),
            state: Mutex::new(EState::default()),
            commands,
            open_connections: AtomicUsize::new(0),
            heartbeats: AtomicU64::new(0),
            redirected_legs: AtomicU64::new(0),
            next_id: AtomicU64::new(0),
            proxy_conn_rsps: Mutex::new(Vec::new()),
            client_details: Mutex::new(Vec::new()),
            tunnel_requests: Mutex::new(Vec::new()),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
            proxy_endpoint: Mutex::new(None),
        });
        let acceptor = tokio_rustls::TlsAcceptor::from(server_config);
        shared.tracker.spawn(accept_loop(
            shared.clone(),
            listener,
            acceptor.clone(),
            false,
        ));
        if self.redirect_proxy_legs {
            let second = bind_reuse(SocketAddr::from(([127, 0, 0, 1], 0)))?;
            *lock(&shared.proxy_endpoint) =
                Some(format!("localhost:{}", second.local_addr()?.port()));
            shared
                .tracker
                .spawn(accept_loop(shared.clone(), second, acceptor, true));
        }
        Ok(LocalEngine {
            shared,
            addr,
            identity,
        })
    }
}

fn bind_reuse(addr: SocketAddr) -> Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket
        .bind(addr)
        .map_err(|e| Error::connect(addr.to_string(), e))?;
    Ok(socket.listen(1024)?)
}

/// An in-process rstream engine on loopback. See the [module docs](self).
pub struct LocalEngine {
    shared: Arc<EngineShared>,
    addr: SocketAddr,
    identity: EngineIdentity,
}

impl std::fmt::Debug for LocalEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEngine")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl LocalEngine {
    /// A builder with defaults (any token, `127.0.0.1:0`, fresh identity).
    pub fn builder() -> LocalEngineBuilder {
        LocalEngineBuilder::default()
    }

    /// Starts an engine with the defaults.
    pub async fn start() -> Result<Self> {
        Self::builder().start().await
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The engine address for [`crate::ClientBuilder::engine`] (`127.0.0.1:<port>`).
    pub fn engine_address(&self) -> String {
        self.addr.to_string()
    }

    /// The TLS identity (reuse it to restart the engine with the same certificate).
    pub fn identity(&self) -> &EngineIdentity {
        &self.identity
    }

    /// The CA certificate (PEM) clients must trust.
    pub fn ca_pem(&self) -> &str {
        self.identity.ca_pem()
    }

    /// Client TLS options trusting this engine.
    pub fn client_tls(&self) -> TlsOptions {
        self.identity.client_tls()
    }

    /// Fault-injection switches.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// The published ingress address of a tunnel.
    pub fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        self.shared
            .state()
            .tunnels
            .get(tunnel_id)
            .and_then(|t| t.ingress.as_ref().map(|(a, _)| *a))
    }

    /// The properties of the open tunnels.
    pub fn tunnels(&self) -> Vec<proto::TunnelProperties> {
        self.shared
            .state()
            .tunnels
            .values()
            .map(|t| t.props.clone())
            .collect()
    }

    /// The tunnel properties as requested by clients, in order.
    pub fn tunnel_requests(&self) -> Vec<proto::TunnelProperties> {
        lock(&self.shared.tunnel_requests).clone()
    }

    /// Number of open control channels.
    pub fn control_channels(&self) -> usize {
        self.shared.state().controls.len()
    }

    /// Number of open TCP connections of every kind (control, data, ingress).
    pub fn open_connections(&self) -> usize {
        self.shared.open_connections.load(Ordering::SeqCst)
    }

    /// Heartbeats received with a non-zero sequence.
    pub fn heartbeats_received(&self) -> u64 {
        self.shared.heartbeats.load(Ordering::SeqCst)
    }

    /// Proxy legs received on the redirect listener.
    pub fn redirected_legs(&self) -> u64 {
        self.shared.redirected_legs.load(Ordering::SeqCst)
    }

    /// `ProxyConnRsp` messages received, in order.
    pub fn proxy_conn_rsps(&self) -> Vec<proto::ProxyConnRsp> {
        lock(&self.shared.proxy_conn_rsps).clone()
    }

    /// `ClientDetails` of every control channel, private dial and proxy leg, in order.
    pub fn client_details(&self) -> Vec<proto::ClientDetails> {
        lock(&self.shared.client_details).clone()
    }

    /// Abruptly closes every control channel (streams stay up).
    pub fn drop_control_channels(&self) {
        let _ = self.shared.commands.send(Command::DropControls);
    }

    /// Writes a malformed frame (`00 00 00 01 FF`) on every control channel.
    pub fn send_malformed_frame(&self) {
        let _ = self
            .shared
            .commands
            .send(Command::Raw(Bytes::from_static(&[0, 0, 0, 1, 0xff])));
    }

    /// Writes a header announcing a 65 536-byte frame on every control channel.
    pub fn send_oversized_frame(&self) {
        let _ = self
            .shared
            .commands
            .send(Command::Raw(Bytes::from_static(&[0, 1, 0, 0])));
    }

    /// Writes raw bytes on every control channel.
    pub fn send_raw(&self, bytes: Bytes) {
        let _ = self.shared.commands.send(Command::Raw(bytes));
    }

    /// Sends a `ServerMessage` on every control channel.
    pub fn send_server_message(&self, text: impl Into<String>) {
        let _ = self
            .shared
            .commands
            .send(Command::ServerMessage(text.into()));
    }

    /// Sends `count` `ProxyConnReq` for streams that do not exist to the owner of `tunnel_id`.
    pub fn flood_proxy_conn_reqs(&self, tunnel_id: &str, count: usize) {
        let _ = self.shared.commands.send(Command::Flood {
            tunnel_id: tunnel_id.to_owned(),
            count,
        });
    }

    /// Drops a tunnel and tells its owner with an unsolicited `CloseTunnelRsp`.
    pub async fn close_tunnel(&self, tunnel_id: &str) -> bool {
        let (tunnel, tx) = {
            let mut st = self.shared.state();
            let Some(t) = st.tunnels.remove(tunnel_id) else {
                return false;
            };
            let tx = st.controls.get(&t.owner).map(|c| c.tx.clone());
            (t, tx)
        };
        if let Some((_, cancel)) = &tunnel.ingress {
            cancel.cancel();
        }
        if let Some(tx) = tx {
            let msg = Payload::CloseTunnelRsp(proto::CloseTunnelRsp {
                tunnel_id: tunnel_id.to_owned(),
            });
            let _ = tx.send(Out::Msg(Box::new(msg.into()))).await;
        }
        true
    }

    /// Stops the engine: listeners, control channels, ingress and streams. The port is free afterwards.
    pub async fn shutdown(self) {
        self.shared.shutdown.cancel();
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
        let mut st = self.shared.state();
        st.tunnels.clear();
        st.pending.clear();
        st.controls.clear();
    }
}

async fn accept_loop(
    shared: Arc<EngineShared>,
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    redirect: bool,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    debug!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        // Small frames (requests, acknowledgements) must not wait for Nagle and delayed ACKs.
        let _ = tcp.set_nodelay(true);
        let task_shared = shared.clone();
        let acceptor = acceptor.clone();
        shared.tracker.spawn(async move {
            let guard = ConnGuard::new(&task_shared);
            let cancel = task_shared.shutdown.clone();
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = serve_connection(&task_shared, tcp, peer, acceptor, redirect) => {}
            }
            drop(guard);
        });
    }
}

async fn serve_connection(
    shared: &Arc<EngineShared>,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    redirect: bool,
) {
    let stall = *lock(&shared.faults.stall_tls_handshake);
    if let Some(d) = stall {
        tokio::time::sleep(d).await;
    }
    let Ok(Ok(tls)) = timeout(FIRST_FRAME_TIMEOUT, acceptor.accept(tcp)).await else {
        return;
    };
    if tls.get_ref().1.alpn_protocol() != Some(tls::ALPN) {
        debug!("closing a connection without ALPN rstrm/1");
        return;
    }
    let mut reader = FrameReader::new(tls);
    let Ok(Ok(first)) = timeout(FIRST_FRAME_TIMEOUT, reader.read_frame()).await else {
        return;
    };
    match first.payload {
        Some(Payload::OpenControlChannelReq(req)) if !redirect => {
            control_connection(shared, reader, req).await
        }
        Some(Payload::StreamReq(req)) if !redirect => private_dial(shared, reader, req, peer).await,
        Some(Payload::ProxyReq(req)) => {
            if redirect {
                shared.redirected_legs.fetch_add(1, Ordering::SeqCst);
            }
            proxy_leg(shared, reader, req).await
        }
        _ => debug!(kind = first.kind(), "unexpected first frame"),
    }
}

fn check_version(details: Option<&proto::ClientDetails>) -> std::result::Result<(), proto::Error> {
    let Some(v) = details.and_then(|d| d.protocol_version.as_deref()) else {
        return Err(proto::Error::new(
            ErrorCode::ProtocolVersionMissing,
            "Protocol version is missing.",
        ));
    };
    let parts: Vec<_> = v.split('.').map(str::parse::<u32>).collect();
    if parts.len() != 3 || parts.iter().any(std::result::Result::is_err) {
        return Err(proto::Error::new(
            ErrorCode::ProtocolVersionInvalid,
            "Protocol version is invalid.",
        ));
    }
    if !v.starts_with("1.4.") {
        return Err(proto::Error::new(
            ErrorCode::ProtocolVersionIncompatible,
            "Protocol version is incompatible.",
        ));
    }
    Ok(())
}

async fn write_msg(
    io: &mut TlsStream<TcpStream>,
    payload: Payload,
    extra: Option<Bytes>,
) -> Result<()> {
    let mut buf = BytesMut::new();
    frame::encode_into(&payload.into(), &mut buf)?;
    if let Some(extra) = extra {
        buf.extend_from_slice(&extra);
    }
    io.write_all(&buf).await?;
    io.flush().await?;
    Ok(())
}

async fn control_connection(
    shared: &Arc<EngineShared>,
    mut reader: FrameReader<TlsStream<TcpStream>>,
    req: proto::OpenControlChannelReq,
) {
    lock(&shared.client_details).push(req.client_details.clone().unwrap_or_default());
    let refuse = check_version(req.client_details.as_ref())
        .and_then(|()| shared.check_token(req.client_details.as_ref()))
        .err()
        .or_else(|| {
            lock(&shared.faults.open_control_error)
                .clone()
                .map(|(c, m)| proto::Error::new(c, m))
        });
    if let Some(error) = refuse {
        let rsp = proto::OpenControlChannelRsp {
            payload: Some(proto::open_control_channel_rsp::Payload::Error(error)),
        };
        let _ = write_msg(reader.get_mut(), Payload::OpenControlChannelRsp(rsp), None).await;
        let _ = reader.get_mut().shutdown().await;
        return;
    }
    let liveness = req
        .liveness
        .filter(|l| l.heartbeat_interval_ms > 0)
        .map(|l| {
            let timeout_ms = shared
                .cfg
                .liveness_timeout
                .map(|d| d.as_millis() as u64)
                .unwrap_or(u64::from(l.heartbeat_interval_ms) * 3)
                .clamp(u64::from(l.heartbeat_interval_ms), 900_000);
            proto::ControlChannelLiveness {
                heartbeat_interval_ms: l.heartbeat_interval_ms,
                heartbeat_timeout_ms: timeout_ms as u32,
            }
        });
    let conn_id = shared.id();
    let ok = proto::open_control_channel_rsp::Ok {
        client_id: format!("cli_{conn_id}"),
        server_details: Some(proto::ServerDetails {
            agent: Some("local-engine".into()),
            channel: Some("test".into()),
            version: Some(env!("CARGO_PKG_VERSION").into()),
            provider: Some("local".into()),
            region: Some("local".into()),
            ..Default::default()
        }),
        liveness,
    };
    let rsp = proto::OpenControlChannelRsp {
        payload: Some(proto::open_control_channel_rsp::Payload::Ok(ok)),
    };
    if write_msg(reader.get_mut(), Payload::OpenControlChannelRsp(rsp), None)
        .await
        .is_err()
    {
        return;
    }
    let (tls, leftover) = reader.into_parts();
    let (rd, wr) = tokio::io::split(PrefixedIo::new(leftover, tls));
    let mut reader = FrameReader::new(rd);
    let (tx, rx) = mpsc::channel::<Out>(1024);
    let kill = CancellationToken::new();
    let writer = tokio::spawn(control_writer(wr, rx, kill.clone()));
    shared
        .state()
        .controls
        .insert(conn_id, ControlHandle { tx: tx.clone() });
    let mut commands = shared.commands.subscribe();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let mut graceful = false;
    loop {
        let stalled = shared.faults.stall_control.load(Ordering::SeqCst);
        tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            _ = tick.tick() => continue,
            cmd = commands.recv() => match cmd {
                Ok(Command::DropControls) => break,
                Ok(Command::Raw(bytes)) => { let _ = tx.send(Out::Raw(bytes)).await; }
                Ok(Command::ServerMessage(text)) => {
                    let _ = tx.send(Out::Msg(Box::new(Payload::ServerMessage(proto::ServerMessage { message: text }).into()))).await;
                }
                Ok(Command::Flood { tunnel_id, count }) => {
                    let owned = shared.state().tunnels.get(&tunnel_id).is_some_and(|t| t.owner == conn_id);
                    if owned {
                        for _ in 0..count {
                            let req = proto::ProxyConnReq {
                                tunnel_id: tunnel_id.clone(),
                                stream_id: random_hex(16),
                                secret: Some(random_hex(16)),
                                source_ip: None,
                                proxy_endpoint: None,
                            };
                            let _ = tx.send(Out::Msg(Box::new(Payload::ProxyConnReq(req).into()))).await;
                        }
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => break,
            },
            frame = reader.read_frame(), if !stalled => match frame {
                Ok(message) => {
                    if handle_control_frame(shared, conn_id, message, &tx).await {
                        graceful = true;
                        break;
                    }
                }
                Err(e) => {
                    debug!(error = %e, "control connection ended");
                    break;
                }
            },
        }
    }
    // Cleanup: the owner's tunnels and pending streams go away with it.
    {
        let mut st = shared.state();
        st.controls.remove(&conn_id);
        let gone: Vec<String> = st
            .tunnels
            .iter()
            .filter(|(_, t)| t.owner == conn_id)
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            if let Some(EngineTunnel {
                ingress: Some((_, cancel)),
                ..
            }) = st.tunnels.remove(&id)
            {
                cancel.cancel();
            }
        }
        st.pending.retain(|_, p| p.owner != conn_id);
    }
    drop(tx);
    if !graceful {
        kill.cancel();
    }
    let _ = writer.await;
}

async fn control_writer(
    mut wr: WriteHalf<PrefixedIo<TlsStream<TcpStream>>>,
    mut rx: mpsc::Receiver<Out>,
    kill: CancellationToken,
) {
    loop {
        let out = tokio::select! {
            _ = kill.cancelled() => return,
            o = rx.recv() => match o { Some(o) => o, None => break },
        };
        let result = match out {
            Out::Msg(m) => frame::write_frame(&mut wr, m.as_ref()).await,
            Out::Raw(b) => wr.write_all(&b).await.map_err(Error::from),
        };
        if result.is_err() {
            return;
        }
    }
    let _ = wr.shutdown().await;
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

/// Returns true when the channel must close gracefully.
async fn handle_control_frame(
    shared: &Arc<EngineShared>,
    conn_id: u64,
    message: Message,
    tx: &mpsc::Sender<Out>,
) -> bool {
    let reply = |p: Payload| Out::Msg(Box::new(p.into()));
    match message.payload {
        Some(Payload::Heartbeat(hb)) => {
            if hb.sequence > 0 {
                shared.heartbeats.fetch_add(1, Ordering::SeqCst);
                if !shared.faults.stop_acking_heartbeats.load(Ordering::SeqCst) {
                    let ack = proto::Heartbeat {
                        sequence: 0,
                        acknowledgement: hb.sequence,
                    };
                    let _ = tx.send(reply(Payload::Heartbeat(ack))).await;
                }
            }
        }
        Some(Payload::OpenTunnelReq(req)) => {
            let payload =
                match open_tunnel(shared, conn_id, req.tunnel_properties.unwrap_or_default()).await
                {
                    Ok(props) => proto::open_tunnel_rsp::Payload::TunnelProperties(props),
                    Err(e) => proto::open_tunnel_rsp::Payload::Error(e),
                };
            let rsp = proto::OpenTunnelRsp {
                request_id: req.request_id,
                payload: Some(payload),
            };
            let _ = tx.send(reply(Payload::OpenTunnelRsp(rsp))).await;
        }
        Some(Payload::CloseTunnelReq(req)) => {
            let removed = {
                let mut st = shared.state();
                match st.tunnels.get(&req.tunnel_id) {
                    Some(t) if t.owner == conn_id => st.tunnels.remove(&req.tunnel_id),
                    _ => None,
                }
            };
            if let Some(EngineTunnel {
                ingress: Some((_, cancel)),
                ..
            }) = removed
            {
                cancel.cancel();
            }
            let _ = tx
                .send(reply(Payload::CloseTunnelRsp(proto::CloseTunnelRsp {
                    tunnel_id: req.tunnel_id,
                })))
                .await;
        }
        Some(Payload::ProxyConnRsp(rsp)) => {
            if rsp.error.is_some() {
                shared.state().pending.remove(&rsp.stream_id);
            }
            lock(&shared.proxy_conn_rsps).push(rsp);
        }
        Some(Payload::CloseControlChannelReq(_)) => {
            let _ = tx
                .send(reply(Payload::CloseControlChannelRsp(
                    proto::CloseControlChannelRsp {},
                )))
                .await;
            return true;
        }
        other => debug!(
            kind = other.as_ref().map_or("empty", Payload::name),
            "ignoring control frame"
        ),
    }
    false
}

async fn open_tunnel(
    shared: &Arc<EngineShared>,
    conn_id: u64,
    mut props: proto::TunnelProperties,
) -> std::result::Result<proto::TunnelProperties, proto::Error> {
    lock(&shared.tunnel_requests).push(props.clone());
    if let Some((code, message)) = lock(&shared.faults.open_tunnel_error).clone() {
        return Err(proto::Error::new(code, message));
    }
    let invalid = |m: String| proto::Error::new(ErrorCode::InvalidRequest, m);
    crate::tunnel::validate_properties(&props).map_err(invalid)?;
    if props.id.is_some() || props.host.is_some() {
        return Err(invalid("Read-only tunnel properties cannot be set.".into()));
    }
    let kind = props
        .r#type
        .get_or_insert_with(|| "bytestream".into())
        .clone();
    if kind != "bytestream" {
        return Err(proto::Error::new(
            ErrorCode::FeatureNotAvailable,
            "Datagram tunnels are not available on this engine.",
        ));
    }
    if let Some(p) = props.protocol.as_deref()
        && !matches!(p, "http" | "tls" | "tcp")
    {
        return Err(proto::Error::new(
            ErrorCode::FeatureNotAvailable,
            format!("Protocol '{p}' is not available."),
        ));
    }
    let published = props.publish != Some(false);
    props.publish = Some(published);
    if let Some(h) = props.hostname.as_deref()
        && shared
            .state()
            .tunnels
            .values()
            .any(|t| t.props.hostname.as_deref() == Some(h))
    {
        return Err(invalid(HOSTNAME_IN_USE.into()));
    }
    let id = format!("tun_{}", shared.id());
    props.id = Some(id.clone());
    props.creation_date = Some(proto::Timestamp::now());
    let mut ingress = None;
    if published {
        let port = props.port.and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
        let listener = bind_reuse(SocketAddr::from(([127, 0, 0, 1], port)))
            .map_err(|_| invalid(format!("Port {port} is not available.")))?;
        let addr = listener.local_addr().map_err(|e| invalid(e.to_string()))?;
        let cancel = shared.shutdown.child_token();
        shared.tracker.spawn(ingress_loop(
            shared.clone(),
            id.clone(),
            listener,
            cancel.clone(),
        ));
        if props.hostname.is_none() {
            props.hostname = Some("127.0.0.1".into());
        }
        props.port = Some(u32::from(addr.port()));
        ingress = Some((addr, cancel));
    }
    shared.state().tunnels.insert(
        id,
        EngineTunnel {
            props: props.clone(),
            owner: conn_id,
            ingress,
        },
    );
    Ok(props)
}

async fn ingress_loop(
    shared: Arc<EngineShared>,
    tunnel_id: String,
    listener: TcpListener,
    cancel: CancellationToken,
) {
    loop {
        let (tcp, peer) = tokio::select! {
            _ = cancel.cancelled() => return,
            r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
        };
        let task_shared = shared.clone();
        let tunnel_id = tunnel_id.clone();
        shared.tracker.spawn(async move {
            let _guard = ConnGuard::new(&task_shared);
            let cancel = task_shared.shutdown.clone();
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = ingress_connection(&task_shared, &tunnel_id, tcp, peer) => {}
            }
        });
    }
}

/// Registers a pending stream, sends `ProxyConnReq` to the owner and waits for the proxy leg.
async fn request_leg(
    shared: &Arc<EngineShared>,
    tunnel_id: &str,
    source: SocketAddr,
) -> std::result::Result<(String, ProxyLeg), proto::Error> {
    let stream_id = random_hex(16);
    let secret = random_hex(16);
    let (leg_tx, leg_rx) = oneshot::channel();
    let owner_tx = {
        let mut st = shared.state();
        let Some(tunnel) = st.tunnels.get(tunnel_id) else {
            return Err(proto::Error::new(
                ErrorCode::TunnelNotFound,
                "Tunnel not found.",
            ));
        };
        let owner = tunnel.owner;
        let Some(tx) = st.controls.get(&owner).map(|c| c.tx.clone()) else {
            return Err(proto::Error::new(
                ErrorCode::ServiceUnavailable,
                "Tunnel owner is not connected.",
            ));
        };
        st.pending.insert(
            stream_id.clone(),
            PendingStream {
                secret: secret.clone(),
                leg: leg_tx,
                owner,
            },
        );
        tx
    };
    let req = proto::ProxyConnReq {
        tunnel_id: tunnel_id.to_owned(),
        stream_id: stream_id.clone(),
        secret: Some(secret),
        source_ip: Some(proto::IpAddress::from(source.ip())),
        proxy_endpoint: lock(&shared.proxy_endpoint).clone(),
    };
    if owner_tx
        .send(Out::Msg(Box::new(Payload::ProxyConnReq(req).into())))
        .await
        .is_err()
    {
        shared.state().pending.remove(&stream_id);
        return Err(proto::Error::new(
            ErrorCode::ServiceUnavailable,
            "Tunnel owner is not connected.",
        ));
    }
    match timeout(shared.cfg.proxy_timeout, leg_rx).await {
        Ok(Ok(leg)) => Ok((stream_id, leg)),
        Ok(Err(_)) => Err(proto::Error::new(
            ErrorCode::InvalidStream,
            "The tunnel owner refused the stream.",
        )),
        Err(_) => {
            shared.state().pending.remove(&stream_id);
            Err(proto::Error::new(
                ErrorCode::ServiceUnavailable,
                "Timed out waiting for the tunnel owner.",
            ))
        }
    }
}

async fn ingress_connection(
    shared: &Arc<EngineShared>,
    tunnel_id: &str,
    mut tcp: TcpStream,
    peer: SocketAddr,
) {
    let _ = tcp.set_nodelay(true);
    match request_leg(shared, tunnel_id, peer).await {
        Ok((_, mut leg)) => {
            let _ = crate::forward::relay(&mut tcp, &mut leg.io).await;
        }
        Err(e) => debug!(error = ?e.message, "ingress stream failed"),
    }
}

async fn private_dial(
    shared: &Arc<EngineShared>,
    mut reader: FrameReader<TlsStream<TcpStream>>,
    req: proto::StreamReq,
    peer: SocketAddr,
) {
    lock(&shared.client_details).push(req.client_details.clone().unwrap_or_default());
    let zero_rtt = req.zero_rtt.unwrap_or(false);
    let target = {
        let st = shared.state();
        if st.tunnels.contains_key(&req.tunnel_id_name) {
            Some(req.tunnel_id_name.clone())
        } else {
            st.tunnels
                .iter()
                .find(|(_, t)| t.props.name.as_deref() == Some(req.tunnel_id_name.as_str()))
                .map(|(id, _)| id.clone())
        }
    };
    let fault = lock(&shared.faults.stream_error)
        .clone()
        .map(|(c, m)| proto::Error::new(c, m));
    let checked = shared
        .check_token(req.client_details.as_ref())
        .and_then(|()| fault.map_or(Ok(()), Err))
        .and_then(|()| {
            target.ok_or_else(|| proto::Error::new(ErrorCode::TunnelNotFound, "Tunnel not found."))
        });
    let result = match checked {
        Ok(tunnel_id) => request_leg(shared, &tunnel_id, peer).await,
        Err(e) => Err(e),
    };
    match result {
        Ok((stream_id, mut leg)) => {
            if !zero_rtt {
                let extra = lock(&shared.faults.coalesce_stream_rsp).take();
                let rsp = proto::StreamRsp {
                    payload: Some(proto::stream_rsp::Payload::StreamId(stream_id)),
                };
                if write_msg(reader.get_mut(), Payload::StreamRsp(rsp), extra)
                    .await
                    .is_err()
                {
                    return;
                }
            }
            let (tls, leftover) = reader.into_parts();
            let mut dialer = PrefixedIo::new(leftover, tls);
            let _ = crate::forward::relay(&mut dialer, &mut leg.io).await;
        }
        Err(error) => {
            if !zero_rtt {
                let rsp = proto::StreamRsp {
                    payload: Some(proto::stream_rsp::Payload::Error(error)),
                };
                let _ = write_msg(reader.get_mut(), Payload::StreamRsp(rsp), None).await;
            }
            let _ = reader.get_mut().shutdown().await;
        }
    }
}

async fn proxy_leg(
    shared: &Arc<EngineShared>,
    mut reader: FrameReader<TlsStream<TcpStream>>,
    req: proto::ProxyReq,
) {
    lock(&shared.client_details).push(req.client_details.clone().unwrap_or_default());
    let zero_rtt = req.zero_rtt.unwrap_or(false);
    let token = req.client_details.as_ref().and_then(|d| d.token.clone());
    let pending = {
        let mut st = shared.state();
        match st.pending.get(&req.stream_id) {
            None => Err(proto::Error::new(
                ErrorCode::InvalidStream,
                "Unknown stream.",
            )),
            Some(p) if Some(&p.secret) != token.as_ref() => {
                st.pending.remove(&req.stream_id);
                Err(proto::Error::new(
                    ErrorCode::Unauthorized,
                    "Invalid stream credential.",
                ))
            }
            Some(_) => st
                .pending
                .remove(&req.stream_id)
                .ok_or_else(|| proto::Error::new(ErrorCode::InvalidStream, "Unknown stream.")),
        }
    };
    match pending {
        Ok(p) => {
            if !zero_rtt {
                let extra = lock(&shared.faults.coalesce_proxy_rsp).take();
                if write_msg(
                    reader.get_mut(),
                    Payload::ProxyRsp(proto::ProxyRsp { error: None }),
                    extra,
                )
                .await
                .is_err()
                {
                    return;
                }
            }
            let (tls, leftover) = reader.into_parts();
            let io = PrefixedIo::new(leftover, tls);
            // Keep the connection alive until the waiting side takes it (it owns the splice).
            let _ = p.leg.send(ProxyLeg { io });
        }
        Err(error) => {
            if !zero_rtt {
                let _ = write_msg(
                    reader.get_mut(),
                    Payload::ProxyRsp(proto::ProxyRsp { error: Some(error) }),
                    None,
                )
                .await;
            }
            let _ = reader.get_mut().shutdown().await;
        }
    }
}

/// A recorded control-plane request: path and `Authorization` header.
pub type RecordedRequest = (String, Option<String>);

/// A minimal control plane on loopback (plain HTTP) answering
/// `GET /api/projects/tunnels/resolve/{endpoint}` with configured project JSON.
pub struct LocalControlPlane {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<RecordedRequest>>>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for LocalControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalControlPlane")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Builder of a [`LocalControlPlane`].
#[derive(Debug, Default)]
pub struct LocalControlPlaneBuilder {
    token: Option<String>,
    projects: HashMap<String, serde_json::Value>,
    redirects: HashMap<String, String>,
}

impl LocalControlPlaneBuilder {
    /// Requires `Authorization: Bearer <token>` (401 otherwise).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }
    /// Answers the endpoint with this project object.
    pub fn project(mut self, endpoint: impl Into<String>, project: serde_json::Value) -> Self {
        self.projects.insert(endpoint.into(), project);
        self
    }
    /// Answers the endpoint with `302 Found` to `location` (clients must not follow it).
    pub fn redirect(mut self, endpoint: impl Into<String>, location: impl Into<String>) -> Self {
        self.redirects.insert(endpoint.into(), location.into());
        self
    }

    /// Starts the server on `127.0.0.1:0`.
    pub async fn start(self) -> Result<LocalControlPlane> {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let cp = LocalControlPlane {
            addr,
            requests: Arc::new(Mutex::new(Vec::new())),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
        };
        let config = Arc::new(self);
        let requests = cp.requests.clone();
        let shutdown = cp.shutdown.clone();
        let tracker = cp.tracker.clone();
        cp.tracker.spawn(async move {
            loop {
                let tcp = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    r = listener.accept() => match r { Ok((tcp, _)) => tcp, Err(_) => continue },
                };
                let config = config.clone();
                let requests = requests.clone();
                let shutdown = shutdown.clone();
                tracker.spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let response = answer(&config, &requests, &req);
                            async move { Ok::<_, std::convert::Infallible>(response) }
                        },
                    );
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), service);
                    tokio::select! {
                        _ = shutdown.cancelled() => {}
                        _ = conn => {}
                    }
                });
            }
        });
        Ok(cp)
    }
}

fn answer(
    config: &LocalControlPlaneBuilder,
    requests: &Mutex<Vec<(String, Option<String>)>>,
    req: &http::Request<hyper::body::Incoming>,
) -> http::Response<Full<Bytes>> {
    let auth = req
        .headers()
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let path = req.uri().path().to_owned();
    lock(requests).push((path.clone(), auth.clone()));
    let respond = |status: u16, body: String| {
        let mut r = http::Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() =
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
    };
    if let Some(token) = &config.token
        && auth.as_deref() != Some(format!("Bearer {token}").as_str())
    {
        return respond(401, r#"{"error":"unauthorized"}"#.into());
    }
    let Some(encoded) = path.strip_prefix("/api/projects/tunnels/resolve/") else {
        return respond(404, r#"{"error":"not found"}"#.into());
    };
    let endpoint = percent_decode(encoded);
    if let Some(location) = config.redirects.get(&endpoint) {
        let mut r = respond(302, String::new());
        if let Ok(v) = http::HeaderValue::from_str(location) {
            r.headers_mut().insert(http::header::LOCATION, v);
        }
        return r;
    }
    match config.projects.get(&endpoint) {
        Some(project) => respond(200, project.to_string()),
        None => respond(404, r#"{"error":"project not found"}"#.into()),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl LocalControlPlane {
    /// A builder.
    pub fn builder() -> LocalControlPlaneBuilder {
        LocalControlPlaneBuilder::default()
    }

    /// The API URL (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received: path and `Authorization` header.
    pub fn requests(&self) -> Vec<(String, Option<String>)> {
        lock(&self.requests).clone()
    }

    /// Stops the server.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}
