//! CoreDNS as the cluster's `kube-dns` Service, as every distribution runs it: a Deployment in
//! `kube-system` reading Services and EndpointSlices, behind the ClusterIP that kubelet writes into
//! every Pod's `resolv.conf`. It answers `cluster.local` and reverse zones only: this cluster has no
//! outside world to forward to.

use serde_json::{Value, json};

use super::COREDNS_IMAGE;
use super::network::DNS_SERVICE_IP;

const COREFILE: &str = r#".:1053 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }
    cache 5
    reload
}
"#;

/// The objects, in the order they are applied.
pub(super) fn objects() -> Vec<Value> {
    let labels = json!({ "k8s-app": "kube-dns" });
    vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": "coredns", "namespace": "kube-system" },
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": { "name": "system:coredns" },
            "rules": [
                { "apiGroups": [""], "resources": ["services", "pods", "namespaces"], "verbs": ["list", "watch"] },
                { "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"] },
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": { "name": "system:coredns" },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns" },
            "subjects": [{ "kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system" }],
        }),
        json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": { "name": "coredns", "namespace": "kube-system" },
            "data": { "Corefile": COREFILE },
        }),
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": { "name": "coredns", "namespace": "kube-system", "labels": labels },
            "spec": {
                "replicas": 1,
                "selector": { "matchLabels": labels },
                "template": {
                    "metadata": { "labels": labels },
                    "spec": {
                        "serviceAccountName": "coredns",
                        "dnsPolicy": "Default",
                        "priorityClassName": "system-cluster-critical",
                        "securityContext": super::check::restricted_pod_security(),
                        "containers": [{
                            "name": "coredns",
                            "image": COREDNS_IMAGE,
                            "imagePullPolicy": "Never",
                            "args": ["-conf", "/etc/coredns/Corefile"],
                            "ports": [
                                { "name": "dns", "containerPort": 1053, "protocol": "UDP" },
                                { "name": "dns-tcp", "containerPort": 1053, "protocol": "TCP" },
                            ],
                            "readinessProbe": { "httpGet": { "path": "/ready", "port": 8181 }, "periodSeconds": 2 },
                            "livenessProbe": { "httpGet": { "path": "/health", "port": 8080 }, "periodSeconds": 10 },
                            "securityContext": super::check::restricted_container_security(),
                            "volumeMounts": [{ "name": "config", "mountPath": "/etc/coredns", "readOnly": true }],
                        }],
                        "volumes": [{ "name": "config", "configMap": { "name": "coredns" } }],
                    },
                },
            },
        }),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": { "name": "kube-dns", "namespace": "kube-system", "labels": labels },
            "spec": {
                "selector": labels,
                "clusterIP": DNS_SERVICE_IP.to_string(),
                "ports": [
                    { "name": "dns", "port": 53, "targetPort": 1053, "protocol": "UDP" },
                    { "name": "dns-tcp", "port": 53, "targetPort": 1053, "protocol": "TCP" },
                ],
            },
        }),
    ]
}
