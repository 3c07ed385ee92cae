//! A minimal TCP relay: one listener, one upstream (or a comma-separated set), graceful drain
//! on Ctrl-C.
//!
//! ```text
//! cargo run -p examples --example tcp_relay -- --listen 127.0.0.1:8080 --upstream 127.0.0.1:9000
//! ```

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use prometheus_client::registry::Registry;
use proxy_core::copy::CopyMode;
use proxy_core::metrics::PrometheusObserver;
use proxy_core::relay::{RelayConfig, Route};
use proxy_core::server::{DataPath, ListenerConfig, ProxyServer, ServerConfig};
use proxy_core::socket::{Keepalive, SocketOptions};
use proxy_core::upstream::Upstream;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    Auto,
    Buffered,
    Splice,
}

/// Relay TCP connections from a local address to an upstream.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long)]
    listen: SocketAddr,
    /// Upstream `host:port`, or several separated by commas (round-robin with failover).
    #[arg(long)]
    upstream: String,
    /// How bytes are copied.
    #[arg(long, value_enum, default_value = "auto")]
    copy_mode: Mode,
    /// Upstream connect timeout, in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    connect_timeout_ms: u64,
    /// Close connections idle for this many seconds (0: never).
    #[arg(long, default_value_t = 0)]
    idle_timeout_secs: u64,
    /// Most connections open at once (unlimited if absent).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Send a PROXY protocol v2 header to the upstream.
    #[arg(long)]
    proxy_protocol: bool,
    /// How long in-flight connections may finish after Ctrl-C, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Pipe size of the splice path, in bytes.
    #[arg(long, default_value_t = proxy_core::relay::DEFAULT_PIPE_SIZE)]
    pipe_size: usize,
    /// Turn TCP keepalive off on both legs (it is on by default: 60 s idle, 10 s interval).
    #[arg(long)]
    no_keepalive: bool,
    /// Bytes of pipe buffer the process may hold (default: a quarter of the user's
    /// pipe-user-pages-soft).
    #[arg(long)]
    pipe_budget: Option<usize>,
    /// Runtime threads: 1 runs one event loop on the main thread (tokio's current-thread
    /// runtime), more a multi-thread runtime with that many workers (at most 1024) [default: one
    /// per CPU].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    threads: Option<u16>,
    /// With --threads N: N event loops of their own, each accepting on its own listening socket
    /// (SO_REUSEPORT) and relaying what it accepted, instead of one runtime whose N workers share
    /// one listener.
    #[arg(long, requires = "threads")]
    listener_per_thread: bool,
    /// What relays the connections: `tokio` (a task each), `event-loop` (Linux: connection
    /// state machines on event-loop threads of the server's own, as many as --threads with
    /// --listener-per-thread, else one) or `auto`.
    #[arg(long, default_value = "tokio")]
    data_path: DataPath,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let mut runtime = match args.threads {
        // The relaying happens on the server's own threads; this one only waits for Ctrl-C.
        _ if args.listener_per_thread => tokio::runtime::Builder::new_current_thread(),
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        threads => {
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if let Some(workers) = threads {
                builder.worker_threads(usize::from(workers));
            }
            builder
        }
    };
    runtime.enable_all().build()?.block_on(relay(args))
}

async fn relay(args: Args) -> anyhow::Result<()> {
    let upstream: Upstream = args.upstream.parse().context("--upstream")?;
    let copy_mode = match args.copy_mode {
        Mode::Auto => CopyMode::Auto,
        Mode::Buffered => CopyMode::Buffered,
        Mode::Splice => CopyMode::Splice,
    };
    let relay = RelayConfig::default()
        .with_copy_mode(copy_mode)
        .with_pipe_size(args.pipe_size)
        .with_socket_options(
            SocketOptions::default().with_keepalive((!args.no_keepalive).then(Keepalive::default)),
        )
        .with_connect_timeout(Duration::from_millis(args.connect_timeout_ms))
        .with_idle_timeout(
            (args.idle_timeout_secs > 0).then(|| Duration::from_secs(args.idle_timeout_secs)),
        );
    let route = Route::new("upstream", upstream).with_proxy_protocol(args.proxy_protocol);
    let listener = ListenerConfig::new(args.listen, route)
        .with_relay(relay)
        .with_max_connections(args.max_connections);

    if let Some(budget) = args.pipe_budget {
        proxy_core::pipe::set_budget(budget);
    }
    // The Prometheus observer the binaries use, so the relay pays for its metrics; the registry
    // is not served here.
    let mut registry = Registry::default();
    let metrics = Arc::new(PrometheusObserver::register(&mut registry));
    let workers = args
        .listener_per_thread
        .then(|| {
            args.threads
                .and_then(|threads| NonZeroUsize::new(usize::from(threads)))
        })
        .flatten();
    let server = ProxyServer::new(
        ServerConfig::default()
            .with_accept_workers(workers)
            .with_data_path(args.data_path),
        metrics,
    )?;
    let bound = server.add_listener(listener)?;
    println!("relaying {bound} -> {}", args.upstream);

    tokio::signal::ctrl_c().await?;
    println!("draining for up to {} s", args.drain_secs);
    let report = server.shutdown(Duration::from_secs(args.drain_secs)).await;
    println!(
        "done: {} finished, {} closed at the deadline",
        report.finished, report.forced
    );
    Ok(())
}
