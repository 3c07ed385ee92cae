//! The manager's tunnel reconcile against a real kube-apiserver (one per test binary), under its
//! least-privilege identity: conditions, the agent's children and their credentials, restarts on
//! rotation, deletion, and invalid specs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::ResourceExt as _;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use netkit_testenv::eventually;
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::api::RstreamTunnel;
use rstream_operator::manager::service as service_lb;
use rstream_operator::names;

#[tokio::test]
async fn tunnel_conditions_name_each_missing_piece_until_only_the_agent_is_missing() {
    let env = manager_env("resolve").await;
    let (admin, ns) = (env.admin.clone(), env.ns.clone());
    let (tunnels, conns) = (env.tunnels.clone(), env.conns.clone());

    // A connection whose Secret does not exist yet.
    env.create_connection().await;
    env.create_tunnel().await;
    let t = wait_condition(&tunnels, "web", "Resolved", "False", "SecretMissing", WAIT).await;
    assert_eq!(condition(&t, "Accepted").unwrap().1, "ConnectionMissing");
    assert_eq!(condition(&t, "Ready").unwrap().1, "ConnectionMissing");
    assert!(t.status.unwrap().last_error.unwrap().contains("creds"));
    wait_for("connection SecretMissing", WAIT, || async {
        let c = conns.get("default").await.ok()?;
        let ready = c
            .status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "Ready")?;
        (ready.status == "False" && ready.reason == "SecretMissing").then_some(())
    })
    .await;

    // The Secret appears: the connection becomes Ready, the tunnel moves on to its Service.
    create(&admin, &ns, &secret("creds", &[("token", "token-1")])).await;
    let c = wait_for("connection Ready", WAIT, || async {
        let c = conns.get("default").await.ok()?;
        let s = c.status.clone()?;
        s.conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(c)
    })
    .await;
    assert_eq!(c.status.unwrap().engine.as_deref(), Some("127.0.0.1:7443"));
    let t = wait_condition(&tunnels, "web", "Resolved", "False", "ServiceMissing", WAIT).await;
    assert_eq!(condition(&t, "Accepted").unwrap().0, "True");
    assert_eq!(condition(&t, "Ready").unwrap().1, "ServiceMissing");

    // A Service without that port, then with it.
    create(
        &admin,
        &ns,
        &service(
            "web",
            serde_json::json!([{"name": "metrics", "port": 9090}]),
        ),
    )
    .await;
    wait_condition(
        &tunnels,
        "web",
        "Resolved",
        "False",
        "ServicePortMissing",
        WAIT,
    )
    .await;
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(admin.clone(), &ns)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "spec": {"ports": [{"name": "http", "port": 8080}]}})),
        )
        .await
        .unwrap();
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let status = t.status.clone().unwrap();
    assert_eq!(condition(&t, "Resolved").unwrap().0, "True");
    assert_eq!(condition(&t, "AgentReady").unwrap().1, "DeploymentPending");
    assert_eq!(condition(&t, "TunnelReady").unwrap().1, "TunnelConnecting");
    assert_eq!(
        status.target.as_deref(),
        Some(format!("web.{ns}.svc:8080").as_str())
    );
    assert_eq!(
        status.rstream_name.as_deref(),
        Some(format!("{ns}-web").as_str())
    );
    assert!(status.last_error.is_none());
    assert!(t.finalizers().iter().any(|f| f == names::FINALIZER));

    env.finish_without_403().await;
}

#[tokio::test]
async fn children_are_owned_restricted_and_get_credentials_by_reference() {
    let env = manager_env("children").await;
    let (t, base) = env.resolved_tunnel().await;
    let status = t.status.clone().unwrap();
    assert_eq!(status.agent_deployment.as_deref(), Some(base.as_str()));
    let kids = children(&env.admin, &env.ns, &base).await;
    let uid = t.uid().unwrap();
    let cm = kids.configmap.unwrap();
    let owners = [
        cm.owner_references(),
        kids.service_account.as_ref().unwrap().owner_references(),
        kids.role.as_ref().unwrap().owner_references(),
        kids.binding.as_ref().unwrap().owner_references(),
        kids.deployment.as_ref().unwrap().owner_references(),
    ];
    for refs in owners {
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].uid, uid);
        assert_eq!(refs[0].controller, Some(true));
        assert_eq!(refs[0].kind, "RstreamTunnel");
    }
    let config_yaml = cm.data.unwrap()[names::CONFIG_KEY].clone();
    assert!(
        !config_yaml.contains("token-1"),
        "the token leaked into the ConfigMap"
    );
    let config = AgentConfig::from_yaml(&config_yaml).unwrap();
    assert_eq!(config.connection.engine, "127.0.0.1:7443");
    assert_eq!(config.target.host, format!("web.{}.svc", env.ns));
    assert_eq!(config.target.port, "8080");
    assert_eq!(config.tunnel.labels["app"], "web");
    assert_eq!(
        config.tunnel.labels["rstream.managed-by"],
        "kubernetes-operator"
    );
    assert_eq!(
        config
            .tunnel
            .http
            .as_ref()
            .unwrap()
            .auth
            .as_ref()
            .unwrap()
            .token,
        Some(true)
    );
    let role = kids.role.unwrap();
    for rule in role.rules.as_ref().unwrap() {
        assert_eq!(
            rule.resource_names.as_deref(),
            Some(&["web".to_owned()][..])
        );
    }
    let d = kids.deployment.unwrap();
    assert_eq!(d.spec.replicas, Some(1));
    assert_eq!(
        d.spec.strategy.as_ref().unwrap().type_.as_deref(),
        Some("Recreate")
    );
    let pod = d.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(base.as_str()));
    let psc = pod.security_context.as_ref().unwrap();
    assert_eq!(psc.run_as_non_root, Some(true));
    assert_eq!(
        psc.seccomp_profile.as_ref().unwrap().type_,
        "RuntimeDefault"
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.image.as_deref(),
        Some("example.test/rstream-operator:dev")
    );
    assert_eq!(
        c.command.as_deref(),
        Some(&["/rstream-agent".to_owned()][..])
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_owned()][..])
    );
    let token_env = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == names::TOKEN_ENV)
        .unwrap();
    assert!(token_env.value.is_none());
    let sel = token_env
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    assert_eq!((sel.name.as_str(), sel.key.as_str()), ("creds", "token"));
    assert_eq!(config_hash(&d).len(), 16);
    let pull_secrets = |d: &Deployment| -> Vec<String> {
        (d.spec
            .template
            .spec
            .as_ref()
            .unwrap()
            .image_pull_secrets
            .iter())
        .flatten()
        .map(|r| r.name.clone())
        .collect()
    };
    // The manager's pull Secrets by default; the connection's own list when it sets one.
    assert_eq!(pull_secrets(&d), [MANAGER_PULL_SECRET]);
    env.conns
        .patch(
            "default",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"agentImagePullSecrets": [{"name": "own-registry"}]}}),
            ),
        )
        .await
        .unwrap();
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), &env.ns);
    eventually(
        "the connection's pull Secrets on the agent",
        WAIT,
        || async {
            let d = deployments.get(&base).await.unwrap();
            pull_secrets(&d) == ["own-registry"]
        },
    )
    .await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn rotating_the_token_restarts_the_agent() {
    let env = manager_env("rotate").await;
    let (_, base) = env.resolved_tunnel().await;
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), &env.ns);
    let first_hash = config_hash(&deployments.get(&base).await.unwrap());
    Api::<Secret>::namespaced(env.admin.clone(), &env.ns)
        .replace(
            "creds",
            &PostParams::default(),
            &secret("creds", &[("token", "token-2")]),
        )
        .await
        .unwrap();
    wait_for("a new config hash", WAIT, || async {
        let d = deployments.get(&base).await.ok()?;
        let h = config_hash(&d);
        (h != first_hash && !h.is_empty()).then_some(())
    })
    .await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn an_available_agent_deployment_makes_the_agent_ready() {
    let env = manager_env("available").await;
    let (_, base) = env.resolved_tunnel().await;
    // No kubelet here: the test reports the Deployment available, as its controller would.
    Api::<Deployment>::namespaced(env.admin.clone(), &env.ns)
        .patch_status(
            &base,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
            "status": {"replicas": 1, "readyReplicas": 1, "availableReplicas": 1}})),
        )
        .await
        .unwrap();
    wait_condition(
        &env.tunnels,
        "web",
        "AgentReady",
        "True",
        "DeploymentAvailable",
        WAIT,
    )
    .await;
    env.finish_without_403().await;
}

#[tokio::test]
async fn deleting_a_tunnel_deletes_its_children_before_the_finalizer_goes() {
    let env = manager_env("delete").await;
    let (_, base) = env.resolved_tunnel().await;
    let tunnels = &env.tunnels;
    // Deleting the tunnel: the manager deletes every child itself (no garbage collector runs
    // here) and then removes its finalizer.
    tunnels
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the tunnel to be gone", WAIT, || async {
        tunnels
            .get_opt("web")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let kids = children(&env.admin, &env.ns, &base).await;
    assert!(kids.configmap.is_none() && kids.service_account.is_none());
    assert!(kids.role.is_none() && kids.binding.is_none() && kids.deployment.is_none());

    env.finish_without_403().await;
}

#[tokio::test]
async fn invalid_specs_and_missing_connections_are_reported() {
    let plane = plane().await;
    let ns = plane.create_namespace("blocked").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);

    // No connection named "other".
    create(
        &admin,
        &ns,
        &tunnel(
            "orphan",
            serde_json::json!({
        "connectionRef": {"name": "other"}, "target": {"service": {"name": "web", "port": 80}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &tunnels,
        "orphan",
        "Accepted",
        "False",
        "ConnectionMissing",
        WAIT,
    )
    .await;
    assert!(condition(&t, "Accepted").unwrap().2.contains("other"));

    // Rules only the client knows: a private tunnel takes no public option.
    create(
        &admin,
        &ns,
        &tunnel(
            "private",
            serde_json::json!({
        "publish": false, "geoip": ["FR"], "target": {"service": {"name": "web", "port": 80}}}),
        ),
    )
    .await;
    let t = wait_condition(
        &tunnels,
        "private",
        "Accepted",
        "False",
        "InvalidSpec",
        WAIT,
    )
    .await;
    assert_eq!(condition(&t, "Ready").unwrap().1, "InvalidSpec");
    assert!(
        t.status
            .unwrap()
            .last_error
            .unwrap()
            .contains("invalid spec")
    );

    stop.cancel();
    let forbidden = forbidden_requests(plane, &sa_user(&ns, MANAGER_SA)).await;
    assert!(
        forbidden.is_empty(),
        "the manager was denied: {forbidden:?}"
    );
}

#[tokio::test]
async fn a_tunnel_with_a_hostname_runs_standby_agents_kept_through_rollouts_and_drains() {
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

    let env = manager_env("standby-agents").await;
    let (t, base) = env.resolved_tunnel().await;
    let deployments: Api<Deployment> = Api::namespaced(env.admin.clone(), &env.ns);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(env.admin.clone(), &env.ns);
    let replicas_become = |n: i32| {
        let deployments = deployments.clone();
        let base = base.clone();
        async move {
            wait_for(&format!("{n} agents"), WAIT, || async {
                let d = deployments.get(&base).await.ok()?;
                (d.spec.replicas == Some(n)).then_some(d)
            })
            .await
        }
    };
    let budget_is = |present: bool| {
        let budgets = budgets.clone();
        let base = base.clone();
        async move {
            wait_for(&format!("budget present: {present}"), WAIT, || async {
                let b = budgets.get_opt(&base).await.ok()?;
                (b.is_some() == present).then_some(b)
            })
            .await
        }
    };
    let merge = |spec: serde_json::Value| {
        let tunnels = env.tunnels.clone();
        async move {
            tunnels
                .patch(
                    "web",
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({ "spec": spec })),
                )
                .await
                .unwrap();
        }
    };

    // No hostname (the engine is an IP, none is generated): each agent would open a tunnel of
    // its own, so one agent, replaced by Recreate, and no budget.
    let d = replicas_become(1).await;
    let strategy = d.spec.strategy.clone().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("Recreate"));
    assert!(budget_is(false).await.is_none());

    // A hostname: two agents by default, rolled one extra at a time with none unavailable,
    // spread over nodes, and a budget keeping one.
    merge(serde_json::json!({"hostname": "web.example.test"})).await;
    let d = replicas_become(2).await;
    let spec = d.spec;
    let strategy = spec.strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    let rolling = strategy.rolling_update.unwrap();
    assert_eq!(rolling.max_unavailable, Some(IntOrString::Int(0)));
    assert_eq!(rolling.max_surge, Some(IntOrString::Int(1)));
    let pod = spec.template.spec.unwrap();
    let preferred = pod
        .affinity
        .and_then(|a| a.pod_anti_affinity)
        .and_then(|a| a.preferred_during_scheduling_ignored_during_execution)
        .expect("no preferred pod anti-affinity");
    assert_eq!(preferred.len(), 1);
    let term = &preferred[0].pod_affinity_term;
    assert_eq!(term.topology_key, "kubernetes.io/hostname");
    let agents = spec.selector.match_labels.clone();
    assert_eq!(term.label_selector.as_ref().unwrap().match_labels, agents);
    let budget = budget_is(true).await.unwrap();
    let owners = budget.owner_references();
    assert_eq!(owners.len(), 1);
    assert_eq!(owners[0].uid, t.uid().unwrap());
    assert_eq!(owners[0].controller, Some(true));
    let bspec = budget.spec.unwrap();
    assert_eq!(bspec.min_available, Some(IntOrString::Int(1)));
    assert_eq!(bspec.selector.unwrap().match_labels, agents);
    assert_eq!(
        bspec.unhealthy_pod_eviction_policy.as_deref(),
        Some("AlwaysAllow")
    );

    // Down to one agent: still rolled without a gap, and no budget (it would block drains).
    merge(serde_json::json!({"agent": {"replicas": 1}})).await;
    let d = replicas_become(1).await;
    let strategy = d.spec.strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));
    budget_is(false).await;
    merge(serde_json::json!({"agent": {"replicas": 3}})).await;
    replicas_become(3).await;
    budget_is(true).await;

    // A tcp tunnel takes no hostname: back to one agent, Recreate, no budget.
    merge(serde_json::json!({"hostname": null, "protocol": "tcp", "http": null})).await;
    let d = replicas_become(1).await;
    let strategy = d.spec.strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("Recreate"));
    budget_is(false).await;

    // Deleting the tunnel deletes its budget too (no garbage collector runs here).
    merge(serde_json::json!({"hostname": "web.example.test", "protocol": "http"})).await;
    budget_is(true).await;
    env.tunnels
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    budget_is(false).await;

    env.finish_without_403().await;
}

/// `(status, reason, message)` of the manager's condition on a Service, and its ingress.
fn service_tunnel_state(
    svc: &Service,
) -> (
    Option<(String, String, String)>,
    Vec<k8s_openapi::api::core::v1::LoadBalancerIngress>,
) {
    let status = svc.status.clone().unwrap_or_default();
    let condition = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == service_lb::CONDITION)
        .map(|c| (c.status, c.reason, c.message));
    let ingress = status
        .load_balancer
        .and_then(|lb| lb.ingress)
        .unwrap_or_default();
    (condition, ingress)
}

fn load_balancer(name: &str, class: &str, annotations: serde_json::Value) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "annotations": annotations},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": class,
            "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 80}],
        },
    }))
    .unwrap()
}

#[tokio::test]
async fn a_load_balancer_service_of_the_class_gets_a_tunnel_and_its_address() {
    let env = manager_env("svc-lb").await;
    let (admin, ns, tunnels) = (env.admin.clone(), env.ns.clone(), env.tunnels.clone());
    let services: Api<Service> = Api::namespaced(admin.clone(), &ns);
    let wait_service = |name: &'static str, reason: &'static str| {
        let services = services.clone();
        async move {
            wait_for(&format!("{name}: {reason}"), WAIT, || async {
                let svc = services.get(name).await.ok()?;
                let (condition, _) = service_tunnel_state(&svc);
                (condition?.1 == reason).then_some(svc)
            })
            .await
        }
    };

    // A Service of the class, asking for its `http` port: a tunnel of its name, owned by it.
    let annotations = serde_json::json!({service_lb::PORT_ANNOTATION: "http"});
    let web = create(
        &admin,
        &ns,
        &load_balancer("web", service_lb::LOAD_BALANCER_CLASS, annotations),
    )
    .await;
    let tunnel = wait_for("the Service's tunnel", WAIT, || async {
        tunnels.get_opt("web").await.unwrap()
    })
    .await;
    assert_eq!(tunnel.spec.target.service.name, "web");
    assert_eq!(
        tunnel.spec.target.service.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(80)
    );
    let owner = &tunnel.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.controller),
        ("Service", Some(true))
    );
    assert_eq!(Some(&owner.uid), web.metadata.uid.as_ref());
    assert_eq!(
        tunnel
            .labels()
            .get(service_lb::SERVICE_LABEL)
            .map(String::as_str),
        Some("web")
    );
    let svc = wait_service("web", service_lb::reasons::WAITING_FOR_ADDRESS).await;
    assert!(
        service_tunnel_state(&svc).1.is_empty(),
        "no address before the agent has one"
    );

    // The agent reports the public address (as rstream-agent does once it holds the tunnel):
    // the Service shows it as its load balancer's ingress.
    let status = serde_json::json!({"status": {"forwardingAddress": "https://localhost:41234", "hostname": "localhost"}});
    tunnels
        .patch_status("web", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    let svc = wait_service("web", service_lb::reasons::ADDRESS_ASSIGNED).await;
    let (condition, ingress) = service_tunnel_state(&svc);
    assert_eq!(condition.unwrap().0, "True");
    assert_eq!(ingress.len(), 1);
    assert_eq!(ingress[0].hostname.as_deref(), Some("localhost"));
    let ports = ingress[0].ports.clone().unwrap();
    assert_eq!((ports[0].port, ports[0].protocol.as_str()), (41234, "TCP"));

    // A bad annotation: said on the Service, the tunnel stays as it was.
    let bad = serde_json::json!({"metadata": {"annotations": {service_lb::PROTOCOL_ANNOTATION: "gopher"}}});
    services
        .patch("web", &PatchParams::default(), &Patch::Merge(&bad))
        .await
        .unwrap();
    let svc = wait_service("web", service_lb::reasons::INVALID_ANNOTATION).await;
    let (condition, kept_ingress) = service_tunnel_state(&svc);
    let message = condition.unwrap().2;
    assert!(
        message.contains("\"gopher\" is not a tunnel protocol"),
        "{message}"
    );
    assert_eq!(
        kept_ingress, ingress,
        "the address stays while the tunnel runs on"
    );
    let kept = tunnels.get("web").await.unwrap();
    assert_eq!(kept.spec, tunnel.spec);

    // A tunnel of the name that someone else made is left alone.
    create(&admin, &ns, &tunnel_spec_for("taken")).await;
    create(
        &admin,
        &ns,
        &load_balancer(
            "taken",
            service_lb::LOAD_BALANCER_CLASS,
            serde_json::json!({}),
        ),
    )
    .await;
    let svc = wait_service("taken", service_lb::reasons::NAME_TAKEN).await;
    assert!(
        service_tunnel_state(&svc)
            .0
            .unwrap()
            .2
            .contains("is not this Service's")
    );
    let theirs = tunnels.get("taken").await.unwrap();
    assert!(theirs.owner_references().is_empty());
    assert_eq!(theirs.spec.target.service.name, "elsewhere");

    // Another class is another controller's: no tunnel, no status.
    create(
        &admin,
        &ns,
        &load_balancer("cloud", "example.com/cloud-lb", serde_json::json!({})),
    )
    .await;

    // No longer a load balancer: the tunnel goes, and so does what the manager wrote.
    let to_cluster_ip =
        serde_json::json!({"spec": {"type": "ClusterIP", "loadBalancerClass": null}});
    services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(&to_cluster_ip),
        )
        .await
        .unwrap();
    wait_for("the tunnel to be gone", WAIT, || async {
        tunnels
            .get_opt("web")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    wait_for("the Service's status to be cleared", WAIT, || async {
        let svc = services.get("web").await.ok()?;
        let (condition, ingress) = service_tunnel_state(&svc);
        (condition.is_none() && ingress.is_empty()).then_some(())
    })
    .await;
    let cloud = services.get("cloud").await.unwrap();
    assert_eq!(service_tunnel_state(&cloud), (None, vec![]));
    assert!(tunnels.get_opt("cloud").await.unwrap().is_none());

    env.finish_without_403().await;
}

fn tunnel_spec_for(name: &str) -> RstreamTunnel {
    tunnel(
        name,
        serde_json::json!({"target": {"service": {"name": "elsewhere", "port": 80}}}),
    )
}
