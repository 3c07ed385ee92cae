//! The API's gate: authentication, authorization, and refusal of malformed requests.

use serde_json::{Value, json};

use crate::support::{Env, Proxier, greeting, port_forward_rule, request};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_are_authenticated_and_authorized_like_port_forward() {
    let env = Env::new("auth", 2).await;
    let (ns, other) = (env.targets[0].clone(), env.targets[1].clone());
    env.pod_with_backend(&ns, "web", "127.0.0.21", "auth-pod")
        .await;
    let px = Proxier::start(&env, &["--enable-v1"]).await;
    let body = json!({"pod_name": format!("{ns}/web"), "time": 30});

    // No token: 401 with a hint, and a WWW-Authenticate challenge.
    let (status, reply) = px
        .call("POST", "/api/v1/mapping", None, Some(body.clone()))
        .await;
    assert_eq!(
        (status, reply["code"].clone()),
        (401, json!(40001)),
        "{reply}"
    );
    assert!(reply["msg"].as_str().unwrap().contains("Bearer"));
    // A token the API server does not know: 401.
    let (status, _) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some("not-a-token"),
            Some(body.clone()),
        )
        .await;
    assert_eq!(status, 401);
    // A ServiceAccount without rights: 403, naming what is missing.
    let nobody = env.caller(&ns, "nobody", vec![]).await;
    let (status, reply) = px
        .call("POST", "/api/v1/mapping", Some(&nobody), Some(body.clone()))
        .await;
    assert_eq!(
        (status, reply["code"].clone()),
        (403, json!(40003)),
        "{reply}"
    );
    assert!(
        reply["msg"].as_str().unwrap().contains("pods/portforward"),
        "{reply}"
    );
    // Rights in another namespace do not count.
    let elsewhere = env
        .caller(&other, "elsewhere", vec![port_forward_rule()])
        .await;
    let (status, _) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&elsewhere),
            Some(body.clone()),
        )
        .await;
    assert_eq!(status, 403);
    // Nothing was mapped by the refused calls.
    assert_eq!(greeting(px.entry).await, None);
    // With `create pods/portforward` in the pod's namespace: 200 and traffic.
    let debugger = env.debugger(&ns).await;
    let (status, reply) = px
        .call(
            "POST",
            "/api/v1/mapping",
            Some(&debugger),
            Some(body.clone()),
        )
        .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(greeting(px.entry).await.as_deref(), Some("auth-pod"));
    assert!(
        reply["data"]["requested_by"]
            .as_str()
            .unwrap()
            .ends_with(":debugger")
    );
    // Listing shows the mapping only to callers who may port-forward to it.
    let (_, listed) = px
        .call("GET", "/api/v1/mappings", Some(&debugger), None)
        .await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 1);
    let (_, listed) = px
        .call("GET", "/api/v1/mappings", Some(&nobody), None)
        .await;
    assert_eq!(listed["data"].as_array().unwrap().len(), 0);
    px.assert_never_forbidden().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_get_clear_4xx_and_change_nothing() {
    let env = Env::new("bad", 1).await;
    let ns = env.targets[0].clone();
    env.pod(&ns, "no-ip", "", None).await;
    env.pod_with_backend(&ns, "web", "127.0.0.22", "bad-pod")
        .await;
    let px = Proxier::start(&env, &["--enable-v1", "--max-body-bytes", "4096"]).await;
    let token = env.debugger(&ns).await;
    let pod = format!("{ns}/web");
    let json_ct = Some("application/json");
    let form_ct = Some("application/x-www-form-urlencoded");
    let big = format!(
        "{{\"pod_name\":\"{pod}\",\"time\":60,\"pad\":\"{}\"}}",
        "x".repeat(20_000)
    );
    let long_name = format!("{ns}/{}", "a".repeat(300));
    let bad_utf8: Vec<u8> = vec![b'{', 0xff, 0xfe, b'}'];
    type Case = (
        &'static str,
        String,
        Option<&'static str>,
        Vec<u8>,
        u16,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            b"{".to_vec(),
            400,
            "not valid JSON",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            b"[]".to_vec(),
            400,
            "JSON object",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            b"\"x\"".to_vec(),
            400,
            "JSON object",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            b"null".to_vec(),
            400,
            "JSON object",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            b"{}".to_vec(),
            400,
            "pod_name is required",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            br#"{"pod_name":5}"#.to_vec(),
            400,
            "must be a string",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            br#"{"pod_name":"nopod"}"#.to_vec(),
            400,
            "<namespace>/<pod>",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            br#"{"pod_name":"/x"}"#.to_vec(),
            400,
            "namespace",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{ns}/"}}"#).into_bytes(),
            400,
            "pod name",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            br#"{"pod_name":"NS/x"}"#.to_vec(),
            400,
            "lowercase",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{ns}/a/b"}}"#).into_bytes(),
            400,
            "pod name",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{long_name}"}}"#).into_bytes(),
            400,
            "at most 253",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":-1}}"#).into_bytes(),
            400,
            "at least 1 second",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":0}}"#).into_bytes(),
            400,
            "at least 1 second",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":1.5}}"#).into_bytes(),
            400,
            "whole number",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":"60"}}"#).into_bytes(),
            400,
            "number of seconds",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":true}}"#).into_bytes(),
            400,
            "number of seconds",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":1e30}}"#).into_bytes(),
            400,
            "max-mapping-time",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":99999999999999999999}}"#).into_bytes(),
            400,
            "max-mapping-time",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","time":10801}}"#).into_bytes(),
            400,
            "max-mapping-time 10800",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","ttl":60}}"#).into_bytes(),
            400,
            "unknown field",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{pod}","close_connections":"yes"}}"#).into_bytes(),
            400,
            "true or false",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            bad_utf8,
            400,
            "not valid JSON",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{ns}/ghost"}}"#).into_bytes(),
            404,
            "not found",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            format!(r#"{{"pod_name":"{ns}/no-ip"}}"#).into_bytes(),
            409,
            "no IP",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            br#"{"pod_name":"kube-system/etcd"}"#.to_vec(),
            403,
            "not served",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            json_ct,
            big.into_bytes(),
            413,
            "larger than 4096",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            Some("text/plain"),
            b"pod_name=x/y".to_vec(),
            415,
            "Content-Type",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            form_ct,
            format!("pod_name={pod}&time=abc").into_bytes(),
            400,
            "whole number",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            form_ct,
            format!("pod_name={pod}&pod_name={pod}").into_bytes(),
            400,
            "more than once",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            form_ct,
            format!("pod_name={pod}&time=-3").into_bytes(),
            400,
            "at least 1 second",
        ),
        (
            "POST",
            format!("/api/v1/mapping?pod_name={pod}"),
            json_ct,
            format!(r#"{{"pod_name":"{pod}"}}"#).into_bytes(),
            400,
            "not both",
        ),
        (
            "POST",
            "/api/v1/mapping".into(),
            None,
            Vec::new(),
            400,
            "pod_name is required",
        ),
        (
            "GET",
            "/api/v1/mapping".into(),
            None,
            Vec::new(),
            400,
            "pod_name is required",
        ),
        (
            "GET",
            "/api/v1/mapping?pod_name=%zz".into(),
            None,
            Vec::new(),
            400,
            "<namespace>/<pod>",
        ),
        (
            "GET",
            format!("/api/v1/mapping?pod_name={pod}&x=1"),
            None,
            Vec::new(),
            400,
            "unknown query parameter",
        ),
        (
            "DELETE",
            format!("/api/v1/mapping?pod_name={pod}"),
            None,
            Vec::new(),
            404,
            "not mapped",
        ),
        (
            "DELETE",
            format!("/api/v1/mapping?pod_name={pod}&close_connections=maybe"),
            None,
            Vec::new(),
            400,
            "true or false",
        ),
        (
            "GET",
            "/api/v2/mappings".into(),
            None,
            Vec::new(),
            404,
            "V2 is disabled",
        ),
        (
            "PUT",
            "/api/v1/mapping".into(),
            json_ct,
            b"{}".to_vec(),
            405,
            "not allowed",
        ),
        (
            "GET",
            "/api/v3/anything".into(),
            None,
            Vec::new(),
            404,
            "no such endpoint",
        ),
    ];
    assert!(cases.len() >= 30);
    for (method, path, content_type, body, expected, needle) in &cases {
        let (status, reply) =
            request(px.api, method, path, Some(&token), *content_type, body).await;
        let case = format!(
            "{method} {path} {:?}",
            String::from_utf8_lossy(&body[..body.len().min(80)])
        );
        assert_eq!(status, *expected, "{case}: {reply}");
        let msg = reply["msg"]
            .as_str()
            .unwrap_or_else(|| panic!("{case}: no envelope: {reply}"));
        assert!(
            reply["code"].as_i64().is_some_and(|c| c != 10000),
            "{case}: {reply}"
        );
        assert!(msg.contains(needle), "{case}: {msg:?} lacks {needle:?}");
    }
    // Nothing changed: no PortMapping, the entry port still refuses, the process is alive.
    assert!(
        env.mappings()
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert_eq!(greeting(px.entry).await, None);
    let (status, reply) = px.call("GET", "/health", None, None).await;
    assert_eq!((status, reply["data"].clone()), (200, Value::from("pong")));
    assert!(!px.logs().contains("panicked"));
    px.assert_never_forbidden().await;
}

/// The "never forbidden" check can fail: a namespace allowed by flag but not bound by RBAC makes
/// the API server refuse pod-proxier's V2 watches there, and the audit log shows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_the_binary_lacks_shows_in_the_audit_log() {
    let env = Env::new("unbound", 1).await;
    let unbound = env.plane.create_namespace("unbound-x").await.unwrap();
    let px = Proxier::start(&env, &["--enable-v2", "--allowed-namespaces", &unbound]).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    // The Service and EndpointSlice watches start together; either may be refused first.
    let services_refused = |f: &[String]| {
        f.iter()
            .any(|r| r.contains(&unbound) && r.contains("services"))
    };
    let forbidden = loop {
        let forbidden = px.forbidden().await;
        if services_refused(&forbidden) || std::time::Instant::now() > deadline {
            break forbidden;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(services_refused(&forbidden), "{forbidden:?}");
}
