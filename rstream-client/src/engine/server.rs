//! The engine side of the protocol: control channels, tunnels, published ingress, private dials
//! and the data legs that join them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWriteExt, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc};
use tokio::time::timeout;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::error::{Error, HOSTNAME_IN_USE, Result};
use crate::frame::FrameReader;
use crate::proto::message::Payload;
use crate::proto::{ErrorCode, Message};
use crate::stream::PrefixedIo;
use crate::{frame, proto, tls};

use super::{
    Command, ConnGuard, ControlHandle, ControlLogin, EngineShared, EngineTunnel,
    FIRST_FRAME_TIMEOUT, Out, ProxyLeg, bind_reuse, lock, random_hex, request_hostname_leg,
    request_leg,
};

pub(super) async fn accept_loop(
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

pub(super) async fn serve_connection(
    shared: &Arc<EngineShared>,
    tcp: TcpStream,
    peer: SocketAddr,
    acceptor: tokio_rustls::TlsAcceptor,
    redirect: bool,
) {
    let hang = shared.faults.hang_next_tls_handshakes.fetch_update(
        Ordering::SeqCst,
        Ordering::SeqCst,
        |n| n.checked_sub(1),
    );
    if hang.is_ok() {
        tokio::time::sleep(FIRST_FRAME_TIMEOUT).await;
        drop(tcp);
        return;
    }
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

pub(super) fn check_version(
    details: Option<&proto::ClientDetails>,
) -> std::result::Result<(), proto::Error> {
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

pub(super) async fn write_msg(
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

pub(super) async fn control_connection(
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
    let token = req.client_details.as_ref().and_then(|d| d.token.clone());
    if let Some(error) = refuse {
        lock(&shared.logins).push(ControlLogin {
            client_id: None,
            token,
            accepted: false,
            open: false,
        });
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
    // The negotiated timeout binds the engine too: a client silent that long is dead (a lost
    // node leaves its connection open, and its tunnels would otherwise be held forever).
    let silence_limit = liveness
        .as_ref()
        .map(|l| Duration::from_millis(u64::from(l.heartbeat_timeout_ms)));
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
    let client_id = format!("cli_{conn_id}");
    let login = {
        let mut logins = lock(&shared.logins);
        logins.push(ControlLogin {
            client_id: Some(client_id.clone()),
            token: token.clone(),
            accepted: true,
            open: true,
        });
        logins.len() - 1
    };
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
    let mut last_heard = tokio::time::Instant::now();
    loop {
        let stalled = shared.faults.stall_control.load(Ordering::SeqCst);
        if stalled {
            // Not reading is the engine's choice, not the client's silence.
            last_heard = tokio::time::Instant::now();
        }
        if let Some(limit) = silence_limit
            && last_heard.elapsed() > limit
        {
            debug!(%client_id, ?limit, "closing a control channel silent past its liveness timeout");
            shared.silent_channels_closed.fetch_add(1, Ordering::SeqCst);
            break;
        }
        tokio::select! {
            _ = shared.shutdown.cancelled() => break,
            _ = tick.tick() => continue,
            cmd = commands.recv() => match cmd {
                Ok(Command::DropControls) => break,
                Ok(Command::DropRevoked) => {
                    if !lock(&shared.auth).accepts(token.as_deref()) {
                        debug!(%client_id, "closing a control channel whose token was revoked");
                        break;
                    }
                }
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
                    last_heard = tokio::time::Instant::now();
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
    if let Some(l) = lock(&shared.logins).get_mut(login) {
        l.open = false;
    }
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

pub(super) async fn control_writer(
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

/// Returns true when the channel must close gracefully.
pub(super) async fn handle_control_frame(
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

pub(super) async fn open_tunnel(
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
    let datagram = kind == "datagram";
    if !datagram && kind != "bytestream" {
        return Err(invalid(format!("Unknown tunnel type '{kind}'.")));
    }
    if let Some(p) = props.protocol.as_deref()
        && !matches!(p, "http" | "tls" | "tcp" | "dtls")
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
    if published && datagram {
        let (addr, cancel) = super::udp::start_ingress(shared, &id)
            .await
            .map_err(|e| invalid(format!("No UDP ingress: {e}")))?;
        if props.hostname.is_none() {
            props.hostname = Some("127.0.0.1".into());
        }
        props.port = Some(u32::from(addr.port()));
        ingress = Some((addr, cancel));
    } else if published && props.port.is_none() && props.hostname.is_some() {
        let hostname = props.hostname.clone().unwrap_or_default();
        let addr = hostname_ingress(shared, &hostname)?;
        props.port = Some(u32::from(addr.port()));
        // Closing the tunnel cancels this token only: the hostname's listener stays.
        ingress = Some((addr, CancellationToken::new()));
    } else if published {
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

/// The listener of `hostname`, started on its first tunnel and kept for the engine's life.
fn hostname_ingress(
    shared: &Arc<EngineShared>,
    hostname: &str,
) -> std::result::Result<SocketAddr, proto::Error> {
    let invalid = |m: String| proto::Error::new(ErrorCode::InvalidRequest, m);
    if let Some(addr) = shared.state().hostname_ingress.get(hostname) {
        return Ok(*addr);
    }
    let listener = bind_reuse(SocketAddr::from(([127, 0, 0, 1], 0)))
        .map_err(|e| invalid(format!("No ingress for {hostname}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| invalid(e.to_string()))?;
    shared
        .state()
        .hostname_ingress
        .insert(hostname.to_owned(), addr);
    shared.tracker.spawn(hostname_ingress_loop(
        shared.clone(),
        hostname.to_owned(),
        listener,
    ));
    Ok(addr)
}

/// Routes each connection to the tunnel holding `hostname` when it is routed (right after it
/// arrives); none: closed. Nothing is queued or retried: a connection that arrives while no
/// tunnel holds the hostname fails, as it would at an edge.
async fn hostname_ingress_loop(shared: Arc<EngineShared>, hostname: String, listener: TcpListener) {
    loop {
        let (mut tcp, peer) = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            r = listener.accept() => match r { Ok(x) => x, Err(_) => continue },
        };
        let task_shared = shared.clone();
        let hostname = hostname.clone();
        shared.tracker.spawn(async move {
            let _guard = ConnGuard::new(&task_shared);
            let cancel = task_shared.shutdown.clone();
            let _ = tcp.set_nodelay(true);
            let relayed = async {
                match request_hostname_leg(&task_shared, &hostname, peer).await {
                    Ok((_, mut leg)) => {
                        let _ = crate::forward::relay(&mut tcp, &mut leg.io).await;
                    }
                    Err(e) => debug!(%hostname, error = ?e.message, "no stream to a holder of the hostname; connection closed"),
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => {}
                () = relayed => {}
            }
        });
    }
}

pub(super) async fn ingress_loop(
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

pub(super) async fn ingress_connection(
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

pub(super) async fn private_dial(
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

pub(super) async fn proxy_leg(
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
