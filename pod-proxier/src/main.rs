//! The pod-proxier binary: parses flags, sets up logging and runs [`pod_proxier::app::run`].

use std::process::ExitCode;

use netkit_runtime as app;
use pod_proxier::config::{Cli, Command};

fn main() -> ExitCode {
    // Go's boolean syntax (`--enable-v1=true`), as the original's flags take it.
    let cli: Cli = app::parse_args();
    let command = cli.command.clone().unwrap_or(Command::Run);
    let need_a_version = matches!(command, Command::Run);
    let settings = match cli.validate(need_a_version) {
        Ok(settings) => settings,
        Err(message) => {
            let code = app::usage_error(&message);
            if need_a_version && !cli.enable_v1 && !cli.enable_v2 {
                eprintln!("\n{}", pod_proxier::app::LOCAL_TRIAL_HINT);
            }
            return code;
        }
    };
    match command {
        Command::Crd => app::exit_with(
            "pod-proxier",
            pod_proxier::crd::crd_yaml().map(|yaml| print!("{yaml}")),
        ),
        Command::Openapi => {
            let doc = pod_proxier::openapi::document(&settings);
            println!("{doc:#}");
            ExitCode::SUCCESS
        }
        Command::HaproxyConfig { output } => {
            let text = pod_proxier::dataplane::haproxy::config_text(&settings);
            match output {
                None => {
                    print!("{text}");
                    ExitCode::SUCCESS
                }
                Some(path) => app::exit_with(
                    "pod-proxier",
                    std::fs::write(&path, text)
                        .map_err(|err| format!("writing {}: {err}", path.display())),
                ),
            }
        }
        Command::Connect(args) => {
            cli.log.init();
            app::block_on("pod-proxier connect", async move {
                let stop = k8s_reconcile::ops::shutdown_on_signals()
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
                pod_proxier::connect::run(args, stop)
                    .await
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            })
        }
        Command::Run => {
            cli.log.init();
            let no_cluster = std::cell::Cell::new(false);
            let code = app::block_on("pod-proxier", async {
                let result = pod_proxier::app::run(settings).await;
                no_cluster.set(matches!(
                    result,
                    Err(pod_proxier::app::StartError::NoCluster(_))
                ));
                result
            });
            // After the error's chain, which names the cause.
            if no_cluster.get() {
                eprintln!("\n{}", pod_proxier::app::LOCAL_TRIAL_HINT);
            }
            code
        }
    }
}
