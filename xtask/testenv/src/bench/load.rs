//! The load generator and its sink, shared by every bench.
//!
//! The sink serves a one-byte command at the start of each connection, so one upstream port serves
//! every workload through a relay that knows nothing about it:
//!
//! * `U`: upload: read to EOF, answer the byte count (u64, big endian), close;
//! * `D` + u64 length: download: send that many bytes, close the write side, read to EOF;
//! * `E`: echo until EOF (latency, idle connections);
//! * `P`: ping: answer one byte and close at once (connection rate, stream setup). The sink closes
//!   first, so the TIME_WAIT state lands on the sink's side and never uses up the relay's
//!   ephemeral ports towards the sink.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use hdrhistogram::Histogram;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;

const UPLOAD: u8 = b'U';
const DOWNLOAD: u8 = b'D';
const ECHO: u8 = b'E';
const PING: u8 = b'P';

/// Large reads and writes: bulk throughput should measure the path, not our syscall count.
const BULK_CHUNK: usize = 256 * 1024;

/// The longest any single transfer may take before the bench gives up on it.
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);

/// The sink: a listener on 127.0.0.1 serving the commands above. Stops when dropped.
pub struct Sink {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Sink {
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await
    }

    /// A sink on `addr` (port 0: any free port).
    pub async fn start_on(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr).await.context("binding the sink")?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(accept_loop(listener, open.clone()));
        Ok(Self { addr, open, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections the sink holds right now.
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// Waits until the sink holds exactly `expected` connections.
    pub async fn wait_for(&self, expected: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.open_connections() != expected {
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "the sink holds {} of {expected} connections after {timeout:?}",
                    self.open_connections()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, open: Arc<AtomicUsize>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // EMFILE and friends: back off instead of spinning.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let open = open.clone();
        open.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            // A failed connection only matters to the client, which reports it.
            let _ = serve(stream).await;
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    match stream.read_u8().await? {
        UPLOAD => {
            let received = drain(&mut stream).await?;
            stream.write_u64(received).await?;
            stream.shutdown().await
        }
        DOWNLOAD => {
            let length = stream.read_u64().await?;
            send_zeros(&mut stream, length).await?;
            stream.shutdown().await?;
            drain(&mut stream).await.map(drop)
        }
        ECHO => {
            let (mut read, mut write) = stream.split();
            tokio::io::copy(&mut read, &mut write).await.map(drop)
        }
        PING => stream.write_u8(PING).await,
        _ => Ok(()),
    }
}

async fn drain(stream: &mut TcpStream) -> std::io::Result<u64> {
    let mut buf = vec![0u8; BULK_CHUNK];
    let mut total = 0u64;
    loop {
        match stream.read(&mut buf).await? {
            0 => return Ok(total),
            n => total += n as u64,
        }
    }
}

async fn send_zeros(stream: &mut TcpStream, mut length: u64) -> std::io::Result<()> {
    let buf = vec![0u8; BULK_CHUNK];
    while length > 0 {
        let n = length.min(BULK_CHUNK as u64) as usize;
        stream.write_all(&buf[..n]).await?;
        length -= n as u64;
    }
    Ok(())
}

/// Which way bulk bytes flow, seen from the client.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Upload,
    Download,
}

/// Moves `total` bytes over `streams` parallel connections to `target` and returns the elapsed
/// time. Every stream's byte count is checked end to end.
pub async fn bulk(
    target: SocketAddr,
    direction: Direction,
    streams: usize,
    total: u64,
) -> anyhow::Result<Duration> {
    let per_stream = total / streams as u64;
    let started = Instant::now();
    let transfers = (0..streams).map(|_| async move {
        match direction {
            Direction::Upload => upload(target, per_stream).await,
            Direction::Download => download(target, per_stream).await,
        }
    });
    let all = futures::future::try_join_all(transfers);
    tokio::time::timeout(TRANSFER_TIMEOUT, all)
        .await
        .context("bulk transfer timed out")??;
    Ok(started.elapsed())
}

async fn upload(target: SocketAddr, length: u64) -> anyhow::Result<()> {
    let mut stream = connect(target).await?;
    stream.write_u8(UPLOAD).await?;
    send_zeros(&mut stream, length).await?;
    stream.shutdown().await?;
    let received = stream
        .read_u64()
        .await
        .context("reading the upload count")?;
    ensure!(
        received == length,
        "sink received {received} of {length} bytes"
    );
    Ok(())
}

async fn download(target: SocketAddr, length: u64) -> anyhow::Result<()> {
    let mut stream = connect(target).await?;
    stream.write_u8(DOWNLOAD).await?;
    stream.write_u64(length).await?;
    let received = drain(&mut stream).await?;
    ensure!(received == length, "received {received} of {length} bytes");
    Ok(())
}

async fn connect(target: SocketAddr) -> anyhow::Result<TcpStream> {
    let stream = TcpStream::connect(target)
        .await
        .with_context(|| format!("connecting to {target}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Source addresses spread over 127.0.0.2 to 127.0.0.251, so many short or many held connections
/// do not exhaust one address's ephemeral ports.
fn spread_source(index: u64) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 2 + (index % 250) as u8)
}

/// Connects from `source` (for short-lived connections: `bind(ip, 0)` reserves the port for
/// every destination until the socket is gone, so held connections use [`connect`] instead).
async fn connect_from(source: Ipv4Addr, target: SocketAddr) -> anyhow::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    let stream = socket
        .connect(target)
        .await
        .with_context(|| format!("connecting {source} -> {target}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Latency percentiles of one open-loop run, in microseconds.
pub struct Latency {
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// Open-loop request/response on one persistent connection: `size`-byte messages sent on a fixed
/// schedule of `rate` per second for `duration`, echoed by the sink. Each latency is measured
/// from the message's *scheduled* send time, so a stalled path is charged for every message it
/// delays (no coordinated omission). Runs on two blocking threads that inherit this thread's CPU.
pub async fn latency(
    target: SocketAddr,
    rate: u32,
    duration: Duration,
    size: usize,
) -> anyhow::Result<Latency> {
    tokio::task::spawn_blocking(move || latency_blocking(target, rate, duration, size)).await?
}

fn latency_blocking(
    target: SocketAddr,
    rate: u32,
    duration: Duration,
    size: usize,
) -> anyhow::Result<Latency> {
    ensure!(size >= 8, "messages carry an 8-byte sequence number");
    let count = (f64::from(rate) * duration.as_secs_f64()) as u64;
    let warmup = count / 20;
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate));
    let mut stream = std::net::TcpStream::connect(target)?;
    stream.set_nodelay(true)?;
    stream.write_all(&[ECHO])?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut sender = stream.try_clone()?;
    let start = Instant::now() + Duration::from_millis(20);
    let schedule = move |i: u64| start + interval.mul_f64(i as f64);

    let send = std::thread::spawn(move || -> std::io::Result<()> {
        let mut message = vec![0u8; size];
        for i in 0..count {
            let due = schedule(i);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            message[..8].copy_from_slice(&i.to_be_bytes());
            sender.write_all(&message)?;
        }
        sender.shutdown(std::net::Shutdown::Write)
    });

    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    let mut reply = vec![0u8; size];
    let received = (|| -> anyhow::Result<()> {
        for i in 0..count {
            stream.read_exact(&mut reply)?;
            let arrived = Instant::now();
            let sequence = u64::from_be_bytes(reply[..8].try_into()?);
            ensure!(
                sequence == i,
                "echo out of order: got {sequence}, expected {i}"
            );
            if i >= warmup {
                let nanos = arrived.saturating_duration_since(schedule(i)).as_nanos();
                histogram.saturating_record(u64::try_from(nanos).unwrap_or(u64::MAX));
            }
        }
        Ok(())
    })();
    // Closing our side unblocks the sender if the reader failed.
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let sent = send.join();
    received?;
    match sent {
        Ok(result) => result.context("sending")?,
        Err(_) => bail!("the sender thread panicked"),
    }
    let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1_000.0;
    Ok(Latency {
        p50_us: us(0.50),
        p99_us: us(0.99),
        p999_us: us(0.999),
    })
}

/// Time from connecting to the first byte back for `count` sequential pings (new-stream setup).
pub async fn setup_latency(target: SocketAddr, count: u64) -> anyhow::Result<Histogram<u64>> {
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for i in 0..count {
        let begun = Instant::now();
        let first_byte = tokio::time::timeout(Duration::from_secs(10), async {
            let mut stream = connect_from(spread_source(i), target).await?;
            stream.write_u8(PING).await?;
            let answer = stream.read_u8().await?;
            ensure!(answer == PING, "unexpected answer {answer}");
            anyhow::Ok(Instant::now())
        })
        .await
        .context("stream setup timed out")??;
        let nanos = first_byte.duration_since(begun).as_nanos();
        histogram.saturating_record(u64::try_from(nanos).unwrap_or(u64::MAX));
    }
    Ok(histogram)
}

/// Opens `count` connections to `target` and keeps them open, never sending a byte, until the
/// returned vector is dropped. They are opened in batches of 64, each batch only once the sink
/// has accepted every earlier one: `connect()` returns as soon as the relay's kernel completes
/// the handshake, so an unpaced opener can overflow the relay's accept queue, and a dropped
/// handshake of a client that never sends is only retried by slow SYN-ACK retransmissions.
pub async fn hold_idle(
    target: SocketAddr,
    count: usize,
    sink: &Sink,
) -> anyhow::Result<Vec<TcpStream>> {
    const BATCH: usize = 64;
    let baseline = sink.open_connections();
    let mut held = Vec::with_capacity(count);
    while held.len() < count {
        let first = held.len() as u64;
        let batch = BATCH.min(count - held.len()) as u64;
        // A plain connect() picks ports per 4-tuple, so these share the ephemeral range with
        // the relay's connections to the sink instead of exhausting it.
        let opened = futures::future::try_join_all((first..first + batch).map(|_| connect(target)));
        held.extend(
            tokio::time::timeout(Duration::from_secs(10), opened)
                .await
                .context("opening idle connections timed out")??,
        );
        sink.wait_for(baseline + held.len(), Duration::from_secs(15))
            .await?;
    }
    Ok(held)
}
