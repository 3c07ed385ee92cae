//! The peer check against a real API server, as pod-proxier's ServiceAccount bound to the
//! chart's rules: a peer that answered and then stopped is marked not Ready; a peer that never
//! answered and one that keeps answering are left alone.
//!
//! The peers are Pod objects bound to a node that does not exist (no kubelet touches them), their
//! status written by the test; their "health ports" are listeners on loopback addresses.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::Ipv4Addr;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_reconcile::peers::PeerCheckConfig;
use kube::api::{Api, Patch, PatchParams, PostParams};
use netkit_testenv::Identity;
use pod_proxier::peers::{self, PeersMetrics};
use pod_proxier::settings::PeerSettings;
use prometheus_client::registry::Registry;
use serde_json::json;
use support::Env;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Generous: the check needs two failed rounds of 200 ms, on a machine that may be busy.
const DEADLINE: Duration = Duration::from_secs(60);

/// A Ready Pod at `ip`, on a node no kubelet serves.
async fn ready_pod(admin: &Api<Pod>, name: &str, ip: Ipv4Addr) {
    let pod = serde_json::from_value(json!({
        "metadata": { "name": name, "labels": { "app": "px-peers" } },
        "spec": { "nodeName": "no-such-node", "containers": [{ "name": "c", "image": "none" }] },
    }))
    .unwrap();
    admin.create(&PostParams::default(), &pod).await.unwrap();
    let status = json!({ "status": {
        "phase": "Running",
        "podIP": ip.to_string(),
        "podIPs": [{ "ip": ip.to_string() }],
        "conditions": [
            { "type": "Ready", "status": "True" },
            { "type": "PodScheduled", "status": "True" },
        ],
    }});
    admin
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
}

/// The Pod's Ready condition: status and reason.
async fn ready(admin: &Api<Pod>, name: &str) -> (String, Option<String>) {
    let pod = admin.get(name).await.unwrap();
    let conditions = pod.status.unwrap().conditions.unwrap();
    let ready = conditions.into_iter().find(|c| c.type_ == "Ready").unwrap();
    (ready.status, ready.reason)
}

/// Two listeners on one port: on 127.0.0.1 and on 127.0.0.2.
async fn two_listeners() -> (TcpListener, TcpListener) {
    for _ in 0..20 {
        let first = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let port = first.local_addr().unwrap().port();
        if let Ok(second) = TcpListener::bind((Ipv4Addr::new(127, 0, 0, 2), port)).await {
            return (first, second);
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

/// Starts the peer check of replica `self` over the Pods `pods` sees, dialling `port` every
/// `interval`, down after `failures`; cancel the token to stop it.
fn start_check(
    pods: Api<Pod>,
    port: u16,
    interval: Duration,
    failures: u32,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let settings = PeerSettings {
        selector: "app=px-peers".to_owned(),
        check: PeerCheckConfig {
            port,
            interval,
            failures: NonZeroU32::new(failures).unwrap(),
            down_only_after_an_answer: true,
        },
    };
    let metrics = PeersMetrics::register(&mut Registry::default());
    let stop = CancellationToken::new();
    let task = tokio::spawn(peers::run(
        pods,
        settings,
        "self".to_owned(),
        metrics,
        stop.clone(),
    ));
    (stop, task)
}

#[tokio::test]
async fn a_peer_that_stops_answering_is_marked_not_ready_and_the_others_are_left_alone() {
    let env = Env::new("peers", 0).await;
    let admin: Api<Pod> = Api::namespaced(env.admin.clone(), &env.state_ns);
    let (alive, lost) = two_listeners().await;
    let port = alive.local_addr().unwrap().port();
    ready_pod(&admin, "alive", Ipv4Addr::LOCALHOST).await;
    ready_pod(&admin, "lost", Ipv4Addr::new(127, 0, 0, 2)).await;
    // Nothing listens on 127.0.0.3: this peer never answers (a closed health port).
    ready_pod(&admin, "never", Ipv4Addr::new(127, 0, 0, 3)).await;

    let identity = Identity::service_account(&env.state_ns, "pod-proxier");
    let client = env.plane.client_as(&identity).await.unwrap();
    let pods = Api::namespaced(client, &env.state_ns);
    let (stop, task) = start_check(pods, port, Duration::from_millis(200), 2);
    // The lost peer answers once, then its port closes (connections are refused).
    tokio::time::timeout(DEADLINE, lost.accept())
        .await
        .expect("the lost peer was never checked")
        .unwrap();
    drop(lost);
    let started = Instant::now();
    loop {
        let (status, reason) = ready(&admin, "lost").await;
        if status == "False" {
            assert_eq!(reason.as_deref(), Some(peers::REASON));
            break;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the lost peer is still Ready {DEADLINE:?} after its port closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // By now "never" has failed every round since the start, more than twice.
    assert_eq!(
        ready(&admin, "never").await.0,
        "True",
        "never answered: left alone"
    );
    assert_eq!(ready(&admin, "alive").await.0, "True");
    // The alive peer's listener saw the checks all along.
    tokio::time::timeout(DEADLINE, alive.accept())
        .await
        .unwrap()
        .unwrap();
    stop.cancel();
    task.await.unwrap();

    let user = format!("system:serviceaccount:{}:pod-proxier", env.state_ns);
    let requests = env.plane.requests_by(&user).await.unwrap();
    let patched: Vec<_> = requests
        .iter()
        .filter(|e| e.verb == "patch" && e.request_uri.contains("/pods/"))
        .map(|e| e.request_uri.clone())
        .collect();
    assert_eq!(patched.len(), 1, "one patch, of the lost peer: {patched:?}");
    assert!(patched[0].contains("/pods/lost/status"), "{patched:?}");
    let forbidden: Vec<_> = requests
        .iter()
        .filter(|e| e.response_status.as_ref().is_some_and(|s| s.code == 403))
        .map(|e| format!("{} {}", e.verb, e.request_uri))
        .collect();
    assert!(
        forbidden.is_empty(),
        "refused with the chart's rules: {forbidden:?}"
    );
}

/// The own Pod is never checked, though it is Ready and matches the selector.
#[tokio::test]
async fn a_replica_does_not_check_itself() {
    let env = Env::new("peers-self", 0).await;
    let admin: Api<Pod> = Api::namespaced(env.admin.clone(), &env.state_ns);
    let (own, other) = two_listeners().await;
    let port = own.local_addr().unwrap().port();
    ready_pod(&admin, "self", Ipv4Addr::LOCALHOST).await;
    ready_pod(&admin, "other", Ipv4Addr::new(127, 0, 0, 2)).await;
    let (stop, task) = start_check(admin.clone(), port, Duration::from_millis(100), 1);
    // Three rounds reach the other peer; each round dials every tracked address at once.
    for _ in 0..3 {
        tokio::time::timeout(DEADLINE, other.accept())
            .await
            .expect("the other peer is not checked")
            .unwrap();
    }
    let own_checked = tokio::time::timeout(Duration::from_millis(300), own.accept()).await;
    assert!(own_checked.is_err(), "the replica dialled its own Pod");
    stop.cancel();
    task.await.unwrap();
}
