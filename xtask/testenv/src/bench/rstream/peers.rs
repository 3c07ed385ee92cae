//! `bench rstream`'s peers: the runtime threads the engine and the tunnel client run on, the
//! Rust tunnel client and the Python SDK process a contender goes through, and their CPU clocks.

use std::io::BufRead as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::fixtures;
use anyhow::{Context as _, bail};
use rstream_client::Client;
use rstream_client::engine::LocalEngine;
use rstream_client::tunnel::TunnelOptions;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use super::{SDK_VERSION, TOKEN, UVLOOP_VERSION};
use crate::bench::system::{self, RELAY_CPU};

const SDK_SCRIPT: &str = include_str!("rstream_sdk.py");

/// A tokio runtime driven by its own std thread (pinned to `cpu` if pinning is possible): what
/// runs on it uses that thread only, so its CPU time is that thread's.
pub(super) struct RuntimeThread {
    pub(super) handle: Handle,
    tid: i32,
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl RuntimeThread {
    pub(super) fn start(name: &str, cpu: usize) -> anyhow::Result<Self> {
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
    pub(super) fn cpu_seconds(&self) -> anyhow::Result<f64> {
        thread_cpu_seconds(self.tid)
    }

    pub(super) fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

/// CPU seconds (user + system) one thread of this process has used.
pub(super) fn thread_cpu_seconds(tid: i32) -> anyhow::Result<f64> {
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
pub(super) struct CpuClocks<'a> {
    pub(super) engine: &'a RuntimeThread,
    pub(super) generator: i32,
}

/// What a contender's transfers go through, and whose CPU time is its peer's.
pub(super) enum Peer<'a> {
    None,
    Thread(&'a RuntimeThread),
    Process(u32),
}

impl Peer<'_> {
    pub(super) fn cpu_seconds(&self) -> anyhow::Result<Option<f64>> {
        Ok(match self {
            Self::None => None,
            Self::Thread(thread) => Some(thread.cpu_seconds()?),
            Self::Process(pid) => Some(system::cpu_seconds(*pid)?),
        })
    }
}

pub(super) struct Contender<'a> {
    pub(super) name: &'static str,
    pub(super) addr: SocketAddr,
    pub(super) peer: Peer<'a>,
}

/// The client's control channel and the forwarder of one published tunnel.
pub(super) struct Tunnel {
    pub(super) id: String,
    control: rstream_client::ControlChannel,
    forward: JoinHandle<()>,
}

impl Tunnel {
    pub(super) async fn close(self) {
        let _ = self.control.close().await;
        self.forward.abort();
    }
}

pub(super) async fn open_tunnel(
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
pub(super) fn ensure_sdk() -> anyhow::Result<PathBuf> {
    let dir = std::env::var_os("NETKIT_PYTHON_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| fixtures::cache_dir("python").join(format!("rstream-{SDK_VERSION}")));
    fixtures::python_venv(
        &dir,
        &[
            ("rstreamlabs-rstream", SDK_VERSION),
            ("uvloop", UVLOOP_VERSION),
        ],
    )
    .with_context(|| format!("preparing the Python SDK in {}", dir.display()))
}

/// The Python SDK owning a published TCP tunnel and forwarding it to the sink.
pub(super) struct SdkPeer {
    pub(super) child: Child,
    pub(super) id: String,
    pub(super) version: String,
    pub(super) event_loop: String,
}

impl SdkPeer {
    pub(super) async fn start(
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

    pub(super) fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the Python SDK exited early ({status})");
        }
        Ok(())
    }

    /// Closes its stdin (it then closes its client) and waits a little for it to end.
    pub(super) fn stop(mut self) {
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
