//! pod-proxier on a bad day, on a real kube-apiserver and etcd of its own: the API server stops
//! while mappings are served, etcd is compacted and restarted, the API server comes back with a
//! fresh watch cache (every watch gets 410 Gone). The data path keeps forwarding, the process is
//! never restarted, and nothing is deleted or re-created because it was briefly missing from a
//! cache. A Lease taken by another holder: the old leader stops writing until it leads again. A
//! verb taken out of its Role: said in the log, retried with backoff, recovered when it returns.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use support::{Env, Proxier, backend, eventually, free_range, greeting, own_plane, v1_v2_flags};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_server_and_etcd_restarts_keep_every_mapping() {
    // Broken on purpose, so a plane of its own (it lives until the test binary exits).
    let plane = own_plane(&[]).await;
    let env = Env::on(plane, "chaos", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.61", "chaos-pod")
        .await;
    let mut px = Proxier::start(&env, &v1_v2_flags(3)).await;
    let token = env.debugger(&ns).await;
    px.map(Some(&token), &format!("{ns}/pod-a"), 600).await;
    let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "svc-a", "namespace": ns},
        "spec": {"ports": [{"name": "debug", "port": 80}]}}))
    .unwrap();
    Api::<Service>::namespaced(env.admin.clone(), &ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let svc_name = format!("svc.{ns}.svc-a.debug");
    eventually("svc-a is published", Duration::from_secs(30), || async {
        env.mappings().get_opt(&svc_name).await.unwrap().is_some()
    })
    .await;
    // Steady state first: the leader has written every mapping's status.
    eventually(
        "every mapping has a status",
        Duration::from_secs(30),
        || async {
            env.mappings()
                .list(&Default::default())
                .await
                .unwrap()
                .items
                .iter()
                .all(|m| m.status.as_ref().is_some_and(|s| s.phase.is_some()))
        },
    )
    .await;
    let before: Vec<_> = env
        .mappings()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|m| (m.metadata.name, m.metadata.uid, m.spec.entry_port))
        .collect();
    assert_eq!(greeting(px.entry).await.as_deref(), Some("chaos-pod"));

    // History every watch must skip, then the API server stops; while it is down the data path
    // forwards; etcd is compacted and restarted; the API server comes back.
    let maps: Api<ConfigMap> = Api::namespaced(env.admin.clone(), &ns);
    for i in 0..20 {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(format!("churn-{i}"));
        maps.create(&PostParams::default(), &cm).await.unwrap();
    }
    plane.requests_by(&px.user).await.unwrap();
    let since_stop = plane.audit_events().unwrap().len();
    plane.stop_apiserver().await.unwrap();
    let mut answered_while_down = 0;
    for _ in 0..5 {
        if greeting(px.entry).await.as_deref() == Some("chaos-pod") {
            answered_while_down += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let revision = plane.compact_etcd().await.unwrap();
    plane.restart_etcd(Duration::from_secs(2)).await.unwrap();
    plane.start_apiserver().await.unwrap();
    let back = Instant::now();
    eprintln!(
        "while the API server was down: {answered_while_down}/5 answered through the entry port; etcd compacted at {revision}"
    );
    assert_eq!(answered_while_down, 5, "{}", px.logs());

    // pod-proxier lists its mappings again: the fault reached its watches.
    let user = px.user.clone();
    let ours = |from: usize| {
        plane
            .audit_events()
            .unwrap()
            .into_iter()
            .skip(from)
            .filter(|e| e.user.username == user)
            .collect::<Vec<_>>()
    };
    eventually(
        "pod-proxier lists the PortMappings again",
        Duration::from_secs(30),
        || async {
            ours(since_stop).iter().any(|e| {
                e.verb == "list"
                    && e.object_ref
                        .as_ref()
                        .is_some_and(|o| o.resource == "portmappings")
            })
        },
    )
    .await;
    let relisted = back.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    plane.requests_by(&user).await.unwrap();
    let events = ours(since_stop);
    let destructive: Vec<_> = events
        .iter()
        .filter(|e| matches!(e.verb.as_str(), "delete" | "deletecollection" | "create"))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    let denied_writes: Vec<_> = events
        .iter()
        .filter(|e| e.is_write() && e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    let mut writes = std::collections::BTreeMap::new();
    for e in events.iter().filter(|e| e.is_write()) {
        let (resource, sub) = e.object_ref.as_ref().map_or(("", ""), |o| {
            (o.resource.as_str(), o.subresource.as_deref().unwrap_or(""))
        });
        let agent = e.user_agent.as_deref().unwrap_or("");
        *writes
            .entry(format!("{} {resource}/{sub} ({agent})", e.verb))
            .or_insert(0) += 1;
    }
    eprintln!(
        "pod-proxier's requests across the fault: {}; writes {writes:?}; relisted {relisted:?} after the API server was back",
        events.len(),
    );
    // Only the Lease is renewed: no mapping is rewritten because of the fault.
    assert!(
        writes.keys().all(|w| w.contains(" leases/")),
        "writes other than the Lease across the fault: {writes:?}"
    );
    assert!(destructive.is_empty(), "{destructive:?}\n{}", px.logs());
    assert!(denied_writes.is_empty(), "{denied_writes:?}");
    let after: Vec<_> = env
        .mappings()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|m| (m.metadata.name, m.metadata.uid, m.spec.entry_port))
        .collect();
    assert_eq!(after, before, "mappings changed across the fault");
    assert!(px.running(), "the process exited:\n{}", px.logs());
    assert_eq!(greeting(px.entry).await.as_deref(), Some("chaos-pod"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_stops_the_writes_before_the_new_holder_starts() {
    let env = Env::new("chaos-lease", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.62", "lease-pod")
        .await;
    let px = Proxier::start(&env, &["--enable-v1"]).await;
    let identity = format!("replica-{}", env.state_ns);
    let leases: Api<Lease> = Api::namespaced(env.admin.clone(), &env.state_ns);
    let holder = || async {
        leases
            .get_opt("pod-proxier")
            .await
            .unwrap()
            .and_then(|l| l.spec?.holder_identity)
    };
    eventually("pod-proxier leads", Duration::from_secs(30), || async {
        holder().await.as_deref() == Some(identity.as_str())
    })
    .await;
    let token = env.debugger(&ns).await;
    px.map(Some(&token), &format!("{ns}/pod-a"), 4).await;
    let name = env
        .mappings()
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .first()
        .and_then(|m| m.metadata.name.clone())
        .unwrap();

    eventually(
        "the leader wrote the mapping's status",
        Duration::from_secs(30),
        || async {
            env.mappings()
                .get(&name)
                .await
                .unwrap()
                .status
                .is_some_and(|s| s.phase.is_some())
        },
    )
    .await;

    // Another holder takes the Lease for 10 s; the mapping expires 4 s after it was made. The old
    // leader must leave its deletion (and every other write) to whoever holds the Lease.
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    let taken = Instant::now();
    leases
        .patch(
            "pod-proxier",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "holderIdentity": "intruder",
                "leaseDurationSeconds": 10,
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .unwrap();
    // A real successor waits out the old term; this one does not: once the old leader has seen
    // it (its leader gauge drops to 0), count.
    eventually(
        "the old leader sees the Lease taken",
        Duration::from_secs(30),
        || async { leader_gauge(&px).await == Some(0) },
    )
    .await;
    let seen = taken.elapsed();
    let plane = env.plane;
    plane.requests_by(&px.user).await.unwrap();
    let from = plane.audit_events().unwrap().len();
    tokio::time::sleep(Duration::from_secs(5)).await;
    plane.requests_by(&px.user).await.unwrap();
    let meanwhile: Vec<_> = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == px.user && e.is_write())
        .filter(|e| e.object_ref.as_ref().is_none_or(|o| o.resource != "leases"))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(
        meanwhile.is_empty(),
        "pod-proxier wrote while another held the Lease: {meanwhile:?}\n{}",
        px.logs()
    );
    assert!(
        env.mappings().get_opt(&name).await.unwrap().is_some(),
        "the expired mapping was removed inside the intruder's term"
    );

    // The intruder's term runs out: pod-proxier leads again and removes the expired mapping.
    eventually(
        "pod-proxier leads again and removes the expired mapping",
        Duration::from_secs(30),
        || async { env.mappings().get_opt(&name).await.unwrap().is_none() },
    )
    .await;
    let removed = taken.elapsed();
    eprintln!(
        "the takeover seen after {seen:?}; expired mapping removed {removed:?} after it (intruder's term: 10 s)"
    );
    assert!(
        removed >= Duration::from_secs(10),
        "removed after {removed:?}"
    );
    assert_eq!(holder().await.as_deref(), Some(identity.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verb_taken_away_is_reported_backed_off_and_recovered() {
    let env = Env::new("chaos-perm", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.63", "perm-pod")
        .await;
    let px = Proxier::start(&env, &["--enable-v1"]).await;
    // `patch` on portmappings/status leaves the state Role: the leader cannot write a status.
    let roles: Api<Role> = Api::namespaced(env.admin.clone(), &env.state_ns);
    let full = roles.get("pod-proxier").await.unwrap();
    let mut narrowed = full.clone();
    narrowed.metadata.managed_fields = None;
    narrowed.metadata.resource_version = None;
    narrowed.rules.get_or_insert_with(Vec::new).retain(|r| {
        !r.resources
            .iter()
            .flatten()
            .any(|x| x == "portmappings/status")
    });
    roles
        .replace(
            "pod-proxier",
            &PostParams::default(),
            &with_version(&roles, narrowed.clone()).await,
        )
        .await
        .unwrap();
    let plane = env.plane;
    plane.requests_by(&px.user).await.unwrap();
    let from = plane.audit_events().unwrap().len();
    let log_from = px.logs().len();
    let token = env.debugger(&ns).await;
    px.map(Some(&token), &format!("{ns}/pod-a"), 600).await;
    // Mapping works without its status: the data path does not need it.
    assert_eq!(greeting(px.entry).await.as_deref(), Some("perm-pod"));
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    plane.requests_by(&px.user).await.unwrap();
    let denied = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == px.user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .count();
    let logs = px.logs()[log_from..].to_owned();
    let said = logs
        .lines()
        .filter(|l| l.contains("updating status"))
        .count();
    eprintln!("{denied} denied status writes and {said} log lines saying so in {window:?}");
    assert!(denied >= 1, "the leader never tried:\n{logs}");
    // Backed off (1 s doubling): about 5 attempts in 20 s, not one a second.
    assert!(
        denied <= 6,
        "{denied} denied requests in {window:?}: not backing off"
    );
    assert!(said <= denied, "said {said} times for {denied} denials");
    assert!(
        logs.contains("patch") && logs.contains("portmappings/status"),
        "the log does not name the verb and resource:\n{logs}"
    );

    // The verb comes back: the status is written within one backoff period (at most 60 s).
    roles
        .replace(
            "pod-proxier",
            &PostParams::default(),
            &with_version(&roles, full).await,
        )
        .await
        .unwrap();
    let restored = Instant::now();
    eventually("the status is written", Duration::from_secs(61), || async {
        env.mappings()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .iter()
            .all(|m| m.status.as_ref().is_some_and(|s| s.phase.is_some()))
    })
    .await;
    eprintln!(
        "status written {:?} after the verb came back",
        restored.elapsed()
    );
}

/// `role` with the current resourceVersion of its namesake, for a replace.
async fn with_version(roles: &Api<Role>, mut role: Role) -> Role {
    let current = roles
        .get(&role.metadata.name.clone().unwrap())
        .await
        .unwrap();
    role.metadata.resource_version = current.metadata.resource_version;
    role.metadata.managed_fields = None;
    role
}

/// The value of `leader_election_master_status{name="pod-proxier"}` on `/metrics`, if it answers.
async fn leader_gauge(px: &Proxier) -> Option<i64> {
    let (_, text) = support::get_text(px.metrics, "/metrics").await.ok()?;
    text.lines()
        .find(|l| l.starts_with(r#"leader_election_master_status{name="pod-proxier"}"#))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_api_server_is_noticed_the_data_plane_serves_and_it_converges() {
    // Frozen on purpose, so a plane of its own (it lives until the test binary exits). Its
    // Services are on loopback: with --v2-target cluster-ip a V2 mapping relays without a node
    // (a server on the ClusterIP stands in for kube-proxy and the Pod behind it).
    let plane = own_plane(&["--service-cluster-ip-range=127.100.1.0/24"]).await;
    let env = Env::on(plane, "hung", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.64", "hung-pod")
        .await;
    let (start, end) = free_range(3);
    let mut px = Proxier::start(
        &env,
        &[
            "--enable-v1",
            "--enable-v2",
            "--v2-target",
            "cluster-ip",
            "--port-range-start",
            &start.to_string(),
            "--port-range-end",
            &end.to_string(),
            "--off-check",
            "--request-timeout",
            "5s",
        ],
    )
    .await;
    eventually("pod-proxier leads", Duration::from_secs(30), || async {
        leader_gauge(&px).await == Some(1)
    })
    .await;
    let token = env.debugger(&ns).await;
    // The TTL ends inside the freeze, after the leader had to step down (renew deadline 10 s).
    let body = px.map(Some(&token), &format!("{ns}/pod-a"), 18).await;
    let expires_at: k8s_openapi::jiff::Timestamp = body["data"]["expires_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let name = format!("v1-entry-{}", px.entry.port());
    assert!(env.mappings().get_opt(&name).await.unwrap().is_some());
    // A V2 mapping that lives on across the freeze: relayed throughout, and the new term after
    // it must not rewrite it.
    let svc_server = backend("127.100.1.10", "hung-svc").await;
    let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "svc-a", "namespace": ns},
        "spec": {"clusterIP": "127.100.1.10",
            "ports": [{"name": "debug", "port": svc_server.port()}]}}))
    .unwrap();
    Api::<Service>::namespaced(env.admin.clone(), &ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    eventually(
        "the leader wrote both mappings' status",
        Duration::from_secs(30),
        || async {
            let items = env
                .mappings()
                .list(&Default::default())
                .await
                .unwrap()
                .items;
            items.len() == 2
                && items
                    .iter()
                    .all(|m| m.status.as_ref().is_some_and(|s| s.phase.is_some()))
        },
    )
    .await;
    let v2_port = env
        .mappings()
        .get(&format!("svc.{ns}.svc-a.debug"))
        .await
        .unwrap()
        .spec
        .entry_port;
    let v2_entry = std::net::SocketAddr::from(([127, 0, 0, 1], u16::try_from(v2_port).unwrap()));
    eventually("the V2 port relays", Duration::from_secs(30), || async {
        greeting(v2_entry).await.as_deref() == Some("hung-svc")
    })
    .await;
    let until_deadline = |at: k8s_openapi::jiff::Timestamp| {
        Duration::from_millis(
            u64::try_from(
                at.as_millisecond() - k8s_openapi::jiff::Timestamp::now().as_millisecond(),
            )
            .unwrap_or(0),
        )
    };
    // Freeze 14 s before the deadline.
    tokio::time::sleep(until_deadline(expires_at).saturating_sub(Duration::from_secs(14))).await;
    assert_eq!(greeting(px.entry).await.as_deref(), Some("hung-pod"));
    let mut held = tokio::net::TcpStream::connect(px.entry).await.unwrap();
    assert_eq!(read_line(&mut held).await.as_deref(), Some("hung-pod"));
    // A caller whose token was never reviewed: its request needs the API server.
    let stranger = env
        .caller(&ns, "stranger", vec![support::port_forward_rule()])
        .await;
    let from = {
        plane.requests_by(&px.user).await.unwrap();
        plane.audit_events().unwrap().len()
    };
    let log_from = px.logs().len();

    plane.pause_apiserver().await.unwrap();
    let frozen = Instant::now();
    let freeze = Duration::from_secs(20);
    let api_call = {
        let api = px.api;
        let path = format!("/api/v1/mapping?pod_name={ns}/pod-a");
        tokio::spawn(async move {
            let asked = Instant::now();
            let answer = support::request(api, "GET", &path, Some(&stranger), None, b"").await;
            (answer, asked.elapsed())
        })
    };
    let (mut noticed, mut unready) = (None, Vec::new());
    let (mut before, mut lost, mut after, mut served_late) = (0, 0, 0, 0);
    let (mut echoed, mut samples) = (0, 0);
    let (mut v2_samples, mut v2_lost) = (0, Vec::new());
    let deadline_in_freeze = until_deadline(expires_at);
    while frozen.elapsed() < freeze {
        let at = frozen.elapsed();
        let answered = greeting(px.entry).await.as_deref() == Some("hung-pod");
        v2_samples += 1;
        if greeting(v2_entry).await.as_deref() != Some("hung-svc") {
            v2_lost.push(at);
        }
        // Half a second before the deadline and two after it are left out: the clocks of the
        // test and of the data plane are read at different moments, and a busy machine runs
        // the expiry timer late (how late is a bench's figure, not this test's).
        if at + Duration::from_millis(500) < deadline_in_freeze {
            before += 1;
            lost += usize::from(!answered);
        } else if at > deadline_in_freeze + Duration::from_secs(2) {
            after += 1;
            served_late += usize::from(answered);
        }
        samples += 1;
        if round_trip(&mut held, samples).await {
            echoed += 1;
        }
        if noticed.is_none() && leader_gauge(&px).await == Some(0) {
            noticed = Some(frozen.elapsed());
        }
        match support::get_text(px.metrics, "/readyz").await {
            Ok((200, _)) => {}
            other => unready.push(format!("{:?}: {other:?}", frozen.elapsed())),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let ((api_status, api_body), api_took) = api_call.await.unwrap();
    // Times after the resume count from SIGCONT, the API server's own return to ready included.
    let resumed = Instant::now();
    plane.resume_apiserver().await.unwrap();
    let answering = resumed.elapsed();
    eprintln!(
        "frozen {freeze:?}: stepped down after {noticed:?}; API call answered {api_status} after {api_took:?}; \
         entry port: {before} new connections before the deadline ({lost} lost), {after} after it ({served_late} served); \
         held connection echoed {echoed}/{samples}; V2 port: {v2_samples} new connections, lost at {v2_lost:?}; \
         unready samples: {unready:?}"
    );
    assert!(v2_lost.is_empty(), "V2 connections lost during the freeze");
    assert_eq!(lost, 0, "connections lost during the freeze\n{}", px.logs());
    // Enough samples either side to mean something, few enough for a busy machine.
    assert!(before >= 5, "only {before} samples before the deadline");
    assert!(after >= 2, "only {after} samples after the deadline");
    assert_eq!(
        served_late, 0,
        "the data plane forwarded past the deadline without the API server"
    );
    // An established connection outlives the deadline too (V1 cuts them only when asked).
    assert_eq!(echoed, samples, "the held connection broke");
    assert!(
        unready.is_empty(),
        "unready while the data plane served: {unready:?}"
    );
    // Noticed by its own timeout: the renew deadline (10 s after the last renewal, at most one
    // retry period of 2 s before the freeze), not by an error from the server: not before 7 s,
    // and within the freeze (how soon after the renew deadline is a bench's figure).
    let noticed = noticed.unwrap_or_else(|| panic!("never stepped down:\n{}", px.logs()));
    assert!(
        noticed >= Duration::from_secs(7),
        "stepped down {noticed:?} into the freeze"
    );
    let logs = px.logs()[log_from..].to_owned();
    assert!(logs.contains("lost the Lease"), "{logs}");
    // The request timeout answers a caller the server cannot serve.
    // Answered by the timeout (not before it), within the client's own 20 s.
    assert_eq!(api_status, 503, "{api_body}");
    assert!(
        api_took >= Duration::from_secs(5),
        "answered after {api_took:?}"
    );

    // Converges: leads again and removes the mapping that expired in the freeze.
    eventually(
        "pod-proxier leads again",
        Duration::from_secs(30),
        || async { leader_gauge(&px).await == Some(1) },
    )
    .await;
    let leads_again = resumed.elapsed();
    eventually(
        "the expired mapping is removed",
        Duration::from_secs(30),
        || async { env.mappings().get_opt(&name).await.unwrap().is_none() },
    )
    .await;
    let converged = resumed.elapsed();
    eprintln!(
        "after SIGCONT: the API server ready after {answering:?}, pod-proxier leads again after {leads_again:?}, \
         the expired mapping removed after {converged:?}"
    );

    // Across the fault and the convergence, one write: the expired mapping's delete. Nothing
    // else but the Lease (and the reviews of the API call, which store nothing).
    plane.requests_by(&px.user).await.unwrap();
    let mut writes = std::collections::BTreeMap::<String, usize>::new();
    for e in plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == px.user && e.is_write())
    {
        let (resource, sub, object) = e.object_ref.as_ref().map_or(("", "", ""), |o| {
            (
                o.resource.as_str(),
                o.subresource.as_deref().unwrap_or(""),
                o.name.as_deref().unwrap_or(""),
            )
        });
        if matches!(resource, "leases" | "tokenreviews" | "subjectaccessreviews") {
            continue;
        }
        *writes
            .entry(format!("{} {resource}/{sub} {object}", e.verb))
            .or_default() += 1;
    }
    eprintln!("writes across the fault: {writes:?}");
    assert!(
        env.mappings()
            .get_opt(&format!("svc.{ns}.svc-a.debug"))
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        writes,
        [(format!("delete portmappings/ {name}"), 1)].into(),
        "{}",
        px.logs()
    );

    // A mapping made now is served at once: the API works again.
    px.map(Some(&token), &format!("{ns}/pod-a"), 600).await;
    eventually("served again", Duration::from_secs(30), || async {
        greeting(px.entry).await.as_deref() == Some("hung-pod")
    })
    .await;
    assert!(px.running(), "the process exited:\n{}", px.logs());
}

/// Reads one line (without its newline) from `stream`, within 3 s.
async fn read_line(stream: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt as _;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match stream.read(&mut byte).await {
                Ok(1) if byte[0] != b'\n' => line.push(byte[0]),
                _ => return,
            }
        }
    })
    .await
    .ok()?;
    Some(String::from_utf8_lossy(&line).into_owned())
}

/// One echo round trip on a held connection, within 2 s.
async fn round_trip(stream: &mut tokio::net::TcpStream, n: usize) -> bool {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let message = format!("message {n}\n");
    if stream.write_all(message.as_bytes()).await.is_err() {
        return false;
    }
    let mut back = vec![0; message.len()];
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut back)).await;
    matches!(read, Ok(Ok(_))) && back == message.as_bytes()
}
