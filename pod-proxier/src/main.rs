//! The pod-proxier binary: parses flags, sets up logging and runs [`pod_proxier::app::run`].

use std::process::ExitCode;

use clap::Parser as _;
use pod_proxier::config::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

fn init_logging(cli: &Cli) {
    let filter = EnvFilter::try_new(&cli.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match cli.log_format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Exit code of invalid flags (as clap's own errors).
const USAGE_ERROR: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let command = cli.command.clone().unwrap_or(Command::Run);
    let need_a_version = matches!(command, Command::Run);
    let settings = match cli.validate(need_a_version) {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("error: {message}\n\nFor more information, try '--help'.");
            if need_a_version && !cli.enable_v1 && !cli.enable_v2 {
                eprintln!("\n{}", pod_proxier::app::LOCAL_TRIAL_HINT);
            }
            return ExitCode::from(USAGE_ERROR);
        }
    };
    match command {
        Command::Crd => match pod_proxier::crd::crd_yaml() {
            Ok(yaml) => {
                print!("{yaml}");
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        },
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
                Some(path) => match std::fs::write(&path, text) {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(err) => {
                        eprintln!("error: writing {}: {err}", path.display());
                        ExitCode::FAILURE
                    }
                },
            }
        }
        Command::Run => {
            init_logging(&cli);
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(err) => {
                    eprintln!("error: cannot start the async runtime: {err}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(pod_proxier::app::run(settings)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    eprintln!("error: {err}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
