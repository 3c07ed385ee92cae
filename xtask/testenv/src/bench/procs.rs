//! The load generator and the sink as processes of their own: this xtask binary re-executed in a
//! role (`NETKIT_BENCH_ROLE=sink|generator`), each pinned to one CPU, so that every party's CPU
//! time (relay, generator, sink) is read from its own `/proc/<pid>/stat`.
//!
//! A generator runs one job: a warm-up, then a measured window of fixed length. It prints
//! `start` when the window opens and `end` when it closes (the orchestrator reads every
//! process's CPU time at both lines), then one `result <json>` line with what the window moved.

use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

use super::cgroup::{CpuClock, CpuMeter};
use super::load::{self, Sink};
use super::system::{self, Service, TcpCounters};

/// Which role this process plays, and the job of a generator (JSON).
pub const ROLE_ENV: &str = "NETKIT_BENCH_ROLE";
const JOB_ENV: &str = "NETKIT_BENCH_JOB";
const SINK_PORT_ENV: &str = "NETKIT_BENCH_SINK_PORT";
const CPU_ENV: &str = "NETKIT_BENCH_CPU";
/// The io_uring probe's listening and upstream addresses: `<listen> <upstream>`.
pub const PROBE_ENV: &str = "NETKIT_BENCH_PROBE";

const UPLOAD: u8 = b'U';
const DOWNLOAD: u8 = b'D';
const PING: u8 = b'P';
const CHUNK: usize = 256 * 1024;

/// Window phases shared by a generator's tasks.
const WARMING: u8 = 0;
const MEASURING: u8 = 1;
const DONE: u8 = 2;

/// What a generator does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub enum Work {
    /// `streams` connections moving bytes one way as fast as they can.
    Bulk { download: bool, streams: usize },
    /// `concurrency` loops of connect, one byte each way, close (closed loop).
    Closed { concurrency: usize },
    /// Connections started at a fixed rate whatever happens to earlier ones (open loop).
    Open { rate: u32 },
    /// One connection, `size`-byte messages echoed at `rate` per second (open loop).
    Latency { rate: u32, size: usize },
}

#[derive(Serialize, Deserialize, Debug)]
struct Job {
    target: SocketAddr,
    warmup_ms: u64,
    measure_ms: u64,
    work: Work,
}

/// What a generator measured in its window.
#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub struct Measured {
    /// Length of the window.
    pub seconds: f64,
    /// Payload bytes moved in the window (bulk).
    pub bytes: u64,
    /// Connections whose first byte came back in the window (rates).
    pub completed: u64,
    /// Connections that failed or timed out (rates).
    pub failed: u64,
    /// Open loop: connections started more than 2 ms after their scheduled time.
    pub late_starts: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

/// CPU seconds each party used in a window, and what the kernel counted meanwhile.
#[derive(Clone, Copy, Debug, Default)]
pub struct WindowCpu {
    pub relay: Option<f64>,
    pub generator: f64,
    pub sink: f64,
    /// TCP counters of the network namespace over the window (every party's segments).
    pub tcp: TcpCounters,
    /// The relay's voluntary and involuntary context switches over the window.
    pub relay_switches: Option<(u64, u64)>,
}

/// The processes a generator's window measures besides the generator itself.
pub struct Watched<'a> {
    /// Where the generator's own clock comes from (a leaf of its own for each run).
    pub meter: &'a CpuMeter,
    /// The relay's pid and clock (none for direct).
    pub relay: Option<(u32, &'a CpuClock)>,
    pub sink: &'a CpuClock,
}

/// Runs this process's role if it has one; `Ok(false)` when it is the orchestrator.
pub fn run_role() -> anyhow::Result<bool> {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return Ok(false);
    };
    if let Some(cpu) = std::env::var(CPU_ENV).ok().and_then(|c| c.parse().ok()) {
        system::pin_current_thread(cpu)?;
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    match role.as_str() {
        "sink" => {
            let port: u16 = std::env::var(SINK_PORT_ENV)
                .context("sink without a port")?
                .parse()?;
            runtime.block_on(async {
                let _sink = Sink::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await?;
                std::future::pending::<anyhow::Result<()>>().await
            })?;
        }
        "generator" => {
            let job: Job = serde_json::from_str(&std::env::var(JOB_ENV).context("no job")?)?;
            let measured = runtime.block_on(generate(&job))?;
            println!("result {}", serde_json::to_string(&measured)?);
        }
        "uring-probe" => {
            let addresses = std::env::var(PROBE_ENV).context("a probe without addresses")?;
            let (listen, upstream) = addresses
                .split_once(' ')
                .context("the probe's addresses are not '<listen> <upstream>'")?;
            super::uring_probe::serve(listen.parse()?, upstream.parse()?)?;
        }
        other => bail!("unknown bench role {other}"),
    }
    Ok(true)
}

fn role_command(role: &str, cpu: Option<usize>) -> anyhow::Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("finding this executable")?);
    cmd.args(std::env::args_os().skip(1))
        .env(ROLE_ENV, role)
        .env(super::RELEASE_ENV, "1");
    if let Some(cpu) = cpu.filter(|_| system::can_pin()) {
        cmd.env(CPU_ENV, cpu.to_string());
    }
    Ok(cmd)
}

/// A sink process on `cpu`, listening on 127.0.0.1.
pub struct SinkProcess {
    pub addr: SocketAddr,
    service: Service,
}

impl SinkProcess {
    pub fn start(cpu: Option<usize>, log_dir: &Path, name: &str) -> anyhow::Result<Self> {
        let port = system::free_port()?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let mut cmd = role_command("sink", cpu)?;
        cmd.env(SINK_PORT_ENV, port.to_string());
        let mut service = Service::spawn(name, cmd, log_dir)?;
        service.wait_listening(addr, Duration::from_secs(10))?;
        Ok(Self { addr, service })
    }

    pub fn pid(&self) -> u32 {
        self.service.pid()
    }

    /// A clock of this sink's CPU time (see [`CpuMeter::clock`]).
    pub fn clock(&self, meter: &CpuMeter, name: &str) -> anyhow::Result<CpuClock> {
        meter.clock(name, self.pid())
    }
}

/// Runs one generator job against `target` on `cpu`; reads the CPU time of the relay (if any),
/// the sink and the generator, the TCP counters and the relay's context switches when the window
/// opens and closes, then calls `hook` (`true` at the opening: a profiler attaches there).
pub fn run_generator(
    target: SocketAddr,
    cpu: Option<usize>,
    work: Work,
    (warmup, measure): (Duration, Duration),
    watched: &Watched<'_>,
    hook: &mut dyn FnMut(bool) -> anyhow::Result<()>,
) -> anyhow::Result<(Measured, WindowCpu)> {
    let job = Job {
        target,
        warmup_ms: warmup.as_millis() as u64,
        measure_ms: measure.as_millis() as u64,
        work,
    };
    let mut cmd = role_command("generator", cpu)?;
    cmd.env(JOB_ENV, serde_json::to_string(&job)?)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = KillOnDrop(cmd.spawn().context("starting the generator")?);
    let pid = child.0.id();
    // Joined long before its window opens (after the warm-up); the leaf goes with this run.
    let generator = watched.meter.clock("generator", pid)?;
    let stdout = child.0.stdout.take().context("generator stdout")?;
    let read_all = || -> anyhow::Result<Snapshot> {
        Ok(Snapshot {
            relay: watched
                .relay
                .map(|(_, clock)| clock.seconds())
                .transpose()?,
            generator: generator.seconds()?,
            sink: watched.sink.seconds()?,
            tcp: system::tcp_counters()?,
            relay_switches: watched
                .relay
                .map(|(pid, _)| system::context_switches(pid))
                .transpose()?,
        })
    };
    let mut at_start = None;
    let mut at_end = None;
    let mut measured = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        match line.as_str() {
            "start" => {
                at_start = Some(read_all()?);
                hook(true)?;
            }
            "end" => {
                at_end = Some(read_all()?);
                hook(false)?;
            }
            other => {
                if let Some(json) = other.strip_prefix("result ") {
                    measured = Some(serde_json::from_str::<Measured>(json)?);
                }
            }
        }
    }
    let status = child.0.wait()?;
    ensure!(status.success(), "generator {work:?} failed ({status})");
    let (Some(start), Some(end), Some(measured)) = (at_start, at_end, measured) else {
        bail!("generator {work:?} did not report its window");
    };
    let cpu = WindowCpu {
        relay: start.relay.zip(end.relay).map(|(a, b)| b - a),
        generator: end.generator - start.generator,
        sink: end.sink - start.sink,
        tcp: end.tcp.since(start.tcp),
        relay_switches: start
            .relay_switches
            .zip(end.relay_switches)
            .map(|(a, b)| (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1))),
    };
    Ok((measured, cpu))
}

/// What is read at each end of a window.
struct Snapshot {
    relay: Option<f64>,
    generator: f64,
    sink: f64,
    tcp: TcpCounters,
    relay_switches: Option<(u64, u64)>,
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn say(line: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

async fn generate(job: &Job) -> anyhow::Result<Measured> {
    let warmup = Duration::from_millis(job.warmup_ms);
    let measure = Duration::from_millis(job.measure_ms);
    match job.work {
        Work::Bulk { download, streams } => {
            bulk(job.target, download, streams, warmup, measure).await
        }
        Work::Closed { concurrency } => closed(job.target, concurrency, warmup, measure).await,
        Work::Open { rate } => open(job.target, rate, warmup, measure).await,
        Work::Latency { rate, size } => {
            say("start")?;
            let started = Instant::now();
            let latency = load::latency(job.target, rate, warmup + measure, size).await?;
            let seconds = started.elapsed().as_secs_f64();
            say("end")?;
            Ok(Measured {
                seconds,
                p50_us: latency.p50_us,
                p99_us: latency.p99_us,
                p999_us: latency.p999_us,
                ..Measured::default()
            })
        }
    }
}

/// Opens and closes the window around `warmup` and `measure`; returns the counter's growth and
/// the window's length.
async fn window(
    phase: &AtomicU8,
    counter: &AtomicU64,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<(u64, f64)> {
    tokio::time::sleep(warmup).await;
    let before = counter.load(Ordering::Relaxed);
    let opened = Instant::now();
    phase.store(MEASURING, Ordering::Relaxed);
    say("start")?;
    tokio::time::sleep(measure).await;
    let after = counter.load(Ordering::Relaxed);
    let seconds = opened.elapsed().as_secs_f64();
    phase.store(DONE, Ordering::Relaxed);
    say("end")?;
    Ok((after - before, seconds))
}

async fn bulk(
    target: SocketAddr,
    download: bool,
    streams: usize,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Measured> {
    let phase = Arc::new(AtomicU8::new(WARMING));
    let moved = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..streams {
        let (phase, moved) = (phase.clone(), moved.clone());
        tasks.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(target).await?;
            stream.set_nodelay(true)?;
            if download {
                stream.write_u8(DOWNLOAD).await?;
                stream.write_u64(u64::MAX).await?;
                let mut buf = vec![0u8; CHUNK];
                while phase.load(Ordering::Relaxed) != DONE {
                    let n = stream.read(&mut buf).await?;
                    ensure!(n > 0, "the download ended early");
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
            } else {
                stream.write_u8(UPLOAD).await?;
                let buf = vec![0u8; CHUNK];
                let mut sent = 0u64;
                while phase.load(Ordering::Relaxed) != DONE {
                    stream.write_all(&buf).await?;
                    sent += CHUNK as u64;
                    moved.fetch_add(CHUNK as u64, Ordering::Relaxed);
                }
                stream.shutdown().await?;
                // Checked end to end: the sink counts what it received.
                let received = stream.read_u64().await?;
                ensure!(received == sent, "sink received {received} of {sent} bytes");
            }
            anyhow::Ok(())
        }));
    }
    let (bytes, seconds) = window(&phase, &moved, warmup, measure).await?;
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .context("a bulk stream did not finish")???;
    }
    Ok(Measured {
        seconds,
        bytes,
        ..Measured::default()
    })
}

/// One connection: connect, a ping, its one-byte answer, EOF. Returns connect-to-first-byte.
async fn ping(source: Ipv4Addr, target: SocketAddr) -> anyhow::Result<Duration> {
    let begun = Instant::now();
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    let mut stream = socket.connect(target).await?;
    stream.set_nodelay(true)?;
    stream.write_u8(PING).await?;
    let answer = stream.read_u8().await?;
    let first_byte = begun.elapsed();
    ensure!(answer == PING, "unexpected answer {answer}");
    let mut rest = [0u8; 16];
    ensure!(stream.read(&mut rest).await? == 0, "data after the ping");
    Ok(first_byte)
}

/// Source addresses spread over 127.0.0.2-251, so short connections do not run one address
/// out of ephemeral ports.
fn spread_source(index: u64) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 2 + (index % 250) as u8)
}

fn new_histogram() -> anyhow::Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000_000, 3)?)
}

fn record(histogram: &mut Histogram<u64>, latency: Duration) {
    histogram.saturating_record(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
}

fn percentiles(measured: &mut Measured, histogram: &Histogram<u64>) {
    let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1_000.0;
    measured.p50_us = us(0.50);
    measured.p99_us = us(0.99);
    measured.p999_us = us(0.999);
}

async fn closed(
    target: SocketAddr,
    concurrency: usize,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Measured> {
    let phase = Arc::new(AtomicU8::new(WARMING));
    let completed = Arc::new(AtomicU64::new(0));
    let next_source = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (phase, completed, next_source) =
            (phase.clone(), completed.clone(), next_source.clone());
        workers.push(tokio::spawn(async move {
            let mut histogram = new_histogram()?;
            let mut failed = 0u64;
            while phase.load(Ordering::Relaxed) != DONE {
                let source = spread_source(next_source.fetch_add(1, Ordering::Relaxed));
                let result =
                    tokio::time::timeout(Duration::from_secs(5), ping(source, target)).await;
                let measuring = phase.load(Ordering::Relaxed) == MEASURING;
                match result {
                    Ok(Ok(latency)) if measuring => {
                        completed.fetch_add(1, Ordering::Relaxed);
                        record(&mut histogram, latency);
                    }
                    Ok(Ok(_)) => {}
                    _ => failed += 1,
                }
            }
            anyhow::Ok((histogram, failed))
        }));
    }
    let (count, seconds) = window(&phase, &completed, warmup, measure).await?;
    let mut total = new_histogram()?;
    let mut measured = Measured {
        seconds,
        completed: count,
        ..Measured::default()
    };
    for worker in workers {
        let (histogram, failed) = worker.await??;
        total.add(histogram)?;
        measured.failed += failed;
    }
    ensure!(!total.is_empty(), "no connection completed");
    percentiles(&mut measured, &total);
    Ok(measured)
}

async fn open(
    target: SocketAddr,
    rate: u32,
    warmup: Duration,
    measure: Duration,
) -> anyhow::Result<Measured> {
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate));
    let started = tokio::time::Instant::now();
    let window_start = started + warmup;
    let window_end = window_start + measure;
    let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
    let scheduler = async {
        let mut index = 0u64;
        let mut late_starts = 0u64;
        let mut said_start = false;
        loop {
            let due = started + interval.mul_f64(index as f64);
            if due >= window_end {
                break;
            }
            if !said_start && due >= window_start {
                say("start")?;
                said_start = true;
            }
            // Tokio's timer has 1 ms resolution: connections due within it start together,
            // so a start counts as late only 2 ms after its time.
            if due > tokio::time::Instant::now() {
                tokio::time::sleep_until(due).await;
            }
            let in_window = due >= window_start;
            if in_window && tokio::time::Instant::now() > due + Duration::from_millis(2) {
                late_starts += 1;
            }
            let sender = sender.clone();
            let source = spread_source(index);
            tokio::spawn(async move {
                let result =
                    tokio::time::timeout(Duration::from_secs(5), ping(source, target)).await;
                let _ = sender.send((in_window, result.ok().and_then(Result::ok)));
            });
            index += 1;
        }
        tokio::time::sleep_until(window_end).await;
        say("end")?;
        anyhow::Ok((index, late_starts))
    };
    let (started_count, late_starts) = scheduler.await?;
    drop(sender);
    let mut histogram = new_histogram()?;
    let mut measured = Measured {
        seconds: measure.as_secs_f64(),
        late_starts,
        ..Measured::default()
    };
    let mut finished = 0u64;
    while let Some((in_window, latency)) = receiver.recv().await {
        finished += 1;
        match latency {
            Some(latency) if in_window => {
                measured.completed += 1;
                record(&mut histogram, latency);
            }
            Some(_) => {}
            None => measured.failed += 1,
        }
    }
    ensure!(finished == started_count, "lost connection results");
    ensure!(!histogram.is_empty(), "no connection completed");
    percentiles(&mut measured, &histogram);
    Ok(measured)
}
