//! The control channel: the state shared by its handles and tasks, and [`ControlChannel`], on
//! which tunnels are created and closed.

use super::*;

/// Closes the control channel when the last user handle (channel or tunnel) is dropped.
#[derive(Debug)]
pub(super) struct Lifetime(pub(super) CancellationToken);

impl Drop for Lifetime {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

pub(super) type CreateResult = Result<(
    proto::TunnelProperties,
    mpsc::Receiver<RstreamStream>,
    CancellationToken,
)>;

pub(super) struct TunnelSlot {
    pub(super) tx: mpsc::Sender<RstreamStream>,
    pub(super) closed: CancellationToken,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pending_creates: HashMap<String, oneshot::Sender<CreateResult>>,
    pub(super) pending_closes: HashMap<String, Vec<oneshot::Sender<Result<()>>>>,
    pub(super) tunnels: HashMap<String, TunnelSlot>,
    pub(super) last_sent: u64,
    pub(super) last_ack: u64,
    pub(super) closing: bool,
    pub(super) finished: bool,
    pub(super) error: Option<Error>,
}

pub(super) struct Shared {
    pub(super) client: Client,
    pub(super) engine: EngineAddress,
    pub(super) out: mpsc::Sender<Message>,
    pub(super) state: Mutex<State>,
    /// The control channel is finished (all background tasks stop).
    pub(super) closed: CancellationToken,
    /// Streams already handed to forwarders must close too (explicit close, protocol error).
    pub(super) hard_close: CancellationToken,
    pub(super) done: watch::Sender<bool>,
    pub(super) client_id: String,
    pub(super) server_details: Option<proto::ServerDetails>,
    pub(super) liveness: Option<Duration>,
    pub(super) tracker: TaskTracker,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the state itself stays consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn finish(&self, error: Option<Error>) {
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
        // `send_replace`, not `send`: with no receiver subscribed yet, `send` would drop the value
        // and a later `close()` would wait for a reply that has already come.
        self.done.send_replace(true);
    }

    pub(super) fn close_error(&self) -> Error {
        self.lock().error.clone().unwrap_or(Error::ControlClosed)
    }

    pub(super) async fn send(&self, message: Message) -> Result<()> {
        if self.closed.is_cancelled() {
            return Err(self.close_error());
        }
        self.out.send(message).await.map_err(|_| self.close_error())
    }

    pub(super) async fn proxy_conn_rsp(&self, stream_id: String, error: Option<proto::Error>) {
        let _ = self
            .send(Payload::ProxyConnRsp(proto::ProxyConnRsp { stream_id, error }).into())
            .await;
    }
}

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

pub(super) async fn close_tunnel(shared: &Shared, tunnel_id: &str) -> Result<()> {
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
