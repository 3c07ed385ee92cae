//! Project tasks: `cargo xtask <task>`.
//!
//! * `envtest`: build/install the test control plane binaries and print their directory.
//! * `cluster`: run a local control plane until Ctrl-C and print its kubeconfig.
//! * `test`: everything CI checks (format, lints, tests, docs).

mod cluster;
mod envtest;
mod test;
mod tools;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Project tasks for the kube-netkit workspace"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install kube-apiserver and etcd for the test control plane; print their directory.
    Envtest(envtest::Args),
    /// Install helm (built from its Go module) and print its path.
    Helm,
    /// Start a local control plane (etcd + kube-apiserver), print its kubeconfig, run until Ctrl-C.
    Cluster,
    /// Run every check CI runs: fmt, clippy, tests, docs.
    Test(test::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.task {
        Task::Envtest(args) => {
            let dir = envtest::ensure(&args)?;
            println!("{}", dir.display());
            Ok(())
        }
        Task::Helm => {
            println!("{}", tools::ensure_helm()?.display());
            Ok(())
        }
        Task::Cluster => cluster::run(),
        Task::Test(args) => test::run(&args),
    }
}

/// The workspace root (xtask lives one level below it).
fn workspace_root() -> std::path::PathBuf {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}
