//! The manager: the RstreamConnection and RstreamTunnel controllers, with the watches that make a
//! change of a Secret, Service or connection re-reconcile what depends on it, and the Service
//! controller that gives Services of the operator's load balancer class a tunnel ([`service`]).
//! Secrets are read by name and watched one by one, only those the connections name
//! ([`secrets`]).

pub mod children;
pub mod connection;
pub mod resolve;
pub mod secrets;
pub mod service;
pub mod tunnel;

use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_reconcile::ControllerBuilder;
use k8s_reconcile::cache::Caches;
use k8s_reconcile::leader::LeaseConfig;
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use k8s_reconcile::watch_set::spawn_store;
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, ResourceExt as _};
use tokio_util::sync::CancellationToken;

use crate::api::{RstreamConnection, RstreamTunnel};

pub use connection::ConnectionReconciler;
pub use service::ServiceReconciler;
pub use tunnel::TunnelReconciler;

/// Errors of a reconcile (retried with backoff).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// A Kubernetes API call failed.
    #[error(transparent)]
    Kube(#[from] kube::Error),
    /// The framework (apply, finalizer) failed.
    #[error(transparent)]
    Framework(#[from] k8s_reconcile::Error),
    /// The agent configuration could not be rendered.
    #[error("rendering the agent configuration: {0}")]
    Render(String),
}

/// Name of the tunnel controller (metrics, field manager).
pub const TUNNEL_CONTROLLER: &str = "rstreamtunnel";
/// Name of the connection controller.
pub const CONNECTION_CONTROLLER: &str = "rstreamconnection";
/// Server-side-apply field manager of the children.
pub const FIELD_MANAGER: &str = "rstream-operator";
/// Lease of the original operator (the tunnel controller); the connection controller uses
/// `<lease>-connections`.
pub const LEASE_NAME: &str = "rstream-operator.tunnels.rstream.io";

/// How the manager runs.
#[derive(Clone, Debug)]
pub struct ManagerOptions {
    /// Default agent image.
    pub agent_image: String,
    /// Image pull Secrets of every agent Pod.
    pub agent_image_pull_secrets: Vec<String>,
    /// Namespace and identity of the Leases, when leader election is on.
    pub leader_election: Option<(String, String)>,
    /// Resync period.
    pub resync: Duration,
    /// Concurrent reconciles per controller.
    pub concurrency: u16,
    /// Watch only this namespace (tunnels, connections, Services, children; the Secrets the
    /// connections name are in their namespaces); `None` watches the whole cluster, which
    /// cross-namespace Service targets need.
    pub namespace: Option<String>,
    /// Services of type LoadBalancer with this `spec.loadBalancerClass` get a tunnel
    /// ([`service`]); `None` turns that controller off.
    pub load_balancer_class: Option<String>,
}

fn api<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

fn tunnels_targeting(store: &Store<RstreamTunnel>, svc: &Service) -> Vec<ObjectRef<RstreamTunnel>> {
    let (name, namespace) = (svc.name_any(), svc.namespace().unwrap_or_default());
    store
        .state()
        .iter()
        .filter(|t| {
            let target = &t.spec.target.service;
            let tns = target
                .namespace
                .clone()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| t.namespace().unwrap_or_default());
            target.name == name && tns == namespace
        })
        .map(|t| ObjectRef::from_obj(t.as_ref()))
        .collect()
}

fn tunnels_using(
    store: &Store<RstreamTunnel>,
    namespace: &str,
    connection: &str,
) -> Vec<ObjectRef<RstreamTunnel>> {
    store
        .state()
        .iter()
        .filter(|t| {
            t.namespace().as_deref() == Some(namespace) && t.spec.connection_name() == connection
        })
        .map(|t| ObjectRef::from_obj(t.as_ref()))
        .collect()
}

/// Whether `connection` reads Secret `name` (in its namespace).
pub fn references_secret(connection: &RstreamConnection, name: &str) -> bool {
    secrets::secret_names(connection).contains(name)
}

fn connections_reading(
    store: &Store<RstreamConnection>,
    secret: &secrets::SecretKey,
) -> Vec<std::sync::Arc<RstreamConnection>> {
    store
        .state()
        .into_iter()
        .filter(|c| {
            c.namespace().as_deref() == Some(secret.namespace.as_str())
                && references_secret(c, &secret.name)
        })
        .collect()
}

/// Runs the controllers until `shutdown`; `health` gets their readiness checks.
pub async fn run(
    client: Client,
    options: ManagerOptions,
    health: Health,
    metrics: ControllerMetrics,
    shutdown: CancellationToken,
) -> Result<(), ManagerError> {
    let ns = options.namespace.as_deref();
    let all = watcher::Config::default;
    let tunnels = spawn_store(api::<RstreamTunnel>(&client, ns), all(), shutdown.clone());
    // The connections' store also decides which Secrets are watched (each by its name).
    let secret_changes = secrets::SecretChanges::default();
    let connections = secrets::spawn(
        client.clone(),
        api::<RstreamConnection>(&client, ns),
        secret_changes.clone(),
        shutdown.clone(),
    );
    let owned = watcher::Config::default().labels(&tunnel::managed_selector());

    let mut tunnel_controller = ControllerBuilder::new(
        client.clone(),
        TUNNEL_CONTROLLER,
        TunnelReconciler {
            agent_image: options.agent_image.clone(),
            agent_image_pull_secrets: options.agent_image_pull_secrets.clone(),
            connections: {
                let mut cached = Caches::new();
                cached.insert(connections.clone());
                cached
            },
        },
    )
    .field_manager(FIELD_MANAGER)
    .resync(options.resync)
    .concurrency(options.concurrency)
    .health(health.scoped("tunnels"))
    .metrics(metrics.clone())
    .owns(api::<Deployment>(&client, ns), owned.clone())
    .owns(api::<PodDisruptionBudget>(&client, ns), owned.clone())
    .owns(api::<ConfigMap>(&client, ns), owned.clone())
    .owns(api::<ServiceAccount>(&client, ns), owned.clone())
    .owns(api::<Role>(&client, ns), owned.clone())
    .owns(api::<RoleBinding>(&client, ns), owned)
    .watches(api::<Service>(&client, ns), watcher::Config::default(), {
        let tunnels = tunnels.clone();
        move |svc: Service| tunnels_targeting(&tunnels, &svc)
    })
    .watches(
        api::<RstreamConnection>(&client, ns),
        watcher::Config::default(),
        {
            let tunnels = tunnels.clone();
            move |c: RstreamConnection| {
                tunnels_using(&tunnels, &c.namespace().unwrap_or_default(), &c.name_any())
            }
        },
    )
    .reconcile_on({
        let (changes, tunnels, connections) =
            (secret_changes.clone(), tunnels.clone(), connections.clone());
        move || {
            let (tunnels, connections) = (tunnels.clone(), connections.clone());
            changes.subscribe().flat_map(move |secret| {
                futures::stream::iter(
                    connections_reading(&connections, &secret)
                        .iter()
                        .flat_map(|c| {
                            tunnels_using(
                                &tunnels,
                                &c.namespace().unwrap_or_default(),
                                &c.name_any(),
                            )
                        })
                        .collect::<Vec<_>>(),
                )
            })
        }
    });

    let mut connection_controller =
        ControllerBuilder::new(client.clone(), CONNECTION_CONTROLLER, ConnectionReconciler)
            .field_manager(FIELD_MANAGER)
            .resync(options.resync)
            .concurrency(options.concurrency)
            .health(health.scoped("connections"))
            .metrics(metrics.clone())
            .reconcile_on({
                let (changes, connections) = (secret_changes.clone(), connections.clone());
                move || {
                    let connections = connections.clone();
                    changes.subscribe().flat_map(move |secret| {
                        futures::stream::iter(
                            connections_reading(&connections, &secret)
                                .iter()
                                .map(|c| ObjectRef::from_obj(c.as_ref()))
                                .collect::<Vec<_>>(),
                        )
                    })
                }
            });

    let mut service_controller = options.load_balancer_class.clone().map(|class| {
        ControllerBuilder::new(
            client.clone(),
            service::SERVICE_CONTROLLER,
            ServiceReconciler {
                class,
                tunnels: tunnels.clone(),
            },
        )
        .field_manager(FIELD_MANAGER)
        .resync(options.resync)
        .concurrency(options.concurrency)
        .health(health.scoped("services"))
        .metrics(metrics.clone())
        .owns(
            api::<RstreamTunnel>(&client, ns),
            watcher::Config::default().labels(service::SERVICE_LABEL),
        )
    });
    if let Some(ns) = ns {
        tunnel_controller = tunnel_controller.namespaced(ns);
        connection_controller = connection_controller.namespaced(ns);
        service_controller = service_controller.map(|c| c.namespaced(ns));
    }
    if let Some((namespace, identity)) = &options.leader_election {
        tunnel_controller =
            tunnel_controller.leader_election(LeaseConfig::new(namespace, LEASE_NAME, identity));
        connection_controller = connection_controller.leader_election(LeaseConfig::new(
            namespace,
            format!("{LEASE_NAME}-connections"),
            identity,
        ));
        service_controller = service_controller.map(|c| {
            c.leader_election(LeaseConfig::new(
                namespace,
                format!("{LEASE_NAME}-services"),
                identity,
            ))
        });
    }
    let services = async {
        match service_controller {
            Some(controller) => controller.run(shutdown.clone()).await,
            None => Ok(()),
        }
    };
    let (a, b, c) = tokio::join!(
        tunnel_controller.run(shutdown.clone()),
        connection_controller.run(shutdown.clone()),
        services
    );
    shutdown.cancel();
    a?;
    b?;
    c?;
    Ok(())
}
