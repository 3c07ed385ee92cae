//! `cargo xtask cluster`: a local control plane for trying the binaries by hand.

use k8s_reconcile::testing::ControlPlane;

pub fn run() -> anyhow::Result<()> {
    crate::envtest::ensure(&crate::envtest::Args::default())?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        eprintln!("starting etcd and kube-apiserver...");
        let started = std::time::Instant::now();
        let plane = ControlPlane::builder().start().await?;
        let kubeconfig = plane.kubeconfig_path().display().to_string();
        println!(
            "control plane ready in {:.1?} at {}",
            started.elapsed(),
            plane.server_url()
        );
        println!("kubeconfig: {kubeconfig}");
        println!();
        println!("try:");
        println!("  export KUBECONFIG={kubeconfig}");
        println!("  kubectl get --raw /version");
        println!("  kubectl get namespaces");
        println!();
        println!("press Ctrl-C to stop and remove everything");
        wait_for_signal().await?;
        eprintln!("stopping...");
        plane.stop();
        Ok(())
    })
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
