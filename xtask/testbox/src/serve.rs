//! `serve`: an HTTP server that says which pod answered, a TCP echo and a UDP echo.

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use anyhow::Context as _;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt as _;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::signal::unix::{SignalKind, signal};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Address to listen on [default: every IPv6 and IPv4 address, or every IPv4 address where
    /// IPv6 is off].
    #[arg(long, env = "TESTBOX_BIND")]
    pub bind: Option<IpAddr>,
    /// HTTP port (0: any free port).
    #[arg(long, env = "TESTBOX_HTTP_PORT", default_value_t = 8080)]
    pub http_port: u16,
    /// TCP echo port (0: any free port).
    #[arg(long, env = "TESTBOX_TCP_ECHO_PORT", default_value_t = 9000)]
    pub tcp_echo_port: u16,
    /// UDP echo port (0: any free port).
    #[arg(long, env = "TESTBOX_UDP_ECHO_PORT", default_value_t = 9001)]
    pub udp_echo_port: u16,
}

/// What GET / reports, read once from the environment the kubelet gives the container.
struct Identity {
    pod: String,
    namespace: Option<String>,
    ip: Option<String>,
}

impl Identity {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        // The kubelet sets HOSTNAME to the pod name; POD_NAME (downward API) wins when given.
        let pod = var("POD_NAME")
            .or_else(|| var("HOSTNAME"))
            .or_else(|| {
                std::fs::read_to_string("/etc/hostname")
                    .ok()
                    .map(|h| h.trim().to_owned())
            })
            .unwrap_or_default();
        Self {
            pod,
            namespace: var("POD_NAMESPACE"),
            ip: var("POD_IP"),
        }
    }
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // As PID 1 of its container, a process that does not handle SIGTERM ignores it and is only
    // killed when the grace period ends. Installed before the listening line, so a caller that
    // saw the line can stop us.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let http = bind_tcp(args.bind, args.http_port).await?;
    let tcp_echo = bind_tcp(args.bind, args.tcp_echo_port).await?;
    let udp_echo = bind_udp(args.bind, args.udp_echo_port).await?;
    println!(
        "listening http={} tcp-echo={} udp-echo={}",
        http.local_addr()?,
        tcp_echo.local_addr()?,
        udp_echo.local_addr()?
    );
    let identity = Arc::new(Identity::from_env());
    tokio::select! {
        result = serve_http(http, identity) => result,
        result = serve_tcp_echo(tcp_echo) => result,
        result = serve_udp_echo(udp_echo) => result,
        _ = terminate.recv() => { eprintln!("SIGTERM: exiting"); Ok(()) }
        _ = interrupt.recv() => { eprintln!("SIGINT: exiting"); Ok(()) }
    }
}

/// `[::]` takes IPv4 too (as mapped addresses); a pod without IPv6 gets `0.0.0.0` instead.
async fn bind_tcp(bind: Option<IpAddr>, port: u16) -> anyhow::Result<TcpListener> {
    if let Some(ip) = bind {
        return TcpListener::bind((ip, port))
            .await
            .with_context(|| format!("binding TCP {}", SocketAddr::new(ip, port)));
    }
    match TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)).await {
        Ok(listener) => Ok(listener),
        Err(_) => TcpListener::bind((Ipv4Addr::UNSPECIFIED, port))
            .await
            .with_context(|| format!("binding TCP port {port}")),
    }
}

async fn bind_udp(bind: Option<IpAddr>, port: u16) -> anyhow::Result<UdpSocket> {
    if let Some(ip) = bind {
        return UdpSocket::bind((ip, port))
            .await
            .with_context(|| format!("binding UDP {}", SocketAddr::new(ip, port)));
    }
    match UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)).await {
        Ok(socket) => Ok(socket),
        Err(_) => UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))
            .await
            .with_context(|| format!("binding UDP port {port}")),
    }
}

async fn serve_http(listener: TcpListener, identity: Arc<Identity>) -> anyhow::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await.context("accepting HTTP")?;
        let identity = identity.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let identity = identity.clone();
                async move { Ok::<_, Infallible>(respond(&request, peer, &identity)) }
            });
            if let Err(error) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                eprintln!("http {peer}: {error}");
            }
        });
    }
}

fn respond(
    request: &Request<Incoming>,
    peer: SocketAddr,
    identity: &Identity,
) -> Response<Full<Bytes>> {
    let client = SocketAddr::new(peer.ip().to_canonical(), peer.port());
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/") => {
            let body = serde_json::json!({
                "pod": identity.pod,
                "namespace": identity.namespace,
                "ip": identity.ip,
                // Where the request came from as this pod sees it: proves or disproves source NAT.
                "client": client.to_string(),
            });
            (StatusCode::OK, "application/json", format!("{body}\n"))
        }
        (&Method::GET, "/healthz") => (StatusCode::OK, "text/plain", "ok\n".to_owned()),
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".to_owned(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "method not allowed\n".to_owned(),
        ),
    };
    eprintln!(
        "http {client} {} {} -> {}",
        request.method(),
        request.uri().path(),
        status.as_u16()
    );
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    response
}

async fn serve_tcp_echo(listener: TcpListener) -> anyhow::Result<()> {
    loop {
        let (stream, peer) = listener.accept().await.context("accepting TCP echo")?;
        tokio::spawn(async move {
            match echo(stream).await {
                Ok(bytes) => eprintln!("tcp-echo {peer}: {bytes} bytes"),
                Err(error) => eprintln!("tcp-echo {peer}: {error}"),
            }
        });
    }
}

/// Echoes until the client's FIN, then sends ours: a client that half-closes still gets every
/// byte back.
async fn echo(mut stream: TcpStream) -> std::io::Result<u64> {
    let (mut reader, mut writer) = stream.split();
    let bytes = tokio::io::copy(&mut reader, &mut writer).await?;
    writer.shutdown().await?;
    Ok(bytes)
}

async fn serve_udp_echo(socket: UdpSocket) -> anyhow::Result<()> {
    let mut buffer = vec![0u8; 65536];
    loop {
        let (len, peer) = socket
            .recv_from(&mut buffer)
            .await
            .context("receiving UDP")?;
        // A failed reply (say, the peer is gone) must not stop the echo for everyone else.
        if let Err(error) = socket.send_to(&buffer[..len], peer).await {
            eprintln!("udp-echo {peer}: {error}");
        }
    }
}
