//! The rstream-operator manager.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use k8s_reconcile::metrics::ControllerMetrics;
use netkit_runtime::{self as app, App, ClientArgs, LogArgs, MetricsArgs};
use rstream_operator::manager::{self, ManagerOptions};

/// Default agent image (the original operator's).
const DEFAULT_AGENT_IMAGE: &str = concat!(
    "ghcr.io/kube-netkit/rstream-operator:",
    env!("CARGO_PKG_VERSION")
);

/// Manages rstream tunnels from RstreamConnection and RstreamTunnel resources. Boolean flags take
/// Go's forms (`--leader-elect`, `--leader-elect=true`, `--leader-elect=false`).
#[derive(Debug, Parser)]
#[command(
    name = "rstream-operator",
    version,
    mut_arg("log_format", |a| a.env("RSTREAM_LOG_FORMAT")),
    mut_arg("log_level", |a| a.env("RSTREAM_LOG_LEVEL")),
    mut_arg("metrics_secure", |a| a.env("RSTREAM_METRICS_SECURE")),
    mut_arg("metrics_cert_file", |a| a.env("RSTREAM_METRICS_CERT_FILE")),
    mut_arg("metrics_key_file", |a| a.env("RSTREAM_METRICS_KEY_FILE"))
)]
struct Args {
    /// Address of /metrics (HTTPS with a token unless --metrics-secure=false); "0" disables it.
    #[arg(long, env = "RSTREAM_METRICS_BIND_ADDRESS", default_value = ":8080", value_parser = app::parse_optional_listen_addr)]
    metrics_bind_address: app::OptionalListenAddr,
    /// Address of /healthz and /readyz, open to anyone (the kubelet's probes); "0" disables it.
    #[arg(
        long,
        env = "RSTREAM_HEALTH_PROBE_BIND_ADDRESS",
        default_value = ":8081",
        value_parser = app::parse_optional_listen_addr
    )]
    health_probe_bind_address: app::OptionalListenAddr,
    #[command(flatten)]
    metrics: MetricsArgs,
    /// Run the controllers only while holding the Lease, so several replicas can run.
    #[arg(long, env = "RSTREAM_LEADER_ELECT", default_value_t = false)]
    leader_elect: bool,
    /// Namespace of the Leases (default: the pod's namespace, else rstream-system).
    #[arg(long, env = "POD_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Image of the tunnel agent, unless a tunnel sets spec.agent.image.
    #[arg(long, env = "RSTREAM_AGENT_IMAGE", default_value = DEFAULT_AGENT_IMAGE, value_parser = non_empty)]
    agent_image: String,
    /// Image pull Secrets (names, comma-separated) of every agent Pod, so agents run from a
    /// private registry.
    #[arg(long, env = "RSTREAM_AGENT_IMAGE_PULL_SECRETS", value_delimiter = ',')]
    agent_image_pull_secrets: Vec<String>,
    /// Every object is reconciled at least this often (Go duration).
    #[arg(long, env = "RSTREAM_RESYNC_PERIOD", default_value = "5m", value_parser = app::parse_positive_duration)]
    resync_period: Duration,
    /// Concurrent reconciles per controller.
    #[arg(long, env = "RSTREAM_CONCURRENCY", default_value_t = 8)]
    concurrency: u16,
    /// Watch only this namespace (default: the whole cluster, needed for cross-namespace targets).
    #[arg(long, env = "WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Services of type LoadBalancer with this spec.loadBalancerClass get a tunnel and its public
    /// address in their status; "" turns that off.
    #[arg(long, env = "RSTREAM_LOAD_BALANCER_CLASS", default_value = manager::service::LOAD_BALANCER_CLASS, value_parser = load_balancer_class)]
    load_balancer_class: String,
    #[command(flatten)]
    client: ClientArgs,
    #[command(flatten)]
    log: LogArgs,
}

/// A load balancer class as the API server takes it (a qualified name with a DNS prefix, `a.b/c`),
/// or "" (off).
fn load_balancer_class(value: &str) -> Result<String, app::ValueError> {
    let value = value.trim();
    if !value.is_empty() {
        app::validate_qualified_name(value, true)?;
    }
    Ok(value.to_owned())
}

/// A value that is not blank, trimmed.
fn non_empty(value: &str) -> Result<String, String> {
    let value = value.trim();
    if value.is_empty() {
        return Err("must not be empty".to_owned());
    }
    Ok(value.to_owned())
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut builder = App::builder("rstream-operator", env!("CARGO_PKG_VERSION"));
    let metrics = ControllerMetrics::register(builder.registry());
    // Made before the servers start: the secure metrics server reviews tokens through it.
    let client = args.client.client().await?;
    let metrics_access = args.metrics.access(&client)?;
    let app = builder
        .serve_health(args.health_probe_bind_address)
        .serve_metrics(args.metrics_bind_address, metrics_access)
        .start()
        .await?;

    let leader_election = args.leader_elect.then(|| {
        let namespace = (args.leader_election_namespace.clone())
            .filter(|n| !n.is_empty())
            .or_else(app::own_namespace)
            .unwrap_or_else(|| "rstream-system".to_owned());
        (namespace, app::leader_identity(None, "rstream-operator"))
    });
    let options = ManagerOptions {
        agent_image: args.agent_image.clone(),
        agent_image_pull_secrets: args.agent_image_pull_secrets.clone(),
        leader_election,
        resync: args.resync_period,
        concurrency: args.concurrency,
        namespace: args.namespace.clone().filter(|n| !n.is_empty()),
        load_balancer_class: Some(args.load_balancer_class.clone()).filter(|c| !c.is_empty()),
    };
    tracing::info!(agent_image = %options.agent_image, leader_elect = args.leader_elect, load_balancer_class = options.load_balancer_class.as_deref().unwrap_or("(off)"), "starting the manager");
    let result = manager::run(
        client,
        options,
        app.health().clone(),
        metrics,
        app.shutdown().clone(),
    )
    .await;
    app.finish().await;
    tracing::info!("stopped");
    Ok(result?)
}

fn main() -> ExitCode {
    let args: Args = app::parse_args();
    args.log.init();
    app::block_on("rstream-operator", run(args))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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

    #[test]
    fn values_are_parsed_at_the_edge_and_bad_ones_are_usage_errors() {
        let parse = |args: &[&str]| {
            app::try_parse_args_from::<Args, _, _>(
                std::iter::once("rstream-operator").chain(args.iter().copied()),
            )
        };
        let args = parse(&["--metrics-bind-address=0", "--resync-period=90s"]).unwrap();
        assert_eq!(args.metrics_bind_address, None, "0 turns the listener off");
        assert_eq!(args.health_probe_bind_address.map(|a| a.port()), Some(8081));
        assert_eq!(args.resync_period, Duration::from_secs(90));
        assert!(args.metrics.metrics_secure, "metrics are secure by default");
        let args = parse(&["--metrics-secure=false"]).unwrap();
        assert!(!args.metrics.metrics_secure);
        assert_eq!(
            args.load_balancer_class,
            manager::service::LOAD_BALANCER_CLASS
        );
        let args = parse(&["--load-balancer-class="]).unwrap();
        assert_eq!(
            args.load_balancer_class, "",
            "empty turns the Service controller off"
        );
        let args = parse(&["--load-balancer-class=example.com/edge_1"]).unwrap();
        assert_eq!(args.load_balancer_class, "example.com/edge_1");
        for bad in [
            &["--load-balancer-class=rstream"][..],
            &["--load-balancer-class=Example.com/edge"],
            &["--load-balancer-class=example.com/"],
            &["--load-balancer-class=example.com/-edge"],
            &["--metrics-bind-address=nonsense"][..],
            &["--resync-period=30"],
            &["--resync-period=0s"],
            &["--agent-image= "],
            &["--log-level=loud"],
            &["--metrics-secure=maybe"],
            &["--metrics-cert-file=/tls.crt"],
        ] {
            let err = parse(bad).map(|_| ()).unwrap_err();
            // clap's usage errors exit with 2, as every binary's bad flags do.
            assert_eq!(err.exit_code(), 2, "{bad:?}: {err}");
        }
    }
}
