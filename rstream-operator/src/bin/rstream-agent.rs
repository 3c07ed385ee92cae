//! The rstream tunnel agent: one per RstreamTunnel, run by the Deployment the manager creates.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use netkit_runtime::{self as app, ClientArgs, LogArgs};
use rstream_operator::agent::{self, AgentError, AgentOptions};

/// Keeps one rstream tunnel up, forwards its streams to the target Service and reports its state
/// into the RstreamTunnel status.
#[derive(Debug, Parser)]
#[command(
    name = "rstream-agent",
    version,
    mut_arg("log_format", |a| a.env("RSTREAM_LOG_FORMAT")),
    mut_arg("log_level", |a| a.env("RSTREAM_LOG_LEVEL"))
)]
struct Args {
    /// Agent configuration file (rendered by the manager).
    #[arg(
        long,
        env = "RSTREAM_AGENT_CONFIG",
        default_value = "/etc/rstream-agent/config.yaml"
    )]
    config: PathBuf,
    /// Address of /healthz, /readyz (ready while connected to the engine, holding the tunnel or on standby) and /metrics; "0" disables it.
    #[arg(
        long,
        env = "RSTREAM_AGENT_HEALTH_BIND_ADDRESS",
        default_value = ":8081",
        value_parser = app::parse_optional_listen_addr
    )]
    health_bind_address: app::OptionalListenAddr,
    /// Forward streams to this host:port instead of the configured Service (tests, debugging).
    #[arg(long, env = "RSTREAM_AGENT_TARGET_OVERRIDE")]
    target_override: Option<String>,
    /// Extra PEM CA bundle trusted for the engine (self-hosted engines with a private CA).
    #[arg(long, env = "RSTREAM_AGENT_CA_FILE")]
    ca_file: Option<PathBuf>,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    log: LogArgs,
}

async fn run(args: Args) -> Result<(), AgentError> {
    let options = AgentOptions {
        config: args.config,
        health_bind_address: args.health_bind_address,
        target_override: args.target_override,
        ca_file: args.ca_file,
        client: args.client,
    };
    agent::run(options).await
}

fn main() -> ExitCode {
    let args: Args = app::parse_args();
    args.log.init();
    // A configuration the agent cannot use is a usage error (exit 2), like a bad flag, in every
    // binary; it is found before anything starts.
    let mut unusable = None;
    let code = app::block_on("rstream-agent", async {
        match run(args).await {
            Err(error) if error.is_configuration() => {
                unusable = Some(error);
                Ok(())
            }
            other => other,
        }
    });
    match unusable {
        Some(error) => app::usage_error(&error),
        None => code,
    }
}
