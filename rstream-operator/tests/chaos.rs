//! The operator's manager on a bad day, on a real kube-apiserver and etcd of its own: etcd
//! compacted and restarted, then the API server restarted (every watch gets 410 Gone and lists
//! again): nothing may be deleted or re-created because it was briefly missing from a cache. A
//! verb taken out of its ClusterRole: said in the tunnel's condition, retried with backoff,
//! recovered when it returns. A Lease taken by another holder: no tunnel write until it leads
//! again.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::api::rbac::v1::ClusterRole;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt as _;
use kube::api::{Api, Patch, PatchParams, PostParams};
use netkit_testenv::{AuditEvent, ControlPlane};
use rstream_operator::api::RstreamTunnel;
use rstream_operator::names;

fn manager_events(plane: &ControlPlane, user: &str, from: usize) -> Vec<AuditEvent> {
    plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == user)
        .collect()
}

/// The Quick Start objects in `ns` (token Secret `creds`, connection `default`, Service and
/// tunnel `web`); returns the tunnel once it waits for its agent's Deployment.
async fn web_tunnel(admin: &kube::Client, ns: &str) -> RstreamTunnel {
    create(admin, ns, &secret("creds", &[("token", "token-1")])).await;
    let conn = serde_json::json!({
        "engine": "127.0.0.1:7443", "tokenSecretRef": {"name": "creds", "key": "token"}});
    create(admin, ns, &connection("default", conn)).await;
    let ports = serde_json::json!([{"name": "http", "port": 8080}]);
    create(admin, ns, &service("web", ports)).await;
    let spec = serde_json::json!({
        "target": {"service": {"name": "web", "port": "http"}}, "labels": {"app": "web"}});
    create(admin, ns, &tunnel("web", spec)).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), ns);
    wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await
}

#[tokio::test]
async fn restarts_after_a_compaction_delete_and_recreate_no_child() {
    let plane = ControlPlane::builder().start().await.unwrap();
    prepare(&plane).await;
    let ns = plane.create_namespace("operator-chaos").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(&plane, &ns, false).await;
    let user = sa_user(&ns, MANAGER_SA);
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;

    // A tunnel whose children exist and wait for their agent.
    let t = web_tunnel(&admin, &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    let base = names::base_name(&ns, "web", t.uid().as_deref());
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    let uid_before = deployments.get(&base).await.unwrap().uid();
    tokio::time::sleep(Duration::from_secs(1)).await;
    plane.writes_by(&user).await.unwrap();
    let from = plane.audit_events().unwrap().len();

    // Writes the watches will have to skip.
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &ns);
    for i in 0..20 {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(format!("churn-{i}"));
        maps.create(&PostParams::default(), &cm).await.unwrap();
    }
    // With the API server down (so no bookmark can tell a client a newer revision), etcd is
    // compacted past everything and restarted, then the API server starts with a fresh watch
    // cache: resuming any watch from before is 410 Gone.
    let since_stop = plane.audit_events().unwrap().len();
    plane.stop_apiserver().await.unwrap();
    let revision = plane.compact_etcd().await.unwrap();
    plane.restart_etcd(Duration::from_secs(2)).await.unwrap();
    plane.start_apiserver().await.unwrap();

    // The manager lists its tunnels again: the fault reached its watches.
    wait_for("the manager relists its tunnels", WAIT, || async {
        manager_events(&plane, &user, since_stop)
            .iter()
            .any(|e| {
                e.verb == "list"
                    && e.object_ref
                        .as_ref()
                        .is_some_and(|o| o.resource == "rstreamtunnels")
            })
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    plane.writes_by(&user).await.unwrap();
    let events = manager_events(&plane, &user, from);
    let destructive: Vec<_> = events
        .iter()
        .filter(|e| matches!(e.verb.as_str(), "delete" | "deletecollection" | "create"))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    // While a restarted API server warms its RBAC cache it denies reads (the watches retry
    // into that window); a denied write would mean the manager acted on a half-built view.
    let (forbidden, denied_reads): (Vec<_>, Vec<_>) = events
        .iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| (e.is_write(), format!("{} {}", e.verb, e.request_uri)))
        .partition(|(write, _)| *write);
    eprintln!(
        "reads denied while the API server started: {}",
        denied_reads.len()
    );
    eprintln!(
        "compacted at revision {revision}; the manager made {} requests across the fault, {} writes",
        events.len(),
        events.iter().filter(|e| e.is_write()).count()
    );
    assert!(destructive.is_empty(), "{destructive:?}");
    assert!(forbidden.is_empty(), "{forbidden:?}");
    assert_eq!(deployments.get(&base).await.unwrap().uid(), uid_before);
    wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    stop.cancel();
}

#[tokio::test]
async fn a_verb_taken_away_is_reported_backed_off_and_recovered() {
    let plane = ControlPlane::builder().start().await.unwrap();
    prepare(&plane).await;
    let ns = plane.create_namespace("operator-perm").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(&plane, &ns, false).await;
    let user = sa_user(&ns, MANAGER_SA);
    let stop = start_manager(plane.client_as(&identity).await.unwrap(), &ns).await;
    web_tunnel(&admin, &ns).await;
    let tunnels: Api<RstreamTunnel> = Api::namespaced(admin.clone(), &ns);

    // `patch` on Deployments leaves the ClusterRole; a token rotation needs it (config hash).
    let roles: Api<ClusterRole> = Api::all(admin.clone());
    let full = manager_cluster_role();
    let mut narrowed = full.clone();
    for rule in narrowed.rules.iter_mut().flatten() {
        if rule.resources.iter().flatten().any(|r| r == "deployments") {
            rule.verbs.retain(|v| v != "patch");
        }
    }
    let params = PatchParams::apply("chaos-test").force();
    roles
        .patch(&full.name_any(), &params, &Patch::Apply(&narrowed))
        .await
        .unwrap();
    let from = plane.audit_events().unwrap().len();
    Api::<Secret>::namespaced(admin.clone(), &ns)
        .patch(
            "creds",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"token": "token-2"}})),
        )
        .await
        .unwrap();
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "ChildrenNotApplied",
        WAIT,
    )
    .await;
    let (_, _, message) = condition(&t, "Ready").unwrap();
    assert!(
        message.contains("patch") && message.contains("deployments"),
        "the condition does not name the verb and resource: {message}"
    );
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    plane.writes_by(&user).await.unwrap();
    let denied = manager_events(&plane, &user, from)
        .into_iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .count();
    eprintln!("{denied} denied requests in {window:?}; condition: {message}");
    assert!(denied >= 1);
    // Backed off (500 ms doubling): about 7 attempts in 20 s, not a hot loop.
    assert!(
        denied <= 10,
        "{denied} denied requests in {window:?}: not backing off"
    );

    // The verb comes back: the agent rolls with the new hash within one backoff period.
    roles
        .patch(&full.name_any(), &params, &Patch::Apply(&full))
        .await
        .unwrap();
    let restored = std::time::Instant::now();
    wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        Duration::from_secs(40),
    )
    .await;
    eprintln!(
        "recovered {:?} after the verb came back",
        restored.elapsed()
    );
    stop.cancel();
}

#[tokio::test]
async fn a_lost_lease_stops_the_writes_before_the_new_holder_starts() {
    let plane = plane().await;
    let ns = plane.create_namespace("operator-lease").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, true).await;
    let user = sa_user(&ns, MANAGER_SA);
    let (stop, health) = start_manager_observed(
        plane.client_as(&identity).await.unwrap(),
        &ns,
        Some((ns.clone(), "chaos-op".to_owned())),
    )
    .await;
    let t = web_tunnel(&admin, &ns).await;
    let base = names::base_name(&ns, "web", t.uid().as_deref());
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    let hash = |d: &Deployment| {
        d.spec
            .template
            .metadata
            .as_ref()
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(names::CONFIG_HASH_ANNOTATION))
            .cloned()
            .unwrap_or_default()
    };
    let before = hash(&deployments.get(&base).await.unwrap());

    // Another holder takes the tunnels' Lease for 10 s, then the token rotates: the old leader
    // must leave the new hash to whoever holds the Lease.
    let leadership = "tunnels/leadership";
    let leading = health.check(leadership).map(|c| c.detail);
    assert!(
        leading.as_deref().is_some_and(|d| d != "term ended"),
        "the manager does not lead before the takeover: {leading:?}"
    );
    let leases: Api<Lease> = Api::namespaced(admin.clone(), &ns);
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let taken = std::time::Instant::now();
    leases
        .patch(
            rstream_operator::manager::LEASE_NAME,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {
                "holderIdentity": "intruder",
                "leaseDurationSeconds": 10,
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .unwrap();
    // A real successor waits out the old term; this one does not: wait until the manager has
    // seen the Lease go (its next renewal, every 2 s) and its term's work has returned (the
    // leadership check changes only then).
    wait_for(
        "the manager's term to end",
        Duration::from_secs(60),
        || async {
            let now = health.check(leadership).map(|c| c.detail);
            (now != leading).then_some(())
        },
    )
    .await;
    eprintln!(
        "the manager's term ended {:?} after the takeover ({leadership}: {:?})",
        taken.elapsed(),
        health.check(leadership).map(|c| c.detail)
    );
    plane.writes_by(&user).await.unwrap();
    let from = plane.audit_events().unwrap().len();
    Api::<Secret>::namespaced(admin.clone(), &ns)
        .patch(
            "creds",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"token": "token-2"}})),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    plane.writes_by(&user).await.unwrap();
    let meanwhile: Vec<_> = manager_events(plane, &user, from)
        .into_iter()
        .filter(|e| e.is_write())
        .filter(|e| {
            // The connections' controller holds its own Lease and may write connection status.
            e.object_ref
                .as_ref()
                .is_none_or(|o| o.resource != "leases" && o.resource != "rstreamconnections")
        })
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(
        meanwhile.is_empty(),
        "the manager wrote tunnel objects while another held the Lease: {meanwhile:?}"
    );
    assert_eq!(hash(&deployments.get(&base).await.unwrap()), before);

    // The intruder's term runs out: the manager leads again and rolls the agent.
    wait_for("the new config hash", Duration::from_secs(40), || async {
        let h = hash(&deployments.get(&base).await.unwrap());
        (h != before).then_some(())
    })
    .await;
    let rolled = taken.elapsed();
    eprintln!("new hash {rolled:?} after the takeover (intruder's term: 10 s)");
    assert!(rolled >= Duration::from_secs(10), "rolled after {rolled:?}");
    stop.cancel();
}

/// Non-Lease writes by `user` from audit index `from` on, counted per verb and object.
fn writes_per_object(
    plane: &ControlPlane,
    user: &str,
    from: usize,
) -> std::collections::BTreeMap<String, usize> {
    let mut writes = std::collections::BTreeMap::new();
    for e in manager_events(plane, user, from)
        .into_iter()
        .filter(AuditEvent::is_write)
    {
        let (resource, sub, object) = e.object_ref.as_ref().map_or(("", "", ""), |o| {
            (
                o.resource.as_str(),
                o.subresource.as_deref().unwrap_or(""),
                o.name.as_deref().unwrap_or(""),
            )
        });
        if resource == "leases" {
            continue;
        }
        *writes
            .entry(format!("{} {resource}/{sub} {object}", e.verb))
            .or_insert(0) += 1;
    }
    writes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_api_server_is_noticed_the_tunnel_serves_and_it_converges() {
    // Frozen on purpose, so a plane of its own.
    let plane = ControlPlane::builder().start().await.unwrap();
    prepare(&plane).await;
    let ns = plane.create_namespace("operator-hung").await.unwrap();
    let live = Live::new(&plane, &ns, &["web-a"]).await;
    let identity = manager_identity(&plane, &ns, true).await;
    let user = sa_user(&ns, MANAGER_SA);
    let kubeconfig = plane.kubeconfig_as(&identity).await.unwrap();
    let manager = Process::manager(
        &kubeconfig,
        &ns,
        "manager-a",
        live.dir.path(),
        &["--namespace", &ns],
    );
    wait_for("the manager leads", WAIT, || async {
        manager.leads().await.then_some(())
    })
    .await;
    wait_condition(
        &live.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let agent = live.start_agent(&plane, "web-agent-0").await;
    let ingress = live.online("web-agent-0").await;
    live.report_deployment_available().await;
    assert_eq!(body_through(ingress).await, Ok(body_of("web-a")));
    let base = live.base().await;
    let agent_user = sa_user(&ns, &base);
    let hash_before = config_hash(&live.deployment().await);
    plane.writes_by(&user).await.unwrap();
    let from = plane.audit_events().unwrap().len();
    let log_from = manager.logs().len();

    plane.pause_apiserver().await.unwrap();
    let frozen = std::time::Instant::now();
    let freeze = Duration::from_secs(20);
    let (mut requests, mut lost) = (0, Vec::new());
    let (mut agent_unready, mut manager_unready) = (Vec::new(), 0);
    let mut noticed = None;
    while frozen.elapsed() < freeze {
        requests += 1;
        match body_through(ingress).await {
            Ok(body) if body == body_of("web-a") => {}
            other => lost.push(format!("{:?}: {other:?}", frozen.elapsed())),
        }
        let agent_ready = http_status(&agent.health, "/readyz").await;
        if agent_ready != 200 {
            agent_unready.push(format!("{:?}: {agent_ready}", frozen.elapsed()));
        }
        if http_status(&manager.health, "/readyz").await != 200 {
            manager_unready += 1;
        }
        if noticed.is_none()
            && leader_gauge(
                &manager.metrics,
                rstream_operator::manager::TUNNEL_CONTROLLER,
            )
            .await
                == Some(0)
        {
            noticed = Some(frozen.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Times after the resume count from SIGCONT, the API server's own return to ready included.
    let resumed = std::time::Instant::now();
    plane.resume_apiserver().await.unwrap();
    let answering = resumed.elapsed();
    eprintln!(
        "frozen {freeze:?}: the manager stepped down after {noticed:?}; {requests} requests through the tunnel, \
         {} lost; agent unready samples {agent_unready:?}; manager /readyz not 200 in {manager_unready} samples",
        lost.len()
    );
    assert!(
        lost.is_empty(),
        "requests lost through the tunnel: {lost:?}"
    );
    assert!(requests >= 20, "only {requests} requests in the freeze");
    assert!(agent_unready.is_empty(), "{agent_unready:?}");
    // Noticed by its own timeout: the renew deadline (10 s after the last renewal, which was
    // at most one retry period of 2 s before the freeze), not by an error from the server.
    let noticed = noticed.unwrap_or_else(|| panic!("never stepped down:\n{}", manager.logs()));
    assert!(
        (Duration::from_secs(7)..Duration::from_secs(12)).contains(&noticed),
        "stepped down {noticed:?} into the freeze"
    );
    let logs = manager.logs()[log_from..].to_owned();
    assert!(logs.contains("lost the Lease"), "{logs}");

    // Converges: leads again, and a change made now reaches the agent's config and Deployment.
    wait_for(
        "the manager leads again",
        Duration::from_secs(30),
        || async { manager.leads().await.then_some(()) },
    )
    .await;
    let leads_again = resumed.elapsed();
    live.tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"labels": {"after": "freeze"}}})),
        )
        .await
        .unwrap();
    wait_for(
        "the new labels in the config, then a new hash",
        WAIT,
        || async {
            (live.agent_config().await.contains("after: freeze")
                && config_hash(&live.deployment().await) != hash_before)
                .then_some(())
        },
    )
    .await;
    let converged = resumed.elapsed();
    assert_eq!(body_through(ingress).await, Ok(body_of("web-a")));
    tokio::time::sleep(Duration::from_secs(2)).await;
    plane.writes_by(&user).await.unwrap();
    let writes = writes_per_object(&plane, &user, from);
    let agent_writes = writes_per_object(&plane, &agent_user, from);
    eprintln!(
        "after SIGCONT: the API server ready after {answering:?}, the manager leads again after {leads_again:?}, \
         a change made then applied after {converged:?}; \
         manager writes {writes:?}; agent writes {agent_writes:?}"
    );
    assert!(
        writes.values().all(|n| *n == 1),
        "an object written more than once: {writes:?}"
    );
    for expected in [
        format!("patch configmaps/ {base}-config"),
        format!("patch deployments/ {base}"),
    ] {
        assert!(writes.contains_key(&expected), "no {expected}: {writes:?}");
    }
    assert!(
        agent_writes.is_empty(),
        "the agent wrote though its tunnel never changed: {agent_writes:?}"
    );
    drop(agent);
    drop(manager);
    live.engine.shutdown().await;
}
