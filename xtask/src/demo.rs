//! `cargo xtask demo`: the three charts running on the test node, with traffic through each.
//!
//! It builds the release images, starts the control plane with its node and imports the images,
//! then installs each chart with Helm into a namespace where Pod Security `restricted` is
//! enforced, as `cargo xtask e2e` does and with the same functions ([`crate::e2e`]):
//! steward-tcp-proxy (a client of `https://10.96.0.1` goes through kube-proxy and steward),
//! pod-proxier (a workload Pod mapped, a request through the entry port of its Service) and
//! rstream-operator (an `RstreamTunnel` to a workload Service, a request through a `LocalEngine`
//! run here on the host's end of the node link). kubelet runs every Pod and reports it Ready by
//! its probes; nothing writes a status by hand. The demo prints what it saw, the kubeconfig and
//! commands to try, and runs until Ctrl-C or SIGTERM; then it stops the engine, the node and the
//! control plane and removes every file it made.
//!
//! It needs root (the node makes network namespaces, mounts and cgroups); its traffic stays on
//! loopback and on the node's Pod and Service ranges. `--skip-build` packages the release
//! binaries already built (as `cargo xtask e2e --skip-build`); `--exit-after-check` (hidden, for
//! `cargo xtask test`) stops right after the checks.

mod pod_proxier;
mod progress;
mod rstream;
mod steward;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use netkit_testenv::ControlPlane;
use netkit_testenv::node::{self, check};
use rstream_client::engine::LocalEngine;
use tokio::signal::unix::{Signal, SignalKind, signal};

use netkit_testenv::e2e::Env;
use netkit_testenv::images::Built;
use progress::Progress;

#[derive(clap::Args)]
pub struct Args {
    /// Package the release binaries already under target/release instead of building them.
    #[arg(long)]
    skip_build: bool,
    /// Check the traffic through each chart, clean up and exit 0 instead of waiting for Ctrl-C.
    #[arg(long, hide = true)]
    exit_after_check: bool,
}

const STEPS: usize = 7;
/// A cold release build of the three binaries on a small machine takes many minutes.
const BUILD_LIMIT: Duration = Duration::from_secs(40 * 60);
/// Above the e2e's own start limit, so that its clearer error comes first.
const CLUSTER_LIMIT: Duration = Duration::from_secs(300);
/// One chart from `helm install` to traffic checked (Pods Ready, kube-proxy routing).
const CHART_LIMIT: Duration = Duration::from_secs(240);
const ENGINE_SHUTDOWN_LIMIT: Duration = Duration::from_secs(5);
/// How many lines of a log a failure shows.
const LOG_TAIL_LINES: usize = 20;

/// What one chart did, and commands to see it for oneself.
struct Shown {
    name: &'static str,
    facts: Vec<String>,
    try_these: Vec<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut progress = Progress::new(STEPS);
    let helm = progress.step_blocking(
        "checking the node's binaries, its images and Helm",
        crate::e2e::ensure_tools,
    )?;
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(run_session(args, helm, progress, started));
    // Nothing of the demo runs any more; do not wait for stray blocking tasks.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_session(
    args: &Args,
    helm: PathBuf,
    mut progress: Progress,
    started: Instant,
) -> anyhow::Result<()> {
    // Registered first, so that a Ctrl-C while starting also cleans up.
    let mut signals = Signals::new()?;
    let mut session = Session::new()?;
    let started_up = tokio::select! {
        shown = session.start(args, helm, &mut progress) => shown,
        name = signals.recv() => {
            // The interrupted step's line has no end yet.
            eprintln!();
            Err(anyhow!("stopped by {name} while starting"))
        }
    };
    let outcome = match started_up {
        Ok(shown) => {
            session.print_summary(&shown, started, args.exit_after_check);
            if !args.exit_after_check {
                let name = signals.recv().await;
                eprintln!("{name} received");
            }
            Ok(())
        }
        Err(err) => {
            if let Some(node) = session.plane.as_ref().and_then(ControlPlane::node) {
                eprintln!("{}", node.log_tails(LOG_TAIL_LINES));
            }
            Err(err)
        }
    };
    session.shutdown().await;
    outcome
}

/// Ctrl-C and SIGTERM.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.interrupt.recv() => "Ctrl-C",
            _ = self.terminate.recv() => "SIGTERM",
        }
    }
}

/// Everything the demo made, so that all of it can be removed however the demo ends. The node's
/// own guardian removes the node and the control plane even if this process is killed.
struct Session {
    /// The build log.
    workdir: tempfile::TempDir,
    engine: Option<LocalEngine>,
    plane: Option<ControlPlane>,
}

impl Session {
    fn new() -> anyhow::Result<Self> {
        let workdir = tempfile::Builder::new()
            .prefix("kube-netkit-demo-")
            .tempdir()
            .context("creating the demo's directory")?;
        Ok(Self {
            workdir,
            engine: None,
            plane: None,
        })
    }

    /// Starts everything, checking the traffic through each chart on the way.
    async fn start(
        &mut self,
        args: &Args,
        helm: PathBuf,
        progress: &mut Progress,
    ) -> anyhow::Result<Vec<Shown>> {
        let build_log = self.workdir.path().join("cargo-build.log");
        let title = if args.skip_build {
            "packaging the release images (--skip-build)"
        } else {
            "building the release images (cargo build --release)"
        };
        let built = progress
            .step(
                title,
                BUILD_LIMIT,
                build_images(args.skip_build, &build_log),
            )
            .await?;
        let plane = progress
            .step(
                "starting the control plane and its node",
                CLUSTER_LIMIT,
                netkit_testenv::e2e::start_cluster(),
            )
            .await?;
        let plane = &*self.plane.insert(plane);
        // `ctr images import`, a few seconds; nothing else needs to run meanwhile.
        let env = progress
            .step_blocking("importing the images into the node's containerd", || {
                Env::new(plane, helm, &built)
            })?;
        let steward = progress
            .step(
                "installing steward-tcp-proxy and calling the API through it",
                CHART_LIMIT,
                steward::start(&env),
            )
            .await?;
        let pod_proxier = progress
            .step(
                "installing pod-proxier and mapping a workload Pod",
                CHART_LIMIT,
                pod_proxier::start(&env),
            )
            .await?;
        let rstream = progress
            .step(
                "installing rstream-operator and a tunnel through a local engine",
                CHART_LIMIT,
                rstream::start(&env, &mut self.engine),
            )
            .await?;
        Ok(vec![steward, pod_proxier, rstream])
    }

    fn print_summary(&self, shown: &[Shown], started: Instant, exit_after_check: bool) {
        println!();
        println!(
            "kube-netkit demo: the three charts run as Pods on the node; traffic checked through each, {:.1}s after start",
            started.elapsed().as_secs_f64()
        );
        for part in shown {
            println!();
            println!("{}", part.name);
            for fact in &part.facts {
                println!("  - {fact}");
            }
        }
        let kubeconfig = self
            .plane
            .as_ref()
            .map(|plane| plane.kubeconfig_path().display().to_string())
            .unwrap_or_default();
        println!();
        println!("kubeconfig: {kubeconfig}");
        println!(
            "network:    Pods {}, Services {}, node {}; the host reaches them over the node link",
            node::POD_CIDR,
            node::SERVICE_CIDR,
            node::NODE_IP
        );
        println!();
        println!("try (as root, like the demo):");
        println!("  export KUBECONFIG={kubeconfig}");
        println!("  kubectl get pods -A -o wide");
        for command in shown.iter().flat_map(|part| &part.try_these) {
            println!("  {command}");
        }
        println!();
        if exit_after_check {
            println!("--exit-after-check: stopping");
        } else {
            println!("press Ctrl-C to stop everything and remove every file");
        }
    }

    /// Stops the engine (agents still talk to it), then the node and the control plane; removes
    /// the work directory.
    async fn shutdown(mut self) {
        let started = Instant::now();
        eprintln!("stopping the engine, the node and the control plane ...");
        if let Some(engine) = self.engine.take()
            && tokio::time::timeout(ENGINE_SHUTDOWN_LIMIT, engine.shutdown())
                .await
                .is_err()
        {
            eprintln!("the engine did not stop within {ENGINE_SHUTDOWN_LIMIT:?}; dropped");
        }
        if let Some(plane) = self.plane.take() {
            plane.stop();
        }
        let workdir = self.workdir.path().to_path_buf();
        if let Err(err) = self.workdir.close() {
            eprintln!("could not remove {}: {err}", workdir.display());
        }
        eprintln!(
            "stopped and removed everything in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// The release images of the three binaries: `cargo build --release` (unless `skip_build`) with
/// its output in `log`, then the images written under `target/images/`.
async fn build_images(skip_build: bool, log: &Path) -> anyhow::Result<Vec<Built>> {
    let specs = crate::image::selected("all")?;
    if !skip_build {
        let output = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let mut cargo = tokio::process::Command::from(crate::image::release_build(&specs));
        cargo
            .stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output)
            .kill_on_drop(true);
        let status = cargo
            .status()
            .await
            .context("running cargo build --release")?;
        if !status.success() {
            bail!(
                "cargo build --release failed ({status}); the end of {}:\n{}",
                log.display(),
                log_tail(log, LOG_TAIL_LINES)
            );
        }
    }
    tokio::task::spawn_blocking(move || {
        crate::image::package(&specs, crate::image::DEFAULT_REPOSITORY, None)
    })
    .await
    .context("the image packaging task")?
}

/// The last `lines` lines of a log file.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// One line per Pod in `ns` matching `selector` (every Pod if empty): its name, IP and whether
/// kubelet reports it Ready.
async fn describe_pods(env: &Env<'_>, ns: &str, selector: &str) -> anyhow::Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(env.plane.client().await?, ns);
    let mut params = ListParams::default();
    if !selector.is_empty() {
        params = params.labels(selector);
    }
    let list = pods
        .list(&params)
        .await
        .with_context(|| format!("listing the Pods {selector} in {ns}"))?;
    Ok(list
        .items
        .iter()
        .map(|pod| {
            let name = pod.metadata.name.as_deref().unwrap_or_default();
            let ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.as_deref())
                .unwrap_or("no IP yet");
            let state = if check::is_ready(pod) {
                "Running, Ready"
            } else {
                "not Ready"
            };
            format!("Pod {ns}/{name} at {ip}: {state}")
        })
        .collect())
}
