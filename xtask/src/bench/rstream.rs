//! `bench rstream`: one TCP stream through rstream-client's in-process `LocalEngine` and a
//! published TCP tunnel (ingress -> engine -> TLS proxy leg -> client -> forward -> sink) versus
//! straight to the sink; and new-stream setup latency.
//!
//! The engine and the client run on their own one-worker runtime pinned to the relay CPU; the
//! generator and sink run on this thread, pinned to the generator CPU.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use rstream_client::Client;
use rstream_client::engine::LocalEngine;
use rstream_client::tunnel::TunnelOptions;
use tokio::task::JoinHandle;

use super::load::{self, Direction, Sink};
use super::report::{Metric, Recorder};
use super::system::{self, GENERATOR_CPU, RELAY_CPU};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const TUNNEL: &str = "rstream tunnel";
const TOKEN: &str = "bench-token";

const UPLOAD: Metric = Metric::higher("1 stream, upload", "Gbit/s");
const DOWNLOAD: Metric = Metric::higher("1 stream, download", "Gbit/s");
const SETUP_P50: Metric = Metric::lower("new stream: connect to first byte, p50", "µs");
const SETUP_P99: Metric = Metric::lower("new stream: connect to first byte, p99", "µs");

/// The engine, the client's control channel and the forwarder of one published tunnel.
struct Tunnel {
    engine: LocalEngine,
    control: rstream_client::ControlChannel,
    ingress: SocketAddr,
    forward: JoinHandle<()>,
}

async fn open_tunnel(target: SocketAddr) -> anyhow::Result<Tunnel> {
    let engine = LocalEngine::builder().token(TOKEN).start().await?;
    let client = Client::builder()
        .engine(engine.engine_address())
        .token(TOKEN)
        .tls(engine.client_tls())
        .operation_timeout(Duration::from_secs(10))
        .build()?;
    let control = client.connect().await?;
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await?;
    let ingress = engine
        .ingress_addr(tunnel.id())
        .context("the published tunnel has no ingress")?;
    let forward = tokio::spawn(async move {
        // Ends when the tunnel closes at teardown.
        let _ = rstream_client::forward::forward(&mut tunnel, &target.to_string()).await;
    });
    Ok(Tunnel {
        engine,
        control,
        ingress,
        forward,
    })
}

async fn close_tunnel(tunnel: Tunnel) {
    let _ = tunnel.control.close().await;
    tunnel.forward.abort();
    tunnel.engine.shutdown().await;
}

/// A one-worker runtime whose threads run on the relay CPU.
fn relay_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let pin = system::can_pin();
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .on_thread_start(move || {
            if pin {
                // Unpinned is still correct, only noisier.
                let _ = system::pin_current_thread(RELAY_CPU);
            }
        })
        .build()?)
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let relay = relay_runtime()?;
    let generator = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let recorder = system::with_cpu(GENERATOR_CPU, || {
        generator.block_on(measure(settings, &relay))
    })??;
    drop(generator);
    relay.shutdown_timeout(Duration::from_secs(5));
    let bulk_mib = bulk_bytes(settings.quick) >> 20;
    Ok(Outcome {
        figures: recorder.finish(&[DIRECT]),
        goals: Vec::new(),
        notes: vec![
            format!(
                "Throughput: {bulk_mib} MiB per run over one connection, payload Gbit/s checked end to end; the tunnel path crosses the engine's TCP ingress, a TLS proxy leg to the client and the client's forward to the sink."
            ),
            format!(
                "Setup: {} sequential new connections per round, time from connect() to the first byte of the sink's answer (the tunnel path includes the engine's ProxyConnReq and the client's new TLS proxy leg).",
                setup_count(settings.quick)
            ),
            "Engine and client share one tokio worker on the relay CPU, so the tunnel column includes the engine's own cost too.".to_owned(),
        ],
    })
}

fn bulk_bytes(quick: bool) -> u64 {
    if quick { 64 << 20 } else { 1 << 30 }
}

fn setup_count(quick: bool) -> u64 {
    if quick { 50 } else { 500 }
}

async fn measure(settings: &Settings, relay: &tokio::runtime::Runtime) -> anyhow::Result<Recorder> {
    let sink = Sink::start().await?;
    let tunnel = relay.spawn(open_tunnel(sink.addr())).await??;
    let contenders = [(DIRECT, sink.addr()), (TUNNEL, tunnel.ingress)];
    let result = measure_contenders(settings, &contenders).await;
    relay.spawn(close_tunnel(tunnel)).await?;
    result
}

async fn measure_contenders(
    settings: &Settings,
    contenders: &[(&str, SocketAddr)],
) -> anyhow::Result<Recorder> {
    let mut recorder = Recorder::default();
    let bytes = bulk_bytes(settings.quick);
    eprintln!("rstream: throughput");
    for (direction, metric) in [(Direction::Upload, UPLOAD), (Direction::Download, DOWNLOAD)] {
        for _ in 0..settings.rounds {
            for (name, addr) in contenders {
                let elapsed = load::bulk(*addr, direction, 1, bytes)
                    .await
                    .with_context(|| format!("{} through {name}", metric.name))?;
                recorder.record(
                    metric,
                    name,
                    bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9,
                );
            }
        }
    }
    eprintln!("rstream: stream setup");
    for _ in 0..settings.rounds {
        for (name, addr) in contenders {
            let histogram = load::setup_latency(*addr, setup_count(settings.quick))
                .await
                .with_context(|| format!("stream setup through {name}"))?;
            let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1_000.0;
            recorder.record(SETUP_P50, name, us(0.5));
            recorder.record(SETUP_P99, name, us(0.99));
        }
    }
    Ok(recorder)
}
