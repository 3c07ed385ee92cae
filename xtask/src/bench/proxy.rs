//! `bench proxy`: the same workloads direct, through proxy-core (`examples/tcp_relay`) and through
//! HAProxy (`mode tcp`, `option splice-auto`), both relays on one worker thread on the relay CPU.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;

use super::load::{self, Direction, Sink};
use super::report::{Figure, Goal, Metric, Recorder};
use super::system::{self, GENERATOR_CPU, RELAY_CPU, Service};
use super::{Outcome, Settings};

const DIRECT: &str = "direct";
const PROXY_CORE: &str = "proxy-core";
const HAPROXY: &str = "haproxy";

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

/// Descriptors a relay may need per idle relayed connection: two sockets, plus the pipe that
/// proxy-core's splice path opens up front (measured, see the "descriptors" figure).
const FDS_PER_CONNECTION: u64 = 4;
/// Descriptors kept free for everything else (listeners, epoll, logs, the runtime).
const FD_MARGIN: u64 = 256;

impl Workload {
    fn new(settings: &Settings) -> Self {
        let quick = settings.quick;
        let wanted_idle: u64 = if quick { 1_000 } else { 10_000 };
        let fitting_idle = settings.fd_limit.saturating_sub(FD_MARGIN) / FDS_PER_CONNECTION;
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
const CPU_PER_GIB: Metric = Metric::lower("relay CPU per GiB relayed (all bulk runs)", "CPU s/GiB");
const LATENCY_P50: Metric = Metric::lower("1 KiB echo at 5k msg/s, p50", "µs");
const LATENCY_P99: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99", "µs");
const LATENCY_P999: Metric = Metric::lower("1 KiB echo at 5k msg/s, p99.9", "µs");
const CONNECTION_RATE: Metric =
    Metric::higher("connection rate (connect, 1 B each way, close)", "conn/s");
const CONNECTION_P99: Metric = Metric::lower("connect to first byte, p99", "µs");
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

impl Relays {
    fn names(&self) -> Vec<&'static str> {
        let mut names = vec![DIRECT, PROXY_CORE];
        if self.haproxy.is_some() {
            names.push(HAPROXY);
        }
        names
    }

    fn start(&self, name: &'static str, upstream: SocketAddr) -> anyhow::Result<Contender> {
        if name == DIRECT {
            return Ok(Contender {
                name,
                addr: upstream,
                process: None,
            });
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, system::free_port()?));
        let mut service = match name {
            PROXY_CORE => self.start_proxy_core(addr, upstream)?,
            _ => self.start_haproxy(addr, upstream)?,
        };
        service.wait_listening(addr, Duration::from_secs(10))?;
        Ok(Contender {
            name,
            addr,
            process: Some(service),
        })
    }

    fn start_proxy_core(
        &self,
        listen: SocketAddr,
        upstream: SocketAddr,
    ) -> anyhow::Result<Service> {
        let mut cmd = system::pinned_command(RELAY_CPU, &self.tcp_relay);
        cmd.arg("--listen")
            .arg(listen.to_string())
            .arg("--upstream")
            .arg(upstream.to_string())
            .arg("--drain-secs")
            .arg("0")
            // One worker, like HAProxy's one thread (tokio's default would be one per CPU).
            .env("TOKIO_WORKER_THREADS", "1")
            .env("RUST_LOG", "warn");
        Service::spawn("tcp_relay", cmd, &self.dir)
    }

    fn start_haproxy(&self, listen: SocketAddr, upstream: SocketAddr) -> anyhow::Result<Service> {
        let haproxy = self
            .haproxy
            .as_deref()
            .context("haproxy is not installed")?;
        let config = self.dir.join(format!("haproxy-{}.cfg", listen.port()));
        // HAProxy itself needs two sockets per connection (its few pipes are in the margin).
        let maxconn = self.fd_limit.saturating_sub(FD_MARGIN) / 2;
        std::fs::write(&config, haproxy_config(listen, upstream, maxconn))
            .with_context(|| format!("writing {}", config.display()))?;
        let mut cmd = system::pinned_command(RELAY_CPU, haproxy);
        // -db: foreground, no daemon, no master process: one pid to measure.
        cmd.arg("-db").arg("-f").arg(&config);
        Service::spawn("haproxy", cmd, &self.dir)
    }
}

/// HAProxy's config. `maxconn` must fit the open-file limit (HAProxy refuses to start when it
/// cannot raise the limit to about 2 x maxconn + 2 x maxpipes); 32 pipes cover 8 spliced streams
/// both ways, where the default (maxconn / 4) would not fit.
fn haproxy_config(listen: SocketAddr, upstream: SocketAddr, maxconn: u64) -> String {
    format!(
        "global
    nbthread 1
    maxconn {maxconn}
    maxpipes 32

defaults
    mode tcp
    option splice-auto
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
    let figures = recorder.finish(&[DIRECT, HAPROXY]);
    let goals = goals(&figures);
    notes.extend(explanations(settings));
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
            for contender in contenders.iter_mut() {
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

async fn latency(
    settings: &Settings,
    workload: &Workload,
    contenders: &mut [Contender],
    recorder: &mut Recorder,
) -> anyhow::Result<()> {
    eprintln!("proxy: latency");
    for _ in 0..settings.rounds {
        for contender in contenders.iter_mut() {
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
    let mut failures: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for _ in 0..settings.rounds {
        for contender in contenders.iter_mut() {
            let result = load::connection_rate(
                contender.addr,
                workload.connection_concurrency,
                workload.connection_duration,
            )
            .await
            .with_context(|| format!("connection rate through {}", contender.name))?;
            contender.check_running()?;
            recorder.record(CONNECTION_RATE, contender.name, result.per_second);
            recorder.record(CONNECTION_P99, contender.name, result.p99_first_byte_us);
            let entry = failures.entry(contender.name).or_default();
            entry.0 += result.completed;
            entry.1 += result.failed;
        }
    }
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
    for _ in 0..settings.rounds {
        for name in relays.names().into_iter().filter(|n| *n != DIRECT) {
            let sink = Sink::start().await?;
            let mut contender = relays.start(name, sink.addr())?;
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
    for (_, _, metric) in BULK {
        let Some(figure) = find(metric) else { continue };
        goals.push(ratio_goal(figure, DIRECT, 0.85));
        goals.push(ratio_goal(figure, HAPROXY, 1.0));
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
        goals.push(ratio_goal(figure, HAPROXY, 1.0));
    }
    if let Some(figure) = find(IDLE_RSS) {
        let ours = figure.median(PROXY_CORE);
        goals.push(Goal {
            goal: "<= 16 KiB RSS per idle relayed connection".to_owned(),
            measured: format!(
                "proxy-core {} KiB",
                ours.map_or_else(|| "?".to_owned(), |kib| format!("{kib:.1}"))
            ),
            met: ours.map(|kib| kib <= 16.0),
        });
    }
    goals
}

/// proxy-core's median at least `at_least` times the reference's.
fn ratio_goal(figure: &Figure, reference: &str, at_least: f64) -> Goal {
    let ratio = figure
        .median(PROXY_CORE)
        .zip(figure.median(reference))
        .map(|(ours, theirs)| ours / theirs);
    Goal {
        goal: format!("{}: proxy-core >= {at_least:.2}x {reference}", figure.name),
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
        "Relay CPU: utime+stime of the relay process from /proc/<pid>/stat over a round's bulk runs, per GiB of payload.".to_owned(),
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
                    " Fewer than 10 000 because the open-file limit here is {} and cannot be raised (no CAP_SYS_RESOURCE), and a relay may need up to {FDS_PER_CONNECTION} descriptors per connection (see the descriptors figure).",
                    settings.fd_limit
                )
            } else {
                String::new()
            }
        ),
        "proxy-core: examples/tcp_relay (copy mode auto = splice), TOKIO_WORKER_THREADS=1; HAProxy: nbthread 1, mode tcp, option splice-auto.".to_owned(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn haproxy_config_names_both_addresses() {
        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, 1000));
        let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, 2000));
        let config = haproxy_config(listen, upstream, 1000);
        assert!(config.contains("bind 127.0.0.1:1000"));
        assert!(config.contains("server sink 127.0.0.1:2000"));
        assert!(config.contains("option splice-auto"));
        assert!(config.contains("maxconn 1000"));
    }
}
