//! The objects created per RstreamTunnel: ConfigMap, ServiceAccount, Role, RoleBinding, Deployment
//! and, when several agents run, a PodDisruptionBudget.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment,
};
use k8s_openapi::api::core::v1::{
    Affinity, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, KeyToPath,
    LocalObjectReference, PodAffinityTerm, PodAntiAffinity, PodSpec, PodTemplateSpec, Probe,
    ProjectedVolumeSource, ResourceRequirements, ServiceAccount, Volume, VolumeMount,
    VolumeProjection, WeightedPodAffinityTerm,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_reconcile::pod;
use kube::api::ObjectMeta;
use sha2::{Digest as _, Sha256};

use crate::api::{RstreamConnection, RstreamTunnelSpec, SecretKeyRef};
use crate::names;

/// Agent health port.
pub const HEALTH_PORT: i32 = 8081;

/// What every child shares.
#[derive(Clone, Debug)]
pub struct ChildContext {
    /// Base name.
    pub base: String,
    /// Namespace.
    pub namespace: String,
    /// Tunnel name.
    pub tunnel: String,
    /// Tunnel UID.
    pub uid: Option<String>,
    /// Controller owner reference to the tunnel.
    pub owner: Option<OwnerReference>,
}

impl ChildContext {
    fn meta(&self, name: String, component: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels(component)),
            owner_references: self.owner.clone().map(|o| vec![o]),
            ..ObjectMeta::default()
        }
    }

    /// Labels of a child of `component`.
    pub fn labels(&self, component: &str) -> BTreeMap<String, String> {
        names::child_labels(
            &self.base,
            component,
            &self.namespace,
            &self.tunnel,
            self.uid.as_deref(),
        )
    }

    /// ConfigMap name.
    pub fn configmap_name(&self) -> String {
        format!("{}-config", self.base)
    }
}

/// The agent ConfigMap.
pub fn configmap(cx: &ChildContext, config_yaml: &str) -> ConfigMap {
    ConfigMap {
        metadata: cx.meta(cx.configmap_name(), "config"),
        data: Some(BTreeMap::from([(
            names::CONFIG_KEY.to_owned(),
            config_yaml.to_owned(),
        )])),
        ..ConfigMap::default()
    }
}

/// The agent ServiceAccount.
pub fn service_account(cx: &ChildContext) -> ServiceAccount {
    ServiceAccount {
        metadata: cx.meta(cx.base.clone(), "agent-rbac"),
        ..ServiceAccount::default()
    }
}

/// The agent Role: its own RstreamTunnel only.
pub fn role(cx: &ChildContext) -> Role {
    let rule = |resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![crate::api::GROUP.to_owned()]),
        resources: Some(vec![resource.to_owned()]),
        resource_names: Some(vec![cx.tunnel.clone()]),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..PolicyRule::default()
    };
    Role {
        metadata: cx.meta(cx.base.clone(), "agent-rbac"),
        rules: Some(vec![
            rule("rstreamtunnels", &["get"]),
            rule("rstreamtunnels/status", &["get", "patch", "update"]),
        ]),
    }
}

/// The agent RoleBinding.
pub fn role_binding(cx: &ChildContext) -> RoleBinding {
    RoleBinding {
        metadata: cx.meta(cx.base.clone(), "agent-rbac"),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "Role".to_owned(),
            name: cx.base.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: cx.base.clone(),
            namespace: Some(cx.namespace.clone()),
            ..Subject::default()
        }]),
    }
}

/// First 16 hex digits of SHA-256 over the config and each agent Secret `name:resourceVersion`,
/// each followed by a NUL byte (as the original operator computes it).
pub fn config_hash(config_yaml: &str, secret_versions: &[String]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(config_yaml.as_bytes());
    hasher.update([0u8]);
    for v in secret_versions {
        hasher.update(v.as_bytes());
        hasher.update([0u8]);
    }
    let mut hex = hex::encode(hasher.finalize());
    hex.truncate(16);
    hex
}

fn default_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("25m".to_owned())),
            ("memory".to_owned(), Quantity("64Mi".to_owned())),
        ])),
        limits: Some(BTreeMap::from([(
            "memory".to_owned(),
            Quantity("256Mi".to_owned()),
        )])),
        ..ResourceRequirements::default()
    }
}

/// The agent Pods' image pull Secrets: the connection's own list when it sets one (empty: none),
/// else the manager's.
fn pull_secrets(
    connection: &RstreamConnection,
    manager: &[String],
) -> Option<Vec<LocalObjectReference>> {
    let secrets: Vec<LocalObjectReference> = match &connection.spec.agent_image_pull_secrets {
        Some(own) => own.clone(),
        None => (manager.iter())
            .map(|name| LocalObjectReference { name: name.clone() })
            .collect(),
    };
    (!secrets.is_empty()).then_some(secrets)
}

/// How many agents run for a tunnel and how they are replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentLayout {
    /// Agent Pods.
    pub replicas: i32,
    /// Whether agents can stand by: the tunnel has a hostname, which the engine keeps exclusive,
    /// so one agent holds it and the others wait for it.
    pub standby: bool,
}

impl AgentLayout {
    /// `spec.agent.replicas` (default 2) for a tunnel with a hostname; 1 otherwise, since without
    /// one every agent would open a tunnel of its own (a TCP tunnel's public port, a private
    /// tunnel's name) and the status would follow whichever wrote last.
    pub fn of(spec: &RstreamTunnelSpec, has_hostname: bool) -> Self {
        let wanted = (spec.agent.as_ref())
            .and_then(|a| a.replicas)
            .unwrap_or(crate::api::DEFAULT_AGENT_REPLICAS)
            .max(1);
        Self {
            replicas: if has_hostname { wanted } else { 1 },
            standby: has_hostname,
        }
    }

    /// Whether a PodDisruptionBudget keeps one agent through voluntary disruptions.
    pub fn disruption_budget(&self) -> bool {
        self.replicas >= 2
    }
}

/// The PodDisruptionBudget of several agents: one stays available through a drain. Unready
/// agents may always be evicted, so a broken one never blocks a drain.
pub fn disruption_budget(cx: &ChildContext) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: cx.meta(cx.base.clone(), "agent"),
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(cx.labels("agent")),
                match_expressions: None,
            }),
            unhealthy_pod_eviction_policy: Some("AlwaysAllow".to_owned()),
            ..PodDisruptionBudgetSpec::default()
        }),
        status: None,
    }
}

/// The spec's affinity, plus (when agents stand by and the spec sets no pod anti-affinity) a
/// preference for one agent per node, so that a lost node leaves a standby elsewhere.
fn agent_affinity(
    spec: Option<Affinity>,
    layout: AgentLayout,
    selector: &BTreeMap<String, String>,
) -> Option<Affinity> {
    let has_own = spec.as_ref().is_some_and(|a| a.pod_anti_affinity.is_some());
    if !layout.standby || has_own {
        return spec;
    }
    let mut affinity = spec.unwrap_or_default();
    affinity.pod_anti_affinity = Some(PodAntiAffinity {
        preferred_during_scheduling_ignored_during_execution: Some(vec![WeightedPodAffinityTerm {
            weight: 100,
            pod_affinity_term: PodAffinityTerm {
                label_selector: Some(LabelSelector {
                    match_labels: Some(selector.clone()),
                    match_expressions: None,
                }),
                topology_key: "kubernetes.io/hostname".to_owned(),
                ..PodAffinityTerm::default()
            },
        }]),
        ..PodAntiAffinity::default()
    });
    Some(affinity)
}

/// The strategy: a rolling update (a new agent stands by before an old one goes: none is
/// unavailable, one extra at most) when agents can stand by; else Recreate, since two agents
/// would hold two tunnels (or fight for a TCP port) at once.
fn strategy(layout: AgentLayout) -> DeploymentStrategy {
    if layout.standby {
        DeploymentStrategy {
            type_: Some("RollingUpdate".to_owned()),
            rolling_update: Some(RollingUpdateDeployment {
                max_unavailable: Some(IntOrString::Int(0)),
                max_surge: Some(IntOrString::Int(1)),
            }),
        }
    } else {
        DeploymentStrategy {
            type_: Some("Recreate".to_owned()),
            rolling_update: None,
        }
    }
}

/// The agent Deployment: `layout`'s replicas and strategy, restricted pod security, token from
/// the Secret.
pub fn deployment(
    cx: &ChildContext,
    spec: &RstreamTunnelSpec,
    layout: AgentLayout,
    connection: &RstreamConnection,
    image: &str,
    image_pull_secrets: &[String],
    hash: &str,
) -> Deployment {
    let agent = spec.agent.clone().unwrap_or_default();
    let selector = cx.labels("agent");
    let mut pod_labels = selector.clone();
    // User labels never override the selector's (the pods would leave their Deployment).
    for (k, v) in agent.pod_labels.clone().unwrap_or_default() {
        pod_labels.entry(k).or_insert(v);
    }
    let mut annotations = agent.pod_annotations.clone().unwrap_or_default();
    annotations.insert(names::CONFIG_HASH_ANNOTATION.to_owned(), hash.to_owned());

    let secret_env = |name: &str, r: &SecretKeyRef| pod::secret_env(name, &r.name, &r.key);
    let mut env = vec![
        pod::field_env(names::POD_NAME_ENV, "metadata.name"),
        pod::field_env(names::POD_NAMESPACE_ENV, "metadata.namespace"),
    ];
    let cspec = &connection.spec;
    if let Some(r) = &cspec.token_secret_ref {
        env.push(secret_env(names::TOKEN_ENV, r));
    }
    if let Some(proxy) = cspec.transport.as_ref().and_then(|t| t.proxy.as_ref()) {
        if let Some(r) = &proxy.username_secret_ref {
            env.push(secret_env(names::PROXY_USERNAME_ENV, r));
        }
        if let Some(r) = &proxy.password_secret_ref {
            env.push(secret_env(names::PROXY_PASSWORD_ENV, r));
        }
    }

    let mut volumes = vec![Volume {
        name: "config".to_owned(),
        config_map: Some(ConfigMapVolumeSource {
            name: cx.configmap_name(),
            items: Some(vec![KeyToPath {
                key: names::CONFIG_KEY.to_owned(),
                path: names::CONFIG_KEY.to_owned(),
                mode: None,
                ..KeyToPath::default()
            }]),
            ..ConfigMapVolumeSource::default()
        }),
        ..Volume::default()
    }];
    let mut mounts = vec![VolumeMount {
        name: "config".to_owned(),
        mount_path: names::CONFIG_DIR.to_owned(),
        read_only: Some(true),
        ..VolumeMount::default()
    }];
    let project = |r: &SecretKeyRef, path: &str| pod::secret_file(&r.name, &r.key, path);
    let mut mount_secrets = |name: &str, dir: &str, sources: Vec<VolumeProjection>| {
        volumes.push(Volume {
            name: name.to_owned(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(sources),
                ..ProjectedVolumeSource::default()
            }),
            ..Volume::default()
        });
        mounts.push(VolumeMount {
            name: name.to_owned(),
            mount_path: dir.to_owned(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    };
    if let Some(ca) = &cspec.ca_secret_ref {
        mount_secrets(
            "engine-ca",
            names::ENGINE_CA_DIR,
            vec![project(ca, "ca.crt")],
        );
    }
    if let Some(m) = &cspec.mtls {
        let mut sources = vec![
            project(&m.cert_secret_ref, "tls.crt"),
            project(&m.key_secret_ref, "tls.key"),
        ];
        if let Some(ca) = &m.ca_secret_ref {
            sources.push(project(ca, "ca.crt"));
        }
        mount_secrets("mtls", names::MTLS_DIR, sources);
    }

    let container = Container {
        name: "agent".to_owned(),
        image: Some(
            agent
                .image
                .clone()
                .filter(|i| !i.trim().is_empty())
                .unwrap_or_else(|| image.to_owned()),
        ),
        image_pull_policy: Some("IfNotPresent".to_owned()),
        command: Some(vec!["/rstream-agent".to_owned()]),
        args: Some(vec![
            format!("--config={}/{}", names::CONFIG_DIR, names::CONFIG_KEY),
            format!("--health-bind-address=:{HEALTH_PORT}"),
            // JSON lines in a Pod, for log collectors; the binary's default is text for people.
            "--log-format=json".to_owned(),
        ]),
        ports: Some(vec![ContainerPort {
            name: Some("health".to_owned()),
            container_port: HEALTH_PORT,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(5),
            period_seconds: Some(10),
            timeout_seconds: Some(2),
            failure_threshold: Some(6),
            ..pod::http_probe("/healthz", "health")
        }),
        readiness_probe: Some(Probe {
            period_seconds: Some(5),
            timeout_seconds: Some(2),
            failure_threshold: Some(3),
            ..pod::http_probe("/readyz", "health")
        }),
        resources: Some(agent.resources.clone().unwrap_or_else(default_resources)),
        security_context: Some(pod::restricted_security_context()),
        env: Some(env),
        volume_mounts: Some(mounts),
        ..Container::default()
    };

    Deployment {
        metadata: cx.meta(cx.base.clone(), "agent"),
        spec: DeploymentSpec {
            replicas: Some(layout.replicas),
            selector: LabelSelector {
                match_labels: Some(selector.clone()),
                match_expressions: None,
            },
            strategy: Some(strategy(layout)),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    annotations: Some(annotations),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(cx.base.clone()),
                    automount_service_account_token: Some(true),
                    security_context: Some(pod::restricted_pod_security_context()),
                    node_selector: agent.node_selector.clone(),
                    tolerations: agent.tolerations.clone(),
                    affinity: agent_affinity(agent.affinity.clone(), layout, &selector),
                    priority_class_name: agent.priority_class_name.clone(),
                    image_pull_secrets: pull_secrets(connection, image_pull_secrets),
                    containers: vec![container],
                    volumes: Some(volumes),
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        },
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::AgentSpec;

    #[test]
    fn several_agents_only_for_a_tunnel_with_a_hostname() {
        let mut spec: RstreamTunnelSpec = serde_json::from_value(
            serde_json::json!({"target": {"service": {"name": "web", "port": 80}}}),
        )
        .unwrap();
        let two = AgentLayout::of(&spec, true);
        assert_eq!(
            (two.replicas, two.standby, two.disruption_budget()),
            (2, true, true)
        );
        assert_eq!(AgentLayout::of(&spec, false).replicas, 1);
        spec.agent = Some(AgentSpec {
            replicas: Some(1),
            ..AgentSpec::default()
        });
        let one = AgentLayout::of(&spec, true);
        assert_eq!((one.replicas, one.disruption_budget()), (1, false));
        assert_eq!(strategy(one).type_.as_deref(), Some("RollingUpdate"));
        let recreate = strategy(AgentLayout::of(&spec, false));
        assert_eq!(recreate.type_.as_deref(), Some("Recreate"));
    }

    #[test]
    fn a_spec_anti_affinity_wins() {
        let layout = AgentLayout {
            replicas: 2,
            standby: true,
        };
        let selector = BTreeMap::from([("a".to_owned(), "b".to_owned())]);
        let ours = agent_affinity(None, layout, &selector).unwrap();
        let term = &ours
            .pod_anti_affinity
            .unwrap()
            .preferred_during_scheduling_ignored_during_execution
            .unwrap()[0];
        assert_eq!(
            term.pod_affinity_term.topology_key,
            "kubernetes.io/hostname"
        );
        let own = Affinity {
            pod_anti_affinity: Some(PodAntiAffinity::default()),
            ..Affinity::default()
        };
        assert_eq!(
            agent_affinity(Some(own.clone()), layout, &selector),
            Some(own)
        );
    }

    #[test]
    fn hash_follows_config_and_secret_versions() {
        let a = config_hash("cfg", &["tok:1".into()]);
        assert_eq!(a.len(), 16);
        assert_eq!(a, config_hash("cfg", &["tok:1".into()]));
        assert_ne!(a, config_hash("cfg", &["tok:2".into()]));
        assert_ne!(a, config_hash("cfg2", &["tok:1".into()]));
    }
}
