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

use std::io::BufRead as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use proxy_core::testing;
use rstream_client::Client;
use rstream_client::engine::LocalEngine;
use rstream_client::tunnel::TunnelOptions;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use super::load;
use super::report::{Goal, Metric, Recorder};
use super::system::{self, GENERATOR_CPU, RELAY_CPU};
use super::{Outcome, Settings};

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
const SDK_SCRIPT: &str = include_str!("rstream_sdk.py");

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

const TRANSFER_TIMEOUT: Duration = Duration::from_secs(120);
const BULK_CHUNK: usize = 256 * 1024;

/// Sink commands (a byte, then a big-endian u64 length for the transfers).
const CMD_UPLOAD: u8 = b'U';
const CMD_DOWNLOAD: u8 = b'D';
/// The byte `load::setup_latency` sends and expects back.
const CMD_PING: u8 = b'P';

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

/// A tokio runtime driven by its own std thread (pinned to `cpu` if pinning is possible): what
/// runs on it uses that thread only, so its CPU time is that thread's.
struct RuntimeThread {
    handle: Handle,
    tid: i32,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl RuntimeThread {
    fn start(name: &str, cpu: usize) -> anyhow::Result<Self> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                if system::can_pin() {
                    // Unpinned is still correct, only noisier.
                    let _ = system::pin_current_thread(cpu);
                }
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                        return;
                    }
                };
                let tid = rustix::thread::gettid().as_raw_nonzero().get();
                let _ = ready_tx.send(Ok((runtime.handle().clone(), tid)));
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                runtime.shutdown_timeout(Duration::from_secs(5));
            })?;
        let (handle, tid) = ready_rx
            .recv()
            .context("the runtime thread ended before starting")??;
        Ok(Self {
            handle,
            tid,
            stop,
            thread,
        })
    }

    /// CPU seconds this thread has used.
    fn cpu_seconds(&self) -> anyhow::Result<f64> {
        thread_cpu_seconds(self.tid)
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// CPU seconds (user + system) one thread of this process has used.
fn thread_cpu_seconds(tid: i32) -> anyhow::Result<f64> {
    let path = format!("/proc/self/task/{tid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("malformed stat")?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 (utime) and 15 (stime) of proc(5); index 0 here is field 3.
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .context("short stat")?
            .parse()
            .context("parsing stat")
    };
    let per_second = rustix::param::clock_ticks_per_second() as f64;
    Ok((ticks(11)? + ticks(12)?) as f64 / per_second)
}

/// The engine's thread, this (generator) thread and the peer, for CPU accounting.
struct CpuClocks<'a> {
    engine: &'a RuntimeThread,
    generator: i32,
}

/// What a contender's transfers go through, and whose CPU time is its peer's.
enum Peer<'a> {
    None,
    Thread(&'a RuntimeThread),
    Process(u32),
}

impl Peer<'_> {
    fn cpu_seconds(&self) -> anyhow::Result<Option<f64>> {
        Ok(match self {
            Self::None => None,
            Self::Thread(thread) => Some(thread.cpu_seconds()?),
            Self::Process(pid) => Some(system::cpu_seconds(*pid)?),
        })
    }
}

struct Contender<'a> {
    name: &'static str,
    addr: SocketAddr,
    peer: Peer<'a>,
}

async fn measure(
    settings: &Settings,
    sizes: &Sizes,
    engine_thread: &RuntimeThread,
    client_thread: &RuntimeThread,
    python: Option<&Path>,
) -> anyhow::Result<(Recorder, Option<String>)> {
    let sink = start_sink().await?;
    let target = sink.0;
    let engine = engine_thread
        .handle
        .spawn(LocalEngine::builder().token(TOKEN).start())
        .await??;
    let dir = tempfile::Builder::new()
        .prefix("netkit-bench-rstream-")
        .tempdir()?;
    let result = async {
        let tunnel = client_thread
            .handle
            .spawn(open_tunnel(
                engine.engine_address(),
                engine.client_tls(),
                target,
            ))
            .await??;
        let ingress = engine
            .ingress_addr(&tunnel.id)
            .context("the published tunnel has no ingress")?;
        let mut sdks = Vec::new();
        let mut sdk_info = None;
        if let Some(python) = python {
            for (name, uvloop) in [(SDK, false), (SDK_UVLOOP, true)] {
                let sdk = SdkPeer::start(python, &engine, dir.path(), target, uvloop).await?;
                let ingress = engine
                    .ingress_addr(&sdk.id)
                    .context("the SDK's tunnel has no ingress")?;
                let info: &mut String = sdk_info.get_or_insert_with(String::new);
                if !info.is_empty() {
                    info.push_str("; ");
                }
                info.push_str(&format!(
                    "{name}: version {}, event loop {}",
                    sdk.version, sdk.event_loop
                ));
                sdks.push((name, ingress, sdk));
            }
        }
        let mut contenders = vec![
            Contender {
                name: DIRECT,
                addr: target,
                peer: Peer::None,
            },
            Contender {
                name: TUNNEL,
                addr: ingress,
                peer: Peer::Thread(client_thread),
            },
        ];
        for (name, addr, sdk) in &sdks {
            contenders.push(Contender {
                name,
                addr: *addr,
                peer: Peer::Process(sdk.child.id()),
            });
        }
        let clocks = CpuClocks {
            engine: engine_thread,
            generator: rustix::thread::gettid().as_raw_nonzero().get(),
        };
        let recorder = measure_contenders(settings, sizes, &contenders, &clocks).await;
        for (_, _, mut sdk) in sdks {
            sdk.check_running()?;
            sdk.stop();
        }
        client_thread.handle.spawn(tunnel.close()).await?;
        anyhow::Ok((recorder?, sdk_info))
    }
    .await;
    engine_thread.handle.spawn(engine.shutdown()).await?;
    sink.1.abort();
    result
}

/// The client's control channel and the forwarder of one published tunnel.
struct Tunnel {
    id: String,
    control: rstream_client::ControlChannel,
    forward: JoinHandle<()>,
}

impl Tunnel {
    async fn close(self) {
        let _ = self.control.close().await;
        self.forward.abort();
    }
}

async fn open_tunnel(
    engine: String,
    tls: rstream_client::tls::TlsOptions,
    target: SocketAddr,
) -> anyhow::Result<Tunnel> {
    let client = Client::builder()
        .engine(engine)
        .token(TOKEN)
        .tls(tls)
        .operation_timeout(Duration::from_secs(10))
        .build()?;
    let control = client.connect().await?;
    let mut tunnel = control.create_tunnel(TunnelOptions::tcp()).await?;
    let id = tunnel.id().to_owned();
    let forward = tokio::spawn(async move {
        // Ends when the tunnel closes at teardown.
        let _ = rstream_client::forward::forward(&mut tunnel, &target.to_string()).await;
    });
    Ok(Tunnel {
        id,
        control,
        forward,
    })
}

/// The venv's python with the pinned SDK and uvloop: the interop test's venv (the same
/// `NETKIT_PYTHON_VENV` override), with uvloop added.
fn ensure_sdk() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("NETKIT_PYTHON_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| testing::cache_dir("python").join(format!("rstream-{SDK_VERSION}")));
    testing::python_venv(
        &dir,
        &[
            ("rstreamlabs-rstream", SDK_VERSION),
            ("uvloop", UVLOOP_VERSION),
        ],
    )
    .with_context(|| format!("preparing the Python SDK in {}", dir.display()))
}

/// The Python SDK owning a published TCP tunnel and forwarding it to the sink.
struct SdkPeer {
    child: Child,
    id: String,
    version: String,
    event_loop: String,
}

impl SdkPeer {
    async fn start(
        python: &Path,
        engine: &LocalEngine,
        dir: &Path,
        target: SocketAddr,
        uvloop: bool,
    ) -> anyhow::Result<Self> {
        let script = dir.join("rstream_sdk.py");
        std::fs::write(&script, SDK_SCRIPT)?;
        let ca = dir.join("engine-ca.pem");
        std::fs::write(&ca, engine.ca_pem())?;
        let cfg = serde_json::json!({
            "engine": engine.engine_address(),
            "ca_file": ca,
            "token": TOKEN,
            "target": target.to_string(),
            "uvloop": uvloop,
        });
        let mut cmd = system::pinned_command(RELAY_CPU, python);
        cmd.arg(&script).arg(cfg.to_string());
        for (key, _) in std::env::vars() {
            if key.starts_with("RSTREAM_") {
                cmd.env_remove(key);
            }
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("starting the Python SDK")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let line = tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufReader::new(stdout).read_line(&mut line)?;
            std::io::Result::Ok(line)
        });
        let line = match tokio::time::timeout(Duration::from_secs(60), line).await {
            Ok(Ok(Ok(line))) if !line.is_empty() => line,
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the Python SDK did not report its tunnel within 60 s");
            }
        };
        let info: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("the SDK printed {line:?}"))?;
        let text = |key: &str| info[key].as_str().unwrap_or("?").to_owned();
        Ok(Self {
            id: info["id"].as_str().context("no tunnel id")?.to_owned(),
            version: text("version"),
            event_loop: text("loop"),
            child,
        })
    }

    fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the Python SDK exited early ({status})");
        }
        Ok(())
    }

    /// Closes its stdin (it then closes its client) and waits a little for it to end.
    fn stop(mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SdkPeer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

async fn measure_contenders(
    settings: &Settings,
    sizes: &Sizes,
    contenders: &[Contender<'_>],
    clocks: &CpuClocks<'_>,
) -> anyhow::Result<Recorder> {
    let mut recorder = Recorder::default();
    let bytes = sizes.bulk_bytes;
    eprintln!(
        "rstream: throughput, {} rounds of {} contenders and the cipher ceiling",
        settings.rounds,
        contenders.len()
    );
    for round in 0..settings.rounds {
        for (direction, metric) in [(CMD_UPLOAD, UPLOAD), (CMD_DOWNLOAD, DOWNLOAD)] {
            // The ceiling takes a turn like a contender (index len).
            for index in super::proxy::shuffled(contenders.len() + 1) {
                let Some(contender) = contenders.get(index) else {
                    let rate = tls_ceiling(sizes.cipher_time, direction == CMD_UPLOAD)?;
                    recorder.record(metric, CEILING, rate);
                    continue;
                };
                let engine_before = clocks.engine.cpu_seconds()?;
                let generator_before = thread_cpu_seconds(clocks.generator)?;
                let peer_before = contender.peer.cpu_seconds()?;
                let elapsed = transfer(contender.addr, direction, bytes)
                    .await
                    .with_context(|| {
                        format!(
                            "{} through {}, round {}",
                            metric.name,
                            contender.name,
                            round + 1
                        )
                    })?;
                let wall = elapsed.as_secs_f64();
                recorder.record(metric, contender.name, bytes as f64 * 8.0 / wall / 1e9);
                let busy = |before: f64, after: f64| (after - before) / wall * 100.0;
                recorder.record(
                    GENERATOR_BUSY,
                    contender.name,
                    busy(generator_before, thread_cpu_seconds(clocks.generator)?),
                );
                if let (Some(before), Some(after)) = (peer_before, contender.peer.cpu_seconds()?) {
                    recorder.record(
                        ENGINE_BUSY,
                        contender.name,
                        busy(engine_before, clocks.engine.cpu_seconds()?),
                    );
                    recorder.record(PEER_BUSY, contender.name, busy(before, after));
                }
            }
        }
    }
    eprintln!("rstream: stream setup");
    for _ in 0..settings.rounds {
        for index in super::proxy::shuffled(contenders.len()) {
            let contender = &contenders[index];
            let histogram = load::setup_latency(contender.addr, sizes.setup_count)
                .await
                .with_context(|| format!("stream setup through {}", contender.name))?;
            let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1_000.0;
            recorder.record(SETUP_P50, contender.name, us(0.5));
            recorder.record(SETUP_P99, contender.name, us(0.99));
        }
    }
    Ok(recorder)
}

/// The TLS ceiling of one stream, measured: one TLS 1.3 connection over loopback TCP with rustls
/// (ring, TLS13_AES_256_GCM_SHA384, the suite the tunnel negotiates) on both ends, the server on
/// the engine's CPU and the client on the peer's, as the tunnel's TLS leg runs. Upload: the
/// server sends (the engine seals what the generator uploads), download: the client sends.
/// Plaintext moves one way in 256 KiB writes for `length`; returns Gbit/s of plaintext
/// received, from the first byte to close_notify.
fn tls_ceiling(length: Duration, upload: bool) -> anyhow::Result<f64> {
    use std::io::Write as _;
    use std::sync::Arc;

    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    let cert = certified.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384],
        ..rustls::crypto::ring::default_provider()
    });
    let server_config = Arc::new(
        rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)?,
    );
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert)?;
    let client_config = Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    );
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    let addr = listener.local_addr()?;

    // Either end: sends for `length`, or reads to close_notify and returns the rate.
    let run_end = move |tls: &mut dyn ReadWrite, send: bool| -> anyhow::Result<f64> {
        if send {
            let buf = vec![0u8; 256 * 1024];
            let started = Instant::now();
            while started.elapsed() < length {
                tls.write_all(&buf)?;
            }
            tls.flush()?;
            Ok(0.0)
        } else {
            let mut buf = vec![0u8; 256 * 1024];
            let mut received = 0u64;
            let mut first = None;
            loop {
                let n = tls.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                first.get_or_insert_with(Instant::now);
                received += n as u64;
            }
            let seconds = first.map_or(0.0, |f: Instant| f.elapsed().as_secs_f64());
            anyhow::ensure!(seconds > 0.0, "no plaintext arrived");
            Ok(received as f64 * 8.0 / seconds / 1e9)
        }
    };
    std::thread::scope(|scope| {
        let server = std::thread::Builder::new()
            .name("bench-tls-server".to_owned())
            .spawn_scoped(scope, || -> anyhow::Result<f64> {
                if system::can_pin() {
                    system::pin_current_thread(GENERATOR_CPU)?;
                }
                let (tcp, _) = listener.accept()?;
                tcp.set_nodelay(true)?;
                let connection = rustls::ServerConnection::new(server_config.clone())?;
                let mut tls = rustls::StreamOwned::new(connection, tcp);
                let rate = run_end(&mut tls, upload)?;
                if upload {
                    tls.conn.send_close_notify();
                    tls.flush()?;
                }
                Ok(rate)
            })?;
        let client = std::thread::Builder::new()
            .name("bench-tls-client".to_owned())
            .spawn_scoped(scope, || -> anyhow::Result<f64> {
                if system::can_pin() {
                    system::pin_current_thread(RELAY_CPU)?;
                }
                let tcp = std::net::TcpStream::connect(addr)?;
                tcp.set_nodelay(true)?;
                let name = rustls::pki_types::ServerName::try_from("localhost")?;
                let connection = rustls::ClientConnection::new(client_config.clone(), name)?;
                let mut tls = rustls::StreamOwned::new(connection, tcp);
                let rate = run_end(&mut tls, !upload)?;
                if !upload {
                    tls.conn.send_close_notify();
                    tls.flush()?;
                }
                Ok(rate)
            })?;
        let joined = |handle: std::thread::ScopedJoinHandle<'_, anyhow::Result<f64>>| {
            handle
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a TLS thread panicked")))
        };
        let (server, client) = (joined(server)?, joined(client)?);
        Ok(if upload { client } else { server })
    })
}

/// Both ends of the ceiling's TLS stream.
trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}

/// The sink: length-prefixed upload and download, and ping. Returns its address and task.
async fn start_sink() -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                // A failed connection only matters to the client, which reports it.
                let _ = serve(stream).await;
            });
        }
    });
    Ok((addr, task))
}

async fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    match stream.read_u8().await? {
        CMD_UPLOAD => {
            let length = stream.read_u64().await?;
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut received = 0u64;
            while received < length {
                match stream.read(&mut buf).await? {
                    0 => break,
                    n => received += n as u64,
                }
            }
            stream.write_u64(received).await?;
            // Wait for the client to close.
            let _ = stream.read(&mut buf).await;
            Ok(())
        }
        CMD_DOWNLOAD => {
            let length = stream.read_u64().await?;
            send_zeros(&mut stream, length).await?;
            let mut byte = [0u8; 1];
            let _ = stream.read(&mut byte).await;
            Ok(())
        }
        CMD_PING => stream.write_u8(CMD_PING).await,
        _ => Ok(()),
    }
}

async fn send_zeros(stream: &mut TcpStream, mut length: u64) -> std::io::Result<()> {
    let buf = vec![0u8; BULK_CHUNK];
    while length > 0 {
        let n = length.min(BULK_CHUNK as u64) as usize;
        stream.write_all(&buf[..n]).await?;
        length -= n as u64;
    }
    Ok(())
}

/// Moves `length` bytes over one connection to `target`, checked end to end.
async fn transfer(target: SocketAddr, command: u8, length: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let run = async {
        let mut stream = TcpStream::connect(target).await?;
        stream.set_nodelay(true)?;
        stream.write_u8(command).await?;
        stream.write_u64(length).await?;
        if command == CMD_UPLOAD {
            send_zeros(&mut stream, length).await?;
            let received = stream.read_u64().await.context("reading the count")?;
            ensure!(received == length, "sink received {received} of {length}");
        } else {
            let mut buf = vec![0u8; BULK_CHUNK];
            let mut received = 0u64;
            while received < length {
                match stream.read(&mut buf).await? {
                    0 => bail!("received {received} of {length} bytes"),
                    n => received += n as u64,
                }
            }
        }
        anyhow::Ok(())
    };
    tokio::time::timeout(TRANSFER_TIMEOUT, run)
        .await
        .context("transfer timed out")??;
    Ok(started.elapsed())
}
