//! The CRDs against a real kube-apiserver (one per test binary): the generated files, schema
//! and CEL validation with the rules' messages, the schema defaults and the samples.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::ApiResource;
use rstream_operator::api::{RstreamConnection, RstreamTunnel};

#[test]
fn crd_files_are_what_crds_serializes_to() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let bless = std::env::var("RSTREAM_OPERATOR_BLESS").is_ok_and(|v| v == "1");
    let files = rstream_operator::crd_files().unwrap();
    assert_eq!(files.len(), 2);
    for sub in rstream_operator::CRD_DIRS {
        for (name, yaml) in &files {
            let path = dir.join(sub).join(name);
            if bless {
                std::fs::write(&path, yaml).unwrap();
            }
            let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                &on_disk == yaml,
                "{} is stale; regenerate it (RSTREAM_OPERATOR_BLESS=1 cargo test -p rstream-operator crd_files)",
                path.display()
            );
        }
    }
}

/// The CRDs' objects as dynamic objects, so invalid ones reach the API server unchanged.
struct CrdApis {
    conns: Api<DynamicObject>,
    tuns: Api<DynamicObject>,
}

async fn crd_apis(prefix: &str) -> CrdApis {
    let plane = plane().await;
    let ns = plane.create_namespace(prefix).await.unwrap();
    let client = plane.client().await.unwrap();
    CrdApis {
        conns: Api::namespaced_with(
            client.clone(),
            &ns,
            &ApiResource::erase::<RstreamConnection>(&()),
        ),
        tuns: Api::namespaced_with(client, &ns, &ApiResource::erase::<RstreamTunnel>(&())),
    }
}

fn object(kind: &str, name: &str, spec: serde_json::Value) -> DynamicObject {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "tunnels.rstream.io/v1alpha1", "kind": kind,
        "metadata": {"name": name}, "spec": spec,
    }))
    .unwrap()
}

/// Invalid specs, each with the kind and the part of the message that names its rule.
fn invalid_specs() -> Vec<(&'static str, serde_json::Value, &'static str)> {
    let token = serde_json::json!({"name": "creds", "key": "token"});
    let target = serde_json::json!({"service": {"name": "web", "port": "http"}});
    vec![
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443"}),
            "exactly one of tokenSecretRef or mtls",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "mtls": {"certSecretRef": token, "keySecretRef": token}}),
            "exactly one of tokenSecretRef or mtls",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"tokenSecretRef": token}),
            "exactly one of projectEndpoint, projectID or engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "projectEndpoint": "p", "tokenSecretRef": token}),
            "exactly one of projectEndpoint, projectID or engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"projectEndpoint": "p",
            "mtls": {"certSecretRef": token, "keySecretRef": token}}),
            "need tokenSecretRef",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "region": "eu", "tokenSecretRef": token}),
            "region cannot be combined with engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "controlPlaneHeaders": [{"name": "x-team", "valueSecretRef": token}]}),
            "controlPlaneHeaders cannot be combined with engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"projectEndpoint": "p", "region": "-bad-", "tokenSecretRef": token}),
            "spec.region",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "", "tokenSecretRef": token}),
            "spec.engine",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "transport": {"heartbeatIntervalSeconds": 0}}),
            "spec.transport.heartbeatIntervalSeconds",
        ),
        (
            "RstreamConnection",
            serde_json::json!({"engine": "e:443", "tokenSecretRef": token,
            "transport": {"heartbeatIntervalSeconds": 301}}),
            "spec.transport.heartbeatIntervalSeconds",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "tcpPort": 10042}),
            "tcpPort requires protocol tcp",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "publish": false}),
            "protocol tcp requires publish",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "type": "datagram"}),
            "protocol tcp requires type bytestream",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "hostname": "a.example.com"}),
            "protocol tcp forbids hostname",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "tls": {"mode": "terminated"}}),
            "forbids the http and tls blocks",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tls", "http": {"version": "h2c"}}),
            "the http block requires protocol http",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "ftp"}),
            "spec.protocol",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "protocol": "tcp", "tcpPort": 70000}),
            "spec.tcpPort",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": {"service": {"name": "", "port": 80}}}),
            "spec.target.service.name",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"protocol": "http"}),
            "spec.target",
        ),
        (
            "RstreamTunnel",
            serde_json::json!({"target": target, "agent": {"replicas": 0}}),
            "spec.agent.replicas",
        ),
    ]
}

/// Creates every invalid spec of `kind` and checks the API server refuses it, naming the rule.
async fn assert_invalid_specs_rejected(kind: &str) {
    let apis = crd_apis("cel").await;
    let api = if kind == "RstreamConnection" {
        &apis.conns
    } else {
        &apis.tuns
    };
    let cases: Vec<_> = invalid_specs()
        .into_iter()
        .filter(|(k, _, _)| *k == kind)
        .collect();
    assert!(cases.len() >= 5, "{kind}: {} cases", cases.len());
    for (i, (kind, spec, expected)) in cases.into_iter().enumerate() {
        let err = api
            .create(
                &PostParams::default(),
                &object(kind, &format!("bad-{i}"), spec.clone()),
            )
            .await
            .expect_err(&format!("case {i} ({kind} {spec}) was accepted"));
        let kube::Error::Api(status) = err else {
            panic!("case {i}: unexpected error {err}");
        };
        assert_eq!(status.code, 422, "case {i}: {status:?}");
        assert!(
            status.message.contains(expected),
            "case {i} ({spec}): message {:?} does not name {expected:?}",
            status.message
        );
    }
}

#[tokio::test]
async fn invalid_connections_are_rejected_by_the_api_server_with_the_rule() {
    assert_invalid_specs_rejected("RstreamConnection").await;
}

#[tokio::test]
async fn invalid_tunnels_are_rejected_by_the_api_server_with_the_rule() {
    assert_invalid_specs_rejected("RstreamTunnel").await;
}

#[tokio::test]
async fn valid_objects_pass_with_the_schema_defaults() {
    let CrdApis { conns, tuns } = crd_apis("defaults").await;
    let token = serde_json::json!({"name": "creds", "key": "token"});
    let target = serde_json::json!({"service": {"name": "web", "port": "http"}});
    // Valid objects pass, with the schema defaults applied.
    let ok = conns
        .create(
            &PostParams::default(),
            &object(
                "RstreamConnection",
                "ok",
                serde_json::json!({"projectEndpoint": "p", "tokenSecretRef": token}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["apiURL"], "https://rstream.io");
    let ok = tuns
        .create(
            &PostParams::default(),
            &object(
                "RstreamTunnel",
                "ok",
                serde_json::json!({"target": target, "protocol": "tcp", "tcpPort": 10042}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["publish"], true);
    let ok = tuns
        .create(
            &PostParams::default(),
            &object(
                "RstreamTunnel",
                "web",
                serde_json::json!({"target": target, "http": {}, "agent": {}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(ok.data["spec"]["protocol"], "http");
    assert_eq!(ok.data["spec"]["http"]["version"], "http/1.1");
    // One agent holds the tunnel, one stands by.
    assert_eq!(ok.data["spec"]["agent"]["replicas"], 2);
}

#[tokio::test]
async fn samples_are_accepted_by_the_api_server() {
    let plane = plane().await;
    let ns = plane.create_namespace("samples").await.unwrap();
    let client = plane.client().await.unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/samples");
    let mut created = 0;
    for file in [
        "tunnels_v1alpha1_rstreamconnection.yaml",
        "tunnels_v1alpha1_rstreamtunnel_http.yaml",
        "tunnels_v1alpha1_rstreamtunnel_tcp.yaml",
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let mut obj: DynamicObject = serde_yaml_ng::from_str(&text).unwrap();
        obj.metadata.namespace = Some(ns.clone());
        let kind = obj.types.as_ref().unwrap().kind.clone();
        let resource = if kind == "RstreamConnection" {
            ApiResource::erase::<RstreamConnection>(&())
        } else {
            ApiResource::erase::<RstreamTunnel>(&())
        };
        Api::<DynamicObject>::namespaced_with(client.clone(), &ns, &resource)
            .create(&PostParams::default(), &obj)
            .await
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        created += 1;
    }
    assert_eq!(created, 3);
}
