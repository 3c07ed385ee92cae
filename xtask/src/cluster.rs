//! `cargo xtask cluster [--node | --nodes N] [--check]`: a local control plane for trying the binaries by hand,
//! optionally with a real node (kubelet, containerd, kube-proxy, CoreDNS) that runs Pods.

use std::time::Instant;

use anyhow::Context as _;
use netkit_testenv::ControlPlane;
use netkit_testenv::node::{self, check};

#[derive(clap::Args, Default)]
pub struct Args {
    /// Add a real node: kubelet, containerd, kube-proxy, kube-controller-manager, kube-scheduler
    /// and CoreDNS (needs root; installs what it needs first).
    #[arg(long)]
    pub node: bool,
    /// Add N real nodes (1 to 4), each in its own network namespace with its own containerd,
    /// kubelet, kube-proxy and Pod subnet; the host routes between them.
    #[arg(long, value_name = "N", conflicts_with = "node", value_parser = clap::value_parser!(u8).range(1..=4))]
    pub nodes: Option<u8>,
    /// With --node or --nodes: prove the nodes work (rollout, Job, ClusterIP, NodePort, DNS,
    /// with several nodes one Pod on each reached across nodes, garbage collection), print each
    /// step, then stop and exit instead of waiting for Ctrl-C.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let nodes = usize::from(args.nodes.unwrap_or(u8::from(args.node)));
    if args.check && nodes == 0 {
        anyhow::bail!("--check proves the nodes: add --node or --nodes N");
    }
    let started = Instant::now();
    crate::envtest::ensure(&crate::envtest::Args {
        node: nodes > 0,
        ..crate::envtest::Args::default()
    })?;
    let release = if args.check {
        // The Job step runs a release image exactly as users get it.
        let built = crate::image::run(&crate::image::Args {
            which: "steward-tcp-proxy".to_owned(),
            repository: crate::image::DEFAULT_REPOSITORY.to_owned(),
            tag: None,
            skip_build: false,
        })?;
        Some(built.into_iter().next().context("no image was built")?)
    } else {
        None
    };
    println!("binaries and images ready in {:.1?}", started.elapsed());
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        eprintln!(
            "starting etcd and kube-apiserver{}...",
            match nodes {
                0 => String::new(),
                1 => " and the node".to_owned(),
                n => format!(" and {n} nodes"),
            }
        );
        let started = Instant::now();
        let mut builder = ControlPlane::builder();
        if nodes > 0 {
            builder = builder
                .nodes(nodes)
                .start_timeout(std::time::Duration::from_secs(180));
        }
        let plane = builder.start().await?;
        println!(
            "control plane ready in {:.1?} at {}",
            started.elapsed(),
            plane.server_url()
        );
        for node in plane.nodes() {
            for (step, took) in node.timings() {
                println!("  {took:>8.1?}  {}: {step}", node.name());
            }
        }
        if let Some(image) = &release {
            let steps = check::run(
                &plane,
                check::ReleaseImage {
                    tarball: &image.tarball,
                    reference: &image.reference,
                    program: "/steward-tcp-proxy",
                },
            )
            .await;
            match steps {
                Ok(steps) => {
                    println!("node check:");
                    for step in &steps {
                        println!("  ok {:>8.1?}  {}", step.took, step.what);
                    }
                    println!("node check: {} passed, 0 failed", steps.len());
                }
                Err(err) => {
                    for node in plane.nodes() {
                        eprintln!("=== {} ===\n{}", node.name(), node.log_tails(20));
                    }
                    plane.stop();
                    return Err(err).context("node check");
                }
            }
            plane.stop();
            return Ok(());
        }
        let echo_url = if nodes > 0 {
            Some(start_sample_workload(&plane).await?)
        } else {
            None
        };
        let kubeconfig = plane.kubeconfig_path().display().to_string();
        println!("kubeconfig: {kubeconfig}");
        println!();
        println!("try:");
        println!("  export KUBECONFIG={kubeconfig}");
        println!("  kubectl get --raw /version");
        if nodes > 0 {
            println!("  kubectl get nodes -o wide");
            println!("  kubectl get pods -A -o wide");
            if let Some(url) = &echo_url {
                println!(
                    "  curl {url}          # the sample Deployment 'echo' through its ClusterIP"
                );
            }
            println!("  kubectl logs -n kube-system deploy/coredns");
            for node in plane.nodes() {
                println!(
                    "  (node {} at {}: Pods {}; routed to the node only)",
                    node.name(),
                    node.internal_ip(),
                    node.pod_cidr()
                );
            }
            println!(
                "  (Services: {}, through the first node)",
                node::SERVICE_CIDR
            );
        } else {
            println!("  kubectl get namespaces");
        }
        println!();
        println!("press Ctrl-C to stop and remove everything");
        wait_for_signal().await?;
        eprintln!("stopping...");
        plane.stop();
        Ok(())
    })
}

/// A sample workload for the user to see: Deployment and Service `echo` (the testbox image) in
/// `default`, waited for until Ready; returns its ClusterIP URL.
async fn start_sample_workload(plane: &ControlPlane) -> anyhow::Result<String> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::Service;
    use kube::api::{Api, PostParams};
    let client = plane.client().await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "default");
    deployments
        .create(
            &PostParams::default(),
            &serde_json::from_value(check::testbox_deployment("echo", 1))?,
        )
        .await?;
    let services: Api<Service> = Api::namespaced(client, "default");
    let service = services
        .create(
            &PostParams::default(),
            &serde_json::from_value(serde_json::json!({
                "metadata": { "name": "echo" },
                "spec": {
                    "selector": { "app": "echo" },
                    "ports": [{ "name": "http", "port": 80, "targetPort": 8080 }],
                },
            }))?,
        )
        .await?;
    let started = Instant::now();
    let pods = check::wait_pods_ready(plane, "default", "app=echo", 1).await?;
    for (name, ip) in &pods {
        println!(
            "  {:>8.1?}  Pod {name} Running and Ready at {ip}",
            started.elapsed()
        );
    }
    let ip = service
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the echo Service has no ClusterIP")?;
    Ok(format!("http://{ip}/"))
}

async fn wait_for_signal() -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = term.recv() => {}
    }
    Ok(())
}
