//! steward-tcp-proxy: makes in-cluster clients of a hosted-control-plane tenant reach the API
//! server through `kubernetes.default.svc`.
//!
//! It keeps the `default/kubernetes` EndpointSlices and Endpoints pointing at itself
//! ([`endpoints`]), leaving out replicas that stop answering ([`k8s_reconcile::peers`]), and
//! relays every connection to the real API server ([`relay`]). Operations:
//! `/healthz`, `/readyz` (upstream dialable, endpoints correct, not shutting down), `/metrics`
//! (over HTTPS behind TokenReview and SubjectAccessReview unless `--metrics-secure=false`),
//! leader election, and a drain on SIGTERM.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod cli;
mod endpoints;
mod relay;
mod tls;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_reconcile::ControllerBuilder;
use k8s_reconcile::leader::LeaseConfig;
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use k8s_reconcile::peers::{PeerCheck, PeerMetrics};
use k8s_reconcile::permissions::{self, MissingPermissions};
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use netkit_runtime::{self as app, App};
use proxy_core::http_connect::{self, HttpProxy};
use proxy_core::metrics::PrometheusObserver;
use proxy_core::relay::RelayConfig;
use proxy_core::upstream::{TargetAddr, Upstream};
use rustls::pki_types::ServerName;
use tokio_util::sync::CancellationToken;

use crate::cli::Args;
use crate::endpoints::{
    EndpointsConfig, EndpointsMetrics, EndpointsReconciler, KUBERNETES_NAMESPACE,
    KUBERNETES_SERVICE, MANAGER,
};
use crate::relay::{Relay, RelaySettings};
use crate::tls::TerminatingAcceptor;

/// Readiness check: the upstream accepts TCP connections.
const UPSTREAM_CHECK: &str = "upstream";

fn main() -> ExitCode {
    let args: Args = app::parse_args();
    if let Err(problem) = args.validate() {
        return app::usage_error(&problem);
    }
    args.log.init();
    app::block_on_threads("steward-tcp-proxy", args.threads, run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut builder = App::builder("steward-tcp-proxy", env!("CARGO_PKG_VERSION"));
    let registry = builder.registry();
    let observer = Arc::new(PrometheusObserver::register(registry));
    let endpoint_metrics = EndpointsMetrics::register(registry);
    let peer_metrics = PeerMetrics::register(registry.sub_registry_with_prefix("steward"));
    let missing_permissions =
        MissingPermissions::register(registry.sub_registry_with_prefix("steward"));
    let controller_metrics = ControllerMetrics::register(registry);
    builder
        .health()
        .set(UPSTREAM_CHECK, false, "not checked yet");
    // Made before the servers start: the secure metrics server reviews tokens through it.
    let client = args
        .client
        .client()
        .await
        .context("for a local control plane, see `cargo xtask cluster`")?;
    let metrics_access = args.metrics.access(&client)?;
    let app = builder
        .serve_health(args.health_addr)
        .serve_metrics(args.metrics_addr, metrics_access)
        .ops_bind_failure(args.ops_bind_failure)
        .start()
        .await?;
    let health = app.health().clone();
    let shutdown = app.shutdown().clone();

    // Data plane first: a proxy that cannot relay must not point the cluster at itself.
    let relay_config = RelayConfig::default()
        .with_connect_timeout(args.connect_timeout)
        .with_idle_timeout((!args.idle_timeout.is_zero()).then_some(args.idle_timeout));
    let tls = tls_settings(&args, &shutdown)?;
    let proxy = upstream_proxy(&args)?;
    let relay = Relay::start(
        RelaySettings {
            listen: args.listen_addr,
            upstream: args.upstream_addr.clone(),
            relay: relay_config,
            max_connections: (args.max_connections > 0).then_some(args.max_connections),
            tls,
            proxy,
            drain_idle: (!args.drain_idle.is_zero()).then_some(args.drain_idle),
            data_path: args.data_path,
        },
        observer,
    )?;
    tracing::info!(listen = %relay.local_addr(), upstream = %relay.upstream().describe(), mode = if args.tls_cert_file.is_some() { "tls-termination" } else { "passthrough" }, data_path = %args.data_path, "relaying");

    spawn_upstream_check(
        relay.upstream().clone(),
        args.connect_timeout,
        health.clone(),
        shutdown.clone(),
    );

    let peer_check = peer_check(&args, peer_metrics);
    if let Some(check) = &peer_check {
        tokio::spawn(check.clone().run(shutdown.clone()));
    }
    let controller = endpoints_controller(
        &args,
        client,
        health,
        endpoint_metrics,
        controller_metrics,
        missing_permissions,
        peer_check,
    )
    .await?;
    let controller_task = tokio::spawn(controller.run(shutdown.child_token()));

    shutdown.cancelled().await;
    if !args.shutdown_delay.is_zero() {
        // Connections kube-proxy still sends here are served until the endpoints move on.
        tracing::info!(delay = ?args.shutdown_delay, "not ready, still accepting before the drain");
        tokio::time::sleep(args.shutdown_delay).await;
    }
    tracing::info!(deadline = ?args.drain_timeout, idle = ?args.drain_idle, "draining");
    let report = relay.drain(args.drain_timeout).await;
    tracing::info!(
        finished = report.finished,
        closed_idle = report.closed_idle,
        forced = report.forced,
        "drained"
    );
    match controller_task.await {
        Ok(result) => result.context("endpoints controller")?,
        Err(err) => tracing::error!(error = %err, "endpoints controller task failed"),
    }
    app.finish().await;
    Ok(())
}

fn tls_settings(
    args: &Args,
    stop: &CancellationToken,
) -> anyhow::Result<Option<Arc<TerminatingAcceptor>>> {
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
    let host = match (&args.upstream_sni, &args.upstream_addr) {
        (Some(sni), _) => sni.clone(),
        (None, Upstream::Target(TargetAddr::Host { host, .. })) => host.clone(),
        (None, Upstream::Target(TargetAddr::Socket(addr))) => addr.ip().to_string(),
        (None, _) => anyhow::bail!("--upstream-addr names several upstreams: set --upstream-sni"),
    };
    let upstream_name = ServerName::try_from(host.clone())
        .with_context(|| format!("{host:?} is not a valid TLS server name (set --upstream-sni)"))?;
    Ok(Some(Arc::new(TerminatingAcceptor {
        cert,
        client: Arc::new(client),
        upstream_name,
    })))
}

/// The peer check the flags ask for; says once why when it is off.
fn peer_check(args: &Args, metrics: PeerMetrics) -> Option<PeerCheck> {
    match args.peer_check() {
        Ok(config) => {
            tracing::info!(port = config.port, interval = ?config.interval, failures = config.failures.get(), "peer check: the leader dials each published replica's health port and leaves out of the kubernetes endpoints those that stop answering");
            Some(PeerCheck::new(config, metrics))
        }
        Err(why) => {
            tracing::info!("peer check off: {why}");
            None
        }
    }
}

async fn endpoints_controller(
    args: &Args,
    client: kube::Client,
    health: Health,
    metrics: EndpointsMetrics,
    controller_metrics: ControllerMetrics,
    permissions: MissingPermissions,
    peer_check: Option<PeerCheck>,
) -> anyhow::Result<ControllerBuilder<EndpointsReconciler>> {
    let ns = args.service_namespace.clone();
    let service = ObjectRef::<Service>::new(&args.service_name).within(&ns);
    // What the role lacks is asked once here, so that nothing below runs into a 403.
    let cannot_write =
        permissions::first_denied(&client, &endpoints::endpoints_write_access()).await;
    let cannot_watch =
        permissions::first_denied(&client, &endpoints::endpoints_watch_access()).await;
    let cannot_record = permissions::first_denied(&client, &[endpoints::events_access(&ns)]).await;
    let cannot_prune = permissions::first_denied(&client, &[endpoints::slice_prune_access()]).await;
    if let Some(access) = &cannot_watch {
        permissions.deny(
            access,
            "changes to the kubernetes Endpoints are not watched (the resync still runs)",
        );
    }
    let reconciler = EndpointsReconciler::new(
        EndpointsConfig {
            mode: args.endpoint_mode,
            service_port: args.service_port,
        },
        health.clone(),
        metrics,
        permissions,
    )
    .endpoints_denied(cannot_write)
    .events_denied(cannot_record)
    .prune_denied(cannot_prune)
    .peer_check(peer_check.clone());
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
        );
    if cannot_watch.is_none() {
        builder = builder.watches(
            Api::<Endpoints>::namespaced(client.clone(), KUBERNETES_NAMESPACE),
            watcher::Config::default().fields(&format!("metadata.name={KUBERNETES_SERVICE}")),
            to(&service),
        );
    }
    if args.endpoint_mode == cli::EndpointMode::PodIp {
        builder = builder.watches(
            Api::<EndpointSlice>::namespaced(client.clone(), &ns),
            watcher::Config::default()
                .labels(&format!("kubernetes.io/service-name={}", args.service_name)),
            to(&service),
        );
    }
    if let Some(check) = peer_check {
        // A peer going down or coming back is published at once, not at the next resync.
        let service = service.clone();
        builder = builder.reconcile_on(move || check.triggers(service.clone()));
    }
    if args.leader_elect {
        let identity = app::leader_identity(args.identity.as_deref(), "steward-tcp-proxy");
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

/// The HTTP proxy in front of the upstream: `--upstream-proxy`, else what `HTTPS_PROXY` and
/// `NO_PROXY` say for the upstream.
fn upstream_proxy(args: &Args) -> anyhow::Result<Option<HttpProxy>> {
    if let Some(proxy) = &args.upstream_proxy {
        tracing::info!(%proxy, "reaching the upstream through the HTTP proxy of --upstream-proxy");
        return Ok(Some(proxy.clone()));
    }
    // A list of upstreams cannot be tunnelled; Relay::start says so if a proxy is asked for.
    let Upstream::Target(target) = &args.upstream_addr else {
        return Ok(None);
    };
    let proxy = http_connect::proxy_from_env(target).context("HTTPS_PROXY")?;
    if let Some(proxy) = &proxy {
        tracing::info!(%proxy, "reaching the upstream through the HTTP proxy of HTTPS_PROXY");
    }
    Ok(proxy)
}

/// Dials the upstream (through the proxy, if any) every 10 s so `/readyz` says whether relaying
/// can work.
fn spawn_upstream_check(
    upstream: Upstream,
    timeout: Duration,
    health: Health,
    stop: CancellationToken,
) {
    tokio::spawn(async move {
        let name = upstream.describe();
        loop {
            match upstream.connect(timeout).await {
                Ok(_) => health.set(UPSTREAM_CHECK, true, format!("{name} dialable")),
                Err(err) => health.set(UPSTREAM_CHECK, false, app::error_chain(&err)),
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(10)) => {}
            }
        }
    });
}
