//! The manager binary as processes on the shared kube-apiserver, the agent run as its
//! Deployment would run it, LocalEngine as the engine: a tunnel's target changed (the agent's
//! config and Deployment follow, traffic reaches the new Service), `--namespace` scoping (another
//! namespace untouched, no request outside it), and failover between two managers (the leader
//! killed, the other takes over and applies what changed meanwhile), and several agents of one
//! tunnel (one active, the others standing by; the active one stopped or killed, a standby takes
//! over).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use rstream_operator::agent_config::AgentConfig;
use rstream_operator::manager::LEASE_NAME;

/// The manager's ServiceAccount kubeconfig in `ns` (leader election on).
async fn manager_kubeconfig(ns: &str, sa: &str) -> std::path::PathBuf {
    let plane = plane().await;
    let identity = manager_identity_named(plane, ns, sa, true).await;
    plane.kubeconfig_as(&identity).await.unwrap()
}

async fn leads_soon(manager: &Process) {
    wait_for("the manager leads", WAIT, || async {
        manager.leads().await.then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_target_rolls_the_agent_to_the_new_service() {
    let plane = plane().await;
    let ns = plane.create_namespace("retarget").await.unwrap();
    let live = Live::new(plane, &ns, &["web-a", "web-b"]).await;
    let kubeconfig = manager_kubeconfig(&ns, MANAGER_SA).await;
    let manager = Process::manager(
        &kubeconfig,
        &ns,
        "manager-a",
        live.dir.path(),
        &["--namespace", &ns],
    );
    leads_soon(&manager).await;
    wait_condition(
        &live.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let mut agent = live.start_agent(plane, "web-agent-0").await;
    let ingress = live.online("web-agent-0").await;
    assert_eq!(body_through(ingress).await, Ok(body_of("web-a")));
    let hash_before = config_hash(&live.deployment().await);

    // The target moves to web-b (port 8081).
    live.tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"spec": {"target": {"service": {"name": "web-b", "port": "http"}}}}),
            ),
        )
        .await
        .unwrap();
    let new_target = format!("web-b.{ns}.svc:8081");
    wait_for("the agent config names web-b", WAIT, || async {
        let config = AgentConfig::from_yaml(&live.agent_config().await).unwrap();
        (config.target_address() == new_target).then_some(())
    })
    .await;
    let rolled = wait_for("the Deployment's config hash changes", WAIT, || async {
        let d = live.deployment().await;
        (config_hash(&d) != hash_before).then_some(d)
    })
    .await;
    // The Deployment controller's part: a new Pod from the new template. The old agent goes
    // (SIGTERM: it leaves the engine); the new one runs the config the ConfigMap holds now.
    assert!(agent.terminate().await, "{}", agent.logs());
    let agent = live.start_agent(plane, "web-agent-1").await;
    let ingress = live.online("web-agent-1").await;
    assert_eq!(body_through(ingress).await, Ok(body_of("web-b")));
    let t = live.tunnels.get("web").await.unwrap();
    assert_eq!(
        t.status.and_then(|s| s.target).as_deref(),
        Some(new_target.as_str())
    );
    // The template points at the same ConfigMap: the hash alone rolls it.
    let volumes = serde_json::to_string(&rolled.spec.template.spec).unwrap();
    assert!(volumes.contains(&format!("{}-config", live.base().await)));
    drop(agent);
    drop(manager);
    let forbidden = forbidden_requests(plane, &sa_user(&ns, MANAGER_SA)).await;
    assert!(forbidden.is_empty(), "{forbidden:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaced_manager_leaves_other_namespaces_alone() {
    let plane = plane().await;
    let ours = plane.create_namespace("scoped").await.unwrap();
    let other = plane.create_namespace("scoped-other").await.unwrap();
    let admin = plane.client().await.unwrap();
    // The same objects in both namespaces; the manager's ClusterRole would allow it to act on
    // both: only --namespace keeps it in its own.
    let other_live = Live::new(plane, &other, &["web-a"]).await;
    let kubeconfig = manager_kubeconfig(&ours, MANAGER_SA).await;
    let user = sa_user(&ours, MANAGER_SA);
    let dir = tempfile::tempdir().unwrap();
    let manager = Process::manager(
        &kubeconfig,
        &ours,
        "manager-a",
        dir.path(),
        &["--namespace", &ours],
    );
    leads_soon(&manager).await;
    let live = Live::new(plane, &ours, &["web-a"]).await;
    wait_condition(
        &live.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    // A change in the other namespace after ours was reconciled; then a change in ours that
    // the manager is seen to handle, so the other's had time to arrive.
    other_live
        .tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    let hash = config_hash(&live.deployment().await);
    live.tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"labels": {"touched": "yes"}}})),
        )
        .await
        .unwrap();
    wait_for("our tunnel's change is applied", WAIT, || async {
        (config_hash(&live.deployment().await) != hash).then_some(())
    })
    .await;

    let untouched = other_live.tunnels.get("web").await.unwrap();
    assert!(
        untouched.status.is_none() && untouched.metadata.finalizers.is_none(),
        "the other namespace's tunnel was reconciled: {:?} {:?}",
        untouched.status,
        untouched.metadata.finalizers
    );
    let deployments = Api::<Deployment>::namespaced(admin.clone(), &other)
        .list(&Default::default())
        .await
        .unwrap();
    assert!(deployments.items.is_empty(), "an agent in {other}");
    let requests = plane.requests_by(&user).await.unwrap();
    let inside = format!("/namespaces/{ours}/");
    let outside: Vec<_> = requests
        .iter()
        .filter(|e| e.object_ref.is_some() && !e.request_uri.contains(&inside))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    eprintln!(
        "{} requests by the manager, {} outside {ours}",
        requests.len(),
        outside.len()
    );
    assert!(
        requests.len() > 20,
        "only {} requests audited",
        requests.len()
    );
    assert!(outside.is_empty(), "requests outside {ours}: {outside:#?}");
    drop(manager);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_manager_takes_over_when_the_leader_is_killed() {
    let plane = plane().await;
    let ns = plane.create_namespace("failover").await.unwrap();
    let live = Live::new(plane, &ns, &["web-a"]).await;
    let (sa_a, sa_b) = (MANAGER_SA, "rstream-operator-b");
    let (user_a, user_b) = (sa_user(&ns, sa_a), sa_user(&ns, sa_b));
    let mut a = Process::manager(
        &manager_kubeconfig(&ns, sa_a).await,
        &ns,
        "manager-a",
        live.dir.path(),
        &["--namespace", &ns],
    );
    leads_soon(&a).await;
    let b = Process::manager(
        &manager_kubeconfig(&ns, sa_b).await,
        &ns,
        "manager-b",
        live.dir.path(),
        &["--namespace", &ns],
    );
    wait_condition(
        &live.tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    wait_for("the standby reports it follows", WAIT, || async {
        (leader_gauge(&b.metrics, rstream_operator::manager::TUNNEL_CONTROLLER).await == Some(0))
            .then_some(())
    })
    .await;
    let holder = || async {
        Api::<Lease>::namespaced(live.admin.clone(), &ns)
            .get(LEASE_NAME)
            .await
            .unwrap()
            .spec
            .and_then(|s| s.holder_identity)
    };
    assert_eq!(holder().await.as_deref(), Some("manager-a"));
    let hash_before = config_hash(&live.deployment().await);

    // The leader dies without releasing the Lease; the token rotates while nobody leads.
    a.kill9();
    let killed = Instant::now();
    let from = {
        plane.requests_by(&user_a).await.unwrap();
        plane.audit_events().unwrap().len()
    };
    Api::<Secret>::namespaced(live.admin.clone(), &ns)
        .patch(
            "rstream-credentials",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"stringData": {"token": "live-token-2"}})),
        )
        .await
        .unwrap();
    wait_for("the standby leads", Duration::from_secs(40), || async {
        b.leads().await.then_some(())
    })
    .await;
    let took_over = killed.elapsed();
    wait_for("the new leader rolls the agent", WAIT, || async {
        (config_hash(&live.deployment().await) != hash_before).then_some(())
    })
    .await;
    let converged = killed.elapsed();
    assert_eq!(holder().await.as_deref(), Some("manager-b"));

    // After the kill only b writes, and b's first tunnel write follows its Lease takeover.
    plane.requests_by(&user_b).await.unwrap();
    let events: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.is_write() && (e.user.username == user_a || e.user.username == user_b))
        .map(|e| {
            let who = if e.user.username == user_a { "a" } else { "b" };
            let resource = e.object_ref.map(|o| o.resource).unwrap_or_default();
            format!("{who} {} {resource}", e.verb)
        })
        .collect();
    eprintln!(
        "took over {took_over:?} after the kill, rolled the agent after {converged:?}; writes since: {events:?}"
    );
    assert!(
        events.iter().all(|e| e.starts_with("b ")),
        "the killed leader wrote: {events:?}"
    );
    let first_lease = events.iter().position(|e| e.ends_with(" leases"));
    let first_other = events.iter().position(|e| !e.ends_with(" leases"));
    assert!(
        matches!((first_lease, first_other), (Some(l), Some(o)) if l < o),
        "b wrote before it held the Lease: {events:?}"
    );
    assert!(
        events.iter().any(|e| e == "b patch deployments"),
        "{events:?}"
    );
    // The old term runs out first: the Lease lasts 15 s from a's last renewal (at most 2 s
    // before the kill), and b counts it on its own clock from when it saw that renewal.
    assert!(
        took_over >= Duration::from_secs(12),
        "took over {took_over:?} after the kill, inside the old term"
    );
    drop(b);
}

/// `rstream_agent_active` of the agent `process` (`None`: no answer).
async fn agent_active(process: &Process) -> Option<i64> {
    gauge(&process.metrics, "rstream_agent_active{tunnel=\"web\"}").await
}

/// What a steady request stream saw: requests sent, failed, the time from the first failure to
/// the last, and when each failure was sent with what it got.
struct Requests {
    sent: u32,
    failed: u32,
    window: Duration,
    failures: Vec<(Instant, String)>,
}

/// `GET /` to `addr` every 20 ms until `stop`.
fn steady_requests(
    addr: std::net::SocketAddr,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Requests> {
    steady_requests_every(addr, Duration::from_millis(20), stop)
}

/// `GET /` to `addr`, one after the other with `pause` between, until `stop`.
fn steady_requests_every(
    addr: std::net::SocketAddr,
    pause: Duration,
    stop: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<Requests> {
    tokio::spawn(async move {
        let mut sent = 0;
        let mut failures = Vec::new();
        while !stop.is_cancelled() {
            sent += 1;
            let at = Instant::now();
            let answered = tokio::time::timeout(Duration::from_secs(10), http_get(addr)).await;
            match answered {
                Ok(Ok(r)) if r.starts_with("HTTP/1.1 200") => {}
                Ok(Ok(r)) if r.is_empty() => failures.push((at, "closed without an answer".into())),
                Ok(Ok(r)) => failures.push((at, r.lines().next().unwrap_or_default().to_owned())),
                Ok(Err(e)) => failures.push((at, e.to_string())),
                Err(_) => failures.push((at, "no answer in 10 s".into())),
            }
            tokio::time::sleep(pause).await;
        }
        let window = match (failures.first(), failures.last()) {
            (Some((first, _)), Some((last, _))) => *last - *first,
            _ => Duration::ZERO,
        };
        Requests {
            sent,
            failed: u32::try_from(failures.len()).unwrap_or(u32::MAX),
            window,
            failures,
        }
    })
}

/// Waits until agent `process` is ready on standby: /readyz answers 200, it holds nothing.
async fn stands_by(process: &Process) {
    wait_for("the agent ready on standby", WAIT, || async {
        let ready = http_status(&process.health, "/readyz").await == 200;
        (ready && agent_active(process).await == Some(0)).then_some(())
    })
    .await;
}

const HOSTNAME: &str = "web.standby.example.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_agent_leaves_the_status_alone_and_takes_the_tunnel_over() {
    let plane = plane().await;
    let ns = plane.create_namespace("standby").await.unwrap();
    let live = Live::new(plane, &ns, &["web-a"]).await;
    // A hostname, which the engine keeps exclusive: what lets agents stand by.
    live.tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"hostname": HOSTNAME}})),
        )
        .await
        .unwrap();
    let kubeconfig = manager_kubeconfig(&ns, MANAGER_SA).await;
    let manager = Process::manager(
        &kubeconfig,
        &ns,
        "manager-a",
        live.dir.path(),
        &["--namespace", &ns],
    );
    leads_soon(&manager).await;
    let deployments: Api<Deployment> = Api::namespaced(live.admin.clone(), &ns);
    wait_for("two agents in the Deployment", WAIT, || async {
        let t = live.tunnels.get("web").await.ok()?;
        let base = rstream_operator::names::base_name(&ns, "web", t.metadata.uid.as_deref());
        let d = deployments.get_opt(&base).await.ok()??;
        (d.spec.replicas == Some(2)).then_some(())
    })
    .await;

    // The first agent holds the tunnel; the second stands by, ready, on one open channel.
    let mut first = live.start_agent(plane, "web-agent-0").await;
    let ingress = live.online("web-agent-0").await;
    // The engine's address of the hostname, whichever tunnel holds it.
    let public = live.engine.hostname_ingress_addr(HOSTNAME).unwrap();
    assert_eq!(ingress, public);
    assert_eq!(body_through(public).await, Ok(body_of("web-a")));
    let mut second = live.start_agent(plane, "web-agent-1").await;
    stands_by(&second).await;
    assert_eq!(agent_active(&first).await, Some(1));
    let logins = live.engine.control_logins().len();
    let held = live.tunnels.get("web").await.unwrap();
    // Several of the standby's retries (1 s apart) later: the status still names the first
    // agent and its tunnel, and the standby never logged in again.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let t = live.tunnels.get("web").await.unwrap();
    let (status, reason, message) = condition(&t, "TunnelReady").unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("True", "TunnelOnline"));
    assert!(message.contains("web-agent-0"), "{message}");
    assert_eq!(
        t.status.as_ref().unwrap().tunnel_id,
        held.status.as_ref().unwrap().tunnel_id
    );
    assert_eq!(
        t.metadata.resource_version, held.metadata.resource_version,
        "the tunnel was written while nothing changed"
    );
    assert_eq!(live.engine.control_logins().len(), logins);
    assert_eq!(live.engine.tunnels().len(), 1);
    assert_eq!(agent_active(&second).await, Some(0));

    // SIGTERM to the active agent (a rollout, a drain): it lets go, the standby takes over, and
    // the hostname's address answers again.
    let stop = tokio_util::sync::CancellationToken::new();
    let stream = steady_requests(public, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopped = Instant::now();
    assert!(first.terminate().await, "{}", first.logs());
    assert_eq!(live.online("web-agent-1").await, public);
    let after_term = stopped.elapsed();
    assert_eq!(body_through(public).await, Ok(body_of("web-a")));
    assert_eq!(agent_active(&second).await, Some(1));
    stop.cancel();
    let term = stream.await.unwrap();

    // SIGKILL (a lost Pod): the engine drops the tunnel with its channel, a third agent on
    // standby takes over.
    let third = live.start_agent(plane, "web-agent-2").await;
    stands_by(&third).await;
    let stop = tokio_util::sync::CancellationToken::new();
    let stream = steady_requests(public, stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    second.kill9();
    assert_eq!(live.online("web-agent-2").await, public);
    let after_kill = killed.elapsed();
    assert_eq!(body_through(public).await, Ok(body_of("web-a")));
    stop.cancel();
    let kill = stream.await.unwrap();
    // Figures, not bounds. SIGTERM is a planned hand-over (the standby is ready and asking fast
    // before the holder lets go); SIGKILL leaves a gap of about one standby retry (1 s, jittered).
    eprintln!(
        "hand-over after SIGTERM: status names the standby after {after_term:?}; requests \
         failed {}/{} over {:?}. After SIGKILL: {after_kill:?}; failed {}/{} over {:?}",
        term.failed, term.sent, term.window, kill.failed, kill.sent, kill.window
    );
    drop(third);
    drop(manager);
    let base = live.base().await;
    for user in [sa_user(&ns, MANAGER_SA), sa_user(&ns, &base)] {
        let forbidden = forbidden_requests(plane, &user).await;
        assert!(forbidden.is_empty(), "{user} was denied: {forbidden:?}");
    }
}

/// Which of `agents` holds the tunnel now (its `rstream_agent_active` is 1), waiting for one.
async fn holder_of(agents: &[(String, Process)]) -> String {
    wait_for("an agent holding the tunnel", WAIT, || async {
        for (pod, process) in agents {
            if agent_active(process).await == Some(1) {
                return Some(pod.clone());
            }
        }
        None
    })
    .await
}

/// Two rollouts of a tunnel's two agents as the Deployment makes them (maxSurge 1,
/// maxUnavailable 0: a new agent ready on standby, then an old one stopped with SIGTERM, in
/// turn), with a request through the hostname's address every 10 ms throughout. Every stop of
/// the holder is a planned hand-over. The failed requests and the hand-over times are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_the_agents_twice_under_a_steady_request_stream() {
    let plane = plane().await;
    let ns = plane.create_namespace("rollout").await.unwrap();
    let live = Live::new(plane, &ns, &["web-a"]).await;
    let hostname = "web.rollout.example.test";
    live.tunnels
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"hostname": hostname}})),
        )
        .await
        .unwrap();
    let kubeconfig = manager_kubeconfig(&ns, MANAGER_SA).await;
    let manager = Process::manager(
        &kubeconfig,
        &ns,
        "manager-a",
        live.dir.path(),
        &["--namespace", &ns],
    );
    leads_soon(&manager).await;
    let deployments: Api<Deployment> = Api::namespaced(live.admin.clone(), &ns);
    wait_for("two agents in the Deployment", WAIT, || async {
        let t = live.tunnels.get("web").await.ok()?;
        let base = rstream_operator::names::base_name(&ns, "web", t.metadata.uid.as_deref());
        let d = deployments.get_opt(&base).await.ok()??;
        (d.spec.replicas == Some(2)).then_some(())
    })
    .await;
    let mut agents: Vec<(String, Process)> = Vec::new();
    let first = live.start_agent(plane, "web-agent-0").await;
    live.online("web-agent-0").await;
    agents.push(("web-agent-0".into(), first));
    let second = live.start_agent(plane, "web-agent-1").await;
    stands_by(&second).await;
    agents.push(("web-agent-1".into(), second));
    let public = live.engine.hostname_ingress_addr(hostname).unwrap();
    assert_eq!(body_through(public).await, Ok(body_of("web-a")));

    let requests_before = live.engine.tunnel_requests().len();
    let misses_before = live.engine.hostname_misses();
    let stop = tokio_util::sync::CancellationToken::new();
    let stream = steady_requests_every(public, Duration::from_millis(10), stop.clone());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // (stopped pod, was it the holder, SIGTERM sent, the next holder online after)
    let mut stops: Vec<(String, bool, Instant, Duration)> = Vec::new();
    let mut next = 2;
    for _rollout in 0..2 {
        for _ in 0..2 {
            let pod = format!("web-agent-{next}");
            next += 1;
            let surge = live.start_agent(plane, &pod).await;
            stands_by(&surge).await;
            agents.push((pod, surge));
            // The oldest agent goes, whatever it does.
            let holder = holder_of(&agents).await == agents[0].0;
            let (old, mut process) = agents.remove(0);
            let sent = Instant::now();
            assert!(process.terminate().await, "{}", process.logs());
            // A planned hand-over: the holder let go once a standby said it was ready.
            if holder {
                let logs = process.logs();
                assert!(
                    logs.lines().any(|l| l.contains("Handing the tunnel over")
                        && l.contains("standby_ready=true")),
                    "{old} let go without a ready standby:\n{logs}"
                );
            }
            let online = if holder {
                holder_of(&agents).await;
                sent.elapsed()
            } else {
                Duration::ZERO
            };
            stops.push((old, holder, sent, online));
            // Requests keep flowing between stops, as between a rollout's steps.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let seen = stream.await.unwrap();
    assert_eq!(body_through(public).await, Ok(body_of("web-a")));
    let holders = stops.iter().filter(|s| s.1).count();
    assert!(
        holders >= 1,
        "no stop hit the holder: {:?}",
        stops.iter().map(|s| &s.0).collect::<Vec<_>>()
    );
    let mut lines = Vec::new();
    for (i, (pod, holder, sent, online)) in stops.iter().enumerate() {
        let until = stops.get(i + 1).map(|s| s.2);
        let failed: Vec<_> = (seen.failures.iter())
            .filter(|(at, _)| at >= sent && until.is_none_or(|u| *at < u))
            .map(|(at, what)| format!("{:?} after SIGTERM: {what}", *at - *sent))
            .collect();
        lines.push(format!(
            "{pod} ({}): {}; failed {}: {failed:?}",
            if *holder { "holder" } else { "standby" },
            if *holder {
                format!("next holder active after {online:?}")
            } else {
                "no hand-over".into()
            },
            failed.len()
        ));
    }
    let before = seen
        .failures
        .iter()
        .filter(|(at, _)| at < &stops[0].2)
        .count();
    // Streams the engine routed to an agent that refused or lost them (the other failures found
    // no holder).
    let refused: Vec<_> = (live.engine.proxy_conn_rsps().into_iter())
        .filter_map(|r| r.error.and_then(|e| e.message))
        .collect();
    let asked = live.engine.tunnel_requests().len() - requests_before;
    let misses = live.engine.hostname_misses() - misses_before;
    eprintln!(
        "two rollouts, {holders} hand-overs of the holder, one request every 10 ms: {} of {} failed \
         (over {:?}; {before} before the first stop); found no holder at the engine: {misses}; \
         streams refused by an agent: {refused:?}; requests for the hostname meanwhile: {asked}\n  {}",
        seen.failed,
        seen.sent,
        seen.window,
        lines.join("\n  ")
    );
    // After the figures: the last hand-over is over, and says who holds the tunnel.
    let last = holder_of(&agents).await;
    let t = live.tunnels.get("web").await.unwrap();
    let (status, reason, message) = condition(&t, "HandOver").unwrap();
    assert_eq!((status.as_str(), reason.as_str()), ("False", "HandedOver"));
    assert!(message.contains(&last), "{message}");
    drop(agents);
    drop(manager);
}
