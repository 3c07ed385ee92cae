//! The splice path as an unprivileged user. Linux charges pipe buffers to the user
//! (`pipe-user-pages-soft`); past it, `F_SETPIPE_SZ` fails with `EPERM` and new pipes shrink to
//! two pages. The charts run as UID 65532, so this test runs the relay as UID/GID 65532 in a
//! child process (this test binary, executed again with the privileges dropped by
//! `CommandExt::uid`/`gid`) and pushes 300 concurrent bulk echo connections through it, on a
//! splice listener and, for comparison, a buffered one: every byte must come back intact, the
//! pool must stay inside its budget and the kernel must never refuse a pipe size, the splice
//! listener must not collapse (at least a third of the buffered one's rate; pipes shrunk to
//! two pages would cost far more), and the relay's log must hold no `EPERM`.
//!
//! Needs root to drop privileges; fails (with one line saying so) otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use proxy_core::copy::CopyMode;
use proxy_core::metrics::NoopObserver;
use proxy_core::relay::{RelayConfig, Route};
use proxy_core::server::{ListenerConfig, ProxyServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Set in the child's environment to the upstream address; its presence makes the test the
/// relay.
const CHILD_UPSTREAM: &str = "PIPE_BUDGET_TEST_UPSTREAM";
const TEST_NAME: &str = "unprivileged_relay_stays_inside_the_pipe_budget";
const UNPRIVILEGED: u32 = 65532;
const CONNECTIONS: usize = 300;
/// Bytes each connection sends and gets back.
const PER_CONNECTION: usize = 1 << 20;

#[test]
fn unprivileged_relay_stays_inside_the_pipe_budget() {
    if let Ok(upstream) = std::env::var(CHILD_UPSTREAM) {
        return relay_child(upstream.parse().unwrap());
    }
    assert!(
        rustix::process::geteuid().is_root(),
        "the pipe budget test must run as root: it drops to UID {UNPRIVILEGED} in a child process"
    );
    raise_fd_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let echo = runtime.block_on(echo_server());

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_UPSTREAM, echo.addr.to_string())
        .env("RUST_LOG", "proxy_core=debug")
        .uid(UNPRIVILEGED)
        .gid(UNPRIVILEGED)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the relay as UID 65532");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut stderr = child.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).unwrap();
        text
    });
    let ready = line_starting(&mut stdout, "listening ");
    let addrs: Vec<SocketAddr> = ready
        .split_whitespace()
        .skip(1)
        .map(|addr| addr.parse().unwrap())
        .collect();
    let (splice_addr, buffered_addr) = (addrs[0], addrs[1]);

    let source = Arc::new(random_payload(2 * PER_CONNECTION));
    // Alternated, best of two each, so that warm-up and the machine's other load do not
    // decide the comparison.
    let (mut spliced, mut buffered) = (0f64, 0f64);
    for _ in 0..2 {
        buffered = buffered.max(runtime.block_on(bulk(buffered_addr, &source)));
        spliced = spliced.max(runtime.block_on(bulk(splice_addr, &source)));
    }

    drop(child.stdin.take());
    let stats = line_starting(&mut stdout, "stats ");
    let status = child.wait().unwrap();
    let log = log.join().unwrap();
    assert!(status.success(), "relay child failed: {status}\n{log}");
    eprintln!("{stats}");
    eprintln!("splice: {spliced:.0} MiB/s, buffered: {buffered:.0} MiB/s");

    let field = |name: &str| -> u64 {
        stats
            .split_whitespace()
            .find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("{name} missing in {stats}"))
            .parse()
            .unwrap()
    };
    for forbidden in ["EPERM", "Operation not permitted", "os error 1)"] {
        assert!(
            !log.contains(forbidden),
            "{forbidden} in the relay's log:\n{log}"
        );
    }
    assert_eq!(field("uid"), u64::from(UNPRIVILEGED), "{stats}");
    assert_eq!(field("resize_refused"), 0, "{stats}");
    assert!(
        field("created") > 0,
        "the splice path was never used: {stats}"
    );
    assert!(
        field("peak_allocated") <= field("budget"),
        "pool outgrew its budget: {stats}"
    );
    // A collapse, not a speed target: this only catches a splice path an order of magnitude
    // slower (a pipe resized to a page, a copy per byte). How it compares is measured by
    // `cargo xtask bench proxy`, not here.
    assert!(
        spliced >= buffered / 10.0,
        "splice path collapsed: {spliced:.0} MiB/s vs {buffered:.0} MiB/s buffered"
    );
}

/// Reads lines until one contains `prefix`; returns the line from `prefix` on. (The test
/// harness writes "test <name> ... " before the test's own output on the same line.)
fn line_starting(reader: &mut impl BufRead, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let read = reader.read_line(&mut line).unwrap();
        assert!(read > 0, "relay child exited before printing {prefix:?}");
        if let Some(start) = line.find(prefix) {
            return line[start..].trim().to_owned();
        }
    }
}

/// 300 concurrent connections each sending 1 MiB and checking the echo byte for byte;
/// returns the aggregate rate in MiB/s (bytes sent).
async fn bulk(addr: SocketAddr, source: &Arc<Vec<u8>>) -> f64 {
    let start = Instant::now();
    let transfers: Vec<_> = (0..CONNECTIONS)
        .map(|index| {
            let source = Arc::clone(source);
            tokio::spawn(async move {
                let offset = index * 4099 % PER_CONNECTION;
                let payload = &source[offset..offset + PER_CONNECTION];
                let stream = TcpStream::connect(addr).await.unwrap();
                let (mut read, mut write) = stream.into_split();
                let sender = {
                    let source = Arc::clone(&source);
                    tokio::spawn(async move {
                        let payload = &source[offset..offset + PER_CONNECTION];
                        write.write_all(payload).await.unwrap();
                        write.shutdown().await.unwrap();
                    })
                };
                let mut received = 0;
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    let n = read.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    assert!(received + n <= PER_CONNECTION, "{addr}: extra bytes");
                    assert!(
                        buf[..n] == payload[received..received + n],
                        "{addr}: bytes altered at offset {received}"
                    );
                    received += n;
                }
                assert_eq!(received, PER_CONNECTION, "{addr}: bytes lost");
                sender.await.unwrap();
            })
        })
        .collect();
    for transfer in transfers {
        tokio::time::timeout(Duration::from_secs(120), transfer)
            .await
            .expect("bulk transfer stalled")
            .unwrap();
    }
    (CONNECTIONS * PER_CONNECTION) as f64 / (1 << 20) as f64 / start.elapsed().as_secs_f64()
}

/// The child: a relay with a splice listener and a buffered one, running until stdin closes,
/// then printing the pipe pool's figures.
fn relay_child(upstream: SocketAddr) {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    raise_fd_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    let server = ProxyServer::new(server_config(), Arc::new(NoopObserver)).unwrap();
    let mut addrs = Vec::new();
    for mode in [CopyMode::Splice, CopyMode::Buffered] {
        let relay = RelayConfig::default().with_copy_mode(mode);
        let listener =
            ListenerConfig::new("127.0.0.1:0".parse().unwrap(), Route::new("echo", upstream))
                .with_relay(relay);
        addrs.push(server.add_listener(listener).unwrap().to_string());
    }
    println!("listening {}", addrs.join(" "));
    std::io::stdout().flush().unwrap();

    let mut rest = Vec::new();
    std::io::stdin().read_to_end(&mut rest).unwrap();
    runtime.block_on(server.shutdown(Duration::from_secs(1)));
    let stats = proxy_core::pipe::stats();
    println!(
        "stats uid={} budget={} peak_allocated={} created={} budget_exhausted={} resize_refused={}",
        rustix::process::getuid().as_raw(),
        stats.budget_bytes,
        stats.peak_allocated_bytes,
        stats.created,
        stats.budget_exhausted,
        stats.resize_refused
    );
}
