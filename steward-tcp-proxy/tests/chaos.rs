//! steward-tcp-proxy on a bad day, on a real kube-apiserver and etcd: the API server restarts,
//! etcd restarts after a compaction, another holder takes the Lease, a verb is taken out of its
//! Role. Each test has a control plane
//! of its own, since it breaks it on purpose.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::{Duration, Instant};

use futures::{AsyncReadExt as _, StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, Patch, PatchParams, PostParams};
use netkit_testenv::{AuditEvent, ControlPlane, Identity, eventually};
use support::{Proxy, create_proxy_service, published};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const USER: &str = "steward-chaos";

/// A control plane of its own, steward (leader-elected, ClusterIP mode) relaying to an echo
/// server, and the addresses it publishes.
struct Setup {
    plane: ControlPlane,
    client: kube::Client,
    ns: String,
    proxy: Proxy,
    expected: (Vec<String>, i32),
}

async fn setup(identity: &str, extra: &[&str]) -> Setup {
    let plane = ControlPlane::builder()
        .apiserver_arg("--endpoint-reconciler-type=none")
        .start()
        .await
        .unwrap();
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-chaos").await.unwrap();
    let cluster_ip = create_proxy_service(&client, &ns)
        .await
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let echo = netkit_testenv::fixtures::echo_server().await.unwrap();
    let kubeconfig = plane
        .kubeconfig_as(&Identity::User {
            name: USER.into(),
            group: Some("system:masters".into()),
        })
        .await
        .unwrap();
    let (namespace_flag, identity_flag) = (
        format!("--service-namespace={ns}"),
        format!("--identity={identity}"),
    );
    let mut args = vec![
        namespace_flag.as_str(),
        "--service-name=proxy",
        "--endpoint-mode=cluster-ip",
        "--leader-elect",
        identity_flag.as_str(),
    ];
    args.extend_from_slice(extra);
    let proxy = Proxy::start(&kubeconfig, &echo.to_string(), &args);
    let expected = (vec![cluster_ip], 6443);
    eventually("steward publishes", Duration::from_secs(30), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;
    eventually("steward is ready", Duration::from_secs(30), || async {
        proxy.readyz().await.is_some_and(|(code, _)| code == 200)
    })
    .await;
    Setup {
        plane,
        client,
        ns,
        proxy,
        expected,
    }
}

/// One echo round trip on a held connection.
async fn round_trip(stream: &mut TcpStream, n: usize) -> bool {
    let message = format!("message {n}\n");
    if stream.write_all(message.as_bytes()).await.is_err() {
        return false;
    }
    let mut back = vec![0; message.len()];
    // A broken relay never answers; a busy machine answers late: 10 s tells them apart.
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut back)).await;
    matches!(read, Ok(Ok(_))) && back == message.as_bytes()
}

/// steward's successful reconciles so far (`controller_runtime_reconcile_total`).
async fn reconciles(proxy: &Proxy) -> u64 {
    proxy
        .metrics_text()
        .await
        .lines()
        .find(|l| {
            l.starts_with("controller_runtime_reconcile_total{") && l.contains("result=\"success\"")
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Rewrites the slice's addresses by hand, as an intruder would.
async fn edit_slice(client: &kube::Client) {
    Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"endpoints": [{"addresses": ["10.0.0.77"]}]})),
        )
        .await
        .unwrap();
}

/// The audit events of `USER` from index `from` on. The API server logs a request after
/// answering it, so this first waits (the barrier of `ControlPlane::requests_by`, as the other
/// crates' chaos tests use) until every request answered before the call is in the log.
async fn steward_events(plane: &ControlPlane, from: usize) -> Vec<AuditEvent> {
    plane.requests_by(USER).await.unwrap();
    plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == USER)
        .collect()
}

/// The audit log's length once every request answered so far is in it (same barrier): a mark
/// that no earlier request can land after.
async fn audit_mark(plane: &ControlPlane) -> usize {
    plane.requests_by(USER).await.unwrap();
    plane.audit_events().unwrap().len()
}

fn resource(e: &AuditEvent) -> &str {
    e.object_ref.as_ref().map_or("", |o| o.resource.as_str())
}

#[tokio::test]
async fn api_server_restart_keeps_relaying_and_repairs_promptly() {
    // No resync within the test: the repair below can only come from its watches.
    let s = setup("chaos-restart", &["--reconcile-interval=1h"]).await;
    let mut held = TcpStream::connect(s.proxy.listen).await.unwrap();
    assert!(round_trip(&mut held, 0).await);

    // While the API server is stopped for 5 s, the held connection keeps relaying and /readyz
    // stays 200: steward's data path does not need the API.
    let outage = s.plane.restart_apiserver(Duration::from_secs(5));
    let probe = async {
        let (mut echoed, mut ready, mut samples) = (0, 0, 0);
        let mut unready = String::new();
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            samples += 1;
            if round_trip(&mut held, samples).await {
                echoed += 1;
            }
            match s.proxy.readyz().await {
                Some((200, _)) => ready += 1,
                other => unready = format!("{other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        (echoed, ready, samples, unready)
    };
    let (restarted, (echoed, ready, samples, unready)) = tokio::join!(outage, probe);
    restarted.unwrap();
    let api_back = Instant::now();
    eprintln!("during the outage: {echoed}/{samples} echoes, {ready}/{samples} /readyz 200");
    assert_eq!(
        echoed,
        samples,
        "the held connection broke:\n{}",
        s.proxy.logs()
    );
    assert_eq!(
        ready,
        samples,
        "steward went unready: {unready}\n{}",
        s.proxy.logs()
    );

    // A slice edited as the API comes back (steward's watches are still broken) is repaired by
    // the watches once they are back (the resync is an hour away): typically within a second,
    // reported; the deadline is generous for a busy machine.
    edit_slice(&s.client).await;
    let mut repaired = None;
    while api_back.elapsed() < Duration::from_secs(30) {
        if published(&s.client).await.as_ref() == Some(&s.expected) {
            repaired = Some(api_back.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let repaired = repaired.unwrap_or_else(|| panic!("never repaired:\n{}", s.proxy.logs()));
    eprintln!("edit repaired {repaired:?} after the API server was back");
    assert!(round_trip(&mut held, 1000).await, "held connection after");
}

#[tokio::test]
async fn etcd_restart_after_compaction_deletes_and_recreates_nothing() {
    // A short resync: after the fault, a full reconcile comes soon (see below).
    let s = setup("chaos-etcd", &["--reconcile-interval=5s"]).await;
    let from = audit_mark(&s.plane).await;

    // Writes the watches will have to skip.
    let maps: Api<ConfigMap> = Api::namespaced(s.client.clone(), &s.ns);
    for i in 0..20 {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(format!("churn-{i}"));
        maps.create(&PostParams::default(), &cm).await.unwrap();
    }
    // With the API server down (so no bookmark can tell a client a newer revision), etcd is
    // compacted past everything and restarted, then the API server starts with a fresh watch
    // cache: resuming any watch from before is 410 Gone.
    let since_stop = audit_mark(&s.plane).await;
    s.plane.stop_apiserver().await.unwrap();
    let revision = s.plane.compact_etcd().await.unwrap();
    s.plane.restart_etcd(Duration::from_secs(2)).await.unwrap();
    s.plane.start_apiserver().await.unwrap();
    eprintln!("compacted etcd at revision {revision}; restarted etcd and the API server");

    // steward lists its objects again (proof the fault reached its watches) ...
    let relisted = Instant::now();
    while !steward_events(&s.plane, since_stop)
        .await
        .iter()
        .any(|e| e.verb == "list" && resource(e) == "endpointslices")
    {
        let seen: Vec<_> = steward_events(&s.plane, since_stop)
            .await
            .iter()
            .map(|e| format!("{} {} {:?}", e.verb, e.request_uri, e.response_status))
            .collect();
        assert!(
            relisted.elapsed() < Duration::from_secs(30),
            "steward did not list the slices again; its requests since: {seen:#?}\n{}",
            s.proxy.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("relisted {:?} after the restart", relisted.elapsed());
    // ... reconciles after that (it had its chance to delete and re-create: polled, not a
    // guessed sleep) ...
    let after_relist = reconciles(&s.proxy).await;
    eventually(
        "a reconcile after the relist",
        Duration::from_secs(60),
        || async { reconciles(&s.proxy).await > after_relist },
    )
    .await;
    s.plane.writes_by(USER).await.unwrap();
    // ... and across the whole fault it deleted and re-created nothing.
    let events = steward_events(&s.plane, from).await;
    let destructive: Vec<_> = events
        .iter()
        .filter(|e| matches!(e.verb.as_str(), "delete" | "deletecollection" | "create"))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    let writes: Vec<_> = events
        .iter()
        .filter(|e| e.is_write())
        .map(|e| format!("{} {}", e.verb, resource(e)))
        .collect();
    eprintln!(
        "steward's requests across the fault: {}; writes: {writes:?}",
        events.len()
    );
    assert!(destructive.is_empty(), "{destructive:?}");
    assert!(
        writes.iter().all(|w| w.ends_with(" leases")),
        "writes other than the Lease across the fault: {writes:?}"
    );
    assert_eq!(published(&s.client).await, Some(s.expected.clone()));
}

#[tokio::test]
async fn a_lost_lease_stops_the_writes_before_the_new_holder_starts() {
    let s = setup("chaos-leader", &[]).await;
    let leases: Api<Lease> = Api::namespaced(s.client.clone(), &s.ns);
    let lease = leases.get("proxy").await.unwrap();
    assert_eq!(
        lease.spec.as_ref().unwrap().holder_identity.as_deref(),
        Some("chaos-leader")
    );
    // Another holder takes the Lease for 30 s (as a new leader would after a partition): long
    // enough that a busy machine still makes the checks below inside its term.
    let term = Duration::from_secs(30);
    let taken = Instant::now();
    let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
    leases
        .patch(
            "proxy",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {
                "holderIdentity": "intruder",
                "leaseDurationSeconds": term.as_secs(),
                "acquireTime": now,
                "renewTime": now,
            }})),
        )
        .await
        .unwrap();
    let from = audit_mark(&s.plane).await;
    // steward sees the intruder at its next attempt and stops leading; then the edit, which the
    // old leader must leave alone.
    eventually("steward stops leading", Duration::from_secs(30), || async {
        leads(&s.proxy).await == Some(false)
    })
    .await;
    let edited = audit_mark(&s.plane).await;
    edit_slice(&s.client).await;
    // It has had its chance to (wrongly) repair: two more of its Lease attempts after the edit,
    // polled in the audit log rather than a guessed sleep (a leader's watch repairs in ms).
    eventually(
        "two Lease attempts after the edit",
        Duration::from_secs(30),
        || async {
            steward_events(&s.plane, edited)
                .await
                .iter()
                .filter(|e| resource(e) == "leases")
                .count()
                >= 2
        },
    )
    .await;
    eprintln!(
        "checked {:?} into the intruder's {term:?} term",
        taken.elapsed()
    );
    let meanwhile: Vec<_> = steward_events(&s.plane, edited)
        .await
        .into_iter()
        .filter(|e| e.is_write() && resource(e) != "leases")
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(
        meanwhile.is_empty(),
        "steward wrote while another held the Lease: {meanwhile:?}\n{}",
        s.proxy.logs()
    );
    assert_ne!(published(&s.client).await, Some(s.expected.clone()));

    // Once the intruder's term runs out, steward takes the Lease back and repairs.
    eventually(
        "steward leads again and repairs",
        term + Duration::from_secs(30),
        || async { published(&s.client).await.as_ref() == Some(&s.expected) },
    )
    .await;
    let back = taken.elapsed();
    let lease = leases.get("proxy").await.unwrap();
    assert_eq!(
        lease.spec.unwrap().holder_identity.as_deref(),
        Some("chaos-leader")
    );
    assert!(
        back >= term,
        "repaired after {back:?}, inside the intruder's term"
    );
    // Every slice write after the takeover came after the Lease was back in steward's hands.
    let writes: Vec<_> = steward_events(&s.plane, from)
        .await
        .into_iter()
        .filter(|e| e.is_write())
        .map(|e| format!("{} {}", e.verb, resource(&e)))
        .collect();
    eprintln!("steward's writes from the takeover on: {writes:?} (back after {back:?})");
    let first_slice = writes.iter().position(|w| w.ends_with(" endpointslices"));
    let first_lease = writes.iter().position(|w| w.ends_with(" leases"));
    assert!(
        matches!((first_lease, first_slice), (Some(l), Some(w)) if l < w),
        "the slice was written before the Lease was retaken: {writes:?}"
    );
}

/// The chart's rules for `default` (see chart/templates/rbac.yaml), with or without the write
/// verbs on the named slices.
fn kubernetes_endpoints_role(with_patch: bool) -> Role {
    let slice_verbs = if with_patch {
        serde_json::json!(["get", "update", "patch"])
    } else {
        serde_json::json!(["get"])
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "steward-perm", "namespace": "default"},
        "rules": [
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "resourceNames": ["kubernetes", "kubernetes-ipv6", "kubernetes-ipv4"], "verbs": slice_verbs},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["list", "watch", "create", "delete"]},
            {"apiGroups": [""], "resources": ["endpoints"], "resourceNames": ["kubernetes"],
             "verbs": ["get", "list", "watch", "update", "patch"]},
            {"apiGroups": [""], "resources": ["endpoints"], "verbs": ["create"]},
        ],
    }))
    .unwrap()
}

#[tokio::test]
async fn a_verb_taken_away_is_reported_backed_off_and_recovered() {
    let plane = ControlPlane::builder()
        .apiserver_arg("--endpoint-reconciler-type=none")
        .start()
        .await
        .unwrap();
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-perm").await.unwrap();
    let cluster_ip = create_proxy_service(&client, &ns)
        .await
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let user = "steward-perm";
    let params = PatchParams::apply("chaos-test").force();
    let roles: Api<Role> = Api::namespaced(client.clone(), "default");
    roles
        .patch(
            user,
            &params,
            &Patch::Apply(kubernetes_endpoints_role(true)),
        )
        .await
        .unwrap();
    let own: Role = serde_json::from_value(serde_json::json!({
        "metadata": {"name": user, "namespace": ns},
        "rules": [
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]},
            {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        ],
    }))
    .unwrap();
    Api::<Role>::namespaced(client.clone(), &ns)
        .patch(user, &params, &Patch::Apply(own))
        .await
        .unwrap();
    for namespace in ["default", ns.as_str()] {
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": user, "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }))
        .unwrap();
        Api::<RoleBinding>::namespaced(client.clone(), namespace)
            .patch(user, &params, &Patch::Apply(binding))
            .await
            .unwrap();
    }
    let kubeconfig = plane
        .kubeconfig_as(&Identity::User {
            name: user.into(),
            group: None,
        })
        .await
        .unwrap();
    let echo = netkit_testenv::fixtures::echo_server().await.unwrap();
    let proxy = Proxy::start(
        &kubeconfig,
        &echo.to_string(),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=proxy",
            "--endpoint-mode=cluster-ip",
            "--leader-elect",
            "--identity=perm",
        ],
    );
    let expected = (vec![cluster_ip], 6443);
    eventually("steward publishes", Duration::from_secs(30), || async {
        published(&client).await.as_ref() == Some(&expected)
    })
    .await;

    // Take `patch` and `update` on the slice away, then edit it: every repair is now forbidden.
    roles
        .patch(
            user,
            &params,
            &Patch::Apply(kubernetes_endpoints_role(false)),
        )
        .await
        .unwrap();
    let from = audit_mark(&plane).await;
    let log_from = proxy.logs().len();
    edit_slice(&client).await;
    let window = Duration::from_secs(20);
    tokio::time::sleep(window).await;
    plane.writes_by(user).await.unwrap();
    let forbidden = plane
        .audit_events()
        .unwrap()
        .into_iter()
        .skip(from)
        .filter(|e| e.user.username == user)
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .count();
    let logs = proxy.logs()[log_from..].to_owned();
    let said = logs.lines().filter(|l| l.contains("forbidden")).count();
    eprintln!("{forbidden} forbidden requests and {said} log lines saying so in {window:?}");
    assert!(forbidden >= 1, "steward never tried to repair:\n{logs}");
    // Backed off (200 ms doubling): about 8 attempts in 20 s; a hot loop would make hundreds.
    assert!(
        forbidden <= 10,
        "{forbidden} forbidden requests in {window:?}: not backing off"
    );
    assert!(
        said <= forbidden,
        "said {said} times for {forbidden} denials:\n{logs}"
    );
    assert!(
        logs.contains("patch") && logs.contains("endpointslices"),
        "the log does not name the verb and resource:\n{logs}"
    );

    // The verb comes back: repaired at the next retry (the backoff is capped at 30 s); the
    // deadline leaves a busy machine room, the time is reported.
    roles
        .patch(
            user,
            &params,
            &Patch::Apply(kubernetes_endpoints_role(true)),
        )
        .await
        .unwrap();
    let restored = Instant::now();
    eventually(
        "repaired once the verb is back",
        Duration::from_secs(60),
        || async { published(&client).await.as_ref() == Some(&expected) },
    )
    .await;
    eprintln!("repaired {:?} after the verb came back", restored.elapsed());
}

#[tokio::test]
async fn sigterm_while_the_api_server_is_down_still_exits() {
    let mut s = setup("chaos-sigterm", &[]).await;
    s.plane.stop_apiserver().await.unwrap();
    // Let a reconcile or a Lease renewal be in flight against the missing API server.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let terminated = Instant::now();
    s.proxy.terminate();
    let mut status = None;
    while terminated.elapsed() < Duration::from_secs(30) {
        if let Some(exit) = s.proxy.child.try_wait().unwrap() {
            status = Some(exit);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = terminated.elapsed();
    s.plane.start_apiserver().await.unwrap();
    let status =
        status.unwrap_or_else(|| panic!("still running 30 s after SIGTERM:\n{}", s.proxy.logs()));
    eprintln!("exited {status} {took:?} after SIGTERM with the API server down");
    assert!(status.success(), "{status}:\n{}", s.proxy.logs());
}

/// Whether steward's `leader_election_master_status` gauge says it leads (`None` while /metrics does not answer).
async fn leads(proxy: &Proxy) -> Option<bool> {
    let text = proxy.metrics_text().await;
    let line = text
        .lines()
        .find(|l| l.starts_with("leader_election_master_status{"))?;
    Some(line.ends_with(" 1"))
}

/// One echo round trip on a new connection through steward.
async fn fresh_round_trip(proxy: &Proxy, n: usize) -> bool {
    match TcpStream::connect(proxy.listen).await {
        Ok(mut stream) => round_trip(&mut stream, n).await,
        Err(_) => false,
    }
}

#[tokio::test]
async fn a_hung_api_server_is_noticed_by_the_lease_while_relaying_goes_on() {
    let s = setup("chaos-hung", &[]).await;
    assert_eq!(leads(&s.proxy).await, Some(true), "{}", s.proxy.logs());
    let mut held = TcpStream::connect(s.proxy.listen).await.unwrap();
    assert!(round_trip(&mut held, 0).await);
    let from = audit_mark(&s.plane).await;

    // Frozen for 20 s: its sockets stay open, nothing answers, no watch ends with an error.
    // Only steward's own deadlines can tell it (the Lease's renew deadline, 10 s).
    let frozen = Instant::now();
    s.plane.pause_apiserver().await.unwrap();
    let (mut noticed, mut samples, mut held_ok, mut fresh_ok) = (None, 0, 0, 0);
    while frozen.elapsed() < Duration::from_secs(20) {
        samples += 1;
        held_ok += usize::from(round_trip(&mut held, samples).await);
        fresh_ok += usize::from(fresh_round_trip(&s.proxy, samples).await);
        if noticed.is_none() && leads(&s.proxy).await == Some(false) {
            noticed = Some(frozen.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    s.plane.resume_apiserver().await.unwrap();
    let resumed = Instant::now();
    eprintln!(
        "while frozen: {held_ok}/{samples} echoes on the held connection, {fresh_ok}/{samples} \
         on new ones; stopped leading after {noticed:?}"
    );
    assert_eq!(
        held_ok,
        samples,
        "the held connection broke:\n{}",
        s.proxy.logs()
    );
    assert_eq!(
        fresh_ok,
        samples,
        "new connections failed:\n{}",
        s.proxy.logs()
    );
    let noticed = noticed.unwrap_or_else(|| {
        panic!(
            "steward still led after 20 s without a renewal:\n{}",
            s.proxy.logs()
        )
    });
    // The renew deadline is 10 s from the last renewal, at most one retry period (2 s) before
    // the freeze, nominally; half the deadline leaves a busy machine's slow attempts room and
    // still fails a replica that steps down at once.
    assert!(
        noticed >= Duration::from_secs(5),
        "stepped down after {noticed:?}, before its renew deadline could have passed"
    );

    // Thawed, it leads again, and nothing needed writing: the endpoints were right all along.
    eventually("steward leads again", Duration::from_secs(30), || async {
        leads(&s.proxy).await == Some(true)
    })
    .await;
    let converged = resumed.elapsed();
    // A change made now is repaired, once.
    let edited = audit_mark(&s.plane).await;
    let before_edit = reconciles(&s.proxy).await;
    edit_slice(&s.client).await;
    eventually("the edit is repaired", Duration::from_secs(30), || async {
        published(&s.client).await.as_ref() == Some(&s.expected)
    })
    .await;
    eprintln!("led again {converged:?} after the API server was thawed");
    // Settled: the repair's reconcile and the one its own write triggers have both ended (a
    // second write would be in by then), polled rather than a guessed sleep. Then read every
    // write across the fault.
    eventually(
        "two reconciles after the edit",
        Duration::from_secs(60),
        || async { reconciles(&s.proxy).await >= before_edit + 2 },
    )
    .await;
    let writes = |events: Vec<AuditEvent>| -> Vec<String> {
        events
            .into_iter()
            .filter(|e| e.is_write() && resource(e) != "leases")
            .map(|e| format!("{} {}", e.verb, e.request_uri))
            .collect()
    };
    let all = writes(steward_events(&s.plane, from).await);
    let repair = writes(steward_events(&s.plane, edited).await);
    let during = all.len() - repair.len();
    eprintln!("steward's writes across the freeze: {during}; repairing the edit: {repair:?}");
    assert_eq!(during, 0, "writes across the freeze: {all:?}");
    assert_eq!(
        repair.len(),
        1,
        "one edit of the slice must take one write: {repair:?}"
    );
    assert!(round_trip(&mut held, 1000).await, "held connection after");
}

/// How many file descriptors a process holds.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[tokio::test]
async fn the_upstream_killed_mid_stream_ends_the_clients_streams_and_leaks_nothing() {
    let plane = ControlPlane::builder().start().await.unwrap();
    let admin = plane.client().await.unwrap();
    let ns = plane.create_namespace("steward-upstream").await.unwrap();
    // Relaying only: no proxy Service of that name, nothing published.
    let proxy = Proxy::start(
        plane.kubeconfig_path(),
        &support::apiserver_addr(&plane),
        &[
            &format!("--service-namespace={ns}"),
            "--service-name=absent",
        ],
    );
    eventually("steward is ready", Duration::from_secs(30), || async {
        proxy.readyz().await.is_some_and(|(code, _)| code == 200)
    })
    .await;
    // 40 MiB of ConfigMaps: a LIST more than every socket and pipe buffer on the way can hold,
    // so the API server is still writing it when it dies.
    let maps: Api<ConfigMap> = Api::namespaced(admin.clone(), &ns);
    let filler = "x".repeat(512 * 1024);
    for i in 0..80 {
        let mut cm = ConfigMap::default();
        cm.metadata.name = Some(format!("bulk-{i}"));
        cm.data = Some([("filler".to_owned(), filler.clone())].into());
        maps.create(&PostParams::default(), &cm).await.unwrap();
    }
    let pid = proxy.child.id();
    let baseline = open_fds(pid);

    let through = support::client_through(&plane, proxy.listen).await;
    // From now on: an idle watch, as a controller's is most of the time.
    let now = maps
        .list_metadata(&kube::api::ListParams::default().limit(1))
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut watch = Api::<ConfigMap>::namespaced(through.clone(), &ns)
        .watch(&kube::api::WatchParams::default().timeout(290), &now)
        .await
        .unwrap()
        .boxed();
    let request = http::Request::get(format!("/api/v1/namespaces/{ns}/configmaps"))
        .body(Vec::new())
        .unwrap();
    let mut list = through.request_stream(request).await.unwrap();
    let mut first = vec![0; 64 * 1024];
    list.read_exact(&mut first).await.unwrap();

    plane.kill_apiserver().await.unwrap();
    let killed = Instant::now();
    // The LIST ends in an error, not a hang and not a body that looks whole.
    let mut rest = Vec::new();
    let listed = tokio::time::timeout(Duration::from_secs(10), list.read_to_end(&mut rest))
        .await
        .expect("the LIST still hangs 10 s after the API server died");
    let list_ended = killed.elapsed();
    let received = first.len() + rest.len();
    eprintln!(
        "LIST: {received} of ~{} bytes, then {listed:?}, {list_ended:?} after the kill",
        80 * filler.len()
    );
    assert!(
        listed.is_err(),
        "the LIST ended as if whole ({received} bytes)"
    );
    assert!(
        received < 80 * filler.len(),
        "the whole LIST was received before the kill"
    );
    // The watch ends too (an error or its end), promptly.
    let watched = tokio::time::timeout(Duration::from_secs(10), watch.try_next())
        .await
        .expect("the watch still hangs 10 s after the API server died");
    eprintln!("watch: {watched:?}, {:?} after the kill", killed.elapsed());
    assert!(!matches!(watched, Ok(Some(_))), "{watched:?}");
    drop((list, watch, through));

    // Every relayed connection is closed: steward holds no more descriptors than before.
    let mut fds = open_fds(pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    while fds > baseline && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        fds = open_fds(pid);
    }
    eprintln!("steward's descriptors: {baseline} before, {fds} after");
    assert!(
        fds <= baseline,
        "{fds} descriptors, {baseline} before:\n{}",
        proxy.logs()
    );

    // The API server back, a new client through steward works.
    plane.start_apiserver().await.unwrap();
    let again = support::client_through(&plane, proxy.listen).await;
    let listed = Api::<ConfigMap>::namespaced(again, &ns)
        .list(&kube::api::ListParams::default())
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 80);
}
