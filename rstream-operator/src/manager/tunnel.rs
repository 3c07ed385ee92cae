//! The RstreamTunnel controller: validate, resolve the connection and the Service, render the agent
//! configuration, apply the children and report the conditions.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_reconcile::cache::Caches;
use k8s_reconcile::conditions::Conditions;
use k8s_reconcile::{Action, Context, Reconciler};
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams};
use rstream_client::tunnel::generate_stable_hostname;

use super::ManagerError;
use super::children::{self, AgentLayout, ChildContext};
use super::resolve::{ResolveError, Resolved, resolve_by_name};
use crate::agent_config::{
    AgentConfig, ConnectionConfig, KubernetesConfig, MtlsFiles, ProxyConfig, RetryConfig,
    TargetConfig, TransportConfig, TunnelConfig,
};
use crate::api::{
    HttpVersion, RstreamTunnel, RstreamTunnelSpec, RstreamTunnelStatus, TunnelProtocol, TunnelType,
};
use crate::names;
use crate::status::{self, messages, reasons, types};

/// Retry delay of a tunnel blocked on its connection (the control plane may be back soon).
const RETRY_BLOCKED: Duration = Duration::from_secs(60);

/// Reconciles RstreamTunnels.
#[derive(Debug, Clone)]
pub struct TunnelReconciler {
    /// Default agent image.
    pub agent_image: String,
    /// Image pull Secrets of every agent Pod.
    pub agent_image_pull_secrets: Vec<String>,
    /// The RstreamConnections the manager watches, read instead of the API server once synced.
    pub connections: Caches,
}

/// A state that stops the reconcile before the children are applied.
struct Blocked {
    accepted: Option<(&'static str, String)>,
    resolved: Option<(&'static str, String)>,
    reason: &'static str,
    message: String,
}

/// The Service port the tunnel forwards to.
struct ResolvedTarget {
    host: String,
    port: i32,
    protocol: String,
}

impl ResolvedTarget {
    fn display(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// Builds the tunnel part of the agent configuration and checks it with the client rules
/// ([`TunnelConfig::options`]), once per reconcile. Its hostname is the spec's; a generated one
/// (`choose_hostname`) is set later, once the engine is known.
pub fn tunnel_config(tunnel: &RstreamTunnel) -> Result<TunnelConfig, String> {
    let spec = &tunnel.spec;
    let namespace = tunnel.namespace().unwrap_or_default();
    let name = tunnel.name_any();
    let protocol = spec.protocol();
    let mut labels = spec.labels.clone().unwrap_or_default();
    labels.insert("rstream.managed-by".into(), "kubernetes-operator".into());
    labels.insert("rstream.source".into(), "kubernetes".into());
    labels.insert("rstream.kubernetes.namespace".into(), namespace.clone());
    labels.insert("rstream.kubernetes.name".into(), name.clone());
    if let Some(uid) = tunnel.uid() {
        labels.insert("rstream.kubernetes.uid".into(), uid);
    }
    if protocol == TunnelProtocol::Tcp && spec.datagram_guaranteed_delivery == Some(true) {
        return Err("protocol tcp forbids datagramGuaranteedDelivery".into());
    }
    let config = TunnelConfig {
        name: spec
            .tunnel_name
            .as_deref()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| names::default_tunnel_name(&namespace, &name)),
        publish: spec.publish.unwrap_or(true),
        protocol,
        type_: spec.tunnel_type(),
        hostname: requested_hostname(spec),
        labels,
        datagram_guaranteed_delivery: spec.datagram_guaranteed_delivery,
        allow_cross_region_routing: spec.allow_cross_region_routing,
        tcp_port: spec.tcp_port.and_then(|p| u32::try_from(p).ok()),
        upstream_tls: spec.upstream_tls,
        trusted_ips: spec.trusted_ips.clone().unwrap_or_default(),
        geoip: spec.geoip.clone().unwrap_or_default(),
        // The CRD's own blocks; the version and ALPNs written as the agent reads them.
        http: spec.http.clone().map(|mut h| {
            h.version.get_or_insert(HttpVersion::Http11);
            h
        }),
        tls: spec.tls.clone().map(|mut t| {
            t.alpns = t.alpns.filter(|a| !a.is_empty());
            t
        }),
    };
    // The client rules (private tunnels take no public option, datagram support...) decide.
    config.options().map_err(|e| e.to_string())?;
    Ok(config)
}

/// Renders the whole agent configuration.
fn agent_config(
    tunnel: &RstreamTunnel,
    resolved: &Resolved,
    target: &ResolvedTarget,
    tunnel_part: TunnelConfig,
) -> AgentConfig {
    let cspec = &resolved.connection.spec;
    let mtls = cspec.mtls.as_ref().map(|m| MtlsFiles {
        cert_file: format!("{}/tls.crt", names::MTLS_DIR),
        key_file: format!("{}/tls.key", names::MTLS_DIR),
        ca_file: m
            .ca_secret_ref
            .as_ref()
            .map(|_| format!("{}/ca.crt", names::MTLS_DIR)),
    });
    let transport = cspec.transport.as_ref().map(|t| TransportConfig {
        mode: t.mode,
        bind: t.bind.clone(),
        ip_family: t.ip_family,
        dns: t.dns.clone(),
        mptcp: t.mptcp,
        proxy: t.proxy.as_ref().map(|p| ProxyConfig {
            http: p.http.clone(),
            username_env: p
                .username_secret_ref
                .as_ref()
                .map(|_| names::PROXY_USERNAME_ENV.to_owned()),
            password_env: p
                .password_secret_ref
                .as_ref()
                .map(|_| names::PROXY_PASSWORD_ENV.to_owned()),
            headers: p.headers.clone(),
        }),
        use_quic: t.use_quic,
        heartbeat_interval_seconds: t.heartbeat_interval_seconds,
    });
    AgentConfig {
        connection: ConnectionConfig {
            engine: resolved.engine.to_string(),
            ca_file: cspec
                .ca_secret_ref
                .as_ref()
                .map(|_| format!("{}/ca.crt", names::ENGINE_CA_DIR)),
            mtls,
            transport,
        },
        tunnel: tunnel_part,
        target: TargetConfig {
            host: target.host.clone(),
            port: target.port.to_string(),
            protocol: target.protocol.clone(),
        },
        kubernetes: Some(KubernetesConfig {
            enabled: true,
            namespace: tunnel.namespace().unwrap_or_default(),
            tunnel_name: tunnel.name_any(),
            pod_name_env: Some(names::POD_NAME_ENV.to_owned()),
            pod_namespace_env: Some(names::POD_NAMESPACE_ENV.to_owned()),
        }),
        retry: Some(RetryConfig {
            initial: Some("1s".into()),
            max: Some("30s".into()),
        }),
    }
}

/// Finds the Service port the tunnel targets; checks its protocol.
async fn resolve_target(
    ctx: &Context,
    tunnel: &RstreamTunnel,
) -> Result<Result<ResolvedTarget, Blocked>, kube::Error> {
    let spec = &tunnel.spec;
    let svc = &spec.target.service;
    let namespace = svc
        .namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| tunnel.namespace().unwrap_or_default());
    let api: Api<Service> = Api::namespaced(ctx.client().clone(), &namespace);
    let blocked = |reason: &'static str, message: String| Blocked {
        accepted: None,
        resolved: Some((reason, message.clone())),
        reason,
        message,
    };
    // From the watch cache of Services once synced: a resync reads nothing.
    let Some(service) = ctx
        .caches()
        .get_or_read(&api, &namespace, &svc.name)
        .await?
    else {
        return Ok(Err(blocked(
            reasons::SERVICE_MISSING,
            format!("Service {namespace}/{} not found", svc.name),
        )));
    };
    let ports = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.clone())
        .unwrap_or_default();
    let found = ports.iter().find(|p| match &svc.port {
        IntOrString::Int(n) => p.port == *n,
        IntOrString::String(s) => p.name.as_deref() == Some(s.as_str()) || s == &p.port.to_string(),
    });
    let port_text = match &svc.port {
        IntOrString::Int(n) => n.to_string(),
        IntOrString::String(s) => s.clone(),
    };
    let Some(port) = found else {
        return Ok(Err(blocked(
            reasons::SERVICE_PORT_MISSING,
            format!("Service {namespace}/{} has no port {port_text}", svc.name),
        )));
    };
    let expected = if spec.tunnel_type() == TunnelType::Datagram {
        "UDP"
    } else {
        "TCP"
    };
    let actual = port
        .protocol
        .clone()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "TCP".into());
    if actual != expected {
        return Ok(Err(blocked(
            reasons::SERVICE_PORT_MISSING,
            format!(
                "Service {namespace}/{} port {port_text} is {actual}, the tunnel needs {expected}",
                svc.name
            ),
        )));
    }
    Ok(Ok(ResolvedTarget {
        host: format!("{}.{namespace}.svc", svc.name),
        port: port.port,
        protocol: expected.to_owned(),
    }))
}

/// Whether the tunnel requests a hostname at all: not when private or TCP.
fn takes_hostname(spec: &RstreamTunnelSpec) -> bool {
    spec.publish != Some(false) && spec.protocol() != TunnelProtocol::Tcp
}

/// The spec's hostname, when the tunnel takes one.
fn requested_hostname(spec: &RstreamTunnelSpec) -> Option<String> {
    let hostname = spec.hostname.as_deref().map(str::trim);
    hostname
        .filter(|h| !h.is_empty() && takes_hostname(spec))
        .map(str::to_owned)
}

/// The hostname to request: none for private or TCP tunnels; the spec's; a stable one generated
/// earlier for this engine; or a new one (both valid DNS names by construction).
fn choose_hostname(
    spec: &RstreamTunnelSpec,
    status: Option<&RstreamTunnelStatus>,
    engine_host: &str,
) -> Option<String> {
    if !takes_hostname(spec) {
        return None;
    }
    if let Some(h) = requested_hostname(spec) {
        return Some(h);
    }
    // Reuse only a hostname generated for this engine: the agent also writes the engine's answer
    // (e.g. an IP) into status.hostname, which must not become a requested hostname.
    let (endpoint, domain) = engine_host.split_once('.')?;
    let suffix = format!("-{endpoint}.t.{domain}");
    if let Some(existing) = status
        .and_then(|s| s.hostname.as_deref())
        .filter(|h| h.ends_with(&suffix))
    {
        return Some(existing.to_owned());
    }
    generate_stable_hostname(engine_host)
}

fn child_context(tunnel: &RstreamTunnel) -> ChildContext {
    let namespace = tunnel.namespace().unwrap_or_default();
    let name = tunnel.name_any();
    let uid = tunnel.uid();
    ChildContext {
        base: names::base_name(&namespace, &name, uid.as_deref()),
        namespace,
        tunnel: name,
        uid,
        owner: k8s_reconcile::apply::controller_owner_ref(tunnel),
    }
}

impl TunnelReconciler {
    async fn write_blocked(
        &self,
        api: &Api<RstreamTunnel>,
        tunnel: &RstreamTunnel,
        blocked: &Blocked,
    ) -> Result<(), ManagerError> {
        let generation = tunnel.metadata.generation;
        status::update_status_from(api, tunnel, |_, s: &mut RstreamTunnelStatus| {
            s.observed_generation = generation;
            s.last_error = Some(blocked.message.clone());
            let mut c = Conditions::of(&mut s.conditions, generation);
            match &blocked.accepted {
                Some((reason, message)) => c.set(types::ACCEPTED, false, reason, message.clone()),
                None => c.set(
                    types::ACCEPTED,
                    true,
                    reasons::ACCEPTED,
                    messages::SPEC_VALID,
                ),
            };
            if let Some((reason, message)) = &blocked.resolved {
                c.set(types::RESOLVED, false, reason, message.clone());
            }
            c.set(types::READY, false, blocked.reason, blocked.message.clone());
        })
        .await?;
        Ok(())
    }
}

impl Reconciler for TunnelReconciler {
    type Resource = RstreamTunnel;
    type Error = ManagerError;

    fn finalizer(&self) -> Option<&str> {
        Some(names::FINALIZER)
    }

    async fn reconcile(
        &self,
        tunnel: Arc<RstreamTunnel>,
        ctx: &Context,
    ) -> Result<Action, ManagerError> {
        let namespace = tunnel.namespace().unwrap_or_default();
        let name = tunnel.name_any();
        let generation = tunnel.metadata.generation;
        let api: Api<RstreamTunnel> = Api::namespaced(ctx.client().clone(), &namespace);

        // 1. The spec, beyond what the schema checks: the agent's tunnel, checked once.
        let mut tunnel_part = match tunnel_config(&tunnel) {
            Ok(config) => config,
            Err(message) => {
                let message = format!("invalid spec: {message}");
                let blocked = Blocked {
                    accepted: Some((reasons::INVALID_SPEC, message.clone())),
                    resolved: None,
                    reason: reasons::INVALID_SPEC,
                    message,
                };
                self.write_blocked(&api, &tunnel, &blocked).await?;
                return Ok(Action::Done);
            }
        };

        // 2. The connection and its Secrets; the engine.
        let resolved = match resolve_by_name(
            ctx.client(),
            &self.connections,
            &namespace,
            tunnel.spec.connection_name(),
        )
        .await
        {
            Ok(r) => r,
            Err(ResolveError::Kube(e)) => return Err(e.into()),
            Err(e) => {
                let message = format!("connection {}: {e}", tunnel.spec.connection_name());
                // Resolved also names what is missing (Secret, connection); resolution errors of
                // an existing connection leave it as it was.
                let resolved = match &e {
                    ResolveError::SecretMissing(_) => {
                        Some((reasons::SECRET_MISSING, message.clone()))
                    }
                    ResolveError::ConnectionNotFound(_) => {
                        Some((reasons::CONNECTION_MISSING, message.clone()))
                    }
                    _ => None,
                };
                // A connection asking for what no agent can do makes the tunnel's spec unusable.
                let reason = match &e {
                    ResolveError::InvalidSpec(_) => reasons::INVALID_SPEC,
                    _ => reasons::CONNECTION_MISSING,
                };
                let blocked = Blocked {
                    accepted: Some((reason, message.clone())),
                    resolved,
                    reason,
                    message,
                };
                self.write_blocked(&api, &tunnel, &blocked).await?;
                return Ok(Action::RequeueAfter(RETRY_BLOCKED));
            }
        };

        // 3. The target Service and port.
        let target = match resolve_target(ctx, &tunnel).await? {
            Ok(t) => t,
            Err(blocked) => {
                self.write_blocked(&api, &tunnel, &blocked).await?;
                return Ok(Action::Done);
            }
        };

        // 4. The hostname, recorded at once so that it stays stable whatever happens next.
        let hostname =
            choose_hostname(&tunnel.spec, tunnel.status.as_ref(), resolved.engine.host());
        if let Some(h) = &hostname
            && tunnel.status.as_ref().and_then(|s| s.hostname.as_ref()) != Some(h)
        {
            status::update_status(&api, &name, |_, s: &mut RstreamTunnelStatus| {
                s.hostname = Some(h.clone());
            })
            .await?;
        }
        tunnel_part.hostname.clone_from(&hostname);
        let rstream_name = tunnel_part.name.clone();
        let config = agent_config(&tunnel, &resolved, &target, tunnel_part);
        let yaml = config
            .to_yaml()
            .map_err(|e| ManagerError::Render(e.to_string()))?;
        let hash = children::config_hash(&yaml, &resolved.agent_secret_versions);

        // 5. The children, each owned by the tunnel.
        let cx = child_context(&tunnel);
        let layout = AgentLayout::of(&tunnel.spec, hostname.is_some());
        let applier = ctx.applier();
        let budgets: Api<PodDisruptionBudget> = Api::namespaced(ctx.client().clone(), &namespace);
        let applied = async {
            applier.apply(&children::configmap(&cx, &yaml)).await?;
            applier.apply(&children::service_account(&cx)).await?;
            applier.apply(&children::role(&cx)).await?;
            applier.apply(&children::role_binding(&cx)).await?;
            if layout.disruption_budget() {
                applier.apply(&children::disruption_budget(&cx)).await?;
            } else if ctx
                .caches()
                .get_or_read(&budgets, &namespace, &cx.base)
                .await
                .map_err(k8s_reconcile::Error::Kube)?
                .is_some()
            {
                // Down to one agent: a budget of one would block every drain.
                delete::<PodDisruptionBudget>(ctx.client(), &namespace, &cx.base)
                    .await
                    .map_err(k8s_reconcile::Error::Kube)?;
            }
            applier
                .apply(&children::deployment(
                    &cx,
                    &tunnel.spec,
                    layout,
                    &resolved.connection,
                    &self.agent_image,
                    &self.agent_image_pull_secrets,
                    &hash,
                ))
                .await
        }
        .await;
        let deployment = match applied {
            Ok(deployment) => deployment.into_inner(),
            Err(err) => {
                // Said where users look (a lost RBAC verb names itself here), once per retry
                // of the controller's backoff; the status is written only when it changes.
                let blocked = Blocked {
                    accepted: None,
                    resolved: None,
                    reason: reasons::CHILDREN_NOT_APPLIED,
                    message: format!("applying the agent's objects: {err}"),
                };
                self.write_blocked(&api, &tunnel, &blocked).await?;
                return Err(err.into());
            }
        };

        // 6. Conditions.
        let dstatus = deployment.status.clone().unwrap_or_default();
        let agent_ready = dstatus.available_replicas.unwrap_or(0) >= 1
            && dstatus.ready_replicas.unwrap_or(0) >= 1;
        let target_text = target.display();
        // Compared with the reconciled object first: a steady state costs no request.
        status::update_status_from(&api, &tunnel, |_, s: &mut RstreamTunnelStatus| {
            s.observed_generation = generation;
            s.agent_deployment = Some(cx.base.clone());
            s.target = Some(target_text.clone());
            s.rstream_name = Some(rstream_name.clone());
            if let Some(h) = &hostname {
                s.hostname = Some(h.clone());
            }
            let mut c = Conditions::of(&mut s.conditions, generation);
            c.set(
                types::ACCEPTED,
                true,
                reasons::ACCEPTED,
                messages::SPEC_VALID,
            )
            .set(types::RESOLVED, true, reasons::RESOLVED, messages::RESOLVED);
            if agent_ready {
                c.set(
                    types::AGENT_READY,
                    true,
                    reasons::DEPLOYMENT_AVAILABLE,
                    messages::AGENT_AVAILABLE,
                );
            } else {
                c.set(
                    types::AGENT_READY,
                    false,
                    reasons::DEPLOYMENT_PENDING,
                    messages::AGENT_PENDING,
                );
                if c.find(types::TUNNEL_READY).is_none() {
                    c.set(
                        types::TUNNEL_READY,
                        false,
                        reasons::TUNNEL_CONNECTING,
                        messages::CONNECTING,
                    );
                }
            }
            let tunnel_ready = c.is_true(types::TUNNEL_READY);
            let disconnected = c
                .find(types::TUNNEL_READY)
                .is_some_and(|t| t.reason == reasons::TUNNEL_DISCONNECTED);
            let (ready, reason, message) = match (agent_ready, tunnel_ready, disconnected) {
                (false, _, _) => (
                    false,
                    reasons::WAITING_FOR_DEPLOYMENT,
                    messages::AGENT_PENDING,
                ),
                (true, true, _) => (true, reasons::READY, messages::READY),
                (true, false, true) => (false, reasons::WAITING_FOR_TUNNEL, messages::RECONNECTING),
                (true, false, false) => (
                    false,
                    reasons::WAITING_FOR_TUNNEL,
                    messages::WAITING_FOR_TUNNEL,
                ),
            };
            c.set(types::READY, ready, reason, message);
            // The agent's own error stays visible while it reconnects; ours are cleared.
            if !disconnected {
                s.last_error = None;
            }
        })
        .await?;
        Ok(Action::Done)
    }

    async fn cleanup(
        &self,
        tunnel: Arc<RstreamTunnel>,
        ctx: &Context,
    ) -> Result<Action, ManagerError> {
        let namespace = tunnel.namespace().unwrap_or_default();
        let generation = tunnel.metadata.generation;
        let api: Api<RstreamTunnel> = Api::namespaced(ctx.client().clone(), &namespace);
        status::update_status(
            &api,
            &tunnel.name_any(),
            |_, s: &mut RstreamTunnelStatus| {
                Conditions::of(&mut s.conditions, generation).set(
                    types::READY,
                    false,
                    reasons::FINALIZING,
                    messages::FINALIZING,
                );
            },
        )
        .await?;
        // No garbage collector is assumed: the children are deleted here, agent first.
        let cx = child_context(&tunnel);
        let client = ctx.client().clone();
        delete::<Deployment>(&client, &namespace, &cx.base).await?;
        delete::<PodDisruptionBudget>(&client, &namespace, &cx.base).await?;
        delete::<ConfigMap>(&client, &namespace, &cx.configmap_name()).await?;
        delete::<RoleBinding>(&client, &namespace, &cx.base).await?;
        delete::<Role>(&client, &namespace, &cx.base).await?;
        delete::<ServiceAccount>(&client, &namespace, &cx.base).await?;
        Ok(Action::Done)
    }
}

async fn delete<K>(client: &kube::Client, namespace: &str, name: &str) -> Result<(), kube::Error>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    match api.delete(name, &DeleteParams::background()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Labels the operator puts on the tunnel's children (for owned watches).
pub fn managed_selector() -> String {
    format!("app.kubernetes.io/managed-by={}", names::MANAGED_BY)
}
