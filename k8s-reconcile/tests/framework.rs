//! The reconciler framework against the real kube-apiserver.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::Timestamp;
use k8s_reconcile::endpointslice::{
    EndpointsOptions, ServiceEndpoint, ServiceEndpoints, ServicePort, apply_service_endpoints,
};
use k8s_reconcile::leader::{LeaderElector, LeaderState, LeaseConfig};
use k8s_reconcile::metrics::ControllerMetrics;
use k8s_reconcile::ops::Health;
use k8s_reconcile::{Action, Applier, Context, ControllerBuilder, Reconciler};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, ResourceExt as _};
use netkit_testenv::fixtures::FreezableRelay;
use netkit_testenv::{ControlPlane, Identity, eventually};
use tokio_util::sync::CancellationToken;

/// A client authenticated as its own user (in system:masters), so its writes can be counted.
async fn counted_client(plane: &ControlPlane, user: &str) -> Client {
    plane
        .client_as(&Identity::User {
            name: user.to_owned(),
            group: Some("system:masters".to_owned()),
        })
        .await
        .unwrap()
}

fn configmap(ns: &str, name: &str, data: &[(&str, &str)]) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ),
        ..ConfigMap::default()
    }
}

#[tokio::test]
async fn applier_writes_once_then_only_reads_and_keeps_other_managers_fields() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("apply").await.unwrap();
    let user = "applier-steady";
    let applier = Applier::new(counted_client(plane, user).await, "netkit-test");
    let desired = configmap(&ns, "cfg", &[("a", "1")]);

    assert!(applier.apply(&desired).await.unwrap().written());
    let after_first = plane.writes_by(user).await.unwrap().len();
    assert_eq!(after_first, 1);
    for _ in 0..5 {
        assert!(!applier.apply(&desired).await.unwrap().written());
    }
    assert_eq!(
        plane.writes_by(user).await.unwrap().len(),
        after_first,
        "steady state wrote"
    );

    // Another field manager adds its own key: ours is still satisfied, nothing is written, and
    // their key survives.
    let admin: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);
    let theirs = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "cfg"}, "data": {"b": "2"}});
    admin
        .patch(
            "cfg",
            &PatchParams::apply("someone-else"),
            &Patch::Apply(&theirs),
        )
        .await
        .unwrap();
    assert!(!applier.apply(&desired).await.unwrap().written());
    let live = admin.get("cfg").await.unwrap();
    assert_eq!(live.data.as_ref().unwrap()["a"], "1");
    assert_eq!(live.data.as_ref().unwrap()["b"], "2");

    // Drift in a field we own is repaired with one write.
    let mut edited = live.clone();
    edited
        .data
        .as_mut()
        .unwrap()
        .insert("a".into(), "tampered".into());
    admin
        .replace("cfg", &PostParams::default(), &edited)
        .await
        .unwrap();
    assert!(applier.apply(&desired).await.unwrap().written());
    assert_eq!(admin.get("cfg").await.unwrap().data.unwrap()["a"], "1");

    // A field we stop setting is removed (the hash changed), theirs stays; that is no repair.
    let without_a = configmap(&ns, "cfg", &[("c", "3")]);
    let applied = applier.apply(&without_a).await.unwrap();
    assert!(applied.written() && !applied.repaired());
    let data = admin.get("cfg").await.unwrap().data.unwrap();
    assert!(!data.contains_key("a"), "{data:?}");
    assert_eq!(data["b"], "2");
    assert_eq!(data["c"], "3");
    assert_eq!(plane.writes_by(user).await.unwrap().len(), after_first + 2);
}

#[tokio::test]
async fn prune_deletes_only_unwanted_labelled_objects() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("prune").await.unwrap();
    let applier = Applier::new(plane.client().await.unwrap(), "netkit-test");
    for name in ["keep", "drop", "other"] {
        let mut cm = configmap(&ns, name, &[]);
        if name != "other" {
            cm.metadata.labels = Some(BTreeMap::from([("owner".into(), "me".into())]));
        }
        applier.apply(&cm).await.unwrap();
    }
    let keep = BTreeSet::from(["keep".to_owned()]);
    let deleted = applier
        .prune::<ConfigMap>(&ns, "owner=me", &keep)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    let api: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);
    let names: BTreeSet<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|c| c.name_any())
        .filter(|n| n != "kube-root-ca.crt")
        .collect();
    assert_eq!(
        names,
        BTreeSet::from(["keep".to_owned(), "other".to_owned()])
    );
}

#[tokio::test]
async fn endpoint_slices_follow_the_addresses_and_families() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("slices").await.unwrap();
    let user = "slice-writer";
    let applier = Applier::new(counted_client(plane, user).await, "netkit-test");
    let admin = plane.client().await.unwrap();
    let slices: Api<EndpointSlice> = Api::namespaced(admin.clone(), &ns);

    // A stale slice of the same Service, written by someone else.
    let stale: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "api-stale", "labels": {"kubernetes.io/service-name": "api"}},
        "addressType": "IPv4", "endpoints": [{"addresses": ["10.9.9.9"]}], "ports": [],
    }))
    .unwrap();
    slices.create(&PostParams::default(), &stale).await.unwrap();

    let mut spec = ServiceEndpoints {
        namespace: ns.clone(),
        service_name: "api".into(),
        managed_by: "netkit-test".into(),
        endpoints: vec![ServiceEndpoint::ready("10.0.0.10".parse().unwrap())],
        ports: vec![ServicePort::tcp("https", 6443)],
        owner_references: Vec::new(),
    };
    let options = EndpointsOptions {
        delete_other_slices: true,
        write_endpoints: true,
    };
    let outcome = apply_service_endpoints(&applier, &spec, options)
        .await
        .unwrap();
    assert_eq!(outcome.written, 2, "{outcome:?}");
    assert_eq!(outcome.deleted, 1, "{outcome:?}");
    let names: Vec<String> = slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=api"))
        .await
        .unwrap()
        .items
        .iter()
        .map(|s| s.name_any())
        .collect();
    assert_eq!(names, vec!["api".to_owned()]);
    let endpoints = Api::<Endpoints>::namespaced(admin.clone(), &ns)
        .get("api")
        .await
        .unwrap();
    assert_eq!(
        endpoints.labels()["endpointslice.kubernetes.io/skip-mirror"],
        "true"
    );
    let subset = &endpoints.subsets.unwrap()[0];
    assert_eq!(subset.addresses.as_ref().unwrap()[0].ip, "10.0.0.10");

    // Steady state: no writes at all.
    let writes = plane.writes_by(user).await.unwrap().len();
    let outcome = apply_service_endpoints(&applier, &spec, options)
        .await
        .unwrap();
    assert!(outcome.unchanged(), "{outcome:?}");
    assert_eq!(plane.writes_by(user).await.unwrap().len(), writes);

    // The family changes: addressType is immutable, so the slice is re-created as IPv6.
    spec.endpoints = vec![ServiceEndpoint::ready("fd00::10".parse().unwrap())];
    let outcome = apply_service_endpoints(&applier, &spec, options)
        .await
        .unwrap();
    assert_eq!(outcome.deleted, 1, "{outcome:?}");
    let api_slice = slices.get("api").await.unwrap();
    assert_eq!(api_slice.address_type, "IPv6");

    // Dual-stack: a second slice for the other family.
    spec.endpoints = vec![
        ServiceEndpoint::ready("10.0.0.10".parse().unwrap()),
        ServiceEndpoint::ready("fd00::10".parse().unwrap()),
    ];
    apply_service_endpoints(&applier, &spec, options)
        .await
        .unwrap();
    assert_eq!(slices.get("api").await.unwrap().address_type, "IPv4");
    assert_eq!(slices.get("api-ipv6").await.unwrap().address_type, "IPv6");
}

/// A short Lease, yet long enough that a busy machine does not make its leader miss its renew
/// deadline: the checks below prove release and expiry by what the Lease says, not by how fast.
const LEASE: Duration = Duration::from_secs(6);

fn lease(ns: &str, identity: &str) -> LeaseConfig {
    let mut config = LeaseConfig::new(ns, "race", identity);
    config.lease_duration = LEASE;
    config.renew_deadline = Duration::from_secs(4);
    config.retry_period = Duration::from_millis(200);
    config
}

/// The race Lease's holder and renewTime, as the API server has them.
async fn race_lease(plane: &ControlPlane, ns: &str) -> (Option<String>, Option<Timestamp>) {
    let leases: Api<Lease> = Api::namespaced(plane.client().await.unwrap(), ns);
    let spec = leases.get("race").await.unwrap().spec.unwrap_or_default();
    (
        spec.holder_identity.filter(|h| !h.is_empty()),
        spec.renew_time.map(|t| t.0),
    )
}

/// An admin client whose connections to the API server pass through a relay that can freeze them.
async fn client_through_relay(plane: &ControlPlane) -> (Client, FreezableRelay) {
    let kubeconfig = Kubeconfig::read_from(plane.kubeconfig_path()).unwrap();
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap();
    let apiserver = config
        .cluster_url
        .authority()
        .unwrap()
        .as_str()
        .parse()
        .unwrap();
    let relay = FreezableRelay::start(apiserver).await.unwrap();
    // The serving certificate names 127.0.0.1, whatever the port.
    config.cluster_url = format!("https://{}", relay.addr()).parse().unwrap();
    (Client::try_from(config).unwrap(), relay)
}

#[tokio::test]
async fn a_leader_whose_connection_hangs_renews_over_a_new_one_and_keeps_leading() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("lease-hang").await.unwrap();
    let (client, relay) = client_through_relay(plane).await;
    // A longer renew deadline than the race Lease's, so each attempt has 3 s to dial a new TLS
    // connection, read the Lease and write it even on a busy machine.
    let mut config = lease(&ns, "a");
    config.lease_duration = Duration::from_secs(12);
    config.renew_deadline = Duration::from_secs(9);
    let renew_deadline = config.renew_deadline;
    let elector = LeaderElector::new(client, config).unwrap();
    let mut state = elector.subscribe();
    let token = CancellationToken::new();
    let task = tokio::spawn(elector.run(token.clone()));
    tokio::time::timeout(
        Duration::from_secs(30),
        state.wait_for(LeaderState::is_leader),
    )
    .await
    .expect("the only candidate leads within 30 s")
    .unwrap();

    // Its pooled connection now hangs like one to an API server endpoint on a lost node: no
    // answer, no reset. Over three renew deadlines it must renew through new connections and never
    // step down (an attempt that waited the whole deadline on the dead connection would).
    let (_, before) = race_lease(plane, &ns).await;
    relay.freeze_open_connections();
    state.mark_unchanged();
    let frozen_at = Instant::now();
    let mut renewals = BTreeSet::new();
    while frozen_at.elapsed() < 3 * renew_deadline {
        assert!(
            state.borrow().is_leader() && !state.has_changed().unwrap(),
            "the leader stepped down {:?} after its connection froze",
            frozen_at.elapsed()
        );
        let (holder, renewed) = race_lease(plane, &ns).await;
        assert_eq!(holder.as_deref(), Some("a"));
        if renewed != before {
            renewals.insert(renewed);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        renewals.len() >= 3,
        "the Lease was renewed only {} times after the freeze",
        renewals.len()
    );
    eprintln!(
        "{} renewals over new connections in {:?} after the freeze",
        renewals.len(),
        frozen_at.elapsed()
    );
    token.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn two_candidates_never_lead_together_and_hand_over() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("lease").await.unwrap();
    let mut states = Vec::new();
    let mut tokens = Vec::new();
    let mut tasks = Vec::new();
    for identity in ["a", "b"] {
        let elector =
            LeaderElector::new(plane.client().await.unwrap(), lease(&ns, identity)).unwrap();
        states.push(elector.subscribe());
        let token = CancellationToken::new();
        tokens.push(token.clone());
        tasks.push(tokio::spawn(elector.run(token)));
    }
    let leaders = |states: &[tokio::sync::watch::Receiver<LeaderState>]| {
        states.iter().filter(|s| s.borrow().is_leader()).count()
    };
    // Someone leads, and never both, over several renewals of the Lease.
    let started = Instant::now();
    let mut renewals = BTreeSet::new();
    while renewals.len() < 4 {
        let n = leaders(&states);
        assert!(n <= 1, "two leaders at once");
        if n == 1 {
            renewals.insert(race_lease(plane, &ns).await.1);
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no leader renewing the Lease within 60 s (renewals seen: {renewals:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "one leader through 3 renewals after {:?}",
        started.elapsed()
    );
    let first = if states[0].borrow().is_leader() { 0 } else { 1 };
    let second = 1 - first;
    let names = ["a", "b"];

    // A graceful stop releases the Lease (proven by the Lease itself once the leader's task has
    // ended: nobody, or already the other, holds it); the other then takes over.
    let stopped = Instant::now();
    tokens[first].cancel();
    tasks.remove(first).await.unwrap();
    let (holder, _) = race_lease(plane, &ns).await;
    assert!(
        holder.is_none() || holder.as_deref() == Some(names[second]),
        "the stopped leader {} did not release the Lease: held by {holder:?}",
        names[first]
    );
    let mut rest = states.remove(second);
    tokio::time::timeout(
        Duration::from_secs(30),
        rest.wait_for(LeaderState::is_leader),
    )
    .await
    .expect("the other candidate leads after the release")
    .unwrap();
    eprintln!("hand-over after a release took {:?}", stopped.elapsed());

    // A newcomer waits while the leader renews: it has seen the leader (its first attempt is
    // done) and follows through renewals spanning more than a lease duration.
    let crashed_leader = tasks.remove(0);
    let mut third_state;
    {
        let elector = LeaderElector::new(plane.client().await.unwrap(), lease(&ns, "c")).unwrap();
        third_state = elector.subscribe();
        let token = CancellationToken::new();
        tokens.push(token.clone());
        tasks.push(tokio::spawn(elector.run(token)));
    }
    let follows = LeaderState::Follower {
        holder: Some(names[second].to_owned()),
    };
    tokio::time::timeout(
        Duration::from_secs(30),
        third_state.wait_for(|s| *s == follows),
    )
    .await
    .expect("c sees the leader within 30 s")
    .unwrap();
    let (_, seen) = race_lease(plane, &ns).await;
    let seen = seen.expect("a held Lease has a renewTime");
    let watching = Instant::now();
    loop {
        assert!(
            !third_state.borrow().is_leader(),
            "c took the Lease while {} renewed it",
            names[second]
        );
        let (holder, renewed) = race_lease(plane, &ns).await;
        assert_eq!(holder.as_deref(), Some(names[second]));
        let renewed = renewed.expect("a held Lease has a renewTime");
        if renewed.duration_since(seen) > LEASE.try_into().unwrap() {
            break;
        }
        assert!(
            watching.elapsed() < Duration::from_secs(60),
            "{} stopped renewing (last at {renewed})",
            names[second]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A crashed leader (no release) is replaced only once its last renewal is a whole lease
    // duration old (on the API server's record and this machine's clock).
    crashed_leader.abort();
    let _ = crashed_leader.await;
    let (holder, last_renewal) = race_lease(plane, &ns).await;
    assert_eq!(holder.as_deref(), Some(names[second]));
    let last_renewal = last_renewal.expect("a held Lease has a renewTime");
    let crashed = Instant::now();
    tokio::time::timeout(
        LEASE + Duration::from_secs(30),
        third_state.wait_for(LeaderState::is_leader),
    )
    .await
    .expect("c leads after the crashed leader's Lease expires")
    .unwrap();
    let led_at = Timestamp::now();
    eprintln!(
        "c took over {:?} after the crash, {:#} after the last renewal",
        crashed.elapsed(),
        led_at.duration_since(last_renewal)
    );
    assert!(
        led_at.duration_since(last_renewal) >= LEASE.try_into().unwrap(),
        "c took over an unexpired Lease: led at {led_at}, last renewal {last_renewal}"
    );
    for token in tokens {
        token.cancel();
    }
}

/// Keeps a `<name>-child` ConfigMap next to every ConfigMap labelled `role=parent`, fails while a
/// parent is labelled `fail=true`, and records what it did.
#[derive(Clone, Default)]
struct ChildMaker {
    log: Arc<Mutex<Vec<(String, Instant)>>>,
}

#[derive(Debug, thiserror::Error)]
enum ChildError {
    #[error("told to fail")]
    ToldToFail,
    #[error(transparent)]
    Framework(#[from] k8s_reconcile::Error),
}

impl Reconciler for ChildMaker {
    type Resource = ConfigMap;
    type Error = ChildError;

    fn finalizer(&self) -> Option<&str> {
        Some("netkit.test/cleanup")
    }

    async fn reconcile(&self, parent: Arc<ConfigMap>, ctx: &Context) -> Result<Action, ChildError> {
        self.log
            .lock()
            .unwrap()
            .push((format!("reconcile {}", parent.name_any()), Instant::now()));
        // The controller's store keeps no managedFields (they can outweigh a small object).
        if parent.metadata.managed_fields.is_some() {
            self.log.lock().unwrap().push((
                format!("managedFields {}", parent.name_any()),
                Instant::now(),
            ));
        }
        if parent.labels().get("fail").is_some_and(|v| v == "true") {
            return Err(ChildError::ToldToFail);
        }
        let mut child = configmap(
            &parent.namespace().unwrap(),
            &format!("{}-child", parent.name_any()),
            &[("from", &parent.name_any())],
        );
        child.metadata.owner_references =
            k8s_reconcile::apply::controller_owner_ref(parent.as_ref()).map(|r| vec![r]);
        if ctx.applier().apply(&child).await?.written() {
            ctx.publish_event(parent.as_ref(), false, "ChildApplied", "child written")
                .await;
        }
        Ok(Action::Done)
    }

    async fn cleanup(&self, parent: Arc<ConfigMap>, _ctx: &Context) -> Result<Action, ChildError> {
        self.log
            .lock()
            .unwrap()
            .push((format!("cleanup {}", parent.name_any()), Instant::now()));
        Ok(Action::Done)
    }
}

fn parent(ns: &str, name: &str, fail: bool) -> ConfigMap {
    let mut cm = configmap(ns, name, &[]);
    let mut labels = BTreeMap::from([("role".to_owned(), "parent".to_owned())]);
    if fail {
        labels.insert("fail".into(), "true".into());
    }
    cm.metadata.labels = Some(labels);
    cm
}

fn start_controller(
    client: Client,
    ns: &str,
    maker: ChildMaker,
    lease: Option<LeaseConfig>,
    resync: Duration,
) -> (
    CancellationToken,
    ControllerMetrics,
    Health,
    tokio::task::JoinHandle<()>,
) {
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = ControllerMetrics::register(&mut registry);
    let health = Health::new();
    let mut builder = ControllerBuilder::new(client.clone(), "child-maker", maker)
        .namespaced(ns)
        .watcher_config(kube::runtime::watcher::Config::default().labels("role=parent"))
        .owns(
            Api::<ConfigMap>::namespaced(client, ns),
            kube::runtime::watcher::Config::default(),
        )
        .resync(resync)
        // A cap far above the first steps, so a backoff that was not reset is unmistakable.
        .backoff(Duration::from_millis(100), Duration::from_secs(60))
        .metrics(metrics.clone())
        .health(health.clone());
    if let Some(lease) = lease {
        builder = builder.leader_election(lease);
    }
    let token = CancellationToken::new();
    let run_token = token.clone();
    let task = tokio::spawn(async move { builder.run(run_token).await.unwrap() });
    (token, metrics, health, task)
}

#[tokio::test]
async fn controller_reconciles_children_without_steady_writes_and_cleans_up() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("controller").await.unwrap();
    let user = "child-maker";
    let maker = ChildMaker::default();
    let (token, metrics, health, task) = start_controller(
        counted_client(plane, user).await,
        &ns,
        maker.clone(),
        None,
        Duration::from_secs(1),
    );
    let admin: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);
    admin
        .create(&PostParams::default(), &parent(&ns, "p", false))
        .await
        .unwrap();

    eventually("child created", Duration::from_secs(30), || async {
        admin.get_opt("p-child").await.unwrap().is_some()
    })
    .await;
    let child = admin.get("p-child").await.unwrap();
    let owner = &child.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("ConfigMap", "p")
    );
    assert_eq!(owner.controller, Some(true));
    eventually("ready", Duration::from_secs(30), || async {
        health.ready()
    })
    .await;

    // Steady state over several resyncs: reconciles happen, writes do not, and the child is
    // read from the controller's cache, not from the API server.
    let writes = plane.writes_by(user).await.unwrap();
    let requests = plane.requests_by(user).await.unwrap().len();
    let reconciles = metrics.reconcile_count("child-maker", true);
    // The window is two resyncs, polled for (bounded), not a guessed sleep.
    eventually("two resyncs reconcile", Duration::from_secs(30), || async {
        metrics.reconcile_count("child-maker", true) >= reconciles + 2
    })
    .await;
    let new_writes: Vec<_> = plane
        .writes_by(user)
        .await
        .unwrap()
        .into_iter()
        .skip(writes.len())
        .collect();
    assert!(new_writes.is_empty(), "steady state wrote: {new_writes:?}");
    let reads: Vec<_> = plane
        .requests_by(user)
        .await
        .unwrap()
        .into_iter()
        .skip(requests)
        .filter(|event| event.verb == "get")
        .map(|event| event.request_uri)
        .collect();
    assert!(reads.is_empty(), "steady state read: {reads:?}");
    let log = maker.log.lock().unwrap().clone();
    assert!(
        log.iter().any(|(what, _)| what == "reconcile p")
            && !log
                .iter()
                .any(|(what, _)| what.starts_with("managedFields")),
        "{log:?}"
    );

    // An edit of the owned child triggers a reconcile that repairs it: shown by a controller
    // whose next resync is an hour away, so only its watch of the owned child can wake it.
    token.cancel();
    task.await.unwrap();
    let (token, metrics, health, task) = start_controller(
        counted_client(plane, user).await,
        &ns,
        maker.clone(),
        None,
        Duration::from_secs(3600),
    );
    eventually(
        "the hour-resync controller is ready and reconciled p",
        Duration::from_secs(30),
        || async { health.ready() && metrics.reconcile_count("child-maker", true) >= 1 },
    )
    .await;
    let mut tampered = child.clone();
    tampered.data = Some(BTreeMap::from([("from".into(), "someone".into())]));
    admin
        .replace("p-child", &PostParams::default(), &tampered)
        .await
        .unwrap();
    let edited = Instant::now();
    eventually("child repaired", Duration::from_secs(30), || async {
        admin.get("p-child").await.unwrap().data.unwrap()["from"] == "p"
    })
    .await;
    eprintln!("owned child repaired {:?} after the edit", edited.elapsed());

    // An Event was recorded about the parent.
    let events: Api<Event> = Api::namespaced(plane.client().await.unwrap(), &ns);
    let recorded = events.list(&ListParams::default()).await.unwrap().items;
    assert!(
        recorded
            .iter()
            .any(|e| e.reason.as_deref() == Some("ChildApplied")),
        "{recorded:?}"
    );

    // Deleting the parent runs cleanup behind the finalizer, then the object goes away.
    let live = admin.get("p").await.unwrap();
    assert!(
        live.finalizers()
            .contains(&"netkit.test/cleanup".to_owned())
    );
    admin.delete("p", &Default::default()).await.unwrap();
    eventually("parent gone", Duration::from_secs(30), || async {
        admin.get_opt("p").await.unwrap().is_none()
    })
    .await;
    assert!(
        maker
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|(what, _)| what == "cleanup p")
    );
    token.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn errors_back_off_exponentially_and_success_resets() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("backoff").await.unwrap();
    let maker = ChildMaker::default();
    let (token, metrics, _health, task) = start_controller(
        plane.client().await.unwrap(),
        &ns,
        maker.clone(),
        None,
        Duration::from_secs(1),
    );
    let admin: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);
    admin
        .create(&PostParams::default(), &parent(&ns, "f", true))
        .await
        .unwrap();
    eventually("five attempts", Duration::from_secs(30), || async {
        maker
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _)| w == "reconcile f")
            .count()
            >= 5
    })
    .await;
    let attempts: Vec<Instant> = maker
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(w, _)| w == "reconcile f")
        .map(|(_, t)| *t)
        .collect();
    let gaps: Vec<Duration> = attempts.windows(2).map(|w| w[1] - w[0]).collect();
    // 100 ms doubling: 100, 200, 400, 800 (plus up to 10 % jitter); a finalizer add may add one
    // quick extra pass, so the last three gaps are at least 100, 200 and 400 ms. Lower bounds
    // only: a busy machine makes gaps longer, never shorter.
    eprintln!("gaps between attempts: {gaps:?}");
    let last = &gaps[gaps.len() - 3..];
    for (gap, floor) in last.iter().zip([100, 200, 400]) {
        assert!(
            *gap >= Duration::from_millis(floor),
            "no backoff growth: {gaps:?}"
        );
    }
    assert!(metrics.reconcile_count("child-maker", false) >= 4);

    // Success resets the backoff: fail again and the first retry is quick again.
    admin
        .patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"fail": "false"}}})),
        )
        .await
        .unwrap();
    eventually("recovered", Duration::from_secs(30), || async {
        admin.get_opt("f-child").await.unwrap().is_some()
    })
    .await;
    maker.log.lock().unwrap().clear();
    admin
        .patch(
            "f",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"labels": {"fail": "true"}}})),
        )
        .await
        .unwrap();
    eventually("two new attempts", Duration::from_secs(30), || async {
        maker
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(w, _)| w == "reconcile f")
            .count()
            >= 2
    })
    .await;
    let log = maker.log.lock().unwrap().clone();
    let retry = log[1].1 - log[0].1;
    // Reset: the first backoff again (100 ms). Not reset, it would be at least 3.2 s (five
    // failures and more before, doubling from 100 ms under a 60 s cap): 3 s between the two
    // leaves a busy machine 2.9 s.
    eprintln!("first retry after the reset: {retry:?}");
    assert!(
        retry < Duration::from_secs(3),
        "backoff not reset: {retry:?}"
    );
    token.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn only_the_leader_reconciles_and_the_other_takes_over() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("leaders").await.unwrap();
    let (token_a, metrics_a, health_a, task_a) = start_controller(
        plane.client().await.unwrap(),
        &ns,
        ChildMaker::default(),
        Some(lease(&ns, "a")),
        Duration::from_secs(1),
    );
    // Let a lead first, so the roles are known.
    eventually("a leads", Duration::from_secs(30), || async {
        health_a
            .check("leadership")
            .is_some_and(|c| c.detail.contains("Leader"))
    })
    .await;
    let (token_b, metrics_b, health_b, task_b) = start_controller(
        plane.client().await.unwrap(),
        &ns,
        ChildMaker::default(),
        Some(lease(&ns, "b")),
        Duration::from_secs(1),
    );
    let admin: Api<ConfigMap> = Api::namespaced(plane.client().await.unwrap(), &ns);
    admin
        .create(&PostParams::default(), &parent(&ns, "one", false))
        .await
        .unwrap();
    eventually("child of one", Duration::from_secs(30), || async {
        admin.get_opt("one-child").await.unwrap().is_some()
    })
    .await;
    // b has had its chance: it knows it follows a (its election attempt is done), and a has
    // reconciled through two resyncs since (polled, not a guessed sleep).
    eventually("b follows a", Duration::from_secs(30), || async {
        health_b.ready()
            && health_b
                .check("leadership")
                .is_some_and(|c| c.detail.contains("Follower"))
    })
    .await;
    let reconciles = metrics_a.reconcile_count("child-maker", true);
    eventually(
        "a reconciles twice more",
        Duration::from_secs(30),
        || async { metrics_a.reconcile_count("child-maker", true) >= reconciles + 2 },
    )
    .await;
    assert_eq!(
        metrics_b.reconcile_count("child-maker", true),
        0,
        "the follower reconciled"
    );
    assert!(health_b.ready(), "a follower is ready: leadership is known");

    token_a.cancel();
    task_a.await.unwrap();
    let stopped = Instant::now();
    admin
        .create(&PostParams::default(), &parent(&ns, "two", false))
        .await
        .unwrap();
    eventually(
        "b reconciles after a stops",
        Duration::from_secs(30),
        || async { admin.get_opt("two-child").await.unwrap().is_some() },
    )
    .await;
    eprintln!("b reconciled {:?} after a stopped", stopped.elapsed());
    assert!(metrics_b.reconcile_count("child-maker", true) > 0);
    token_b.cancel();
    task_b.await.unwrap();
}
