//! `cargo xtask demo`: the three binaries against a local control plane, with traffic through each.
//!
//! It starts etcd and kube-apiserver, then steward-tcp-proxy (relaying to that API server and
//! publishing itself as `default/kubernetes`), pod-proxier (mapping a demo Pod backed by a local
//! server) and rstream-operator (manager and agent, with `LocalEngine` as the engine), each as a
//! process, as their integration tests do. It checks that traffic flows through each, prints what
//! happened and what to try, and runs until Ctrl-C or SIGTERM; then it stops every process and
//! removes every file it made. Everything listens on 127.0.0.0/8.
//!
//! `--exit-after-check` (hidden, for `cargo xtask test`) stops right after the checks.

mod net;
mod pod_proxier;
mod processes;
mod progress;
mod rstream;
mod steward;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow};
use k8s_openapi::api::core::v1::Namespace;
use k8s_reconcile::testing::ControlPlane;
use kube::api::{Api, PostParams};
use rstream_client::engine::LocalEngine;
use tokio::signal::unix::{Signal, SignalKind, signal};

use processes::{Binaries, Processes};
use progress::Progress;

#[derive(clap::Args)]
pub struct Args {
    /// Check the traffic through each binary, clean up and exit 0 instead of waiting for Ctrl-C.
    #[arg(long, hide = true)]
    exit_after_check: bool,
}

/// The namespace of every demo object.
const NAMESPACE: &str = "demo";
const PACKAGES: [&str; 3] = ["steward-tcp-proxy", "pod-proxier", "rstream-operator"];
const STEPS: usize = 6;
/// A cold debug build of the workspace on a small machine takes minutes.
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);
const CONTROL_PLANE_LIMIT: Duration = Duration::from_secs(120);
const BINARY_LIMIT: Duration = Duration::from_secs(90);
/// How often the children are checked while the demo runs.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// What every part of the demo needs from the cluster.
struct Cluster<'a> {
    plane: &'a ControlPlane,
    admin: kube::Client,
    binaries: &'a Binaries,
}

/// What one binary did, and commands to see it for oneself.
struct Shown {
    name: &'static str,
    facts: Vec<String>,
    try_these: Vec<String>,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut progress = Progress::new(STEPS);
    progress.step_blocking("checking kube-apiserver and etcd", || {
        crate::envtest::ensure(&Default::default())
    })?;
    let runtime = tokio::runtime::Runtime::new()?;
    let result = runtime.block_on(run_session(args, progress, started));
    // Nothing of the demo runs any more; do not wait for stray blocking tasks.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run_session(args: &Args, mut progress: Progress, started: Instant) -> anyhow::Result<()> {
    // Registered first, so that a Ctrl-C while starting also cleans up.
    let mut signals = Signals::new()?;
    let mut session = Session::new()?;
    eprintln!("      logs in {}", session.workdir.display());
    let started_up = tokio::select! {
        shown = session.start(&mut progress) => shown,
        name = signals.recv() => {
            // The interrupted step's line has no end yet.
            eprintln!();
            Err(anyhow!("stopped by {name} while starting"))
        }
    };
    let outcome = match started_up {
        Ok(shown) => {
            session.print_summary(&shown, started, args.exit_after_check);
            if args.exit_after_check {
                Ok(())
            } else {
                session.run_until_signal(&mut signals).await
            }
        }
        Err(err) => Err(err),
    };
    if outcome.is_err() {
        session.processes.print_log_tails();
    }
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

/// Everything the demo made, so that all of it can be removed however the demo ends.
struct Session {
    workdir: PathBuf,
    processes: Processes,
    engine: Option<LocalEngine>,
    plane: Option<ControlPlane>,
}

impl Session {
    fn new() -> anyhow::Result<Self> {
        let workdir = tempfile::Builder::new()
            .prefix("kube-netkit-demo-")
            .tempdir()
            .context("creating the demo's directory")?
            .keep();
        let processes = Processes::new(&workdir)?;
        Ok(Self {
            workdir,
            processes,
            engine: None,
            plane: None,
        })
    }

    /// Starts everything, checking the traffic through each binary on the way.
    async fn start(&mut self, progress: &mut Progress) -> anyhow::Result<Vec<Shown>> {
        let build_log = self.workdir.join("cargo-build.log");
        let binaries = progress
            .step(
                "building the binaries (cargo build)",
                BUILD_LIMIT,
                processes::build(&PACKAGES, &build_log),
            )
            .await?;
        let (plane, admin) = progress
            .step(
                "starting etcd and kube-apiserver",
                CONTROL_PLANE_LIMIT,
                start_control_plane(),
            )
            .await?;
        let cluster = Cluster {
            plane: self.plane.insert(plane),
            admin,
            binaries: &binaries,
        };
        let processes = &mut self.processes;
        let steward = progress
            .step(
                "starting steward-tcp-proxy and calling the API through it",
                BINARY_LIMIT,
                steward::start(&cluster, processes),
            )
            .await?;
        let pod_proxier = progress
            .step(
                "starting pod-proxier and mapping a pod",
                BINARY_LIMIT,
                pod_proxier::start(&cluster, processes),
            )
            .await?;
        let engine = &*self.engine.insert(rstream::start_engine().await?);
        let rstream = progress
            .step(
                "starting rstream-operator, its agent and a tunnel",
                BINARY_LIMIT,
                rstream::start(&cluster, processes, engine, &self.workdir),
            )
            .await?;
        Ok(vec![steward, pod_proxier, rstream])
    }

    fn print_summary(&self, shown: &[Shown], started: Instant, exit_after_check: bool) {
        println!();
        println!(
            "kube-netkit demo: traffic checked through all three binaries, {:.1}s after start",
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
        println!("logs:       {}", self.workdir.display());
        println!();
        println!("try:");
        println!("  export KUBECONFIG={kubeconfig}");
        println!("  kubectl get all -n {NAMESPACE}");
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

    /// Until Ctrl-C or SIGTERM; fails if a child exits meanwhile.
    async fn run_until_signal(&mut self, signals: &mut Signals) -> anyhow::Result<()> {
        loop {
            tokio::select! {
                name = signals.recv() => {
                    eprintln!("{name} received");
                    return Ok(());
                }
                _ = tokio::time::sleep(WATCH_INTERVAL) => self.processes.ensure_running()?,
            }
        }
    }

    /// Stops the children (they may still talk to the engine and the API server), then the
    /// engine, then the control plane; removes the work directory.
    async fn shutdown(mut self) {
        let started = Instant::now();
        eprintln!("stopping the binaries, the engine and the control plane ...");
        let killed = self.processes.stop_all().await;
        if !killed.is_empty() {
            eprintln!("killed after the grace period: {}", killed.join(", "));
        }
        if let Some(engine) = self.engine.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), engine.shutdown()).await;
        }
        if let Some(plane) = self.plane.take() {
            plane.stop();
        }
        self.processes.release_guardian();
        if let Err(err) = std::fs::remove_dir_all(&self.workdir) {
            eprintln!("could not remove {}: {err}", self.workdir.display());
        }
        eprintln!(
            "stopped and removed everything in {:.1}s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// A control plane without the built-in endpoint reconciler (steward-tcp-proxy writes
/// `default/kubernetes` instead), with the demo namespace.
async fn start_control_plane() -> anyhow::Result<(ControlPlane, kube::Client)> {
    let plane = ControlPlane::builder()
        .apiserver_arg("--endpoint-reconciler-type=none")
        .start()
        .await?;
    let admin = plane.client().await?;
    let mut namespace = Namespace::default();
    namespace.metadata.name = Some(NAMESPACE.to_owned());
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .context("creating the demo namespace")?;
    Ok((plane, admin))
}
