//! steward-tcp-proxy: makes in-cluster clients of a hosted-control-plane tenant reach the API
//! server through `kubernetes.default.svc`.
//!
//! It keeps the `default/kubernetes` EndpointSlices and Endpoints pointing at itself
//! ([`endpoints`]) and relays every connection to the real API server ([`relay`]). Operations:
//! `/healthz`, `/readyz` (upstream dialable, endpoints correct, not shutting down), `/metrics`,
//! leader election, and a drain on SIGTERM.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod cli;
mod duration;
mod endpoints;
mod relay;
mod tls;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_reconcile::ControllerBuilder;
use k8s_reconcile::leader::LeaseConfig;
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::{self, Health};
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use proxy_core::metrics::PrometheusObserver;
use proxy_core::relay::RelayConfig;
use rustls::pki_types::ServerName;
use tokio_util::sync::CancellationToken;

use crate::cli::{Args, LogFormat};
use crate::endpoints::{
    EndpointsConfig, EndpointsMetrics, EndpointsReconciler, KUBERNETES_NAMESPACE,
    KUBERNETES_SERVICE, MANAGER,
};
use crate::relay::{Relay, RelaySettings, TlsSettings};

/// Readiness check: the upstream accepts TCP connections.
const UPSTREAM_CHECK: &str = "upstream";
/// Readiness check: false once SIGTERM arrived, so load balancers stop sending first.
const SHUTDOWN_CHECK: &str = "shutdown";

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(problem) = args.validate() {
        eprintln!("error: {problem}");
        return ExitCode::from(2);
    }
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: starting the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let shutdown = ops::shutdown_on_signals()?;
    let health = Health::new();
    health.set(SHUTDOWN_CHECK, true, "running");
    let mut registry = Registry::default();
    let observer = Arc::new(PrometheusObserver::register(&mut registry));
    let endpoint_metrics = EndpointsMetrics::register(&mut registry);
    let controller_metrics = ControllerMetrics::register(&mut registry);
    let registry = Arc::new(registry);

    // Data plane first: a proxy that cannot relay must not point the cluster at itself.
    let relay_config = RelayConfig::default()
        .with_connect_timeout(args.connect_timeout)
        .with_idle_timeout((!args.idle_timeout.is_zero()).then_some(args.idle_timeout));
    let tls = tls_settings(&args, &shutdown)?;
    let relay = Relay::start(
        RelaySettings {
            listen: args.listen_addr,
            upstream: args.upstream_addr.clone(),
            relay: relay_config,
            max_connections: (args.max_connections > 0).then_some(args.max_connections),
            tls,
        },
        observer,
    )
    .await?;
    tracing::info!(listen = %relay.local_addr(), upstream = %args.upstream_addr, mode = if args.tls_cert_file.is_some() { "tls-termination" } else { "passthrough" }, "relaying");

    let router = ops::router(health.clone(), Arc::clone(&registry));
    let ops_stop = CancellationToken::new();
    if args.health_addr == args.metrics_addr {
        ops::serve(args.health_addr, router, ops_stop.clone()).await?;
    } else {
        ops::serve(args.health_addr, router.clone(), ops_stop.clone()).await?;
        ops::serve(args.metrics_addr, router, ops_stop.clone()).await?;
    }
    spawn_upstream_check(
        args.upstream_addr.clone(),
        args.connect_timeout,
        health.clone(),
        shutdown.clone(),
    );

    let client = kube_client(&args).await?;
    let controller = endpoints_controller(
        &args,
        client,
        health.clone(),
        endpoint_metrics,
        controller_metrics,
    )?;
    let controller_stop = shutdown.child_token();
    let controller_task = tokio::spawn(controller.run(controller_stop));

    shutdown.cancelled().await;
    health.set(SHUTDOWN_CHECK, false, "shutting down: draining connections");
    tracing::info!(deadline = ?args.drain_timeout, "draining");
    let report = relay.drain(args.drain_timeout).await;
    tracing::info!(
        finished = report.finished,
        forced = report.forced,
        "drained"
    );
    match controller_task.await {
        Ok(result) => result.context("endpoints controller")?,
        Err(err) => tracing::error!(error = %err, "endpoints controller task failed"),
    }
    ops_stop.cancel();
    Ok(())
}

fn tls_settings(args: &Args, stop: &CancellationToken) -> anyhow::Result<Option<TlsSettings>> {
    let (Some(cert), Some(key)) = (&args.tls_cert_file, &args.tls_key_file) else {
        return Ok(None);
    };
    let cert = Arc::new(tls::ReloadingCert::load(cert, key)?);
    Arc::clone(&cert).watch(Duration::from_secs(5), stop.clone());
    if args.upstream_insecure {
        tracing::warn!(
            "--upstream-insecure: the upstream API server's certificate is not verified"
        );
    }
    let client =
        tls::upstream_client_config(args.upstream_ca_file.as_deref(), args.upstream_insecure)?;
    let host = match &args.upstream_sni {
        Some(sni) => sni.clone(),
        None => upstream_host(&args.upstream_addr).to_owned(),
    };
    let upstream_name = ServerName::try_from(host.clone())
        .with_context(|| format!("{host:?} is not a valid TLS server name (set --upstream-sni)"))?;
    Ok(Some(TlsSettings {
        cert,
        client: Arc::new(client),
        upstream_name,
    }))
}

/// The host part of `host:port` (brackets of an IPv6 literal removed).
fn upstream_host(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

async fn kube_client(args: &Args) -> anyhow::Result<kube::Client> {
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading --kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await?
        }
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration: run in a cluster, set KUBECONFIG or pass --kubeconfig \
             (for a local control plane, see `cargo xtask cluster`)",
        )?,
    };
    Ok(kube::Client::try_from(config)?)
}

fn endpoints_controller(
    args: &Args,
    client: kube::Client,
    health: Health,
    metrics: EndpointsMetrics,
    controller_metrics: ControllerMetrics,
) -> anyhow::Result<ControllerBuilder<EndpointsReconciler>> {
    let ns = args.service_namespace.clone();
    let service = ObjectRef::<Service>::new(&args.service_name).within(&ns);
    let reconciler = EndpointsReconciler::new(
        EndpointsConfig {
            mode: args.endpoint_mode,
            service_port: args.service_port,
        },
        health.clone(),
        metrics,
    );
    let mut builder = ControllerBuilder::new(client.clone(), "endpoints", reconciler)
        .namespaced(&ns)
        .watcher_config(
            watcher::Config::default().fields(&format!("metadata.name={}", args.service_name)),
        )
        .field_manager(MANAGER)
        .resync(args.reconcile_interval)
        .concurrency(1)
        .backoff(Duration::from_millis(200), Duration::from_secs(30))
        .health(health)
        .metrics(controller_metrics)
        // Any change to the published objects triggers a repair at once.
        .watches(
            Api::<EndpointSlice>::namespaced(client.clone(), KUBERNETES_NAMESPACE),
            watcher::Config::default()
                .labels(&format!("kubernetes.io/service-name={KUBERNETES_SERVICE}")),
            to(&service),
        )
        .watches(
            Api::<Endpoints>::namespaced(client.clone(), KUBERNETES_NAMESPACE),
            watcher::Config::default().fields(&format!("metadata.name={KUBERNETES_SERVICE}")),
            to(&service),
        );
    if args.endpoint_mode == cli::EndpointMode::PodIp {
        builder = builder.watches(
            Api::<EndpointSlice>::namespaced(client.clone(), &ns),
            watcher::Config::default()
                .labels(&format!("kubernetes.io/service-name={}", args.service_name)),
            to(&service),
        );
    }
    if args.leader_elect {
        let identity = match &args.identity {
            Some(identity) => identity.clone(),
            None => hostname(),
        };
        builder = builder.leader_election(LeaseConfig::new(&ns, &args.service_name, identity));
    }
    Ok(builder)
}

/// Maps any change of a watched object to a reconcile of the proxy Service.
fn to<C>(
    service: &ObjectRef<Service>,
) -> impl Fn(C) -> Vec<ObjectRef<Service>> + Send + Sync + 'static {
    let service = service.clone();
    move |_| vec![service.clone()]
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| format!("steward-tcp-proxy-{}", std::process::id()))
}

/// Dials the upstream every 10 s so `/readyz` says whether relaying can work.
fn spawn_upstream_check(
    upstream: String,
    timeout: Duration,
    health: Health,
    stop: CancellationToken,
) {
    health.set(UPSTREAM_CHECK, false, "not checked yet");
    tokio::spawn(async move {
        loop {
            let dial =
                tokio::time::timeout(timeout, tokio::net::TcpStream::connect(&upstream)).await;
            match dial {
                Ok(Ok(_)) => health.set(UPSTREAM_CHECK, true, format!("{upstream} dialable")),
                Ok(Err(err)) => health.set(UPSTREAM_CHECK, false, format!("{upstream}: {err}")),
                Err(_) => health.set(
                    UPSTREAM_CHECK,
                    false,
                    format!("{upstream}: no answer within {timeout:?}"),
                ),
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(10)) => {}
            }
        }
    });
}
