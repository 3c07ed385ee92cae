//! `bench proxy`'s measured phases: bulk transfers, two-thread scaling, connection rates,
//! echo latency and idle memory, each recorded per contender and round, with every party's CPU.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;

use super::relays::{Contender, Relays};
use super::syscalls::EpollCounter;
use super::{
    BULK, CPU_PER_GIB, DIRECT, GIB, IDLE_FDS, IDLE_RSS, LATENCY_P50, LATENCY_P99, LATENCY_P999,
    SCALING, Workload, shuffled,
};
use crate::bench::Settings;
use crate::bench::load::{self, Sink};
use crate::bench::procs::{Measured, WindowCpu, Work};
use crate::bench::report::{self, Metric, Recorder};
use crate::bench::system;

/// A metric whose name is made at run time (figures per phase and party).
fn metric(name: String, unit: &'static str, higher_is_better: bool) -> Metric {
    let name: &'static str = Box::leak(name.into_boxed_str());
    if higher_is_better {
        Metric::higher(name, unit)
    } else {
        Metric::lower(name, unit)
    }
}

/// One window's busy fractions: relay (none for direct), generator, sink.
type BusySample = (Option<f64>, f64, f64);

/// CPU busy (CPU seconds per second of window) of each party, per phase and contender, for the
/// report's note: which process was the bottleneck.
#[derive(Default)]
pub(super) struct Busy {
    /// (phase, contender) -> samples of (relay, generator, sink).
    samples: BTreeMap<(String, &'static str), Vec<BusySample>>,
}

impl Busy {
    fn add(&mut self, phase: &str, contender: &'static str, cpu: WindowCpu, seconds: f64) {
        self.samples
            .entry((phase.to_owned(), contender))
            .or_default()
            .push((
                cpu.relay.map(|r| r / seconds),
                cpu.generator / seconds,
                cpu.sink / seconds,
            ));
    }

    pub(super) fn note(&self) -> String {
        let mut phases: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for ((phase, contender), samples) in &self.samples {
            let mut relay: Vec<f64> = samples.iter().filter_map(|s| s.0).collect();
            let mut generator: Vec<f64> = samples.iter().map(|s| s.1).collect();
            let mut sink: Vec<f64> = samples.iter().map(|s| s.2).collect();
            let shown = |values: &mut Vec<f64>| {
                median(values).map_or_else(|| "—".to_owned(), |m| format!("{m:.2}"))
            };
            phases.entry(phase).or_default().push(format!(
                "{contender} {}/{}/{}",
                shown(&mut relay),
                shown(&mut generator),
                shown(&mut sink)
            ));
        }
        let text: Vec<String> = phases
            .into_iter()
            .map(|(phase, entries)| format!("{phase}: {}", entries.join(", ")))
            .collect();
        format!(
            "CPU busy in each measured window, relay/generator/sink in CPU seconds per second (1.00 is a whole CPU; median of rounds; — for direct, which has no relay): {}.",
            text.join("; ")
        )
    }
}

/// One window of one contender in one round, as the recording helpers take it.
#[derive(Clone, Copy)]
struct Run<'a> {
    phase: &'a str,
    contender: &'static str,
    round: usize,
    cpu: WindowCpu,
    /// CPU time below this is not resolved by the clock in use.
    min_cpu: f64,
}

/// Records the cost of every party for one run: CPU per `amount` of work (`per` of it).
fn record_costs(
    recorder: &mut Recorder,
    run: Run<'_>,
    amount: f64,
    scale: f64,
    (per, unit): (&str, &'static str),
) {
    let Run {
        phase,
        contender,
        round,
        cpu,
        min_cpu,
    } = run;
    if amount <= 0.0 {
        return;
    }
    let parties = [
        ("relay", cpu.relay),
        ("generator", Some(cpu.generator)),
        ("sink", Some(cpu.sink)),
    ];
    for (party, seconds) in parties {
        let figure = metric(format!("{phase}: {party} CPU per {per}"), unit, false);
        match seconds {
            Some(seconds) if seconds >= min_cpu => {
                recorder.record_round(figure, contender, round, seconds * scale / amount);
            }
            Some(_) => recorder.note(figure, contender, "too little CPU time to resolve"),
            None => recorder.note(figure, contender, "no relay process"),
        }
    }
}

/// Records what the kernel counted in one run per `amount` of work (`per`: "connection" or
/// "MiB"): TCP segments on loopback (every hop: generator, relay and sink; OutSegs, each segment
/// once), the relay's voluntary context switches (its wake-ups: each is a sleep in
/// `epoll_wait` that an event ended), and for connections the connects per connection, which
/// shows whether anything else used TCP in this network namespace during the window.
fn record_counts(recorder: &mut Recorder, run: Run<'_>, amount: f64, per: &str) {
    if amount <= 0.0 {
        return;
    }
    let Run {
        phase,
        contender,
        round,
        cpu,
        ..
    } = run;
    let segments = metric(
        format!("{phase}: TCP segments per {per}"),
        "segments",
        false,
    );
    recorder.record_round(segments, contender, round, cpu.tcp.out_segs as f64 / amount);
    let wakeups = metric(
        format!("{phase}: relay wake-ups per {per} (voluntary context switches)"),
        "switches",
        false,
    );
    match cpu.relay_switches {
        Some((voluntary, _)) => {
            recorder.record_round(wakeups, contender, round, voluntary as f64 / amount);
        }
        None => recorder.note(wakeups, contender, "no relay process"),
    }
    if per == "connection" {
        let connects = metric(
            format!(
                "{phase}: connects per connection (ActiveOpens; 2 through a relay, 1 direct: more means other TCP traffic in the window)"
            ),
            "connects",
            false,
        );
        recorder.record_round(
            connects,
            contender,
            round,
            cpu.tcp.active_opens as f64 / amount,
        );
    }
}

/// Records one bulk run (its throughput, every party's CPU per GiB, the busy share) and returns
/// the bytes it moved.
fn record_bulk_run(
    recorder: &mut Recorder,
    busy: &mut Busy,
    run: Run<'_>,
    throughput: Metric,
    measured: &Measured,
) -> f64 {
    let bytes = measured.bytes as f64;
    recorder.record_round(
        throughput,
        run.contender,
        run.round,
        bytes * 8.0 / measured.seconds / 1e9,
    );
    record_costs(recorder, run, bytes / GIB, 1.0, ("GiB", "CPU s/GiB"));
    record_counts(recorder, run, bytes / f64::from(1u32 << 20), "MiB");
    busy.add(run.phase, run.contender, run.cpu, measured.seconds);
    bytes
}

/// After the rounds of a phase: each relay's `epoll_wait` calls per `per` ("connection" or
/// "MiB") in one extra window with `perf stat` attached, outside the CPU figures.
fn count_epoll_waits(
    epoll: Option<&EpollCounter>,
    (phase, work, per): (&str, Work, &str),
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    let Some(counter) = epoll else {
        return Ok(());
    };
    let figure = metric(
        format!("{phase}: relay epoll_wait calls per {per} (perf stat, one extra window)"),
        "calls",
        false,
    );
    for contender in contenders.iter_mut() {
        match counter.count(contender, work, workload)? {
            Some((calls, measured)) => {
                let amount = if per == "MiB" {
                    measured.bytes as f64 / f64::from(1u32 << 20)
                } else {
                    measured.completed as f64
                };
                if amount > 0.0 {
                    recorder.record(figure, contender.name, calls as f64 / amount);
                }
            }
            None => recorder.note(figure, contender.name, "no relay process"),
        }
    }
    Ok(())
}

/// Bulk transfers: throughput and every party's CPU per GiB, per run and over a round's runs.
pub(super) fn bulk(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    (busy, epoll): (&mut Busy, Option<&EpollCounter>),
) -> anyhow::Result<()> {
    // (contender, round) -> (relay CPU seconds, bytes) over that round's bulk runs.
    let mut per_round: BTreeMap<(&'static str, usize), (f64, f64)> = BTreeMap::new();
    for (streams, download, phase) in BULK {
        eprintln!("proxy: {phase}");
        let throughput = metric(phase.to_owned(), "Gbit/s", true);
        for round in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let (measured, cpu) = contender.run(Work::Bulk { download, streams }, workload)?;
                let run = Run {
                    phase,
                    contender: contender.name,
                    round,
                    cpu,
                    min_cpu: contender.min_cpu_seconds(),
                };
                let bytes = record_bulk_run(recorder, busy, run, throughput, &measured);
                if let Some(relay) = cpu.relay {
                    let entry = per_round.entry((contender.name, round)).or_default();
                    entry.0 += relay;
                    entry.1 += bytes;
                }
            }
        }
        let work = Work::Bulk { download, streams };
        count_epoll_waits(epoll, (phase, work, "MiB"), workload, contenders, recorder)?;
    }
    recorder.note(CPU_PER_GIB, DIRECT, "no relay process");
    for ((name, round), (seconds, bytes)) in per_round {
        recorder.record_round(CPU_PER_GIB, name, round, seconds / (bytes / GIB));
    }
    Ok(())
}

/// Eight streams through relays with two worker threads each.
pub(super) fn scaling(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    busy: &mut Busy,
) -> anyhow::Result<()> {
    for (download, phase) in SCALING {
        eprintln!("proxy: {phase}");
        let throughput = metric(phase.to_owned(), "Gbit/s", true);
        for round in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let work = Work::Bulk {
                    download,
                    streams: 8,
                };
                let (measured, cpu) = contender.run(work, workload)?;
                let run = Run {
                    phase,
                    contender: contender.name,
                    round,
                    cpu,
                    min_cpu: contender.min_cpu_seconds(),
                };
                record_bulk_run(recorder, busy, run, throughput, &measured);
            }
        }
    }
    Ok(())
}

/// Connection rate: a closed loop of 16 (capacity under this machine's hand-offs) and open loops
/// at fixed offered rates (latency and cost at a given load).
pub(super) fn connections(
    settings: &Settings,
    workload: &Workload,
    phases: &[(String, Work)],
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    (busy, epoll): (&mut Busy, Option<&EpollCounter>),
) -> anyhow::Result<()> {
    let mut failures: BTreeMap<(String, &str), (u64, u64, u64)> = BTreeMap::new();
    for (phase, work) in phases {
        let (phase, work) = (phase.clone(), *work);
        eprintln!("proxy: {phase}");
        let rate = metric(format!("{phase}: completed connections"), "conn/s", true);
        let p50 = metric(format!("{phase}: connect to first byte, p50"), "µs", false);
        let p99 = metric(format!("{phase}: connect to first byte, p99"), "µs", false);
        for round in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let (measured, cpu) = contender.run(work, workload)?;
                let name = contender.name;
                recorder.record_round(
                    rate,
                    name,
                    round,
                    measured.completed as f64 / measured.seconds,
                );
                recorder.record_round(p50, name, round, measured.p50_us);
                recorder.record_round(p99, name, round, measured.p99_us);
                let run = Run {
                    phase: &phase,
                    contender: name,
                    round,
                    cpu,
                    min_cpu: contender.min_cpu_seconds(),
                };
                let completed = measured.completed as f64;
                record_costs(
                    recorder,
                    run,
                    completed / 1e3,
                    1e3,
                    ("1000 connections", "CPU ms"),
                );
                record_counts(recorder, run, completed, "connection");
                if let Work::Open { .. } = work {
                    let relay_busy =
                        metric(format!("{phase}: relay CPU busy"), "% of a core", false);
                    match cpu.relay {
                        Some(relay) => recorder.record_round(
                            relay_busy,
                            contender.name,
                            round,
                            relay * 100.0 / measured.seconds,
                        ),
                        None => recorder.note(relay_busy, contender.name, "no relay process"),
                    }
                }
                busy.add(&phase, contender.name, cpu, measured.seconds);
                let entry = failures.entry((phase.clone(), contender.name)).or_default();
                entry.0 += measured.completed;
                entry.1 += measured.failed;
                entry.2 += measured.late_starts;
            }
        }
        let counting = (phase.as_str(), work, "connection");
        count_epoll_waits(epoll, counting, workload, contenders, recorder)?;
    }
    for ((phase, name), (completed, failed, late)) in failures {
        if failed > 0 || late > 0 {
            eprintln!(
                "proxy: {phase} through {name}: {failed} failed or timed out, {late} started over 2 ms late, {completed} completed"
            );
        }
    }
    Ok(())
}

pub(super) fn latency(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    busy: &mut Busy,
) -> anyhow::Result<()> {
    eprintln!("proxy: latency");
    let work = Work::Latency {
        rate: workload.latency_rate,
        size: workload.latency_message,
    };
    let timing = Workload {
        warmup: Duration::ZERO,
        measure: workload.latency_duration,
        ..Workload::new(settings)
    };
    for round in 0..settings.rounds {
        for index in shuffled(contenders.len()) {
            let contender = &mut contenders[index];
            let (measured, cpu) = contender.run(work, &timing)?;
            let name = contender.name;
            recorder.record_round(LATENCY_P50, name, round, measured.p50_us);
            recorder.record_round(LATENCY_P99, name, round, measured.p99_us);
            recorder.record_round(LATENCY_P999, name, round, measured.p999_us);
            busy.add(
                "1 KiB echo at 5k msg/s",
                contender.name,
                cpu,
                measured.seconds,
            );
        }
    }
    Ok(())
}

fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    (!values.is_empty()).then(|| report::median_of_sorted(values))
}

/// RSS per idle connection, each round in fresh relay processes so earlier runs' allocations do
/// not hide the cost, towards a fresh sink port whose 4-tuples carry no TIME_WAIT history from
/// the connection-rate runs.
pub(super) async fn idle_memory(
    settings: &Settings,
    workload: &Workload,
    relays: &Relays,
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    eprintln!("proxy: idle connections");
    recorder.note(IDLE_RSS, DIRECT, "no relay process");
    recorder.note(IDLE_FDS, DIRECT, "no relay process");
    let names: Vec<_> = relays
        .names()
        .into_iter()
        .filter(|n| *n != DIRECT)
        .collect();
    for round in 0..settings.rounds {
        for index in shuffled(names.len()) {
            let name = names[index];
            let sink = Sink::start().await?;
            let (addr, service) = relays.start_with(name, sink.addr(), true)?;
            let mut service = service.context("relay without a process")?;
            let pid = service.pid();
            let before = system::rss_kib(pid)?;
            let fds_before = system::fd_count(pid)?;
            let held = load::hold_idle(addr, workload.idle_connections, &sink)
                .await
                .with_context(|| format!("idle connections through {name}"))?;
            // Let the relay go quiet (deferred frees, lazy setup) before reading its memory.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let after = system::rss_kib(pid)?;
            let fds_after = system::fd_count(pid)?;
            service.check_running()?;
            drop(held);
            let per_connection =
                after.saturating_sub(before) as f64 / workload.idle_connections as f64;
            recorder.record_round(IDLE_RSS, name, round, per_connection);
            let fds =
                fds_after.saturating_sub(fds_before) as f64 / workload.idle_connections as f64;
            recorder.record_round(IDLE_FDS, name, round, fds);
        }
    }
    Ok(())
}
