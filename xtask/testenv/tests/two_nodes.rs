//! Two nodes, and the loss of one: the primitives of the node-loss scenarios. Needs root and
//! `cargo xtask envtest --node` (node tier); a missing piece fails with one line naming it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, PostParams};
use netkit_testenv::ControlPlane;
use netkit_testenv::node::check;
use serde_json::json;

/// Generous: a busy 2-core machine starts two nodes and notices a lost one slowly.
const WAIT: Duration = Duration::from_secs(180);

async fn until<F, Fut, T>(what: &str, mut probe: F) -> (T, Duration)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await {
            return (value, started.elapsed());
        }
        assert!(started.elapsed() < WAIT, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn a_lost_node_turns_not_ready_and_its_pod_leaves_the_service() {
    let plane = ControlPlane::builder()
        .nodes(2)
        .start_timeout(Duration::from_secs(300))
        .start()
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let names: Vec<String> = plane.nodes().iter().map(|n| n.name()).collect();
    assert_eq!(names.len(), 2);
    let client = plane.client().await.unwrap();
    let ns = plane.create_namespace("two-nodes").await.unwrap();

    let mut spread = check::testbox_deployment("spread", 2);
    spread["spec"]["template"]["spec"]["affinity"] = json!({ "podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": { "matchLabels": { "app": "spread" } },
            "topologyKey": "kubernetes.io/hostname",
        }],
    }});
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &serde_json::from_value(spread).unwrap(),
        )
        .await
        .unwrap();
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": "spread" },
        "spec": { "selector": { "app": "spread" }, "ports": [{ "port": 80, "targetPort": 8080 }] },
    }))
    .unwrap();
    let service = Api::<Service>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &service)
        .await
        .unwrap();
    let cluster_ip = service.spec.unwrap().cluster_ip.unwrap();
    let addr: SocketAddr = format!("{cluster_ip}:80").parse().unwrap();
    check::wait_pods_ready(&plane, &ns, "app=spread", 2)
        .await
        .unwrap();
    let pods: Vec<Pod> = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels("app=spread"))
        .await
        .unwrap()
        .items;
    let on = |node: &str| {
        pods.iter()
            .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
            .and_then(|p| p.metadata.name.clone())
            .unwrap_or_else(|| panic!("no spread Pod on {node}"))
    };
    let (kept, lost) = (on(&names[0]), on(&names[1]));
    let both: BTreeSet<String> = [kept.clone(), lost.clone()].into();
    let seen = check::reach_all(addr, &both).await.unwrap();
    println!("before: {addr} answered by {seen:?}");

    plane.nodes()[1].lose().unwrap();
    let lost_at = Instant::now();

    let nodes: Api<Node> = Api::all(client.clone());
    let (_, not_ready) = until("the lost Node to leave Ready", || async {
        let node = nodes.get(&names[1]).await.ok()?;
        let ready = node
            .status?
            .conditions?
            .into_iter()
            .find(|c| c.type_ == "Ready")?;
        (ready.status != "True").then_some(())
    })
    .await;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let (_, unready) = until("the lost Pod's endpoint to turn unready", || async {
        let list = slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=spread"))
            .await
            .ok()?;
        let lost_ready = list
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .any(|e| {
                e.target_ref.as_ref().and_then(|t| t.name.as_deref()) == Some(lost.as_str())
                    && e.conditions.as_ref().and_then(|c| c.ready) == Some(true)
            });
        (!lost_ready).then_some(())
    })
    .await;
    // Once kube-proxy has the new endpoints, every request goes to the surviving Pod.
    let (answers, routed) = until(
        "the Service to answer from the surviving Pod only",
        || async {
            let mut answers = Vec::new();
            for _ in 0..10 {
                answers.push(check::http_get(addr, "/").await.ok()?);
            }
            answers
                .iter()
                .all(|a| a.contains(kept.as_str()))
                .then_some(answers.len())
        },
    )
    .await;
    println!(
        "after losing {}: Node not Ready after {not_ready:.1?}, {lost} unready in the EndpointSlice after a further {unready:.1?}, {answers} requests through {addr} all answered by {kept} {routed:.1?} later ({:.1?} in all)",
        names[1],
        lost_at.elapsed()
    );
}
