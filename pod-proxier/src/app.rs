//! Wiring: client, data plane, mapping sync loop, leader work, API and operations servers, and
//! the graceful shutdown on SIGTERM.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_reconcile::app::rest::{self, ApiLimits};
use k8s_reconcile::leader::LeaseConfig;
use k8s_reconcile::leading::{Leadership, run_while_leading};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::{self, Health};
use kube::Client;
use kube::api::{Api, ListParams};
use proxy_core::metrics::PrometheusObserver;
use proxy_core::upstream::HealthCheck;

use crate::api::{AppState, router};
use crate::config::{AuthMode, BackendKind, Settings};
use crate::crd::CONTROLLER;
use crate::crd::PortMapping;
use crate::dataplane::embedded::EmbeddedPlane;
use crate::dataplane::haproxy::HaproxyPlane;
use crate::dataplane::{DataPlane, DesiredPorts, PortRoute};
use crate::expiry::sweep_expired;
use crate::forwarding::spawn_sync_loop;
use crate::metrics::Metrics;
use crate::pod_mappings::V1;
use crate::service_ports::{V2Inputs, V2Reconciler};
use k8s_reconcile::auth::Authenticator;

/// How to try pod-proxier without a cluster, shown whenever none is reachable.
pub const LOCAL_TRIAL_HINT: &str = "\
pod-proxier needs a Kubernetes API server. In a cluster it uses its ServiceAccount; elsewhere \
give --kubeconfig (or KUBECONFIG).
To try it locally with the project's control plane:
  cargo xtask cluster        # starts etcd + kube-apiserver and prints a kubeconfig path
  export KUBECONFIG=<that path>
  cargo run -p pod-proxier -- crd | kubectl apply -f -
  cargo run -p pod-proxier -- --enable-v1 --auth none --listen-addr 127.0.0.1 --api-listen-addr 127.0.0.1";

/// The answer over --max-api-connections, in the API's envelope.
const BUSY_BODY: &str =
    r#"{"code":50003,"msg":"too many connections to this API; retry in a second"}"#;

/// Why pod-proxier could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// No usable kubeconfig, or the API server does not answer.
    #[error("cannot reach a Kubernetes API server: {0}\n\n{LOCAL_TRIAL_HINT}")]
    NoCluster(String),
    /// The CRD is not installed.
    #[error(
        "the PortMapping CRD ({}) is not installed in this cluster. Install it with \
         `pod-proxier crd | kubectl apply -f -` (or the chart, or pod-proxier/config/crd)",
        crate::crd::GROUP
    )]
    CrdMissing,
    /// pod-proxier's identity lacks permissions.
    #[error(
        "pod-proxier's identity may not list PortMappings in namespace {0:?}: bind it to the \
         chart's RBAC rules (pod-proxier/chart/files/rbac-rules.yaml)"
    )]
    Forbidden(String),
    /// A Kubernetes call failed at start.
    #[error("Kubernetes API call failed at start: {0}")]
    Kube(kube::Error),
    /// The data plane could not start.
    #[error("data plane: {0}")]
    DataPlane(String),
    /// Operations server, signals, leader election.
    #[error(transparent)]
    Framework(#[from] k8s_reconcile::Error),
}

/// A client from `--kubeconfig`, or the usual inference.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, StartError> {
    let client = k8s_reconcile::app::kube_client(kubeconfig)
        .await
        .map_err(|e| StartError::NoCluster(e.to_string()))?;
    match tokio::time::timeout(Duration::from_secs(10), client.apiserver_version()).await {
        Ok(Ok(_)) => Ok(client),
        Ok(Err(err)) => Err(StartError::NoCluster(err.to_string())),
        Err(_) => Err(StartError::NoCluster(
            "no answer within 10 seconds".to_owned(),
        )),
    }
}

/// Runs pod-proxier until SIGTERM/SIGINT.
pub async fn run(settings: Settings) -> Result<(), StartError> {
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    if settings.auth == AuthMode::None {
        tracing::warn!(
            "--auth=none: the API is open to anyone who can reach {}; use only for local trials",
            settings.api_addr
        );
    }
    let settings = Arc::new(settings);
    let client = client(settings.kubeconfig.as_deref()).await?;
    let api: Api<PortMapping> = Api::namespaced(client.clone(), &settings.state_namespace);
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => return Err(StartError::CrdMissing),
        Err(kube::Error::Api(status)) if status.code == 403 => {
            return Err(StartError::Forbidden(settings.state_namespace.clone()));
        }
        Err(err) => return Err(StartError::Kube(err)),
    }

    let mut registry =
        k8s_reconcile::app::metrics_registry("pod-proxier", env!("CARGO_PKG_VERSION"));
    let observer = Arc::new(PrometheusObserver::register(&mut registry));
    let metrics = Metrics::register(&mut registry);
    let controller_metrics = ControllerMetrics::register(&mut registry);
    let registry = Arc::new(registry);
    let health = Health::new();

    let plane = match settings.backend {
        BackendKind::Embedded => {
            let check = match settings.health_check {
                Some((interval, timeout)) => Some(
                    HealthCheck::new(interval, timeout, 1, 2)
                        .map_err(|e| StartError::DataPlane(e.to_string()))?,
                ),
                None => None,
            };
            DataPlane::Embedded(
                EmbeddedPlane::new(settings.listen_ip, observer, check, settings.drain_timeout)
                    .map_err(|e| StartError::DataPlane(e.to_string()))?,
            )
        }
        BackendKind::Haproxy => DataPlane::Haproxy(
            HaproxyPlane::connect(&settings)
                .await
                .map_err(|e| StartError::DataPlane(e.to_string()))?,
        ),
    };
    let plane = Arc::new(plane);
    if settings.enable_v1 {
        // Bind the V1 entry port now, so a taken port stops the start instead of a log line.
        let idle: DesiredPorts = [(settings.entry_port, PortRoute::idle())].into();
        if let Some(error) = plane.sync(&idle).await.into_iter().next() {
            return Err(StartError::DataPlane(format!(
                "V1 entry port {}: {}",
                error.port, error.message
            )));
        }
    }

    let shutdown = ops::shutdown_on_signals()?;
    let (mappings, sync_task) = spawn_sync_loop(
        api.clone(),
        Arc::clone(&settings),
        Arc::clone(&plane),
        metrics.clone(),
        health.clone(),
        shutdown.clone(),
    );

    let leadership = Leadership {
        name: CONTROLLER.to_owned(),
        health: health.clone(),
        metrics: Some(controller_metrics),
    };
    let leader_task = tokio::spawn(lead(
        V2Inputs {
            settings: Arc::clone(&settings),
            client: client.clone(),
            api: api.clone(),
            mappings: mappings.clone(),
            metrics: metrics.clone(),
        },
        leadership,
        shutdown.clone(),
    ));

    let state = Arc::new(AppState {
        settings: Arc::clone(&settings),
        auth: match settings.auth {
            AuthMode::None => Authenticator::allow_all("anonymous (--auth=none)"),
            AuthMode::Kubernetes => Authenticator::new(client.clone()),
        },
        v1: settings.enable_v1.then(|| {
            V1::new(
                Arc::clone(&settings),
                client.clone(),
                api.clone(),
                mappings.clone(),
            )
        }),
        mappings,
        metrics,
    });
    let listener = rest::bind_api(settings.api_addr).await?;
    let limits = ApiLimits {
        header_read_timeout: settings.header_read_timeout,
        max_connections: settings.max_api_connections,
        busy_body: BUSY_BODY,
        drain_timeout: settings.request_timeout,
    };
    let api_task = tokio::spawn(rest::serve_api(
        listener,
        router(state),
        limits,
        shutdown.clone(),
    ));
    let ops_task = ops::serve(
        settings.metrics_addr,
        ops::router(health, registry),
        shutdown.clone(),
    )
    .await?;
    tracing::info!(
        api = %settings.api_addr,
        metrics = %settings.metrics_addr,
        v1 = settings.enable_v1,
        v2 = settings.enable_v2,
        entry_port = settings.entry_port,
        range = %format!("{}-{}", settings.port_range.0, settings.port_range.1),
        backend = ?settings.backend,
        "pod-proxier started"
    );

    shutdown.cancelled().await;
    tracing::info!(drain = ?settings.drain_timeout, "shutting down: API closed, draining connections");
    let _ = api_task.await;
    let _ = leader_task.await;
    let _ = sync_task.await;
    plane.shutdown(settings.drain_timeout).await;
    let _ = ops_task.await;
    Ok(())
}

/// Campaigns for the Lease and, while holding it, removes expired mappings and (with V2)
/// allocates Service ports. Followers only forward and serve the API.
async fn lead(
    inputs: V2Inputs,
    leadership: Leadership,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(), k8s_reconcile::Error> {
    let settings = Arc::clone(&inputs.settings);
    let lease = LeaseConfig::new(
        settings.state_namespace.clone(),
        settings.lease_name.clone(),
        settings.identity.clone(),
    );
    let client = inputs.client.clone();
    run_while_leading(client, lease, &leadership, shutdown, move |stop| {
        let sweep = sweep_expired(inputs.api.clone(), inputs.mappings.clone(), stop.clone());
        let v2 = settings
            .enable_v2
            .then(|| V2Reconciler::new(inputs.clone()));
        let identity = settings.identity.clone();
        async move {
            tracing::info!(%identity, "leading: removing expired mappings and allocating V2 ports");
            match v2 {
                Some(v2) => {
                    tokio::join!(sweep, v2.run(stop));
                }
                None => sweep.await,
            }
        }
    })
    .await
}
