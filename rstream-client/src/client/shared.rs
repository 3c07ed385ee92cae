//! The state a control channel's handles and background tasks share, and the operations on
//! it that both use.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::frame::FrameError;
use crate::proto::message::Payload;
use crate::proto::{self, Message};
use crate::resolve::EngineAddress;
use crate::stream::RstreamStream;

use super::Client;

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
            Some(e) => warn!(error = %crate::error::chain(e), "control channel failed"),
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

pub(super) fn uuid_v4() -> String {
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
