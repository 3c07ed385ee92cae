//! The client commands: `get`, `resolve`, `tcp-check` and `udp-check`.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpStream, UdpSocket};

/// A connection, plain or TLS.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

/// TLS over `stream`, the server's certificate verified for `host` against `ca_file` only.
async fn tls_connect(
    stream: TcpStream,
    host: &str,
    ca_file: &std::path::Path,
) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    use rustls::pki_types::pem::PemObject as _;
    let pem = std::fs::read(ca_file).with_context(|| format!("reading {}", ca_file.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots
            .add(cert.with_context(|| format!("{} is not PEM", ca_file.display()))?)
            .with_context(|| format!("{}: not a usable CA", ca_file.display()))?;
    }
    if roots.is_empty() {
        bail!("{} holds no certificate", ca_file.display());
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .with_context(|| format!("{host:?} is not a server name"))?;
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, stream)
        .await
        .with_context(|| format!("TLS handshake with {host}"))
}

#[derive(clap::Args, Debug)]
pub struct GetArgs {
    /// An http:// or https:// URL.
    pub url: String,
    /// For https://: the CA (PEM) the server's certificate must chain to [required for https].
    #[arg(long)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Succeed only on this status [default: any 2xx].
    #[arg(long)]
    pub expect_status: Option<u16>,
    /// Give up on an attempt after this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub timeout_seconds: f64,
    /// Try again, a second apart, while this many seconds have not passed since the first
    /// attempt: a readiness check through a Service whose endpoints may still be on their way
    /// to kube-proxy [default: one attempt].
    #[arg(long, default_value_t = 0.0)]
    pub retry_for_seconds: f64,
}

pub async fn get(args: GetArgs) -> anyhow::Result<()> {
    let timeout = seconds(args.timeout_seconds)?;
    let retry_for = seconds(args.retry_for_seconds)?;
    let started = Instant::now();
    let mut attempts = 1u32;
    loop {
        let fetched = tokio::time::timeout(timeout, fetch(&args.url, args.ca_file.as_deref()))
            .await
            .with_context(|| format!("GET {} timed out after {timeout:?}", args.url))
            .and_then(|fetched| fetched);
        let (verdict, answer) = match fetched {
            Ok((status, body)) => (judge(&args, status), Some((status, body))),
            Err(error) => (Err(error), None),
        };
        if let Err(error) = &verdict
            && started.elapsed() < retry_for
        {
            eprintln!("attempt {attempts}: {error:#}; trying again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            attempts += 1;
            continue;
        }
        // The last answer's body, a failed one's too (a /readyz says which check failed).
        if let Some((status, body)) = answer {
            std::io::stdout().write_all(&body)?;
            eprintln!("GET {} -> {status}", args.url);
        }
        return match verdict {
            Err(error) if attempts > 1 => Err(error.context(format!(
                "{attempts} attempts in {:.1} s",
                started.elapsed().as_secs_f64()
            ))),
            verdict => verdict,
        };
    }
}

/// Whether `status` is the one asked for (any 2xx when none was).
fn judge(args: &GetArgs, status: hyper::StatusCode) -> anyhow::Result<()> {
    match args.expect_status {
        Some(expected) if status.as_u16() != expected => {
            bail!("GET {}: status {status}, expected {expected}", args.url)
        }
        None if !status.is_success() => bail!("GET {}: status {status}", args.url),
        _ => Ok(()),
    }
}

async fn fetch(
    url: &str,
    ca_file: Option<&std::path::Path>,
) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
    let uri: hyper::Uri = url
        .parse()
        .with_context(|| format!("{url:?} is not a URL"))?;
    let tls = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => bail!("{url}: only http:// and https:// URLs are supported"),
    };
    let authority = uri
        .authority()
        .with_context(|| format!("{url} has no host"))?
        .clone();
    // An IPv6 literal comes bracketed ("[::1]"); connect() wants the bare address.
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let stream = TcpStream::connect((host, port))
        .await
        .with_context(|| format!("connecting to {authority}"))?;
    let stream: Box<dyn Io> = if tls {
        let ca_file = ca_file.context("an https:// URL needs --ca-file")?;
        Box::new(tls_connect(stream, host, ca_file).await?)
    } else {
        Box::new(stream)
    };
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP handshake")?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            eprintln!("HTTP connection: {error}");
        }
    });
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, authority.as_str())
        .body(Empty::<Bytes>::new())?;
    let response = sender
        .send_request(request)
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .context("reading the body")?
        .to_bytes();
    Ok((status, body))
}

#[derive(clap::Args, Debug)]
pub struct ResolveArgs {
    /// A host name (or address).
    pub name: String,
}

pub async fn resolve(args: ResolveArgs) -> anyhow::Result<()> {
    let addresses = tokio::net::lookup_host((args.name.as_str(), 0))
        .await
        .with_context(|| format!("resolving {}", args.name))?;
    let mut seen: Vec<IpAddr> = Vec::new();
    for address in addresses {
        if !seen.contains(&address.ip()) {
            seen.push(address.ip());
            println!("{}", address.ip());
        }
    }
    if seen.is_empty() {
        bail!("{} resolves to no address", args.name);
    }
    eprintln!("{} -> {} addresses", args.name, seen.len());
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct TcpCheckArgs {
    /// The echo server, HOST:PORT.
    pub target: String,
    /// How many bytes to send.
    #[arg(long, default_value_t = 1 << 20)]
    pub bytes: u64,
    /// Seed of the pseudo-random bytes [default: from the clock].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 30.0)]
    pub timeout_seconds: f64,
}

pub async fn tcp_check(args: TcpCheckArgs) -> anyhow::Result<()> {
    let timeout = seconds(args.timeout_seconds)?;
    let seed = args.seed.unwrap_or_else(clock_seed);
    let started = Instant::now();
    let received = tokio::time::timeout(timeout, exchange(&args.target, args.bytes, seed))
        .await
        .with_context(|| format!("tcp-check {} timed out after {timeout:?}", args.target))??;
    let millis = started.elapsed().as_secs_f64() * 1000.0;
    let result = match received {
        Exchanged::Same => "ok",
        Exchanged::Differs { .. } | Exchanged::Short(_) => "mismatch",
    };
    println!(
        "tcp-check target={} bytes={} duration_ms={millis:.3} result={result}",
        args.target, args.bytes
    );
    match received {
        Exchanged::Same => Ok(()),
        Exchanged::Differs { offset } => {
            bail!("the echo differs from what was sent at byte {offset}")
        }
        Exchanged::Short(got) => bail!("{got} bytes came back of {} sent", args.bytes),
    }
}

enum Exchanged {
    Same,
    Differs { offset: u64 },
    Short(u64),
}

/// Writes and reads at once: an echo server only sends back as fast as we read, so writing
/// everything first would deadlock once the socket buffers fill.
async fn exchange(target: &str, bytes: u64, seed: u64) -> anyhow::Result<Exchanged> {
    let mut stream = TcpStream::connect(target)
        .await
        .with_context(|| format!("connecting to {target}"))?;
    eprintln!(
        "tcp-check: connected {} -> {}",
        stream.local_addr()?,
        stream.peer_addr()?
    );
    let (mut reader, mut writer) = stream.split();
    let send = async {
        let mut source = Pseudorandom::new(seed);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut left = bytes;
        while left > 0 {
            let n = usize::try_from(left).unwrap_or(usize::MAX).min(chunk.len());
            source.fill(&mut chunk[..n]);
            writer.write_all(&chunk[..n]).await?;
            left -= n as u64;
        }
        // Half-close: the server sees EOF, echoes the rest and closes its side.
        writer.shutdown().await?;
        anyhow::Ok(())
    };
    let receive = async {
        let mut expected = Pseudorandom::new(seed);
        let mut buffer = vec![0u8; 64 * 1024];
        let mut want = vec![0u8; 64 * 1024];
        let mut total = 0u64;
        let mut differs = None;
        loop {
            let n = reader.read(&mut buffer).await?;
            if n == 0 {
                break;
            }
            if differs.is_none() {
                // Past what was sent nothing can match; count it so the total shows it.
                let compared = usize::try_from(bytes.saturating_sub(total))
                    .unwrap_or(usize::MAX)
                    .min(n);
                expected.fill(&mut want[..compared]);
                if let Some(i) = (0..compared).find(|&i| buffer[i] != want[i]) {
                    differs = Some(total + i as u64);
                } else if compared < n {
                    differs = Some(total + compared as u64);
                }
            }
            total += n as u64;
        }
        anyhow::Ok((total, differs))
    };
    let ((), (total, differs)) = tokio::try_join!(send, receive)?;
    Ok(match differs {
        Some(offset) => Exchanged::Differs { offset },
        None if total < bytes => Exchanged::Short(total),
        None => Exchanged::Same,
    })
}

#[derive(clap::Args, Debug)]
pub struct UdpCheckArgs {
    /// The echo server, HOST:PORT.
    pub target: String,
    /// How many datagrams to exchange, one after the other.
    #[arg(long, default_value_t = 3)]
    pub count: u32,
    /// Payload bytes per datagram.
    #[arg(long, default_value_t = 512)]
    pub size: usize,
    /// Seconds to wait for each echo before sending the datagram again.
    #[arg(long, default_value_t = 1.0)]
    pub wait_seconds: f64,
    /// Sends of one datagram before giving up (UDP may drop).
    #[arg(long, default_value_t = 5)]
    pub attempts: u32,
}

pub async fn udp_check(args: UdpCheckArgs) -> anyhow::Result<()> {
    let wait = seconds(args.wait_seconds)?;
    let target = tokio::net::lookup_host(args.target.as_str())
        .await
        .with_context(|| format!("resolving {}", args.target))?
        .next()
        .with_context(|| format!("{} resolves to no address", args.target))?;
    let local: SocketAddr = match target {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await.context("binding UDP")?;
    // Connected: only the target's datagrams are received (and ICMP errors are reported).
    socket.connect(target).await?;
    let mut source = Pseudorandom::new(clock_seed());
    let mut payload = vec![0u8; args.size];
    let mut buffer = vec![0u8; args.size.max(1) + 1];
    let started = Instant::now();
    for datagram in 0..args.count {
        source.fill(&mut payload);
        let mut echoed = false;
        for attempt in 1..=args.attempts {
            socket.send(&payload).await.context("sending UDP")?;
            match tokio::time::timeout(wait, receive_echo(&socket, &payload, &mut buffer)).await {
                Ok(Ok(())) => {
                    echoed = true;
                    break;
                }
                Ok(Err(error)) => return Err(error),
                Err(_) => eprintln!("udp-check: datagram {datagram}, attempt {attempt}: no echo"),
            }
        }
        if !echoed {
            bail!(
                "udp-check {}: datagram {datagram} not echoed after {} attempts",
                args.target,
                args.attempts
            );
        }
    }
    println!(
        "udp-check target={} datagrams={} duration_ms={:.3} result=ok",
        args.target,
        args.count,
        started.elapsed().as_secs_f64() * 1000.0
    );
    Ok(())
}

/// Waits for the echo of `payload`, skipping late echoes of earlier datagrams.
async fn receive_echo(socket: &UdpSocket, payload: &[u8], buffer: &mut [u8]) -> anyhow::Result<()> {
    loop {
        let n = socket.recv(buffer).await.context("receiving UDP")?;
        if &buffer[..n] == payload {
            return Ok(());
        }
        eprintln!("udp-check: ignoring a {n}-byte datagram that is not the echo");
    }
}

fn seconds(value: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .with_context(|| format!("{value} is not a duration in seconds"))
}

fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// xorshift64* as a byte stream: plenty for test data that must not be all zeros or repeat short
/// patterns. The bytes do not depend on how the stream is cut into `fill` calls, so sender and
/// checker agree whatever sizes the socket reads return.
struct Pseudorandom {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl Pseudorandom {
    fn new(seed: u64) -> Self {
        Self {
            // Zero is xorshift's one fixed point.
            state: if seed == 0 {
                0x9e37_79b9_7f4a_7c15
            } else {
                seed
            },
            word: [0; 8],
            used: 8,
        }
    }

    fn fill(&mut self, out: &mut [u8]) {
        for byte in out {
            if self.used == 8 {
                self.state ^= self.state >> 12;
                self.state ^= self.state << 25;
                self.state ^= self.state >> 27;
                self.word = self.state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
                self.used = 0;
            }
            *byte = self.word[self.used];
            self.used += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pseudorandom;

    #[test]
    fn pseudorandom_bytes_do_not_depend_on_the_chunking() {
        let mut whole = vec![0u8; 1000];
        Pseudorandom::new(7).fill(&mut whole);
        let mut pieces = vec![0u8; 1000];
        let mut source = Pseudorandom::new(7);
        let mut at = 0;
        for len in [1, 3, 8, 13, 500, 475] {
            source.fill(&mut pieces[at..at + len]);
            at += len;
        }
        assert_eq!(whole, pieces);
        assert!(whole.iter().filter(|&&b| b == 0).count() < 20);
    }
}
