//! Least privilege for Secrets, against a real kube-apiserver and its audit log: the manager,
//! watching the whole cluster (so this binary has its control plane to itself), reads only the
//! Secret its RstreamConnection names (by name, and a watch narrowed to that name), never another
//! Secret of the same or another namespace, and still rolls the agent when that Secret rotates.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

const NAMED: &str = "named-token";
const UNNAMED_SAME_NS: &str = "unnamed-same-namespace";
const UNNAMED_OTHER_NS: &str = "unnamed-other-namespace";

/// The value of query parameter `key` in `uri`, percent-decoded.
fn query_param(uri: &str, key: &str) -> Option<String> {
    let query = uri.split_once('?')?.1;
    let raw = query
        .split('&')
        .find_map(|pair| pair.strip_prefix(key)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[test]
fn query_params_are_decoded() {
    let uri = "/api/v1/namespaces/n/secrets?fieldSelector=metadata.name%3Da&watch=true";
    assert_eq!(
        query_param(uri, "fieldSelector").as_deref(),
        Some("metadata.name=a")
    );
    assert_eq!(query_param(uri, "watch").as_deref(), Some("true"));
    assert_eq!(query_param("/api/v1/secrets", "fieldSelector"), None);
}

#[tokio::test]
async fn the_manager_reads_only_the_secrets_its_connections_name() {
    let plane = plane().await;
    let ns = plane.create_namespace("secrets").await.unwrap();
    let other = plane.create_namespace("secrets-other").await.unwrap();
    let admin = plane.client().await.unwrap();
    let identity = manager_identity(plane, &ns, false).await;

    // Three Secrets, in place before the manager starts; the connection names only the first.
    create(&admin, &ns, &secret(NAMED, &[("token", "token-1")])).await;
    create(
        &admin,
        &ns,
        &secret(UNNAMED_SAME_NS, &[("token", "not-for-the-operator")]),
    )
    .await;
    create(
        &admin,
        &other,
        &secret(UNNAMED_OTHER_NS, &[("token", "not-for-the-operator")]),
    )
    .await;
    create(
        &admin,
        &ns,
        &service("web", serde_json::json!([{"name": "http", "port": 80}])),
    )
    .await;
    create(
        &admin,
        &ns,
        &connection(
            "default",
            serde_json::json!({
        "engine": "127.0.0.1:7443", "tokenSecretRef": {"name": NAMED, "key": "token"}}),
        ),
    )
    .await;
    create(
        &admin,
        &ns,
        &tunnel(
            "web",
            serde_json::json!({"target": {"service": {"name": "web", "port": "http"}}}),
        ),
    )
    .await;

    let (stop, _) =
        start_manager_scoped(plane.client_as(&identity).await.unwrap(), None, None).await;
    let tunnels: Api<rstream_operator::api::RstreamTunnel> = Api::namespaced(admin.clone(), &ns);
    let t = wait_condition(
        &tunnels,
        "web",
        "Ready",
        "False",
        "WaitingForDeployment",
        WAIT,
    )
    .await;
    let base = rstream_operator::names::base_name(&ns, "web", t.metadata.uid.as_deref());
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), &ns);
    let first_hash = config_hash(&deployments.get(&base).await.unwrap());
    assert!(!first_hash.is_empty());

    // Rotating the named Secret rolls the agent: only its own watch can tell the manager (no
    // resync for 300 s, the Deployment does not change by itself here).
    Api::<Secret>::namespaced(admin.clone(), &ns)
        .replace(
            NAMED,
            &PostParams::default(),
            &secret(NAMED, &[("token", "token-2")]),
        )
        .await
        .unwrap();
    wait_for("a new config hash after the rotation", WAIT, || async {
        let h = config_hash(&deployments.get(&base).await.ok()?);
        (h != first_hash && !h.is_empty()).then_some(())
    })
    .await;
    stop.cancel();

    let user = sa_user(&ns, MANAGER_SA);
    let requests = plane.requests_by(&user).await.unwrap();
    let on_secrets: Vec<_> = requests
        .iter()
        .filter(|e| {
            e.object_ref
                .as_ref()
                .is_some_and(|r| r.resource == "secrets")
        })
        .collect();
    let mut named_reads = 0;
    let mut named_watches = 0;
    for e in &on_secrets {
        let what = format!("{} {}", e.verb, e.request_uri);
        for unnamed in [UNNAMED_SAME_NS, UNNAMED_OTHER_NS] {
            assert!(
                !e.request_uri.contains(unnamed)
                    && e.object_ref.as_ref().unwrap().name.as_deref() != Some(unnamed),
                "the manager named a Secret no connection names: {what}"
            );
        }
        match e.verb.as_str() {
            "get" => {
                assert!(
                    e.request_uri
                        .starts_with(&format!("/api/v1/namespaces/{ns}/secrets/{NAMED}")),
                    "{what}"
                );
                named_reads += 1;
            }
            "list" | "watch" => {
                assert_eq!(
                    query_param(&e.request_uri, "fieldSelector").as_deref(),
                    Some(format!("metadata.name={NAMED}").as_str()),
                    "a list or watch of Secrets not narrowed to the named one: {what}"
                );
                assert!(
                    e.request_uri
                        .starts_with(&format!("/api/v1/namespaces/{ns}/secrets?")),
                    "{what}"
                );
                named_watches += 1;
            }
            _ => panic!("the manager did more than read Secrets: {what}"),
        }
    }
    assert!(
        named_reads > 0 && named_watches > 0,
        "the named Secret was read {named_reads} times and watched {named_watches} times: {on_secrets:?}"
    );
}
