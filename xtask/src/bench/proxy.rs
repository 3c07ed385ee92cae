//! `bench proxy`: the same workloads direct, through proxy-core (`examples/tcp_relay`, with the
//! Prometheus observer the binaries use) and through HAProxy (`mode tcp`) in two configurations,
//! each reported on its own: `option splice-auto`, and forced splicing (`option splice-request` +
//! `option splice-response`), both with proxy-core's pipe size.
//!
//! The generator and the sink are processes of their own ([`procs`]), pinned to the generator
//! CPU; one-thread relays run pinned to the relay CPU. Every run has a warm-up, then a measured
//! window, and the CPU time of the relay, the generator and the sink is read at both ends of the
//! window: the primary figures are what each relay costs (CPU seconds per GiB, CPU ms per 1 000
//! connections), with the throughput and rate beside them. Rounds run the contenders in a random
//! order. The prose of the report is `proxy_notes.md`, filled with this run's figures.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;

use super::load::{self, Sink};
use super::procs::{self, Measured, SinkProcess, WindowCpu, Work};
use super::report::{self, Figure, Goal, Metric, Recorder};
use super::system::{self, GENERATOR_CPU, RELAY_CPU, Service};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const PROXY_CORE: &str = "proxy-core";
const HAPROXY_AUTO: &str = "haproxy splice-auto";
const HAPROXY_FORCED: &str = "haproxy forced splice";
const PROXY_CORE_2T: &str = "proxy-core 2 threads";
/// Another build of `tcp_relay` (e.g. before a change), when `NETKIT_BENCH_BASELINE_RELAY`
/// names one: measured in the same rounds, so before and after share the run's noise.
const PROXY_CORE_BASELINE: &str = "proxy-core baseline";
const BASELINE_ENV: &str = "NETKIT_BENCH_BASELINE_RELAY";
const HAPROXY_AUTO_2T: &str = "haproxy splice-auto nbthread 2";
const HAPROXY_FORCED_2T: &str = "haproxy forced splice nbthread 2";

/// Pipe size of both relays' splice paths (proxy-core's default).
const PIPE_SIZE: usize = 1 << 20;

const GIB: f64 = (1u64 << 30) as f64;

/// The prose of the report, with `{placeholders}` filled by [`notes`].
const NOTES_TEMPLATE: &str = include_str!("proxy_notes.md");

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

/// Descriptors a relay may need per relayed connection: two sockets, and for HAProxy the
/// pipes (`maxpipes` = `maxconn`, two descriptors each). proxy-core's pipes come from a small
/// pool and none is held by an idle connection (see the "descriptors" figure).
const FDS_PER_CONNECTION: u64 = 4;
/// Descriptors kept free for everything else (listeners, epoll, logs, the runtime).
const FD_MARGIN: u64 = 256;

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
const IDLE_RSS: Metric = Metric::lower("relay RSS per idle connection", "KiB");
const IDLE_FDS: Metric = Metric::lower("relay descriptors per idle connection", "fds");

/// A metric whose name is made at run time (figures per phase and party).
fn metric(name: String, unit: &'static str, higher_is_better: bool) -> Metric {
    let name: &'static str = Box::leak(name.into_boxed_str());
    if higher_is_better {
        Metric::higher(name, unit)
    } else {
        Metric::lower(name, unit)
    }
}

/// The open-loop phase at `rate` connections per second.
fn open_phase(rate: u32) -> String {
    format!("connections, open loop at {rate}/s")
}

/// A relay (or none, for direct) that the generator sends its workloads through, and the sink
/// process behind it.
struct Contender {
    name: &'static str,
    addr: SocketAddr,
    process: Option<Service>,
    sink_pid: u32,
}

impl Contender {
    fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Service::pid)
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        self.process.as_mut().map_or(Ok(()), Service::check_running)
    }

    /// One generator job through this contender, with every party's CPU in its window.
    fn run(&mut self, work: Work, workload: &Workload) -> anyhow::Result<(Measured, WindowCpu)> {
        let result = procs::run_generator(
            self.addr,
            Some(GENERATOR_CPU),
            work,
            workload.warmup,
            workload.measure,
            self.pid(),
            self.sink_pid,
            &mut |_| Ok(()),
        )
        .with_context(|| format!("{work:?} through {}", self.name))?;
        self.check_running()?;
        Ok(result)
    }
}

/// The two sinks: one on the generator CPU behind the relays, one on the relay CPU for direct
/// (a baseline with a core on each end).
struct Sinks {
    relayed: SinkProcess,
    direct: SinkProcess,
}

/// How to start each relay.
struct Relays {
    tcp_relay: PathBuf,
    baseline: Option<PathBuf>,
    haproxy: Option<PathBuf>,
    dir: PathBuf,
    fd_limit: u64,
}

/// How a contender relays.
#[derive(Clone, Copy)]
enum Kind {
    Direct,
    ProxyCore { threads: usize, baseline: bool },
    Haproxy { threads: usize, forced: bool },
}

fn kind(name: &str) -> Kind {
    match name {
        PROXY_CORE => Kind::ProxyCore {
            threads: 1,
            baseline: false,
        },
        PROXY_CORE_BASELINE => Kind::ProxyCore {
            threads: 1,
            baseline: true,
        },
        PROXY_CORE_2T => Kind::ProxyCore {
            threads: 2,
            baseline: false,
        },
        HAPROXY_AUTO => Kind::Haproxy {
            threads: 1,
            forced: false,
        },
        HAPROXY_FORCED => Kind::Haproxy {
            threads: 1,
            forced: true,
        },
        HAPROXY_AUTO_2T => Kind::Haproxy {
            threads: 2,
            forced: false,
        },
        HAPROXY_FORCED_2T => Kind::Haproxy {
            threads: 2,
            forced: true,
        },
        _ => Kind::Direct,
    }
}

impl Relays {
    /// The contenders of the one-thread phases.
    fn names(&self) -> Vec<&'static str> {
        let mut names = vec![DIRECT, PROXY_CORE];
        if self.baseline.is_some() {
            names.push(PROXY_CORE_BASELINE);
        }
        if self.haproxy.is_some() {
            names.extend([HAPROXY_AUTO, HAPROXY_FORCED]);
        }
        names
    }

    /// The contenders of the scaling phase.
    fn scaling_names(&self) -> Vec<&'static str> {
        let mut names = vec![DIRECT, PROXY_CORE_2T];
        if self.haproxy.is_some() {
            names.extend([HAPROXY_AUTO_2T, HAPROXY_FORCED_2T]);
        }
        names
    }

    /// A contender towards the sink processes.
    fn start(&self, name: &'static str, sinks: &Sinks) -> anyhow::Result<Contender> {
        if matches!(kind(name), Kind::Direct) {
            return Ok(Contender {
                name,
                addr: sinks.direct.addr,
                process: None,
                sink_pid: sinks.direct.pid(),
            });
        }
        let (addr, process) = self.start_with(name, sinks.relayed.addr, false)?;
        Ok(Contender {
            name,
            addr,
            process,
            sink_pid: sinks.relayed.pid(),
        })
    }

    /// `idle_only`: HAProxy is configured for idle connections only (`maxconn` up to the
    /// open-file limit at two descriptors each, `maxpipes 0`), as no byte will move.
    fn start_with(
        &self,
        name: &'static str,
        upstream: SocketAddr,
        idle_only: bool,
    ) -> anyhow::Result<(SocketAddr, Option<Service>)> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?));
        let mut service = match kind(name) {
            Kind::Direct => return Ok((upstream, None)),
            Kind::ProxyCore { threads, baseline } => {
                let program = match &self.baseline {
                    Some(program) if baseline => program,
                    _ => &self.tcp_relay,
                };
                self.start_proxy_core(program, addr, upstream, threads)?
            }
            Kind::Haproxy { threads, forced } => {
                self.start_haproxy(addr, upstream, threads, forced, idle_only)?
            }
        };
        service.wait_listening(addr, Duration::from_secs(10))?;
        Ok((addr, Some(service)))
    }

    /// One thread: pinned to the relay CPU. Two threads: unpinned (both CPUs, shared with the
    /// generator).
    fn command(&self, threads: usize, program: &Path) -> Command {
        if threads == 1 {
            system::pinned_command(RELAY_CPU, program)
        } else {
            Command::new(program)
        }
    }

    fn start_proxy_core(
        &self,
        program: &Path,
        listen: SocketAddr,
        upstream: SocketAddr,
        threads: usize,
    ) -> anyhow::Result<Service> {
        let mut cmd = self.command(threads, program);
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--upstream")
            .arg(upstream.to_string())
            .arg("--drain-secs")
            .arg("0")
            .arg("--pipe-size")
            .arg(PIPE_SIZE.to_string())
            // HAProxy runs without `option tcpka`: the same work per connection.
            .arg("--no-keepalive")
            // Threads like HAProxy's nbthread: 1 is one event loop (tokio's current-thread
            // runtime), as `nbthread 1` is; tokio's default would be a worker per CPU.
            .arg("--threads")
            .arg(threads.to_string())
            .env("RUST_LOG", "warn");
        Service::spawn("tcp_relay", cmd, &self.dir)
    }

    fn start_haproxy(
        &self,
        listen: SocketAddr,
        upstream: SocketAddr,
        threads: usize,
        forced: bool,
        idle_only: bool,
    ) -> anyhow::Result<Service> {
        let haproxy = self
            .haproxy
            .as_deref()
            .context("haproxy is not installed")?;
        let config = self.dir.join(format!("haproxy-{}.cfg", listen.port()));
        // Two sockets per connection, and up to one pipe (two descriptors) per connection.
        let usable = self.fd_limit.saturating_sub(FD_MARGIN);
        let (maxconn, maxpipes) = if idle_only {
            (idle_maxconn(self.fd_limit), 0)
        } else {
            let maxconn = usable / FDS_PER_CONNECTION;
            (maxconn, maxconn)
        };
        std::fs::write(
            &config,
            haproxy_config(listen, upstream, maxconn, maxpipes, threads, forced),
        )
        .with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = self.command(threads, haproxy);
        // -db: foreground, no daemon, no master process: one pid to measure.
        cmd.arg("-db").arg("-f").arg(&config);
        Service::spawn("haproxy", cmd, &self.dir)
    }
}

/// The most idle connections every contender can hold within `fd_limit`: HAProxy refuses to
/// start unless the limit covers about 2.5 descriptors per `maxconn` (two sockets and a share for
/// idle server connections), the relay and the generator need two each.
fn idle_maxconn(fd_limit: u64) -> u64 {
    fd_limit.saturating_sub(FD_MARGIN) * 2 / 5
}

/// HAProxy's config: proxy-core's pipe size (`tune.pipesize`), a pipe for every connection
/// (`maxpipes` = `maxconn`, which must fit the open-file limit: HAProxy refuses to start when
/// it cannot raise it to about 2 x maxconn + 2 x maxpipes), and either `splice-auto` or forced
/// splicing both ways.
fn haproxy_config(
    listen: SocketAddr,
    upstream: SocketAddr,
    maxconn: u64,
    maxpipes: u64,
    threads: usize,
    forced: bool,
) -> String {
    let splice = if forced {
        "option splice-request\n    option splice-response"
    } else {
        "option splice-auto"
    };
    format!(
        "global
    nbthread {threads}
    maxconn {maxconn}
    maxpipes {maxpipes}
    tune.pipesize {PIPE_SIZE}

defaults
    mode tcp
    {splice}
    timeout connect 5s
    timeout client 10m
    timeout server 10m

frontend bench
    bind {listen}
    default_backend sink

backend sink
    server sink {upstream}
"
    )
}

/// Each contender's configuration, as the summary shows it.
pub fn contenders(_settings: &Settings) -> Vec<(&'static str, String)> {
    let haproxy = |splice: &str, threads: &str| {
        format!(
            "HAProxy mode tcp, {threads}, {splice}, tune.pipesize {PIPE_SIZE} (proxy-core's pipe), maxpipes = maxconn (a pipe per connection; the idle-memory phase uses maxpipes 0), no option tcpka"
        )
    };
    vec![
        (
            DIRECT,
            format!(
                "no relay: the generator process (CPU {GENERATOR_CPU}) to a sink process of its own on CPU {RELAY_CPU} (the relays' CPU, idle in this contender): one loopback hop, a core on each end"
            ),
        ),
        (
            PROXY_CORE,
            format!(
                "examples/tcp_relay, --threads 1 (current-thread runtime: one event loop, as nbthread 1) pinned to CPU {RELAY_CPU}, automatic copy mode, {PIPE_SIZE}-byte pipes, no TCP keepalive (as HAProxy), the binaries' Prometheus observer"
            ),
        ),
        (
            PROXY_CORE_BASELINE,
            format!(
                "as proxy-core, but the tcp_relay binary named by {BASELINE_ENV} ({}); present only when that is set",
                std::env::var(BASELINE_ENV).unwrap_or_default()
            ),
        ),
        (
            HAPROXY_AUTO,
            haproxy(
                "option splice-auto",
                &format!("nbthread 1 pinned to CPU {RELAY_CPU}"),
            ),
        ),
        (
            HAPROXY_FORCED,
            haproxy(
                "option splice-request + option splice-response",
                &format!("nbthread 1 pinned to CPU {RELAY_CPU}"),
            ),
        ),
        (
            PROXY_CORE_2T,
            "examples/tcp_relay, --threads 2 (multi-thread runtime, 2 workers), unpinned, otherwise as proxy-core".to_owned(),
        ),
        (
            HAPROXY_AUTO_2T,
            haproxy("option splice-auto", "nbthread 2, unpinned"),
        ),
        (
            HAPROXY_FORCED_2T,
            haproxy(
                "option splice-request + option splice-response",
                "nbthread 2, unpinned",
            ),
        ),
    ]
}

/// Finds HAProxy, installing Debian's package if it is missing; `None` if that is impossible.
fn ensure_haproxy(notes: &mut Vec<String>) -> Option<PathBuf> {
    if let Some(path) = system::which("haproxy") {
        return Some(path);
    }
    eprintln!("haproxy is missing: apt-get install -y haproxy");
    let installed = Command::new("apt-get")
        .args(["install", "-y", "haproxy"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success());
    let found = system::which("haproxy").filter(|_| installed);
    if found.is_none() {
        notes.push("HAProxy could not be installed: its column is not measured.".to_owned());
    }
    found
}

pub fn run(settings: &Settings) -> anyhow::Result<Outcome> {
    let tcp_relay = system::cargo_build_release(&["-p", "examples", "--example", "tcp_relay"])?;
    let mut notes = Vec::new();
    let haproxy = ensure_haproxy(&mut notes);
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-proxy-")
        .tempdir()?;
    let baseline = std::env::var_os(BASELINE_ENV).map(PathBuf::from);
    let relays = Relays {
        tcp_relay,
        baseline,
        haproxy,
        dir: dir.path().to_path_buf(),
        fd_limit: settings.fd_limit,
    };
    let workload = Workload::new(settings);
    let mut recorder = Recorder::default();
    let mut busy = Busy::default();
    let sinks = Sinks {
        relayed: SinkProcess::start(Some(GENERATOR_CPU), &relays.dir, "sink-relayed")?,
        direct: SinkProcess::start(Some(RELAY_CPU), &relays.dir, "sink-direct")?,
    };
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
            &mut busy,
        )?;
        connections(
            settings,
            &workload,
            &mut contenders,
            &mut recorder,
            &mut busy,
        )?;
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
    notes.push(busy.note());
    notes.extend(self::notes(settings, &workload, &figures));
    notes.extend(configuration(&relays));
    Ok(Outcome {
        figures,
        goals,
        notes,
    })
}

/// One window's busy fractions: relay (none for direct), generator, sink.
type BusySample = (Option<f64>, f64, f64);

/// CPU busy (CPU seconds per second of window) of each party, per phase and contender, for the
/// report's note: which process was the bottleneck.
#[derive(Default)]
struct Busy {
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

    fn note(&self) -> String {
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

/// Records the cost of every party for one run: CPU per `amount` of work (`per` of it).
#[allow(clippy::too_many_arguments)] // One figure per party, named alike.
fn record_costs(
    recorder: &mut Recorder,
    phase: &str,
    contender: &'static str,
    cpu: WindowCpu,
    amount: f64,
    scale: f64,
    per: &str,
    unit: &'static str,
) {
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
            Some(seconds) if seconds >= system::MIN_CPU_SECONDS => {
                recorder.record(figure, contender, seconds * scale / amount);
            }
            Some(_) => recorder.note(figure, contender, "too little CPU time to resolve"),
            None => recorder.note(figure, contender, "no relay process"),
        }
    }
}

/// Records one bulk run (its throughput, every party's CPU per GiB, the busy share) and returns
/// the bytes it moved.
fn record_bulk_run(
    recorder: &mut Recorder,
    busy: &mut Busy,
    phase: &str,
    throughput: Metric,
    contender: &'static str,
    measured: &Measured,
    cpu: WindowCpu,
) -> f64 {
    let bytes = measured.bytes as f64;
    recorder.record(throughput, contender, bytes * 8.0 / measured.seconds / 1e9);
    record_costs(
        recorder,
        phase,
        contender,
        cpu,
        bytes / GIB,
        1.0,
        "GiB",
        "CPU s/GiB",
    );
    busy.add(phase, contender, cpu, measured.seconds);
    bytes
}

/// Bulk transfers: throughput and every party's CPU per GiB, per run and over a round's runs.
fn bulk(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    busy: &mut Busy,
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
                let bytes = record_bulk_run(
                    recorder,
                    busy,
                    phase,
                    throughput,
                    contender.name,
                    &measured,
                    cpu,
                );
                if let Some(relay) = cpu.relay {
                    let entry = per_round.entry((contender.name, round)).or_default();
                    entry.0 += relay;
                    entry.1 += bytes;
                }
            }
        }
    }
    recorder.note(CPU_PER_GIB, DIRECT, "no relay process");
    for ((name, _), (seconds, bytes)) in per_round {
        recorder.record(CPU_PER_GIB, name, seconds / (bytes / GIB));
    }
    Ok(())
}

/// Eight streams through relays with two worker threads each.
fn scaling(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    busy: &mut Busy,
) -> anyhow::Result<()> {
    for (download, phase) in SCALING {
        eprintln!("proxy: {phase}");
        let throughput = metric(phase.to_owned(), "Gbit/s", true);
        for _ in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let work = Work::Bulk {
                    download,
                    streams: 8,
                };
                let (measured, cpu) = contender.run(work, workload)?;
                record_bulk_run(
                    recorder,
                    busy,
                    phase,
                    throughput,
                    contender.name,
                    &measured,
                    cpu,
                );
            }
        }
    }
    Ok(())
}

/// Connection rate: a closed loop of 16 (capacity under this machine's hand-offs) and open loops
/// at fixed offered rates (latency and cost at a given load).
fn connections(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    busy: &mut Busy,
) -> anyhow::Result<()> {
    let mut phases = vec![(
        CLOSED_PHASE.to_owned(),
        Work::Closed {
            concurrency: workload.connection_concurrency,
        },
    )];
    for rate in workload.open_rates {
        phases.push((open_phase(rate), Work::Open { rate }));
    }
    let mut failures: BTreeMap<(String, &str), (u64, u64, u64)> = BTreeMap::new();
    for (phase, work) in phases {
        eprintln!("proxy: {phase}");
        let rate = metric(format!("{phase}: completed connections"), "conn/s", true);
        let p50 = metric(format!("{phase}: connect to first byte, p50"), "µs", false);
        let p99 = metric(format!("{phase}: connect to first byte, p99"), "µs", false);
        for _ in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let (measured, cpu) = contender.run(work, workload)?;
                recorder.record(
                    rate,
                    contender.name,
                    measured.completed as f64 / measured.seconds,
                );
                recorder.record(p50, contender.name, measured.p50_us);
                recorder.record(p99, contender.name, measured.p99_us);
                let thousands = measured.completed as f64 / 1e3;
                record_costs(
                    recorder,
                    &phase,
                    contender.name,
                    cpu,
                    thousands,
                    1e3,
                    "1000 connections",
                    "CPU ms",
                );
                if let Work::Open { .. } = work {
                    let relay_busy =
                        metric(format!("{phase}: relay CPU busy"), "% of a core", false);
                    match cpu.relay {
                        Some(relay) => recorder.record(
                            relay_busy,
                            contender.name,
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

fn latency(
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
    for _ in 0..settings.rounds {
        for index in shuffled(contenders.len()) {
            let contender = &mut contenders[index];
            let (measured, cpu) = contender.run(work, &timing)?;
            recorder.record(LATENCY_P50, contender.name, measured.p50_us);
            recorder.record(LATENCY_P99, contender.name, measured.p99_us);
            recorder.record(LATENCY_P999, contender.name, measured.p999_us);
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

/// The indices `0..len` in a random order (a new one at each call), so that no contender always
/// runs first or right after another one.
pub(super) fn shuffled(len: usize) -> Vec<usize> {
    use std::hash::{BuildHasher, RandomState};
    let state = RandomState::new();
    let mut indices: Vec<usize> = (0..len).collect();
    indices.sort_by_key(|index| state.hash_one(index));
    indices
}

/// What each contender ran on and with, for the report.
fn configuration(relays: &Relays) -> Vec<String> {
    let haproxy_version = relays
        .haproxy
        .as_deref()
        .and_then(|haproxy| Command::new(haproxy).arg("-v").output().ok())
        .and_then(|output| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "HAProxy not available".to_owned());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_owned(), |text| text.trim().to_owned());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let pipe_budget = std::fs::read_to_string("/proc/sys/fs/pipe-user-pages-soft")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .filter(|pages| *pages > 0)
        .map_or(16 << 20, |pages| pages * 4096 / 4);
    let pinning = if system::can_pin() {
        format!(
            "generator and sink: CPU {GENERATOR_CPU}; one-thread relays (proxy-core, both HAProxy): taskset -c {RELAY_CPU}; two-thread relays: unpinned (both CPUs, shared with the generator)"
        )
    } else {
        "nothing pinned (fewer than 2 usable CPUs)".to_owned()
    };
    vec![
        format!("Machine: {cpu}; kernel {kernel}; {haproxy_version}."),
        format!("Pinning: {pinning}."),
        format!(
            "{PROXY_CORE}: examples/tcp_relay, copy mode auto (buffered first bytes, then splice through a pooled {} KiB pipe once a read fills 16 KiB), pipe budget {} MiB (the default: a quarter of pipe-user-pages-soft), PrometheusObserver registered as in the binaries (registry not scraped), --no-keepalive (TCP keepalive off, as HAProxy without option tcpka; on by default it costs 4 setsockopt per upstream connection), --threads 1 (tokio's current-thread runtime: one event loop, no hand-offs between workers, as HAProxy nbthread 1; steward-tcp-proxy --threads 1 runs the same), RUST_LOG=warn; {PROXY_CORE_2T}: the same with --threads 2 (a multi-thread runtime with 2 workers).",
            PIPE_SIZE >> 10,
            pipe_budget >> 20
        ),
        format!(
            "{HAPROXY_AUTO}: nbthread 1, mode tcp, option splice-auto, tune.pipesize {PIPE_SIZE}, maxpipes = maxconn, no option tcpka (its default); {HAPROXY_FORCED}: the same with option splice-request + option splice-response instead; the nbthread 2 variants differ only in nbthread."
        ),
    ]
}

/// RSS per idle connection, each round in fresh relay processes so earlier runs' allocations do
/// not hide the cost, towards a fresh sink port whose 4-tuples carry no TIME_WAIT history from
/// the connection-rate runs.
async fn idle_memory(
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
    for _ in 0..settings.rounds {
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
            recorder.record(IDLE_RSS, name, per_connection);
            let fds =
                fds_after.saturating_sub(fds_before) as f64 / workload.idle_connections as f64;
            recorder.record(IDLE_FDS, name, fds);
        }
    }
    Ok(())
}

/// How a ratio is judged against its bound.
#[derive(Clone, Copy)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
    Below(f64),
}

fn goals(figures: &[Figure]) -> Vec<Goal> {
    let find = |name: &str| figures.iter().find(|f| f.name == name);
    let mut goals = Vec::new();
    for phase in std::iter::once(CLOSED_PHASE.to_owned()).chain([2_000, 5_000].map(open_phase)) {
        let name = format!("{phase}: relay CPU per 1000 connections");
        for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
            goals.push(ratio_goal(
                find(&name),
                &name,
                PROXY_CORE,
                haproxy,
                Bound::AtMost(0.9),
            ));
        }
    }
    let per_gib = find(CPU_PER_GIB.name);
    goals.push(ratio_goal(
        per_gib,
        CPU_PER_GIB.name,
        PROXY_CORE,
        HAPROXY_FORCED,
        Bound::AtMost(1.0),
    ));
    goals.push(ratio_goal(
        per_gib,
        CPU_PER_GIB.name,
        PROXY_CORE,
        HAPROXY_AUTO,
        Bound::Below(1.0),
    ));
    for (streams, _, phase) in BULK {
        let figure = find(phase);
        if streams == 1 {
            goals.push(ratio_goal(
                figure,
                phase,
                PROXY_CORE,
                DIRECT,
                Bound::AtLeast(0.5),
            ));
        }
        for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
            goals.push(ratio_goal(
                figure,
                phase,
                PROXY_CORE,
                haproxy,
                Bound::AtLeast(1.0),
            ));
        }
    }
    for (_, phase) in SCALING {
        for haproxy in [HAPROXY_FORCED_2T, HAPROXY_AUTO_2T] {
            goals.push(ratio_goal(
                find(phase),
                phase,
                PROXY_CORE_2T,
                haproxy,
                Bound::AtLeast(1.0),
            ));
        }
    }
    if let Some(figure) = find(LATENCY_P99.name) {
        for haproxy in [HAPROXY_FORCED, HAPROXY_AUTO] {
            let added = |name: &str| Some(figure.median(name)? - figure.median(DIRECT)?);
            let (ours, theirs) = (added(PROXY_CORE), added(haproxy));
            goals.push(Goal {
                goal: format!("added p99 latency <= {haproxy}'s"),
                measured: format!(
                    "proxy-core {} µs, {haproxy} {} µs over direct",
                    shown(ours),
                    shown(theirs)
                ),
                met: ours.zip(theirs).map(|(o, t)| o <= t),
            });
        }
    }
    if let Some(figure) = find(IDLE_RSS.name) {
        let ours = figure.median(PROXY_CORE);
        goals.push(Goal {
            goal: "<= 8 KiB RSS per idle relayed connection".to_owned(),
            measured: format!(
                "proxy-core {} KiB",
                ours.map_or_else(|| "?".to_owned(), |kib| format!("{kib:.1}"))
            ),
            met: ours.map(|kib| kib <= 8.0),
        });
    }
    if let Some(figure) = find(IDLE_FDS.name) {
        let ours = figure.median(PROXY_CORE);
        goals.push(Goal {
            goal: "2 descriptors per idle relayed connection (no pipe before data)".to_owned(),
            measured: format!(
                "proxy-core {}",
                ours.map_or_else(|| "?".to_owned(), |fds| format!("{fds:.2}"))
            ),
            met: ours.map(|fds| fds <= 2.05),
        });
    }
    goals
}

/// `ours`'s median against `reference`'s in one figure, judged by `bound`.
fn ratio_goal(
    figure: Option<&Figure>,
    name: &str,
    ours: &str,
    reference: &str,
    bound: Bound,
) -> Goal {
    let ratio = figure
        .and_then(|figure| figure.median(ours).zip(figure.median(reference)))
        .map(|(ours, theirs)| ours / theirs);
    let (relation, met) = match bound {
        Bound::AtLeast(x) => (format!(">= {x:.2}x"), ratio.map(|r| r >= x)),
        Bound::AtMost(x) => (format!("<= {x:.2}x"), ratio.map(|r| r <= x)),
        Bound::Below(x) => (format!("< {x:.2}x"), ratio.map(|r| r < x)),
    };
    Goal {
        goal: format!("{name}: {ours} {relation} {reference}"),
        measured: ratio.map_or_else(|| "not measured".to_owned(), |r| format!("{r:.2}x")),
        met,
    }
}

fn shown(value: Option<f64>) -> String {
    value.map_or_else(|| "?".to_owned(), |v| format!("{v:+.0}"))
}

/// The report's prose: `proxy_notes.md` with this run's settings filled in, one note per
/// paragraph; then what bounds the figures, from the `--profile` files, or nothing where there is
/// no profile to cite.
fn notes(settings: &Settings, workload: &Workload, figures: &[Figure]) -> Vec<String> {
    let idle_limit = if workload.idle_connections < 10_000 && !settings.quick {
        format!(
            " Fewer than 10 000 because the open-file limit here is {} and cannot be raised further, and HAProxy refuses to start unless the limit covers 2.5 descriptors per maxconn (it runs this phase with maxconn = this count and maxpipes 0).",
            settings.fd_limit
        )
    } else {
        String::new()
    };
    let values = [
        ("warmup", format!("{:?}", workload.warmup)),
        ("measure", format!("{:?}", workload.measure)),
        ("generator_cpu", GENERATOR_CPU.to_string()),
        ("relay_cpu", RELAY_CPU.to_string()),
        ("latency_rate", workload.latency_rate.to_string()),
        (
            "latency_duration",
            format!("{:?}", workload.latency_duration),
        ),
        ("concurrency", workload.connection_concurrency.to_string()),
        (
            "open_rates",
            workload.open_rates.map(|r| r.to_string()).join(" and "),
        ),
        ("idle_connections", workload.idle_connections.to_string()),
        ("idle_limit", idle_limit),
        ("profile_dir", PROFILE_DIR.to_owned()),
    ];
    let mut text = NOTES_TEMPLATE.to_owned();
    for (key, value) in values {
        text = text.replace(&format!("{{{key}}}"), &value);
    }
    let mut notes: Vec<String> = text
        .split("\n\n")
        .filter(|paragraph| !paragraph.trim_start().starts_with("<!--"))
        .map(|paragraph| paragraph.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|paragraph| !paragraph.is_empty())
        .collect();
    notes.extend(bounds(figures));
    notes
}

/// What bounds each figure, read from the committed `--profile` files (each note names its
/// file); a relay without a profile gets no note.
fn bounds(figures: &[Figure]) -> Vec<String> {
    let root = crate::workspace_root();
    let read = |contender: &str, kind: &str| {
        let path = profile_file(contender, kind);
        std::fs::read_to_string(root.join(&path))
            .ok()
            .map(|text| (path, text))
    };
    let mut notes = Vec::new();
    let closed_cpu = format!("{CLOSED_PHASE}: relay CPU per 1000 connections");
    let mut syscalls = Vec::new();
    for contender in [
        PROXY_CORE,
        PROXY_CORE_BASELINE,
        HAPROXY_FORCED,
        HAPROXY_AUTO,
    ] {
        if let Some((path, text)) = read(contender, "connections.strace")
            && let Some((total, calls)) = strace_per_connection(&text)
        {
            let top: Vec<String> = calls
                .iter()
                .take(12)
                .map(|(name, count)| format!("{name} {count:.2}"))
                .collect();
            syscalls.push(format!(
                "{contender} {total:.1} syscalls per connection ({}; from {path})",
                top.join(", ")
            ));
        }
    }
    if !syscalls.is_empty() {
        notes.push(format!(
            "Bound, CPU per connection (this run: proxy-core {} HAProxy forced splice, {} splice-auto): per connection the relays pay the kernel for their syscalls, each with its loopback delivery. {}.",
            versus(figures, &closed_cpu, PROXY_CORE, HAPROXY_FORCED),
            versus(figures, &closed_cpu, PROXY_CORE, HAPROXY_AUTO),
            syscalls.join("; ")
        ));
    }
    for (kind, what, figure) in [
        (
            "connections.perf",
            "CPU per connection",
            closed_cpu.as_str(),
        ),
        ("bulk-upload.perf", "CPU per GiB", CPU_PER_GIB.name),
    ] {
        let mut tops = Vec::new();
        for contender in [PROXY_CORE, HAPROXY_FORCED] {
            if let Some((path, text)) = read(contender, kind) {
                tops.push(format!(
                    "{contender}, from {path}: {}",
                    perf_top(&text, 8).join(", ")
                ));
            }
        }
        if !tops.is_empty() {
            notes.push(format!(
                "Bound, {what} (this run: proxy-core {} HAProxy forced splice): where the relay's cycles go, top entries of perf report: {}.",
                versus(figures, figure, PROXY_CORE, HAPROXY_FORCED),
                tops.join("; ")
            ));
        }
    }
    notes
}

/// The slug of a contender in profile file names.
fn slug(name: &str) -> String {
    name.replace(' ', "-")
}

/// Profile file `kind` (`connections.perf`, `bulk-upload.perf`, `connections.strace`) of
/// `contender`, relative to the workspace root.
fn profile_file(contender: &str, kind: &str) -> String {
    format!("{PROFILE_DIR}/{}-{kind}.txt", slug(contender))
}

/// A profiler attached to a relay while a generator's window is open.
struct Attached {
    child: std::process::Child,
}

impl Attached {
    fn start(program: &str, args: &[String]) -> anyhow::Result<Self> {
        let child = Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        Ok(Self { child })
    }

    /// SIGINT (both perf and strace then write what they have) and wait.
    fn stop(mut self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .arg("-INT")
            .arg(self.child.id().to_string())
            .status()?;
        anyhow::ensure!(status.success(), "kill -INT failed");
        self.child.wait()?;
        Ok(())
    }
}

/// `cargo xtask bench proxy --profile`: for each relay, `perf record -g` over a closed-loop
/// connection window and a one-stream upload window, `perf report --stdio` of each, and
/// `strace -c -f` over an open-loop window at 1 000 connections/s; files under [`PROFILE_DIR`].
fn profile(
    workload: &Workload,
    contenders: &mut [Contender],
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    crate::envtest::install_packages(&["linux-perf", "strace"], "bench --profile")?;
    let dir = crate::workspace_root().join(PROFILE_DIR);
    std::fs::create_dir_all(&dir)?;
    let scratch = tempfile::tempdir()?;
    for contender in contenders.iter_mut() {
        let Some(pid) = contender.pid() else { continue };
        eprintln!("proxy: profiling {}", contender.name);
        let works = [
            (
                "connections.perf",
                Work::Closed {
                    concurrency: workload.connection_concurrency,
                },
            ),
            (
                "bulk-upload.perf",
                Work::Bulk {
                    download: false,
                    streams: 1,
                },
            ),
            ("connections.strace", Work::Open { rate: 1_000 }),
        ];
        for (kind, work) in works {
            let data = scratch
                .path()
                .join(format!("{}-{kind}.data", slug(contender.name)));
            let output = crate::workspace_root().join(profile_file(contender.name, kind));
            let strace = kind.ends_with("strace");
            let mut attached = None;
            let mut hook = |opening: bool| -> anyhow::Result<()> {
                if opening {
                    let args: Vec<String> = if strace {
                        vec![
                            "-c".into(),
                            "-f".into(),
                            "-o".into(),
                            output.display().to_string(),
                            "-p".into(),
                            pid.to_string(),
                        ]
                    } else {
                        vec![
                            "record".into(),
                            "-g".into(),
                            "-q".into(),
                            "-o".into(),
                            data.display().to_string(),
                            "-p".into(),
                            pid.to_string(),
                        ]
                    };
                    attached = Some(Attached::start(
                        if strace { "strace" } else { "perf" },
                        &args,
                    )?);
                } else if let Some(attached) = attached.take() {
                    attached.stop()?;
                }
                Ok(())
            };
            let (measured, cpu) = procs::run_generator(
                contender.addr,
                Some(GENERATOR_CPU),
                work,
                workload.warmup,
                workload.measure,
                Some(pid),
                contender.sink_pid,
                &mut hook,
            )?;
            contender.check_running()?;
            let amount = match work {
                Work::Bulk { .. } => format!(
                    "{:.2} GiB moved in the window ({:.2} Gbit/s)",
                    measured.bytes as f64 / GIB,
                    measured.bytes as f64 * 8.0 / measured.seconds / 1e9
                ),
                _ => format!(
                    "{} connections completed in the window ({:.0}/s)",
                    measured.completed,
                    measured.completed as f64 / measured.seconds
                ),
            };
            let header = format!(
                "# {} under {work:?}, {:.1} s window: {amount}; relay CPU {:.2} s, generator {:.2} s, sink {:.2} s (with the profiler attached)\n",
                contender.name,
                measured.seconds,
                cpu.relay.unwrap_or(0.0),
                cpu.generator,
                cpu.sink,
            );
            let body = if strace {
                std::fs::read_to_string(&output).unwrap_or_default()
            } else {
                let report = Command::new("perf")
                    .arg("report")
                    .arg("-i")
                    .arg(&data)
                    .args([
                        "--stdio",
                        "--no-children",
                        "-g",
                        "none",
                        "--percent-limit",
                        "0.3",
                        "--sort",
                        "dso,symbol",
                    ])
                    .output()
                    .context("perf report")?;
                String::from_utf8_lossy(&report.stdout).into_owned()
            };
            let body: String = body
                .lines()
                .filter(|line| !line.trim().is_empty())
                .map(|line| format!("{line}\n"))
                .collect();
            let command = if strace {
                "# strace -c -f -p <relay pid>, stopped with SIGINT when the window closed; per connection means per upstream connect (strace attaches after the window opens and slows the relay)\n".to_owned()
            } else {
                "# perf record -g -p <relay pid> over the window; perf report --stdio --no-children -g none --percent-limit 0.3 --sort dso,symbol\n".to_owned()
            };
            std::fs::write(&output, format!("{header}{command}{body}"))
                .with_context(|| format!("writing {}", output.display()))?;
        }
    }
    notes.push(format!(
        "--profile: perf and strace files of this run are under {PROFILE_DIR}/ (one set per relay)."
    ));
    Ok(())
}

/// Syscalls per connection from a `--profile` strace file: (total, the top calls with their
/// count per connection). Each relayed connection makes exactly one upstream `connect`, so the
/// `connect` count is the number of connections strace saw (strace attaches after the window
/// opens and slows the relay, so the generator's count would not match).
fn strace_per_connection(text: &str) -> Option<(f64, Vec<(String, f64)>)> {
    let mut calls = Vec::new();
    let mut total = None;
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // % time, seconds, usecs/call, calls, [errors], syscall
        if fields.len() < 5 || fields[0].parse::<f64>().is_err() {
            continue;
        }
        let Ok(count) = fields[3].parse::<f64>() else {
            continue;
        };
        let name = fields[fields.len() - 1].to_owned();
        if name == "total" {
            total = Some(count);
        } else {
            calls.push((name, count));
        }
    }
    let connections = calls
        .iter()
        .find(|(name, _)| name == "connect")
        .map(|(_, count)| *count)
        .filter(|count| *count > 0.0)?;
    for call in &mut calls {
        call.1 /= connections;
    }
    calls.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some((total? / connections, calls))
}

/// The top `count` entries of a `--profile` perf report: (share, where).
fn perf_top(text: &str, count: usize) -> Vec<String> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let share = fields.first()?.strip_suffix('%')?;
            share.parse::<f64>().ok()?;
            // share, dso, [k] or [.], symbol, then the IPC columns ("-" when not sampled)
            let dso = fields.get(1)?;
            let symbol = fields
                .get(3..)?
                .iter()
                .take_while(|field| **field != "-")
                .copied()
                .collect::<Vec<_>>()
                .join(" ");
            Some(format!("{share}% {symbol} ({dso})"))
        })
        .take(count)
        .collect()
}

/// `ours` against `reference` in one figure of this run: the ratio of medians, and whether each
/// median falls inside the other's min-max (then the run cannot tell the two apart).
fn versus(figures: &[Figure], name: &str, ours: &str, reference: &str) -> String {
    let Some(figure) = figures.iter().find(|f| f.name == name) else {
        return "not measured".to_owned();
    };
    let series = |name: &str| figure.series.iter().find(|s| s.contender == name);
    let (Some(a), Some(b)) = (series(ours), series(reference)) else {
        return "not measured".to_owned();
    };
    let (Some(a_median), Some(b_median)) = (a.median, b.median) else {
        return "not measured".to_owned();
    };
    let inside = |median: f64, other: &report::Series| {
        other.min.is_some_and(|min| min <= median) && other.max.is_some_and(|max| median <= max)
    };
    let overlap = if inside(a_median, b) && inside(b_median, a) {
        ", each median inside the other's min-max"
    } else {
        ""
    };
    format!("{:.2}x{overlap}", a_median / b_median)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versus_gives_the_ratio_and_says_when_the_ranges_overlap() {
        let up = Metric::higher("up", "Gbit/s");
        let down = Metric::higher("down", "Gbit/s");
        let mut recorder = Recorder::default();
        for (ours, theirs) in [(10.0, 9.0), (12.0, 11.0), (11.0, 12.5)] {
            recorder.record(up, PROXY_CORE, ours);
            recorder.record(up, HAPROXY_FORCED, theirs);
        }
        for (ours, theirs) in [(10.0, 20.0), (11.0, 21.0)] {
            recorder.record(down, PROXY_CORE, ours);
            recorder.record(down, HAPROXY_FORCED, theirs);
        }
        let figures = recorder.finish(&[DIRECT]);
        assert_eq!(
            versus(&figures, up.name, PROXY_CORE, HAPROXY_FORCED),
            "1.00x, each median inside the other's min-max"
        );
        assert_eq!(
            versus(&figures, down.name, PROXY_CORE, HAPROXY_FORCED),
            "0.51x"
        );
        assert_eq!(
            versus(&figures, "rate", PROXY_CORE, HAPROXY_FORCED),
            "not measured"
        );
    }

    #[test]
    fn haproxy_config_names_both_addresses() {
        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 1000));
        let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, 2000));
        let config = haproxy_config(listen, upstream, 1000, 1000, 1, false);
        assert!(config.contains("bind 127.0.0.1:1000"));
        assert!(config.contains("server sink 127.0.0.1:2000"));
        assert!(config.contains("option splice-auto"));
        assert!(config.contains("maxconn 1000"));
        assert!(config.contains("maxpipes 1000"));
        assert!(config.contains(&format!("tune.pipesize {PIPE_SIZE}")));
    }

    #[test]
    fn forced_splice_splices_both_ways() {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 1000));
        let config = haproxy_config(addr, addr, 1000, 1000, 2, true);
        assert!(config.contains("option splice-request\n    option splice-response\n"));
        assert!(!config.contains("splice-auto"));
        assert!(config.contains("nbthread 2"));
    }

    #[test]
    fn shuffled_is_a_permutation() {
        let mut order = shuffled(5);
        order.sort_unstable();
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn strace_counts_per_connection() {
        let text = "# header\n# connections: 999\n% time     seconds  usecs/call     calls    errors syscall\n------ ----------- ----------- --------- --------- ----------------\n 40.00    0.004000          20       200           close\n 30.00    0.003000          15       400       100 recvfrom\n 30.00    0.003000          15       100       100 connect\n------ ----------- ----------- --------- --------- ----------------\n100.00    0.010000          14       700       200 total\n";
        let Some((total, calls)) = strace_per_connection(text) else {
            panic!("no counts parsed");
        };
        assert_eq!(total, 7.0);
        assert_eq!(calls[0], ("recvfrom".to_owned(), 4.0));
        assert_eq!(calls[1], ("close".to_owned(), 2.0));
        assert_eq!(calls[2], ("connect".to_owned(), 1.0));
        assert!(strace_per_connection("100.00 0.1 1 700 0 total\n").is_none());
    }

    #[test]
    fn perf_top_reads_shares_and_symbols() {
        let text = "# comment\n    12.50%  [kernel.kallsyms]  [k] tcp_sendmsg   -      -   \n     3.10%  tcp_relay          [.] proxy_core::copy::copy_tcp\n";
        assert_eq!(
            perf_top(text, 1),
            vec!["12.50% tcp_sendmsg ([kernel.kallsyms])".to_owned()]
        );
        assert_eq!(perf_top(text, 5).len(), 2);
    }

    #[test]
    fn ratio_goals_judge_each_bound() {
        let mut recorder = Recorder::default();
        let metric = Metric::lower("cost", "CPU ms");
        recorder.record(metric, PROXY_CORE, 90.0);
        recorder.record(metric, HAPROXY_FORCED, 100.0);
        let figures = recorder.finish(&[]);
        let goal =
            |bound| ratio_goal(figures.first(), "cost", PROXY_CORE, HAPROXY_FORCED, bound).met;
        assert_eq!(goal(Bound::AtMost(0.9)), Some(true));
        assert_eq!(goal(Bound::AtMost(0.89)), Some(false));
        assert_eq!(goal(Bound::Below(0.9)), Some(false));
        assert_eq!(goal(Bound::AtLeast(0.95)), Some(false));
        assert_eq!(
            ratio_goal(None, "cost", PROXY_CORE, HAPROXY_AUTO, Bound::AtMost(1.0)).met,
            None
        );
    }
}
