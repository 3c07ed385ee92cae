//! State lives in the cluster: kill -9 and start again restores every mapping, port and TTL;
//! replicas agree; SIGTERM drains.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use serde_json::json;

use crate::support::{
    Env, Proxier, assert_deadline_within, eventually, expect_expiry, greeting, v1_v2_flags,
};

/// The restored mapping's TTL: long enough to outlive the set-up, a second replica and a
/// restart on a busy machine, so the restored mapping is seen live before its deadline.
const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_then_start_restores_mappings_ports_and_ttls() {
    let env = Env::new("restart", 1).await;
    let ns = env.targets[0].clone();
    env.pod_with_backend(&ns, "pod-a", "127.0.0.51", "restart-pod")
        .await;
    let mut px = Proxier::start(&env, &v1_v2_flags(3)).await;
    let token = env.debugger(&ns).await;
    let sent = Timestamp::now();
    let body = px
        .map(Some(&token), &format!("{ns}/pod-a"), TTL.as_secs())
        .await;
    let expires_at = body["data"]["expires_at"].as_str().unwrap().to_owned();
    assert_deadline_within(&expires_at, sent, Timestamp::now(), TTL);
    let svc: Service = serde_json::from_value(json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "svc-a", "namespace": ns}, "spec": {"ports": [{"name": "debug", "port": 80}]}}))
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
    let svc_port = env.mappings().get(&svc_name).await.unwrap().spec.entry_port;
    assert_eq!(greeting(px.entry).await.as_deref(), Some("restart-pod"));

    // A second replica (another identity, same ports on 127.0.0.2) forwards the same way.
    let replica = px.replica("127.0.0.2", "second").await;
    assert_eq!(
        greeting(replica.entry).await.as_deref(),
        Some("restart-pod")
    );
    drop(replica);

    px.kill9();
    assert_eq!(
        greeting(px.entry).await,
        None,
        "nothing listens while it is down"
    );
    px.restart().await;
    // Restored: the same target, the same deadline, the same V2 port.
    assert_eq!(greeting(px.entry).await.as_deref(), Some("restart-pod"));
    let (status, body) = px
        .call(
            "GET",
            &format!("/api/v1/mapping?pod_name={ns}/pod-a"),
            Some(&token),
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["data"]["expires_at"], expires_at.as_str());
    assert_eq!(
        env.mappings().get(&svc_name).await.unwrap().spec.entry_port,
        svc_port
    );
    assert!(std::net::TcpListener::bind(("127.0.0.1", u16::try_from(svc_port).unwrap())).is_err());
    // And the TTL still ends on time: live until the deadline, refused after it.
    expect_expiry(px.entry, "restart-pod", &expires_at).await;

    // SIGTERM: a clean exit after draining.
    let status = px.terminate();
    assert!(status.success(), "{status}");
    assert!(px.logs().contains("shutting down"));
    px.assert_never_forbidden().await;
}
