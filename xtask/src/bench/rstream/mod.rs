//! `bench rstream`: one TCP stream through rstream-client's in-process `LocalEngine` and a
//! published TCP tunnel (ingress -> engine -> TLS proxy leg -> client -> forward -> sink), next
//! to straight to the sink, to the official Python SDK (`rstreamlabs-rstream`) forwarding a
//! tunnel of the same engine, and to one rustls TLS stream over loopback with the same cipher
//! suite and pinning (the TLS ceiling of one stream, measured); and new-stream setup latency.
//!
//! Threads: the engine runs on its own tokio runtime on its own std thread, pinned to the
//! generator CPU; the tunnel client (or the Python SDK process) on its own runtime thread pinned
//! to the relay CPU; the generator and sink on this thread, pinned to the generator CPU. The CPU
//! time of the engine thread, of the generator thread and of the peer is measured during every
//! transfer, so the report shows which one is the bottleneck.
//!
//! This file holds the contenders' names, the sizes, the run and its goals; [`peers`] holds the
//! threads and peers the transfers go through, [`phases`] measures them, [`sink`] is the sink and
//! the generator's transfers.

mod peers;
mod phases;
mod sink;

use std::time::Duration;

use super::report::{Goal, Metric};
use super::system::{self, GENERATOR_CPU, RELAY_CPU};
use super::{Outcome, Settings};

use peers::{RuntimeThread, ensure_sdk};
use phases::measure;

const DIRECT: &str = "direct";
const TUNNEL: &str = "rstream tunnel";
const SDK: &str = "Python SDK";
const SDK_UVLOOP: &str = "Python SDK + uvloop";
const CEILING: &str = "rustls TLS 1.3 stream, loopback";
const TOKEN: &str = "bench-token";

/// The pinned SDK release (as in rstream-client/tests/python_interop.rs).
const SDK_VERSION: &str = "0.7.0";
/// uvloop, the event loop an SDK user after speed would pick.
const UVLOOP_VERSION: &str = "0.23.0";

const UPLOAD: Metric = Metric::higher("1 stream, upload", "Gbit/s");
const DOWNLOAD: Metric = Metric::higher("1 stream, download", "Gbit/s");
const SETUP_P50: Metric = Metric::lower("new stream: connect to first byte, p50", "µs");
const SETUP_P99: Metric = Metric::lower("new stream: connect to first byte, p99", "µs");
const ENGINE_BUSY: Metric =
    Metric::lower("engine thread CPU during 1-stream transfers", "% of a core");
const GENERATOR_BUSY: Metric = Metric::lower(
    "generator + sink thread CPU during 1-stream transfers",
    "% of a core",
);
const PEER_BUSY: Metric = Metric::lower(
    "peer (client thread or SDK process) CPU during 1-stream transfers",
    "% of a core",
);

struct Sizes {
    bulk_bytes: u64,
    setup_count: u64,
    cipher_time: Duration,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                bulk_bytes: 64 << 20,
                setup_count: 50,
                cipher_time: Duration::from_millis(300),
            }
        } else {
            Self {
                bulk_bytes: 512 << 20,
                setup_count: 500,
                cipher_time: Duration::from_secs(2),
            }
        }
    }
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let sizes = Sizes::new(settings.quick);
    let python = match ensure_sdk() {
        Ok(python) => Some(python),
        Err(error) => {
            eprintln!("rstream: the Python SDK is unavailable: {error:#}");
            None
        }
    };
    let engine_thread = RuntimeThread::start("bench-engine", GENERATOR_CPU)?;
    let client_thread = RuntimeThread::start("bench-client", RELAY_CPU)?;
    let generator = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let measured = system::with_cpu(GENERATOR_CPU, || {
        generator.block_on(measure(
            settings,
            &sizes,
            &engine_thread,
            &client_thread,
            python.as_deref(),
        ))
    })?;
    drop(generator);
    client_thread.stop();
    engine_thread.stop();
    let (recorder, sdk_info) = measured?;
    let mut figures = recorder.finish(&[DIRECT, CEILING, SDK, SDK_UVLOOP]);
    // The busy figures have no reference: their ratios say nothing.
    for figure in &mut figures {
        if figure.unit == "% of a core" {
            figure.references.clear();
            for series in &mut figure.series {
                series.ratios.clear();
            }
        }
    }
    // Throughput and setup first, then where the CPU time went.
    let order = [
        UPLOAD,
        DOWNLOAD,
        SETUP_P50,
        SETUP_P99,
        ENGINE_BUSY,
        PEER_BUSY,
        GENERATOR_BUSY,
    ];
    figures.sort_by_key(|f| order.iter().position(|m| m.name == f.name));
    let goals = goals(&figures);
    let mut notes = vec![
        format!(
            "Throughput: {} MiB per run over one connection, {} rounds, the contenders in a random order each round. The sink's protocol is length-prefixed (upload: the sink reads the announced length, then answers with the count; download: the client reads exactly the announced length), so no contender depends on half-close: the SDK's forwarder closes the whole stream when one direction ends. The tunnel path crosses the engine's TCP ingress, a TLS proxy leg to the peer and the peer's forward to the sink.",
            sizes.bulk_bytes >> 20,
            settings.rounds
        ),
        format!(
            "Ceiling: {CEILING} is measured, not modelled: one TLS 1.3 connection over loopback TCP with rustls and ring's TLS13_AES_256_GCM_SHA384 (the suite the tunnel's TLS leg negotiates) on both ends, the TLS server on CPU {GENERATOR_CPU} (the engine's) and the client on CPU {RELAY_CPU} (the peer's), as the tunnel's leg runs; plaintext moves one way (upload: server to client, as the engine seals an upload; download: client to server) in 256 KiB writes for {:?}, and the rate is the plaintext received from its first byte to close_notify. It takes a turn in each round like a contender. It has one TCP hop and no generator or sink: the most one TLS stream of this stack moves here.",
            sizes.cipher_time
        ),
        format!(
            "Setup: {} sequential new connections per round and contender, time from connect() to the first byte of the sink's answer (through a tunnel that includes the engine's ProxyConnReq, the peer's new TLS proxy leg and its connect to the sink).",
            sizes.setup_count
        ),
        format!(
            "CPU: the engine, the tunnel client and the generator + sink each run on their own thread (their own tokio runtime); the engine and the generator share CPU {GENERATOR_CPU}, the peer (the Rust client or the SDK process) has CPU {RELAY_CPU}. The busy figures are each thread's (or the SDK process's) CPU time during the transfers over their wall time, one sample per transfer, from /proc (10 ms ticks)."
        ),
    ];
    match sdk_info {
        Some(info) => notes.push(format!("Python SDK processes: {info}.")),
        None => notes.push(
            "Python SDK: not measured (the venv could not be prepared; see the bench's stderr)."
                .to_owned(),
        ),
    }
    Ok(Outcome {
        figures,
        goals,
        notes,
    })
}

/// Each contender's configuration, as the summary shows it.
pub fn contenders(_settings: &Settings) -> Vec<(&'static str, String)> {
    let engine = format!(
        "rstream-client LocalEngine on its own current-thread tokio runtime and std thread, pinned to CPU {GENERATOR_CPU} (shared with the generator)"
    );
    vec![
        (DIRECT, "generator to sink on loopback".to_owned()),
        (
            TUNNEL,
            format!(
                "{engine}; rstream-client (release build, rustls + ring) with a published TCP tunnel and forward::forward to the sink, on its own current-thread runtime pinned to CPU {RELAY_CPU}"
            ),
        ),
        (
            SDK,
            format!(
                "{engine}; rstreamlabs-rstream {SDK_VERSION} (CPython, asyncio default loop, ssl module / OpenSSL), a published TCP tunnel and the SDK's tunnel.forward_to to the sink, process pinned to CPU {RELAY_CPU}"
            ),
        ),
        (
            SDK_UVLOOP,
            format!(
                "as {SDK}, with uvloop {UVLOOP_VERSION} as the event loop (the fastest loop an SDK user can pick)"
            ),
        ),
        (
            CEILING,
            format!(
                "rustls 0.23 + ring TLS13_AES_256_GCM_SHA384 on both ends of one loopback TCP connection, server thread on CPU {GENERATOR_CPU}, client thread on CPU {RELAY_CPU}, one-way plaintext in 256 KiB writes"
            ),
        ),
    ]
}

/// The goals: the tunnel at least half the TLS ceiling, and at least twice the
/// faster SDK configuration.
fn goals(figures: &[super::report::Figure]) -> Vec<Goal> {
    let mut goals = Vec::new();
    for metric in [UPLOAD, DOWNLOAD] {
        let Some(figure) = figures.iter().find(|f| f.name == metric.name) else {
            continue;
        };
        let tunnel = figure.median(TUNNEL);
        let ceiling = figure.median(CEILING);
        let ratio = tunnel.zip(ceiling).map(|(t, c)| t / c);
        goals.push(Goal {
            goal: format!("{}: rstream tunnel >= 0.5x {CEILING}", metric.name),
            measured: match (tunnel, ceiling) {
                (Some(t), Some(c)) => format!("{t:.2} / {c:.2} Gbit/s = {:.2}x", t / c),
                _ => "not measured".to_owned(),
            },
            met: ratio.map(|r| r >= 0.5),
        });
        let sdk = [SDK, SDK_UVLOOP]
            .into_iter()
            .filter_map(|name| Some((name, figure.median(name)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        goals.push(Goal {
            goal: format!(
                "{}: rstream tunnel >= 2x the faster Python SDK configuration",
                metric.name
            ),
            measured: match (tunnel, sdk) {
                (Some(t), Some((name, s))) => {
                    format!("{t:.2} / {s:.3} Gbit/s ({name}) = {:.1}x", t / s)
                }
                _ => "not measured".to_owned(),
            },
            met: tunnel.zip(sdk).map(|(t, (_, s))| t / s >= 2.0),
        });
    }
    goals
}
