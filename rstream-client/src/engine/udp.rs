//! The UDP ingress of published datagram tunnels: one inbound stream per UDP peer, datagrams framed
//! as records both ways.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{ConnGuard, EngineShared, request_leg};
use crate::datagram::DatagramStream;

/// How long a UDP peer of a datagram tunnel keeps its stream without a datagram either way.
pub const UDP_PEER_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Datagrams queued for a peer whose stream is still being set up (more are dropped, as UDP would).
const PEER_QUEUE: usize = 1024;

/// Binds the UDP ingress of `tunnel_id` on `127.0.0.1` and serves it until the returned token (or the
/// engine's shutdown) fires.
pub(super) async fn start_ingress(
    shared: &Arc<EngineShared>,
    tunnel_id: &str,
) -> std::io::Result<(SocketAddr, CancellationToken)> {
    let socket = Arc::new(UdpSocket::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?);
    let addr = socket.local_addr()?;
    let cancel = shared.shutdown.child_token();
    shared.tracker.spawn(ingress_loop(
        shared.clone(),
        tunnel_id.to_owned(),
        socket,
        cancel.clone(),
    ));
    Ok((addr, cancel))
}

async fn ingress_loop(
    shared: Arc<EngineShared>,
    tunnel_id: String,
    socket: Arc<UdpSocket>,
    cancel: CancellationToken,
) {
    let mut peers: HashMap<SocketAddr, mpsc::Sender<Bytes>> = HashMap::new();
    let mut buf = vec![0u8; crate::datagram::MAX_DATAGRAM_LEN];
    loop {
        let (n, peer) = tokio::select! {
            () = cancel.cancelled() => return,
            r = socket.recv_from(&mut buf) => match r {
                Ok(x) => x,
                // An ICMP error for an earlier answer: the peer went away.
                Err(e) => {
                    debug!(error = %e, "UDP ingress receive failed");
                    continue;
                }
            },
        };
        let datagram = Bytes::copy_from_slice(&buf[..n]);
        let tx = match peers.get(&peer) {
            Some(tx) if !tx.is_closed() => tx.clone(),
            _ => {
                peers.retain(|_, tx| !tx.is_closed());
                let (tx, rx) = mpsc::channel(PEER_QUEUE);
                shared.tracker.spawn(peer_stream(
                    shared.clone(),
                    tunnel_id.clone(),
                    socket.clone(),
                    peer,
                    rx,
                    cancel.clone(),
                ));
                peers.insert(peer, tx.clone());
                tx
            }
        };
        if tx.try_send(datagram).is_err() {
            debug!(%peer, "UDP ingress queue full; datagram dropped");
        }
    }
}

/// One peer: asks the owner for a stream, then relays records and datagrams until the stream ends,
/// the peer is idle, or the tunnel goes away.
async fn peer_stream(
    shared: Arc<EngineShared>,
    tunnel_id: String,
    socket: Arc<UdpSocket>,
    peer: SocketAddr,
    mut rx: mpsc::Receiver<Bytes>,
    cancel: CancellationToken,
) {
    let _guard = ConnGuard::new(&shared);
    let leg = tokio::select! {
        () = cancel.cancelled() => return,
        r = request_leg(&shared, &tunnel_id, peer) => match r {
            Ok((_, leg)) => leg,
            Err(e) => {
                debug!(error = ?e.message, "datagram ingress stream failed");
                return;
            }
        },
    };
    let mut stream = DatagramStream::new(leg.io);
    let idle = tokio::time::sleep(UDP_PEER_IDLE_TIMEOUT);
    tokio::pin!(idle);
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            () = &mut idle => break,
            datagram = rx.recv() => {
                let Some(datagram) = datagram else { break };
                idle.as_mut().reset(tokio::time::Instant::now() + UDP_PEER_IDLE_TIMEOUT);
                if stream.send(&datagram).await.is_err() {
                    break;
                }
            }
            record = stream.recv() => match record {
                Ok(Some(datagram)) => {
                    idle.as_mut().reset(tokio::time::Instant::now() + UDP_PEER_IDLE_TIMEOUT);
                    if let Err(e) = socket.send_to(&datagram, peer).await {
                        debug!(error = %e, %peer, "datagram not delivered to the UDP peer");
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    debug!(error = %e, "bad record from the tunnel owner");
                    break;
                }
            },
        }
    }
    let _ = stream.close().await;
}
