//! V2: Service ports named --port-name published on ports of the range.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::support::{Env, Proxier, eventually, free_range, get_text};

async fn service(env: &Env, ns: &str, name: &str, ports: &[(&str, i32)]) {
    let ports: Vec<_> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    let svc: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"ports": ports}
    }))
    .unwrap();
    Api::<Service>::namespaced(env.admin.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
}

async fn set_ports(env: &Env, ns: &str, name: &str, ports: &[(&str, i32)]) {
    let ports: Vec<_> = ports
        .iter()
        .map(|(n, p)| json!({"name": n, "port": p, "protocol": "TCP"}))
        .collect();
    let patch = json!({"spec": {"ports": ports}});
    Api::<Service>::namespaced(env.admin.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

async fn slice(env: &Env, ns: &str, service: &str, port: u16, endpoints: &[(&str, bool)]) {
    let endpoints: Vec<_> = endpoints
        .iter()
        .map(|(ip, ready)| json!({"addresses": [ip], "conditions": {"ready": ready}}))
        .collect();
    let slice: EndpointSlice = serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-1"), "namespace": ns, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "debug", "port": port, "protocol": "TCP"}]
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(env.admin.clone(), ns)
        .create(&PostParams::default(), &slice)
        .await
        .unwrap();
}

/// Whether pod-proxier holds `port` on 127.0.0.1 (probed by binding, without traffic).
fn listening(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_err()
}

async fn entry_port(env: &Env, name: &str) -> Option<u16> {
    env.mappings()
        .get_opt(name)
        .await
        .unwrap()
        .map(|m| u16::try_from(m.spec.entry_port).unwrap())
}

async fn wait_entry_port(env: &Env, name: &str) -> u16 {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(port) = entry_port(env, name).await {
            return port;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "PortMapping {name} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_gone(env: &Env, name: &str) {
    eventually(
        &format!("PortMapping {name} removed"),
        Duration::from_secs(30),
        || async { entry_port(env, name).await.is_none() },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_publishes_updates_releases_and_reports_exhaustion() {
    let env = Env::new("v2", 2).await;
    let (t0, t1) = (env.targets[0].clone(), env.targets[1].clone());
    let outside = env.plane.create_namespace("v2-outside").await.unwrap();
    let (start, end) = free_range(2);
    let px = Proxier::start(
        &env,
        &[
            "--enable-v2",
            "--port-range-start",
            &start.to_string(),
            "--port-range-end",
            &end.to_string(),
            "--off-check",
        ],
    )
    .await;

    // svc-a: two ready endpoints and a not-ready one. The API server refuses loopback addresses
    // in EndpointSlices, so these are TEST-NET addresses and no traffic is sent (--off-check;
    // the data plane's forwarding to several endpoints is tested in tests/dataplane.rs).
    service(&env, &t0, "svc-a", &[("debug", 80), ("http", 81)]).await;
    slice(
        &env,
        &t0,
        "svc-a",
        8080,
        &[
            ("192.0.2.31", true),
            ("192.0.2.32", true),
            ("192.0.2.33", false),
        ],
    )
    .await;
    let a_name = format!("svc.{t0}.svc-a.debug");
    let a_port = wait_entry_port(&env, &a_name).await;
    assert!((start..=end).contains(&a_port));
    let a = env.mappings().get(&a_name).await.unwrap();
    assert_eq!(
        a.spec.upstreams,
        vec![
            "192.0.2.31:8080".parse::<std::net::SocketAddr>().unwrap(),
            "192.0.2.32:8080".parse().unwrap()
        ]
    );
    assert_eq!(a.spec.target.port, Some(80));
    eventually(
        "the entry port listens",
        Duration::from_secs(30),
        || async { listening(a_port) },
    )
    .await;

    // The allocation is stable across Service updates that keep the port (its name): other
    // ports change, and so does its number, which the mapping shows once the update is applied
    // (a state to wait for, not a sleep).
    set_ports(
        &env,
        &t0,
        "svc-a",
        &[("debug", 90), ("http", 82), ("extra", 83)],
    )
    .await;
    eventually(
        "svc-a's mapping follows the new port number",
        Duration::from_secs(30),
        || async { env.mappings().get(&a_name).await.unwrap().spec.target.port == Some(90) },
    )
    .await;
    assert_eq!(entry_port(&env, &a_name).await, Some(a_port));

    // svc-b takes the second port; svc-c finds the range full: Event, metric, log.
    service(&env, &t1, "svc-b", &[("debug", 80)]).await;
    let b_name = format!("svc.{t1}.svc-b.debug");
    let b_port = wait_entry_port(&env, &b_name).await;
    assert_ne!(b_port, a_port);
    service(&env, &t0, "svc-c", &[("debug", 80)]).await;
    let c_name = format!("svc.{t0}.svc-c.debug");
    let events: Api<Event> = Api::namespaced(env.admin.clone(), &t0);
    eventually(
        "a PortRangeExhausted Event on svc-c",
        Duration::from_secs(30),
        || async {
            events
                .list(&ListParams::default())
                .await
                .unwrap()
                .items
                .iter()
                .any(|e| {
                    e.reason.as_deref() == Some("PortRangeExhausted")
                        && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("svc-c")
                })
        },
    )
    .await;
    assert_eq!(entry_port(&env, &c_name).await, None);
    let (_, metrics) = get_text(px.metrics, "/metrics").await.unwrap();
    assert!(
        metrics.lines().any(
            |l| l.starts_with("podproxier_v2_port_range_exhausted_total") && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    assert!(metrics.contains("podproxier_v2_ports_free 0"), "{metrics}");
    assert!(px.logs().contains("V2 port range exhausted"));

    // Renaming svc-a's port releases its entry port, and svc-c gets it.
    set_ports(&env, &t0, "svc-a", &[("web", 80)]).await;
    wait_gone(&env, &a_name).await;
    assert_eq!(wait_entry_port(&env, &c_name).await, a_port);
    // svc-c has no endpoints: its mapping refuses connections until it gets some.
    assert!(
        env.mappings()
            .get(&c_name)
            .await
            .unwrap()
            .spec
            .upstreams
            .is_empty()
    );

    // Removing the port from svc-b and deleting svc-c release theirs.
    set_ports(&env, &t1, "svc-b", &[("http", 80)]).await;
    wait_gone(&env, &b_name).await;
    eventually(
        "svc-b's entry port is released",
        Duration::from_secs(30),
        || async { !listening(b_port) },
    )
    .await;
    Api::<Service>::namespaced(env.admin.clone(), &t0)
        .delete("svc-c", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&env, &c_name).await;

    // A Service outside --allowed-namespaces is never published: svc-d, made after it in an
    // allowed namespace, is published (the controller has caught up), then 2 s more pass, and
    // svc-d is still the only mapping.
    service(&env, &outside, "svc-x", &[("debug", 80)]).await;
    service(&env, &t1, "svc-d", &[("debug", 80)]).await;
    let d_port = wait_entry_port(&env, &format!("svc.{t1}.svc-d.debug")).await;
    // An absence is proven over a window, not by a state: 2 s in which svc-x must not appear.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let names: Vec<String> = env
        .mappings()
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|m| m.metadata.name)
        .collect();
    assert_eq!(names, [format!("svc.{t1}.svc-d.debug")]);

    // The V2 API: a caller who may get Services sees a published port.
    let token = env.debugger(&t1).await;
    let (status, reply) = px
        .call(
            "GET",
            &format!("/api/v2/mapping?service={t1}/svc-d"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["data"]["entry_port"], d_port);
    let (status, reply) = px
        .call(
            "GET",
            &format!("/api/v2/mappings?namespace={t1}"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(
        (status, reply["data"].as_array().map(Vec::len)),
        (200, Some(1)),
        "{reply}"
    );
    let (status, _) = px
        .call(
            "GET",
            &format!("/api/v2/mapping?service={t0}/svc-a"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 403);
    px.assert_never_forbidden().await;
}
