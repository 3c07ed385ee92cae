//! `bench proxy`: the same workloads direct, through proxy-core (`examples/tcp_relay`, with the
//! Prometheus observer the binaries use) and through HAProxy (`mode tcp`) twice: with
//! `option splice-auto` and with forced splicing (`option splice-request` +
//! `option splice-response`), both with proxy-core's pipe size. The better HAProxy of each figure
//! is the peer. Relays run one thread on the relay CPU (proxy-core tokio's current-thread runtime,
//! one event loop as HAProxy's `nbthread 1`); a scaling phase gives proxy-core two worker threads
//! and HAProxy `nbthread 2`, unpinned. Rounds run the contenders in a random
//! order.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;

use super::load::{self, Direction, Sink};
use super::report::{self, Figure, Goal, Metric, Recorder};
use super::system::{self, GENERATOR_CPU, RELAY_CPU, Service};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const PROXY_CORE: &str = "proxy-core";
const HAPROXY_AUTO: &str = "haproxy splice-auto";
const HAPROXY_FORCED: &str = "haproxy forced splice";
/// The better of the two HAProxy contenders, per figure.
const HAPROXY: &str = "haproxy (better)";
const PROXY_CORE_2T: &str = "proxy-core 2 threads";
const HAPROXY_AUTO_2T: &str = "haproxy splice-auto nbthread 2";
const HAPROXY_FORCED_2T: &str = "haproxy forced splice nbthread 2";
/// The better of the two HAProxy contenders with two threads, per figure.
const HAPROXY_2T: &str = "haproxy nbthread 2 (better)";

/// Pipe size of both relays' splice paths (proxy-core's default).
const PIPE_SIZE: usize = 1 << 20;

const GIB: f64 = (1u64 << 30) as f64;

/// How much each workload does; `--quick` shrinks everything.
struct Workload {
    bulk_bytes: u64,
    latency_rate: u32,
    latency_duration: Duration,
    latency_message: usize,
    connection_concurrency: usize,
    connection_duration: Duration,
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
            bulk_bytes: if quick { 64 << 20 } else { 2 << 30 },
            latency_rate: 5_000,
            latency_duration: Duration::from_millis(if quick { 600 } else { 4_000 }),
            latency_message: 1024,
            connection_concurrency: 16,
            connection_duration: Duration::from_millis(if quick { 400 } else { 2_000 }),
            idle_connections: wanted_idle.min(fitting_idle) as usize,
        }
    }
}

const BULK: [(usize, Direction, Metric); 4] = [
    (
        1,
        Direction::Upload,
        Metric::higher("bulk 1 stream, upload", "Gbit/s"),
    ),
    (
        1,
        Direction::Download,
        Metric::higher("bulk 1 stream, download", "Gbit/s"),
    ),
    (
        8,
        Direction::Upload,
        Metric::higher("bulk 8 streams, upload", "Gbit/s"),
    ),
    (
        8,
        Direction::Download,
        Metric::higher("bulk 8 streams, download", "Gbit/s"),
    ),
];
const SCALING: [(Direction, Metric); 2] = [
    (
        Direction::Upload,
        Metric::higher("bulk 8 streams, upload, 2 relay threads", "Gbit/s"),
    ),
    (
        Direction::Download,
        Metric::higher("bulk 8 streams, download, 2 relay threads", "Gbit/s"),
    ),
];
const CPU_PER_GIB: Metric = Metric::lower("relay CPU per GiB relayed (all bulk runs)", "CPU s/GiB");
const LATENCY_P50: Metric = Metric::lower("1 KiB echo at 5k msg/s, p50", "µs");
const LATENCY_P99: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99", "µs");
const LATENCY_P999: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99.9", "µs");
const CONNECTION_RATE: Metric =
    Metric::higher("connection rate (connect, 1 B each way, close)", "conn/s");
const CONNECTION_P99: Metric = Metric::lower("connect to first byte, p99", "µs");
const CONNECTION_CPU: Metric = Metric::lower("relay CPU per 1000 connections", "CPU ms");
/// The generator and the sink share this process: what each relay costs the other side.
const GENERATOR_CPU_PER_CONNECTION: Metric =
    Metric::lower("generator and sink CPU per 1000 connections", "CPU ms");
const IDLE_RSS: Metric = Metric::lower("relay RSS per idle connection", "KiB");
const IDLE_FDS: Metric = Metric::lower("relay descriptors per idle connection", "fds");

/// A relay (or none, for direct) that the generator sends its workloads through.
struct Contender {
    name: &'static str,
    addr: SocketAddr,
    process: Option<Service>,
}

impl Contender {
    fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Service::pid)
    }

    fn cpu_seconds(&self) -> anyhow::Result<Option<f64>> {
        self.pid().map(system::cpu_seconds).transpose()
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        self.process.as_mut().map_or(Ok(()), Service::check_running)
    }
}

/// How to start each relay.
struct Relays {
    tcp_relay: PathBuf,
    haproxy: Option<PathBuf>,
    dir: PathBuf,
    fd_limit: u64,
}

/// How a contender relays.
#[derive(Clone, Copy)]
enum Kind {
    Direct,
    ProxyCore { threads: usize },
    Haproxy { threads: usize, forced: bool },
}

fn kind(name: &str) -> Kind {
    match name {
        PROXY_CORE => Kind::ProxyCore { threads: 1 },
        PROXY_CORE_2T => Kind::ProxyCore { threads: 2 },
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

    fn start(&self, name: &'static str, upstream: SocketAddr) -> anyhow::Result<Contender> {
        self.start_with(name, upstream, false)
    }

    /// `idle_only`: HAProxy is configured for idle connections only (`maxconn` up to the
    /// open-file limit at two descriptors each, `maxpipes 0`), as no byte will move.
    fn start_with(
        &self,
        name: &'static str,
        upstream: SocketAddr,
        idle_only: bool,
    ) -> anyhow::Result<Contender> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?));
        let mut service = match kind(name) {
            Kind::Direct => {
                return Ok(Contender {
                    name,
                    addr: upstream,
                    process: None,
                });
            }
            Kind::ProxyCore { threads } => self.start_proxy_core(addr, upstream, threads)?,
            Kind::Haproxy { threads, forced } => {
                self.start_haproxy(addr, upstream, threads, forced, idle_only)?
            }
        };
        service.wait_listening(addr, Duration::from_secs(10))?;
        Ok(Contender {
            name,
            addr,
            process: Some(service),
        })
    }

    /// One thread: pinned to the relay CPU. Two threads: unpinned (both CPUs, shared with the
    /// generator).
    fn command(&self, threads: usize, program: &std::path::Path) -> Command {
        if threads == 1 {
            system::pinned_command(RELAY_CPU, program)
        } else {
            Command::new(program)
        }
    }

    fn start_proxy_core(
        &self,
        listen: SocketAddr,
        upstream: SocketAddr,
        threads: usize,
    ) -> anyhow::Result<Service> {
        let mut cmd = self.command(threads, &self.tcp_relay);
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
        (DIRECT, "generator to sink on loopback, no relay".to_owned()),
        (
            PROXY_CORE,
            format!(
                "examples/tcp_relay, --threads 1 (current-thread runtime: one event loop, as nbthread 1) pinned to CPU {RELAY_CPU}, automatic copy mode, {PIPE_SIZE}-byte pipes, no TCP keepalive (as HAProxy), the binaries' Prometheus observer"
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
            HAPROXY,
            "the better of the two HAProxy configurations above, per figure (named in its note)"
                .to_owned(),
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
        (
            HAPROXY_2T,
            "the better of the two nbthread 2 HAProxy configurations, per figure".to_owned(),
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
    let relays = Relays {
        tcp_relay,
        haproxy,
        dir: dir.path().to_path_buf(),
        fd_limit: settings.fd_limit,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Generator and sink live on this thread (and its blocking helpers) on the generator CPU.
    let recorder = system::with_cpu(GENERATOR_CPU, || {
        runtime.block_on(measure(settings, &relays, &mut notes))
    })??;
    drop(runtime);
    let mut figures = recorder.finish(&[DIRECT]);
    for figure in &mut figures {
        add_peer(figure, HAPROXY, &[HAPROXY_AUTO, HAPROXY_FORCED]);
        add_peer(figure, HAPROXY_2T, &[HAPROXY_AUTO_2T, HAPROXY_FORCED_2T]);
    }
    let goals = goals(&figures);
    notes.extend(explanations(settings));
    notes.extend(bounds(&figures));
    notes.extend(configuration(&relays));
    Ok(Outcome {
        figures,
        goals,
        notes,
    })
}

async fn measure(
    settings: &Settings,
    relays: &Relays,
    notes: &mut Vec<String>,
) -> anyhow::Result<Recorder> {
    let workload = Workload::new(settings);
    let sink = Sink::start().await?;
    let mut recorder = Recorder::default();
    let mut contenders = Vec::new();
    for name in relays.names() {
        contenders.push(relays.start(name, sink.addr())?);
    }
    bulk(settings, &workload, &mut contenders, &mut recorder).await?;
    latency(settings, &workload, &mut contenders, &mut recorder).await?;
    connection_rate(settings, &workload, &mut contenders, &mut recorder, notes).await?;
    drop(contenders);
    let mut contenders = Vec::new();
    for name in relays.scaling_names() {
        contenders.push(relays.start(name, sink.addr())?);
    }
    scaling(settings, &workload, &mut contenders, &mut recorder).await?;
    drop(contenders);
    idle_memory(settings, &workload, relays, &mut recorder).await?;
    Ok(recorder)
}

/// Bulk transfers, alternating contenders within each round; also the relays' CPU per GiB.
async fn bulk(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    // (contender, round) -> (CPU seconds, bytes) summed over that round's bulk runs.
    let mut cpu: BTreeMap<(&'static str, usize), (f64, f64)> = BTreeMap::new();
    for (streams, direction, metric) in BULK {
        eprintln!("proxy: {}", metric.name);
        for round in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let cpu_before = contender.cpu_seconds()?;
                let elapsed =
                    load::bulk(contender.addr, direction, streams, workload.bulk_bytes).await?;
                contender.check_running()?;
                let gbits = workload.bulk_bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9;
                recorder.record(metric, contender.name, gbits);
                if let (Some(before), Some(after)) = (cpu_before, contender.cpu_seconds()?) {
                    let entry = cpu.entry((contender.name, round)).or_default();
                    entry.0 += after - before;
                    entry.1 += workload.bulk_bytes as f64;
                }
            }
        }
    }
    recorder.note(CPU_PER_GIB, DIRECT, "no relay process");
    for contender in contenders.iter() {
        let rounds = cpu.iter().filter(|((name, _), _)| *name == contender.name);
        for (_, (seconds, bytes)) in rounds {
            if *seconds >= system::MIN_CPU_SECONDS {
                recorder.record(CPU_PER_GIB, contender.name, seconds / (bytes / GIB));
            } else {
                recorder.note(
                    CPU_PER_GIB,
                    contender.name,
                    "too little CPU time to resolve",
                );
            }
        }
    }
    Ok(())
}

/// Eight streams through relays with two worker threads each.
async fn scaling(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    for (direction, metric) in SCALING {
        eprintln!("proxy: {}", metric.name);
        for _ in 0..settings.rounds {
            for index in shuffled(contenders.len()) {
                let contender = &mut contenders[index];
                let elapsed = load::bulk(contender.addr, direction, 8, workload.bulk_bytes).await?;
                contender.check_running()?;
                let gbits = workload.bulk_bytes as f64 * 8.0 / elapsed.as_secs_f64() / 1e9;
                recorder.record(metric, contender.name, gbits);
            }
        }
    }
    Ok(())
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

/// Adds `peer`: a copy of whichever of `candidates` has the better median in `figure`, with a
/// note naming it, and every series' ratio against it.
fn add_peer(figure: &mut Figure, peer: &str, candidates: &[&str]) {
    let better = figure
        .series
        .iter()
        .filter(|series| candidates.contains(&series.contender.as_str()))
        .filter(|series| series.median.is_some())
        .max_by(|a, b| {
            let (a, b) = (a.median.unwrap_or(0.0), b.median.unwrap_or(0.0));
            if figure.higher_is_better {
                a.total_cmp(&b)
            } else {
                b.total_cmp(&a)
            }
        })
        .cloned();
    let Some(mut series) = better else { return };
    series.note = Some(format!("= {}, the better HAProxy here", series.contender));
    series.contender = peer.to_owned();
    series.ratios.clear();
    let base = series.median.filter(|median| *median != 0.0);
    figure.series.push(series);
    figure.references.push(peer.to_owned());
    if let Some(base) = base {
        for series in &mut figure.series {
            if let Some(median) = series.median {
                series.ratios.insert(format!("vs {peer}"), median / base);
            }
        }
    }
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
            "{HAPROXY_AUTO}: nbthread 1, mode tcp, option splice-auto, tune.pipesize {PIPE_SIZE}, maxpipes = maxconn, no option tcpka (its default); {HAPROXY_FORCED}: the same with option splice-request + option splice-response instead; the nbthread 2 variants differ only in nbthread. \"{HAPROXY}\" is, per figure, whichever of the two has the better median."
        ),
    ]
}

async fn latency(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    eprintln!("proxy: latency");
    for _ in 0..settings.rounds {
        for index in shuffled(contenders.len()) {
            let contender = &mut contenders[index];
            let result = load::latency(
                contender.addr,
                workload.latency_rate,
                workload.latency_duration,
                workload.latency_message,
            )
            .await
            .with_context(|| format!("latency through {}", contender.name))?;
            contender.check_running()?;
            recorder.record(LATENCY_P50, contender.name, result.p50_us);
            recorder.record(LATENCY_P99, contender.name, result.p99_us);
            recorder.record(LATENCY_P999, contender.name, result.p999_us);
        }
    }
    Ok(())
}

async fn connection_rate(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
    notes: &mut Vec<String>,
) -> anyhow::Result<()> {
    eprintln!("proxy: connection rate");
    recorder.note(CONNECTION_CPU, DIRECT, "no relay process");
    let mut failures: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    // Per contender and round: the CPU seconds per second the relay and the generator used.
    let mut busy: BTreeMap<&str, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for _ in 0..settings.rounds {
        for index in shuffled(contenders.len()) {
            let contender = &mut contenders[index];
            let cpu_before = contender.cpu_seconds()?;
            let generator_before = system::cpu_seconds(std::process::id())?;
            let started = std::time::Instant::now();
            let result = load::connection_rate(
                contender.addr,
                workload.connection_concurrency,
                workload.connection_duration,
            )
            .await
            .with_context(|| format!("connection rate through {}", contender.name))?;
            let generator_seconds = system::cpu_seconds(std::process::id())? - generator_before;
            let wall = started.elapsed().as_secs_f64();
            contender.check_running()?;
            busy.entry(contender.name)
                .or_default()
                .1
                .push(generator_seconds / wall);
            if generator_seconds >= system::MIN_CPU_SECONDS && result.completed > 0 {
                recorder.record(
                    GENERATOR_CPU_PER_CONNECTION,
                    contender.name,
                    generator_seconds * 1e3 / (result.completed as f64 / 1e3),
                );
            }
            recorder.record(CONNECTION_RATE, contender.name, result.per_second);
            recorder.record(CONNECTION_P99, contender.name, result.p99_first_byte_us);
            if let (Some(before), Some(after)) = (cpu_before, contender.cpu_seconds()?) {
                let seconds = after - before;
                busy.entry(contender.name)
                    .or_default()
                    .0
                    .push(seconds / wall);
                if seconds >= system::MIN_CPU_SECONDS && result.completed > 0 {
                    let per_thousand = seconds * 1e3 / (result.completed as f64 / 1e3);
                    recorder.record(CONNECTION_CPU, contender.name, per_thousand);
                }
            }
            let entry = failures.entry(contender.name).or_default();
            entry.0 += result.completed;
            entry.1 += result.failed;
        }
    }
    let shown: Vec<String> = busy
        .iter_mut()
        .map(|(name, (relay, generator))| {
            let relay = median(relay).map_or("—".to_owned(), |m| format!("{m:.2}"));
            let generator = median(generator).map_or("—".to_owned(), |m| format!("{m:.2}"));
            format!("{name}: relay {relay}, generator and sink {generator}")
        })
        .collect();
    notes.push(format!(
        "CPU busy during the connection-rate runs (CPU seconds per second, median of rounds; 1.00 is one CPU): {}.",
        shown.join("; ")
    ));
    for (name, (completed, failed)) in failures {
        if failed > 0 {
            notes.push(format!(
                "connection rate through {name}: {failed} of {} connections failed or timed out",
                completed + failed
            ));
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
            let mut contender = relays.start_with(name, sink.addr(), true)?;
            let pid = contender.pid().context("relay without a process")?;
            let before = system::rss_kib(pid)?;
            let fds_before = system::fd_count(pid)?;
            let held = load::hold_idle(contender.addr, workload.idle_connections, &sink)
                .await
                .with_context(|| format!("idle connections through {name}"))?;
            // Let the relay go quiet (deferred frees, lazy setup) before reading its memory.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let after = system::rss_kib(pid)?;
            let fds_after = system::fd_count(pid)?;
            contender.check_running()?;
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

fn goals(figures: &[Figure]) -> Vec<Goal> {
    let find = |metric: Metric| figures.iter().find(|f| f.name == metric.name);
    let mut goals = Vec::new();
    for (streams, _, metric) in BULK {
        let Some(figure) = find(metric) else { continue };
        if streams == 1 {
            goals.push(ratio_goal(figure, PROXY_CORE, DIRECT, 0.5));
            goals.push(ratio_goal(figure, PROXY_CORE, HAPROXY, 1.2));
        } else {
            goals.push(ratio_goal(figure, PROXY_CORE, HAPROXY, 1.0));
        }
    }
    for (_, metric) in SCALING {
        let Some(figure) = find(metric) else { continue };
        goals.push(ratio_goal(figure, PROXY_CORE_2T, HAPROXY_2T, 1.0));
    }
    if let Some(figure) = find(LATENCY_P99) {
        let added = |name: &str| Some(figure.median(name)? - figure.median(DIRECT)?);
        let (ours, theirs) = (added(PROXY_CORE), added(HAPROXY));
        goals.push(Goal {
            goal: "added p99 latency <= HAProxy's".to_owned(),
            measured: format!(
                "proxy-core {} µs, haproxy {} µs over direct",
                shown(ours),
                shown(theirs)
            ),
            met: ours.zip(theirs).map(|(o, t)| o <= t),
        });
    }
    if let Some(figure) = find(CONNECTION_RATE) {
        goals.push(ratio_goal(figure, PROXY_CORE, HAPROXY, 1.0));
    }
    if let Some(figure) = find(IDLE_RSS) {
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
    if let Some(figure) = find(IDLE_FDS) {
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

/// `ours`'s median at least `at_least` times the reference's.
fn ratio_goal(figure: &Figure, ours: &str, reference: &str, at_least: f64) -> Goal {
    let ratio = figure
        .median(ours)
        .zip(figure.median(reference))
        .map(|(ours, theirs)| ours / theirs);
    Goal {
        goal: format!("{}: {ours} >= {at_least:.2}x {reference}", figure.name),
        measured: ratio.map_or_else(|| "not measured".to_owned(), |r| format!("{r:.2}x")),
        met: ratio.map(|r| r >= at_least),
    }
}

fn shown(value: Option<f64>) -> String {
    value.map_or_else(|| "?".to_owned(), |v| format!("{v:+.0}"))
}

fn explanations(settings: &Settings) -> Vec<String> {
    let workload = Workload::new(settings);
    vec![
        format!(
            "Bulk: {} MiB per run, split evenly over the streams; Gbit/s of payload, checked end to end.",
            workload.bulk_bytes >> 20
        ),
        "Relay CPU: utime+stime of the relay process from /proc/<pid>/stat over a round's bulk runs, per GiB of payload; and over each connection-rate run, per 1000 connections (what a relay pays per connection, whatever the generator and the other CPU limit the rate to).".to_owned(),
        format!(
            "Latency: open loop, one connection, {} msg/s for {:?}, measured from each message's scheduled send time (HDR histogram, first 5% dropped as warm-up).",
            workload.latency_rate, workload.latency_duration
        ),
        format!(
            "Connection rate: {} concurrent loops for {:?}, sources spread over 127.0.0.2-251; the sink closes first.",
            workload.connection_concurrency, workload.connection_duration
        ),
        format!(
            "Idle RSS: VmRSS of a fresh relay before and after {} connections, each accepted and connected upstream (the sink holds them all) but never carrying a byte; kernel socket memory is not in RSS.{}",
            workload.idle_connections,
            if workload.idle_connections < 10_000 && !settings.quick {
                format!(
                    " Fewer than 10 000 because the open-file limit here is {} and cannot be raised further (setrlimit above the hard limit is refused), and HAProxy refuses to start unless the limit covers 2.5 descriptors per maxconn (it runs this phase with maxconn = this count and maxpipes 0); the relay and this generator need two per idle connection.",
                    settings.fd_limit
                )
            } else {
                String::new()
            }
        ),
        "Scaling: 8 streams, as the bulk runs, through relays with two worker threads (proxy-core) or nbthread 2 (HAProxy), unpinned.".to_owned(),
    ]
}

/// What bounds the figures proxy-core does not reach, from profiles of the relay taken during
/// this bench (`perf record -g -p <relay>`, cpu-clock sampling, Debian linux-perf) and syscall
/// counts (`strace -c -f -p <relay>` over 2000 sequential pings, one thread), with this run's
/// figures in the text so that every statement can be checked against the tables. Issue 13.
fn bounds(figures: &[Figure]) -> Vec<String> {
    let [up, down, eight_up, eight_down] = BULK.map(|(_, _, metric)| metric);
    let [scaled_up, scaled_down] = SCALING.map(|(_, metric)| metric);
    let vs = |metric: Metric, ours: &str, reference: &str| versus(figures, metric, ours, reference);
    vec![
        format!(
            "Bound, bulk one stream (goal 0.5x direct; this run: proxy-core up {}, down {}; HAProxy forced splice up {}, down {}): the relay is not CPU-bound. Over the bulk runs it spends 96% of its cycles in the kernel (splice pipe -> socket 68%, which includes the loopback delivery into the receiving socket run in softirq on the relay's CPU, about 26%; splice socket -> pipe 16%) and 3% in user space; at 0.27-0.30 CPU s/GiB and 12-15 Gbit/s its CPU is busy 40-50% of the time (HAProxy forced splice: 0.25-0.29 CPU s/GiB; the difference is kernel time, the relay's own code being 3%). A single stream through any relay crosses one more loopback TCP hop, with a cross-CPU wake-up (an IPI, costly in this VM) at each hand-off, while the generator's CPU still does every copy in and out. HAProxy with forced splice, which makes the same two splice calls per chunk through a pipe of the same size, lands in the same band, so the ceiling is the kernel's loopback path, not the relay's code. Bound, bulk one stream (goal 1.2x HAProxy; this run: up {}, down {}): proxy-core is 1.5-1.9x HAProxy splice-auto, but against forced splice with proxy-core's pipe size it is at parity (0.93-1.38x in three earlier full runs of 2026-12-02): when 96% of both relays' cycles are the same kernel calls, no change in the relay's 3% of user space can make it 1.2x faster.",
            vs(up, PROXY_CORE, DIRECT),
            vs(down, PROXY_CORE, DIRECT),
            vs(up, HAPROXY_FORCED, DIRECT),
            vs(down, HAPROXY_FORCED, DIRECT),
            vs(up, PROXY_CORE, HAPROXY_FORCED),
            vs(down, PROXY_CORE, HAPROXY_FORCED),
        ),
        format!(
            "Bound, connection rate (goal 1.0x HAProxy; this run: {}; 0.92-0.98x in four earlier runs of 2026-12-02 with the current-thread runtime proxy-core runs here, 0.85-0.95x in seven with a multi-thread runtime of one worker): neither CPU is saturated.{CONNECTION_RATE_PROFILE}",
            vs(CONNECTION_RATE, PROXY_CORE, HAPROXY),
        ),
        format!(
            "Bound, 8 streams (goal 1.0x HAProxy, one relay thread and two; this run, one thread: up {}, down {}; two threads: up {}, down {}): the generator and sink copy every byte in and out through the socket API and saturate their CPU. With one relay thread the relay's CPU is busy about a third of the time (relay CPU per GiB x throughput). With two threads everything is unpinned and the generator and sink take about 1.3 of the 2 CPUs (perf record -a -g over 3 rounds of the scaling phase: 64% of all samples in this process, nearly all kernel copy and loopback); the relays share the rest (proxy-core 2 threads about 0.55 CPU, HAProxy forced splice nbthread 2 about 0.49 CPU during their runs) and both splice. Within that ceiling the two are at parity: 0.84-1.11x over five earlier runs, the lowest with each median inside the other's min-max.",
            vs(eight_up, PROXY_CORE, HAPROXY),
            vs(eight_down, PROXY_CORE, HAPROXY),
            vs(scaled_up, PROXY_CORE_2T, HAPROXY_2T),
            vs(scaled_down, PROXY_CORE_2T, HAPROXY_2T),
        ),
        "Idle connections: 10 000 do not fit this machine's hard open-file limit of 20 000 (setrlimit above it is refused even as root here): a relay needs 2 descriptors per connection plus its own, the generator 2 more (client and sink side), and HAProxy 2.5 per maxconn, so every contender holds the count shown in the note above.".to_owned(),
    ]
}

/// The profile behind the connection-rate bound (perf and strace on this machine, 2026-12-02).
const CONNECTION_RATE_PROFILE: &str = " At about 6 300 connections/s the relay uses about half a CPU and the generator and sink about half of theirs (see the CPU-busy note), so the closed loop of 16 connections is bound by the hand-offs between the two CPUs (each a cross-CPU wake-up, an IPI and a vCPU wake from halt in this VM), and every microsecond either side spends per connection lengthens each hand-off. Per connection the relay pays 1.1-1.2x HAProxy's CPU time and costs the generator 1.0-1.1x (the two CPU-per-1000-connections figures). A system-wide profile (perf record -a -g over 4 rounds of this phase) put the relay's samples per connection within 1% of HAProxy's: 83% kernel (connect, close and sendto, each with the loopback delivery in softirq), about 7% user space. strace -f -p over 20 s: proxy-core issues 23 syscalls per connection with keepalive off (accept4 1.14 including EAGAIN, socket, connect, getsockopt SO_ERROR, setsockopt TCP_NODELAY, epoll_ctl 4 = 2 ADD + 2 DEL before close, recvfrom 4, sendto 2, shutdown, close 2, and an eventfd write on 35% of connections when arming the connect timer wakes the driver); HAProxy 2.6 issues 21 (+0.5 clock_gettime): level-triggered epoll with one MOD, close removes the socket, no SO_ERROR read, timers in user space. Two changes measured here made no difference beyond the noise: keepalive off (4 setsockopt fewer; kept, for equal work) and reading the client's first bytes before connecting upstream as HAProxy does (0.85-0.94x; not kept). Running one event loop on the main thread (tokio's current-thread runtime, as HAProxy nbthread 1) instead of a worker beside the main thread moved the ratio up by a few hundredths, about the noise between runs, without changing the syscalls (strace -c -f over 2000 sequential connections: 25 per connection in both, 5 of them epoll_wait); the hand-off between the two runtime threads is gone. What remains is tokio's epoll registration and timer model, which the relay cannot change without an event loop of its own.";

/// `ours` against `reference` in one figure of this run: the ratio of medians, and whether each
/// median falls inside the other's min-max (then the run cannot tell the two apart).
fn versus(figures: &[Figure], metric: Metric, ours: &str, reference: &str) -> String {
    let Some(figure) = figures.iter().find(|f| f.name == metric.name) else {
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
        let [up, down, ..] = BULK.map(|(_, _, metric)| metric);
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
            versus(&figures, up, PROXY_CORE, HAPROXY_FORCED),
            "1.00x, each median inside the other's min-max"
        );
        assert_eq!(versus(&figures, down, PROXY_CORE, HAPROXY_FORCED), "0.51x");
        assert_eq!(
            versus(&figures, CONNECTION_RATE, PROXY_CORE, HAPROXY),
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
    fn peer_is_the_better_haproxy() {
        let mut recorder = Recorder::default();
        let metric = Metric::higher("rate", "conn/s");
        recorder.record(metric, PROXY_CORE, 120.0);
        recorder.record(metric, HAPROXY_AUTO, 100.0);
        recorder.record(metric, HAPROXY_FORCED, 80.0);
        let mut figures = recorder.finish(&[]);
        add_peer(&mut figures[0], HAPROXY, &[HAPROXY_AUTO, HAPROXY_FORCED]);
        assert_eq!(figures[0].median(HAPROXY), Some(100.0));
        let ratio = figures[0]
            .series
            .iter()
            .find(|s| s.contender == PROXY_CORE)
            .and_then(|s| s.ratios.get("vs haproxy (better)").copied());
        assert_eq!(ratio, Some(1.2));
    }
}
