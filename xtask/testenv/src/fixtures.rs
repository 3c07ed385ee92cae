//! The plain tier: fixtures shared by the workspace's tests, examples and `cargo xtask`:
//! free loopback ports, TCP and UDP echo servers with tagged datagrams to send them, a little HTTP
//! server and client, pinned Python environments, a "request to first byte"
//! timer, child processes that are killed when dropped, and a real HTTP proxy ([`Tinyproxy`]). Not
//! part of any production binary.

use std::collections::BTreeSet;
use std::hash::{BuildHasher as _, Hasher as _, RandomState};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// How long [`http_get`] waits for a whole response.
const HTTP_TIMEOUT: Duration = Duration::from_secs(10);

/// The lowest port the `free_*` functions hand out: above the Kubernetes components' own ports
/// (10249-10259).
const PORT_FLOOR: u16 = 20_000;
/// One past the highest port the `free_*` functions hand out: below the NodePort range
/// (30000-32767).
const PORT_CEILING: u16 = 30_000;

/// Ports this process handed out, so that two servers of one test binary never get the same one.
static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// A port free on 127.0.0.1 for a server the caller starts next.
///
/// It comes from below the kernel's ephemeral range. A port the kernel picks (for `bind(0)` or
/// for an outgoing connection, and tests make thousands) can be taken again between this check
/// and the server's own bind; that once failed a CI run with "address already in use". A port
/// outside that range is taken only by another program that chose it. No port is handed out
/// twice by one process. When the machine's ephemeral range leaves no room below it, the
/// kernel's pick is returned, with that race.
pub fn free_port() -> io::Result<u16> {
    Ok(free_port_range(1)?.0)
}

/// [`free_port`] as a socket address on 127.0.0.1.
pub fn free_addr() -> io::Result<SocketAddr> {
    Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?)))
}

/// `count` consecutive ports free on 127.0.0.1, as the first and the last, chosen like
/// [`free_port`] (for a program that takes a port range).
///
/// # Errors
///
/// `count` is 0, or no such run of ports is free (in the fallback, the kernel's port only serves
/// a `count` of 1).
pub fn free_port_range(count: u16) -> io::Result<(u16, u16)> {
    let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_owned());
    if count == 0 {
        return Err(invalid("a port range of 0 ports"));
    }
    let ceiling = ephemeral_low().map_or(PORT_CEILING, |low| low.min(PORT_CEILING));
    let slots = ceiling.saturating_sub(PORT_FLOOR) / count;
    if slots == 0 {
        if count > 1 {
            return Err(invalid("no room below the ephemeral port range"));
        }
        let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
            .local_addr()?
            .port();
        return Ok((port, port));
    }
    // A different start per call and process keeps concurrent test binaries apart.
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    let start = hasher.finish() % u64::from(slots);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    for step in 0..u64::from(slots) {
        let slot = u16::try_from((start + step) % u64::from(slots))
            .map_err(|_| invalid("a port slot out of range"))?;
        let first = PORT_FLOOR + slot * count;
        let ports = first..first + count;
        let free = ports.clone().all(|port| {
            !handed_out.contains(&port)
                && std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok()
        });
        if free {
            handed_out.extend(ports);
            return Ok((first, first + count - 1));
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!("no {count} consecutive free ports in {PORT_FLOOR}..{ceiling}"),
    ))
}

/// The low end of the kernel's ephemeral port range, when it can be read.
fn ephemeral_low() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// A TCP server on 127.0.0.1 that echoes every byte and half-closes after the client did; it
/// lives as long as the runtime.
pub async fn echo_server() -> io::Result<SocketAddr> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = socket.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
                let _ = write.shutdown().await;
            });
        }
    });
    Ok(addr)
}

/// A TCP relay on 127.0.0.1 to `target` whose open connections can be frozen: what a peer behind
/// a lost node looks like (no FIN, no reset, no bytes). Connections made after a freeze pass.
pub struct FreezableRelay {
    addr: SocketAddr,
    open: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

impl FreezableRelay {
    /// Starts relaying; it lives as long as the runtime.
    pub async fn start(target: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let open: Arc<Mutex<Vec<Arc<AtomicBool>>>> = Arc::default();
        let registry = open.clone();
        tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = TcpStream::connect(target).await else {
                    continue;
                };
                let frozen = Arc::new(AtomicBool::new(false));
                registry
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(frozen.clone());
                let (down_read, down_write) = down.into_split();
                let (up_read, up_write) = up.into_split();
                tokio::spawn(Self::pump(down_read, up_write, frozen.clone()));
                tokio::spawn(Self::pump(up_read, down_write, frozen));
            }
        });
        Ok(Self { addr, open })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Freezes every connection open now: nothing more gets through them, yet they stay open.
    pub fn freeze_open_connections(&self) {
        for frozen in self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain(..)
        {
            frozen.store(true, Ordering::SeqCst);
        }
    }

    async fn pump(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        frozen: Arc<AtomicBool>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let read = from.read(&mut buf).await;
            if frozen.load(Ordering::SeqCst) {
                break;
            }
            match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(n) => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
        // Frozen: hold both halves open for good, nothing more gets through.
        let _held = (from, to);
        std::future::pending::<()>().await;
    }
}

/// The largest UDP payload over IPv4 (65 535 − 20 − 8).
pub const MAX_UDP_PAYLOAD: usize = 65_507;

/// A UDP server on 127.0.0.1 that sends every datagram back to its sender; it lives as long as
/// the runtime.
pub async fn udp_echo_server() -> io::Result<SocketAddr> {
    let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
    let addr = socket.local_addr()?;
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_535];
        while let Ok((n, peer)) = socket.recv_from(&mut buf).await {
            let _ = socket.send_to(&buf[..n], peer).await;
        }
    });
    Ok(addr)
}

/// The size of [`tagged_datagram`] `i`: mostly small, some mid-sized, a few up to
/// [`MAX_UDP_PAYLOAD`], with the edges (0, 1, the limit) among the first three.
pub fn tagged_datagram_len(i: usize) -> usize {
    let x = (i.wrapping_mul(2_654_435_761)) % 1_000_003;
    match i % 50 {
        0 => 0,
        1 => MAX_UDP_PAYLOAD,
        2 => 1,
        3..=6 => 16_384 + x % (MAX_UDP_PAYLOAD - 16_384),
        7..=16 => 1_500 + x % 14_884,
        _ => x % 1_500,
    }
}

/// Datagram `i`: its index (big-endian, as much of it as fits), then bytes derived from `i`, so a
/// swapped, truncated or corrupted datagram shows when compared with a fresh copy.
pub fn tagged_datagram(i: usize) -> Vec<u8> {
    let n = tagged_datagram_len(i);
    let mut d: Vec<u8> = (0..n)
        .map(|j| (j.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect();
    let tag = (i as u32).to_be_bytes();
    let k = n.min(4);
    d[..k].copy_from_slice(&tag[..k]);
    d
}

/// An HTTP/1.1 server on `ip` (any port) answering every request with `200 OK` and `body`; it
/// lives as long as the runtime.
pub async fn http_server(ip: IpAddr, body: impl Into<String>) -> io::Result<SocketAddr> {
    let listener = TcpListener::bind((ip, 0)).await?;
    let addr = listener.local_addr()?;
    let body = body.into();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(answer(stream, body.clone()));
        }
    });
    Ok(addr)
}

async fn answer(mut stream: TcpStream, body: String) {
    let mut request = Vec::new();
    let mut chunk = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => request.extend_from_slice(&chunk[..n]),
        }
    }
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Sends `GET path` to `addr` and returns the whole response (status line, headers and body).
pub async fn http_get(addr: SocketAddr, path: &str) -> io::Result<String> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    tokio::time::timeout(HTTP_TIMEOUT, stream.read_to_string(&mut response))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no whole response in time"))??;
    Ok(response)
}

/// Time from sending `POST path` with the JSON `body` (and `Authorization: Bearer <token>` when
/// given) to `api` until the first byte arrives through `entry`: how long a proxy's API takes to
/// make a new route carry traffic. The target behind `entry` must speak first (e.g. a banner);
/// after a `200` answer, `entry` is tried every millisecond. A non-200 answer is an error carrying
/// the whole response; nothing within `timeout` is [`io::ErrorKind::TimedOut`].
pub async fn post_to_first_byte(
    api: SocketAddr,
    path: &str,
    body: &str,
    token: Option<&str>,
    entry: SocketAddr,
    timeout: Duration,
) -> io::Result<Duration> {
    let timed_out = || {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no byte through {entry} within {timeout:?}"),
        )
    };
    let started = Instant::now();
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    let mut stream = TcpStream::connect(api).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(timeout, stream.read_to_end(&mut answer))
        .await
        .map_err(|_| timed_out())??;
    let text = String::from_utf8_lossy(&answer);
    let status = text.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        return Err(io::Error::other(format!(
            "the API answered {status}: {text}"
        )));
    }
    let deadline = started + timeout;
    while Instant::now() < deadline {
        if let Ok(mut conn) = TcpStream::connect(entry).await {
            let mut byte = [0u8; 1];
            if let Ok(Ok(1)) =
                tokio::time::timeout(Duration::from_millis(200), conn.read(&mut byte)).await
            {
                return Ok(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Err(timed_out())
}

/// Runs `command` to its end and returns its stdout; a failed exit is an error carrying stderr.
pub fn stdout_of(command: &mut Command) -> io::Result<String> {
    let output = command.output()?;
    if !output.status.success() {
        return Err(io::Error::other(format!(
            "{command:?} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        )));
    }
    String::from_utf8(output.stdout).map_err(io::Error::other)
}

/// The project's cache of built tools and environments: `~/.cache/kube-netkit/<name>` (the
/// system temporary directory stands in for a missing `HOME`).
pub fn cache_dir(name: &str) -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(".cache/kube-netkit")
        .join(name)
}

/// A Python virtual environment at `dir` holding `packages` (name, exact version), created with
/// `python3 -m venv` and filled with pip when missing or at another version (which needs PyPI
/// once). Returns the path of its `python`.
pub fn python_venv(dir: &Path, packages: &[(&str, &str)]) -> io::Result<PathBuf> {
    let python = dir.join("bin/python");
    if !python.exists() {
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent)?;
        }
        stdout_of(Command::new("python3").args(["-m", "venv"]).arg(dir))?;
    }
    let names: Vec<&str> = packages.iter().map(|(name, _)| *name).collect();
    let probe = format!(
        "import importlib.metadata as m\nfor p in {names:?}:\n  try: print(m.version(p))\n  except Exception: print('-')"
    );
    let installed = stdout_of(Command::new(&python).args(["-c", &probe]))?;
    let wanted: Vec<&str> = packages.iter().map(|(_, version)| *version).collect();
    if installed.lines().collect::<Vec<_>>() != wanted {
        let pins: Vec<String> = packages.iter().map(|(n, v)| format!("{n}=={v}")).collect();
        stdout_of(
            Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(&pins),
        )?;
    }
    Ok(python)
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing running.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl KillOnDrop {
    /// Starts `command`.
    pub fn spawn(command: &mut Command) -> io::Result<Self> {
        command.spawn().map(Self)
    }

    /// Sends SIGTERM and waits up to `grace` for the exit; true when it exited successfully.
    pub async fn terminate(mut self, grace: Duration) -> bool {
        let pid = self.0.id().to_string();
        let signalled = Command::new("kill").args(["-TERM", &pid]).status();
        if !signalled.is_ok_and(|s| s.success()) {
            return false;
        }
        let deadline = tokio::time::Instant::now() + grace;
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.0.try_wait() {
                return status.success();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Settings of a [`Tinyproxy`].
#[derive(Debug, Clone, Default)]
pub struct TinyproxyConfig {
    /// `BasicAuth user password`: the proxy answers 407 without them.
    pub basic_auth: Option<(String, String)>,
    /// `ConnectPort` lines: the only target ports `CONNECT` may reach (403 for others). Empty
    /// allows every port.
    pub connect_ports: Vec<u16>,
}

/// A real HTTP proxy: Debian's `tinyproxy` (`apt-get install -y tinyproxy`), in the foreground on
/// 127.0.0.1 with its own configuration, pid and log files in a private directory; killed and
/// cleaned up when dropped.
#[derive(Debug)]
pub struct Tinyproxy {
    child: KillOnDrop,
    addr: SocketAddr,
    dir: std::path::PathBuf,
}

/// Where Debian installs tinyproxy, then `$PATH`.
fn tinyproxy_binary() -> Option<std::path::PathBuf> {
    let mut candidates = vec![std::path::PathBuf::from("/usr/bin/tinyproxy")];
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|dir| dir.join("tinyproxy")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

impl Tinyproxy {
    /// Starts tinyproxy and waits until it accepts connections. Without tinyproxy installed this
    /// is an error saying how to install it (tests fail rather than skip).
    pub async fn start(config: &TinyproxyConfig) -> io::Result<Self> {
        let binary = tinyproxy_binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "tinyproxy is required for the HTTP proxy tests: apt-get install -y tinyproxy",
            )
        })?;
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tinyproxy-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let addr = free_addr()?;
        let mut text = format!(
            "Port {port}\nListen 127.0.0.1\nTimeout 600\nMaxClients 100\nAllow 127.0.0.1\n\
             LogLevel Info\nLogFile \"{log}\"\nPidFile \"{pid}\"\n",
            port = addr.port(),
            log = dir.join("tinyproxy.log").display(),
            pid = dir.join("tinyproxy.pid").display(),
        );
        if let Some((user, password)) = &config.basic_auth {
            text.push_str(&format!("BasicAuth {user} {password}\n"));
        }
        for port in &config.connect_ports {
            text.push_str(&format!("ConnectPort {port}\n"));
        }
        let conf = dir.join("tinyproxy.conf");
        std::fs::write(&conf, text)?;
        let child = KillOnDrop::spawn(
            Command::new(binary)
                .arg("-d")
                .arg("-c")
                .arg(&conf)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(dir.join("stderr.log"))?),
        )?;
        let mut proxy = Self { child, addr, dir };
        // Listening is the only sign of readiness tinyproxy gives in the foreground.
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).await.is_err() {
            if let Ok(Some(status)) = proxy.child.0.try_wait() {
                return Err(io::Error::other(format!(
                    "tinyproxy exited ({status}): {}",
                    proxy.logs()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("tinyproxy did not listen on {addr}: {}", proxy.logs()),
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(proxy)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its URL, `http://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its log and stderr so far.
    pub fn logs(&self) -> String {
        ["tinyproxy.log", "stderr.log"]
            .iter()
            .map(|f| std::fs::read_to_string(self.dir.join(f)).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Tinyproxy {
    fn drop(&mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn http_server_answers_http_get() {
        let server = http_server(IpAddr::V4(Ipv4Addr::LOCALHOST), "hello")
            .await
            .unwrap();
        let response = http_get(server, "/").await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200 OK"), "{response}");
        assert!(response.ends_with("\r\n\r\nhello"), "{response}");
    }

    #[tokio::test]
    async fn echo_server_echoes() {
        let server = echo_server().await.unwrap();
        let mut stream = TcpStream::connect(server).await.unwrap();
        stream.write_all(b"ping").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut back = Vec::new();
        stream.read_to_end(&mut back).await.unwrap();
        assert_eq!(back, b"ping");
    }

    #[tokio::test]
    async fn post_to_first_byte_times_the_first_byte_after_an_accepted_post() {
        let api = http_server(IpAddr::V4(Ipv4Addr::LOCALHOST), "{}")
            .await
            .unwrap();
        let banner = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let entry = banner.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = banner.accept().await {
                let _ = socket.write_all(b"hi").await;
            }
        });
        let timeout = Duration::from_secs(30);
        let took = post_to_first_byte(api, "/map", "{}", Some("t"), entry, timeout)
            .await
            .unwrap();
        assert!(took < timeout, "{took:?}");
        // Nothing speaks on a free port: the timer gives up.
        let silent = free_addr().unwrap();
        let short = Duration::from_millis(300);
        let err = post_to_first_byte(api, "/map", "{}", None, silent, short)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn post_to_first_byte_refuses_a_non_200_answer() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let api = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut chunk = [0u8; 4096];
                let _ = socket.read(&mut chunk).await;
                let _ = socket
                    .write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                    .await;
            }
        });
        let entry = free_addr().unwrap();
        let err = post_to_first_byte(api, "/map", "{}", None, entry, Duration::from_secs(30))
            .await
            .unwrap_err();
        assert!(err.to_string().starts_with("the API answered 403"), "{err}");
    }

    #[test]
    fn stdout_of_returns_output_and_refuses_failures() {
        let out = stdout_of(Command::new("echo").arg("hi")).unwrap();
        assert_eq!(out, "hi\n");
        assert!(stdout_of(&mut Command::new("false")).is_err());
    }

    #[test]
    fn free_ports_are_bindable() {
        let addr = free_addr().unwrap();
        assert!(std::net::TcpListener::bind(addr).is_ok());
    }

    #[test]
    fn free_ports_stay_out_of_the_ephemeral_range_and_are_never_handed_out_twice() {
        let low = ephemeral_low().unwrap();
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        assert!(
            ports.iter().all(|&p| (PORT_FLOOR..low).contains(&p)),
            "{ports:?}"
        );
    }

    #[test]
    fn a_free_port_range_is_consecutive_bindable_and_not_empty() {
        let (first, last) = free_port_range(5).unwrap();
        assert_eq!(last - first, 4);
        let held: Vec<_> = (first..=last)
            .map(|p| std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, p)).unwrap())
            .collect();
        assert_eq!(held.len(), 5);
        assert_eq!(
            free_port_range(0).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
