//! Project tasks: `cargo xtask <task>` (`cargo xtask --help` lists them).
//!
//! * `envtest`, `helm`: the test control plane binaries and Helm, built from their Go modules.
//! * `cluster`, `demo`: a local control plane (optionally with a node), or the three charts
//!   running on its node with traffic through each.
//! * `crds`, `charts` (`--package`: the chart repository), `chart-readme`, `image`, `verify-images`, `readme-flags`: generated files and release
//!   artefacts, each with its check.
//! * `consumers`: k8s-reconcile built and run by outside crates on other Kubernetes versions.
//! * `bench`: benchmarks against baselines measured in the same run; `loc`: each binary's own
//!   logic in lines.
//! * `modules`: no import circles between a library's modules.
//! * `errors`: every error type returns its cause from `source()` and does not print it.
//! * `audit`: Cargo.lock against a local copy of the RustSec advisory database.
//! * `test`: everything CI checks.

mod audit;
mod chart_readme;
mod charts;
mod cluster;
mod consumers;
mod crds;
mod demo;
mod e2e;
mod envtest;
mod errors;
mod flag_conventions;
mod image;
mod loc;
mod modules;
mod node_images;
mod readme_flags;
mod test;
mod test_binaries;
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
    /// Start a local control plane (etcd + kube-apiserver; --node: and a real node), print its
    /// kubeconfig, run until Ctrl-C (--check: prove the node works, then exit).
    Cluster(cluster::Args),
    /// Install the three charts on a local control plane's node (root) and show traffic through
    /// each, until Ctrl-C.
    Demo(demo::Args),
    /// Lint and render every chart (with a matrix of values) and kustomize tree, and dry-run
    /// every object against a real API server (--package: write the chart repository instead).
    Charts(charts::Args),
    /// Check that each binary's README flag table matches its --help.
    ReadmeFlags,
    /// Write each chart's README values table from its values.yaml comments (--check: verify).
    ChartReadme(chart_readme::Args),
    /// Write the CRD YAML of the kustomize trees and charts from the Rust types (--check: verify).
    Crds(crds::Args),
    /// Build release OCI images (no container engine needed) under target/images/.
    Image(image::Args),
    /// Build the images, then unpack them with umoci and run their binaries inside.
    VerifyImages(image::Args),
    /// The charts on a real node: helm install, scenarios, target/e2e/report.{json,md} (root).
    E2e(e2e::Args),
    /// Run every check CI runs: fmt, clippy, tests, docs.
    Test(test::Args),
    /// Benchmark the relays on loopback (proxy-core vs HAProxy, steward, rstream), or a node loss
    /// on two nodes (node-loss, root); see bench/mod.rs.
    Bench(netkit_testenv::bench::Args),
    /// Count each binary's own logic in lines (no blanks, comments or tests) against its goal.
    Loc,
    /// Builds outside crates on k8s-openapi `earliest` (1.33) and `v1_35` against
    /// k8s-reconcile and runs the crate docs' controller in each against a real API server.
    Consumers,
    /// Check Cargo.lock against a local copy of the RustSec advisory database (cargo-audit).
    Audit(audit::Args),
    /// Fail on an import circle between the modules of any crate (globs seen through).
    Modules,
    /// Fail on an error variant whose cause is not its source() or is printed in its message
    /// (every crate; the rule is in xtask/src/errors.rs).
    Errors,
}

/// Runs the task; an error ends the output with its cause chain on one line and exit status 1,
/// never a backtrace (`anyhow`'s `Debug` would print one whenever `RUST_BACKTRACE` is set), so a
/// task's own summary stays the last thing a user reads.
fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
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
        Task::Cluster(args) => cluster::run(&args),
        Task::Demo(args) => demo::run(&args),
        Task::Charts(args) => charts::run(&args),
        Task::Crds(args) => crds::run(&args),
        Task::ReadmeFlags => readme_flags::run(),
        Task::ChartReadme(args) => chart_readme::run(&args),
        Task::Image(args) => image::run(&args).map(|_| ()),
        Task::VerifyImages(args) => image::verify(&args),
        Task::E2e(args) => e2e::run(&args),
        Task::Test(args) => test::run(&args),
        Task::Bench(args) if args.needs_cluster() => e2e::bench_on_cluster(&args),
        Task::Bench(args) => netkit_testenv::bench::run(&args),
        Task::Loc => loc::run(),
        Task::Consumers => consumers::run(),
        Task::Audit(args) => audit::run(&args),
        Task::Modules => modules::run(),
        Task::Errors => errors::run(),
    }
}
