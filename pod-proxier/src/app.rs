//! Wiring: client, data plane, mapping sync loop, leader work, API and operations servers, and
//! the graceful shutdown on SIGTERM.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_reconcile::leader::LeaseConfig;
use k8s_reconcile::leading::{Leadership, run_while_leading};
use k8s_reconcile::metrics::ControllerMetrics;
use kube::Client;
use kube::api::{Api, ListParams};
use netkit_runtime::App;
use netkit_runtime::rest::{self, ApiLimits, ApiTransport};
use proxy_core::metrics::PrometheusObserver;

use crate::api::{AppState, router};
use crate::config::{AuthMode, BackendKind};
use crate::crd::CONTROLLER;
use crate::crd::PortMapping;
use crate::dataplane::embedded::EmbeddedPlane;
use crate::dataplane::haproxy::{HaproxyError, HaproxyPlane, gated_ports};
use crate::dataplane::{DataPlane, DesiredPorts, PortRoute};
use crate::expiry::sweep_expired;
use crate::forwarding::spawn_sync_loop;
use crate::metrics::Metrics;
use crate::peers::PeersMetrics;
use crate::pod_mappings::V1;
use crate::service_ports::{V2Inputs, V2Reconciler};
use crate::settings::Settings;
use k8s_reconcile::auth::Authenticator;

/// How long `--backend haproxy` waits at start for HAProxy's Runtime API (its sidecar starts
/// alongside and opens the socket a moment later) before the start fails.
const RUNTIME_API_WAIT: Duration = Duration::from_secs(30);

/// How often the API's certificate files are checked for a new pair (a Secret volume is
/// updated within about a minute of the Secret; this adds little to that).
const CERT_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// How to try pod-proxier without a cluster, shown whenever none is reachable.
pub const LOCAL_TRIAL_HINT: &str = "\
pod-proxier needs a Kubernetes API server. In a cluster it uses its ServiceAccount; elsewhere \
give --kubeconfig (or KUBECONFIG).
To try it locally with the project's control plane:
  cargo xtask cluster        # starts etcd + kube-apiserver and prints a kubeconfig path
  export KUBECONFIG=<that path>
  cargo run -p pod-proxier -- crd | kubectl apply -f -
  cargo run -p pod-proxier -- --enable-v1 --auth none --plain-http --listen-addr 127.0.0.1 --api-listen-addr 127.0.0.1
(--plain-http and --auth none are for such a trial only; elsewhere serve the API over TLS with \
--tls-cert-file and --tls-key-file.)";

/// The answer over --max-api-connections, in the API's envelope.
const BUSY_BODY: &str =
    r#"{"code":50003,"msg":"too many connections to this API; retry in a second"}"#;

/// Why pod-proxier could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// No usable kubeconfig, or the API server does not answer. The binary prints
    /// [`LOCAL_TRIAL_HINT`] after it.
    #[error("cannot reach a Kubernetes API server")]
    NoCluster(#[source] NoClusterCause),
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
    /// `--peer-selector` is set, but pod-proxier's identity may not watch its peers' Pods.
    #[error(
        "--peer-selector is set, but pod-proxier's identity may not list Pods in namespace \
         {0:?}: bind it to the chart's RBAC rules (pod-proxier/chart/files/rbac-rules.yaml)"
    )]
    PeersForbidden(String),
    /// The API's certificate or key cannot be used.
    #[error("the API's TLS certificate")]
    Tls(#[source] ApiTlsError),
    /// A Kubernetes call failed at start.
    #[error("Kubernetes API call failed at start")]
    Kube(#[source] kube::Error),
    /// The data plane could not start.
    #[error("data plane")]
    DataPlane(#[source] DataPlaneError),
    /// Operations server, signals, leader election.
    #[error(transparent)]
    Framework(#[from] netkit_runtime::Error),
}

/// Why the data plane could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataPlaneError {
    /// proxy-core refused its configuration.
    #[error("starting the embedded proxy")]
    Embedded(#[source] proxy_core::ServerError),
    /// HAProxy cannot be driven.
    #[error("driving HAProxy")]
    Haproxy(#[source] HaproxyError),
    /// A V1 entry port cannot be bound (taken, say).
    #[error("V1 entry port {port}: {message}")]
    EntryPort {
        /// The port.
        port: u16,
        /// What the data plane reported.
        message: String,
    },
}

/// Why the API's TLS set-up failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiTlsError {
    /// The certificate or key files.
    #[error(transparent)]
    Cert(#[from] proxy_core::tls::CertError),
    /// rustls refused the configuration.
    #[error("TLS configuration")]
    Config(#[source] rustls::Error),
}

/// The API over TLS: a tokio-rustls handshake with the reloading certificate.
struct Tls(tokio_rustls::TlsAcceptor);

impl ApiTransport for Tls {
    type Stream = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

    async fn handshake(&self, tcp: tokio::net::TcpStream) -> std::io::Result<Self::Stream> {
        self.0.accept(tcp).await
    }
}

/// The TLS acceptor of `--tls-cert-file`/`--tls-key-file`, its files checked for a new pair
/// every [`CERT_CHECK_INTERVAL`] until `stop`.
fn tls_acceptor(
    files: &crate::settings::ApiTls,
    stop: tokio_util::sync::CancellationToken,
) -> Result<tokio_rustls::TlsAcceptor, ApiTlsError> {
    use proxy_core::tls::ReloadingCert;
    let cert = Arc::new(ReloadingCert::load(&files.cert_file, &files.key_file)?);
    Arc::clone(&cert).watch(CERT_CHECK_INTERVAL, stop);
    let mut config = ReloadingCert::server_config(&cert).map_err(ApiTlsError::Config)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Why no API server could be reached.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NoClusterCause {
    /// No client: no kubeconfig, or an unusable one.
    #[error(transparent)]
    Client(netkit_runtime::Error),
    /// The version request failed.
    #[error(transparent)]
    Kube(kube::Error),
    /// The version request got no answer in time.
    #[error("no answer within {0:?}")]
    Silent(Duration),
}

/// How long the API server has to answer the first request.
const FIRST_ANSWER: Duration = Duration::from_secs(10);

/// A client from `--kubeconfig`, or the usual inference.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, StartError> {
    let client = netkit_runtime::kube_client(kubeconfig)
        .await
        .map_err(|e| StartError::NoCluster(NoClusterCause::Client(e)))?;
    match tokio::time::timeout(FIRST_ANSWER, client.apiserver_version()).await {
        Ok(Ok(_)) => Ok(client),
        Ok(Err(err)) => Err(StartError::NoCluster(NoClusterCause::Kube(err))),
        Err(_) => Err(StartError::NoCluster(NoClusterCause::Silent(FIRST_ANSWER))),
    }
}

/// Runs pod-proxier until SIGTERM/SIGINT.
pub async fn run(settings: Settings) -> Result<(), StartError> {
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    if settings.api.auth == AuthMode::None {
        tracing::warn!(
            "--auth=none: the API is open to anyone who can reach {}; use only for local trials",
            settings.api.addr
        );
    }
    if settings.api.tls.is_none() {
        tracing::warn!(
            "--plain-http: the API at {} is served without TLS, so bearer tokens cross the \
             network in the clear; use only for local trials or behind a TLS-terminating proxy",
            settings.api.addr
        );
    }
    // The certificate first: a bad file stops the start before anything else happens. Its
    // watch ends when `run` returns, whichever way.
    let cert_watch = tokio_util::sync::CancellationToken::new();
    let _stop_cert_watch = cert_watch.clone().drop_guard();
    let tls = match &settings.api.tls {
        Some(files) => Some(tls_acceptor(files, cert_watch).map_err(StartError::Tls)?),
        None => None,
    };
    let settings = Arc::new(settings);
    let client = client(settings.cluster.kubeconfig.as_deref()).await?;
    let api: Api<PortMapping> = Api::namespaced(client.clone(), &settings.cluster.state_namespace);
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 404 => return Err(StartError::CrdMissing),
        Err(kube::Error::Api(status)) if status.code == 403 => {
            return Err(StartError::Forbidden(
                settings.cluster.state_namespace.clone(),
            ));
        }
        Err(err) => return Err(StartError::Kube(err)),
    }
    let peer_pods: Api<Pod> = Api::namespaced(client.clone(), &settings.cluster.state_namespace);
    if let Some(peers) = &settings.cluster.peers {
        let list = ListParams::default().labels(&peers.selector).limit(1);
        match peer_pods.list(&list).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 403 => {
                return Err(StartError::PeersForbidden(
                    settings.cluster.state_namespace.clone(),
                ));
            }
            Err(err) => return Err(StartError::Kube(err)),
        }
    }

    let mut builder = App::builder("pod-proxier", env!("CARGO_PKG_VERSION"));
    let registry = builder.registry();
    let observer = Arc::new(PrometheusObserver::register(registry));
    let metrics = Metrics::register(registry);
    let controller_metrics = ControllerMetrics::register(registry);
    let peers_metrics = PeersMetrics::register(registry);
    let health = builder.health().clone();

    let gated = gated_ports(&settings.policy);
    let plane = match settings.plane.backend {
        BackendKind::Embedded => DataPlane::Embedded(
            EmbeddedPlane::new(
                settings.plane.listen_ip,
                observer,
                settings.plane.health_check,
                settings.plane.drain_timeout,
                settings.plane.data_path,
            )
            .map_err(|e| StartError::DataPlane(DataPlaneError::Embedded(e)))?
            .with_source_checks(gated, metrics.source_refused.clone()),
        ),
        BackendKind::Haproxy => DataPlane::Haproxy(
            HaproxyPlane::connect_waiting(&settings, RUNTIME_API_WAIT)
                .await
                .map_err(|e| StartError::DataPlane(DataPlaneError::Haproxy(e)))?
                .with_source_metric(metrics.source_refused.clone()),
        ),
    };
    let plane = Arc::new(plane);
    if let Some(v1) = &settings.policy.v1 {
        // Bind the V1 entry ports now, so a taken port stops the start instead of a log line.
        let idle: DesiredPorts = v1
            .entry_ports
            .all()
            .into_iter()
            .map(|port| (port, PortRoute::idle()))
            .collect();
        if let Some(error) = plane.sync(&idle).await.into_iter().next() {
            return Err(StartError::DataPlane(DataPlaneError::EntryPort {
                port: error.port,
                message: error.message,
            }));
        }
    }

    // Cancelled by SIGTERM once the app starts below, after the API is bound.
    let shutdown = builder.shutdown().clone();
    let (mappings, sync_task) = spawn_sync_loop(
        api.clone(),
        settings.policy.clone(),
        settings.plane.health_check.is_some(),
        Arc::clone(&plane),
        metrics.clone(),
        health.clone(),
        shutdown.clone(),
    );

    let peers_task = settings.cluster.peers.clone().map(|peers| {
        tokio::spawn(crate::peers::run(
            peer_pods,
            peers,
            settings.cluster.identity.clone(),
            peers_metrics,
            shutdown.clone(),
        ))
    });

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
        auth: match settings.api.auth {
            AuthMode::None => Authenticator::allow_all("anonymous (--auth=none)"),
            AuthMode::Kubernetes => Authenticator::new(client.clone()),
        },
        v1: settings.policy.v1.clone().map(|policy| {
            V1::new(
                policy,
                settings.cluster.state_namespace.clone(),
                client.clone(),
                api.clone(),
                mappings.clone(),
            )
        }),
        mappings,
        metrics,
    });
    let listener = rest::bind_api(settings.api.addr).await?;
    let limits = ApiLimits {
        header_read_timeout: settings.api.header_read_timeout,
        max_connections: settings.api.max_connections,
        busy_body: BUSY_BODY,
        drain_timeout: settings.api.request_timeout,
    };
    let api_task = match tls {
        Some(acceptor) => tokio::spawn(rest::serve_api_with(
            listener,
            router(state),
            limits,
            shutdown.clone(),
            Tls(acceptor),
        )),
        None => tokio::spawn(rest::serve_api_with(
            listener,
            router(state),
            limits,
            shutdown.clone(),
            rest::PlainHttp,
        )),
    };
    let metrics_access = settings.metrics.access(&client)?;
    let app = builder
        .serve_health([settings.health_addr])
        .serve_metrics([settings.metrics_addr], metrics_access)
        .start()
        .await?;
    let policy = &settings.policy;
    tracing::info!(
        api = %settings.api.addr,
        tls = settings.api.tls.is_some(),
        health = %settings.health_addr,
        metrics = %settings.metrics_addr,
        metrics_secure = settings.metrics.metrics_secure,
        v1 = policy.v1.is_some(),
        v2 = policy.v2.is_some(),
        v1_entry_ports = ?policy.v1.as_ref().map(|v1| v1.entry_ports.to_string()),
        entry_access = ?policy.entry_access,
        range = ?policy.v2.as_ref().map(|v2| v2.port_range.to_string()),
        backend = ?settings.plane.backend,
        "pod-proxier started"
    );

    shutdown.cancelled().await;
    let drain = settings.plane.drain_timeout;
    tracing::info!(?drain, "shutting down: API closed, draining connections");
    let _ = api_task.await;
    let _ = leader_task.await;
    let _ = sync_task.await;
    if let Some(task) = peers_task {
        let _ = task.await;
    }
    plane.shutdown(drain).await;
    app.finish().await;
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
    let cluster = &settings.cluster;
    let lease = LeaseConfig::new(
        cluster.state_namespace.clone(),
        cluster.lease_name.clone(),
        cluster.identity.clone(),
    );
    let client = inputs.client.clone();
    run_while_leading(client, lease, &leadership, shutdown, move |stop| {
        let sweep = sweep_expired(inputs.api.clone(), inputs.mappings.clone(), stop.clone());
        let v2 = settings
            .policy
            .v2
            .clone()
            .map(|policy| V2Reconciler::new(inputs.clone(), policy));
        let identity = settings.cluster.identity.clone();
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
