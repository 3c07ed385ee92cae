//! The control channel's background tasks: writer, reader and message handling, heartbeats, and
//! the dispatcher that opens inbound streams.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::{Error, Result};
use crate::frame::{FrameError, FrameReader, write_frame};
use crate::proto::message::Payload;
use crate::proto::{self, Message};
use crate::resolve::EngineAddress;
use crate::stream::{ClientTls, PrefixedIo, RstreamStream};

use super::DELIVERY_TIMEOUT;
use super::shared::{CreateResult, Shared, TunnelSlot};

pub(super) type ControlIo = PrefixedIo<ClientTls>;

pub(super) async fn writer_task(
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

pub(super) async fn reader_task(
    shared: Arc<Shared>,
    mut reader: FrameReader<ReadHalf<ControlIo>>,
    proxy_tx: mpsc::Sender<Inbound>,
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

pub(super) async fn handle_message(
    shared: &Arc<Shared>,
    message: Message,
    proxy_tx: &mpsc::Sender<Inbound>,
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

pub(super) async fn handle_open_tunnel_rsp(
    shared: &Arc<Shared>,
    rsp: proto::OpenTunnelRsp,
) -> Result<()> {
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

pub(super) async fn handle_proxy_conn_req(
    shared: &Arc<Shared>,
    req: proto::ProxyConnReq,
    proxy_tx: &mpsc::Sender<Inbound>,
) {
    if req.stream_id.is_empty() {
        warn!(tunnel_id = %req.tunnel_id, "ignoring a proxy connection request without stream ID");
        return;
    }
    // The tunnel's queue as of this request: a stream the engine sent before closing the tunnel
    // still reaches it, even when its dial ends after the close.
    let queue = shared
        .lock()
        .tunnels
        .get(&req.tunnel_id)
        .map(|slot| slot.tx.clone());
    let known = queue.is_some();
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
        let Some(queue) = queue else { return };
        match proxy_tx.try_send((req, queue)) {
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

pub(super) async fn heartbeat_task(shared: Arc<Shared>, interval: Duration) {
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

pub(super) async fn dispatcher_task(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Inbound>,
    slots: Arc<Semaphore>,
) {
    loop {
        let req = tokio::select! {
            biased;
            _ = shared.closed.cancelled() => return,
            r = rx.recv() => match r { Some(r) => r, None => return },
        };
        let (req, queue) = req;
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
                r = open_proxy_stream(&task_shared, req, queue) => r,
            };
            let error = outcome.err().map(|e| {
                let e = crate::error::chain(&e);
                debug!(%stream_id, error = %e, "inbound stream failed");
                proto::Error::new(proto::ErrorCode::InvalidStream, e)
            });
            task_shared.proxy_conn_rsp(stream_id, error).await;
        });
    }
}

/// A `ProxyConnReq` and the queue of the tunnel it names.
pub(super) type Inbound = (proto::ProxyConnReq, mpsc::Sender<RstreamStream>);

pub(super) async fn open_proxy_stream(
    shared: &Arc<Shared>,
    req: proto::ProxyConnReq,
    tx: mpsc::Sender<RstreamStream>,
) -> Result<()> {
    let client = &shared.client;
    let (target, allow_override) = match req.proxy_endpoint.as_deref() {
        Some(ep) => {
            let addr = EngineAddress::parse(ep)?;
            let same = addr == shared.engine;
            (addr, same)
        }
        None => (shared.engine.clone(), true),
    };
    // As the Go SDK: a dial that timed out is tried once more; other failures are final.
    let tls = match client.connect_tls(&target, allow_override).await {
        Err(e) if e.is_timeout() => {
            debug!(stream_id = %req.stream_id, error = %e, "proxy dial timed out; retrying once");
            client.connect_tls(&target, allow_override).await?
        }
        other => other?,
    };
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
