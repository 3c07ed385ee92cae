//! `LocalEngine`: an in-process rstream engine for tests, examples and demos (feature `engine`).
//!
//! It speaks protocol 1.4.5 over TLS (a fresh rcgen CA and a server certificate for `localhost`,
//! `127.0.0.1` and `::1`, ALPN `rstrm/1`) on a loopback port:
//!
//! * control channels with token checks, protocol-version checks, liveness negotiation and heartbeat
//!   acknowledgements; a client silent past the negotiated timeout is closed as dead, its tunnels
//!   with it ([`LocalEngine::silent_channels_closed`]); the accepted tokens can change at run time ([`LocalEngine::set_auth`]),
//!   which closes the control channels of a revoked token, and every login is recorded with its
//!   token and outcome ([`LocalEngine::control_logins`]);
//! * tunnels with IDs `tun_<n>`, validated with the client rules; duplicate stable hostnames are
//!   refused with "Hostname is already in use.";
//! * **published ingress**: every published tunnel (tcp, tls or http) gets its own plain TCP listener on
//!   `127.0.0.1` (a requested free TCP `port` is honoured). Each downstream connection becomes a
//!   `ProxyConnReq` to the owner and is spliced, raw bytes both ways. HTTP tunnels are not terminated:
//!   a test sends a plain HTTP request to [`LocalEngine::ingress_addr`]. The reply's `hostname` is
//!   `127.0.0.1` (or the requested stable hostname) and `port` the listener port. A requested
//!   hostname (without a `port`) has one listener for the engine's life, as an edge routes by name:
//!   the next tunnel holding that hostname is reached at the same address
//!   ([`LocalEngine::hostname_ingress_addr`]), and a connection arriving while no tunnel holds it is
//!   closed at once;
//! * **datagram tunnels** (`protocol: dtls`, `type: datagram`): a published one gets a UDP socket on
//!   `127.0.0.1` ([`LocalEngine::udp_ingress_addr`]). Each UDP peer (source address) becomes one
//!   inbound stream to the owner, carrying its datagrams as length-prefixed records
//!   ([`crate::datagram`]); records coming back are sent to that peer. A peer without traffic for
//!   [`UDP_PEER_IDLE_TIMEOUT`] is forgotten (its stream closed);
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
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio::time::timeout;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use crate::proto::{self, ErrorCode, Message, message::Payload};
use crate::stream::PrefixedIo;
use crate::tls::{self, TlsOptions};

mod control_plane;
mod faults;
mod pki;
mod server;
mod udp;

pub use control_plane::{LocalControlPlane, LocalControlPlaneBuilder, RecordedRequest};
pub use faults::Faults;
pub use pki::EngineIdentity;
use server::accept_loop;
pub use udp::UDP_PEER_IDLE_TIMEOUT;

const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_PROXY_TIMEOUT: Duration = Duration::from_secs(10);

fn other(e: impl std::fmt::Display) -> Error {
    Error::InvalidConfig(e.to_string())
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
    /// Any one of these tokens (none accepted when empty): a rotation accepts the old and the
    /// new one for a while, then only the new one.
    Tokens(Vec<String>),
    /// No token must be sent (mTLS or unauthenticated engines).
    NoToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EngineAuth {
    /// Whether a connection presenting `token` (`None`: no token) is let in.
    pub fn accepts(&self, token: Option<&str>) -> bool {
        match self {
            EngineAuth::AnyToken => true,
            EngineAuth::Token(expected) => token == Some(expected.as_str()),
            EngineAuth::Tokens(accepted) => token.is_some_and(|t| accepted.iter().any(|a| a == t)),
            EngineAuth::NoToken => token.is_none(),
        }
    }
}

/// One `OpenControlChannelReq` the engine answered: the token it carried and the outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ControlLogin {
    /// The client id the engine gave (`cli_<n>`), when it accepted the channel.
    pub client_id: Option<String>,
    /// The token sent (`None`: none).
    pub token: Option<String>,
    /// Whether the channel was opened; false when refused (token, version or an injected error).
    pub accepted: bool,
    /// Whether the channel is still open (always false for a refused one).
    pub open: bool,
}

#[derive(Clone, Debug)]
enum Command {
    DropControls,
    /// Close the control channels whose token the current policy refuses.
    DropRevoked,
    Raw(Bytes),
    ServerMessage(String),
    Flood {
        tunnel_id: String,
        count: usize,
    },
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
    /// The listener of each requested hostname (bytestream tunnels without a `port`).
    hostname_ingress: HashMap<String, SocketAddr>,
    pending: HashMap<String, PendingStream>,
    controls: HashMap<u64, ControlHandle>,
}

struct Config {
    liveness_timeout: Option<Duration>,
    proxy_timeout: Duration,
}

struct EngineShared {
    cfg: Config,
    auth: Mutex<EngineAuth>,
    logins: Mutex<Vec<ControlLogin>>,
    faults: Faults,
    state: Mutex<EState>,
    commands: broadcast::Sender<Command>,
    open_connections: AtomicUsize,
    heartbeats: AtomicU64,
    redirected_legs: AtomicU64,
    hostname_misses: AtomicU64,
    silent_channels_closed: AtomicU64,
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
        if lock(&self.auth).accepts(token) {
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
                liveness_timeout: self.liveness_timeout,
                proxy_timeout: self.proxy_timeout,
            },
            auth: Mutex::new(self.auth),
            logins: Mutex::new(Vec::new()),
            faults: Faults::default(),
            state: Mutex::new(EState::default()),
            commands,
            open_connections: AtomicUsize::new(0),
            heartbeats: AtomicU64::new(0),
            redirected_legs: AtomicU64::new(0),
            hostname_misses: AtomicU64::new(0),
            silent_channels_closed: AtomicU64::new(0),
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

    /// The published TCP ingress address of a bytestream tunnel.
    pub fn ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        self.ingress(tunnel_id, false)
    }

    /// The listener of a requested stable `hostname`: stays the same address whichever tunnel holds
    /// the hostname (`None` before a tunnel first asked for it).
    pub fn hostname_ingress_addr(&self, hostname: &str) -> Option<SocketAddr> {
        self.shared.state().hostname_ingress.get(hostname).copied()
    }

    /// The published UDP ingress address of a datagram tunnel.
    pub fn udp_ingress_addr(&self, tunnel_id: &str) -> Option<SocketAddr> {
        self.ingress(tunnel_id, true)
    }

    fn ingress(&self, tunnel_id: &str, datagram: bool) -> Option<SocketAddr> {
        self.shared
            .state()
            .tunnels
            .get(tunnel_id)
            .filter(|t| (t.props.r#type.as_deref() == Some("datagram")) == datagram)
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

    /// Connections to a hostname's ingress closed because no tunnel held the hostname then (the
    /// gap of a hand-over between agents, as an edge would see it).
    pub fn hostname_misses(&self) -> u64 {
        self.shared.hostname_misses.load(Ordering::SeqCst)
    }

    /// Control channels the engine closed because their client stayed silent past the
    /// negotiated liveness timeout (a client whose node or network died).
    pub fn silent_channels_closed(&self) -> u64 {
        self.shared.silent_channels_closed.load(Ordering::SeqCst)
    }

    /// `ProxyConnRsp` messages received, in order.
    pub fn proxy_conn_rsps(&self) -> Vec<proto::ProxyConnRsp> {
        lock(&self.shared.proxy_conn_rsps).clone()
    }

    /// `ClientDetails` of every control channel, private dial and proxy leg, in order.
    pub fn client_details(&self) -> Vec<proto::ClientDetails> {
        lock(&self.shared.client_details).clone()
    }

    /// Replaces the authentication policy at run time: later logins and private dials are checked
    /// against it, and every open control channel whose token it refuses is closed abruptly (its
    /// tunnels go with it; streams already relayed stay up). Revoking a rotated-out token:
    /// `set_auth(EngineAuth::Tokens(vec![new]))`.
    pub fn set_auth(&self, auth: EngineAuth) {
        *lock(&self.shared.auth) = auth;
        let _ = self.shared.commands.send(Command::DropRevoked);
    }

    /// The current authentication policy.
    pub fn auth(&self) -> EngineAuth {
        lock(&self.shared.auth).clone()
    }

    /// Every control-channel login, in order: its token, whether it was accepted, whether it is
    /// still open.
    pub fn control_logins(&self) -> Vec<ControlLogin> {
        lock(&self.shared.logins).clone()
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
// Shared by the TCP ingress (`server`) and the UDP ingress (`udp`), so neither uses the other
// for it.

/// Where a stream goes: a tunnel, or whichever tunnel holds a hostname when it is routed.
#[derive(Clone, Copy)]
enum Route<'a> {
    Tunnel(&'a str),
    Hostname(&'a str),
}

/// Registers a pending stream, sends `ProxyConnReq` to the owner and waits for the proxy leg.
async fn request_leg(
    shared: &Arc<EngineShared>,
    tunnel_id: &str,
    source: SocketAddr,
) -> std::result::Result<(String, ProxyLeg), proto::Error> {
    request_leg_to(shared, Route::Tunnel(tunnel_id), source).await
}

/// [`request_leg`] to whichever tunnel holds `hostname` now: found and registered under one lock,
/// so a hand-over between tunnels never strands the stream between the two.
async fn request_hostname_leg(
    shared: &Arc<EngineShared>,
    hostname: &str,
    source: SocketAddr,
) -> std::result::Result<(String, ProxyLeg), proto::Error> {
    request_leg_to(shared, Route::Hostname(hostname), source).await
}

async fn request_leg_to(
    shared: &Arc<EngineShared>,
    route: Route<'_>,
    source: SocketAddr,
) -> std::result::Result<(String, ProxyLeg), proto::Error> {
    let stream_id = random_hex(16);
    let secret = random_hex(16);
    let (leg_tx, leg_rx) = oneshot::channel();
    let (tunnel_id, owner_tx) = {
        let mut st = shared.state();
        let found = match route {
            Route::Tunnel(id) => st.tunnels.get(id).map(|t| (id.to_owned(), t.owner)),
            Route::Hostname(hostname) => (st.tunnels.iter())
                .find(|(_, t)| t.props.hostname.as_deref() == Some(hostname))
                .map(|(id, t)| (id.clone(), t.owner)),
        };
        let Some((tunnel_id, owner)) = found else {
            if let Route::Hostname(_) = route {
                shared.hostname_misses.fetch_add(1, Ordering::SeqCst);
            }
            return Err(proto::Error::new(
                ErrorCode::TunnelNotFound,
                "Tunnel not found.",
            ));
        };
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
        (tunnel_id, tx)
    };
    let req = proto::ProxyConnReq {
        tunnel_id,
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

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}
