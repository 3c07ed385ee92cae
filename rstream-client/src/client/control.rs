//! The handles users hold: [`ControlChannel`], on which tunnels are created and closed, and
//! [`Tunnel`], whose inbound streams are accepted. Each can reach the other, so they live together.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use crate::frame::FrameReader;
use crate::proto;
use crate::proto::message::Payload;
use crate::resolve::EngineAddress;
use crate::stream::{ClientTls, PrefixedIo, RstreamStream};
use crate::tunnel::{TunnelOptions, forwarding_address};

use super::Client;
use super::shared::{Lifetime, Shared, State, close_tunnel, uuid_v4};
use super::tasks::{dispatcher_task, heartbeat_task, reader_task, writer_task};

/// An open control channel. Cloning is cheap; the channel closes when [`ControlChannel::close`] is called
/// or when the last clone and the last [`Tunnel`] are dropped.
#[derive(Clone)]
pub struct ControlChannel {
    pub(super) shared: Arc<Shared>,
    pub(super) life: Arc<Lifetime>,
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
    pub(super) fn start(
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
        let mut rx = self.shared.done.subscribe();
        let sent = self
            .shared
            .send(Payload::CloseControlChannelReq(proto::CloseControlChannelReq {}).into())
            .await;
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

/// A tunnel created on a [`ControlChannel`]: accept its inbound streams with [`Tunnel::accept`].
pub struct Tunnel {
    pub(super) shared: Arc<Shared>,
    pub(super) _life: Arc<Lifetime>,
    pub(super) id: String,
    pub(super) props: proto::TunnelProperties,
    pub(super) rx: mpsc::Receiver<RstreamStream>,
    pub(super) closed: CancellationToken,
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
            stream = self.rx.recv() => return stream.ok_or_else(|| self.close_reason()),
            _ = self.closed.cancelled() => {}
        }
        // Closed: the streams already on their way still come (their dials hold the queue's
        // other ends), unless the whole channel is gone.
        if self.shared.closed.is_cancelled() {
            return Err(self.close_reason());
        }
        self.rx.recv().await.ok_or_else(|| self.close_reason())
    }

    pub(super) fn close_reason(&self) -> Error {
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
