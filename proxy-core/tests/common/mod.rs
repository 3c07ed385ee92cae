//! Helpers shared by the integration tests: loopback servers, payload checks, an observer
//! that counts events.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proxy_core::ConnectError;
use proxy_core::copy::{CopyMode, Direction, RelayCounters};
use proxy_core::metrics::{RelayObserver, RouteLabels};
use proxy_core::relay::{self, Ending, RelayConfig, RelaySummary, Route};
use proxy_core::server::{DataPath, ServerConfig};
use rand::{Rng, RngCore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const MODES: [CopyMode; 2] = [CopyMode::Buffered, CopyMode::Splice];

/// Names the data path the server tests run on: `tokio`, `event-loop` or `auto`; unset, the
/// default. Run the suite once per path to cover both.
pub const DATA_PATH_VAR: &str = "PROXY_CORE_TEST_DATA_PATH";

/// The data path of this test run (see [`DATA_PATH_VAR`]).
pub fn data_path() -> DataPath {
    match std::env::var(DATA_PATH_VAR) {
        Ok(path) => path
            .parse()
            .unwrap_or_else(|e| panic!("{DATA_PATH_VAR}: {e}")),
        Err(_) => ServerConfig::default().data_path,
    }
}

/// The server configuration every server test starts from: the default, on this run's data
/// path.
pub fn server_config() -> ServerConfig {
    ServerConfig::default().with_data_path(data_path())
}

/// Raises the soft descriptor limit to the hard one: 1 000 relayed connections need ~8 000.
pub fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    limit.current = limit.maximum;
    setrlimit(Resource::Nofile, limit).expect("raise RLIMIT_NOFILE");
}

/// 64-bit FNV-1a, streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checksum {
    pub hash: u64,
    pub len: u64,
}

impl Default for Checksum {
    fn default() -> Self {
        Self {
            hash: 0xcbf2_9ce4_8422_2325,
            len: 0,
        }
    }
}

impl Checksum {
    pub fn update(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.hash ^= u64::from(*byte);
            self.hash = self.hash.wrapping_mul(0x0100_0000_01b3);
        }
        self.len += bytes.len() as u64;
    }

    pub fn of(bytes: &[u8]) -> Self {
        let mut sum = Self::default();
        sum.update(bytes);
        sum
    }
}

pub fn random_payload(len: usize) -> Vec<u8> {
    let mut payload = vec![0u8; len];
    rand::rng().fill_bytes(&mut payload);
    payload
}

pub fn random_len(max: usize) -> usize {
    rand::rng().random_range(0..=max)
}

/// An echo server on loopback; counts accepted connections.
pub struct Echo {
    pub addr: SocketAddr,
    pub accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A loopback listener with a backlog for 1 000 simultaneous connects (tokio's `bind` uses 128,
/// and an overflowing accept queue drops SYNs, which costs a 1 s retransmission).
pub fn loopback_listener() -> TcpListener {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    socket.listen(4096).unwrap()
}

pub async fn echo_server() -> Echo {
    let listener = loopback_listener();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut read, mut write) = stream.into_split();
                if tokio::io::copy(&mut read, &mut write).await.is_ok() {
                    let _ = write.shutdown().await;
                }
            });
        }
    });
    Echo {
        addr,
        accepted,
        task,
    }
}

/// A loopback address on which nothing listens (connects are refused).
pub async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

/// Sends `payload` (then FIN) while reading everything back; returns the checksum of what came
/// back. `pause` spaces out 64 KiB chunks to keep a transfer running for a while.
pub async fn echo_roundtrip(
    stream: TcpStream,
    payload: Arc<Vec<u8>>,
    pause: Option<Duration>,
) -> std::io::Result<Checksum> {
    let (mut read, mut write) = stream.into_split();
    let writer = tokio::spawn(async move {
        for chunk in payload.chunks(64 * 1024) {
            write.write_all(chunk).await?;
            if let Some(pause) = pause {
                tokio::time::sleep(pause).await;
            }
        }
        write.shutdown().await?;
        Ok::<_, std::io::Error>(write)
    });
    let mut sum = Checksum::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = read.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        sum.update(&buf[..n]);
    }
    writer.await.unwrap()?;
    Ok(sum)
}

/// A connected client and the task relaying its accepted side with [`relay::proxy`].
pub struct OneRelay {
    pub client: TcpStream,
    pub counters: Arc<RelayCounters>,
    pub cancel: CancellationToken,
    pub task: JoinHandle<Result<RelaySummary, ConnectError>>,
}

pub async fn relay_once(route: Route, config: RelayConfig) -> OneRelay {
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = front.accept().await.unwrap();
    let counters = Arc::new(RelayCounters::new());
    let cancel = CancellationToken::new();
    let task = {
        let (counters, cancel) = (Arc::clone(&counters), cancel.clone());
        tokio::spawn(
            async move { relay::proxy(accepted, &route, &config, &counters, &cancel).await },
        )
    };
    OneRelay {
        client,
        counters,
        cancel,
        task,
    }
}

/// Counts every observer event.
#[derive(Debug, Default)]
pub struct CountingObserver {
    pub opened: AtomicUsize,
    pub closed: AtomicUsize,
    pub rejected: AtomicUsize,
    pub connect_failed: AtomicUsize,
    pub connect_timeouts: AtomicUsize,
    pub bytes_to_upstream: AtomicU64,
    pub bytes_to_client: AtomicU64,
    pub endings: Mutex<Vec<Ending>>,
}

impl CountingObserver {
    pub fn get(counter: &AtomicUsize) -> usize {
        counter.load(Ordering::SeqCst)
    }

    pub fn endings(&self) -> Vec<Ending> {
        self.endings.lock().unwrap().clone()
    }
}

impl RelayObserver for CountingObserver {
    fn connection_opened(&self, _: &RouteLabels) {
        self.opened.fetch_add(1, Ordering::SeqCst);
    }

    fn connection_rejected(&self, _: &RouteLabels) {
        self.rejected.fetch_add(1, Ordering::SeqCst);
    }

    fn connect_failed(&self, _: &RouteLabels, error: &ConnectError) {
        self.connect_failed.fetch_add(1, Ordering::SeqCst);
        if error.is_timeout() {
            self.connect_timeouts.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn bytes_relayed(&self, _: &RouteLabels, direction: Direction, bytes: u64) {
        match direction {
            Direction::ToUpstream => &self.bytes_to_upstream,
            Direction::ToClient => &self.bytes_to_client,
        }
        .fetch_add(bytes, Ordering::SeqCst);
    }

    fn connection_closed(&self, _: &RouteLabels, summary: &RelaySummary) {
        self.endings.lock().unwrap().push(summary.ending);
        self.closed.fetch_add(1, Ordering::SeqCst);
    }
}

/// Polls `condition` every 10 ms until it holds, failing after `within`.
pub async fn eventually(within: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads `stream` to its end, which must come within 30 s; `what` names what should arrive.
pub async fn read_to_end_within_30s(stream: &mut TcpStream, what: &str) -> Vec<u8> {
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut received))
        .await
        .unwrap_or_else(|_| panic!("{what} did not arrive within 30 s"))
        .unwrap();
    received
}

/// Reads until EOF or error; true when the connection ended (EOF or reset) within `within`.
pub async fn closes_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let read_to_end = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read_to_end).await.is_ok()
}

/// The counters `ss -ti` shows for the TCP socket from `local` to `remote` (`segs_in`,
/// `bytes_acked`, ...).
pub fn tcp_counters(local: SocketAddr, remote: SocketAddr) -> BTreeMap<String, u64> {
    let output = std::process::Command::new("ss")
        .args([
            "-tinH",
            "src",
            &local.to_string(),
            "dst",
            &remote.to_string(),
        ])
        .output()
        .expect("ss (iproute2) runs");
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .filter_map(|field| {
            let (name, value) = field.split_once(':')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// `client` has sent one byte through a relay and `upstream` is the relay's connection to the
/// upstream: the upstream reads the byte, then answers one byte and closes, in one segment, so
/// the relay reads the answer together with the FIN. Returns how many segments the client's
/// socket received for the answer and the FIN (1 when the relay sends them together).
#[cfg(target_os = "linux")]
pub async fn segments_of_an_answer_with_fin(client: &mut TcpStream, upstream: TcpStream) -> u64 {
    let leg = (client.local_addr().unwrap(), client.peer_addr().unwrap());
    let mut upstream = upstream;
    let mut request = [0u8; 1];
    upstream.read_exact(&mut request).await.unwrap();
    let upstream = upstream.into_std().unwrap();
    // The relay's ACK of the request (the SYN counts as one byte) is in before counting.
    eventually(
        Duration::from_secs(30),
        "the relay acknowledged the request",
        || tcp_counters(leg.0, leg.1).get("bytes_acked") >= Some(&2),
    )
    .await;
    let before = tcp_counters(leg.0, leg.1)["segs_in"];
    rustix::net::send(&upstream, b"Q", rustix::net::SendFlags::MORE).unwrap();
    upstream.shutdown(std::net::Shutdown::Write).unwrap();
    let answer = read_to_end_within_30s(client, "the answer and the FIN").await;
    assert_eq!(answer, b"Q");
    tcp_counters(leg.0, leg.1)["segs_in"] - before
}
