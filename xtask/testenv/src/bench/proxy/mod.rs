//! `bench proxy`: the same workloads direct, through proxy-core (`examples/tcp_relay`, with the
//! Prometheus observer the binaries use) and through HAProxy (`mode tcp`) in two configurations,
//! each reported on its own: `option splice-auto`, and forced splicing (`option splice-request` +
//! `option splice-response`), both with proxy-core's pipe size.
//!
//! The generator and the sink are processes of their own ([`procs`](super::procs)), pinned to
//! the generator CPU; one-thread relays run pinned to the relay CPU. Every run has a warm-up, then
//! a measured window, and the CPU time of the relay, the generator and the sink is read at both
//! ends of the window: the primary figures are what each relay costs (CPU seconds per GiB, CPU ms
//! per 1 000 connections), with the throughput and rate beside them. Rounds run the contenders in
//! a random order. The prose of the report is `proxy_notes.md`, filled with this run's figures.
//!
//! This file holds the contenders' names, the workload and the run; [`relays`] starts the
//! contenders, [`phases`] measures them, [`profile`](mod@profile) runs `--profile` and reads its
//! files back, [`goals`](mod@goals) judges the figures and writes the report's prose.

mod goals;
mod phases;
mod profile;
mod relays;
mod syscalls;

use std::path::PathBuf;
use std::time::Duration;

use super::cgroup::CpuMeter;
use super::procs::Work;
use super::report::{Metric, Recorder};
use super::system::{self, GENERATOR_CPU};
use super::{Outcome, Settings};

use goals::{configuration, goals, notes};
use phases::{Busy, bulk, connections, idle_memory, latency, scaling};
use profile::profile;
use relays::{Relays, Sinks, ensure_haproxy, idle_maxconn};
use syscalls::EpollCounter;

pub use relays::contenders;

const DIRECT: &str = "direct";
const PROXY_CORE: &str = "proxy-core";
const HAPROXY_AUTO: &str = "haproxy splice-auto";
const HAPROXY_FORCED: &str = "haproxy forced splice";
const PROXY_CORE_2T: &str = "proxy-core 2 threads";
/// The third one-thread contender: proxy-core's connection state machines on its own event loop
/// (`tcp_relay --data-path event-loop`), measured whenever the `tcp_relay` built here has that
/// flag (see [`relays::Relays::data_path`]); the goals judge it as they judge [`PROXY_CORE`],
/// which then runs with `--data-path tokio`.
const PROXY_CORE_EVENT_LOOP: &str = "proxy-core event loop";
/// The bench's io_uring probe ([`crate::bench::uring_probe`]): a featureless relay that shows
/// the kernel's share of a connection. Measured in the connection phases only, where the
/// kernel allows rings; no goal judges it.
const URING_PROBE: &str = "io_uring probe (featureless)";
/// Two event loops with a listening socket each (`SO_REUSEPORT`), against [`PROXY_CORE_2T`]'s
/// one runtime whose two workers share a listener.
const PROXY_CORE_2L: &str = "proxy-core 2 threads, listener per thread";
/// Another build of `tcp_relay` (e.g. before a change), when `NETKIT_BENCH_BASELINE_RELAY`
/// names one: measured in the same rounds, so before and after share the run's noise.
const PROXY_CORE_BASELINE: &str = "proxy-core baseline";
const BASELINE_ENV: &str = "NETKIT_BENCH_BASELINE_RELAY";
const HAPROXY_AUTO_2T: &str = "haproxy splice-auto nbthread 2";
const HAPROXY_FORCED_2T: &str = "haproxy forced splice nbthread 2";

/// Pipe size of both relays' splice paths (proxy-core's default).
const PIPE_SIZE: usize = 1 << 20;

const GIB: f64 = (1u64 << 30) as f64;

/// Where `--profile` writes its files, relative to the workspace root (committed with the
/// report; the bound notes cite them).
pub const PROFILE_DIR: &str = "xtask/bench-profile";

/// How much each workload does; `--quick` shrinks everything.
struct Workload {
    warmup: Duration,
    measure: Duration,
    latency_rate: u32,
    latency_duration: Duration,
    latency_message: usize,
    connection_concurrency: usize,
    open_rates: [u32; 2],
    idle_connections: usize,
}

impl Workload {
    fn new(settings: &Settings) -> Self {
        let quick = settings.quick;
        let wanted_idle: u64 = if quick { 1_000 } else { 10_000 };
        // Idle connections need two descriptors in the relay (no pipe) and two in this process
        // (the client and the sink's side); HAProxy wants the limit to cover 2.5 x maxconn.
        let fitting_idle = idle_maxconn(settings.fd_limit);
        Self {
            warmup: Duration::from_millis(if quick { 300 } else { 1_000 }),
            measure: Duration::from_millis(if quick { 1_000 } else { 5_000 }),
            latency_rate: 5_000,
            latency_duration: Duration::from_millis(if quick { 600 } else { 4_000 }),
            latency_message: 1024,
            connection_concurrency: 16,
            open_rates: [2_000, 5_000],
            idle_connections: wanted_idle.min(fitting_idle) as usize,
        }
    }
}

/// Bulk runs: streams, download?, name.
const BULK: [(usize, bool, &str); 4] = [
    (1, false, "bulk 1 stream, upload"),
    (1, true, "bulk 1 stream, download"),
    (8, false, "bulk 8 streams, upload"),
    (8, true, "bulk 8 streams, download"),
];
const SCALING: [(bool, &str); 2] = [
    (false, "bulk 8 streams, upload, 2 relay threads"),
    (true, "bulk 8 streams, download, 2 relay threads"),
];
/// Over every one-thread bulk run of a round: the goal's figure.
const CPU_PER_GIB: Metric =
    Metric::lower("relay CPU per GiB (all 1-thread bulk runs)", "CPU s/GiB");
const LATENCY_P50: Metric = Metric::lower("1 KiB echo at 5k msg/s, p50", "µs");
const LATENCY_P99: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99", "µs");
const LATENCY_P999: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99.9", "µs");
const CLOSED_PHASE: &str = "connections, closed loop of 16";
const CLOSED_2T_PHASE: &str = "connections, closed loop of 16, 2 relay threads";
const IDLE_RSS: Metric = Metric::lower("relay RSS per idle connection", "KiB");
const IDLE_FDS: Metric = Metric::lower("relay descriptors per idle connection", "fds");

/// The open-loop phase at `rate` connections per second.
fn open_phase(rate: u32) -> String {
    format!("connections, open loop at {rate}/s")
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let tcp_relay = system::cargo_build_release(&["-p", "examples", "--example", "tcp_relay"])?;
    let mut notes = Vec::new();
    let haproxy = ensure_haproxy(&mut notes);
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-proxy-")
        .tempdir()?;
    let baseline = std::env::var_os(BASELINE_ENV).map(PathBuf::from);
    let data_path = relays::has_data_path_flag(&tcp_relay);
    let probe = crate::bench::uring_probe::available();
    if !probe {
        notes.push(format!(
            "This process cannot make an io_uring here: the {URING_PROBE} is not measured."
        ));
    }
    let relays = Relays {
        data_path,
        probe,
        tcp_relay,
        baseline,
        haproxy,
        dir: dir.path().to_path_buf(),
        fd_limit: settings.fd_limit,
        meter: std::sync::Arc::new(CpuMeter::new()),
    };
    let workload = Workload::new(settings);
    let mut recorder = Recorder::default();
    let mut busy = Busy::default();
    let epoll = EpollCounter::probe();
    let sinks = Sinks::start(&relays.meter, &relays.dir)?;
    {
        let mut contenders = relays
            .names()
            .into_iter()
            .map(|name| relays.start(name, &sinks))
            .collect::<anyhow::Result<Vec<_>>>()?;
        bulk(
            settings,
            &workload,
            &mut contenders,
            &mut recorder,
            (&mut busy, epoll.as_ref()),
        )?;
        let mut phases = vec![(
            CLOSED_PHASE.to_owned(),
            Work::Closed {
                concurrency: workload.connection_concurrency,
            },
        )];
        for rate in workload.open_rates {
            phases.push((open_phase(rate), Work::Open { rate }));
        }
        if relays.probe {
            contenders.push(relays.start(URING_PROBE, &sinks)?);
        }
        connections(
            settings,
            &workload,
            &phases,
            &mut contenders,
            &mut recorder,
            (&mut busy, epoll.as_ref()),
        )?;
        if relays.probe {
            contenders.pop();
        }
        latency(
            settings,
            &workload,
            &mut contenders,
            &mut recorder,
            &mut busy,
        )?;
        if settings.profile {
            profile(&workload, &mut contenders, &mut notes)?;
        }
    }
    {
        let mut contenders = relays
            .scaling_names()
            .into_iter()
            .map(|name| relays.start(name, &sinks))
            .collect::<anyhow::Result<Vec<_>>>()?;
        scaling(
            settings,
            &workload,
            &mut contenders,
            &mut recorder,
            &mut busy,
        )?;
        let closed = Work::Closed {
            concurrency: workload.connection_concurrency,
        };
        connections(
            settings,
            &workload,
            &[(CLOSED_2T_PHASE.to_owned(), closed)],
            &mut contenders,
            &mut recorder,
            (&mut busy, None),
        )?;
    }
    drop(sinks);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The idle phase's generator and sink live on this thread, on the generator CPU.
    system::with_cpu(GENERATOR_CPU, || {
        runtime.block_on(idle_memory(settings, &workload, &relays, &mut recorder))
    })??;
    drop(runtime);
    let references: &[&str] = if relays.baseline.is_some() {
        &[DIRECT, HAPROXY_FORCED, HAPROXY_AUTO, PROXY_CORE_BASELINE]
    } else {
        &[DIRECT, HAPROXY_FORCED, HAPROXY_AUTO]
    };
    let figures = recorder.finish(references);
    let goals = goals(&figures);
    notes.push(format!("{}.", relays.meter.describe()));
    notes.push(busy.note());
    notes.extend(self::notes(settings, &workload, &figures));
    notes.extend(configuration(&relays));
    Ok(Outcome {
        figures,
        goals,
        notes,
    })
}

/// The indices `0..len` in a random order (a new one at each call), so that no contender always
/// runs first or right after another one.
pub(super) fn shuffled(len: usize) -> Vec<usize> {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    let mut indices: Vec<usize> = (0..len).collect();
    indices.sort_by_key(|index| state.hash_one(index));
    indices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffled_is_a_permutation() {
        let mut order = shuffled(5);
        order.sort_unstable();
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
    }
}
