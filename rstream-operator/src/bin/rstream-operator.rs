//! The rstream-operator manager.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use k8s_reconcile::app::{self, LogFormat};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::{self, Health};
use prometheus_client::registry::Registry;
use rstream_operator::manager::{self, ManagerOptions};

/// Default agent image (the original operator's).
const DEFAULT_AGENT_IMAGE: &str = concat!(
    "ghcr.io/kube-netkit/rstream-operator:",
    env!("CARGO_PKG_VERSION")
);

/// Manages rstream tunnels from RstreamConnection and RstreamTunnel resources. Boolean flags take
/// Go's forms (`--leader-elect`, `--leader-elect=true`, `--leader-elect=false`).
#[derive(Debug, Parser)]
#[command(name = "rstream-operator", version)]
struct Args {
    /// Address of /metrics (also /healthz, /readyz); "0" disables it.
    #[arg(long, env = "RSTREAM_METRICS_BIND_ADDRESS", default_value = ":8080")]
    metrics_bind_address: String,
    /// Address of /healthz and /readyz (also /metrics); "0" disables it.
    #[arg(
        long,
        env = "RSTREAM_HEALTH_PROBE_BIND_ADDRESS",
        default_value = ":8081"
    )]
    health_probe_bind_address: String,
    /// Run the controllers only while holding the Lease, so several replicas can run.
    #[arg(long, env = "RSTREAM_LEADER_ELECT", default_value_t = false)]
    leader_elect: bool,
    /// Namespace of the Leases (default: the pod's namespace, else rstream-system).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Image of the tunnel agent, unless a tunnel sets spec.agent.image.
    #[arg(long, env = "RSTREAM_AGENT_IMAGE", default_value = DEFAULT_AGENT_IMAGE)]
    agent_image: String,
    /// Every object is reconciled at least this often (Go duration).
    #[arg(long, env = "RSTREAM_RESYNC_PERIOD", default_value = "5m")]
    resync_period: String,
    /// Concurrent reconciles per controller.
    #[arg(long, env = "RSTREAM_CONCURRENCY", default_value_t = 8)]
    concurrency: u16,
    /// Watch only this namespace (default: the whole cluster, needed for cross-namespace targets).
    #[arg(long, env = "WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Log format.
    #[arg(long, env = "RSTREAM_LOG_FORMAT", value_enum, default_value = "json")]
    log_format: LogFormat,
    /// Log level or filter (RUST_LOG wins when set).
    #[arg(long, env = "RSTREAM_LOG_LEVEL", default_value = "info", value_parser = app::parse_log_level)]
    log_level: String,
}

async fn run(args: Args) -> anyhow::Result<()> {
    let metrics_addr = app::parse_optional_listen_addr(&args.metrics_bind_address)
        .context("--metrics-bind-address")?;
    let health_addr = app::parse_optional_listen_addr(&args.health_probe_bind_address)
        .context("--health-probe-bind-address")?;
    let resync = app::parse_positive_duration(&args.resync_period).context("--resync-period")?;
    anyhow::ensure!(
        !args.agent_image.trim().is_empty(),
        "--agent-image must not be empty"
    );
    let shutdown = ops::shutdown_on_signals()?;
    let client = app::kube_client(None).await?;

    let mut registry = Registry::default();
    let metrics = ControllerMetrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::new();
    let servers = app::serve_ops(
        [metrics_addr, health_addr].into_iter().flatten(),
        &health,
        &registry,
        &shutdown,
    )
    .await?;

    let leader_election = args.leader_elect.then(|| {
        let namespace = (args.leader_election_namespace.clone())
            .filter(|n| !n.is_empty())
            .or_else(app::own_namespace)
            .unwrap_or_else(|| "rstream-system".to_owned());
        (namespace, app::leader_identity(None, "rstream-operator"))
    });
    let options = ManagerOptions {
        agent_image: args.agent_image.trim().to_owned(),
        leader_election,
        resync,
        concurrency: args.concurrency,
        namespace: args.namespace.clone().filter(|n| !n.is_empty()),
    };
    tracing::info!(agent_image = %options.agent_image, leader_elect = args.leader_elect, "starting the manager");
    let result = manager::run(client, options, health, metrics, shutdown.clone()).await;
    shutdown.cancel();
    for server in servers {
        let _ = server.await;
    }
    tracing::info!("stopped");
    Ok(result?)
}

fn main() -> ExitCode {
    let args: Args = app::parse_args();
    app::init_logging(args.log_format, Some(&args.log_level));
    app::block_on("rstream-operator", run(args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_elect_takes_gos_boolean_forms() {
        let parse = |args: &[&str]| {
            app::try_parse_args_from::<Args, _, _>(
                std::iter::once("rstream-operator").chain(args.iter().copied()),
            )
        };
        for (args, expected) in [
            (&[][..], false),
            (&["--leader-elect"], true),
            (&["--leader-elect=true"], true),
            (&["--leader-elect=1"], true),
            (&["--leader-elect=false"], false),
            (&["--leader-elect=F"], false),
        ] {
            let parsed = parse(args).map(|a| a.leader_elect);
            assert!(
                matches!(parsed, Ok(v) if v == expected),
                "{args:?}: {parsed:?}"
            );
        }
        assert!(parse(&["--leader-elect=maybe"]).is_err());
    }
}
