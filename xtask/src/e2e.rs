//! `cargo xtask e2e`: the charts on a real node, as users run them. This task prepares what the
//! run needs (the node's tools, Helm, the release images and pod-proxier's HAProxy sidecar image);
//! the scenarios and their report are `netkit_testenv::e2e`'s.

use std::path::PathBuf;
use std::time::Instant;

use netkit_testenv::e2e::pod_proxier;
use netkit_testenv::images::Built;

#[derive(clap::Args, Default)]
pub struct Args {
    /// Use the images already under target/images/ instead of building them.
    #[arg(long)]
    pub skip_build: bool,
    /// Run only these charts (repeatable: steward-tcp-proxy, pod-proxier, rstream-operator, or
    /// node-loss: the three on two nodes, one lost); all four when not given. A run of fewer says
    /// so in its report and closing line.
    #[arg(long = "chart", value_name = "RELEASE")]
    pub charts: Vec<String>,
}

/// What the charts' runs need on the machine: the envtest binaries with the node's (kubelet & co.,
/// containerd, the node images), and Helm; returns Helm's path.
pub fn ensure_tools() -> anyhow::Result<PathBuf> {
    crate::envtest::ensure(&crate::envtest::Args {
        node: true,
        ..crate::envtest::Args::default()
    })?;
    crate::tools::ensure_helm()
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let pod_proxier =
        args.charts.is_empty() || args.charts.iter().any(|c| c == pod_proxier::RELEASE);
    let (helm, built) = prepare(args.skip_build, pod_proxier)?;
    netkit_testenv::e2e::run(&args.charts, helm, &built)
}

/// `cargo xtask bench node-loss`: the images the node-loss run needs, then its rounds.
pub fn bench_on_cluster(args: &netkit_testenv::bench::Args) -> anyhow::Result<()> {
    let (helm, built) = prepare(false, false)?;
    netkit_testenv::bench::run_on_cluster(args, helm, &built)
}

/// Helm's path and the release images (built unless `skip_build`), with pod-proxier's HAProxy
/// sidecar image when `haproxy`.
fn prepare(skip_build: bool, haproxy: bool) -> anyhow::Result<(PathBuf, Vec<Built>)> {
    let started = Instant::now();
    let helm = ensure_tools()?;
    let mut built = crate::image::run(&crate::image::Args {
        which: "all".to_owned(),
        repository: crate::image::DEFAULT_REPOSITORY.to_owned(),
        tag: None,
        skip_build,
    })?;
    if haproxy {
        // pod-proxier's HAProxy backend runs it as a sidecar; no registry has it for the node.
        built.push(crate::node_images::haproxy_image()?);
    }
    println!("tools and images ready in {:.1?}", started.elapsed());
    Ok((helm, built))
}
