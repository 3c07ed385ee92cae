//! `k8s_reconcile::auth` against the real kube-apiserver: real ServiceAccount tokens, real RBAC.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use http::HeaderMap;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_reconcile::auth::{AuthError, Authenticator, ResourceAccess};
use kube::api::{Api, PostParams};
use netkit_testenv::{ControlPlane, Identity};

fn bearer(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let value = format!("Bearer {token}");
    headers.insert(http::header::AUTHORIZATION, value.parse().unwrap());
    headers
}

/// A ServiceAccount `name` in `ns` that may `get` Services and nothing else, and its token.
async fn service_reader(plane: &ControlPlane, ns: &str, name: &str) -> String {
    // Creates the ServiceAccount.
    plane
        .client_as(&Identity::service_account(ns, name))
        .await
        .unwrap();
    let admin = plane.client().await.unwrap();
    let role = Role {
        metadata: kube::api::ObjectMeta {
            name: Some("service-reader".to_owned()),
            ..Default::default()
        },
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["services".to_owned()]),
            verbs: vec!["get".to_owned()],
            ..Default::default()
        }]),
    };
    Api::<Role>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some("service-reader".to_owned()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".to_owned()),
            kind: "Role".to_owned(),
            name: "service-reader".to_owned(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: name.to_owned(),
            namespace: Some(ns.to_owned()),
            ..Default::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(admin.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    Api::<ServiceAccount>::namespaced(admin, ns)
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

#[tokio::test]
async fn a_service_account_token_is_authenticated_and_its_rbac_applied() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("auth").await.unwrap();
    let token = service_reader(plane, &ns, "reader").await;
    let auth = Authenticator::new(plane.client().await.unwrap());

    let caller = auth.authenticate(&bearer(&token)).await.unwrap();
    assert_eq!(
        caller.username(),
        format!("system:serviceaccount:{ns}:reader")
    );
    assert!(
        caller
            .groups()
            .iter()
            .any(|g| g == "system:serviceaccounts")
    );
    assert!(!caller.is_unchecked());
    // A second request within the cache's lifetime gets the same answer.
    assert_eq!(auth.authenticate(&bearer(&token)).await.unwrap(), caller);

    let get = ResourceAccess::new("get", "services", &ns).name("web");
    assert!(auth.allowed(&caller, &get).await.unwrap());
    auth.authorize(&caller, &get).await.unwrap();

    let portforward = ResourceAccess::new("create", "pods", &ns)
        .subresource("portforward")
        .name("web-0");
    assert!(!auth.allowed(&caller, &portforward).await.unwrap());
    let refused = auth.authorize(&caller, &portforward).await.unwrap_err();
    assert_eq!(
        refused.to_string(),
        format!(
            "system:serviceaccount:{ns}:reader may not create pods/portforward \"web-0\" in namespace \"{ns}\""
        )
    );
    assert!(matches!(refused, AuthError::Forbidden { .. }));

    // Another namespace is not covered by the Role.
    let elsewhere = ResourceAccess::new("get", "services", "default");
    assert!(!auth.allowed(&caller, &elsewhere).await.unwrap());
}

#[tokio::test]
async fn bad_or_missing_tokens_are_refused() {
    let plane = ControlPlane::shared().await.unwrap();
    let auth = Authenticator::new(plane.client().await.unwrap());
    let err = auth.authenticate(&HeaderMap::new()).await.unwrap_err();
    assert!(matches!(err, AuthError::MissingToken), "{err:?}");
    let mut basic = HeaderMap::new();
    basic.insert(http::header::AUTHORIZATION, "Basic YTpi".parse().unwrap());
    let err = auth.authenticate(&basic).await.unwrap_err();
    assert!(matches!(err, AuthError::MalformedHeader), "{err:?}");
    let err = auth.authenticate(&bearer("not-a-token")).await.unwrap_err();
    assert!(matches!(err, AuthError::InvalidToken(_)), "{err:?}");
    assert!(
        err.to_string()
            .starts_with("the token was not accepted by the Kubernetes API server"),
        "{err}"
    );
}

#[tokio::test]
async fn a_client_that_may_not_review_makes_checks_unavailable() {
    let plane = ControlPlane::shared().await.unwrap();
    let ns = plane.create_namespace("auth-unavailable").await.unwrap();
    let token = service_reader(plane, &ns, "reader").await;
    // The reader itself may not create TokenReviews.
    let weak = plane
        .client_as(&Identity::service_account(&ns, "reader"))
        .await
        .unwrap();
    let auth = Authenticator::new(weak);
    let err = auth.authenticate(&bearer(&token)).await.unwrap_err();
    assert!(matches!(err, AuthError::Unavailable(_)), "{err:?}");
    // The API server's refusal is the source, for a caller to inspect.
    let source = std::error::Error::source(&err)
        .and_then(|e| e.downcast_ref::<kube::Error>())
        .expect("the kube error is the source");
    assert!(
        matches!(source, kube::Error::Api(status) if status.code == 403),
        "{source:?}"
    );
}
