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

use super::report::{Goal, Metric, notes_from};
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
/// The report's prose, filled with this run's settings.
const NOTES_TEMPLATE: &str = include_str!("rstream_notes.md");

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
    let mut notes = notes_from(
        NOTES_TEMPLATE,
        &[
            ("bulk_mib", (sizes.bulk_bytes >> 20).to_string()),
            ("rounds", settings.rounds.to_string()),
            ("ceiling", CEILING.to_owned()),
            ("generator_cpu", GENERATOR_CPU.to_string()),
            ("relay_cpu", RELAY_CPU.to_string()),
            ("cipher_time", format!("{:?}", sizes.cipher_time)),
            ("setup_count", sizes.setup_count.to_string()),
        ],
    );
    notes.extend(bounds(&figures));
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

/// What bounds the tunnel where it stays under twice the faster SDK, computed from this run's
/// figures: whether one TLS stream of this stack (the ceiling, measured in the same rounds)
/// could move that much at all.
fn bounds(figures: &[super::report::Figure]) -> Vec<String> {
    let mut notes = Vec::new();
    for metric in [UPLOAD, DOWNLOAD] {
        let Some(figure) = figures.iter().find(|f| f.name == metric.name) else {
            continue;
        };
        let sdk = [SDK, SDK_UVLOOP]
            .into_iter()
            .filter_map(|name| Some((name, figure.median(name)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let (Some(tunnel), Some(ceiling), Some((sdk_name, sdk))) =
            (figure.median(TUNNEL), figure.median(CEILING), sdk)
        else {
            continue;
        };
        let wanted = 2.0 * sdk;
        if tunnel >= wanted {
            continue;
        }
        let what_bounds = if ceiling < wanted {
            format!(
                "the goal asks {wanted:.2} Gbit/s, more than one TLS stream of this stack moves here ({CEILING}: {ceiling:.2}), and the tunnel already reaches {:.2}x of that stream; a tunnel over one TLS connection cannot meet it on this machine",
                tunnel / ceiling
            )
        } else {
            format!(
                "the {CEILING} ({ceiling:.2}) leaves room above {wanted:.2} Gbit/s, and the tunnel reaches {:.2}x of it: the gap is in the tunnel, not explained by this run",
                tunnel / ceiling
            )
        };
        notes.push(format!(
            "Bound, {}: tunnel {tunnel:.2} Gbit/s against {sdk:.3} ({sdk_name}); {what_bounds}.",
            metric.name
        ));
    }
    notes
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
            met: ratio.map(|r| r >= 0.5).into(),
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
            met: tunnel.zip(sdk).map(|(t, (_, s))| t / s >= 2.0).into(),
        });
    }
    goals
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::Recorder;

    #[test]
    fn bounds_say_whether_one_tls_stream_could_meet_the_sdk_goal() {
        let mut recorder = Recorder::default();
        // Upload: twice the SDK is above the ceiling. Download: the ceiling leaves room.
        for (contender, up, down) in [
            (TUNNEL, 6.0, 5.0),
            (CEILING, 6.0, 12.0),
            (SDK, 3.3, 3.0),
            (SDK_UVLOOP, 3.1, 2.0),
        ] {
            recorder.record(UPLOAD, contender, up);
            recorder.record(DOWNLOAD, contender, down);
        }
        let notes = bounds(&recorder.finish(&[DIRECT]));
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].starts_with("Bound, 1 stream, upload: tunnel 6.00 Gbit/s against 3.300 (Python SDK); the goal asks 6.60 Gbit/s"), "{}", notes[0]);
        assert!(notes[0].contains("cannot meet it"), "{}", notes[0]);
        assert!(
            notes[1].contains("the gap is in the tunnel"),
            "{}",
            notes[1]
        );

        let mut met = Recorder::default();
        for (contender, up) in [(TUNNEL, 7.0), (CEILING, 7.5), (SDK, 3.0)] {
            met.record(UPLOAD, contender, up);
        }
        assert!(
            bounds(&met.finish(&[DIRECT])).is_empty(),
            "a met goal needs no bound"
        );
    }
}
